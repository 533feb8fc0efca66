//! Learning that another process committed, without polling: every commit of any process
//! writes the database's WAL file, and the kernel reports that write (inotify through the
//! `notify` crate) at no cost while nothing happens. A file event says only that a commit may
//! be under way; whoever waits confirms it with `data_version`, a little later too, since a
//! commit becomes visible through the shared-memory index just after its last WAL write
//! (which raised the event) and, with `synchronous=FULL`, after that write's sync.

use std::path::Path;
use tokio::sync::watch;

/// A watch on the database's folder: a counter that goes up on every event for one of the
/// database's files (the database, its WAL, its shared-memory index).
pub struct Changes {
    rx: watch::Receiver<u64>,
    tx: std::sync::Arc<watch::Sender<u64>>,
    /// The file watch; `None` on PostgreSQL, where a listening session counts instead
    /// (`store::pg::listen`, alive while `tx` is).
    watcher: Option<notify::RecommendedWatcher>,
    folder: std::path::PathBuf,
    paused: bool,
}

impl std::fmt::Debug for Changes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Changes").finish_non_exhaustive()
    }
}

impl Changes {
    /// Watches the folder of `db`; `None` when the kernel will not (no inotify, or its limit
    /// of watches reached): the caller then polls.
    pub fn watch(db: &Path) -> Option<Changes> {
        use notify::Watcher as _;
        let (tx, rx) = watch::channel(0u64);
        let tx = std::sync::Arc::new(tx);
        if crate::store::pg::is_url(db) {
            crate::store::pg::listen(
                &db.to_string_lossy(),
                std::sync::Arc::downgrade(&tx),
                |tx, _| tx.send_modify(|n| *n = n.wrapping_add(1)),
            );
            return Some(Changes {
                rx,
                tx,
                watcher: None,
                folder: std::path::PathBuf::new(),
                paused: false,
            });
        }
        let name = db.file_name()?.to_string_lossy().into_owned();
        let folder = match db.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => std::path::PathBuf::from("."),
        };
        let events = tx.clone();
        let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
            // An error or an event without paths (the kernel's queue overflowed: events were
            // lost) counts as a change too.
            let ours = ev.map_or(true, |ev| {
                ev.paths.is_empty()
                    || ev.paths.iter().any(|p| {
                        p.file_name()
                            .is_some_and(|f| f.to_string_lossy().starts_with(&name))
                    })
            });
            if ours {
                events.send_modify(|n| *n = n.wrapping_add(1));
            }
        })
        .ok()?;
        watcher
            .watch(&folder, notify::RecursiveMode::NonRecursive)
            .ok()?;
        Some(Changes {
            rx,
            tx,
            watcher: Some(watcher),
            folder,
            paused: false,
        })
    }

    /// Stops the events for a while (an engine busy with its own commits, which would raise
    /// an event each, polls instead): the kernel drops the watch. Idempotent.
    pub fn pause(&mut self) {
        use notify::Watcher as _;
        if !self.paused
            && let Some(w) = self.watcher.as_mut()
        {
            self.paused = true;
            let _ = w.unwatch(&self.folder);
        }
    }

    /// Watches again after [`Changes::pause`], and counts as an event at once: a commit whose
    /// WAL writes fell in the pause becomes visible only now, so whoever waits looks again
    /// over the next moments. `false` when the kernel will not watch again (poll from then on).
    pub fn resume(&mut self) -> bool {
        use notify::Watcher as _;
        if !self.paused {
            return true;
        }
        self.paused = false;
        if let Some(w) = self.watcher.as_mut()
            && w.watch(&self.folder, notify::RecursiveMode::NonRecursive)
                .is_err()
        {
            return false;
        }
        self.tx.send_modify(|n| *n = n.wrapping_add(1));
        true
    }

    /// A receiver whose `changed()` resolves on the next event (and at once when an event
    /// came since it last looked).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.rx.clone()
    }
}

/// Waits until `look` finds something (`Some`), `deadline` passes (`None`), or `stop`
/// finishes (`None`). `look` runs at once, then after each change to the database's files
/// (and once more shortly after, since a commit becomes visible just after the write that
/// raised the event), else every 2 s (a file system that sends no events). The one wait of
/// every front (MCP `wait_for_messages`, `handoffs wait`).
pub async fn wait_until<T, E>(
    mut look: impl FnMut() -> Result<Option<T>, E>,
    mut rx: Option<watch::Receiver<u64>>,
    deadline: tokio::time::Instant,
    stop: impl std::future::Future<Output = ()>,
) -> Result<Option<T>, E> {
    tokio::pin!(stop);
    let mut recheck: Option<tokio::time::Instant> = None;
    loop {
        if let Some(found) = look()? {
            return Ok(Some(found));
        }
        let now = tokio::time::Instant::now();
        let next = recheck
            .take()
            .filter(|r| *r > now)
            .unwrap_or(now + std::time::Duration::from_secs(2))
            .min(deadline);
        tokio::select! {
            biased;
            () = &mut stop => return Ok(None),
            () = tokio::time::sleep_until(deadline) => return Ok(None),
            changed = async {
                match rx.as_mut() {
                    Some(r) => r.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            } => {
                if !changed {
                    rx = None;
                }
                // Let a burst of writes (one commit) settle into one look.
                tokio::time::sleep(std::time::Duration::from_millis(15)).await;
                if let Some(r) = rx.as_mut() {
                    r.borrow_and_update();
                }
                recheck = Some(tokio::time::Instant::now() + std::time::Duration::from_millis(60));
            }
            () = tokio::time::sleep_until(next) => {}
        }
    }
}
