"""The sidecar's event loop while a 10 MB answer's final state is captured (issue 23): ``CaptureWriter.write``
(redaction and encoding on the loop, as the final write ran before) against ``write_later`` (taken on the loop,
encoded and written by the writer's encoder thread), without and with the list filter's parse of the body
(``capture.ParsedBody``: how the sidecar captures a list answer it filtered, its keys read off the parse instead
of a search of the bytes).

Run: .venv/bin/python bench/bench_capture_stall.py   (a few seconds)

A ticker due every millisecond on the loop; printed per way, medians over 7 rounds (the order rotating): the
loop's longest stall, the time until the flow is on disk, and the CPU the process spent on it (the loop, the
encoder, the ticker). The answer is bench_tools_list.py's 201 tools.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mitmproxy.test import tflow

from tether.proxy import mcp
from tether.proxy.capture import CaptureWriter, ParsedBody

count, mb = 200, 10
pad = max(0, int(mb * 1024 * 1024 / count) - 120)
tools = [{"name": f"tool_{i:06d}", "description": f"tool {i} " + "x" * pad,
          "inputSchema": {"type": "object", "properties": {"q": {"type": "string"}}}} for i in range(count)]
body = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"tools": tools}}).encode()


WAYS = ("write on the loop", "write_later, encoder thread", "write_later with the list filter's parse")


async def once(writer: CaptureWriter, way: int) -> tuple[float, float, float]:
    f = tflow.tflow(resp=True)
    f.response.headers["content-type"] = "application/json"
    f.response.content = body
    parsed = None
    if way == 2:  # the list filter parsed it (in its worker thread, before the answer left): not measured here
        parsed = ParsedBody(f.response.raw_content, mcp.filtered(mcp.read_answer(body, False), lambda _: True).value)
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
    start, cpu = time.perf_counter(), time.process_time()
    if way == 0:
        writer.write(f)
    else:
        writer.write_later(f, parsed)
    await asyncio.to_thread(writer.flush, 60)
    total, cpu = time.perf_counter() - start, time.process_time() - cpu
    await asyncio.sleep(0.02)
    done.set()
    await t
    return max(stalls), total, cpu


def main() -> None:
    print(f"capture stall benchmark  {time.strftime('%Y-%m-%d %H:%M')} UTC  {len(body) / 1e6:.1f} MB answer  "
          f"load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as d:
        w = CaptureWriter(Path(d) / "flows.mitm")
        res: dict[int, list[tuple[float, float, float]]] = {way: [] for way in range(len(WAYS))}
        for r in range(7):
            for way in [(r + k) % len(WAYS) for k in range(len(WAYS))]:
                res[way].append(asyncio.run(once(w, way)))
        w.close()
    for way, name in enumerate(WAYS):
        print(f"{name}: longest loop stall median {statistics.median(s for s, _, _ in res[way])*1000:.1f} ms, "
              f"until on disk median {statistics.median(t for _, t, _ in res[way])*1000:.1f} ms, "
              f"CPU median {statistics.median(c for _, _, c in res[way])*1000:.1f} ms")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
