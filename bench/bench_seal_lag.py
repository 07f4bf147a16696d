"""The event loop's lag while the sealer seals 100,000 reports (one chain, 10,000 a segment), against the lag of
the same loop idle for as long, in the same run: what a ``/healthz`` answered meanwhile would wait.

    PYTHONPATH=$PWD python bench/bench_seal_lag.py sqlite:///tmp/x.db     (or redis://127.0.0.1:PORT/0)
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tether.controlplane.services.segments import SegmentService
from tether.controlplane.store import open_store_url

N = 100_000


async def lags_during(work: object) -> list[float]:
    """Lags of a 10 ms ticker while ``work`` (an awaitable) runs, sorted."""
    lags: list[float] = []
    done = False

    async def ticker() -> None:
        while not done:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - t - 0.01)

    task = asyncio.create_task(ticker())
    await work  # type: ignore[misc]
    done = True
    await task
    return sorted(lags)


def summary(lags: list[float]) -> tuple[float, float, float]:
    return (1000 * lags[len(lags) // 2], 1000 * lags[int(len(lags) * 0.99)], 1000 * lags[-1])


async def main(url: str) -> None:
    store = open_store_url(url)
    await store.open()
    try:
        for at in range(0, N, 5000):
            await store.put_reports([{"call_id": f"k{i:07d}", "agent": "a", "method": "GET", "url": "http://t/",
                                      "link": "L", "started_at": 1000.0 + i * 0.001, "resolution": "completed",
                                      "status": 200, "capability": "x", "ended_at": 1000.0 + i * 0.001}
                                     for i in range(at, at + 5000)])
        sealer = SegmentService(store, Ed25519PrivateKey.generate(), time.time, settle_s=0.0)
        t0 = time.perf_counter()
        sealing = await lags_during(sealer.seal_once())
        took = time.perf_counter() - t0
        idle = await lags_during(asyncio.sleep(took))
        (s50, s99, smax), (i50, i99, imax) = summary(sealing), summary(idle)
        print(f"{url.split(':')[0]}: sealed {sealer.sealed} in {took:.2f} s; loop lag ms p50/p99/max sealing "
              f"{s50:.1f}/{s99:.1f}/{smax:.1f}, idle {i50:.1f}/{i99:.1f}/{imax:.1f}; p99 ratio "
              f"{s99 / max(i99, 0.01):.1f}x; load {os.getloadavg()[0]:.1f}")
    finally:
        await store.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
