"""How long the control plane's event loop stalls while a termination record of 20,000 calls is written.

Run: python bench/bench_record_stall.py        (about 1 minute; --calls N, --store sqlite|redis|both)

Real parts, in this process: the control plane's aiohttp app (``cli.controlplane.build``, the same one
``tether controlplane serve`` runs) listening on loopback, over SQLite and over a ``redis-server`` started
here. One registered agent has 20,000 final call reports (ingested through ``RecordService.ingest``,
before the clock starts). Then ``POST /v1/agents/{agent}/terminate {"mode": "abort", "window_s": 0}`` over
HTTP, and a probe task on the control plane's own loop sleeps 2 ms at a time and records how late each
wake-up is: the loop's lag. Reported: the worst lag from the request until the termination is
``terminated`` (the record written), the time that took, and the record's size.

Target (issue 17): a 20k-call record never blocks the loop more than 100 ms.

``TETHER_BENCH_ROOT=/path/to/another/checkout`` runs the same measurement against that checkout's code (how
the "before" figure was taken).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(os.environ.get("TETHER_BENCH_ROOT") or Path(__file__).resolve().parents[1])
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from tests.harness import RedisServer, free_port, prepare_controlplane  # noqa: E402
from tether.capability import keys  # noqa: E402
from tether.capability.chain import mint_root  # noqa: E402
from tether.cli.controlplane import build  # noqa: E402
from tether.controlplane.auth import Caller  # noqa: E402

TOKEN = "bench-admin-token"
TARGET_MS = 100.0
PROBE_S = 0.002


def report_doc(agent: str, i: int, now: float) -> dict[str, Any]:
    """The shape of ``proxy.state.Call.report()`` for an ordinary completed call."""
    return {"call_id": f"{agent}-{i:07d}", "agent": agent, "method": "GET",
            "url": "http://127.0.0.1:9000/repos/tether/bench/issues", "started_at": now + i * 1e-3,
            "capability": "issues.read", "tier": "direct", "resolution": "completed", "status": 200, "code": None,
            "ended_at": now + i * 1e-3 + 0.004, "capture_ref": f"captures/flows.mitm#{i * 2048}",
            "termination_id": None, "detail": None}


async def measure(directory: Path, store_url: str, calls: int) -> dict[str, Any]:
    prepared = prepare_controlplane(directory, 1, 2, 3)
    cp = build(store_url, str(prepared.catalog_path), str(prepared.signing_key_path), TOKEN, grace_s=0.2,
               lease_ttl_s=3.0)
    runner = web.AppRunner(cp.app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        key = keys.generate()
        wire = mint_root(cp.signing_key, agent="big", subject_key=key.public_key(), caps={"issues.read": "direct"},
                         now=time.time(), ttl_s=3600, depth=2, catalog=cp.catalog)
        docs, _, _ = await cp.grants.register_chain(wire)
        caller = Caller("big", docs[-1], "run-bench")
        now = time.time()
        for start in range(0, calls, 1000):
            batch = [report_doc("big", i, now) for i in range(start, min(calls, start + 1000))]
            await cp.records.ingest(caller, batch, [])
        await asyncio.sleep(6.0)  # past the termination driver's reconnection grace after its start

        lags: list[tuple[float, float]] = []

        async def probe() -> None:
            while True:
                before = time.perf_counter()
                await asyncio.sleep(PROBE_S)
                lags.append((before, time.perf_counter() - before - PROBE_S))

        prober = asyncio.create_task(probe())
        await asyncio.sleep(0.5)
        quiet = max(lag for _, lag in lags)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            sent = time.perf_counter()
            async with session.post(f"{base}/v1/agents/big/terminate", headers=headers,
                                    json={"mode": "abort", "window_s": 0, "reason": "bench"}) as resp:
                tid = (await resp.json())["termination_id"]
            while True:
                async with session.get(f"{base}/v1/terminations/{tid}", headers=headers) as resp:
                    state = (await resp.json())["state"]
                if state == "terminated":
                    break
                await asyncio.sleep(0.05)
            done = time.perf_counter()
        prober.cancel()
        during = [lag for at, lag in lags if sent <= at <= done]
        records = await cp.store.records()
        size = len(json.dumps(records[-1]))
        return {"store": store_url.split(":")[0], "calls": len(records[-1]["calls"]), "record_bytes": size,
                "elapsed_s": done - sent, "max_lag_ms": max(during) * 1000, "quiet_max_lag_ms": quiet * 1000,
                "over_50ms": sum(1 for lag in during if lag > 0.05), "probes": len(during)}
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--store", choices=["sqlite", "redis", "both"], default="both")
    args = parser.parse_args()
    print(f"bench_record_stall: Python {platform.python_version()}, code from {ROOT}, load average "
          f"{os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    directory = Path(tempfile.mkdtemp(prefix="tether-bench-stall-"))
    redis = None
    rows = []
    try:
        if args.store in ("sqlite", "both"):
            rows.append(asyncio.run(measure(directory / "sqlite", f"sqlite:///{directory / 'stall.db'}", args.calls)))
        if args.store in ("redis", "both"):
            redis = RedisServer(directory / "redis").start()
            rows.append(asyncio.run(measure(directory / "redis", redis.url(0), args.calls)))
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(directory, ignore_errors=True)
    print("\n| store | calls in the record | record size | terminate -> terminated | worst loop lag meanwhile | "
          "wake-ups later than 50 ms | worst lag when idle |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['store']} | {r['calls']:,} | {r['record_bytes'] / 2**20:.1f} MiB | {r['elapsed_s']:.2f} s | "
              f"**{r['max_lag_ms']:.0f} ms** | {r['over_50ms']} of {r['probes']} | {r['quiet_max_lag_ms']:.1f} ms |")
    worst = max(r["max_lag_ms"] for r in rows)
    print(f"\nTarget: the loop never blocked more than {TARGET_MS:.0f} ms: {'met' if worst <= TARGET_MS else 'missed'} "
          f"(worst {worst:.0f} ms).")


if __name__ == "__main__":
    main()
