//! The Codex daemon: the shared background app-server that the interactive `codex` uses
//! unless started with `--no-daemon` (`codex app-server daemon start`, or any
//! `codex app-server --listen unix://`). Its control socket,
//! `$CODEX_HOME/app-server-control/app-server-control.sock`, speaks the app-server's JSON-RPC
//! as WebSocket text frames over a Unix socket; every client of one daemon shares its threads.
//! A thread the daemon has loaded is the session a person has open: a write reaches it only
//! through this socket (any other process gets "already has an active writer").

use super::{Link, Rpc};
use futures_util::{SinkExt as _, StreamExt as _};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio_tungstenite::tungstenite::Message;

pub(crate) type Socket = tokio_tungstenite::WebSocketStream<tokio::net::UnixStream>;

/// How long connecting and the WebSocket handshake may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a question about a thread may take (asked on the engine's pass: a daemon that
/// hangs must not hold it up).
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Where a Codex home's daemon listens.
pub fn socket_path(home: &Path) -> PathBuf {
    home.join("app-server-control")
        .join("app-server-control.sock")
}

/// A connection to the daemon of `home`, not yet introduced: `None` when no daemon runs
/// (no socket, or a socket nobody listens on); `Err` when one answers but not as a daemon.
pub(crate) async fn connect(home: &Path) -> Result<Option<Rpc>, String> {
    let path = socket_path(home);
    let stream =
        match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::UnixStream::connect(&path)).await {
            Ok(Ok(s)) => s,
            // No socket, a stale link, or nobody listening: no daemon.
            Ok(Err(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) =>
            {
                return Ok(None);
            }
            Ok(Err(e)) => return Err(format!("cannot connect to {}: {e}", path.display())),
            Err(_) => return Err(format!("{} did not accept in time", path.display())),
        };
    match tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio_tungstenite::client_async("ws://localhost/", stream),
    )
    .await
    {
        Ok(Ok((ws, _))) => Ok(Some(Rpc::new(Link::Socket(Box::new(ws)), None))),
        Ok(Err(e)) => Err(format!("{} did not speak WebSocket: {e}", path.display())),
        Err(_) => Err(format!("{} did not answer the handshake", path.display())),
    }
}

/// The most pages of loaded threads one look reads (200 threads a page).
const LOADED_PAGES_MAX: usize = 50;

/// The daemon of `home`, introduced, when it has `thread` loaded (the thread is open in a
/// person's session); `None` when no daemon runs or it does not serve the thread.
pub(crate) async fn serving(home: &Path, thread: &str) -> Result<Option<Rpc>, String> {
    let Some(mut rpc) = connect(home).await? else {
        return Ok(None);
    };
    let served = async {
        tokio::time::timeout(PROBE_TIMEOUT, rpc.hello())
            .await
            .map_err(|_| "no answer to initialize".to_owned())??;
        let mut cursor = Value::Null;
        // A daemon that keeps answering with cursors never ends a look: bounded by pages,
        // and a cursor seen before ends the list.
        let mut seen = std::collections::HashSet::new();
        for _ in 0..LOADED_PAGES_MAX {
            let page = rpc
                .call_within(
                    PROBE_TIMEOUT,
                    "thread/loaded/list",
                    json!({"cursor": cursor, "limit": 200}),
                )
                .await?;
            if page["data"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|t| t == thread)
            {
                return Ok(true);
            }
            match &page["nextCursor"] {
                Value::String(c) if !c.is_empty() && seen.insert(c.clone()) => {
                    cursor = Value::String(c.clone());
                }
                Value::String(c) if !c.is_empty() => {
                    return Err(format!("thread/loaded/list repeated its cursor {c:?}"));
                }
                _ => return Ok::<bool, String>(false),
            }
        }
        Err(format!(
            "thread/loaded/list went on past {LOADED_PAGES_MAX} pages"
        ))
    }
    .await;
    match served {
        Ok(true) => Ok(Some(rpc)),
        Ok(false) => {
            rpc.close().await;
            Ok(None)
        }
        Err(e) => {
            rpc.close().await;
            Err(format!("the Codex daemon did not answer: {e}"))
        }
    }
}

/// The thread's `Thread.status` type as the daemon reports it (`idle`, `active`, …), and
/// what it waits on when active.
pub(crate) async fn status(rpc: &mut Rpc, thread: &str) -> Result<(String, Vec<String>), String> {
    let read = rpc
        .call_within(PROBE_TIMEOUT, "thread/read", json!({"threadId": thread}))
        .await?;
    let status = &read["thread"]["status"];
    let kind = status["type"]
        .as_str()
        .ok_or("thread/read gave no status")?
        .to_owned();
    let flags = status["activeFlags"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(str::to_owned)
        .collect();
    Ok((kind, flags))
}

/// How many pages of turns (newest first) [`listed_turn`] reads before it gives up.
const TURN_PAGES_MAX: usize = 5;
/// Turns a page.
const TURN_PAGE: u32 = 20;

/// The turn of `thread` whose user message carries `clientId` = `request_id`, from the
/// daemon's own list of the thread's turns with every item (`thread/turns/list`, full view;
/// the default summary view leaves mid-turn messages out): `(turn id, status)`, or `None`
/// when none of the newest [`TURN_PAGES_MAX`] pages has it.
pub(crate) async fn listed_turn(
    rpc: &mut Rpc,
    thread: &str,
    request_id: &str,
) -> Result<Option<(String, String)>, String> {
    let mut cursor: Option<String> = None;
    for _ in 0..TURN_PAGES_MAX {
        let page = rpc
            .call_within(
                PROBE_TIMEOUT,
                "thread/turns/list",
                json!({"threadId": thread, "itemsView": "full", "limit": TURN_PAGE,
                       "sortDirection": "desc", "cursor": cursor}),
            )
            .await?;
        for turn in page["data"].as_array().into_iter().flatten() {
            let ours =
                turn["items"].as_array().into_iter().flatten().any(|i| {
                    i["type"] == "userMessage" && i["clientId"].as_str() == Some(request_id)
                });
            if ours {
                let id = turn["id"].as_str().ok_or("a listed turn has no id")?;
                let status = turn["status"]
                    .as_str()
                    .ok_or("a listed turn has no status")?;
                return Ok(Some((id.to_owned(), status.to_owned())));
            }
        }
        match page["nextCursor"].as_str() {
            Some(next) if Some(next) != cursor.as_deref() => cursor = Some(next.to_owned()),
            _ => return Ok(None),
        }
    }
    Ok(None)
}

pub(super) async fn send(ws: &mut Socket, msg: &Value) -> Result<(), String> {
    ws.send(Message::text(msg.to_string()))
        .await
        .map_err(|e| format!("the Codex daemon stopped reading: {e}"))
}

/// The next text frame; `None` once the daemon closed the connection.
pub(super) async fn read(ws: &mut Socket) -> Option<String> {
    loop {
        match ws.next().await? {
            Ok(Message::Text(t)) => return Some(t.as_str().to_owned()),
            Ok(Message::Binary(b)) => return Some(String::from_utf8_lossy(&b).into_owned()),
            // Pings are answered by the library as it reads.
            Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_)) => {}
            Ok(Message::Close(_)) | Err(_) => return None,
        }
    }
}

pub(super) async fn close(ws: &mut Socket) {
    let _ = tokio::time::timeout(Duration::from_secs(2), ws.close(None)).await;
}
