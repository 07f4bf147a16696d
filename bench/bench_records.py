"""Big records: the time to write the termination record of an agent with N calls, and what it costs the
control plane meanwhile (its RSS, and how late ``/healthz`` answers), on SQLite and on Redis.

Run: python bench/bench_records.py                 (N = 200,000; several minutes)
     python bench/bench_records.py --calls 20000   (a quick run; --store sqlite|redis|both)

Real processes: ``tether controlplane serve`` (the harness's ``ControlPlaneProcess``) over a SQLite file and
over a ``redis-server`` started here. Two agents are granted through the API (``POST /v1/chains/register``):
``big`` gets N final call reports, ``small`` one (the baseline, measured in the same control plane just
before). The reports go straight into the store (the same ``Store`` class, a connection of the bench's own:
delivering 200,000 reports through signed sidecar requests would measure ingest, not the record). Each
agent is then terminated (``abort``, window 0) through the API, and until its termination is ``terminated``
a thread reads the control plane's RSS (``/proc/PID/status``) every 20 ms and another asks ``/healthz``
back to back. Reported: request -> terminated, reconciling -> terminated (the record itself, from the
termination's history), whether that is within the window plus the default grace (5 s), the CPU seconds
the control plane (and redis-server) spent from request to terminated (the work, which the load of a shared
machine does not stretch the way it stretches wall-clock times), the record's size, the peak RSS during it
over the RSS before, and the worst and median ``/healthz`` latency during it; and the ratio of each to the
1-call baseline. Each record is then read back from the store a page at a time and its hash recomputed (it
must be the one signed). ``--before DIR``: the control plane of a checkout of the code before (``git worktree
add DIR main``) is measured too, in alternating runs over fresh stores (``--rounds`` of each), and the ratios
of the medians printed.

Run: python bench/bench_records.py --calls 1000000 --before /tmp/before --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness import ControlPlaneProcess, RedisServer, prepare_controlplane  # noqa: E402
from tether.capability.chain import parse_chain_unverified  # noqa: E402
from tether.controlplane.metrics import Metrics  # noqa: E402
from tether.controlplane.services.records import RecordService  # noqa: E402
from tether.controlplane.store import open_store_url  # noqa: E402

BATCH = 5000
DEFAULT_GRACE_S = 5.0  # `controlplane serve --grace`'s default: a record written in less is within window + grace


def report_doc(agent: str, link: str, i: int, now: float) -> dict[str, Any]:
    """A stored report as ``RecordService.ingest`` leaves it (the shape of ``proxy.state.Call.report()``)."""
    resolution = ("completed", "completed", "completed", "refused", "unknown")[i % 5]
    return {"call_id": f"{agent}-{i:07d}", "agent": agent, "method": "GET",
            "url": f"http://127.0.0.1:9000/repos/tether/bench/issues/{i}", "started_at": now + i * 1e-3,
            "capability": "issues.read", "tier": "direct", "resolution": resolution,
            "status": 200 if resolution == "completed" else None, "code": None,
            "ended_at": now + i * 1e-3 + 0.004, "capture_ref": f"captures/flows.mitm#{i * 2048}",
            "termination_id": None, "detail": None, "link": link, "run_id": f"run-bench-{agent}",
            "received_at": now + i * 1e-3 + 0.5}


async def fill(store_url: str, agent: str, link: str, calls: int) -> None:
    store = open_store_url(store_url)
    await store.open()
    try:
        now = time.time() - calls * 1e-3 - 60
        for start in range(0, calls, BATCH):
            await store.put_reports([report_doc(agent, link, i, now) for i in range(start, min(calls, start + BATCH))])
    finally:
        await store.close()


class CodeControlPlane(ControlPlaneProcess):
    """A control plane running the code of ``code`` (a checkout): ``python -m tether`` imports it first."""

    code: Path = ROOT

    def env(self) -> dict[str, str]:
        return {**super().env(), "PYTHONPATH": str(self.code)}


async def chain_loose(store_url: str, link: str) -> int:
    """How many of the link's reports no segment holds yet (its chain's ``loose``; the whole link's if none)."""
    store = open_store_url(store_url)
    await store.open()
    try:
        chain = (await store.chains([link])).get(link)
        return int(chain["loose"]) if chain else 1 << 30
    finally:
        await store.close()


async def read_back(store_url: str, termination_id: str) -> tuple[int, bool, float]:
    """The record's calls counted, then its hash recomputed, a page at a time from the store (never whole);
    and the seconds of the hash's pass: reading every entry text in order and hashing it, which any writer of
    the record must do once the fields before ``calls`` are known (docs/termination.md, "Big records")."""
    store = open_store_url(store_url)
    await store.open()
    try:
        head = next(h for h in await store.record_heads() if h["termination_id"] == termination_id)
        calls = sum(ref["count"] for ref in head.get("segments") or ())  # record form 2: its segments' calls
        async for page in store.record_calls(head["record_id"]):
            calls += len(page)
        began = time.perf_counter()
        digest = await RecordService(store, Metrics(), time.time).digest(head)
        return calls, digest == head["hash"], time.perf_counter() - began
    finally:
        await store.close()


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process so far (``/proc/PID/stat``): the work done, whatever the load of
    the machine (which stretches wall-clock times several-fold on 2 shared cores)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Watch:
    """RSS and /healthz latency of the control plane, sampled from threads until stopped."""

    def __init__(self, cp: ControlPlaneProcess) -> None:
        self.cp = cp
        self.rss: list[int] = []
        self.health: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._sample_rss), threading.Thread(target=self._ask_health)]

    def __enter__(self) -> Watch:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def _sample_rss(self) -> None:
        assert self.cp.proc is not None
        while not self._stop.is_set():
            self.rss.append(rss_kib(self.cp.proc.pid))
            time.sleep(0.02)

    def _ask_health(self) -> None:
        while not self._stop.is_set():
            began = time.perf_counter()
            try:
                with urllib.request.urlopen(self.cp.url + "/healthz", timeout=30) as resp:
                    resp.read()
            except OSError:
                self.failures += 1
            self.health.append(time.perf_counter() - began)
            time.sleep(0.01)


def terminate(cp: ControlPlaneProcess, agent: str, redis_pid: int | None, store_url: str) -> dict[str, Any]:
    client = cp.client()
    client.timeout = 120
    assert cp.proc is not None
    before = rss_kib(cp.proc.pid)
    cpu_before = cpu_s(cp.proc.pid), cpu_s(redis_pid)
    with Watch(cp) as watch:
        sent = time.time()
        tid = client.request("POST", f"/v1/agents/{agent}/terminate",
                             {"mode": "abort", "window_s": 0, "reason": "bench"})["termination_id"]
        while True:
            doc = client.request("GET", f"/v1/terminations/{tid}")
            if doc["state"] == "terminated":
                break
            time.sleep(0.05)
        done = time.time()
        cpu_after = cpu_s(cp.proc.pid), cpu_s(redis_pid)
    reconciling = next(step["at"] for step in doc["history"] if step["state"] == "reconciling")
    calls, hash_ok, hash_pass_s = asyncio.run(read_back(store_url, tid))
    if not hash_ok:
        raise AssertionError(f"termination {tid}: the record read back does not match its hash")
    return {"calls": calls, "hash_pass_s": hash_pass_s, "elapsed_s": done - sent,
            "record_s": doc["completed_at"] - reconciling,
            "cp_cpu_s": cpu_after[0] - cpu_before[0], "redis_cpu_s": cpu_after[1] - cpu_before[1],
            "within_s": doc["window_s"] + DEFAULT_GRACE_S,
            "rss_before_mib": before / 1024, "rss_peak_mib": max(watch.rss, default=before) / 1024,
            "rss_growth_mib": (max(watch.rss, default=before) - before) / 1024,
            "health_max_ms": max(watch.health) * 1000, "health_p50_ms": statistics.median(watch.health) * 1000,
            "health_asked": len(watch.health), "health_failed": watch.failures}


def measure(directory: Path, store: str, calls: int, redis: RedisServer | None, code: Path = ROOT,
            db: int = 0) -> dict[str, Any]:
    """One fresh control plane of ``code`` over a fresh store (Redis: database ``db``, emptied after)."""
    cp = prepare_controlplane(directory, 1, 2, 3, grace=0.2, lease_ttl=3.0,
                              store=redis.url(db) if redis else None)
    cp.__class__ = CodeControlPlane
    cp.code = code  # type: ignore[attr-defined]
    cp.start()
    try:
        client = cp.client()
        links = {}
        for agent in ("small", "big"):
            ident = cp.issue(agent, {"issues.read": "direct"})
            client.request("POST", "/v1/chains/register", {"chain": ident.wire})
            links[agent] = parse_chain_unverified(ident.wire)[-1].hash
        store_url = redis.url(db) if redis else f"sqlite:///{directory / 'tether.db'}"
        asyncio.run(fill(store_url, "small", links["small"], 1))
        filled, cpu = time.perf_counter(), time.process_time()
        redis_pid = redis.proc.pid if redis is not None and redis.proc is not None else None
        server = cpu_s(redis_pid)
        cp_cpu0 = cpu_s(cp.proc.pid if cp.proc else None)  # the control plane's CPU over the fill: its sealing
        asyncio.run(fill(store_url, "big", links["big"], calls))
        ingest_us = (time.process_time() - cpu) / calls * 1e6
        server_us = (cpu_s(redis_pid) - server) / calls * 1e6
        stored_s = time.perf_counter() - filled
        which = "before" if code != ROOT else "this code"
        sealed_s = 0.0
        if code == ROOT:  # record form 2: wait for the control plane's sealer to seal the calls as the agent ran
            began = time.perf_counter()
            while asyncio.run(chain_loose(store_url, links["big"])) >= 1000:
                time.sleep(0.2)
            sealed_s = time.perf_counter() - began
        seal_cpu = cpu_s(cp.proc.pid if cp.proc else None) - cp_cpu0
        print(f"  {store} ({which}): control-plane CPU over the fill (and sealing) {seal_cpu / calls * 1e6:.1f} us "
              f"a call (the code before seals nothing: its figure is the idle baseline); sealed "
              f"{sealed_s:.1f} s after the fill ended", flush=True)
        print(f"  {store} ({which}): {calls:,} reports stored in {stored_s:.1f} s "
              "(the bench's process, "
              f"the store's own put_reports in batches of {BATCH:,}): CPU per report {ingest_us:.1f} us here, "
              f"{server_us:.1f} us in redis-server (with, for this code, the sealer's work meanwhile)", flush=True)
        time.sleep(5.5)  # past the termination driver's reconnection grace after its start
        base = terminate(cp, "small", redis_pid, store_url)
        big = terminate(cp, "big", redis_pid, store_url)
        return {"store": store, "code": "before" if code != ROOT else "this code", "base": base, "big": big,
                "seal_us": seal_cpu / calls * 1e6, "sealed_s": sealed_s}
    finally:
        cp.stop()
        if redis is not None:
            import redis as redis_client

            redis_client.Redis.from_url(redis.url(db), socket_timeout=120).flushdb(asynchronous=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--store", choices=["sqlite", "redis", "both"], default="both")
    parser.add_argument("--before", type=Path, help="a checkout of the code before, measured in alternating runs")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each code (with --before)")
    args = parser.parse_args()
    print(f"bench_records: Python {platform.python_version()}, nproc {os.cpu_count()}, load average "
          f"{os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    directory = Path(tempfile.mkdtemp(prefix="tether-bench-records-"))
    os.chdir(directory)  # no checkout in the working directory: each control plane imports its own code
    codes = [ROOT] if args.before is None else [args.before.resolve(), ROOT]
    rows = []
    redis = None
    try:
        stores = [s for s in ("sqlite", "redis") if args.store in (s, "both")]
        if "redis" in stores:
            redis = RedisServer(directory / "redis-server").start()
        n = 0
        for store in stores:
            for round_ in range(args.rounds if args.before else 1):
                for code in codes if round_ % 2 == 0 else codes[::-1]:  # alternating: before first, then after
                    n += 1
                    rows.append(measure(directory / f"run{n}", store, args.calls,
                                        redis if store == "redis" else None, code, db=n % 16))
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(directory, ignore_errors=True)
    print("\n| store | code | calls | request -> terminated | record written (reconciling -> terminated) | "
          "within window + default grace | CPU: control plane, redis-server | "
          "control-plane RSS before -> peak | /healthz worst (median) meanwhile | /healthz failed |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for row in rows:
        for name in ("base", "big"):
            r = row[name]
            within = "yes" if r["record_s"] <= r["within_s"] else "no"
            print(f"| {row['store']} | {row['code']} | {r['calls']:,} | {r['elapsed_s']:.2f} s | "
                  f"{r['record_s']:.2f} s | "
                  f"{within} ({r['within_s']:.0f} s) | {r['cp_cpu_s']:.2f} s, {r['redis_cpu_s']:.2f} s | "
                  f"{r['rss_before_mib']:.0f} -> {r['rss_peak_mib']:.0f} MiB | {r['health_max_ms']:.0f} ms "
                  f"({r['health_p50_ms']:.1f} ms) | {r['health_failed']} of {r['health_asked']} |")
    print("\nRatios, big against the 1-call baseline of the same control plane:")
    for row in rows:
        b, g = row["base"], row["big"]
        print(f"  {row['store']} ({row['code']}): request -> terminated {g['elapsed_s'] / b['elapsed_s']:.1f}x, "
              f"RSS growth {g['rss_growth_mib']:.0f} MiB (baseline {b['rss_growth_mib']:.0f} MiB), "
              f"/healthz worst {g['health_max_ms'] / max(b['health_max_ms'], 0.1):.1f}x, "
              f"median {g['health_p50_ms'] / max(b['health_p50_ms'], 0.01):.1f}x; read back and hashed again "
              f"in {g['hash_pass_s']:.2f} s (the hash's own pass, in the bench's process)")
    if args.before is not None:
        print("\nThis code against the code before (ratio of medians over the runs; below 1: this code is faster):")
        for store in stores:
            def med(code: str, key: str, store: str = store) -> float:
                return statistics.median(r["big"][key] for r in rows if r["store"] == store and r["code"] == code)
            for key, what in (("record_s", "record written"), ("cp_cpu_s", "control-plane CPU"),
                              ("redis_cpu_s", "redis-server CPU"), ("rss_growth_mib", "RSS growth")):
                if key == "redis_cpu_s" and store != "redis":
                    continue
                print(f"  {store}: {what} {med('this code', key):.2f} against {med('before', key):.2f}: "
                      f"{med('this code', key) / max(med('before', key), 1e-9):.2f}x")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
