//! `serve --tls-cert FILE --tls-key FILE`: HTTPS without a proxy (issue 17 item 3).
//!
//! rustls through `tokio-rustls` (already in the tree for reqwest's HTTPS, with the same
//! aws-lc-rs provider, so no new crypto is compiled in). The one piece written here is
//! [`TlsListener`], an `axum::serve::Listener`: TCP connections are accepted on a task of
//! their own and each handshake runs on its own task with a time limit, so a client that
//! connects and never speaks TLS holds up nobody else (at most 256 handshakes at once, each
//! for at most 10 s); finished handshakes reach axum through a channel.

use crate::service::ServiceError;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::{
    self,
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
};
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;

/// How long a client gets to finish its TLS handshake.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);
/// Handshakes under way at once; past this, new connections wait in the kernel's backlog, so
/// silent clients cannot use up the process's files.
const HANDSHAKES_AT_ONCE: usize = 256;

/// The certificate chain and private key files `serve` was given (PEM).
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn usage(m: String) -> ServiceError {
    ServiceError::Usage(m)
}

impl TlsFiles {
    /// Reads both files and checks that the key belongs to the certificate.
    pub fn load(&self) -> Result<Arc<rustls::ServerConfig>, ServiceError> {
        let certs = read_certs(&self.cert)?;
        let key = PrivateKeyDer::from_pem_file(&self.key).map_err(|e| {
            usage(format!(
                "--tls-key {}: no PEM private key could be read ({e})",
                self.key.display()
            ))
        })?;
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| ServiceError::Refused(format!("TLS set-up failed: {e}")))?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| {
                usage(format!(
                    "--tls-cert {} and --tls-key {} do not make a usable pair: {e}",
                    self.cert.display(),
                    self.key.display()
                ))
            })?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, ServiceError> {
    let bad = |e: String| {
        usage(format!(
            "--tls-cert {}: no PEM certificate could be read ({e})",
            path.display()
        ))
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("the file holds no CERTIFICATE block".to_owned()));
    }
    Ok(certs)
}

/// Accepted TLS connections, for `axum::serve`.
pub struct TlsListener {
    ready: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl std::fmt::Debug for TlsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsListener")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl TlsListener {
    /// Starts accepting on `tcp` (on the current runtime) until `stop`.
    pub fn new(
        tcp: TcpListener,
        config: Arc<rustls::ServerConfig>,
        stop: CancellationToken,
    ) -> std::io::Result<TlsListener> {
        let local = tcp.local_addr()?;
        let (tx, ready) = tokio::sync::mpsc::channel(64);
        let acceptor = TlsAcceptor::from(config);
        let slots = Arc::new(tokio::sync::Semaphore::new(HANDSHAKES_AT_ONCE));
        tokio::spawn(async move {
            loop {
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let (stream, peer) = tokio::select! {
                    () = stop.cancelled() => return,
                    accepted = tcp.accept() => match accepted {
                        Ok(a) => a,
                        // The client gave up before it was accepted: nothing to wait for.
                        Err(e) if matches!(
                            e.kind(),
                            std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset
                        ) => continue,
                        Err(e) => {
                            // Out of file descriptors and the like: wait, as axum's own
                            // listener does, rather than spin.
                            tracing::warn!(error = %e, "accepting a connection failed");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            continue;
                        }
                    },
                };
                let mut stream = stream;
                crate::front::web::nodelay(&mut stream);
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let _slot = slot;
                    match tokio::time::timeout(HANDSHAKE_LIMIT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { ready, local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            // The acceptor stopped: the server is stopping too; wait for its shutdown.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
