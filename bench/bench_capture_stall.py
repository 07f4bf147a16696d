"""The sidecar's event loop while a 10 MB answer's final state is captured (issue 23): ``CaptureWriter.write``
(redaction and encoding on the loop, as the final write ran before) against ``write_later`` (taken on the loop,
encoded and written by the writer's encoder thread, as it runs now).

Run: .venv/bin/python bench/bench_capture_stall.py   (a few seconds)

A ticker due every millisecond on the loop; printed per way, medians over 7 rounds (the order alternating): the
loop's longest stall, and the time until the flow is on disk. The answer is bench_tools_list.py's 201 tools.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mitmproxy.test import tflow

from tether.proxy.capture import CaptureWriter

count, mb = 200, 10
pad = max(0, int(mb * 1024 * 1024 / count) - 120)
tools = [{"name": f"tool_{i:06d}", "description": f"tool {i} " + "x" * pad,
          "inputSchema": {"type": "object", "properties": {"q": {"type": "string"}}}} for i in range(count)]
body = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"tools": tools}}).encode()


async def once(writer: CaptureWriter, later: bool) -> tuple[float, float]:
    f = tflow.tflow(resp=True)
    f.response.headers["content-type"] = "application/json"
    f.response.content = body
    stalls: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            stalls.append(now - last)
            last = now
    t = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    start = time.perf_counter()
    (writer.write_later if later else writer.write)(f)
    await asyncio.to_thread(writer.flush, 60)
    total = time.perf_counter() - start
    await asyncio.sleep(0.02)
    done.set()
    await t
    return max(stalls), total


def main() -> None:
    print(f"capture stall benchmark  {time.strftime('%Y-%m-%d %H:%M')} UTC  {len(body) / 1e6:.1f} MB answer")
    with tempfile.TemporaryDirectory() as d:
        w = CaptureWriter(Path(d) / "flows.mitm")
        res: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for r in range(7):
            for later in (False, True) if r % 2 == 0 else (True, False):
                res[later].append(asyncio.run(once(w, later)))
        w.close()
    for later, name in ((False, "write on the loop (before)"), (True, "write_later, encoder thread (now)")):
        print(f"{name}: longest loop stall median {statistics.median(s for s, _ in res[later])*1000:.1f} ms, "
              f"until on disk median {statistics.median(t for _, t in res[later])*1000:.1f} ms")


if __name__ == "__main__":
    main()
