#!/usr/bin/env python3
"""Loopback mock of the Anthropic Messages API, enough to drive Claude Code offline.

Python 3 stdlib only.

Endpoints answered
  POST /v1/messages                 stream:true  -> SSE (message_start, ping,
                                    content_block_start, content_block_delta*,
                                    content_block_stop, message_delta, message_stop)
                                    stream:false -> one JSON message
  POST /v1/messages/count_tokens    -> {"input_tokens": N}
  GET/POST /_mock/config            -> read / change the mode at run time (JSON body)
  GET  /_mock/requests              -> {"count": all requests, "message_posts": POST /v1/messages}
  anything else                     -> 404 Anthropic-style error JSON (still logged)

Every request (method, path, selected headers, parsed JSON body) is appended as one
JSON line to --log.

Modes (--mode, or POST /_mock/config {"mode": ...}):
  ok        normal reply (after --delay seconds; see --delay-phase)
  error500  HTTP 500 {"type":"error","error":{"type":"api_error",...}}
  error529  HTTP 529 overloaded_error
  hang      read the request, then never answer (until the client hangs up)
  reset     read the request, then close the socket without any response

Tool calls (--tool NAME [--tool-input JSON], or POST /_mock/config {"tool":..,"tool_input":..};
off by default): a POST /v1/messages whose `tools` offer NAME (exactly, or as the suffix
"__NAME", so "send_handoff" matches Claude Code's "mcp__handoffs__send_handoff") and whose last
user message carries no tool_result is answered with one `tool_use` block (stop_reason
"tool_use") with input --tool-input (default {}). The next request, carrying the tool_result,
gets the usual reply, and the result is logged as one line
  {"event": "tool_result", "tool_use_id", "is_error", "content", "text"}.
A request that offers tools but not NAME is logged as {"event": "tool_not_offered", "tools": [...]}
and gets the usual reply. Structured-output requests never get a tool call.

Usage
  python3 mock_messages.py --port 0 --port-file /tmp/port --log /tmp/req.jsonl \
      [--delay 5] [--delay-phase before|during] [--mode ok] [--reply "text"]
--port 0 picks a free port; it is written to --port-file (and printed on stdout as
"LISTENING <port>").
"""
import argparse
import json
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATE = {
    "mode": "ok",
    "delay": 0.0,
    "delay_phase": "during",  # "before": before HTTP headers; "during": after message_start
    "reply": None,             # None -> "mock reply #<n>"
    "count": 0,            # every logged request (incl. HEAD / preconnect)
    "message_posts": 0,    # POST /v1/messages, any mode
    "message_count": 0,    # POST /v1/messages answered in mode ok
    "tool": None,          # tool name to call (see "Tool calls"); None -> never
    "tool_input": {},      # the tool_use block's input
}
LOCK = threading.Lock()
LOG_PATH = None
HEADERS_TO_LOG = (
    "user-agent", "x-api-key", "authorization", "anthropic-version", "anthropic-beta",
    "x-app", "x-stainless-retry-count", "x-stainless-timeout", "x-claude-code-session-id",
    "content-type", "accept",
)


def log_line(obj):
    if not LOG_PATH:
        return
    with LOCK:
        with open(LOG_PATH, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj, ensure_ascii=False) + "\n")


def rough_tokens(body):
    try:
        return max(1, len(json.dumps(body)) // 4)
    except Exception:
        return 1


def last_user_text(body):
    """Best-effort text of the last user message (for the reply text)."""
    try:
        msgs = body.get("messages") or []
        for m in reversed(msgs):
            if m.get("role") != "user":
                continue
            c = m.get("content")
            if isinstance(c, str):
                return c
            texts = [b.get("text", "") for b in c if isinstance(b, dict) and b.get("type") == "text"]
            # skip <system-reminder> blocks Claude Code injects
            texts = [t for t in texts if not t.lstrip().startswith("<system-reminder>")]
            if texts:
                return texts[-1]
    except Exception:
        pass
    return ""


def last_tool_results(body):
    """tool_result blocks of the last user message (empty when it has none)."""
    msgs = body.get("messages") if isinstance(body, dict) else None
    if not msgs or not isinstance(msgs[-1], dict) or msgs[-1].get("role") != "user":
        return []
    c = msgs[-1].get("content")
    if not isinstance(c, list):
        return []
    return [b for b in c if isinstance(b, dict) and b.get("type") == "tool_result"]


def tool_result_text(block):
    c = block.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        return "\n".join(b.get("text", "") for b in c if isinstance(b, dict) and b.get("type") == "text")
    return ""


def offered_tool(body, want):
    """The name of the offered tool matching `want` (exact or "...__want"), else None."""
    for t in (body.get("tools") or []) if isinstance(body, dict) else []:
        name = t.get("name") if isinstance(t, dict) else None
        if name and (name == want or name.endswith("__" + want)):
            return name
    return None


def fake_from_schema(schema):
    t = schema.get("type")
    if t == "object":
        return {k: fake_from_schema(v) for k, v in (schema.get("properties") or {}).items()}
    if t == "array":
        return []
    if t in ("integer", "number"):
        return 0
    if t == "boolean":
        return False
    return "Mock session title"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "mock-anthropic/1.0"

    def log_message(self, fmt, *args):  # quiet stderr
        sys.stderr.write("[mock] %s %s\n" % (self.address_string(), fmt % args))

    # ---------- helpers ----------
    def _read_body(self):
        n = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            return raw, json.loads(raw) if raw else None
        except Exception:
            return raw, None

    def _send_json(self, code, obj, extra_headers=None):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.send_header("request-id", "req_mock_" + uuid.uuid4().hex[:16])
        for k, v in (extra_headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _chunk(self, data: bytes):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _begin_sse(self):
        """The status line and headers of a streamed (SSE) answer."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("cache-control", "no-cache")
        self.send_header("transfer-encoding", "chunked")
        self.send_header("request-id", "req_mock_" + uuid.uuid4().hex[:16])
        self.end_headers()

    def _sse(self, event, obj):
        self._chunk(("event: %s\ndata: %s\n\n" % (event, json.dumps(obj))).encode())

    def _log_request(self, body, raw):
        with LOCK:
            STATE["count"] += 1
            n = STATE["count"]
            mode = STATE["mode"]
        hdrs = {k: self.headers.get(k) for k in HEADERS_TO_LOG if self.headers.get(k) is not None}
        if "x-api-key" in hdrs:
            hdrs["x-api-key"] = hdrs["x-api-key"][:6] + "..."
        if "authorization" in hdrs:
            hdrs["authorization"] = hdrs["authorization"][:12] + "..."
        log_line({
            "n": n, "t": time.time(), "method": self.command, "path": self.path,
            "mode": mode, "headers": hdrs,
            "body": body if body is not None else (raw.decode("utf-8", "replace") if raw else None),
        })
        return n, mode

    # ---------- verbs ----------
    def do_GET(self):
        if self.path.startswith("/_mock/config"):
            return self._send_json(200, {k: STATE[k] for k in ("mode", "delay", "delay_phase", "reply", "count")})
        if self.path.startswith("/_mock/requests"):
            return self._send_json(200, {"count": STATE["count"], "message_posts": STATE["message_posts"]})
        self._log_request(None, b"")
        self._send_json(404, {"type": "error", "error": {"type": "not_found_error", "message": "mock: no GET " + self.path}})

    def do_HEAD(self):
        self._log_request(None, b"")
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self):
        raw, body = self._read_body()
        if self.path.startswith("/_mock/config"):
            with LOCK:
                for k in ("mode", "delay", "delay_phase", "reply", "tool", "tool_input"):
                    if isinstance(body, dict) and k in body:
                        STATE[k] = body[k]
            return self._send_json(200, {k: STATE[k] for k in ("mode", "delay", "delay_phase", "reply")})

        n, mode = self._log_request(body, raw)
        path = self.path.split("?", 1)[0]

        if path == "/v1/messages/count_tokens":
            return self._send_json(200, {"input_tokens": rough_tokens(body)})

        if path != "/v1/messages":
            return self._send_json(404, {"type": "error", "error": {"type": "not_found_error", "message": "mock: no POST " + path}})

        with LOCK:
            STATE["message_posts"] += 1
        # ---- failure modes ----
        if mode == "error500":
            return self._send_json(500, {"type": "error", "error": {"type": "api_error", "message": "mock internal error"}})
        if mode == "error529":
            return self._send_json(529, {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
        if mode == "reset":
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except Exception:
                pass
            self.close_connection = True
            return
        if mode == "hang":
            # never answer; return when the client goes away
            self.connection.settimeout(1.0)
            while True:
                try:
                    if self.connection.recv(1, socket.MSG_PEEK) == b"":
                        break
                except socket.timeout:
                    continue
                except Exception:
                    break
            self.close_connection = True
            return

        # ---- ok ----
        body = body or {}
        with LOCK:
            STATE["message_count"] += 1
            mcount = STATE["message_count"]
            reply = STATE["reply"]
            delay = float(STATE["delay"] or 0)
            phase = STATE["delay_phase"]
            want_tool = STATE["tool"]
            tool_input = STATE["tool_input"]
        fmt = ((body.get("output_config") or {}).get("format") or {})
        tool_call = None
        if want_tool and fmt.get("type") != "json_schema":
            results = last_tool_results(body)
            for r in results:
                log_line({"n": n, "t": time.time(), "event": "tool_result",
                          "tool_use_id": r.get("tool_use_id"), "is_error": bool(r.get("is_error")),
                          "content": r.get("content"), "text": tool_result_text(r)})
            if not results and body.get("tools"):
                tool_call = offered_tool(body, want_tool)
                if tool_call is None:
                    log_line({"n": n, "t": time.time(), "event": "tool_not_offered", "tool": want_tool,
                              "tools": [t.get("name") for t in body.get("tools") if isinstance(t, dict)]})
        if tool_call is not None:
            return self._tool_use(body, n, tool_call, tool_input or {})
        if fmt.get("type") == "json_schema":
            # structured output (e.g. Claude Code's session-title request): answer valid JSON
            reply = json.dumps(fake_from_schema(fmt.get("schema") or {}))
        elif reply is None:
            reply = "mock reply #%d" % mcount
        model = body.get("model", "claude-mock")
        msg_id = "msg_mock_%06d" % n
        in_tok = rough_tokens(body)
        out_tok = max(1, len(reply) // 4)

        if delay and phase == "before":
            time.sleep(delay)

        if not body.get("stream"):
            return self._send_json(200, {
                "id": msg_id, "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": reply}],
                "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": in_tok, "output_tokens": out_tok,
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
            })

        try:
            self._begin_sse()
            self._sse("message_start", {"type": "message_start", "message": {
                "id": msg_id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": in_tok, "output_tokens": 1,
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}})
            self._sse("ping", {"type": "ping"})
            if delay and phase == "during":
                end = time.time() + delay
                while time.time() < end:
                    time.sleep(min(1.0, end - time.time()))
                    self._sse("ping", {"type": "ping"})
            self._sse("content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": {"type": "text", "text": ""}})
            # two deltas to look like a real stream
            half = max(1, len(reply) // 2)
            for piece in (reply[:half], reply[half:]):
                if piece:
                    self._sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                      "delta": {"type": "text_delta", "text": piece}})
            self._sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            self._sse("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                        "usage": {"output_tokens": out_tok}})
            self._sse("message_stop", {"type": "message_stop"})
            self._chunk(b"")  # terminating zero-length chunk
        except (BrokenPipeError, ConnectionResetError):
            log_line({"n": n, "t": time.time(), "event": "client_disconnected_mid_stream"})
            self.close_connection = True


    def _tool_use(self, body, n, name, tool_input):
        """One tool_use block calling `name` with `tool_input`; stop_reason tool_use."""
        model = body.get("model", "claude-mock")
        msg_id = "msg_mock_%06d" % n
        tool_id = "toolu_mock_%06d" % n
        usage = {"input_tokens": rough_tokens(body), "output_tokens": 10,
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        log_line({"n": n, "t": time.time(), "event": "tool_use", "id": tool_id, "name": name,
                  "input": tool_input})
        if not body.get("stream"):
            return self._send_json(200, {
                "id": msg_id, "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "tool_use", "id": tool_id, "name": name, "input": tool_input}],
                "stop_reason": "tool_use", "stop_sequence": None, "usage": usage,
            })
        try:
            self._begin_sse()
            self._sse("message_start", {"type": "message_start", "message": {
                "id": msg_id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": dict(usage, output_tokens=1)}})
            self._sse("content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": {"type": "tool_use", "id": tool_id,
                                                                "name": name, "input": {}}})
            self._sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "input_json_delta",
                                                        "partial_json": json.dumps(tool_input)}})
            self._sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            self._sse("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                                        "usage": {"output_tokens": 10}})
            self._sse("message_stop", {"type": "message_stop"})
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            log_line({"n": n, "t": time.time(), "event": "client_disconnected_mid_stream"})
            self.close_connection = True


def main():
    global LOG_PATH
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file")
    ap.add_argument("--log", default="requests.jsonl")
    ap.add_argument("--mode", default="ok", choices=["ok", "error500", "error529", "hang", "reset"])
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--delay-phase", default="during", choices=["before", "during"])
    ap.add_argument("--reply", default=None)
    ap.add_argument("--tool", default=None, help="answer with a tool_use of this (offered) tool")
    ap.add_argument("--tool-input", default="{}", help="JSON input of that tool_use")
    a = ap.parse_args()
    LOG_PATH = a.log
    STATE.update(mode=a.mode, delay=a.delay, delay_phase=a.delay_phase, reply=a.reply)
    if a.tool:
        STATE.update(tool=a.tool, tool_input=json.loads(a.tool_input))
    srv = ThreadingHTTPServer((a.host, a.port), Handler)
    srv.daemon_threads = True
    port = srv.server_address[1]
    if a.port_file:
        with open(a.port_file, "w") as f:
            f.write(str(port))
    print("LISTENING %d" % port, flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
