//! What can be checked about an agent's destination at once, without writing to it (SPEC §5
//! `doctor`, issue 12): the binary and its version, the session or thread, the folder, the
//! URL. `agent add` prints the problems as warnings (the registration stands); `handoffs
//! doctor` prints every finding for every agent.
//!
//! Hand-written on purpose: a few file lookups and a `--version` run with a timeout; no crate
//! does this for Codex's and Claude Code's layouts.

use crate::store::AgentRow;
use model::Provider;
use serde::Serialize;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long a `--version` run may take.
const VERSION_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection to an HTTP agent may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// One thing found about an agent's destination.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Finding {
    pub agent: String,
    /// False: something that will keep deliveries from arriving.
    pub ok: bool,
    pub text: String,
}

struct Findings {
    agent: String,
    out: Vec<Finding>,
}

impl Findings {
    fn ok(&mut self, text: impl Into<String>) {
        self.out.push(Finding {
            agent: self.agent.clone(),
            ok: true,
            text: text.into(),
        });
    }
    fn problem(&mut self, text: impl Into<String>) {
        self.out.push(Finding {
            agent: self.agent.clone(),
            ok: false,
            text: text.into(),
        });
    }
}

fn setting<'a>(agent: &'a AgentRow, key: &str) -> Option<&'a str> {
    agent.settings.get(key).and_then(Value::as_str)
}

/// Checks what can be checked about `agent`'s destination now.
pub fn check(agent: &AgentRow) -> Vec<Finding> {
    let mut f = Findings {
        agent: agent.id.clone(),
        out: Vec::new(),
    };
    let provider = agent.provider.parse::<Provider>().ok();
    if !agent.cwd.is_empty() {
        if Path::new(&agent.cwd).is_dir() {
            f.ok(format!("folder {} exists", agent.cwd));
        } else {
            f.problem(format!("folder {} does not exist", agent.cwd));
        }
    }
    match provider {
        Some(Provider::Demo) => f.ok("demo agent: simulated in this process"),
        Some(Provider::Command) => command(agent, &mut f),
        Some(Provider::Codex) => codex(agent, &mut f),
        Some(Provider::ClaudeCode) => claude_code(agent, &mut f),
        None => f.problem(format!("unknown provider {:?}", agent.provider)),
    }
    f.out
}

fn command(agent: &AgentRow, f: &mut Findings) {
    if let Some(argv) = agent.settings.get("command").and_then(Value::as_array) {
        let program = argv.first().and_then(Value::as_str).unwrap_or_default();
        match find_program(program) {
            Some(path) => f.ok(format!("command {} found", path.display())),
            None => f.problem(format!(
                "command {program:?} is not an executable file, nor found on PATH"
            )),
        }
    }
    for key in ["url", "activity_url", "status_url"] {
        if let Some(url) = setting(agent, key) {
            match reachable(url) {
                Ok(addr) => f.ok(format!("{key} {url} answers at {addr}")),
                Err(e) => f.problem(format!("{key} {url}: {e}")),
            }
        }
    }
}

fn codex(agent: &AgentRow, f: &mut Findings) {
    let binary = setting(agent, "binary").unwrap_or("codex");
    version(binary, f);
    let home = setting(agent, "home")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("CODEX_HOME").map(PathBuf::from))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".codex")));
    match &home {
        Some(h) if h.is_dir() => f.ok(format!("Codex home {} exists", h.display())),
        Some(h) => f.problem(format!("Codex home {} does not exist", h.display())),
        None => f.problem("no Codex home: set home, or CODEX_HOME"),
    }
    let thread = agent.endpoint.as_str();
    if thread.is_empty() {
        f.problem("no thread: register the Codex thread id with --endpoint");
    } else if let Some(h) = home.filter(|h| h.is_dir()) {
        match find_rollout(&h.join("sessions"), thread) {
            Some(p) => f.ok(format!("thread {thread} found ({})", p.display())),
            None => f.problem(format!(
                "thread {thread} not found under {}",
                h.join("sessions").display()
            )),
        }
        codex_holder(&h, thread, f);
    }
}

/// Who has the thread open: the Codex daemon (handoffs go into that session), another Codex
/// process (they wait until it lets go), or nobody (handoffs start an app-server of their own).
fn codex_holder(home: &Path, thread: &str, f: &mut Findings) {
    let Ok(pids) = super::codex::lock_holders_checked(&super::codex::writer_lock(home, thread))
    else {
        return;
    };
    let Some(pid) = pids.first() else {
        f.ok(format!(
            "thread {thread} is not open in any Codex process: handoffs run their own app-server"
        ));
        return;
    };
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let listens = cmdline
        .split(|b| *b == 0)
        .any(|a| a.starts_with(b"unix://") || a == b"--managed-daemon");
    if listens && super::codex::daemon::socket_path(home).exists() {
        f.ok(format!(
            "thread {thread} is open in the Codex daemon (pid {pid}): handoffs go into that session, each as a turn of its own"
        ));
    } else {
        f.problem(format!(
            "thread {thread} is held by Codex process {pid}, which is not the daemon (`codex --no-daemon`, an IDE, or an app-server over stdio): handoffs wait until it lets go"
        ));
    }
}

fn claude_code(agent: &AgentRow, f: &mut Findings) {
    let binary = setting(agent, "binary").unwrap_or("claude");
    version(binary, f);
    let config = setting(agent, "config_dir")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("CLAUDE_CONFIG_DIR").map(PathBuf::from))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".claude")));
    match &config {
        Some(c) if c.is_dir() => f.ok(format!("Claude config folder {} exists", c.display())),
        Some(c) => f.problem(format!(
            "Claude config folder {} does not exist",
            c.display()
        )),
        None => f.problem("no Claude config folder: set config_dir, or CLAUDE_CONFIG_DIR"),
    }
    let session = agent.endpoint.as_str();
    if session.is_empty() {
        f.problem("no session: register the Claude session id with --endpoint");
    } else if agent.cwd.is_empty() {
        f.problem("no folder: a Claude session resumes only in its own folder (--cwd)");
    } else if let Some(c) = config.filter(|c| c.is_dir()) {
        let transcript = transcript_path(&c, Path::new(&agent.cwd), session);
        if transcript.is_file() {
            f.ok(format!(
                "session {session} found ({})",
                transcript.display()
            ));
        } else {
            f.problem(format!(
                "session {session} not found: no transcript {}",
                transcript.display()
            ));
        }
    }
}

/// Claude Code keeps a session's transcript under its folder's real path with every
/// character that is not a letter or a digit replaced by `-`.
/// A name longer than 200 characters keeps its first 200 and gains `-` and a base-36 hash of
/// the whole path (Java's string hash over UTF-16 units, as Claude Code computes it).
pub fn transcript_path(config: &Path, cwd: &Path, session: &str) -> PathBuf {
    let real = std::fs::canonicalize(cwd).unwrap_or_else(|_| cwd.to_owned());
    let path = real.to_string_lossy();
    // Per UTF-16 unit, as JavaScript's replace sees the string.
    let mut folder: String = path
        .encode_utf16()
        .map(|u| {
            char::from_u32(u32::from(u))
                .filter(char::is_ascii_alphanumeric)
                .unwrap_or('-')
        })
        .collect();
    if folder.len() > 200 {
        let hash = path.encode_utf16().fold(0_i32, |h, u| {
            h.wrapping_shl(5).wrapping_sub(h).wrapping_add(i32::from(u))
        });
        let mut n = hash.unsigned_abs();
        let mut digits = Vec::new();
        loop {
            digits.push(char::from_digit(n % 36, 36).unwrap_or('0'));
            n /= 36;
            if n == 0 {
                break;
            }
        }
        folder.truncate(200);
        folder.push('-');
        folder.extend(digits.iter().rev());
    }
    config
        .join("projects")
        .join(folder)
        .join(format!("{session}.jsonl"))
}

/// Codex keeps a thread as `sessions/YYYY/MM/DD/rollout-<time>-<thread>.jsonl`.
pub fn find_rollout(sessions: &Path, thread: &str) -> Option<PathBuf> {
    let suffix = format!("-{thread}.jsonl");
    let mut stack = vec![(sessions.to_owned(), 0)];
    while let Some((dir, depth)) = stack.pop() {
        // An unreadable folder is skipped, not taken for the end of the search.
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() && depth < 3 {
                stack.push((path, depth + 1));
            } else if path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("rollout-") && n.ends_with(&suffix))
            {
                return Some(path);
            }
        }
    }
    None
}

/// An executable path, or a name found on `PATH`.
fn find_program(program: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.is_empty() {
        return None;
    }
    if program.contains('/') {
        let p = PathBuf::from(program);
        return executable(&p).then_some(p);
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| executable(p))
}

/// Runs `binary --version` (no shell) and reports its first line.
fn version(binary: &str, f: &mut Findings) {
    let Some(path) = find_program(binary) else {
        f.problem(format!(
            "{binary} is not an executable file, nor found on PATH"
        ));
        return;
    };
    match run_version(&path) {
        Ok(v) => f.ok(format!("{} is {v}", path.display())),
        Err(e) => f.problem(format!("{} --version: {e}", path.display())),
    }
}

fn run_version(path: &Path) -> Result<String, String> {
    let mut child = Command::new(path)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    loop {
        match child.try_wait().map_err(|e| e.to_string())? {
            Some(status) => {
                let out = child.wait_with_output().map_err(|e| e.to_string())?;
                let text = String::from_utf8_lossy(&out.stdout);
                let line = text.lines().next().unwrap_or_default().trim().to_owned();
                return if status.success() && !line.is_empty() {
                    Ok(line)
                } else {
                    Err(format!("exited with {status} and no version"))
                };
            }
            None if start.elapsed() > VERSION_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no answer within {}s", VERSION_TIMEOUT.as_secs()));
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Whether a TCP connection to the URL's host opens.
fn reachable(url: &str) -> Result<String, String> {
    use std::net::ToSocketAddrs;
    let u = reqwest::Url::parse(url).map_err(|e| e.to_string())?;
    let host = u.host_str().ok_or("no host")?;
    let port = u.port_or_known_default().ok_or("no port")?;
    let addrs: Vec<_> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host}: {e}"))?
        .collect();
    let mut last = String::from("no address");
    for addr in addrs {
        match std::net::TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(_) => return Ok(addr.to_string()),
            Err(e) => last = format!("does not answer ({e})"),
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::transcript_path;
    use std::path::Path;

    #[test]
    fn a_claude_transcript_lives_under_its_mangled_folder() {
        let p = transcript_path(Path::new("/c"), Path::new("/no/such/my_project.v2"), "abc");
        assert_eq!(p, Path::new("/c/projects/-no-such-my-project-v2/abc.jsonl"));
    }

    #[test]
    fn a_long_folder_is_cut_at_200_and_named_by_its_hash() {
        // The expected name is what Claude Code's rule gives (computed independently).
        let folder = format!("/tmp/{}/{}/é日本", "a".repeat(120), "b b.c".repeat(20));
        let p = transcript_path(Path::new("/c"), Path::new(&folder), "s");
        let expected = format!("-tmp-{}-{}b-b--ruc0yf", "a".repeat(120), "b-b-c".repeat(14));
        assert_eq!(p, Path::new("/c/projects").join(expected).join("s.jsonl"));
    }
}
