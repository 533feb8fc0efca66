//! The MCP server's stdio transport: one JSON-RPC message per line, as rmcp's own, but every
//! line that is not a message it can hand on gets an answer a client can match.
//!
//! Hand-written on purpose: rmcp's line transport drops a line that is not JSON without a
//! word, and answers a request of the wrong shape (its `params` a number, a string, a list)
//! with `-32600` *without its id*, so the client cannot match the answer and waits forever.
//! Here (JSON-RPC 2.0 §5.1):
//! - a line that is not JSON: `-32700`, id null;
//! - JSON that is not one object (a batch, a number): `-32600`, id null;
//! - a request whose `params` is present but not an object: `-32602`, with its id;
//! - a request of MCP's whose params do not fit (a `tools/call` without a name): `-32602`,
//!   with its id (rmcp would say "method not found");
//! - any other request rmcp cannot read: `-32600`, with its id when it has one;
//! - a notification that cannot be read is dropped (a notification is never answered);
//! - an unknown method reaches rmcp, which answers `-32601` with its id.
//!
//! Lines over [`LINE_MAX`] bytes are refused with `-32600` and skipped to their end.

use rmcp::RoleServer;
use rmcp::service::{RxJsonRpcMessage, TxJsonRpcMessage};
use serde_json::{Value, json};
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::Mutex;

/// The longest line read (16 MiB): a message is at most a few hundred kilobytes.
pub const LINE_MAX: usize = 16 << 20;

/// What one line comes to.
#[derive(Debug)]
pub enum Line {
    /// A message for rmcp.
    Message(Box<RxJsonRpcMessage<RoleServer>>),
    /// An error response to write back (the line is not handed on).
    Answer(Value),
    /// Nothing to do (a blank line, an unreadable notification).
    Skip,
}

/// Judges one line (without its newline).
pub fn judge(line: &[u8]) -> Line {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
    if line.iter().all(u8::is_ascii_whitespace) {
        return Line::Skip;
    }
    let value: Value = match serde_json::from_slice(line) {
        Ok(v) => v,
        Err(e) => return Line::Answer(error(&Value::Null, -32700, &format!("Parse error: {e}"))),
    };
    let Some(object) = value.as_object() else {
        let what = if value.is_array() {
            "batches are not supported; send one message per line"
        } else {
            "a message is one JSON object"
        };
        return Line::Answer(error(
            &Value::Null,
            -32600,
            &format!("Invalid request: {what}"),
        ));
    };
    // Only a string or a number is an id a client can match; anything else is no id.
    let id = object
        .get("id")
        .filter(|id| id.is_string() || id.is_number())
        .cloned();
    let method = object.get("method").and_then(Value::as_str);
    // Absent and null params are no params; anything else must be an object.
    if method.is_some()
        && let Some(params) = object.get("params")
        && !params.is_object()
        && !params.is_null()
    {
        return match id {
            Some(_) if crate::planted(crate::Plant::McpDropsBadParams) => Line::Skip,
            Some(id) => Line::Answer(error(
                &id,
                -32602,
                "Invalid params: params must be an object",
            )),
            None => Line::Skip,
        };
    }
    match serde_json::from_value::<RxJsonRpcMessage<RoleServer>>(value.clone()) {
        // rmcp reads a standard request whose params do not fit as a custom one, and would
        // answer "method not found"; the method is there, its params are wrong.
        Ok(rmcp::model::JsonRpcMessage::Request(r))
            if matches!(&r.request, rmcp::model::ClientRequest::CustomRequest(c)
                if STANDARD_METHODS.contains(&c.method.as_str())) =>
        {
            let method = method.unwrap_or_default();
            Line::Answer(error(
                id.as_ref().unwrap_or(&Value::Null),
                -32602,
                &format!("Invalid params for {method}"),
            ))
        }
        Ok(message) => Line::Message(Box::new(message)),
        // An unreadable notification, or a response to nothing we asked: no answer.
        Err(_) if id.is_none() && method.is_some() => Line::Skip,
        Err(_)
            if method.is_none()
                && (object.contains_key("result") || object.contains_key("error")) =>
        {
            Line::Skip
        }
        Err(e) => Line::Answer(error(
            id.as_ref().unwrap_or(&Value::Null),
            -32600,
            &format!("Invalid request: {e}"),
        )),
    }
}

/// The requests of MCP a client sends (2025-06-18), and rmcp's `server/discover`.
const STANDARD_METHODS: &[&str] = &[
    "initialize",
    "ping",
    "completion/complete",
    "logging/setLevel",
    "prompts/get",
    "prompts/list",
    "resources/list",
    "resources/templates/list",
    "resources/read",
    "resources/subscribe",
    "resources/unsubscribe",
    "tools/call",
    "tools/list",
    "server/discover",
];

fn error(id: &Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
}

/// JSON-RPC over a line stream: reads from `R`, writes to `W`.
pub struct Lines<R, W> {
    read: BufReader<R>,
    write: Arc<Mutex<W>>,
    /// The line read so far: kept across a cancelled `receive` (rmcp polls it in a
    /// `select!`), cleared once a whole line was judged.
    line: Vec<u8>,
    /// Skipping the rest of an over-long line.
    discarding: bool,
    /// Error answers being written: finished before the end of input is reported, so a
    /// client that closes its side right after a bad line still reads the answer.
    answering: Vec<tokio::task::JoinHandle<()>>,
}

impl<R, W> std::fmt::Debug for Lines<R, W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lines").finish_non_exhaustive()
    }
}

impl<R: AsyncRead + Unpin, W: AsyncWrite + Unpin + Send + 'static> Lines<R, W> {
    pub fn new(read: R, write: W) -> Self {
        Lines {
            read: BufReader::new(read),
            write: Arc::new(Mutex::new(write)),
            line: Vec::new(),
            discarding: false,
            answering: Vec::new(),
        }
    }

    /// Reads up to the end of the next line into `self.line`: `Some(true)` a line,
    /// `Some(false)` an over-long one (skipped), `None` the end of input. A last line
    /// without a newline is a line. Cancel-safe: what was read stays in `self.line`.
    async fn next_line(&mut self) -> std::io::Result<Option<bool>> {
        loop {
            let available = self.read.fill_buf().await?;
            if available.is_empty() {
                if self.discarding || self.line.is_empty() {
                    return Ok(None);
                }
                return Ok(Some(true));
            }
            let newline = available.iter().position(|b| *b == b'\n');
            let take = newline.map_or(available.len(), |i| i + 1);
            if self.discarding {
                self.read.consume(take);
                if newline.is_some() {
                    self.discarding = false;
                }
                continue;
            }
            if self.line.len() + take > LINE_MAX {
                self.line.clear();
                self.read.consume(take);
                self.discarding = newline.is_none();
                return Ok(Some(false));
            }
            self.line.extend_from_slice(&available[..take]);
            self.read.consume(take);
            if newline.is_some() {
                self.line.pop();
                return Ok(Some(true));
            }
        }
    }

    /// Writes `answer` as one line, in a task of its own: a cancelled `receive` never
    /// leaves half a line on the wire.
    fn answer(&mut self, answer: &Value) {
        let mut bytes = answer.to_string().into_bytes();
        bytes.push(b'\n');
        let write = self.write.clone();
        self.answering.retain(|h| !h.is_finished());
        self.answering.push(tokio::spawn(async move {
            let mut w = write.lock().await;
            if w.write_all(&bytes).await.is_ok() {
                let _ = w.flush().await;
            }
        }));
    }

    /// Waits for every error answer still being written.
    async fn answered(&mut self) {
        for h in self.answering.drain(..) {
            let _ = h.await;
        }
    }
}

impl<R, W> rmcp::transport::Transport<RoleServer> for Lines<R, W>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send + 'static,
{
    type Error = std::io::Error;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleServer>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        let write = self.write.clone();
        async move {
            let mut bytes = serde_json::to_vec(&item)?;
            bytes.push(b'\n');
            let mut w = write.lock().await;
            w.write_all(&bytes).await?;
            w.flush().await
        }
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleServer>> {
        loop {
            match self.next_line().await {
                Ok(Some(true)) => {}
                Ok(Some(false)) => {
                    self.answer(&error(
                        &Value::Null,
                        -32600,
                        &format!("Invalid request: a line over {LINE_MAX} bytes"),
                    ));
                    continue;
                }
                Ok(None) => {
                    self.answered().await;
                    return None;
                }
                Err(e) => {
                    tracing::error!("cannot read stdin: {e}");
                    self.answered().await;
                    return None;
                }
            }
            let judged = judge(&self.line);
            self.line.clear();
            match judged {
                Line::Message(m) => return Some(*m),
                Line::Answer(a) => self.answer(&a),
                Line::Skip => {}
            }
        }
    }

    fn close(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        let write = self.write.clone();
        let answering = std::mem::take(&mut self.answering);
        async move {
            for h in answering {
                let _ = h.await;
            }
            write.lock().await.flush().await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(line: &str) -> Value {
        match judge(line.as_bytes()) {
            Line::Answer(a) => a,
            other => panic!("{line}: {other:?}"),
        }
    }

    /// An id no integer type holds (29 digits) is no id rmcp reads: the request is answered
    /// invalid with that id, written so that it reads back as the very number the client's
    /// own parser made of what it sent. Found by the fuzz target, whose build lacked the
    /// exact float parse (`float_roundtrip`, which jsonschema happens to turn on in the
    /// product's build; Cargo.toml now asks for it itself): the default parse was one unit
    /// off, and the answer matched no request. The input is a seed of the fuzz target.
    #[test]
    fn an_id_too_large_for_an_integer_is_echoed_as_the_same_number() {
        let sent = r#"{"jsonrpc":"2.0","id":18446744078446744073709551615,"method":"ping"}"#;
        let a = answer(sent);
        assert_eq!(a["error"]["code"], -32600);
        let echoed: Value = serde_json::from_str(&a.to_string()).unwrap();
        let own: Value = serde_json::from_str(sent).unwrap();
        assert_eq!(echoed["id"], own["id"], "{a}");
    }

    #[test]
    fn every_bad_request_is_answered_with_its_id() {
        assert_eq!(answer("not json")["error"]["code"], -32700);
        assert_eq!(answer("not json")["id"], Value::Null);
        assert_eq!(answer("[1, 2]")["error"]["code"], -32600);
        assert_eq!(answer("7")["error"]["code"], -32600);
        for params in ["5", "\"x\"", "[1]", "true"] {
            let a = answer(&format!(
                r#"{{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{params}}}"#
            ));
            assert_eq!(a["id"], 4, "{params}");
            assert_eq!(a["error"]["code"], -32602, "{params}");
        }
        for params in [r#"{"name":5}"#, "{}"] {
            let a = answer(&format!(
                r#"{{"jsonrpc":"2.0","id":"a","method":"tools/call","params":{params}}}"#
            ));
            assert_eq!(a["id"], "a");
            assert_eq!(a["error"]["code"], -32602);
        }
    }

    #[test]
    fn messages_pass_and_notifications_are_never_answered() {
        assert!(matches!(
            judge(br#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#),
            Line::Message(_)
        ));
        assert!(matches!(
            judge(br#"{"jsonrpc":"2.0","id":1,"method":"frobnicate","params":{}}"#),
            Line::Message(_)
        ));
        assert!(matches!(
            judge(br#"{"jsonrpc":"2.0","method":"notifications/initialized","params":3}"#),
            Line::Skip
        ));
        assert!(matches!(judge(b"   \r"), Line::Skip));
        assert!(matches!(
            judge(br#"{"jsonrpc":"2.0","id":2,"method":"tools/list","params":null}"#),
            Line::Message(_)
        ));
    }
}
