#!/usr/bin/env python3
"""End-to-end test of `handoffs mcp` driven by the official Python MCP SDK (package `mcp` 2.3).

Run it with the Python that has the SDK installed, against an already-built binary:

    /tmp/mcpvenv/bin/python tests/mcp_sdk.py                      # all checks, default binary
    /tmp/mcpvenv/bin/python tests/mcp_sdk.py --bin path/to/handoffs
    /tmp/mcpvenv/bin/python tests/mcp_sdk.py --only 2,4           # a subset of the checks

It never builds anything. Each run makes a fresh temporary database (HANDOFFS_DB), registers
alice, bob and carol (provider demo) and gives each check its own `git init`-ed project root,
so the ledger's one-writer lease of one check never meets another's.

Each check prints one line per assertion, "ok  <name>" or "FAIL <name>: detail", and the run
exits 1 if any fails. The checks:
  1 tools/list over mode="legacy" (initialize) and mode="auto" (server/discover)
  2 a handoff and a work item: send, inbox, read, accept, return, close
  3 identity guard: sender-naming arguments are refused and nothing is stored
  4 the one writer lease under a two-process race, five rounds
  5 the handoff budget: the third pass of a cap-2 task stops in needs_human; CLI resume
  6 wait_for_messages wakes on a new message, and times out when nothing comes
  7 raw stdio probes before/after initialize (no SDK)
  8 bad input for every tool: no arguments, wrong types, 300,000-character strings
  9 the context library tools (--context-library)
 10 remote MCP over Streamable HTTP (`serve`'s /mcp, bearer tokens): tools, a handoff between
    two agents, spoofing refused, a wrong and a missing token refused

Planted-bug mode, for a binary built with the `planted-bugs` feature:

    /tmp/mcpvenv/bin/python tests/mcp_sdk.py --expect-broken spoof   # HANDOFFS_PLANT=mcp_spoof
    /tmp/mcpvenv/bin/python tests/mcp_sdk.py --expect-broken remote-spoof  # the same, over HTTP
    /tmp/mcpvenv/bin/python tests/mcp_sdk.py --expect-broken lease   # HANDOFFS_PLANT=lease_race

runs only that check with the plant set for the servers and exits 0 iff the check FAILS.

Options: --bin PATH (default /work/main/target/debug/handoffs; if it is missing, e.g. while
being relinked, the script waits for it), --only N,M, --keep (keep the temporary folder).
Dependencies: the standard library and `mcp`. The whole run takes about 5 s (limit: 60 s).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS

DEFAULT_BIN = "/work/main/target/debug/handoffs"
AGENTS = ("alice", "bob", "carol")

HANDOFF_TOOLS = [
    "send_handoff", "inbox", "read_message", "accept_work", "return_work", "close_work",
    "handoff_status", "list_agents", "wait_for_messages", "create_handoff", "claim_handoff",
    "renew_handoff", "pass_handoff", "complete_handoff", "show_handoff", "list_handoffs",
    "cancel_chain", "spend_budget", "list_topics", "subscribe", "unsubscribe", "publish",
    "read_topic", "get_artifact", "fan_out", "trace_chain", "fanout_status",
]
CONTEXT_TOOLS = [
    "context_brief", "context_search", "context_get", "context_record", "context_supersede",
    "context_status", "context_put", "context_keys",
]
READ_ONLY = {"inbox", "list_agents", "handoff_status", "show_handoff", "list_handoffs", "list_topics", "get_artifact", "trace_chain", "fanout_status"}
CONTEXT_READ_ONLY = {"context_brief", "context_search", "context_get", "context_status", "context_keys"}
WRITES = {
    "send_handoff", "accept_work", "return_work", "close_work", "create_handoff", "claim_handoff",
    "renew_handoff", "pass_handoff", "complete_handoff", "context_record", "context_supersede", "context_put",
    "cancel_chain", "spend_budget", "publish", "read_topic", "fan_out",
}

ONE_OF_REQUIRED = {"context_get"}
CALL_TIMEOUT = 10.0  # seconds, per tool call
CHECK_TIMEOUT = 40.0  # seconds, per check


# ----------------------------------------------------------------- reporting

FAILURES: list[str] = []
PASSES: list[str] = []


def report(name: str, ok: bool, detail: str = "", note: str = "") -> bool:
    """One line: `ok  name  (note)`, or `FAIL name: detail`."""
    if ok:
        PASSES.append(name)
        print(f"ok  {name}" + (f"  ({note})" if note else ""), flush=True)
    else:
        FAILURES.append(name)
        print(f"FAIL {name}: {detail}", flush=True)
    return ok


def short(value: Any, n: int = 300) -> str:
    s = value if isinstance(value, str) else json.dumps(value, default=str)
    return s if len(s) <= n else s[:n] + f"... ({len(s)} chars)"


# ----------------------------------------------------------------- environment

class Env:
    """One run's binary, database and temporary folders."""

    def __init__(self, bin_path: str, plant: str | None):
        self.bin = bin_path
        self.plant = plant
        self.tmp = Path(tempfile.mkdtemp(prefix="handoffs-mcp-sdk-"))
        self.db = self.tmp / "h.sqlite3"

    def wait_bin(self, seconds: float = 120.0) -> None:
        """The binary may be rebuilt under us: wait for it to be there again."""
        deadline = time.monotonic() + seconds
        told = False
        while not os.access(self.bin, os.X_OK):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.bin} is missing (waited {seconds:.0f} s)")
            if not told:
                print(f"--  {self.bin} is missing; waiting up to {seconds:.0f} s for it", flush=True)
                told = True
            time.sleep(0.5)

    def server_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {"HANDOFFS_DB": str(self.db), "HANDOFFS_LOG": "error"}
        if self.plant:
            env["HANDOFFS_PLANT"] = self.plant
        env.update(extra or {})
        return env

    def cli_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HANDOFFS_")}
        env.update(self.server_env())
        return env

    def cli(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        for attempt in range(5):
            self.wait_bin()
            try:
                return subprocess.run(
                    [self.bin, *args], cwd=cwd or self.tmp, env=self.cli_env(),
                    capture_output=True, text=True, timeout=30,
                )
            except OSError:  # e.g. ETXTBSY while the linker rewrites it
                if attempt == 4:
                    raise
                time.sleep(1)
        raise AssertionError("unreachable")

    def cli_json(self, *args: str, cwd: Path | None = None) -> Any:
        p = self.cli("--json", *args, cwd=cwd)
        if p.returncode != 0:
            raise RuntimeError(f"handoffs {' '.join(args)} exited {p.returncode}: {p.stderr.strip()}")
        return json.loads(p.stdout)

    def project(self, name: str) -> Path:
        """A fresh project root: a git repository of its own."""
        root = self.tmp / name
        root.mkdir()
        subprocess.run(["git", "init", "-q", str(root)], check=True)
        return root

    def setup(self) -> None:
        for args in (("init",), *(("agent", "add", a, "--provider", "demo") for a in AGENTS)):
            p = self.cli(*args)
            if p.returncode != 0:
                raise RuntimeError(f"setup `handoffs {' '.join(args)}` failed: {p.stderr.strip()}")

    @asynccontextmanager
    async def connect(self, agent: str, cwd: Path, mode: str = "legacy", extra: tuple[str, ...] = ()):
        """An SDK client connected to `handoffs mcp --agent AGENT` started in `cwd`."""
        params = StdioServerParameters(
            command=self.bin, args=["mcp", "--agent", agent, *extra],
            env=self.server_env(), cwd=str(cwd),
        )
        async with AsyncExitStack() as stack:
            for attempt in range(5):
                self.wait_bin()
                try:
                    client = await stack.enter_async_context(
                        Client(params, mode=mode, cache=None, read_timeout_seconds=15)
                    )
                    break
                except OSError:
                    if attempt == 4:
                        raise
                    await anyio.sleep(1)
            yield client


@dataclass
class R:
    """A tool result, flattened."""

    err: bool
    data: dict[str, Any] | None
    text: str

    def __str__(self) -> str:
        return f"isError={self.err} " + (short(self.data) if self.data is not None else repr(short(self.text)))


async def call(c: Client, name: str, args: dict[str, Any] | None = None, timeout: float = CALL_TIMEOUT) -> R:
    r = await c.call_tool(name, args, read_timeout_seconds=timeout)
    text = " ".join(getattr(b, "text", "") or "" for b in r.content)
    return R(bool(r.is_error), r.structured_content, text)


def get(d: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


# ----------------------------------------------------------------- 1. tools/list

async def check_tools_list(env: Env) -> None:
    root = env.project("p1")
    listings: dict[str, dict[str, Any]] = {}
    for mode in ("legacy", "auto"):
        async with env.connect("alice", root, mode=mode) as c:
            version = c.protocol_version
            want = HANDSHAKE_PROTOCOL_VERSIONS if mode == "legacy" else MODERN_PROTOCOL_VERSIONS
            report(f"tools/list[{mode}] negotiates a {'handshake' if mode == 'legacy' else 'modern'} protocol version",
                   version in want, f"got {version!r}, expected one of {list(want)}", note=version)
            tools = {t.name: t for t in (await c.list_tools()).tools}
            listings[mode] = tools
            missing = [n for n in HANDOFF_TOOLS if n not in tools]
            extra = [n for n in tools if n not in HANDOFF_TOOLS]
            report(f"tools/list[{mode}] names the {len(HANDOFF_TOOLS)} handoff tools",
                   not missing and not extra, f"missing {missing}, unexpected {extra}")
            bad_schema = [n for n, t in tools.items()
                          if not isinstance(t.input_schema, dict) or t.input_schema.get("type") != "object"]
            report(f"tools/list[{mode}] every inputSchema is an object", not bad_schema,
                   f"not type object: {bad_schema}")
            no_ann = [n for n, t in tools.items() if t.annotations is None]
            wrong_ro = [n for n in READ_ONLY if n in tools and
                        (tools[n].annotations is None or tools[n].annotations.read_only_hint is not True)]
            wrong_w = [n for n in WRITES if n in tools and tools[n].annotations is not None
                       and tools[n].annotations.read_only_hint is True]
            report(f"tools/list[{mode}] annotations (readOnlyHint)", not (no_ann or wrong_ro or wrong_w),
                   f"no annotations {no_ann}; read tools not readOnly {wrong_ro}; writes marked readOnly {wrong_w}")
    a, b = listings["legacy"], listings["auto"]
    same = a.keys() == b.keys() and all(
        a[n].input_schema == b[n].input_schema and a[n].annotations == b[n].annotations for n in a)
    report("tools/list is the same over legacy and auto", same, f"legacy {sorted(a)} vs auto {sorted(b)}")


# ----------------------------------------------------------------- 2. handoff and work

async def check_handoff_flow(env: Env) -> None:
    root = env.project("p2")
    tag = uuid.uuid4().hex[:8]
    plain_body = f"plain note {tag}: the schema moved to v2"
    work_body = f"work {tag}: please migrate the fixtures"
    title = f"Migrate fixtures {tag}"
    async with env.connect("alice", root, "legacy") as alice, env.connect("bob", root, "auto") as bob:
        plain = await call(alice, "send_handoff", {"to": "bob", "message": plain_body})
        report("flow: alice sends bob a handoff",
               not plain.err and get(plain.data, "to") == "bob" and get(plain.data, "kind") == "plain"
               and bool(get(plain.data, "id")), str(plain))
        report("flow: the send warns that no engine runs",
               "engine" in str(get(plain.data, "warning") or ""), str(plain))
        work = await call(alice, "send_handoff", {"to": "bob", "message": work_body, "title": title,
                                                  "due_minutes": 60})
        report("flow: alice sends bob a work item",
               not work.err and get(work.data, "kind") == "work", str(work))
        pid, wid = get(plain.data, "id"), get(work.data, "id")

        inbox = await call(bob, "inbox", {})
        msgs = {m.get("id"): m for m in get(inbox.data, "messages") or []}
        ok = (not inbox.err and pid in msgs and wid in msgs
              and msgs[pid].get("from") == "alice" and msgs[wid].get("title") == title
              and msgs[wid].get("kind") == "work" and not msgs[wid].get("read"))
        report("flow: bob's inbox shows both, unread, from alice", ok, str(inbox))

        for label, mid, body in (("handoff", pid, plain_body), ("work", wid, work_body)):
            r = await call(bob, "read_message", {"id": mid})
            ok = (not r.err and get(r.data, "body") == body and get(r.data, "from") == "alice"
                  and get(r.data, "to") == "bob")
            report(f"flow: bob reads the {label} (body matches)", ok, str(r))
        inbox = await call(bob, "inbox", {})
        ids = [m.get("id") for m in get(inbox.data, "messages") or []]
        report("flow: read messages leave the unread inbox", pid not in ids and wid not in ids, str(inbox))

        r = await call(bob, "accept_work", {"id": wid})
        report("flow: bob accepts the work", not r.err and get(r.data, "work", "state") == "accepted", str(r))
        r = await call(bob, "return_work", {"id": wid, "summary": f"migrated {tag}", "evidence": "tests pass"})
        ret_id = get(r.data, "return_message_id")
        report("flow: bob returns the work",
               not r.err and get(r.data, "work", "state") == "returned" and bool(ret_id), str(r))

        r = await call(bob, "close_work", {"id": wid, "outcome": "accepted"})
        report("flow: bob (the recipient) cannot close alice's work", r.err, str(r))

        inbox = await call(alice, "inbox", {})
        ret = [m for m in get(inbox.data, "messages") or [] if m.get("id") == ret_id]
        report("flow: alice's inbox has the return from bob",
               len(ret) == 1 and ret[0].get("from") == "bob" and ret[0].get("kind") == "return", str(inbox))
        r = await call(alice, "close_work", {"id": wid, "outcome": "accepted", "note": "thanks"})
        ok = (not r.err and get(r.data, "work", "state") == "closed"
              and get(r.data, "work", "outcome") == "accepted")
        report("flow: alice closes the work as accepted", ok, str(r))
        r = await call(alice, "handoff_status", {"id": wid})
        report("flow: handoff_status shows the delivery", not r.err and r.data is not None, str(r))


# ----------------------------------------------------------------- 3. identity guard

# A spoof that got through would store a message "from" bob: to alice (the brief's case), and
# to carol, where alice could otherwise send herself.
SPOOFS = [
    {"to": "bob", "message": "x", "from": "bob"},
    {"to": "alice", "message": "x", "from": "bob"},
    {"to": "alice", "message": "x", "sender": "bob"},
    {"to": "carol", "message": "x", "sender": "bob"},
    {"to": "alice", "message": "x", "as": "bob"},
    {"to": "carol", "message": "x", "as": "bob"},
    {"to": "alice", "message": "x", "fromAgent": "bob"},
    {"to": "carol", "message": "x", "fromAgent": "bob"},
    {"to": "carol", "message": "x", "from_agent": "bob"},
    {"to": "carol", "message": "x", "agent": "bob"},
]


async def check_spoof(env: Env) -> None:
    root = env.project("p3")
    async with env.connect("alice", root, "legacy") as alice:
        for args in SPOOFS:
            key = next(k for k in args if k not in ("to", "message"))
            r = await call(alice, "send_handoff", args)
            report(f"spoof: send_handoff with `{key}` (to {args['to']}) is refused",
                   r.err and "acts only as alice" in r.text, str(r))
    stored = []
    for agent in AGENTS:
        for m in env.cli_json("inbox", agent, "--all"):
            if m.get("body") == "x":
                stored.append(f"{m.get('sender')}->{m.get('recipient')}")
    from_bob = [s for s in stored if s == "bob->alice"]
    report("spoof: no message from bob with body x in alice's inbox", not from_bob, f"stored {from_bob}")
    report("spoof: the refused calls stored nothing at all", not stored, f"stored {stored}")


# ----------------------------------------------------------------- 4. lease race

async def check_lease_race(env: Env, rounds: int = 5) -> None:
    root = env.project("p4")
    async with env.connect("alice", root, "legacy") as alice, env.connect("bob", root, "auto") as bob:
        for n in range(1, rounds + 1):
            tasks = []
            for who in ("a", "b"):
                r = await call(alice, "create_handoff", {"title": f"race {n}{who}", "goal": "win the lease"})
                if r.err:
                    report(f"lease race round {n}", False, f"create_handoff: {r}")
                    return
                tasks.append(get(r.data, "task", "id"))
            ra, rb = await asyncio.gather(
                call(alice, "claim_handoff", {"task_id": tasks[0]}),
                call(bob, "claim_handoff", {"task_id": tasks[1]}),
            )
            results = [("alice", alice, tasks[0], ra), ("bob", bob, tasks[1], rb)]
            winners = [x for x in results if not x[3].err]
            losers = [x for x in results if x[3].err]
            detail = f"alice: {ra}; bob: {rb}"
            ok = len(winners) == 1
            if ok:
                text = losers[0][3].text.lower()
                ok = "lease" in text or "one writer" in text
                if ok:
                    shown = await call(alice, "show_handoff", {"task_id": losers[0][2]})
                    ok = get(shown.data, "task", "state") == "queued"
                    detail = f"loser's task is not queued: {shown}" if not ok else detail
            report(f"lease race round {n}: exactly one of two simultaneous claims wins", ok, detail,
                   note=f"{winners[0][0]} won" if ok else "")
            for who, client, task_id, r in winners:  # release for the next round
                token = get(r.data, "lease", "token")
                done = await call(client, "complete_handoff",
                                  {"task_id": task_id, "lease_token": token, "summary": "released"})
                if ok and done.err:
                    report(f"lease race round {n}: the winner completes its task", False, str(done))


# ----------------------------------------------------------------- 5. handoff budget

async def check_budget(env: Env) -> None:
    root = env.project("p5")
    async with env.connect("alice", root, "legacy") as alice, env.connect("bob", root, "auto") as bob:
        agents = {"alice": alice, "bob": bob}
        r = await call(alice, "create_handoff", {"title": "budget", "goal": "spend it", "handoff_cap": 2})
        task_id = get(r.data, "task", "id")
        if not report("budget: create a task with handoff_cap 2",
                      not r.err and get(r.data, "task", "handoff_cap") == 2, str(r)):
            return
        hops = [("alice", "bob"), ("bob", "alice"), ("alice", "bob")]
        for i, (holder, target) in enumerate(hops, 1):
            c = agents[holder]
            claim = await call(c, "claim_handoff", {"task_id": task_id})
            if not report(f"budget: {holder} claims before pass {i}", not claim.err, str(claim)):
                return
            p = await call(c, "pass_handoff", {
                "task_id": task_id, "lease_token": get(claim.data, "lease", "token"),
                "summary": f"hop {i}", "next_action": f"continue from hop {i}",
                "changed_files": [f"src/hop{i}.rs"], "target_agent": target,
            })
            if i < 3:
                report(f"budget: pass {i} {holder}->{target} spends one (left {2 - i})",
                       not p.err and get(p.data, "handoffs_left") == 2 - i, str(p))
            else:
                report("budget: the third pass is refused for the budget", p.err and "budget" in p.text, str(p))
        shown = await call(alice, "show_handoff", {"task_id": task_id})
        report("budget: show_handoff says needs_human",
               get(shown.data, "task", "state") == "needs_human", str(shown))
        r = await call(bob, "claim_handoff", {"task_id": task_id})
        report("budget: no claim while it needs a person", r.err, str(r))

        p = env.cli("task", "resume", task_id, "--add", "1", cwd=root)
        report("budget: `handoffs task resume ID --add 1` succeeds", p.returncode == 0,
               f"exit {p.returncode}: {p.stdout.strip()} {p.stderr.strip()}")
        r = await call(bob, "claim_handoff", {"task_id": task_id})
        report("budget: after resume bob can claim again",
               not r.err and get(r.data, "task", "state") == "claimed", str(r))
        if not r.err:
            await call(bob, "complete_handoff", {"task_id": task_id})


# ----------------------------------------------------------------- 6. wait_for_messages

async def check_wait(env: Env) -> None:
    root = env.project("p6")
    async with env.connect("carol", root, "auto") as carol, env.connect("alice", root, "legacy") as alice:
        # Carol should have no mail (only a failed spoof check sends her any); drain it so this
        # check measures waits, not that.
        for m in get((await call(carol, "inbox", {})).data, "messages") or []:
            await call(carol, "read_message", {"id": m.get("id")})
        pre = await call(carol, "inbox", {})
        if not report("wait: carol starts with an empty unread inbox",
                      not pre.err and get(pre.data, "messages") == [], str(pre)):
            return
        t0 = time.monotonic()
        r = await call(carol, "wait_for_messages", {"timeout_seconds": 1})
        took = time.monotonic() - t0
        report("wait: nothing coming, timeout 1 -> timed_out true",
               not r.err and get(r.data, "timed_out") is True and 0.8 <= took <= 4.0,
               f"{took:.2f} s; {r}", note=f"{took:.2f} s")

        sent: dict[str, Any] = {}

        async def send_later() -> None:
            await asyncio.sleep(1.0)
            sent["at"] = time.monotonic()  # latency is measured from the moment the send is issued
            sent["result"] = await call(alice, "send_handoff",
                                        {"to": "carol", "message": f"wake up {uuid.uuid4().hex[:6]}"})

        async def wait() -> tuple[R, float]:
            w = await call(carol, "wait_for_messages", {"timeout_seconds": 10}, timeout=15)
            return w, time.monotonic()

        async def meanwhile() -> None:  # another call on carol's server while her wait is pending
            await asyncio.sleep(0.3)
            t1 = time.monotonic()
            other = await call(carol, "list_agents", {})
            took = time.monotonic() - t1
            report("wait: a pending wait does not hold up another call on the same server",
                   not other.err and "at" not in sent, f"list_agents took {took:.2f} s: {other}",
                   note=f"list_agents in {took:.3f} s")

        t0 = time.monotonic()
        (w, t_back), _, _ = await asyncio.gather(wait(), send_later(), meanwhile())
        latency = t_back - sent["at"]
        mid = get(sent["result"].data, "id")
        ids = [m.get("id") for m in get(w.data, "messages") or []]
        # The server wakes on file changes, else polls every 2 s: 5 s is a generous bound that
        # still fails a wait that sleeps to its timeout.
        ok = not w.err and get(w.data, "timed_out") is False and mid in ids and latency < 5.0
        how = " (woken by the 2 s fallback poll, not the file watch)" if latency > 0.5 else ""
        report("wait: a message sent 1 s into a 10 s wait wakes it", ok,
               f"latency {latency:.2f} s; sent {sent['result']}; wait {w}",
               note=f"latency {latency:.3f} s from the send{how}, {t_back - t0:.2f} s in all")


# ----------------------------------------------------------------- 7. raw stdio probes

class RawServer:
    """`handoffs mcp` on plain pipes, one JSON-RPC message per line."""

    def __init__(self, env: Env, agent: str, cwd: Path):
        env.wait_bin()
        full_env = env.cli_env()
        self.p = subprocess.Popen(
            [env.bin, "mcp", "--agent", agent], cwd=cwd, env=full_env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        self.lines: queue.Queue[Any] = queue.Queue()
        self.stderr = b""
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout
        for line in self.p.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                self.lines.put({"unparseable": line.decode(errors="replace")})

    def _read_err(self) -> None:
        assert self.p.stderr
        self.stderr = self.p.stderr.read()

    def send(self, msg: dict[str, Any]) -> None:
        assert self.p.stdin
        self.p.stdin.write((json.dumps(msg) + "\n").encode())
        self.p.stdin.flush()

    def response(self, id_: int, timeout: float = 2.0) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                m = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if m.get("id") == id_ and ("result" in m or "error" in m):
                return m
        return None

    def close(self) -> None:
        try:
            if self.p.stdin:
                self.p.stdin.close()
            self.p.wait(timeout=3)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()


INITIALIZE = {
    "jsonrpc": "2.0", "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {},
               "clientInfo": {"name": "mcp_sdk.py raw probe", "version": "1"}},
}


def check_raw_probes(env: Env) -> None:
    root = env.project("p7")
    s = RawServer(env, "alice", root)
    try:
        s.send({"jsonrpc": "2.0", "id": 1, "method": "server/discover"})
        r = s.response(1)
        report("raw: server/discover without _meta as the first line -> JSON-RPC error",
               r is not None and "error" in r, f"got {short(r)}")
        s.send({"jsonrpc": "2.0", "id": 2, "method": "no/such"})
        r = s.response(2)
        report("raw: unknown method before initialize -> JSON-RPC error",
               r is not None and "error" in r, f"got {short(r)}")
        s.send({**INITIALIZE, "id": 3})
        r = s.response(3)
        report("raw: initialize then works on the same process",
               r is not None and bool(get(r, "result", "protocolVersion")), f"got {short(r)}")
        s.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        s.send({"jsonrpc": "2.0", "id": 4, "method": "no/such"})
        r = s.response(4)
        report("raw: unknown method after initialize -> JSON-RPC error",
               r is not None and "error" in r, f"got {short(r)}")
        s.send({"jsonrpc": "2.0", "id": 5, "method": "tools/list"})
        r = s.response(5)
        report("raw: tools/list still answers", len(get(r, "result", "tools") or []) == len(HANDOFF_TOOLS),
               f"got {short(r)}")
    finally:
        s.close()

    s = RawServer(env, "alice", root)
    try:
        s.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        time.sleep(0.5)
        alive = s.p.poll() is None
        s.send({**INITIALIZE, "id": 1}) if alive else None
        r = s.response(1) if alive else None
        report("raw: notifications/initialized as the first line does not end the server",
               alive and r is not None and "result" in r,
               f"alive={alive}, exit={s.p.poll()}, initialize -> {short(r)}, stderr {short(s.stderr.decode(errors='replace'))}")
    finally:
        s.close()


# ----------------------------------------------------------------- 8. bad input

HUGE = "y" * 300_000


def first_type(prop: dict[str, Any]) -> str:
    t = prop.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "null")
    return t or "string"


def sample(prop: dict[str, Any]) -> Any:
    return {"string": "x", "integer": 1, "number": 1, "boolean": False,
            "array": ["x"], "object": {}}.get(first_type(prop), "x")


async def check_bad_input(env: Env) -> None:
    root = env.project("p8")
    library = env.tmp / "ctx8"
    library.mkdir()
    # wait_for_messages without arguments waits 30 s unless there is unread mail: give alice some.
    env.cli("send", "bob", "alice", "something to read, so waits return at once")
    async with env.connect("alice", root, "legacy", extra=("--context-library", str(library))) as c:
        tools = (await c.list_tools()).tools
        total = 0
        for t in tools:
            schema = t.input_schema or {}
            props: dict[str, Any] = schema.get("properties") or {}
            required = set(schema.get("required") or [])
            # context_get takes one of id or key: neither is required, but one must be given.
            needs = bool(required) or t.name in ONE_OF_REQUIRED
            base = {k: sample(v) for k, v in props.items()}
            cases: list[tuple[str, dict[str, Any] | None, bool | None]] = [
                ("no arguments", None, needs),
                ("empty arguments", {}, needs),
            ]
            for k, v in props.items():
                ty = first_type(v)
                if ty == "string":
                    cases.append((f"{k}=integer", {**base, k: 12345}, True))
                    cases.append((f"{k}=300k chars", {**base, k: HUGE}, None))
                elif ty == "array" and first_type(v.get("items") or {}) == "string":
                    cases.append((f"{k}=[integer]", {**base, k: [12345]}, True))
                    cases.append((f"{k}=[300k chars]", {**base, k: [HUGE]}, None))
            problems: list[str] = []
            accepted: list[str] = []  # calls with no fixed expectation that succeeded
            for label, args, want_err in cases:
                total += 1
                try:
                    r = await call(c, t.name, args)
                except Exception as e:  # a protocol or transport failure is what this check is about
                    problems.append(f"{label}: no result ({describe(e)})")
                    continue
                if want_err is not None and r.err != want_err:
                    problems.append(f"{label}: isError={r.err}, expected {want_err}: {short(r.text, 160)}")
                elif r.err and not r.text.strip():
                    problems.append(f"{label}: isError without a message")
                elif want_err is None and not r.err:
                    accepted.append(label)
            report(f"bad input: {t.name} ({len(cases)} calls)", not problems, "; ".join(problems),
                   note=f"accepted: {', '.join(accepted)}" if accepted else "")
        try:
            after = await c.list_tools()
            ok, detail = len(after.tools) == len(tools), f"{len(after.tools)} tools after {total} bad calls"
        except Exception as e:
            ok, detail = False, describe(e)
        report("bad input: the server still answers tools/list", ok, detail, note=detail)


# ----------------------------------------------------------------- 9. context library

async def check_context(env: Env) -> None:
    root = env.project("p9")
    library = env.tmp / "ctx9"
    library.mkdir()
    tag = uuid.uuid4().hex[:8]
    extra = ("--context-library", str(library))
    async with env.connect("alice", root, "auto", extra=extra) as alice, \
            env.connect("bob", root, "legacy", extra=extra) as bob:
        tools = {t.name: t for t in (await alice.list_tools()).tools}
        missing = [n for n in HANDOFF_TOOLS + CONTEXT_TOOLS if n not in tools]
        wrong_ro = [n for n in CONTEXT_READ_ONLY if n in tools and
                    (tools[n].annotations is None or tools[n].annotations.read_only_hint is not True)]
        report("context: tools/list adds the eight context tools (read-only where they read)",
               not missing and not wrong_ro, f"missing {missing}; not readOnly {wrong_ro}")

        r = await call(alice, "context_record", {"title": f"Fixture layout {tag}",
                                                 "body": f"Fixtures live in tests/data; quokka{tag}.",
                                                 "tags": ["tests"]})
        rec = get(r.data, "record") or {}
        old = rec.get("id")
        report("context: alice records a note", not r.err and bool(old) and rec.get("author") == "alice", str(r))
        files = list(library.glob("*.md"))
        on_disk = (library / rec["file"]).read_text() if rec.get("file") and (library / rec["file"]).exists() else ""
        head = on_disk.split("\n---", 1)[0]
        report("context: the record file on disk says author: alice",
               "\nauthor: alice\n" in head + "\n", f"files {[f.name for f in files]}; head {short(head)}")

        r = await call(alice, "context_search", {"query": f"quokka{tag}"})
        hits = [h.get("id") for h in get(r.data, "hits") or []]
        report("context: search finds it", not r.err and old in hits, str(r))

        r = await call(alice, "context_supersede", {"id": old, "body": f"Fixtures moved to tests/fixtures; wombat{tag}.",
                                                    "title": f"Fixture layout {tag} (v2)"})
        new = get(r.data, "record", "id")
        report("context: supersede makes a new record",
               not r.err and bool(new) and new != old and get(r.data, "record", "supersedes") == old, str(r))
        r = await call(alice, "context_get", {"id": old})
        report("context: get shows the old one superseded",
               not r.err and get(r.data, "record", "status") == "superseded"
               and get(r.data, "record", "superseded_by") == new, str(r))
        r = await call(alice, "context_get", {"id": new})
        report("context: get returns the new body",
               not r.err and f"wombat{tag}" in str(get(r.data, "record", "body")), str(r))
        r = await call(alice, "context_search", {"query": f"quokka{tag}"})
        hits = [h.get("id") for h in get(r.data, "hits") or []]
        report("context: search skips the superseded record by default", not r.err and old not in hits, str(r))

        r = await call(bob, "context_record", {"title": f"Bob's note {tag}", "body": "Run the sim before merging."})
        report("context: bob's record is authored by bob",
               not r.err and get(r.data, "record", "author") == "bob", str(r))
        for i in range(8):
            await call(alice, "context_record", {"title": f"Filler {i} {tag}",
                                                 "body": f"Filler record {i}: " + "lorem ipsum " * 20})
        r = await call(alice, "context_brief", {"max_chars": 300})
        text = get(r.data, "text") or ""
        report("context: brief with max_chars 300 stays within it",
               not r.err and 0 < len(text) <= 300 and bool(get(r.data, "omitted") or get(r.data, "truncated")),
               f"{len(text)} chars; {r}", note=f"{len(text)} chars, {get(r.data, 'omitted')} omitted")
        r = await call(alice, "context_brief", {})
        text = get(r.data, "text") or ""
        report("context: default brief is bounded (<= 2,048 chars)",
               not r.err and 0 < len(text) <= 2048, f"{len(text)} chars; {r}", note=f"{len(text)} chars")
        r = await call(alice, "context_status", {})
        ok = (not r.err and get(r.data, "records") == 11 and get(r.data, "superseded") == 1
              and sorted(get(r.data, "authors") or []) == ["alice", "bob"])
        report("context: status counts 11 records, 1 superseded, by alice and bob", ok, str(r))

        before = sorted(p.name for p in library.glob("*.md"))
        r = await call(alice, "context_record", {"title": "forged", "body": "forged", "author": "bob"})
        after = sorted(p.name for p in library.glob("*.md"))
        report("context: context_record with `author` is refused by the identity guard",
               r.err and "acts only as alice" in r.text and before == after,
               f"{r}; files {len(before)} -> {len(after)}")


# ----------------------------------------------------------------- 10. remote MCP over HTTP

@asynccontextmanager
async def serving(env: Env):
    """`handoffs serve --port 0` on loopback; yields its /mcp URL."""
    env.wait_bin()
    proc = subprocess.Popen(
        [env.bin, "serve", "--port", "0"], cwd=env.tmp, env=env.cli_env(),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        line = await anyio.to_thread.run_sync(proc.stdout.readline)
        url = next((w for w in line.split() if w.startswith("http://")), None)
        if url is None:
            raise RuntimeError(f"`handoffs serve` printed no URL: {line!r}")
        # Keep draining stdout so the server never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        yield url.split("#")[0].rstrip("/") + "/mcp"
    finally:
        proc.kill()
        proc.wait()


@asynccontextmanager
async def remote(url: str, token: str):
    """An SDK client over Streamable HTTP that sends `Authorization: Bearer TOKEN`."""
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {token}"} if token else {}, timeout=httpx2.Timeout(30, read=300),
    )
    async with http, Client(
        streamable_http_client(url, http_client=http), mode="legacy", cache=None, read_timeout_seconds=15,
    ) as client:
        yield client


async def check_remote(env: Env) -> None:
    tokens = {}
    for agent in ("alice", "bob"):
        p = env.cli("agent", "token", agent)
        tokens[agent] = p.stdout.strip()
        report(f"remote: `handoffs agent token {agent}` prints one token",
               p.returncode == 0 and tokens[agent].startswith("hat_"), f"{p.returncode} {p.stderr.strip()}")
    async with serving(env) as url:
        async with remote(url, tokens["alice"]) as alice, remote(url, tokens["bob"]) as bob:
            names = sorted(t.name for t in (await alice.list_tools()).tools)
            report("remote: tools/list over HTTP lists every handoff tool",
                   names == sorted(HANDOFF_TOOLS), f"got {names}")
            body = f"remote {uuid.uuid4().hex[:8]}"
            r = await call(alice, "send_handoff", {"to": "bob", "message": body, "title": "Remote"})
            report("remote: alice's send_handoff over HTTP succeeds", not r.err, str(r))
            r = await call(bob, "inbox", {})
            mine = [m for m in get(r.data, "messages") or [] if m.get("title") == "Remote"]
            report("remote: bob's inbox over HTTP holds it, from alice",
                   not r.err and len(mine) == 1 and mine[0].get("from") == "alice", str(r))
            for args in SPOOFS:
                key = next(k for k in args if k not in ("to", "message"))
                r = await call(alice, "send_handoff", args)
                report(f"remote spoof: send_handoff with `{key}` (to {args['to']}) is refused",
                       r.err and "acts only as alice" in r.text, str(r))
        stored = [m for a in AGENTS for m in env.cli_json("inbox", a, "--all") if m.get("body") == "x"]
        report("remote spoof: the refused calls stored nothing",
               not stored, f"stored {[(m.get('sender'), m.get('recipient')) for m in stored]}")
        refusals = (("a wrong token", "hat_" + "0" * 64, "unknown token"),
                    ("a rotated token", tokens["alice"], "unknown token"),
                    ("no token", "", "Authorization: Bearer"))
        env.cli("agent", "token", "alice")  # rotates: the first token is void now
        for label, token, says in refusals:
            try:
                async with remote(url, token) as c:
                    await c.list_tools()
                report(f"remote: {label} is refused", False, "the session opened")
            except Exception as e:  # noqa: BLE001 - the SDK raises the server's JSON-RPC error
                report(f"remote: {label} is refused, saying {says!r}", says in describe(e), describe(e))


# ----------------------------------------------------------------- main

CHECKS = {
    1: ("tools/list", check_tools_list),
    2: ("handoff flow", check_handoff_flow),
    3: ("spoofing", check_spoof),
    4: ("lease race", check_lease_race),
    5: ("budget", check_budget),
    6: ("wait_for_messages", check_wait),
    7: ("raw probes", check_raw_probes),
    8: ("bad input", check_bad_input),
    9: ("context library", check_context),
    10: ("remote MCP over HTTP", check_remote),
}
# --expect-broken NAME: (check, plant, the reports that must fail: every failure starts so).
BROKEN = {
    "spoof": (3, "mcp_spoof", "spoof: "),
    "remote-spoof": (10, "mcp_spoof", "remote spoof: "),
    "lease": (4, "lease_race", "lease race round "),
}


def describe(e: BaseException) -> str:
    """The innermost error of an exception group (anyio wraps a check's failure in several)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}"


async def run(env: Env, numbers: list[int]) -> None:
    for n in numbers:
        name, fn = CHECKS[n]
        before = len(FAILURES)
        t0 = time.monotonic()
        try:
            with anyio.fail_after(CHECK_TIMEOUT):
                if inspect.iscoroutinefunction(fn):
                    await fn(env)
                else:
                    fn(env)
        except TimeoutError:
            report(f"{name}", False, f"did not finish within {CHECK_TIMEOUT:.0f} s")
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
            report(f"{name}", False, describe(e))
        status = "ok" if len(FAILURES) == before else "FAILED"
        print(f"--  check {n} ({name}) {status} in {time.monotonic() - t0:.1f} s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=DEFAULT_BIN, help=f"the handoffs binary (default {DEFAULT_BIN})")
    ap.add_argument("--expect-broken", choices=sorted(BROKEN),
                    help="run only that check with the bug planted; exit 0 iff the check fails")
    ap.add_argument("--only", help="comma-separated check numbers (1-10)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    opts = ap.parse_args()

    plant = None
    numbers = sorted(CHECKS)
    if opts.expect_broken:
        n, plant, _ = BROKEN[opts.expect_broken]
        numbers = [n]
    elif opts.only:
        numbers = [int(x) for x in opts.only.split(",")]

    env = Env(os.path.abspath(opts.bin), plant)
    started = time.monotonic()
    print(f"--  {env.bin}; temp {env.tmp}" + (f"; HANDOFFS_PLANT={plant}" if plant else ""), flush=True)
    try:
        env.setup()
        asyncio.run(run(env, numbers))
    finally:
        if not opts.keep:
            subprocess.run(["rm", "-rf", str(env.tmp)], check=False)
    elapsed = time.monotonic() - started
    print(f"--  {len(PASSES)} ok, {len(FAILURES)} failed in {elapsed:.1f} s", flush=True)

    if opts.expect_broken:
        prefix = BROKEN[opts.expect_broken][2]
        others = [f for f in FAILURES if not f.startswith(prefix)]
        if FAILURES and not others:
            print(f"--  as expected, the {opts.expect_broken} check fails with HANDOFFS_PLANT={plant}")
            return 0
        if others:
            print(f"--  the {opts.expect_broken} check failed, but not (only) where the plant "
                  f"should show ({prefix!r}): {others}")
            return 1
        print(f"--  the {opts.expect_broken} check PASSED with HANDOFFS_PLANT={plant}: "
              "it does not catch the planted bug (or the binary lacks the planted-bugs feature)")
        return 1
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
