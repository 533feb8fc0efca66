#!/usr/bin/env python3
"""Remote MCP with the real agent CLIs: an agent "on another machine" reaches `handoffs serve`'s
/mcp with a bearer token, configured exactly as docs/MCP.md ("Remote agents: MCP over HTTP")
shows, and sends a handoff with the `send_handoff` tool.

Offline: each CLI talks to a loopback mock model (tests/mocks/mock_messages.py for Claude Code,
tests/mocks/mock_responses.py for Codex) that answers the first request with a call of the MCP
tool and logs the tool's result. Every CLI runs with its own HOME and config folder.

Cases, per CLI:
  * configured as the docs show (Claude Code: `claude mcp add --transport http handoffs URL
    --header "Authorization: Bearer TOKEN"`, at its default scope: the docs' `--scope user`
    only changes where the setting is kept; Codex: `[mcp_servers.handoffs] url = ...
    bearer_token_env_var = "HANDOFFS_TOKEN"`), the CLI lists the server and the model's call of
    send_handoff lands in bob's inbox exactly once, sent as alice (the token's agent), with a
    result that is no error;
  * Claude Code only: the same through `--mcp-config` JSON (type http, url, headers);
  * a wrong token: the tools are not offered and nothing is stored;
  * alice's token revoked: the configuration that worked no longer offers the tools.

Usage: python3 tests/real_remote_mcp.py [--bin target/debug/handoffs] [--claude PATH] [--codex PATH]
The CLIs are found through --claude/--codex, HANDOFFS_CLAUDE_BIN/HANDOFFS_CODEX_BIN,
.ci/node/node_modules/.bin, then PATH. A missing CLI is skipped (and says so), except under
CI=true, where it fails. Each check prints "ok  name" or "FAIL name: detail"; the exit status is 1
when any failed. Every subprocess has a hard timeout; the whole run takes a few seconds.
"""
import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MOCKS = ROOT / "tests" / "mocks"
START = time.monotonic()
BUDGET = 55.0  # seconds for the whole run; every timeout is cut to what is left of it
FAILED = []
CHILDREN = []  # long-running processes we started (each leads its own process group)
WRONG_TOKEN = "hat_" + "0" * 64


def check(name, cond, detail=""):
    if cond:
        print("ok  " + name, flush=True)
    else:
        FAILED.append(name)
        print("FAIL %s: %s" % (name, detail), flush=True)
    return cond


def left(limit):
    return max(1.0, min(limit, BUDGET - (time.monotonic() - START)))


def kill_group(p):
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def run(cmd, env=None, cwd=None, timeout=30.0):
    """Runs cmd in its own process group; returns (code or "timeout", stdout, stderr)."""
    p = subprocess.Popen([str(c) for c in cmd], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = p.communicate(timeout=left(timeout))
        code = p.returncode
    except subprocess.TimeoutExpired:
        kill_group(p)
        out, err = p.communicate()
        code = "timeout"
    finally:
        # whatever the CLI left behind in its group (MCP helpers and the like)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def spawn(cmd, env=None, cwd=None, stdout=subprocess.DEVNULL):
    p = subprocess.Popen([str(c) for c in cmd], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                         stdout=stdout, stderr=subprocess.DEVNULL, start_new_session=True)
    CHILDREN.append(p)
    return p


def find_cli(name, given, env_var):
    for cand in (given, os.environ.get(env_var),
                 ROOT / ".ci" / "node" / "node_modules" / ".bin" / name, shutil.which(name)):
        if cand and Path(cand).is_file():
            return Path(cand)
    return None


class Handoffs:
    def __init__(self, binary, dir_):
        self.binary = binary
        self.env = base_env(dir_)
        self.env["HANDOFFS_DB"] = str(dir_ / "state" / "h.sqlite3")

    def ok(self, *args):
        code, out, err = run([self.binary, *args], env=self.env, timeout=15)
        if code != 0:
            raise RuntimeError("handoffs %s failed (%s): %s" % (" ".join(args), code, err.strip()))
        return out

    def bob_inbox(self):
        return json.loads(self.ok("--json", "inbox", "bob", "--all", "--limit", "1000"))

    def serve(self):
        """Starts `handoffs serve --port 0`; the /mcp URL from its first stdout line."""
        p = spawn([self.binary, "serve", "--port", "0"], env=self.env, stdout=subprocess.PIPE)
        line = b""
        deadline = time.monotonic() + left(15)
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            r, _, _ = select.select([p.stdout], [], [], 0.2)
            if r:
                b = os.read(p.stdout.fileno(), 1)
                if not b:
                    break
                line += b
        text = line.decode("utf-8", "replace")
        urls = [w for w in text.split() if w.startswith("http://")]
        if not urls:
            raise RuntimeError("serve printed no URL: %r" % text)
        # keep draining stdout so serve never blocks on a full pipe
        threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
        return urls[0].split("#")[0].rstrip("/") + "/mcp"


def base_env(home):
    env = {"PATH": os.pathsep.join([str(ROOT / ".ci" / "node" / "bin"), os.environ.get("PATH", "")]),
           "HOME": str(home), "LANG": "C.UTF-8",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    return env


class Mock:
    """A loopback mock model; its log is read from the offset of the current case on."""

    def __init__(self, script, dir_, extra):
        self.dir = dir_
        self.log = dir_ / "mock.jsonl"
        port_file = dir_ / "mock.port"
        spawn([sys.executable, MOCKS / script, "--port", "0", "--port-file", port_file,
               "--log", self.log, *extra])
        deadline = time.monotonic() + left(10)
        while time.monotonic() < deadline:
            try:
                self.port = int(port_file.read_text().strip())
                break
            except (OSError, ValueError):
                time.sleep(0.05)
        else:
            raise RuntimeError("mock %s did not start" % script)
        self.offset = 0

    def configure(self, obj):
        req = urllib.request.Request("http://127.0.0.1:%d/_mock/config" % self.port,
                                     data=json.dumps(obj).encode(), method="POST",
                                     headers={"content-type": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        opener.open(req, timeout=5).read()

    def mark(self):
        self.offset = self.log.stat().st_size if self.log.exists() else 0

    def events(self, kind=None):
        if not self.log.exists():
            return []
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            lines = f.read().decode("utf-8", "replace").splitlines()
        out = []
        for l in lines:
            try:
                e = json.loads(l)
            except ValueError:
                continue
            if "event" in e and (kind is None or e["event"] == kind):
                out.append(e)
        return out


def ours(inbox, body):
    return [m for m in inbox if m.get("body") == body]


def check_delivered(tag, h, body, title):
    got = ours(h.bob_inbox(), body)
    check(tag + ": bob's inbox holds exactly one such message", len(got) == 1,
          "%d messages with body %r" % (len(got), body))
    if got:
        m = got[0]
        check(tag + ": sent as alice (the token's agent), with the title",
              m.get("sender") == "alice" and m.get("title") == title,
              "sender %r title %r" % (m.get("sender"), m.get("title")))


def check_not_stored(tag, h, before, body, title):
    # bob (a demo agent) returns work on his own, so only what this case would send counts
    new = [m for m in h.bob_inbox() if m.get("id") not in before]
    bad = [m for m in new if m.get("body") == body or m.get("title") == title]
    check(tag + ": nothing is stored", not bad, "new messages in bob's inbox: %r" % bad)


def brief(out, err):
    return ("stdout %r stderr %r" % (out[-400:], err[-600:])).replace("\n", "\\n")


# ------------------------------------------------------------------------------ Claude Code
def claude_cases(claude, h, url, token, work):
    (work / "claude-mock").mkdir()
    mock = Mock("mock_messages.py", work / "claude-mock", ["--tool", "send_handoff"])
    proj = work / "claude-project"
    proj.mkdir()

    def env_for(name):
        home = work / ("claude-home-" + name)
        (home / "config").mkdir(parents=True)
        env = base_env(home)
        env.update({
            "CLAUDE_CONFIG_DIR": str(home / "config"),
            "ANTHROPIC_BASE_URL": "http://127.0.0.1:%d" % mock.port,
            "ANTHROPIC_API_KEY": "dummy",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_MAX_RETRIES": "0",
        })
        return env

    def mcp_add(env, tok):
        # docs/MCP.md, verbatim but for the URL and the token
        return run([claude, "mcp", "add", "--transport", "http", "handoffs", url,
                    "--header", "Authorization: Bearer " + tok], env=env, cwd=proj, timeout=20)

    def turn(env, tag, body, title, extra=()):
        mock.configure({"tool_input": {"to": "bob", "message": body, "title": title}})
        mock.mark()
        code, out, err = run([claude, "-p", "Hand bob the review, please.",
                              "--allowedTools", "mcp__handoffs__send_handoff", *extra],
                             env=env, cwd=proj, timeout=40)
        check(tag + ": claude -p exits 0", code == 0, "exit %s, %s" % (code, brief(out, err)))
        return code, out, err

    def check_called(tag, env, body, title, extra=()):
        turn(env, tag, body, title, extra)
        uses = mock.events("tool_use")
        check(tag + ": the model was offered mcp__handoffs__send_handoff and called it",
              [u.get("name") for u in uses] == ["mcp__handoffs__send_handoff"],
              "tool_use events %r, not offered: %r" % (uses, mock.events("tool_not_offered")))
        results = mock.events("tool_result")
        ok = (len(results) == 1 and not results[0].get("is_error")
              and '"created":true' in results[0].get("text", "")
              and '"to":"bob"' in results[0].get("text", ""))
        check(tag + ": the tool_result is no error and says created, to bob", ok,
              "tool_result events %r" % results)
        check_delivered(tag, h, body, title)

    def check_refused(tag, env, body, title, extra=()):
        before = {m.get("id") for m in h.bob_inbox()}
        turn(env, tag, body, title, extra)
        called = [r for r in mock.events("tool_result") if not r.get("is_error")]
        check(tag + ": send_handoff is not offered (or only fails)",
              mock.events("tool_not_offered") and not called,
              "not_offered %r, successful results %r" % (mock.events("tool_not_offered"), called))
        check_not_stored(tag, h, before, body, title)

    # 1. `claude mcp add --transport http ... --header "Authorization: Bearer …"` (the docs' form)
    env_ok = env_for("docs")
    code, out, err = mcp_add(env_ok, token)
    check("claude: `claude mcp add --transport http handoffs URL --header ...` exits 0",
          code == 0, "exit %s, %s" % (code, brief(out, err)))
    code, out, err = run([claude, "mcp", "list"], env=env_ok, cwd=proj, timeout=20)
    check("claude: `claude mcp list` shows handoffs connected",
          code == 0 and "handoffs" in out and "Connected" in out and "Failed" not in out,
          "exit %s, %s" % (code, brief(out, err)))
    check_called("claude (mcp add)", env_ok, "review the parser, from claude", "Parser review")

    # 2. the same server through --mcp-config JSON
    env_json = env_for("json")
    cfg = {"mcpServers": {"handoffs": {"type": "http", "url": url,
                                       "headers": {"Authorization": "Bearer " + token}}}}
    check_called("claude (--mcp-config)", env_json, "review the lexer, from claude",
                 "Lexer review", ["--strict-mcp-config", "--mcp-config", json.dumps(cfg)])

    # 3. a wrong token
    env_bad = env_for("wrong")
    mcp_add(env_bad, WRONG_TOKEN)
    code, out, err = run([claude, "mcp", "list"], env=env_bad, cwd=proj, timeout=20)
    check("claude (wrong token): `claude mcp list` does not show handoffs connected",
          "handoffs" in out and "Connected" not in out, "exit %s, %s" % (code, brief(out, err)))
    check_refused("claude (wrong token)", env_bad, "wrong token, from claude", "Wrong (claude)")
    return env_ok, check_refused


# ------------------------------------------------------------------------------ Codex
def codex_cases(codex, h, url, token, work):
    (work / "codex-mock").mkdir()
    mock = Mock("mock_responses.py", work / "codex-mock", ["--call", "send_handoff"])
    home = work / "codex-home"
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True)
    proj = work / "codex-project"
    proj.mkdir()
    config = (MOCKS / "config.example.toml").read_text().replace("PORT", str(mock.port))
    # docs/MCP.md, verbatim but for the URL
    config += '\n[mcp_servers.handoffs]\nurl = "%s"\nbearer_token_env_var = "HANDOFFS_TOKEN"\n' % url
    (codex_home / "config.toml").write_text(config)

    def env_with(tok):
        env = base_env(home)
        env.update({"CODEX_HOME": str(codex_home), "HANDOFFS_TOKEN": tok})
        return env

    def turn(env, tag, body, title):
        mock.configure({"call_args": {"to": "bob", "message": body, "title": title}})
        mock.mark()
        code, out, err = run([codex, "exec", "--skip-git-repo-check", "Hand bob the review, please."],
                             env=env, cwd=proj, timeout=40)
        check(tag + ": codex exec exits 0", code == 0, "exit %s, %s" % (code, brief(out, err)))

    def check_called(tag, env, body, title):
        turn(env, tag, body, title)
        calls = mock.events("function_call")
        check(tag + ": the model was offered send_handoff in namespace mcp__handoffs and called it",
              [(c.get("namespace"), c.get("name")) for c in calls] == [("mcp__handoffs", "send_handoff")],
              "function_call events %r, not offered: %r" % (calls, mock.events("call_not_offered")))
        outs = mock.events("function_call_output")
        text = str(outs[0].get("output")) if len(outs) == 1 else ""
        check(tag + ": the call's output is no error and says created, to bob",
              '"created":true' in text and '"to":"bob"' in text, "outputs %r" % outs)
        check_delivered(tag, h, body, title)

    def check_refused(tag, env, body, title):
        before = {m.get("id") for m in h.bob_inbox()}
        turn(env, tag, body, title)
        outs = [o for o in mock.events("function_call_output") if '"created":true' in str(o.get("output"))]
        check(tag + ": send_handoff is not offered (or only fails)",
              mock.events("call_not_offered") and not outs,
              "not_offered %r, successful outputs %r" % (mock.events("call_not_offered"), outs))
        check_not_stored(tag, h, before, body, title)

    env_ok = env_with(token)
    code, out, err = run([codex, "mcp", "list"], env=env_ok, cwd=proj, timeout=20)
    check("codex: `codex mcp list` shows handoffs with bearer_token_env_var HANDOFFS_TOKEN",
          code == 0 and "handoffs" in out and "HANDOFFS_TOKEN" in out,
          "exit %s, %s" % (code, brief(out, err)))
    check_called("codex (config.toml)", env_ok, "review the planner, from codex", "Planner review")
    check_refused("codex (wrong token)", env_with(WRONG_TOKEN), "wrong token, from codex", "Wrong (codex)")
    return env_ok, check_refused


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(ROOT / "target" / "debug" / "handoffs"))
    ap.add_argument("--claude")
    ap.add_argument("--codex")
    a = ap.parse_args()
    # SIGTERM (CI's timeout, say) unwinds like Ctrl+C, so `finally` kills what was started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ci = os.environ.get("CI") == "true"
    binary = Path(a.bin).resolve()
    if not binary.is_file():
        print("FAIL setup: no handoffs binary at %s" % binary)
        return 1
    clis = {"claude": find_cli("claude", a.claude, "HANDOFFS_CLAUDE_BIN"),
            "codex": find_cli("codex", a.codex, "HANDOFFS_CODEX_BIN")}
    for name, path in clis.items():
        if path is None:
            if ci:
                check("%s CLI installed" % name, False, "missing under CI=true: run .ci/run, "
                      "or set HANDOFFS_%s_BIN" % name.upper())
            else:
                print("skipped: the %s CLI is not installed (set HANDOFFS_%s_BIN)" % (name, name.upper()))
    work = Path(tempfile.mkdtemp(prefix="real-remote-mcp-"))
    try:
        h = Handoffs(binary, work)
        h.ok("init")
        h.ok("agent", "add", "alice", "--provider", "demo")
        h.ok("agent", "add", "bob", "--provider", "demo")
        token = h.ok("agent", "token", "alice").strip()
        check("setup: alice's token looks like hat_…", token.startswith("hat_"), repr(token))
        url = h.serve()
        revoked = []  # (name, env, check_refused) of each CLI whose cases ran
        if clis["claude"]:
            revoked.append(("claude",) + claude_cases(clis["claude"], h, url, token, work))
        if clis["codex"]:
            revoked.append(("codex",) + codex_cases(clis["codex"], h, url, token, work))
        if revoked:
            # the configuration that worked, with alice's token revoked
            h.ok("agent", "token", "alice", "--revoke")
            for name, env, refused in revoked:
                refused("%s (revoked token)" % name, env, "after revoke, from " + name,
                        "Revoked (%s)" % name)
            senders = {m.get("sender") for m in h.bob_inbox()}
            check("all: every message in bob's inbox is from alice", senders <= {"alice"}, repr(senders))
    except Exception as e:  # a broken setup is a failure, not a crash
        check("run", False, "%s: %s" % (type(e).__name__, e))
    finally:
        for p in reversed(CHILDREN):
            kill_group(p)
        shutil.rmtree(work, ignore_errors=True)
    print("%s in %.1f s" % ("FAILED: " + ", ".join(FAILED) if FAILED else "all passed",
                            time.monotonic() - START))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
