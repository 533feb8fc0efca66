#!/usr/bin/env python3
"""Loopback mock of the OpenAI Responses API, just enough for `codex` to finish a turn.

Python 3 stdlib only.  Serves:
  POST /v1/responses   (stream: true)  -> SSE: response.created, output_item.added,
                                           output_text.delta, output_item.done,
                                           response.completed
  GET  /v1/models                       -> {"object":"list","data":[],"models":[]}
  GET  /_mock/state                     -> current settings + request count (for tests)
  POST /_mock/config  {"mode":..,"delay":..,"reply":..}  -> change settings at runtime
  anything else                         -> 404 JSON (logged)

Settings (argv wins over env):
  --port N        / MOCK_PORT        (0 = pick a free port; default 0)
  --host H        / MOCK_HOST        (default 127.0.0.1 -- loopback only)
  --delay S       / MOCK_DELAY       seconds to wait after response.created before the text
  --mode M        / MOCK_MODE        ok | 500 | hang | close
                     ok    = normal SSE reply
                     500   = HTTP 500 JSON error on every POST /v1/responses
                     hang  = read the request, never send a byte (socket stays open)
                     close = read the request, close the socket without a response
  --reply TEXT    / MOCK_REPLY       assistant text; "{input}" is replaced with the last
                                     user text (default "mock reply to: {input}")
  --sse S         / MOCK_SSE         full (default) | minimal (only output_item.done +
                                     response.completed -- the two events Codex needs)
                                     | nocomplete (output_item.done, then EOF: shows the
                                     "stream closed before response.completed" failure)
  --log FILE      / MOCK_LOG         JSONL log, one line per HTTP request (default ./mock_requests.jsonl)
  --port-file F   / MOCK_PORT_FILE   write the bound port here once listening

Per-message override: a user text containing "[delay=5]" makes that reply wait 5 s,
"[mode=500]" / "[mode=hang]" switches mode for that request only, and "[tool=touch x]" makes
the model first call `exec_command` with that command (the answer after Codex returns the
call's output is the usual reply), so a turn can need an approval.

MCP tool calls (--call NAME [--call-args JSON] / MOCK_CALL, MOCK_CALL_ARGS, or POST
/_mock/config {"call":..,"call_args":..}; off by default): a POST /v1/responses whose `tools`
offer NAME -- a function named NAME or "...__NAME", or a function NAME inside a `namespace`
tool (how Codex offers an MCP server's tools: namespace "mcp__<server>") -- and whose input
carries no function_call_output is answered with one `function_call` of it (with "namespace"
when it came from one), arguments --call-args (default {}). The request that carries the
output gets the usual reply, and each output is logged as one line
  {"event": "function_call_output", "call_id", "output"}.
A request with tools but without NAME is logged as {"event": "call_not_offered", "tools": [...]}
(namespaces as "ns/tool") and gets the usual reply.

Each log line: {"ts","n","method","path","thread_id","turn_id" (from body.client_metadata),
               "headers":{...},"body":<parsed JSON or text>,
               "user_texts":[...all role=user input_text strings in body.input, incl. the
                             <environment_context> block Codex injects...],
               "last_user_text": "..."}
"""
import argparse
import json
import os
import re
import socketserver
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer

LOCK = threading.Lock()
STATE = {"mode": "ok", "delay": 0.0, "reply": "mock reply to: {input}", "count": 0, "sse": "full",
         "call": None, "call_args": {}}
LOG_PATH = "mock_requests.jsonl"
LOG_HEADERS = ("authorization", "content-type", "accept", "user-agent", "originator",
               "session_id", "session-id", "x-codex-turn-metadata", "version",
               "openai-beta", "chatgpt-account-id", "content-encoding", "x-client-request-id")


def user_texts(body):
    """All text parts of role=user messages in a Responses request body."""
    out = []
    if not isinstance(body, dict):
        return out
    items = body.get("input") or []
    if isinstance(items, str):
        return [items]
    for it in items:
        if not isinstance(it, dict) or it.get("role") != "user":
            continue
        content = it.get("content")
        if isinstance(content, str):
            out.append(content)
            continue
        for part in content or []:
            if isinstance(part, dict) and part.get("type") in ("input_text", "text"):
                out.append(part.get("text", ""))
    return out


def has_call_output(body):
    """Whether the request already carries a function call's output (the call was answered)."""
    items = body.get("input") if isinstance(body, dict) else None
    return isinstance(items, list) and any(
        isinstance(i, dict) and i.get("type") == "function_call_output" for i in items)


def call_outputs(body):
    """The function_call_output items of a Responses request body."""
    items = body.get("input") if isinstance(body, dict) else None
    return [i for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"] \
        if isinstance(items, list) else []


def offered_tools(body):
    """(namespace or None, name) of every function tool offered, namespaces opened."""
    out = []
    for t in (body.get("tools") or []) if isinstance(body, dict) else []:
        if not isinstance(t, dict):
            continue
        if t.get("type") == "namespace":
            for sub in t.get("tools") or []:
                if isinstance(sub, dict) and sub.get("name"):
                    out.append((t.get("name"), sub["name"]))
        elif t.get("name"):
            out.append((None, t["name"]))
    return out


def find_tool(body, want):
    for ns, name in offered_tools(body):
        if name == want or name.endswith("__" + want):
            return ns, name
    return None


def log_request(entry):
    with LOCK:
        with open(LOG_PATH, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "mock-responses/1"

    def log_message(self, fmt, *args):  # quiet; requests go to the JSONL log
        sys.stderr.write("mock: " + (fmt % args) + "\n")

    # ---------------------------------------------------------------- helpers
    def _read_body(self):
        n = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(n) if n else b""
        if self.headers.get("content-encoding", "").lower() == "zstd":
            return raw, None  # cannot decode zstd with stdlib; logged as note
        if self.headers.get("content-encoding", "").lower() in ("gzip",):
            import gzip
            raw = gzip.decompress(raw)
        return raw, True

    def _json(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _entry(self, body_obj, note=None):
        with LOCK:
            STATE["count"] += 1
            n = STATE["count"]
        hdrs = {k: v for k, v in self.headers.items() if k.lower() in LOG_HEADERS}
        texts = user_texts(body_obj)
        cm = body_obj.get("client_metadata") if isinstance(body_obj, dict) else None
        cm = cm if isinstance(cm, dict) else {}
        e = {"ts": time.time(), "n": n, "method": self.command, "path": self.path,
             "thread_id": cm.get("thread_id"), "turn_id": cm.get("turn_id"),
             "headers": hdrs, "user_texts": texts,
             "last_user_text": texts[-1] if texts else None, "body": body_obj}
        if note:
            e["note"] = note
        return e

    # ---------------------------------------------------------------- verbs
    def do_GET(self):
        path = self.path.split("?")[0]
        log_request(self._entry(None))
        if path == "/_mock/state":
            with LOCK:
                return self._json(200, dict(STATE))
        if path.endswith("/models"):
            return self._json(200, {"object": "list", "data": [], "models": []})
        return self._json(404, {"error": {"message": "not found: " + path}})

    def do_POST(self):
        path = self.path.split("?")[0]
        raw, ok = self._read_body()
        note = None
        try:
            body = json.loads(raw.decode("utf-8")) if raw else None
        except Exception:
            body, note = raw.decode("utf-8", "replace"), "body not JSON"
        if ok is None:
            note = "zstd-compressed body (not decoded)"
        entry = self._entry(body, note)
        log_request(entry)

        if path == "/_mock/config":
            with LOCK:
                for k in ("mode", "delay", "reply", "sse", "call", "call_args"):
                    if isinstance(body, dict) and k in body:
                        STATE[k] = float(body[k]) if k == "delay" else body[k]
                return self._json(200, dict(STATE))
        if not path.endswith("/responses"):
            return self._json(404, {"error": {"message": "not found: " + path}})

        with LOCK:
            mode, delay, reply, sse = STATE["mode"], STATE["delay"], STATE["reply"], STATE["sse"]
        last = entry["last_user_text"] or ""
        m = re.search(r"\[delay=([0-9.]+)\]", last)
        if m:
            delay = float(m.group(1))
        m = re.search(r"\[mode=(\w+)\]", last)
        if m:
            mode = m.group(1)

        if mode == "500":
            return self._json(500, {"error": {"type": "server_error", "code": "server_error",
                                              "message": "mock: model unavailable"}})
        if mode == "hang":
            # keep the socket open, never answer; ends when the client hangs up
            while True:
                time.sleep(3600)
        if mode == "close":
            self.close_connection = True
            self.connection.shutdown(2)
            return
        m = re.search(r"\[tool=([^\]]+)\]", last)
        if m and not has_call_output(body):
            return self._stream_call(m.group(1))
        with LOCK:
            want, call_args = STATE["call"], STATE["call_args"]
        if want:
            outs = call_outputs(body)
            for o in outs:
                log_request({"ts": time.time(), "n": entry["n"], "event": "function_call_output",
                             "call_id": o.get("call_id"), "output": o.get("output")})
            if not outs and isinstance(body, dict) and body.get("tools"):
                found = find_tool(body, want)
                if found:
                    return self._stream_call(None, found, call_args or {})
                log_request({"ts": time.time(), "n": entry["n"], "event": "call_not_offered",
                             "call": want, "tools": [n if ns is None else ns + "/" + n
                                                     for ns, n in offered_tools(body)]})
        self._stream_ok(body, reply.replace("{input}", last.strip()[:200]), delay, sse)

    def _stream_call(self, cmd, tool=None, args=None):
        """One function call of `exec_command` running `cmd` (or of `tool`, a (namespace or
        None, name) pair, with `args`), then the response ends."""
        resp_id = "resp_" + uuid.uuid4().hex[:24]
        item = {"id": "fc_" + uuid.uuid4().hex[:24], "type": "function_call", "status": "completed",
                "name": "exec_command", "call_id": "call_" + uuid.uuid4().hex[:24],
                "arguments": json.dumps({"cmd": cmd, "sandbox_permissions": "require_escalated",
                                         "justification": "the mock asks to run %s" % cmd})}
        if tool is not None:
            ns, name = tool
            item.update(name=name, arguments=json.dumps(args))
            if ns is not None:
                item["namespace"] = ns
            log_request({"ts": time.time(), "event": "function_call", "call_id": item["call_id"],
                         "namespace": ns, "name": name, "arguments": args})
        usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": 15}
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            for obj in ({"type": "response.output_item.done", "output_index": 0, "item": item},
                        {"type": "response.completed", "response": {"id": resp_id, "usage": usage}}):
                data = "event: %s\ndata: %s\n\n" % (obj["type"], json.dumps(obj))
                self.wfile.write(data.encode())
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass

    # ---------------------------------------------------------------- SSE
    def _stream_ok(self, body, text, delay, sse="full"):
        resp_id = "resp_" + uuid.uuid4().hex[:24]
        msg_id = "msg_" + uuid.uuid4().hex[:24]
        model = (body or {}).get("model", "mock-model") if isinstance(body, dict) else "mock-model"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")  # body ends when we close the socket
        self.end_headers()
        self.close_connection = True

        def ev(obj):
            data = "event: %s\ndata: %s\n\n" % (obj["type"], json.dumps(obj))
            self.wfile.write(data.encode())
            self.wfile.flush()

        base = {"id": resp_id, "object": "response", "model": model, "created_at": int(time.time())}
        item = {"id": msg_id, "type": "message", "role": "assistant", "status": "in_progress",
                "content": []}
        done = dict(item, status="completed",
                    content=[{"type": "output_text", "text": text, "annotations": []}])
        usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": 15}
        try:
            if sse in ("minimal", "nocomplete"):
                if delay > 0:
                    time.sleep(delay)
                ev({"type": "response.output_item.done", "output_index": 0, "item": done})
                if sse == "minimal":
                    ev({"type": "response.completed", "response": {"id": resp_id, "usage": usage}})
                return
            ev({"type": "response.created", "response": dict(base, status="in_progress", output=[])})
            if delay > 0:
                time.sleep(delay)
            ev({"type": "response.output_item.added", "output_index": 0, "item": item})
            ev({"type": "response.content_part.added", "item_id": msg_id, "output_index": 0,
                "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
            ev({"type": "response.output_text.delta", "item_id": msg_id, "output_index": 0,
                "content_index": 0, "delta": text})
            ev({"type": "response.output_text.done", "item_id": msg_id, "output_index": 0,
                "content_index": 0, "text": text})
            ev({"type": "response.output_item.done", "output_index": 0, "item": done})
            ev({"type": "response.completed",
                "response": dict(base, status="completed", output=[done], usage=usage)})
        except (BrokenPipeError, ConnectionResetError):
            pass  # client hung up (e.g. turn/interrupt)


class Server(socketserver.ThreadingMixIn, HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def main():
    global LOG_PATH
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default=os.environ.get("MOCK_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("MOCK_PORT", "0")))
    ap.add_argument("--delay", type=float, default=float(os.environ.get("MOCK_DELAY", "0")))
    ap.add_argument("--mode", default=os.environ.get("MOCK_MODE", "ok"),
                    choices=["ok", "500", "hang", "close"])
    ap.add_argument("--reply", default=os.environ.get("MOCK_REPLY", STATE["reply"]))
    ap.add_argument("--sse", default=os.environ.get("MOCK_SSE", "full"), choices=["full", "minimal", "nocomplete"])
    ap.add_argument("--call", default=os.environ.get("MOCK_CALL"),
                    help="answer with a function_call of this offered (MCP) tool")
    ap.add_argument("--call-args", default=os.environ.get("MOCK_CALL_ARGS", "{}"),
                    help="JSON arguments of that call")
    ap.add_argument("--log", default=os.environ.get("MOCK_LOG", LOG_PATH))
    ap.add_argument("--port-file", default=os.environ.get("MOCK_PORT_FILE"))
    a = ap.parse_args()
    STATE.update(mode=a.mode, delay=a.delay, reply=a.reply, sse=a.sse)
    if a.call:
        STATE.update(call=a.call, call_args=json.loads(a.call_args))
    LOG_PATH = a.log
    srv = Server((a.host, a.port), Handler)
    port = srv.server_address[1]
    if a.port_file:
        with open(a.port_file + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(a.port_file + ".tmp", a.port_file)
    print("mock_responses listening on http://%s:%d/v1 mode=%s delay=%s log=%s"
          % (a.host, port, a.mode, a.delay, LOG_PATH), flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
