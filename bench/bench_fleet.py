"""A fleet over Redis: how fast a revocation reaches 1,000 sidecars' event streams, and how many call reports
one control plane replica ingests per second.

Run: python bench/bench_fleet.py            (about 2-3 minutes on 2 cores; --quick for a smoke run)

Real parts: one ``redis-server`` and two ``tether controlplane serve`` replicas over it (A and B: same
catalog, same signing key), plus a SQLite replica for the ingest comparison. Loopback only.

(a) Revocation propagation. 1,000 subscribers, each holding its own registered chain
``fleet-root -> hop-1 -> hop-2 -> leaf-i`` (the leaves minted with ``mint_child`` and registered by
``POST /v1/chains/register``, signed with the leaf's key). Each subscriber is the sidecar's own event
client: a ``ControlChannel`` and a ``SidecarState``, driven by ``ControlLoops.sync_events`` and
``ControlLoops.on_event`` themselves (the functions, not copies). Even subscribers follow replica A, odd ones
replica B; they run in 2 worker processes (500 asyncio long polls each). Three rounds, each revoking one
shared link through replica A, deepest first (hop-2, hop-1, then the root): every round cuts all 1,000
off, and every subscriber must learn of it. Per subscriber we take the time from the revoke call's
return (and from its send) to the moment its ``SidecarState`` holds the jti, i.e. from which it would
refuse every call. Clock: CLOCK_MONOTONIC, shared by every process on the machine. Between rounds the
subscribers that got the revocation wait, so the next round starts from 1,000 parked long polls.

Baselines in the same run: the same client and rounds with a single subscriber following B (the
cross-replica path with no fan-out), and raw Redis pub/sub: one PUBLISH to 1 and to 1,000 redis-py
asyncio subscribers spread the same way over the 2 worker processes (the floor for waking 1,000
Python clients on this machine).

Also printed per round: the CPU time each process group used (``/proc``), which shows where the time
goes.

Target: p99 under 100 ms from the revoke call's return, with every subscriber reached.

(b) Report ingest. One replica, on SQLite and on Redis: 8 senders (each a registered agent, every
request signed with its key as a sidecar signs it) POST batches of 200 final call reports to
``/v1/reports``. The request bodies are built before the clock starts so the figure is the replica's, not
the client's. Baseline: the same batches passed to the store's ``put_reports`` directly, in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from tests.harness import (  # noqa: E402
    ControlPlaneProcess,
    RedisServer,
    free_port,
    prepare_controlplane,
    wait_until,
)
from tether.capability import keys  # noqa: E402
from tether.capability.catalog import parse_catalog  # noqa: E402
from tether.capability.chain import mint_child, mint_root, parse_chain_unverified  # noqa: E402
from tether.capability.errors import ApiError  # noqa: E402
from tether.capability.proof import make_proof  # noqa: E402

TARGET_P99_MS = 100.0
TARGET_FLEET_P99_MS = 1000.0
PUBSUB = "raw Redis PUBLISH -> redis-py subscriber"
AS_SHIPPED = "revoke on A -> sidecar stream client (ControlChannel.stream_events)"
LIGHT = "revoke on A -> light stream client (shared session per process)"
CAPS = {"issues.read": "direct"}
REPORTS_PATH = "/v1/reports"


# -- shared helpers ---------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    data = sorted(values)
    return data[min(len(data) - 1, int(q * len(data)))] if data else float("nan")


def nproc() -> str:
    try:
        return subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(os.cpu_count())


@dataclass
class Holder:
    """A chain, its leaf link and the leaf's private key: what a sidecar starts with."""

    agent: str
    wire: str
    key: Any

    @property
    def leaf(self) -> Any:
        return parse_chain_unverified(self.wire)[-1]

    def to_json(self, url: str) -> dict[str, Any]:
        pem = base64.b64encode(keys.private_pem(self.key)).decode()
        return {"agent": self.agent, "wire": self.wire, "key": pem, "url": url}


def mint_tree(cp: ControlPlaneProcess, prefix: str, shared: int, leaves: int, ttl: float = 3600) -> list[Holder]:
    """``prefix-root -> prefix-hop-1 .. prefix-hop-(shared-1) -> prefix-leaf-i`` for i < leaves."""
    signing = keys.load_private(cp.signing_key_path.read_bytes())
    catalog = parse_catalog(cp.catalog_path.read_text(), str(cp.catalog_path))
    now = time.time()
    key = keys.generate()
    wire = mint_root(signing, agent=f"{prefix}-root", subject_key=key.public_key(), caps=CAPS, now=now,
                     ttl_s=ttl, depth=shared + 1, catalog=catalog)
    for hop in range(1, shared):
        child_key = keys.generate()
        child = mint_child(parse_chain_unverified(wire)[-1], key, agent=f"{prefix}-hop-{hop}",
                           subject_key=child_key.public_key(), caps=CAPS, now=now, ttl_s=ttl)
        wire, key = f"{wire},{child}", child_key
    parent = parse_chain_unverified(wire)[-1]
    holders = []
    for i in range(leaves):
        leaf_key = keys.generate()
        leaf = mint_child(parent, key, agent=f"{prefix}-leaf-{i}", subject_key=leaf_key.public_key(), caps=CAPS,
                          now=now, ttl_s=ttl)
        holders.append(Holder(f"{prefix}-leaf-{i}", f"{wire},{leaf}", leaf_key))
    return holders


async def register_all(holders: list[Holder], url: str | list[str], concurrency: int = 32) -> None:
    """Register every chain as its sidecar does: POST /v1/chains/register signed with the leaf's key (spread
    over the replicas when given several)."""
    from tether.proxy.channel import ControlChannel

    urls = [url] if isinstance(url, str) else url
    queue = list(holders)

    async def worker(n: int) -> None:
        while queue:
            h = queue.pop()
            channel = ControlChannel(urls[n % len(urls)], h.agent, h.leaf.hash, h.key)
            try:
                await channel.register(h.wire)
            finally:
                await channel.close()

    await asyncio.gather(*(worker(n) for n in range(concurrency)))


# -- subscriber worker process: the sidecar's event client, many per process -----------------------------------
def worker_main() -> None:
    """Runs in a child process. First stdin line: the subscribers; then one JSON command per line."""
    import logging

    from tether.capability.chain import Verifier
    from tether.proxy.approvals import on_approval as decided  # a class body cannot read the function's own name
    from tether.proxy.channel import ControlChannel, sleep_backoff
    from tether.proxy.loops import ControlLoops
    from tether.proxy.state import SidecarState

    logging.getLogger("tether").setLevel(logging.ERROR)  # every subscriber logs "revoked" otherwise

    class Subscriber:
        """What ``ControlLoops.apply_events`` and ``ControlLoops.on_event`` need of a sidecar, and nothing else."""

        apply_events = ControlLoops.apply_events
        on_event = ControlLoops.on_event
        on_approval = decided

        def __init__(self, channel: ControlChannel, state: SidecarState) -> None:
            self.channel = channel
            self.state = state
            self.seq = -1
            self.approvals: dict[str, Any] = {}
            self.learned: dict[str, float] = {}  # jti -> monotonic time it entered state.revoked
            self.streaming = False
            self.errors = 0

        def on_command(self, command: dict[str, Any]) -> None:
            pass  # no terminations in this benchmark

    async def main() -> None:
        import aiohttp

        config = json.loads(await asyncio.to_thread(sys.stdin.readline))
        trust = keys.load_public(config["trust"].encode())
        verifier = Verifier(trust, catalog_hash=config["catalog_hash"])
        # Light subscribers share one HTTP client session per process (one socket each, no pool of their
        # own): the stream client code is the sidecar's, the per-client memory is not.
        shared = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) if config.get("light") else None
        subs: list[Subscriber] = []
        for s in config["subs"]:
            key = keys.load_private(base64.b64decode(s["key"]))
            state = SidecarState(verifier.verify(s["wire"], now=time.time()), verifier, lease_ttl_s=15.0)
            link = parse_chain_unverified(s["wire"])[-1]
            channel = ControlChannel(s["url"], s["agent"], link.hash, key)
            if shared is not None:
                channel._session = shared
            subs.append(Subscriber(channel, state))
        errors: dict[str, int] = {}

        async def follow(sub: Subscriber) -> None:
            """ControlLoops.events_loop's streaming branch, timing each revocation as it lands in the state."""
            attempt = 0
            while True:
                try:
                    async for answer in sub.channel.stream_events(sub.seq):
                        before = set(sub.state.revoked)
                        sub.apply_events(answer)
                        sub.streaming = True
                        attempt = 0
                        new = sub.state.revoked - before
                        if new:
                            now = time.monotonic()
                            for jti in new:
                                sub.learned.setdefault(jti, now)
                except ApiError as exc:
                    sub.errors += 1
                    errors[exc.code] = errors.get(exc.code, 0) + 1
                    attempt += 1
                    await sleep_backoff(attempt)
                finally:
                    sub.streaming = False
                await asyncio.sleep(0.1)

        tasks: list[asyncio.Task[None]] = []
        for start in range(0, len(subs), 50):  # connect in slices, as a fleet starting up would, not at once
            tasks += [asyncio.create_task(follow(sub)) for sub in subs[start:start + 50]]
            await asyncio.sleep(0.1)
        pubsub_times: dict[str, list[float]] = {}
        pubsub_tasks: list[asyncio.Task[None]] = []
        pubsub_clients: list[Any] = []

        async def pubsub_start(url: str, channel: str, n: int) -> None:
            import redis.asyncio as aioredis

            client = aioredis.from_url(url, max_connections=n + 4)
            pubsub_clients.append(client)
            ready = 0

            async def listen() -> None:
                nonlocal ready
                ps = client.pubsub()
                await ps.subscribe(channel)
                await ps.get_message(timeout=5)  # the subscribe confirmation
                ready += 1
                while True:
                    msg = await ps.get_message(ignore_subscribe_messages=True, timeout=30)
                    if msg is not None:
                        pubsub_times.setdefault(msg["data"].decode(), []).append(time.monotonic())

            pubsub_tasks.extend(asyncio.create_task(listen()) for _ in range(n))
            deadline = time.monotonic() + 30
            while ready < n and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

        def reply(doc: dict[str, Any]) -> None:
            sys.stdout.write(json.dumps(doc) + "\n")
            sys.stdout.flush()

        reply({"ok": True, "subs": len(subs)})
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "status":
                dead = [t for t in tasks if t.done()]
                reply({"streaming": sum(s.streaming for s in subs), "errors": sum(s.errors for s in subs),
                       "error_codes": errors, "dead": len(dead),
                       "why": repr(dead[0].exception()) if dead and not dead[0].cancelled() else None})
            elif op == "collect":
                reply({"times": [s.learned.get(cmd["jti"]) for s in subs]})  # in subscriber order, None: not yet
            elif op == "pubsub_start":
                await pubsub_start(cmd["url"], cmd["channel"], cmd["n"])
                reply({"ok": True})
            elif op == "pubsub_collect":
                reply({"times": pubsub_times.get(cmd["msg"], [])})
            elif op == "stop":
                break
        for task in (*tasks, *pubsub_tasks):
            task.cancel()
        await asyncio.gather(*tasks, *pubsub_tasks, return_exceptions=True)
        if shared is not None:
            await shared.close()
        else:
            for sub in subs:
                await sub.channel.close()
        for client in pubsub_clients:
            await client.aclose()
        reply({"ok": True})

    asyncio.run(main())


class Worker:
    """A subscriber worker process, spoken to over its stdin/stdout, one JSON line each way."""

    def __init__(self, log: Path) -> None:
        self.log = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)

    def send(self, doc: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(doc) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float = 120) -> dict[str, Any]:
        import selectors

        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise TimeoutError(f"worker {self.proc.pid} did not answer within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.pid} exited ({self.proc.poll()}); see {self.log.name}")
        return json.loads(line)

    def ask(self, doc: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
        self.send(doc)
        return self.receive(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask({"op": "stop"}, timeout=10)
                self.proc.wait(10)
            except (OSError, TimeoutError, RuntimeError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# -- (a) revocation propagation ------------------------------------------------------------------------------
@dataclass
class Round:
    what: str
    latencies_ms: list[float] = field(default_factory=list)  # from the revoke call's return
    from_send_ms: list[float] = field(default_factory=list)
    by_replica: dict[str, list[float]] = field(default_factory=dict)
    reached: int = 0
    expected: int = 0
    revoke_call_ms: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    cpu_ms: dict[str, float] = field(default_factory=dict)  # per process group, over the round's window
    window_ms: float = 0.0  # from the revoke's send until every subscriber was seen to have it


def start_workers(holders_by_worker: list[list[dict[str, Any]]], cp: ControlPlaneProcess, logdir: Path,
                  workers: list[Worker], light: bool = False) -> None:
    trust = keys.public_pem(keys.load_private(cp.signing_key_path.read_bytes()).public_key()).decode()
    catalog_hash = parse_catalog(cp.catalog_path.read_text(), str(cp.catalog_path)).hash
    started = []
    for n, subs in enumerate(holders_by_worker):
        w = Worker(logdir / f"worker-{len(workers)}.log")
        workers.append(w)
        w.send({"trust": trust, "catalog_hash": catalog_hash, "subs": subs, "light": light})
        started.append((w, n))
    for w, _ in started:
        assert w.receive(120)["ok"]


def wait_streaming(workers: list[Worker], total: int, timeout: float = 180) -> None:
    def all_streaming() -> bool:
        status = [w.ask({"op": "status"}) for w in workers]
        assert not any(s["dead"] for s in status), status
        return sum(s["streaming"] for s in status) >= total

    wait_until(all_streaming, timeout, interval=0.5, what=f"{total} event streams")
    time.sleep(1.0)  # quiet before the round


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_ms(pids: list[int]) -> float:
    """User + system CPU time the processes have used so far (from /proc), in ms."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
    return total * 1000 / os.sysconf("SC_CLK_TCK")


def revoke_round(a: ControlPlaneProcess, jti: str, workers: list[Worker], followers: list[list[str]],
                 total: int, what: str, processes: dict[str, list[int]] | None = None) -> Round:
    client = a.client()
    cpu_before = {name: cpu_ms(pids) for name, pids in (processes or {}).items()}
    sent = time.monotonic()
    refused = 0
    while True:  # as an operator would: a 503 is retried (it is counted, and the clock runs from the first try)
        try:
            client.request("POST", f"/v1/grants/{jti}/revoke", {"reason": "bench"})
            break
        except ApiError as exc:
            if exc.http_status != 503 or refused >= 50:
                raise
            refused += 1
            time.sleep(0.1)
    returned = time.monotonic()
    rnd = Round(what, expected=total, revoke_call_ms=(returned - sent) * 1000)
    if refused:
        rnd.errors["revoke call answered 503, retried"] = refused
    deadline = time.monotonic() + 15
    answers: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        time.sleep(0.2)
        answers = [w.ask({"op": "collect", "jti": jti}) for w in workers]
        if sum(t is not None for x in answers for t in x["times"]) >= total:
            break
    for answer, replicas in zip(answers, followers, strict=True):
        for t, replica in zip(answer["times"], replicas, strict=True):
            if t is not None:
                rnd.latencies_ms.append((t - returned) * 1000)
                rnd.from_send_ms.append((t - sent) * 1000)
                rnd.by_replica.setdefault(replica, []).append((t - returned) * 1000)
    rnd.cpu_ms = {name: cpu_ms(pids) - cpu_before[name] for name, pids in (processes or {}).items()}
    rnd.window_ms = (time.monotonic() - sent) * 1000
    rnd.reached = len(rnd.latencies_ms)
    return rnd


def pubsub_round(redis_url: str, channel: str, msg: str, workers: list[Worker], total: int) -> Round:
    import redis

    r = redis.Redis.from_url(redis_url)
    sent = time.monotonic()
    receivers = r.publish(channel, msg)
    returned = time.monotonic()
    r.close()
    rnd = Round(f"PUBLISH {msg}", expected=total, revoke_call_ms=(returned - sent) * 1000)
    deadline = time.monotonic() + 10
    times: list[float] = []
    while time.monotonic() < deadline:
        time.sleep(0.1)
        times = [t for w in workers for t in w.ask({"op": "pubsub_collect", "msg": msg})["times"]]
        if len(times) >= total:
            break
    rnd.latencies_ms = [(t - returned) * 1000 for t in times]
    rnd.from_send_ms = [(t - sent) * 1000 for t in times]
    rnd.reached = len(times)
    assert receivers >= total, f"PUBLISH reached {receivers} subscribers, expected {total}"
    return rnd


def pubsub_baseline(directory: Path, cp: ControlPlaneProcess, redis_url: str, subscribers: int, n_workers: int,
                    rounds: int) -> dict[tuple[str, int], list[Round]]:
    """Raw Redis pub/sub to 1 and to N redis-py asyncio subscribers, in the same worker layout."""
    workers: list[Worker] = []
    try:
        start_workers([[] for _ in range(n_workers)], cp, directory, workers)
        workers[0].ask({"op": "pubsub_start", "url": redis_url, "channel": "bench:one", "n": 1}, timeout=60)
        per = subscribers // n_workers
        for w in workers:
            w.ask({"op": "pubsub_start", "url": redis_url, "channel": "bench:many", "n": per}, timeout=120)
        return {
            (PUBSUB, 1): [pubsub_round(redis_url, "bench:one", f"one-{i}", workers, 1) for i in range(rounds)],
            (PUBSUB, per * n_workers): [pubsub_round(redis_url, "bench:many", f"many-{i}", workers, per * n_workers)
                                        for i in range(rounds)],
        }
    finally:
        for w in workers:
            w.stop()


def propagation(directory: Path, a: ControlPlaneProcess, b: ControlPlaneProcess, label: str, subscribers: int,
                n_workers: int, rounds: int, redis_pid: int, light: bool = False,
                solo: bool = True) -> dict[tuple[str, int], list[Round]]:
    results: dict[tuple[str, int], list[Round]] = {}
    prefix = f"fleet{subscribers}"
    if solo:  # baseline: one subscriber following B, the same chain shape, revoked through A
        alone = mint_tree(a, f"{prefix}-solo", rounds, 1)
        asyncio.run(register_all(alone, a.url))
        workers: list[Worker] = []
        try:
            start_workers([[alone[0].to_json(b.url)]], a, directory, workers)
            jtis = [link.jti for link in parse_chain_unverified(alone[0].wire)[:rounds]][::-1]
            runs = []
            for i, jti in enumerate(jtis):
                wait_streaming(workers, 1)
                runs.append(revoke_round(a, jti, workers, [["B"]], 1, f"solo round {i + 1}"))
            results[label, 1] = runs
        finally:
            for w in workers:
                w.stop()

    t0 = time.monotonic()
    fleet = mint_tree(a, prefix, rounds, subscribers)
    minted = time.monotonic()
    asyncio.run(register_all(fleet, [a.url, b.url], concurrency=64))
    registered = time.monotonic()
    print(f"  minted {subscribers} chains in {minted - t0:.1f}s, registered them in {registered - minted:.1f}s",
          flush=True)
    per_worker: list[list[dict[str, Any]]] = [[] for _ in range(n_workers)]
    followers: list[list[str]] = [[] for _ in range(n_workers)]
    for i, holder in enumerate(fleet):
        w = i * n_workers // len(fleet)
        replica = "A" if i % 2 == 0 else "B"
        per_worker[w].append(holder.to_json(a.url if replica == "A" else b.url))
        followers[w].append(replica)
    workers = []
    try:
        assert a.proc is not None and b.proc is not None
        rss_before = rss_mib(a.proc.pid) + rss_mib(b.proc.pid)
        start_workers(per_worker, a, directory, workers, light=light)
        connecting = time.monotonic()
        wait_streaming(workers, len(fleet), timeout=600)
        rss_after = rss_mib(a.proc.pid) + rss_mib(b.proc.pid)
        print(f"  {len(fleet)} streams open in {time.monotonic() - connecting:.1f}s; the two replicas' RSS "
              f"{rss_before:.0f} -> {rss_after:.0f} MiB ({(rss_after - rss_before) * 1024 / len(fleet):.1f} KiB "
              "per stream)", flush=True)
        jtis = [link.jti for link in parse_chain_unverified(fleet[0].wire)[:rounds]][::-1]
        runs = []
        for i, jti in enumerate(jtis):
            wait_streaming(workers, len(fleet))
            what = "root" if i == len(jtis) - 1 else f"hop-{len(jtis) - 1 - i}"
            assert a.proc is not None and b.proc is not None
            processes = {"replica A": [a.proc.pid], "replica B": [b.proc.pid], "redis-server": [redis_pid],
                         f"subscriber processes ({n_workers})": [w.proc.pid for w in workers]}
            runs.append(revoke_round(a, jti, workers, followers, len(fleet), f"revoke {what}", processes))
            r = runs[-1]
            print(f"  round {i + 1} ({what}): reached {r.reached}/{r.expected}, p99 {pct(r.from_send_ms, .99):.1f} ms "
                  f"from the send, revoke call {r.revoke_call_ms:.1f} ms", flush=True)
        status = [w.ask({"op": "status"}) for w in workers]
        for st in status:
            for code, n in st["error_codes"].items():
                runs[-1].errors[code] = runs[-1].errors.get(code, 0) + n
        print(f"  subscriber streams broken and resumed: {runs[-1].errors or 'none'}", flush=True)
        results[label, len(fleet)] = runs
    finally:
        for w in workers:
            w.stop()
    return results


def print_propagation(results: dict[tuple[str, int], list[Round]]) -> None:
    print("\n### Revocation propagation (ms; all rounds pooled)\n")
    print("| path | subscribers | reached | from the revoke call's return: p50 / p99 / max | "
          "from its send: p50 / p99 / max | revoke call (ms, median) | requests refused (then retried) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for (label, n), runs in results.items():
        lat = [x for r in runs for x in r.latencies_ms]
        send = [x for r in runs for x in r.from_send_ms]
        reached = sum(r.reached for r in runs)
        expected = sum(r.expected for r in runs)
        call = statistics.median(r.revoke_call_ms for r in runs)
        errors: dict[str, int] = {}
        for r in runs:
            for code, c in r.errors.items():
                errors[code] = errors.get(code, 0) + c
        refused = ", ".join(f"{c} {code}" for code, c in errors.items()) or ("0" if label != PUBSUB else "-")
        print(f"| {label} | {n} | {reached}/{expected} | {pct(lat, .5):.1f} / {pct(lat, .99):.1f} / "
              f"{max(lat, default=float('nan')):.1f} | {pct(send, .5):.1f} / {pct(send, .99):.1f} / "
              f"{max(send, default=float('nan')):.1f} | {call:.1f} | {refused} |")
    for (label, n), runs in results.items():
        if label == PUBSUB or n == 1:
            continue
        print(f"\nPer round and per replica followed: {label}, {n} subscribers (ms from the revoke call's send)\n")
        print("| round | reached | p50 | p99 | max | followers of A: p50 / p99 | followers of B: p50 / p99 |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in runs:
            shift = r.revoke_call_ms
            a = [x + shift for x in r.by_replica.get("A", [])]
            b = [x + shift for x in r.by_replica.get("B", [])]
            print(f"| {r.what} | {r.reached}/{r.expected} | {pct(r.from_send_ms, .5):.1f} | "
                  f"{pct(r.from_send_ms, .99):.1f} | {max(r.from_send_ms, default=float('nan')):.1f} | "
                  f"{pct(a, .5):.1f} / {pct(a, .99):.1f} | {pct(b, .5):.1f} / {pct(b, .99):.1f} |")
        names = list(runs[0].cpu_ms)
        print(f"\nCPU used during each round (ms, /proc utime+stime, 10 ms ticks): {label}, {n} subscribers\n")
        print(f"| round | window (ms) | {' | '.join(names)} | all | all / nproc |")
        print("|---|---:|" + "---:|" * (len(names) + 2))
        cores = len(os.sched_getaffinity(0))
        for r in runs:
            all_ms = sum(r.cpu_ms.values())
            print(f"| {r.what} | {r.window_ms:.0f} | {' | '.join(f'{r.cpu_ms[k]:.0f}' for k in names)} | "
                  f"{all_ms:.0f} | {all_ms / cores:.0f} |")


# -- (b) report ingest -----------------------------------------------------------------------------------------
def report_doc(agent: str, i: int, now: float) -> dict[str, Any]:
    """The shape of ``proxy.state.Call.report()`` for an ordinary completed call."""
    return {"call_id": f"{agent}-{i:07d}", "agent": agent, "method": "GET",
            "url": "http://127.0.0.1:9000/repos/tether/bench/issues", "started_at": now + i * 1e-3,
            "capability": "issues.read", "tier": "direct", "resolution": "completed", "status": 200, "code": None,
            "ended_at": now + i * 1e-3 + 0.004, "capture_ref": f"captures/flows.mitm#{i * 2048}",
            "termination_id": None, "detail": None}


async def ingest_http(url: str, senders: list[Holder], batches: int, batch: int) -> tuple[float, int]:
    """Every sender POSTs ``batches`` batches; returns (reports per second, reports accepted)."""
    await register_all(senders, url, concurrency=len(senders))
    now = time.time()
    bodies: dict[str, list[bytes]] = {}
    for s in senders:
        bodies[s.agent] = [
            json.dumps({"reports": [report_doc(s.agent, n * batch + k, now) for k in range(batch)]}).encode()
            for n in range(batches + 1)]
    accepted = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=len(senders))) as session:

        async def post(s: Holder, body: bytes) -> int:
            proof = make_proof(s.key, agent=s.agent, method="POST", path=REPORTS_PATH, body=body, now=time.time(),
                               link=s.leaf.hash, run=f"run-{s.agent}")
            async with session.post(url + REPORTS_PATH, data=body, timeout=aiohttp.ClientTimeout(total=60),
                                    headers={"Content-Type": "application/json", "Tether-Proof": proof}) as resp:
                doc = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"POST /v1/reports: HTTP {resp.status}: {doc}")
                return int(doc["accepted"])

        await asyncio.gather(*(post(s, bodies[s.agent][0]) for s in senders))  # warm-up, not counted

        async def sender(s: Holder) -> int:
            return sum([await post(s, body) for body in bodies[s.agent][1:]])

        start = time.perf_counter()
        accepted = sum(await asyncio.gather(*(sender(s) for s in senders)))
        wall = time.perf_counter() - start
    return accepted / wall, accepted


async def heartbeats_http(url: str, senders: list[Holder], per_sender: int) -> float:
    """Every sender renews its lease ``per_sender`` times, as a sidecar does; returns heartbeats per second."""
    body = json.dumps({"state": "serving", "inflight": [], "seq": 0, "pid": 1, "spooled": 0}).encode()
    path = "/v1/sidecars/heartbeat"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=len(senders))) as session:

        async def beat(s: Holder) -> None:
            proof = make_proof(s.key, agent=s.agent, method="POST", path=path, body=body, now=time.time(),
                               link=s.leaf.hash, run=f"run-{s.agent}")
            async with session.post(url + path, data=body, headers={"Content-Type": "application/json",
                                                                     "Tether-Proof": proof}) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"heartbeat: HTTP {resp.status}: {await resp.text()}")

        async def sender(s: Holder) -> None:
            for _ in range(per_sender):
                await beat(s)

        await asyncio.gather(*(beat(s) for s in senders))  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(sender(s) for s in senders))
        return len(senders) * per_sender / (time.perf_counter() - start)


async def ingest_direct(store_url: str, senders: int, batches: int, batch: int) -> tuple[float, int]:
    from tether.controlplane.store import open_store_url

    store = open_store_url(store_url)
    await store.open()
    try:
        now = time.time()
        work = [[[{**report_doc(f"direct-{s}", n * batch + k, now), "received_at": now} for k in range(batch)]
                 for n in range(batches)] for s in range(senders)]

        async def sender(lists: list[list[dict[str, Any]]]) -> int:
            return sum([(await store.put_reports(docs))[0] for docs in lists])

        start = time.perf_counter()
        accepted = sum(await asyncio.gather(*(sender(lists) for lists in work)))
        wall = time.perf_counter() - start
        return accepted / wall, accepted
    finally:
        await store.close()


def ingest(directory: Path, redis_cp: ControlPlaneProcess, redis_url: str, n_senders: int, batches: int,
           batch: int, redis_pid: int) -> list[tuple[str, str, float, int]]:
    rows: list[tuple[str, str, float, int]] = []
    sqlite_cp = ControlPlaneProcess(directory / "cp-sqlite")
    sqlite_cp.directory.mkdir(parents=True)
    for path in (redis_cp.catalog_path, redis_cp.signing_key_path):
        shutil.copy(path, sqlite_cp.directory / path.name)
    try:
        sqlite_cp.start()
        for label, cp, store_url in (("SQLite", sqlite_cp, f"sqlite:///{directory / 'direct.db'}"),
                                     ("Redis", redis_cp, redis_url)):
            senders = [Holder(h.agent, h.wire, h.key) for h in
                       (mint_tree(cp, f"ingest-{label.lower()}-{s}", 1, 1)[0] for s in range(n_senders))]
            assert cp.proc is not None
            asyncio.run(register_all(senders, cp.url, concurrency=len(senders)))
            before = cpu_ms([cp.proc.pid]), cpu_ms([redis_pid])
            rate, n = asyncio.run(ingest_http(cp.url, senders, batches, batch))
            used = cpu_ms([cp.proc.pid]) - before[0], cpu_ms([redis_pid]) - before[1]
            rows.append((label, f"POST /v1/reports, {n_senders} senders, batches of {batch}", rate, n))
            print(f"  {label}: CPU per report: replica {used[0] * 1000 / n:.1f} us, redis-server "
                  f"{used[1] * 1000 / n:.1f} us (the whole POST phase, warm-up included)", flush=True)
            rate, n = asyncio.run(ingest_direct(store_url, n_senders, batches, batch))
            rows.append((label, f"store.put_reports in-process, {n_senders} concurrent, batches of {batch}", rate, n))
            before = cpu_ms([cp.proc.pid]), cpu_ms([redis_pid])
            beats = asyncio.run(heartbeats_http(cp.url, senders, batches * 4))
            used = cpu_ms([cp.proc.pid]) - before[0], cpu_ms([redis_pid]) - before[1]
            rows.append((label, f"POST /v1/sidecars/heartbeat, {n_senders} senders (heartbeats/s)", beats,
                         n_senders * batches * 4))
            print(f"  {label}: CPU per heartbeat: replica {used[0] * 1000 / (n_senders * batches * 4):.0f} us, "
                  f"redis-server {used[1] * 1000 / (n_senders * batches * 4):.0f} us", flush=True)
            print(f"  {label}: {rows[-3][2]:,.0f} reports/s over HTTP, {rows[-2][2]:,.0f} reports/s direct, "
                  f"{beats:,.0f} heartbeats/s", flush=True)
    finally:
        sqlite_cp.stop()
    return rows


def print_ingest(rows: list[tuple[str, str, float, int]]) -> None:
    print("\n### Report ingest, one replica\n")
    print("| store | path | reports stored | reports/s | replica's share of the store's own rate |")
    print("|---|---|---:|---:|---:|")
    direct = {store: rate for store, path, rate, _ in rows if "in-process" in path}
    for store, path, rate, n in rows:
        share = (f"{rate / direct[store]:.0%}" if "/v1/reports" in path
                 else "(baseline)" if "in-process" in path else "-")
        print(f"| {store} | {path} | {n:,} | {rate:,.0f} | {share} |")


# -- main --------------------------------------------------------------------------------------------------------
def replica_pair(directory: Path, name: str, store: str) -> tuple[ControlPlaneProcess, ControlPlaneProcess]:
    """Two replicas over one store, one deployment: the same catalog and signing key."""
    a = prepare_controlplane(directory / f"{name}-a", free_port(), free_port(), free_port(), store=store)
    b = ControlPlaneProcess(directory / f"{name}-b", store=store)
    b.directory.mkdir(parents=True)
    for path in (a.catalog_path, a.signing_key_path):
        shutil.copy(path, b.directory / path.name)
    return a, b


def verdict(fleet: list[Round], target_ms: float) -> tuple[str, float, int, int]:
    from_send = [x for r in fleet for x in r.from_send_ms]
    reached, expected = sum(r.reached for r in fleet), sum(r.expected for r in fleet)
    p99 = pct(from_send, 0.99)
    return ("met" if reached == expected and p99 <= target_ms else "missed"), p99, reached, expected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="100 and 1,000 subscribers, fewer batches: a smoke run")
    parser.add_argument("--subscribers", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2, help="subscriber processes")
    parser.add_argument("--fleet", type=int, default=10_000, help="light subscribers in the large run (0: skip)")
    parser.add_argument("--fleet-workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--senders", type=int, default=8)
    parser.add_argument("--batches", type=int, default=25, help="batches per sender (0: skip the ingest part)")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs)")
    args = parser.parse_args()
    if args.worker:
        worker_main()
        return
    if args.quick:
        args.subscribers, args.fleet, args.batches = 100, 1000, 5

    print(f"bench_fleet: Python {platform.python_version()} on {platform.machine()}, nproc {nproc()}, "
          f"load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    directory = Path(tempfile.mkdtemp(prefix="tether-bench-fleet-"))
    redis = RedisServer(directory / "redis")
    running: list[ControlPlaneProcess] = []
    started = time.monotonic()
    try:
        redis.start()
        a, b = replica_pair(directory, "cp", redis.url(0))
        for cp in (a, b):
            running.append(cp)
            cp.start()
        print("(a) revocation propagation", flush=True)
        results = pubsub_baseline(directory, a, redis.url(0), args.subscribers, args.workers, args.rounds)
        results.update(propagation(directory, a, b, AS_SHIPPED, args.subscribers, args.workers, args.rounds,
                                   redis.proc.pid))
        if args.fleet:
            print(f"(b) {args.fleet:,} light event clients", flush=True)
            results.update(propagation(directory, a, b, LIGHT, args.fleet, args.fleet_workers, args.rounds,
                                       redis.proc.pid, light=True, solo=False))
        rows = []
        if args.batches:
            print("(c) report ingest", flush=True)
            rows = ingest(directory, a, redis.url(1), args.senders, args.batches, 200, redis.proc.pid)
        print_propagation(results)
        if rows:
            print_ingest(rows)
        pubsub = [x for r in results[PUBSUB, args.subscribers // args.workers * args.workers]
                  for x in r.from_send_ms]
        met, p99, reached, expected = verdict(results[AS_SHIPPED, args.subscribers], TARGET_P99_MS)
        print(f"\nTarget p99 <= {TARGET_P99_MS:.0f} ms from the send, every one of {args.subscribers} stream clients "
              f"reached: {met} (p99 {p99:.1f} ms, reached {reached}/{expected}); raw PUBLISH p99 "
              f"{pct(pubsub, .99):.1f} ms: ratio {p99 / pct(pubsub, .99):.2f}x (target <= 1.5x).")
        if args.fleet:
            met, p99, reached, expected = verdict(results[LIGHT, args.fleet], TARGET_FLEET_P99_MS)
            print(f"Target p99 <= {TARGET_FLEET_P99_MS:.0f} ms from the send, every one of {args.fleet:,} light "
                  f"clients reached: {met} (p99 {p99:.1f} ms, reached {reached}/{expected}).")
        print(f"nproc {nproc()}. Whole run {time.monotonic() - started:.0f} s; load average now "
              f"{os.getloadavg()[0]:.1f}.")
    finally:
        for cp in running:
            cp.stop()
        redis.stop()
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            print(f"kept {directory}")


if __name__ == "__main__":
    main()
