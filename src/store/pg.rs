//! PostgreSQL: one session per `Store`, driven by `tokio-postgres` on a worker thread of its
//! own, with a current-thread Tokio runtime that runs only while the worker waits on a call
//! (as the synchronous `postgres` client does it). That runtime must never be entered from a
//! thread already driving one (the engine, `serve` and the MCP server call the store from
//! async code, as they call SQLite: briefly and blocking); so every call is handed to the
//! worker and its answer waited for on a channel. Statements are prepared once per session,
//! their `?N` parameters rewritten to `$N`.
//!
//! Transaction control that cannot fail on its own (a read transaction's `BEGIN`, a step's
//! `SAVEPOINT`) is held back ([`PgSession::hold`]) and goes out with the next call, in the
//! same write to the socket as its statement (pipelined): one round trip where there were
//! two. Whatever fails among them is that call's error.
//!
//! Every write transaction `NOTIFY`s [`CHANNEL`] as it commits. A store that asks how many
//! commits there were ([`PgSession::notified`], PostgreSQL's `data_version`: the engine)
//! starts a second session that `LISTEN`s, on a thread of its own blocked on the socket:
//! the synchronous client reads a notification only while one of its calls waits, so the
//! query session, idle between calls, would never see one.

use super::StoreError;
use super::sql::Val;
use postgres::fallible_iterator::FallibleIterator as _;
use postgres::types::{FromSql, IsNull, ToSql, Type, to_sql_checked};
use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak, mpsc};
use std::time::Duration;
use tokio_postgres::{Client, NoTls, Statement};

/// The channel write transactions notify.
pub const CHANNEL: &str = "handoffs";

/// Whether `db` names a PostgreSQL database rather than a SQLite file.
pub fn is_url(db: &std::path::Path) -> bool {
    db.to_str()
        .is_some_and(|s| s.starts_with("postgres://") || s.starts_with("postgresql://"))
}

/// Whether `db`, when it is a PostgreSQL URL, is one the driver takes: `Err` says what is
/// wrong with it (its password left out), a usage error rather than a failed connection.
pub fn check_url(db: &std::path::Path) -> Result<(), String> {
    if !is_url(db) {
        return Ok(());
    }
    let text = db.to_string_lossy();
    settings(&text).map(|_| ()).map_err(|why| {
        format!(
            "--db (or HANDOFFS_DB) is not a PostgreSQL URL the driver takes: {} ({why})",
            redacted(&text)
        )
    })
}

/// The files a TLS session reads, named by libpq's parameters: the certificates it trusts
/// instead of the system's (`sslrootcert`), and the client certificate (`sslcert`, a PEM chain)
/// with its private key (`sslkey`, PEM, unencrypted) it proves its user with, for a server
/// whose `pg_hba.conf` says `cert` (or `clientcert=verify-full`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct TlsFiles {
    root: Option<std::path::PathBuf>,
    cert: Option<std::path::PathBuf>,
    key: Option<std::path::PathBuf>,
}

/// What a URL asks of a session: the driver's settings, and the files its TLS reads
/// ([`TlsFiles`]). The driver knows `sslmode` `disable`, `prefer` and `require` only, and none
/// of `sslrootcert`, `sslcert`, `sslkey`: they are taken out of the query here, every other
/// parameter kept byte for byte (the driver decodes `%XX` itself), and since every TLS session
/// of ours checks the server's certificate, `verify-ca` and `verify-full` are `require`. With no
/// `sslmode` a session is not encrypted, as before TLS was supported (a server with a
/// certificate nobody trusts, Debian's default, stays reachable): add `sslmode=require` for
/// TLS. A client certificate comes with its key, and only over TLS: `sslcert` without
/// `sslkey` (or the reverse), or either without an `sslmode` that encrypts, is refused here
/// rather than left for the server to turn away with a less telling message. libpq's default
/// files (`~/.postgresql/postgresql.crt`) are not read: a certificate is named or not used.
fn settings(url: &str) -> Result<(tokio_postgres::Config, TlsFiles), String> {
    let decoded = |raw: &str| {
        percent_encoding::percent_decode_str(raw)
            .decode_utf8()
            .map(std::borrow::Cow::into_owned)
            .map_err(|e| format!("{raw}: {e}"))
    };
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let (mut files, mut mode) = (TlsFiles::default(), None);
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match decoded(key)?.as_str() {
            "sslrootcert" => files.root = Some(std::path::PathBuf::from(decoded(value)?)),
            "sslcert" => files.cert = Some(std::path::PathBuf::from(decoded(value)?)),
            "sslkey" => files.key = Some(std::path::PathBuf::from(decoded(value)?)),
            "sslmode" => mode = Some(decoded(value)?),
            _ => kept.push(pair),
        }
    }
    let rest = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    let described = |e: postgres::Error| {
        std::error::Error::source(&e).map_or_else(|| e.to_string(), ToString::to_string)
    };
    let mut config: tokio_postgres::Config = rest.parse().map_err(described)?;
    config.ssl_mode(match mode.as_deref() {
        None | Some("disable") => postgres::config::SslMode::Disable,
        Some("prefer") => postgres::config::SslMode::Prefer,
        Some("require" | "verify-ca" | "verify-full") => postgres::config::SslMode::Require,
        Some(other) => {
            return Err(format!(
                "sslmode {other} is not one of disable, prefer, require, verify-ca, verify-full"
            ));
        }
    });
    // A local socket carries no TLS (libpq ignores sslmode there too).
    let sockets_only = !config.get_hosts().is_empty()
        && config
            .get_hosts()
            .iter()
            .all(|h| matches!(h, postgres::config::Host::Unix(_)));
    if sockets_only {
        config.ssl_mode(postgres::config::SslMode::Disable);
    }
    match (&files.cert, &files.key) {
        (Some(_), None) => return Err("sslcert needs sslkey, the file of its private key".into()),
        (None, Some(_)) => return Err("sslkey needs sslcert, the file of its certificate".into()),
        (Some(_), Some(_))
            if !matches!(
                mode.as_deref(),
                Some("require" | "verify-ca" | "verify-full")
            ) =>
        {
            return Err(
                "sslcert and sslkey need sslmode=require (or verify-ca, verify-full): a client certificate is only shown over TLS".into(),
            );
        }
        _ => {}
    }
    Ok((config, files))
}

/// The TLS side of a session: rustls with the aws-lc-rs provider serve's HTTPS uses, trusting
/// the certificates of `files.root` (`sslrootcert`) alone when given, as libpq does, else the
/// system's roots; showing the client certificate of `files` when it names one.
fn tls(files: &TlsFiles) -> Result<tokio_postgres_rustls::MakeRustlsConnect, PgFailure> {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::{CertificateDer, pem::PemObject};
    let root = files.root.as_deref();
    let failure = |detail: String| PgFailure {
        code: None,
        closed: false,
        message: detail,
    };
    let mut roots = rustls::RootCertStore::empty();
    if let Some(path) = root {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .and_then(Iterator::collect)
            .map_err(|e| failure(format!("sslrootcert {}: {e}", path.display())))?;
        if certs.is_empty() {
            return Err(failure(format!(
                "sslrootcert {}: no certificate in it",
                path.display()
            )));
        }
        for cert in certs {
            roots
                .add(cert)
                .map_err(|e| failure(format!("sslrootcert {}: {e}", path.display())))?;
        }
    } else {
        // The system's roots, read once a process.
        static NATIVE: std::sync::OnceLock<Vec<CertificateDer<'static>>> =
            std::sync::OnceLock::new();
        roots.add_parsable_certificates(
            NATIVE
                .get_or_init(|| rustls_native_certs::load_native_certs().certs)
                .iter()
                .cloned(),
        );
    }
    let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| failure(e.to_string()))?
        .with_root_certificates(roots);
    let config = match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => {
            let (chain, key_der) = client_identity(cert, key).map_err(failure)?;
            let signer = provider
                .key_provider
                .load_private_key(key_der)
                .map_err(|e| failure(format!("sslkey {}: {e}", key.display())))?;
            let certified = rustls::sign::CertifiedKey::new(chain, signer);
            // rustls's own `with_client_auth_cert` refuses a certificate webpki cannot read,
            // an X.509 v1 one (`openssl x509 -req` without extensions makes them) among
            // them; libpq shows it, and the server is the one to judge it. A key that is
            // not the certificate's is refused here, by name.
            if let Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) =
                certified.keys_match()
            {
                return Err(failure(format!(
                    "sslkey {} is not the private key of the certificate in sslcert {}",
                    key.display(),
                    cert.display()
                )));
            }
            builder.with_client_cert_resolver(std::sync::Arc::new(
                rustls::sign::SingleCertAndKey::from(certified),
            ))
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

/// The client certificate chain in `cert` and its private key in `key` (both PEM). Like
/// libpq, a key file that its owner lets the group or others read is refused: whoever reads
/// it can log in as the certificate's user.
fn client_identity(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<
    (
        Vec<tokio_rustls::rustls::pki_types::CertificateDer<'static>>,
        tokio_rustls::rustls::pki_types::PrivateKeyDer<'static>,
    ),
    String,
> {
    use std::os::unix::fs::MetadataExt;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(Iterator::collect)
        .map_err(|e| format!("sslcert {}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("sslcert {}: no certificate in it", cert.display()));
    }
    let meta = std::fs::metadata(key).map_err(|e| format!("sslkey {}: {e}", key.display()))?;
    if meta.mode() & 0o077 != 0 && meta.uid() == nix::unistd::geteuid().as_raw() {
        return Err(format!(
            "sslkey {}: its group or others may read it (mode {:o}); make it 0600 (chmod 600)",
            key.display(),
            meta.mode() & 0o777
        ));
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        format!(
            "sslkey {}: {e} (an unencrypted PEM private key)",
            key.display()
        )
    })?;
    Ok((chain, key_der))
}

/// `url` without its secrets, for messages and file names: the password (in the user part
/// or a `password=` parameter) shown as `***`; a URL that does not parse (several hosts,
/// say) shows as its scheme alone, so nothing unparsed ever reaches a message.
pub fn redacted(url: &str) -> String {
    let scheme = if url.starts_with("postgresql://") {
        "postgresql://"
    } else {
        "postgres://"
    };
    let Ok(mut u) = url::Url::parse(url) else {
        return format!("{scheme}…");
    };
    if u.password().is_some() && u.set_password(Some("***")).is_err() {
        return format!("{scheme}…");
    }
    if u.query_pairs()
        .any(|(k, _)| k.eq_ignore_ascii_case("password"))
    {
        let kept: Vec<(String, String)> = u
            .query_pairs()
            .map(|(k, v)| {
                let v = if k.eq_ignore_ascii_case("password") {
                    "***".to_owned()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        u.query_pairs_mut().clear().extend_pairs(kept);
    }
    u.to_string()
}

/// What names a database without anything secret: user, host, port and database, for the
/// file names of this machine's state.
pub fn identity(url: &str) -> String {
    match settings(url) {
        Ok((c, _)) => {
            let host = c
                .get_hosts()
                .iter()
                .map(|h| match h {
                    postgres::config::Host::Tcp(name) => name.clone(),
                    postgres::config::Host::Unix(path) => path.display().to_string(),
                })
                .collect::<Vec<_>>()
                .join(",");
            let port = c
                .get_ports()
                .iter()
                .map(u16::to_string)
                .collect::<Vec<_>>()
                .join(",");
            format!(
                "{}@{host}:{port}/{}",
                c.get_user().unwrap_or(""),
                c.get_dbname().unwrap_or("")
            )
        }
        Err(_) => "unparsed".to_owned(),
    }
}

/// A failure reported by PostgreSQL or its client, carried inside `rusqlite::Error` through
/// the table files (see `sql.rs`) and turned into a [`StoreError`] at the end.
#[derive(Debug)]
pub struct PgFailure {
    /// The SQLSTATE, when the server answered with one.
    pub code: Option<String>,
    /// The session is gone (the server went away, the connection broke).
    pub closed: bool,
    pub message: String,
}

impl std::fmt::Display for PgFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}
impl std::error::Error for PgFailure {}

impl PgFailure {
    fn of(e: &postgres::Error) -> PgFailure {
        let message = match (e.as_db_error(), std::error::Error::source(e)) {
            (Some(db), _) => format!("PostgreSQL: {}", db.message()),
            (None, Some(cause)) => format!("PostgreSQL: {e}: {cause}"),
            (None, None) => format!("PostgreSQL: {e}"),
        };
        PgFailure {
            code: e.code().map(|c| c.code().to_owned()),
            closed: e.is_closed(),
            message,
        }
    }

    fn gone() -> PgFailure {
        PgFailure {
            code: None,
            closed: true,
            message: "the PostgreSQL session's worker has stopped".to_owned(),
        }
    }

    pub fn into_store_error(self) -> StoreError {
        match self.code.as_deref() {
            // serialization failure, deadlock, lock not available, cancelled by lock_timeout
            Some("40001" | "40P01" | "55P03" | "57014") => StoreError::Locked,
            Some("25006") => StoreError::ReadOnly(self.message),
            _ if self.closed => StoreError::Io(format!(
                "lost the connection to PostgreSQL: {}",
                self.message
            )),
            _ => StoreError::Sqlite(self.message),
        }
    }
}

fn wrap(f: PgFailure) -> rusqlite::Error {
    if std::env::var_os("HANDOFFS_PG_DEBUG").is_some() {
        eprintln!("handoffs-pg: {}", f.message);
    }
    rusqlite::Error::ToSqlConversionFailure(Box::new(f))
}

/// The work a session's thread does: its session and prepared statements.
struct Worker {
    url: String,
    session: Session,
    statements: HashMap<String, Statement>,
    /// This session's backend process (the listener does not count its notifications).
    pid: Arc<AtomicI32>,
}

/// What the listening session has heard.
#[derive(Debug, Default)]
struct Heard {
    /// Notifications from other sessions so far (and one more each time the listener
    /// connects anew, as it may have missed some meanwhile).
    count: AtomicU64,
}

type Job = Box<dyn FnOnce(&mut Worker) + Send>;

/// Transaction control held back for the next call (see the module's notes).
#[derive(Debug, Default)]
struct Held {
    /// Statements without parameters, each followed by `;`.
    text: String,
    /// The next call begins a transaction (or runs a statement on its own): a session lost
    /// since the last transaction may be opened anew first, as `BEGIN` does.
    fresh: bool,
}

/// One PostgreSQL session (see the module's notes).
pub struct PgSession {
    jobs: mpsc::Sender<Job>,
    held: std::sync::Mutex<Held>,
    url: String,
    pid: Arc<AtomicI32>,
    /// Started by the first [`PgSession::notified`]; its thread ends soon after this drops.
    heard: OnceLock<Arc<Heard>>,
}

/// How long a session may sit idle inside a transaction before the server ends it (and rolls
/// the transaction back): a process stopped or suspended mid-transaction would otherwise hold
/// the writers' lock, and every other engine and command would wait on it for as long as it
/// stays stopped. No transaction of ours waits on anything but the server between statements.
pub const IDLE_IN_TRANSACTION_MS: u64 = 10_000;

/// What a session to `url` is opened with: its settings, with bounds on what the network may
/// take: a connect gives up after 10 s, and a session whose peer stopped answering is
/// declared dead within about half a minute (TCP keepalive and user timeout) instead of the
/// kernel's quarter of an hour, unless the URL says otherwise; and the roots its TLS trusts.
fn config(url: &str) -> Result<(tokio_postgres::Config, TlsFiles), PgFailure> {
    let (mut config, files) = settings(url).map_err(|message| PgFailure {
        code: None,
        closed: false,
        message,
    })?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(10));
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(Duration::from_secs(30));
    }
    if !url.contains("keepalives_idle") {
        config
            .keepalives_idle(Duration::from_secs(10))
            .keepalives_interval(Duration::from_secs(5))
            .keepalives_retries(3);
    }
    Ok((config, files))
}

/// What every session sets first. A session idle inside a transaction for
/// [`IDLE_IN_TRANSACTION_MS`] is ended by the server. Each commit waits for its flush
/// (`synchronous_commit`, whatever the server's default): a reservation is on disk before its
/// write goes out.
fn session_settings() -> String {
    let wait = std::env::var("HANDOFFS_BUSY_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(30_000);
    format!(
        "SET lock_timeout = {wait}; SET TIME ZONE 'UTC'; SET synchronous_commit = on; \
         SET idle_in_transaction_session_timeout = {IDLE_IN_TRANSACTION_MS};"
    )
}

/// A session through the synchronous client (the listener's: it reads notifications while
/// it waits on the socket).
fn connect_sync(url: &str) -> Result<postgres::Client, PgFailure> {
    let (config, files) = config(url)?;
    let config = postgres::Config::from(config);
    let mut client = if config.get_ssl_mode() == postgres::config::SslMode::Disable {
        config.connect(NoTls)
    } else {
        config.connect(tls(&files)?)
    }
    .map_err(|e| PgFailure::of(&e))?;
    client
        .batch_execute(&session_settings())
        .map_err(|e| PgFailure::of(&e))?;
    Ok(client)
}

/// A session of the worker: the asynchronous client, and the runtime that drives its
/// connection while the worker waits on a call.
struct Session {
    rt: tokio::runtime::Runtime,
    client: Client,
    /// The connection's task: it says goodbye to the server once the client is gone.
    connection: tokio::task::JoinHandle<()>,
    /// What the server said as it ended the session (the idle-in-transaction timeout, a
    /// shutdown), read by the connection's task while no call waited for it: the error of the
    /// call that finds the session closed, as the server's words rather than a bare "closed".
    ended: Arc<std::sync::Mutex<Option<PgFailure>>>,
    /// Statements held back failed (a step's `SAVEPOINT` among them, not made): until the
    /// next transaction begins, no undo (`ROLLBACK TO SAVEPOINT`) may run, as it would roll
    /// back to an earlier step's savepoint instead (still open while its release was held
    /// back). The step's undo fails, and with it the whole batch, which its next look
    /// reports lost.
    held_failed: std::cell::Cell<bool>,
}

impl Session {
    fn open(url: &str) -> Result<Session, PgFailure> {
        let (config, files) = config(url)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| PgFailure {
                code: None,
                closed: true,
                message: format!("cannot start the PostgreSQL session's runtime: {e}"),
            })?;
        let ended = Arc::new(std::sync::Mutex::new(None));
        let slot = ended.clone();
        let keep = move |out: Result<(), tokio_postgres::Error>| {
            if let Err(e) = out
                && e.as_db_error().is_some()
            {
                *slot
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(PgFailure::of(&e));
            }
        };
        let (client, connection) =
            if config.get_ssl_mode() == tokio_postgres::config::SslMode::Disable {
                let (client, connection) = rt
                    .block_on(config.connect(NoTls))
                    .map_err(|e| PgFailure::of(&e))?;
                (client, rt.spawn(async move { keep(connection.await) }))
            } else {
                let (client, connection) = rt
                    .block_on(config.connect(tls(&files)?))
                    .map_err(|e| PgFailure::of(&e))?;
                (client, rt.spawn(async move { keep(connection.await) }))
            };
        let session = Session {
            rt,
            client,
            connection,
            ended,
            held_failed: std::cell::Cell::new(false),
        };
        session.batch(&session_settings())?;
        Ok(session)
    }

    /// Ends the session the way a client should (the server logs no lost connection),
    /// waiting at most a second.
    fn close(self) {
        let Session {
            rt,
            client,
            connection,
            ..
        } = self;
        drop(client);
        let _ =
            rt.block_on(async { tokio::time::timeout(Duration::from_secs(1), connection).await });
    }

    /// The failure of a call: what the server said as it ended the session, when the call
    /// found it closed and the server had said something.
    fn failure(&self, e: &tokio_postgres::Error) -> PgFailure {
        let said = e.is_closed().then(|| {
            self.ended
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take()
        });
        match said.flatten() {
            Some(mut f) => {
                f.closed = true;
                f
            }
            None => PgFailure::of(e),
        }
    }

    fn batch(&self, sql: &str) -> Result<(), PgFailure> {
        self.rt
            .block_on(self.client.batch_execute(sql))
            .map_err(|e| self.failure(&e))
    }

    /// Runs `sql`; when it fails, rolls back whatever transaction it left open and failed,
    /// so the session is left outside any.
    fn batch_or_rollback(&self, sql: &str) -> Result<(), PgFailure> {
        self.batch(sql).inspect_err(|_| {
            let _ = self.batch("ROLLBACK");
        })
    }

    /// A step's undo (`ROLLBACK TO SAVEPOINT`), refused after a held statement failed.
    fn undo(&self, sql: &str) -> Result<(), PgFailure> {
        if self.held_failed.get() {
            return Err(PgFailure {
                code: None,
                closed: false,
                message: "a step's savepoint was not made: the transaction is rolled back whole"
                    .to_owned(),
            });
        }
        self.batch(sql)
    }

    /// Runs `held` on its own (before a statement still to be prepared).
    fn batch_held(&self, held: &str) -> Result<(), PgFailure> {
        self.batch(held).inspect_err(|_| self.held_failed.set(true))
    }

    fn backend_pid(&self) -> Result<i32, PgFailure> {
        self.rt
            .block_on(self.client.query_one("SELECT pg_backend_pid()", &[]))
            .and_then(|r| r.try_get(0))
            .map_err(|e| self.failure(&e))
    }

    /// `run`'s statement, after `held` (when there is any) in the same write to the socket:
    /// the server answers both in order, and a failure of `held` is the call's.
    fn pipelined<T>(
        &self,
        held: &str,
        run: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, PgFailure> {
        if held.is_empty() {
            return self.rt.block_on(run).map_err(|e| self.failure(&e));
        }
        // `join` polls the held statements first: their request is queued before `run`'s.
        let (first, then) = self.rt.block_on(futures_util::future::join(
            self.client.batch_execute(held),
            run,
        ));
        if let Err(e) = first {
            self.held_failed.set(true);
            return Err(self.failure(&e));
        }
        then.map_err(|e| self.failure(&e))
    }
}

impl std::fmt::Debug for PgSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgSession")
            .field("url", &redacted(&self.url))
            .finish_non_exhaustive()
    }
}

impl PgSession {
    /// Connects to `url` (a `postgres://` URL; TLS with `sslmode=require`, see `settings`).
    pub fn connect(url: &str) -> Result<PgSession, StoreError> {
        let (jobs, inbox) = mpsc::channel::<Job>();
        let (ready, started) = mpsc::channel::<Result<(), PgFailure>>();
        let owned = url.to_owned();
        let pid = Arc::new(AtomicI32::new(0));
        let worker_pid = pid.clone();
        std::thread::Builder::new()
            .name("handoffs-pg".to_owned())
            .spawn(move || {
                let session = match Session::open(&owned) {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                match session.backend_pid() {
                    Ok(p) => worker_pid.store(p, Ordering::SeqCst),
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                }
                let _ = ready.send(Ok(()));
                let mut worker = Worker {
                    url: owned,
                    session,
                    statements: HashMap::new(),
                    pid: worker_pid,
                };
                while let Ok(job) = inbox.recv() {
                    job(&mut worker);
                }
                worker.session.close();
            })
            .map_err(|e| StoreError::Io(format!("cannot start the PostgreSQL worker: {e}")))?;
        match started.recv() {
            Ok(Ok(())) => Ok(PgSession {
                jobs,
                held: std::sync::Mutex::default(),
                url: url.to_owned(),
                pid,
                heard: OnceLock::new(),
            }),
            Ok(Err(e)) => {
                let said = format!("cannot connect to {}: {}", redacted(url), e.message);
                // Class 28 (invalid authorization) and 3D000 (no such database): the
                // server's answer, which no wait changes. A server starting up (57P03), or
                // one turning sessions away for now (55000), may answer otherwise later.
                Err(match e.code.as_deref() {
                    Some(c) if c.starts_with("28") || c == "3D000" => StoreError::Denied(said),
                    _ => StoreError::Io(said),
                })
            }
            Err(_) => Err(StoreError::Io(
                "the PostgreSQL worker stopped while connecting".to_owned(),
            )),
        }
    }

    /// Runs `f` on the worker and waits for its answer.
    fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Worker) -> Result<R, PgFailure> + Send + 'static,
    ) -> Result<R, PgFailure> {
        let (tx, rx) = mpsc::channel();
        self.jobs
            .send(Box::new(move |w| {
                let _ = tx.send(f(w));
            }))
            .map_err(|_| PgFailure::gone())?;
        rx.recv().map_err(|_| PgFailure::gone())?
    }

    /// What is held back for the next call, taken.
    fn take_held(&self) -> Held {
        std::mem::take(
            &mut *self
                .held
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Holds `sql` (statements without parameters that cannot fail on their own: a step's
    /// `SAVEPOINT`) back to go out with the next call.
    pub fn hold(&self, sql: &str) {
        let mut held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        held.text.push_str(sql);
        held.text.push(';');
    }

    /// Holds back `sql`, which begins a transaction (a read transaction's `BEGIN`), for the
    /// next call, which may open a lost session anew first.
    pub fn begin_later(&self, sql: &str) {
        self.hold(sql);
        self.fresh();
    }

    /// The next call runs a statement on its own, outside any transaction: a lost session
    /// may be opened anew first.
    pub fn fresh(&self) {
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .fresh = true;
    }

    /// The rows of `sql` with `params`, every value read out.
    pub fn query(&self, sql: &str, params: Vec<Val>) -> rusqlite::Result<Vec<Vec<Val>>> {
        let sql = sql.to_owned();
        let held = self.take_held();
        self.call(move |w| {
            let (st, held) = w.ready(held, &sql)?;
            let refs: Vec<&(dyn ToSql + Sync)> =
                params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
            let rows = w
                .session
                .pipelined(&held, w.session.client.query(&st, &refs))?;
            rows.iter().map(decode_row).collect()
        })
        .map_err(wrap)
    }

    /// Runs `sql` with `params`; the number of rows it changed.
    pub fn execute(&self, sql: &str, params: Vec<Val>) -> rusqlite::Result<usize> {
        let sql = sql.to_owned();
        let held = self.take_held();
        self.call(move |w| {
            let (st, held) = w.ready(held, &sql)?;
            let refs: Vec<&(dyn ToSql + Sync)> =
                params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
            let n = w
                .session
                .pipelined(&held, w.session.client.execute(&st, &refs))?;
            Ok(usize::try_from(n).unwrap_or(usize::MAX))
        })
        .map_err(wrap)
    }

    /// Runs statements without parameters (transaction control, schema), after whatever
    /// is held back, in one message.
    pub fn batch(&self, sql: &str) -> Result<(), StoreError> {
        let held = self.take_held();
        let sql = sql.to_owned();
        self.call(move |w| {
            if held.fresh {
                w.reopen()?;
            }
            w.session.batch(&(held.text + &sql))
        })
        .map_err(PgFailure::into_store_error)
    }

    /// Begins a transaction with `sql`, first opening the session anew if it was lost
    /// (between transactions only: a transaction never spans two sessions).
    pub fn begin(&self, sql: &str) -> Result<(), StoreError> {
        // Nothing held back belongs to a transaction that begins now.
        let _ = self.take_held();
        let sql = sql.to_owned();
        self.call(move |w| {
            w.reopen()?;
            w.session.held_failed.set(false);
            // `BEGIN; SELECT pg_advisory_xact_lock(…)` is one message: when the lock's wait
            // times out, the transaction is open and failed. End it, or every later call
            // of this session would fail.
            w.session.batch_or_rollback(&sql)
        })
        .map_err(PgFailure::into_store_error)
    }

    /// Commits with `sql` (after whatever is held back). When that fails (a held statement,
    /// the `NOTIFY` of an aborted transaction), the transaction is rolled back, so that the
    /// session is left outside any: a statement run on its own next would fail otherwise.
    pub fn commit(&self, sql: &str) -> Result<(), StoreError> {
        let held = self.take_held();
        let sql = sql.to_owned();
        self.call(move |w| w.session.batch_or_rollback(&(held.text + &sql)))
            .map_err(PgFailure::into_store_error)
    }

    /// Rolls the open transaction back; what is held back is dropped (a held statement
    /// sent first would stop the `ROLLBACK` when it fails).
    pub fn rollback(&self) -> Result<(), StoreError> {
        let _ = self.take_held();
        self.call(|w| w.session.batch("ROLLBACK"))
            .map_err(PgFailure::into_store_error)
    }

    /// Undoes a step with `sql` (`ROLLBACK TO SAVEPOINT …`), after whatever is held back;
    /// refused once a held statement of this transaction failed (see `Session`).
    pub fn undo(&self, sql: &str) -> Result<(), StoreError> {
        let held = self.take_held();
        let sql = sql.to_owned();
        self.call(move |w| w.session.undo(&(held.text + &sql)))
            .map_err(PgFailure::into_store_error)
    }

    /// The server process of this session now (`pg_backend_pid()`; it changes when the
    /// session is opened anew).
    pub fn backend_pid(&self) -> i64 {
        i64::from(self.pid.load(Ordering::SeqCst))
    }

    /// How many commits other sessions have announced on [`CHANNEL`] since this session
    /// first asked (the first call starts the listener).
    pub fn notified(&self) -> Result<u64, StoreError> {
        let heard = self.heard.get_or_init(|| {
            let heard = Arc::new(Heard::default());
            let worker = self.pid.clone();
            listen(&self.url, Arc::downgrade(&heard), move |h, from| {
                if from.is_none_or(|pid| pid != worker.load(Ordering::SeqCst)) {
                    h.count.fetch_add(1, Ordering::SeqCst);
                }
            });
            heard
        });
        Ok(heard.count.load(Ordering::SeqCst))
    }
}

/// Listens on [`CHANNEL`] in a session of its own, on a thread blocked on its socket a
/// second at a time, until `alive` is gone: `on(alive, Some(pid))` for each commit a session
/// announced, and `on(alive, None)` each time it connects (anew after the session broke),
/// since it may have missed some meanwhile.
pub fn listen<T: Send + Sync + 'static>(
    url: &str,
    alive: Weak<T>,
    on: impl Fn(&T, Option<i32>) + Send + 'static,
) {
    let url = url.to_owned();
    let spawned = std::thread::Builder::new()
        .name("handoffs-pg-listen".to_owned())
        .spawn(move || {
            loop {
                if alive.strong_count() == 0 {
                    return;
                }
                let session = connect_sync(&url).and_then(|mut c| {
                    c.batch_execute(&format!("LISTEN {CHANNEL}"))
                        .map(|()| c)
                        .map_err(|e| PgFailure::of(&e))
                });
                let Ok(mut client) = session else {
                    std::thread::sleep(Duration::from_secs(1));
                    continue;
                };
                // Listening now: whatever was committed before may have gone unheard.
                let Some(t) = alive.upgrade() else { return };
                on(&t, None);
                drop(t);
                loop {
                    let Some(t) = alive.upgrade() else { return };
                    {
                        let mut notes = client.notifications();
                        let mut waiting = notes.timeout_iter(Duration::from_secs(1));
                        while let Ok(Some(n)) = waiting.next() {
                            on(&t, Some(n.process_id()));
                        }
                    }
                    if client.is_closed() {
                        break;
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the PostgreSQL listener");
    }
}

impl Worker {
    /// A new session in place of a lost one.
    fn reopen(&mut self) -> Result<(), PgFailure> {
        if self.session.client.is_closed() {
            self.session = Session::open(&self.url)?;
            self.pid
                .store(self.session.backend_pid()?, Ordering::SeqCst);
            self.statements.clear();
        }
        Ok(())
    }

    /// `sql` prepared, and what is held back still to send with it: a statement this
    /// session has not prepared yet is prepared after what is held went out on its own.
    fn ready(&mut self, held: Held, sql: &str) -> Result<(Statement, String), PgFailure> {
        if held.fresh {
            self.reopen()?;
        }
        if let Some(st) = self.statements.get(sql) {
            return Ok((st.clone(), held.text));
        }
        if !held.text.is_empty() {
            self.session.batch_held(&held.text)?;
        }
        Ok((self.prepare(sql)?, String::new()))
    }

    fn prepare(&mut self, sql: &str) -> Result<Statement, PgFailure> {
        if let Some(st) = self.statements.get(sql) {
            return Ok(st.clone());
        }
        let st = self
            .session
            .rt
            .block_on(self.session.client.prepare(&translate(sql)))
            .map_err(|e| {
                let mut f = PgFailure::of(&e);
                if std::env::var_os("HANDOFFS_PG_DEBUG").is_some() {
                    f.message = format!("{} in: {sql}", f.message);
                }
                f
            })?;
        self.statements.insert(sql.to_owned(), st.clone());
        Ok(st)
    }
}

/// SQLite's `?N` parameters as PostgreSQL's `$N` (outside quoted text).
pub fn translate(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut quoted = false;
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                quoted = !quoted;
                out.push(c);
            }
            '?' if !quoted && chars.peek().is_some_and(char::is_ascii_digit) => out.push('$'),
            _ => out.push(c),
        }
    }
    out
}

impl ToSql for Val {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            Val::Null => Ok(IsNull::Yes),
            Val::Int(i) => match *ty {
                Type::INT8 => i.to_sql(ty, out),
                Type::INT4 => i32::try_from(*i)?.to_sql(ty, out),
                Type::INT2 => i16::try_from(*i)?.to_sql(ty, out),
                Type::BOOL => (*i != 0).to_sql(ty, out),
                #[allow(clippy::cast_precision_loss)]
                Type::FLOAT8 => (*i as f64).to_sql(ty, out),
                _ => i.to_string().as_str().to_sql(ty, out),
            },
            Val::Real(f) => match *ty {
                Type::FLOAT4 => {
                    #[allow(clippy::cast_possible_truncation)]
                    let f = *f as f32;
                    f.to_sql(ty, out)
                }
                Type::FLOAT8 => f.to_sql(ty, out),
                _ => f.to_string().as_str().to_sql(ty, out),
            },
            // The service refuses such text at its door; this names the cause should any
            // other text carry one (PostgreSQL's own word is an encoding error).
            Val::Text(s) if s.contains('\0') => {
                Err("text with a NUL character (\\0) cannot be stored in PostgreSQL".into())
            }
            Val::Text(s) => match *ty {
                Type::INT8 => s.parse::<i64>()?.to_sql(ty, out),
                _ => s.as_str().to_sql(ty, out),
            },
            Val::Blob(b) => b.as_slice().to_sql(ty, out),
        }
    }

    fn accepts(_: &Type) -> bool {
        true
    }

    to_sql_checked!();
}

/// A `numeric` (what `sum` of a `bigint` column gives) as an integer, or a float when it
/// has a fraction: its binary form is base-10000 digits with a weight and a sign.
struct Numeric(Val);

impl<'a> FromSql<'a> for Numeric {
    fn from_sql(_: &Type, raw: &'a [u8]) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        let word = |i: usize| -> Result<i16, Box<dyn std::error::Error + Sync + Send>> {
            let b = raw
                .get(i * 2..i * 2 + 2)
                .ok_or("a numeric value is cut short")?;
            Ok(i16::from_be_bytes([b[0], b[1]]))
        };
        let digits = usize::try_from(word(0)?).map_err(|_| "a numeric with negative length")?;
        let weight = i32::from(word(1)?);
        let sign = u16::from_be_bytes(word(2)?.to_be_bytes());
        if sign == 0xC000 {
            return Err("NaN where a number was expected".into());
        }
        let mut whole: i128 = 0;
        let mut frac = 0f64;
        for i in 0..digits {
            let d = i128::from(word(4 + i)?);
            let power = weight - i32::try_from(i).unwrap_or(i32::MAX);
            if power >= 0 {
                whole += d * 10_000i128.pow(u32::try_from(power).unwrap_or(0));
            } else {
                #[allow(clippy::cast_precision_loss)]
                {
                    frac += d as f64 * 10_000f64.powi(power);
                }
            }
        }
        if sign == 0x4000 {
            whole = -whole;
            frac = -frac;
        }
        if frac == 0.0 {
            return Ok(Numeric(Val::Int(i64::try_from(whole)?)));
        }
        #[allow(clippy::cast_precision_loss)]
        Ok(Numeric(Val::Real(whole as f64 + frac)))
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::NUMERIC
    }
}

fn decode_row(row: &postgres::Row) -> Result<Vec<Val>, PgFailure> {
    (0..row.len())
        .map(|i| {
            let ty = row.columns()[i].type_().clone();
            let v = match ty {
                Type::INT8 => row.try_get::<_, Option<i64>>(i).map(|v| v.map(Val::Int)),
                Type::INT4 => row
                    .try_get::<_, Option<i32>>(i)
                    .map(|v| v.map(|x| Val::Int(x.into()))),
                Type::INT2 => row
                    .try_get::<_, Option<i16>>(i)
                    .map(|v| v.map(|x| Val::Int(x.into()))),
                Type::BOOL => row
                    .try_get::<_, Option<bool>>(i)
                    .map(|v| v.map(|x| Val::Int(x.into()))),
                Type::FLOAT8 => row.try_get::<_, Option<f64>>(i).map(|v| v.map(Val::Real)),
                Type::FLOAT4 => row
                    .try_get::<_, Option<f32>>(i)
                    .map(|v| v.map(|x| Val::Real(x.into()))),
                Type::NUMERIC => row.try_get::<_, Option<Numeric>>(i).map(|v| v.map(|n| n.0)),
                Type::BYTEA => row
                    .try_get::<_, Option<Vec<u8>>>(i)
                    .map(|v| v.map(Val::Blob)),
                _ => row
                    .try_get::<_, Option<String>>(i)
                    .map(|v| v.map(Val::Text)),
            };
            v.map(|v| v.unwrap_or(Val::Null))
                .map_err(|e| PgFailure::of(&e))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use postgres::config::SslMode;

    #[test]
    fn a_url_asks_for_tls_by_sslmode_and_names_its_own_roots() {
        let (c, files) = settings("postgres://u:p@db:5433/team").unwrap();
        assert_eq!(c.get_ssl_mode(), SslMode::Disable, "in clear unless asked");
        assert_eq!((c.get_ports(), files), (&[5433][..], TlsFiles::default()));
        let (c, files) = settings(
            "postgres://u@db/team?connect_timeout=3&sslmode=verify-full&sslrootcert=/etc/ca.pem",
        )
        .unwrap();
        assert_eq!(c.get_ssl_mode(), SslMode::Require);
        assert_eq!(c.get_connect_timeout(), Some(&Duration::from_secs(3)));
        assert_eq!(files.root, Some(std::path::PathBuf::from("/etc/ca.pem")));
        assert_eq!(
            settings("postgres://db/t?sslmode=prefer")
                .unwrap()
                .0
                .get_ssl_mode(),
            SslMode::Prefer
        );
        assert!(
            settings("postgres://db/t?sslmode=allow")
                .unwrap_err()
                .contains("sslmode allow is not one of")
        );
        assert!(settings("postgres://db/t?nonsense=1").is_err());
        // Every other parameter is kept as written: the driver decodes %XX itself.
        let (c, _) = settings(
            "postgres://u@db/t?options=-c%20search_path%3Dx&sslmode=require&password=a%20b",
        )
        .unwrap();
        assert_eq!(c.get_options(), Some("-c search_path=x"));
        assert_eq!(c.get_password(), Some(&b"a b"[..]));
        // Several hosts (no URL parser takes them) keep their sslmode.
        let (c, files) =
            settings("postgres://u@db1:5432,db2:5433/t?sslmode=require&sslrootcert=%2Fca.pem")
                .unwrap();
        assert_eq!(c.get_ssl_mode(), SslMode::Require);
        assert_eq!(c.get_hosts().len(), 2);
        assert_eq!(files.root, Some(std::path::PathBuf::from("/ca.pem")));
        // A local socket carries no TLS.
        let (c, _) = settings("postgres://u@%2Frun%2Fpostgresql/t?sslmode=require").unwrap();
        assert_eq!(c.get_ssl_mode(), SslMode::Disable);
        assert_eq!(
            identity("postgres://u@db:5433/team?sslmode=require&sslrootcert=/ca.pem"),
            "u@db:5433/team"
        );
    }

    #[test]
    fn a_client_certificate_comes_with_its_key_and_only_over_tls() {
        let (c, files) = settings(
            "postgres://u@db/t?sslmode=verify-full&sslcert=%2Fc%2Fme.crt&sslkey=/c/me.key&sslrootcert=/c/ca.crt",
        )
        .unwrap();
        assert_eq!(c.get_ssl_mode(), SslMode::Require);
        assert_eq!(
            files,
            TlsFiles {
                root: Some("/c/ca.crt".into()),
                cert: Some("/c/me.crt".into()),
                key: Some("/c/me.key".into()),
            }
        );
        let refused = |url: &str| settings(url).unwrap_err();
        assert!(
            refused("postgres://db/t?sslmode=require&sslcert=/a").contains("sslcert needs sslkey")
        );
        assert!(
            refused("postgres://db/t?sslmode=require&sslkey=/a").contains("sslkey needs sslcert")
        );
        for mode in ["", "&sslmode=disable", "&sslmode=prefer"] {
            assert!(
                refused(&format!("postgres://db/t?sslcert=/a&sslkey=/b{mode}"))
                    .contains("only shown over TLS"),
                "{mode}"
            );
        }
    }

    #[test]
    fn a_client_key_others_may_read_is_refused_by_name() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("me.crt"), dir.path().join("me.key"));
        let made = rcgen::generate_simple_self_signed(vec!["handoffs".into()]).unwrap();
        std::fs::write(&cert, made.cert.pem()).unwrap();
        std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let said = client_identity(&cert, &key).unwrap_err();
        assert!(
            said.contains("its group or others may read it (mode 644)"),
            "{said}"
        );
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        let (chain, _) = client_identity(&cert, &key).unwrap();
        assert_eq!(chain.len(), 1);
        std::fs::write(&cert, "not a certificate").unwrap();
        assert!(
            client_identity(&cert, &key)
                .unwrap_err()
                .contains("no certificate in it")
        );
        std::fs::write(&cert, made.cert.pem()).unwrap();
        std::fs::write(&key, "not a key").unwrap();
        let said = client_identity(&cert, &key).unwrap_err();
        assert!(
            said.starts_with(&format!("sslkey {}", key.display())),
            "{said}"
        );
    }

    /// A key that is not the certificate's is refused by name before any connection, and a
    /// matching pair makes a TLS configuration that shows it.
    #[test]
    fn a_client_key_that_is_not_the_certificates_is_refused_by_name() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("me.crt"), dir.path().join("me.key"));
        let made = rcgen::generate_simple_self_signed(vec!["handoffs".into()]).unwrap();
        let other = rcgen::KeyPair::generate().unwrap();
        std::fs::write(&cert, made.cert.pem()).unwrap();
        std::fs::write(&key, other.serialize_pem()).unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        let files = TlsFiles {
            root: None,
            cert: Some(cert.clone()),
            key: Some(key.clone()),
        };
        let said = tls(&files)
            .err()
            .expect("a key of another certificate")
            .to_string();
        assert!(
            said.contains("is not the private key of the certificate in sslcert"),
            "{said}"
        );
        std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
        assert!(tls(&files).is_ok());
    }

    #[test]
    fn parameters_are_renumbered_outside_quotes() {
        assert_eq!(
            translate("SELECT a FROM t WHERE b = ?1 AND c = '?2' AND d IN (?2, ?10)"),
            "SELECT a FROM t WHERE b = $1 AND c = '?2' AND d IN ($2, $10)"
        );
    }

    #[test]
    fn a_password_is_never_shown() {
        assert_eq!(
            redacted("postgres://me:secret@db.example:5432/team"),
            "postgres://me:***@db.example:5432/team"
        );
        assert_eq!(redacted("postgres://me@h/db"), "postgres://me@h/db");
    }
}
