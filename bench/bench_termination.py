"""Terminating a tree of 50 agents with 500 calls in flight: how long until the record, and is anything lost.

Run: python bench/bench_termination.py      (about 1 minute on 2 cores; --no-fork: fresh interpreters, ~4 minutes)

Real parts: a ``tether controlplane serve`` process (SQLite), 50 ``tether sidecar`` processes for a delegation
tree (root -> 7 children -> 6 grandchildren each), and the harness's aiohttp tool server in a process of its
own. The sidecars are forked from a zygote that imported their code once (each then runs
``cli.main.main(["sidecar", ...])`` as a process of its own); ``--no-fork`` starts fresh interpreters
instead, which on 2 cores spends minutes importing. Each sidecar carries 10 slow calls (``/slow?s=N``): 5
short ones that end inside the drain window and 5 long ones that the window cuts: 500 calls in flight when the
root is terminated with ``mode=drain``. Every call carries a unique tag in its query string, so the record can
be checked call by call: the capture each record entry points to (``capture_ref``) holds the request with its
tag.

Right after the terminate request returns, every sidecar is probed in a loop with a cheap granted call;
the time each first refuses is how long the revocation took to reach it.

``--heavy`` is the busy case: 20 agents (root and 19 children) each calling as fast as its share of
``--load`` (400 calls/s in all) allows, before and through a 5 s drain, besides their slow calls. Every load
call is tagged too; one refused after its sidecar acknowledged (``tether.terminated``) may postdate the
record, every other one must be in it. Throughout, ``/healthz`` is polled every 20 ms: its slowest answer
bounds how long the control plane's event loop stalled (writing a big record included).

Targets (docs/contract.md section 6):
  - the record is written (state ``terminated``) within the drain window + 1 s of the request;
  - zero calls missing: every call the clients started is in the record, with its resolution;
  - (heavy) 0 agents unaccounted, and no event-loop stall over 100 ms in the control plane.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402
from bench_sidecar import ToolServerProcess, cpu_seconds, stopping  # noqa: E402

from tests.harness import (  # noqa: E402
    ControlPlaneProcess,
    Identity,
    SidecarProcess,
    close_stdin_and_wait,
    free_port,
    make_test_ca,
    prepare_controlplane,
    wait_until,
)
from tether.capture.segments import CAPTURE_FILE, read_flows  # noqa: E402

RECORD_SLACK_S = 1.0
STALL_TARGET_S = 0.100
LOAD_PATH = "/repos/o/load/issues"
REFUSED = {"tether.draining", "tether.terminated", "tether.chain_revoked"}
PROBE_PATH = "/repos/o/r/issues"


@dataclass
class Outcome:
    tag: str
    agent: str
    seconds: float
    started: float = 0.0
    ended: float = 0.0
    result: str = ""  # "200", "503 tether.draining", or the exception's name


@dataclass
class Probe:
    agent: str
    forwarded: int = 0
    refused_at: float | None = None  # when the refusal reached the client
    refused_sent: float | None = None  # when that refused probe was sent
    code: str | None = None
    tags: list[str] = field(default_factory=list)


def build_tree(cp: ControlPlaneProcess, children: int, grandchildren: int) -> list[Identity]:
    caps = {"slow.read": "direct", "issues.read": "direct"}
    root = cp.issue("root", caps)
    out = [root]
    for i in range(children):
        child = cp.delegate(root, f"c{i}", caps)
        out.append(child)
        out += [cp.delegate(child, f"c{i}g{j}", caps) for j in range(grandchildren)]
    return out


async def call(session: aiohttp.ClientSession, base: str, proxy: str, outcome: Outcome) -> None:
    outcome.started = time.time()
    try:
        async with session.get(f"{base}/slow?s={outcome.seconds:g}&tag={outcome.tag}", proxy=proxy) as resp:
            await resp.read()
            code = resp.headers.get("Tether-Error")
            outcome.result = str(resp.status) + (f" {code}" if code else "")
    except Exception as exc:  # the cut calls: the client sees its connection end
        outcome.result = type(exc).__name__
    outcome.ended = time.time()


async def load(session: aiohttp.ClientSession, base: str, proxy: str, agent: str, rate: float, stop_at: float,
               outcomes: list[Outcome]) -> None:
    """Call as fast as ``rate`` per second allows until ``stop_at``, through the drain and after."""
    n = 0
    next_at = time.monotonic()
    while time.monotonic() < stop_at:
        o = Outcome(f"load-{agent}-{n}", agent, 0.0)
        outcomes.append(o)
        n += 1
        o.started = time.time()
        try:
            async with session.get(f"{base}{LOAD_PATH}?tag={o.tag}", proxy=proxy) as resp:
                await resp.read()
                code = resp.headers.get("Tether-Error")
                o.result = str(resp.status) + (f" {code}" if code else "")
        except Exception as exc:
            o.result = type(exc).__name__
        o.ended = time.time()
        next_at += 1.0 / rate
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))


async def responsiveness(url: str, stop: asyncio.Event, samples: list[float]) -> None:
    """How long the control plane takes to answer /healthz, every 20 ms: a stalled event loop shows here."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                async with session.get(f"{url}/healthz") as resp:
                    await resp.read()
            except aiohttp.ClientError:
                pass
            samples.append(time.monotonic() - sent)
            await asyncio.sleep(0.02)


async def probe(session: aiohttp.ClientSession, base: str, proxy: str, p: Probe, stop_at: float) -> None:
    n = 0
    while time.monotonic() < stop_at:
        tag = f"probe-{p.agent}-{n}"
        n += 1
        p.tags.append(tag)
        sent = time.time()
        try:
            async with session.get(f"{base}{PROBE_PATH}?tag={tag}", proxy=proxy) as resp:
                await resp.read()
                code = resp.headers.get("Tether-Error")
        except aiohttp.ClientError:
            code = None
        if code in REFUSED:
            p.refused_at, p.refused_sent, p.code = time.time(), sent, code
            return
        p.forwarded += 1


def pct(values: list[float], q: float) -> float:
    data = sorted(values)
    return data[min(len(data) - 1, int(q * len(data)))]


def cpu_by_role(pids: dict[str, list[int]]) -> dict[str, float]:
    out = {}
    for role, group in pids.items():
        total = 0.0
        for pid in group:
            try:
                total += cpu_seconds(pid)
            except OSError:  # gone
                pass
        out[role] = total
    return out


def cpu_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {role: after[role] - before[role] for role in after}


async def scenario(cp: ControlPlaneProcess, tools: ToolServerProcess, sidecars: list[SidecarProcess],
                   per_agent: int, short_s: float, long_s: float, window: float,
                   pids: dict[str, list[int]], load_rate: float = 0.0) -> dict[str, Any]:
    base = tools.http_base
    cpu_launch = cpu_by_role(pids)
    outcomes: list[Outcome] = []
    load_outcomes: list[Outcome] = []
    sessions: list[aiohttp.ClientSession] = []
    probes = [Probe(s.identity.agent) for s in sidecars]
    stalls: list[float] = []
    watching = asyncio.Event()
    watcher = asyncio.create_task(responsiveness(cp.url, watching, stalls))
    load_tasks: list[asyncio.Task] = []
    try:
        tasks = []
        for s in sidecars:
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                            timeout=aiohttp.ClientTimeout(total=60))
            # aiohttp quietly resends an idempotent request whose connection dropped (RFC 9112 9.3.1); the
            # resend of a cut call would be refused by the terminated sidecar and hide the cut from us.
            session._retry_connection = False
            sessions.append(session)
            for k in range(per_agent):
                seconds = long_s if k % 2 == 0 else short_s
                outcomes.append(Outcome(f"{s.identity.agent}-{k}", s.identity.agent, seconds))
        outcomes.sort(key=lambda o: -o.seconds)
        by_agent = {s.identity.agent: (s, session) for s, session in zip(sidecars, sessions, strict=True)}
        for o in outcomes:
            s, session = by_agent[o.agent]
            tasks.append(asyncio.create_task(call(session, base, s.proxy, o)))
        probe_sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1),
                                                timeout=aiohttp.ClientTimeout(total=10)) for _ in sidecars]
        sessions += probe_sessions
        launched = time.monotonic()
        expected = len(outcomes)
        # Long calls first, so that a slow ramp on a loaded machine eats into the short calls' margin only.
        # Wait until every call is in flight at the tool server (or, should a short call already have ended,
        # until every call has arrived there).
        while (await asyncio.to_thread(tools.ask, "active") < expected
               and await asyncio.to_thread(tools.ask, "hits") < expected):
            if all(t.done() for t in tasks) or time.monotonic() - launched > 20:
                seen: dict[str, int] = {}
                for o in outcomes:
                    seen[o.result or "pending"] = seen.get(o.result or "pending", 0) + 1
                print(f"calls did not all reach the tool server: {seen}", flush=True)
                raise RuntimeError(f"only {tools.ask('active')} of {expected} calls reached the tool server")
            await asyncio.sleep(0.02)
        ramp = time.monotonic() - launched
        in_flight = await asyncio.to_thread(tools.ask, "active")
        if load_rate:
            load_stop = time.monotonic() + window + 12
            for s, session in zip(sidecars, sessions, strict=False):
                load_tasks.append(asyncio.create_task(load(session, base, s.proxy, s.identity.agent,
                                                           load_rate / len(sidecars), load_stop, load_outcomes)))
            await asyncio.sleep(2.0)  # the load is running at full rate when the termination comes

        client = cp.client()
        print(f"{in_flight} calls in flight after {ramp:.1f} s; terminating root", flush=True)
        cpu_terminate = cpu_by_role(pids)
        t_request = time.time()
        doc = await asyncio.to_thread(client.request, "POST", "/v1/agents/root/terminate",
                                      {"mode": "drain", "window_s": window, "reason": "bench"})
        t_returned = time.time()
        tid = doc["termination_id"]
        stop_at = time.monotonic() + 15
        probe_tasks = [asyncio.create_task(probe(ps, base, s.proxy, p, stop_at))
                       for ps, s, p in zip(probe_sessions, sidecars, probes, strict=True)]

        t_seen = None
        deadline = time.monotonic() + window + 60
        while time.monotonic() < deadline:
            term = await asyncio.to_thread(client.request, "GET", f"/v1/terminations/{tid}")
            if term["state"] == "terminated":
                t_seen = time.time()
                cpu_done = cpu_by_role(pids)
                break
            await asyncio.sleep(0.05)
        await asyncio.wait_for(asyncio.gather(*tasks, *probe_tasks, *load_tasks), 60)
        record = await asyncio.to_thread(client.request, "GET", f"/v1/records/{tid}")
        metrics = await asyncio.to_thread(client.request, "GET", "/metrics")
        loop = {name: float(value) for line in metrics.splitlines() if line.startswith("tether_event_loop_")
                for name, value in [line.split()]}
    finally:
        watching.set()
        await watcher
        for session in sessions:
            await session.close()
    return {"outcomes": outcomes, "load": load_outcomes, "stalls": stalls, "loop": loop, "probes": probes,
            "ramp": ramp, "in_flight": in_flight, "t_request": t_request,
            "t_returned": t_returned, "t_seen": t_seen, "termination": term, "record": record,
            "cpu_ramp": cpu_delta(cpu_terminate, cpu_launch), "cpu_termination": cpu_delta(cpu_done, cpu_terminate)}


# A zygote: imports the sidecar's code once, then forks one child per sidecar that runs exactly what
# ``python -m tether sidecar ...`` runs. Each child is a full sidecar process of its own; only
# the ~2 s of imports per process is shared, which 50 processes on 2 cores would otherwise pay in turn.
ZYGOTE_CODE = """
import json, os, signal, sys
sys.path.insert(0, {root!r})
import tether.cli.sidecar, proxy.sidecar  # proxy.sidecar loads the mitmproxy addons a sidecar runs, and only those
from tether.cli.main import main as tether
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
print("ready", flush=True)
while line := sys.stdin.readline():
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.update(req["env"])
        code = 1
        try:
            code = tether(req["argv"])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(pid, flush=True)
"""


class Zygote:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def start(self) -> Zygote:
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE_CODE.format(root=str(ROOT))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready", "zygote failed"
        return self

    def fork(self, argv: list[str], log: Path, env: dict[str, str]) -> int:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log), "env": env}) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def stop(self) -> None:
        close_stdin_and_wait(self.proc, 5)
        self.proc = None


class ForkedSidecar(SidecarProcess):
    """The harness's SidecarProcess, started by the zygote instead of a fresh interpreter."""

    zygote: Zygote | None = None
    pid: int | None = None

    def launch(self, zygote: Zygote) -> None:
        self.zygote = zygote
        self.state_dir.mkdir(parents=True, exist_ok=True)
        ready = self.state_dir / "ready.json"
        ready.unlink(missing_ok=True)
        argv = ["sidecar", "--controlplane", self.cp.url, "--chain", str(self.identity.chain_path),
                "--key", str(self.identity.key_path), "--listen", "127.0.0.1:0", "--state-dir", str(self.state_dir),
                "--ready-file", str(ready)]
        self.pid = zygote.fork(argv, self.state_dir / "sidecar.log", {"TETHER_CONTROLPLANE": self.cp.url})

    def alive(self) -> bool:
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state != "Z"

    def wait_ready(self, timeout: float) -> None:
        ready = self.state_dir / "ready.json"

        def ready_or_dead() -> bool:
            if not self.alive():
                raise AssertionError(f"sidecar {self.identity.agent} exited: {self.log_text[-2000:]}")
            return ready.exists()

        wait_until(ready_or_dead, timeout, what=f"sidecar for {self.identity.agent}")
        self.info = json.loads(ready.read_text())

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.pid is None or not self.alive():
            return
        os.kill(self.pid, sig)
        deadline = time.monotonic() + 15
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)


def start_all(cp: ControlPlaneProcess, identities: list[Identity], zygote: Zygote | None,
              workers: int) -> list[SidecarProcess]:
    if zygote is None:  # --no-fork: a fresh interpreter per sidecar, as the harness starts them
        sidecars = [SidecarProcess(cp, ident) for ident in identities]
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda s: s.start(), sidecars))
        return sidecars
    forked = [ForkedSidecar(cp, ident) for ident in identities]
    for s in forked:
        s.launch(zygote)
    for s in forked:
        s.wait_ready(120)
    return list(forked)


def pid_of(s: SidecarProcess) -> int:
    return s.pid if isinstance(s, ForkedSidecar) else s.proc.pid  # type: ignore[return-value,union-attr]


def memory_mib(pid: int) -> tuple[float, float]:
    """(RSS, PSS): forked sidecars share their imported code, which RSS counts in every one of them."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) / 1024
    return fields["Rss"], fields["Pss"]


def stop_all(sidecars: list[SidecarProcess]) -> None:
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda s: s.stop(), sidecars))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--children", type=int, default=7)
    parser.add_argument("--grandchildren", type=int, default=6, help="per child")
    parser.add_argument("--calls", type=int, default=10, help="calls in flight per sidecar")
    parser.add_argument("--short", type=float, default=1.0, help="seconds of the calls that end inside the window")
    parser.add_argument("--long", type=float, default=10.0, help="seconds of the calls the window cuts")
    parser.add_argument("--window", type=float, default=3.0, help="drain window in seconds")
    parser.add_argument("--grace", type=float, default=2.0, help="the control plane's grace past the window")
    parser.add_argument("--no-fork", action="store_true", help="start each sidecar as a fresh interpreter")
    parser.add_argument("--start-workers", type=int, default=4, help="with --no-fork: sidecars starting at once")
    parser.add_argument("--load", type=float, default=0.0, help="calls per second in all, through the drain")
    parser.add_argument("--heavy", action="store_true",
                        help="the busy case: 20 agents, 4 slow calls each, --load 400, a 5 s drain window")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()
    if args.heavy:
        args.children, args.grandchildren, args.calls, args.load, args.window = 19, 0, 4, args.load or 400.0, 5.0

    work = Path(tempfile.mkdtemp(prefix="tether-bench-termination-"))
    began = time.monotonic()
    print(f"tether termination benchmark  {time.strftime('%Y-%m-%d %H:%M')}  nproc {os.cpu_count()}  "
          f"python {platform.python_version()}  load average {os.getloadavg()[0]:.2f}", flush=True)
    sidecars: list[SidecarProcess] = []
    try:
        with ExitStack() as stack:
            ca = make_test_ca(work / "toolca")
            tools = stack.enter_context(stopping(ToolServerProcess(ca).start()))
            # A lease TTL long enough that 50 sidecars starting on 2 cores never miss a renewal.
            cp = prepare_controlplane(work / "cp", tools.http_port, tools.https_port, free_port(), lease_ttl=15.0,
                                      grace=args.grace)
            stack.enter_context(stopping(cp.start()))
            identities = build_tree(cp, args.children, args.grandchildren)
            zygote = None if args.no_fork else stack.enter_context(stopping(Zygote().start()))
            stack.callback(stop_all, sidecars)
            t0 = time.monotonic()
            sidecars += start_all(cp, identities, zygote, args.start_workers)
            startup = time.monotonic() - t0
            mem = [memory_mib(pid_of(s)) for s in sidecars]
            rss, pss = sum(m[0] for m in mem), sum(m[1] for m in mem)
            how = "fresh interpreters" if zygote is None else "forked from a zygote"
            print(f"started {len(sidecars)} sidecars in {startup:.1f} s ({how}); "
                  f"RSS {rss:.0f} MiB summed, PSS {pss:.0f} MiB ({pss / len(mem):.0f} MiB each)", flush=True)
            # A sidecar takes its first lease before it starts its proxy, and renews it lease_ttl/3 after the
            # proxy listens; on a loaded machine that first lease can lapse in between. Start the calls once
            # every sidecar has renewed from a listening proxy (its heartbeat then names the proxy).
            client = cp.client()

            def renewed() -> bool:
                nodes = client.request("GET", "/v1/agents")["agents"]
                return all((n.get("sidecar") or {}).get("proxy") for n in nodes)

            t1 = time.monotonic()
            wait_until(renewed, 60, interval=0.25, what="every sidecar to renew its lease")
            print(f"every lease renewed by a listening sidecar {time.monotonic() - t1:.1f} s later", flush=True)
            assert tools.proc is not None and cp.proc is not None
            pids = {"sidecars": [pid_of(s) for s in sidecars], "control plane": [cp.proc.pid],
                    "tool server": [tools.proc.pid], "clients (this process)": [os.getpid()]}
            result = asyncio.run(scenario(cp, tools, sidecars, args.calls, args.short, args.long, args.window, pids,
                                          args.load))
            captures = {s.identity.agent: s.state_dir / "captures" / CAPTURE_FILE for s in sidecars}
            report(result, captures, args, len(sidecars), startup, pss)
        print(f"elapsed {time.monotonic() - began:.0f} s; load average now {os.getloadavg()[0]:.2f}")
    except BaseException:
        args.keep = True  # the logs of what failed stay for a look
        raise
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def match_tags(calls: list[dict[str, Any]], captures: dict[str, Path]
               ) -> tuple[dict[str, dict[str, Any]], int, int, float, int]:
    """Which record entry is which client call: the tag in the captured request's query string.

    The record's ``capture_ref`` names the captured flow. When it names none (the flow id in the capture
    differs), fall back to pairing, per agent, each entry's ``started_at`` with the nearest captured
    request's start time.
    """
    flows: dict[str, dict[str, Any]] = {}  # agent -> {flow id: (tag, start)}
    for agent, path in captures.items():
        flows[agent] = {}
        if path.exists():
            for flow in read_flows(path):
                tag = flow.request.query.get("tag")
                if tag:
                    flows[agent][flow.id] = (tag, flow.request.timestamp_start)
    in_record: dict[str, dict[str, Any]] = {}
    by_ref = by_time = 0
    leftover: dict[str, list[dict[str, Any]]] = {}
    for entry in calls:
        ref = (entry.get("capture_ref") or "").partition("#")[2]
        hit = flows.get(entry["agent"], {}).get(ref)
        if hit is not None:
            in_record[hit[0]] = entry
            by_ref += 1
        else:
            leftover.setdefault(entry["agent"], []).append(entry)
    worst = 0.0
    unmatched = 0
    for agent, entries in leftover.items():
        starts: dict[str, float] = {}
        for tag, start in flows.get(agent, {}).values():  # a call is written twice: same tag, same start
            if tag not in in_record:
                starts[tag] = start
        pairs = sorted((abs(e["started_at"] - start), i, tag) for i, e in enumerate(entries)
                       for tag, start in starts.items())
        used_entries: set[int] = set()
        for skew, i, tag in pairs:
            if i in used_entries or tag in in_record or skew > 0.5:
                continue
            used_entries.add(i)
            in_record[tag] = entries[i]
            by_time += 1
            worst = max(worst, skew)
        unmatched += len(entries) - len(used_entries)
    return in_record, by_ref, by_time, worst, unmatched


def report(r: dict[str, Any], captures: dict[str, Path], args: argparse.Namespace, n_agents: int, startup: float,
           rss_total: float) -> None:
    record, term, window = r["record"], r["termination"], args.window
    outcomes: list[Outcome] = r["outcomes"]
    probes: list[Probe] = r["probes"]

    in_record, by_ref, by_time, worst_skew, untagged = match_tags(record["calls"], captures)
    missing = [o.tag for o in outcomes if o.tag not in in_record]
    resolutions: dict[str, int] = {}
    for o in outcomes:
        entry = in_record.get(o.tag)
        if entry is not None:
            key = f"{entry['resolution']}" + (f"/{entry['status']}" if entry.get("status") else "")
            resolutions[key] = resolutions.get(key, 0) + 1
    # Per agent, what the clients saw must be what the record says: as many 200s as completed/200 calls.
    disagree = []
    for agent in sorted({o.agent for o in outcomes}):
        got = sum(1 for o in outcomes if o.agent == agent and o.result == "200")
        rec = sum(1 for c in record["calls"] if c["agent"] == agent and c["url"].endswith("/slow")
                  and c["resolution"] == "completed" and c.get("status") == 200)
        slow = sum(1 for c in record["calls"] if c["agent"] == agent and c["url"].endswith("/slow"))
        if got != rec or slow != sum(1 for o in outcomes if o.agent == agent):
            disagree.append(agent)
    client_results: dict[str, int] = {}
    for o in outcomes:
        client_results[o.result] = client_results.get(o.result, 0) + 1
    call_ids = [c["call_id"] for c in record["calls"]]

    requested_at, completed_at = term["requested_at"], term["completed_at"]
    to_record = completed_at - requested_at
    seen = (r["t_seen"] - r["t_request"]) if r["t_seen"] else float("nan")
    history = " -> ".join(f"{h['state']} +{h['at'] - requested_at:.2f}s" for h in term["history"])
    revoked = [lease["revoked_at"] for lease in record["leases"] if "revoked_at" in lease]
    first_revoke = min(revoked) if revoked else float("nan")
    refusals = [p.refused_at for p in probes if p.refused_at is not None]
    never = [p.agent for p in probes if p.refused_at is None]
    after_revoke = [t - first_revoke for t in refusals]
    sent_after_revoke = [p.refused_sent - first_revoke for p in probes if p.refused_sent is not None]
    after_return = [t - r["t_returned"] for t in refusals]
    probe_tags = {t for p in probes for t in p.tags}
    probes_in_record = sum(1 for t in probe_tags if t in in_record)
    cut = sum(1 for o in outcomes if o.seconds == args.long)
    short_done = sum(1 for o in outcomes if o.seconds == args.short and o.result == "200")

    load_outcomes: list[Outcome] = r["load"]
    # A load call refused once its sidecar had acknowledged may be reported after the record (as probes).
    load_missing = [o.tag for o in load_outcomes if o.tag not in in_record and o.result != "503 tether.terminated"]
    load_results: dict[str, int] = {}
    for o in load_outcomes:
        load_results[o.result] = load_results.get(o.result, 0) + 1
    load_span = (max((o.ended for o in load_outcomes), default=0) - min((o.started for o in load_outcomes),
                                                                        default=0)) or 1.0
    stalls: list[float] = r["stalls"]
    worst_stall = max(stalls, default=float("nan"))
    record_ok = to_record <= window + RECORD_SLACK_S
    missing_ok = not missing and not load_missing
    print()
    print(f"tree: {n_agents} agents (root, {args.children} children, {args.children * args.grandchildren} "
          f"grandchildren), each with its own sidecar process; started in {startup:.1f} s, "
          f"{rss_total:.0f} MiB PSS in all")
    print(f"calls: {len(outcomes)} started ({len(outcomes) - cut} of {args.short:g} s, {cut} of {args.long:g} s), "
          f"{r['in_flight']} in flight at the tool server when terminate was requested (ramp {r['ramp']:.2f} s); "
          f"drain window {window:g} s, control plane grace {args.grace:g} s")
    print()
    print("| figure | value |")
    print("|---|---:|")
    print(f"| terminate request -> record written (control plane: completed_at - requested_at) | {to_record:.2f} s |")
    print(f"| terminate request -> client sees state terminated (polled every 50 ms) | {seen:.2f} s |")
    print(f"| overhead beyond the drain window (the longest call, {args.long:g} s, outlives it) | "
          f"{to_record - window:+.2f} s |")
    print(f"| terminate request returned | {r['t_returned'] - r['t_request'] :.3f} s |")
    print(f"| request -> first link revoked | {first_revoke - requested_at:.3f} s |")
    print(f"| revoke -> refusal received by the prober: median / last of {len(refusals)} | "
          f"{pct(after_revoke, 0.5):.3f} s / "
          f"{max(after_revoke):.3f} s |")
    print(f"| the same, by when the first refused probe was sent: median / last | "
          f"{pct(sent_after_revoke, 0.5):.3f} s"
          f" / {max(sent_after_revoke):.3f} s |")
    print(f"| terminate returned -> last sidecar's refusal received | {max(after_return):.3f} s |")
    print(f"| probes forwarded before refusal (all sidecars) | {sum(p.forwarded for p in probes)} |")
    print(f"| short calls completed for the client (of {len(outcomes) - cut}) | {short_done} |")
    print()
    print(f"state history: {history}")
    for phase, label, wall in (("cpu_ramp", "calls entering (launch -> all in flight)", r["ramp"]),
                               ("cpu_termination", "termination (request -> terminated seen)", seen)):
        cpu = r[phase]
        print(f"CPU seconds used during {label}, {wall:.2f} s wall on {os.cpu_count()} cores: "
              + ", ".join(f"{role} {v:.2f}" for role, v in cpu.items()) + f"; total {sum(cpu.values()):.2f}")
    print("client saw: " + ", ".join(f"{k} x{v}" for k, v in sorted(client_results.items())))
    print(f"record: {len(record['calls'])} calls ({len(set(call_ids))} distinct call ids), "
          f"{len(record['agents_terminated'])} agents terminated, {len(record['agents_unaccounted'])} unaccounted, "
          f"{len(revoked)} leases revoked")
    print(f"the {len(outcomes)} slow calls in the record, by resolution: "
          + ", ".join(f"{k} {v}" for k, v in sorted(resolutions.items()))
          + f"; agents whose client outcomes disagree with their record entries: {len(disagree)}")
    print(f"missing from the record: {len(missing)}" + (f" (e.g. {missing[:5]})" if missing else "")
          + f"; probes in the record: {probes_in_record} of {len(probe_tags)} (a probe refused after its sidecar "
          f"acknowledged may postdate the record)")
    print(f"calls matched to their capture by capture_ref: {by_ref}; by start time (capture_ref names no captured "
          f"flow): {by_time}, largest start-time skew {worst_skew * 1000:.1f} ms; record entries unmatched: {untagged}")
    if never:
        print(f"sidecars that never refused a probe: {never}")
    if load_outcomes:
        print(f"load: {len(load_outcomes)} calls at {len(load_outcomes) / load_span:.0f}/s; client saw "
              + ", ".join(f"{k} x{v}" for k, v in sorted(load_results.items()))
              + f"; missing from the record: {len(load_missing)}" + (f" (e.g. {load_missing[:5]})" if load_missing
                                                                      else ""))
    print(f"control plane /healthz while it all ran ({len(stalls)} polls every 20 ms): p50 "
          f"{pct(stalls, 0.5) * 1000:.1f} ms, p99 {pct(stalls, 0.99) * 1000:.1f} ms, max {worst_stall * 1000:.1f} ms")
    loop = r["loop"]
    own_stall = loop.get("tether_event_loop_stall_seconds_max", float("nan"))
    print(f"control plane's own event-loop watch (since start): longest stall of its own work "
          f"{own_stall * 1000:.1f} ms; longest late tick whatever the cause (CPU starvation included) "
          f"{loop.get('tether_event_loop_late_seconds_max', float('nan')) * 1000:.1f} ms")
    print()
    print(f"target: record within window + {RECORD_SLACK_S:g} s ({window + RECORD_SLACK_S:g} s): "
          f"{'met' if record_ok else 'MISSED'} ({to_record:.2f} s)")
    print(f"target: zero calls missing: {'met' if missing_ok else 'MISSED'} ({len(missing) + len(load_missing)} "
          "missing)")
    print(f"target: 0 agents unaccounted: {'met' if not record['agents_unaccounted'] else 'MISSED'} "
          f"({len(record['agents_unaccounted'])})")
    print(f"target: no control-plane event-loop stall over {STALL_TARGET_S * 1000:.0f} ms (its own work, measured "
          f"in the process): {'met' if own_stall <= STALL_TARGET_S else 'MISSED'} ({own_stall * 1000:.1f} ms; the "
          f"slowest /healthz answer, CPU starvation included, was {worst_stall * 1000:.1f} ms)")


if __name__ == "__main__":
    sys.exit(main())
