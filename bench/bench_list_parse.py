"""How long one large MCP list answer holds the sidecar's event loop while the sidecar reads and filters it.

Run: .venv/bin/python bench/bench_list_parse.py            (~20-40 s on 2 cores; --quick for a smoke run)
     .venv/bin/python bench/bench_list_parse.py --mb 10 --rounds 7

In one process, the sidecar's own code on an answer of about ``--mb`` MB (``--tools`` tools, the shape of
``bench_tools_list.py``'s upstream, ``--granted`` of them held), JSON and SSE, two ways, rounds alternating:

* *on the loop*: what the sidecar did before (and still does for a list inside a batch or on a listen stream):
  ``mcp.filter_json_body`` for JSON, the streaming ``mcp.SseListsFilter`` for SSE, called on the event loop;
* *worker thread*: what ``proxy.addons.McpFilter`` does now for a single list request's answer:
  ``await asyncio.to_thread`` of ``mcp.read_answer`` (the parse in pieces) and ``mcp.filter_answer``.

Meanwhile a task on the same loop wakes every millisecond and records how late each wake-up is: the loop's
stall, which is what every other call of the sidecar waits for. Printed per kind and way, medians over the
rounds: the time to filter the answer, the longest stall and the 99th-percentile stall (ms), and the stall's
ratio to the on-the-loop way measured in the same run. Both ways produce the same bytes (checked each round).
Timing on a loaded machine moves both ways alike; the ratio is the figure to read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tether.proxy import mcp  # noqa: E402


def answer(mb: float, count: int) -> bytes:
    pad = max(0, int(mb * 1024 * 1024 / count) - 120)
    tools = [{"name": "add", "description": "adds", "inputSchema": {"type": "object"}}]
    tools += [{"name": f"tool_{i:06d}", "description": f"tool {i} " + "x" * pad,
               "inputSchema": {"type": "object", "properties": {"q": {"type": "string"}}}} for i in range(count)]
    return json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"tools": tools}}).encode()


async def stalls(work: Callable[[], Awaitable[bytes]]) -> tuple[float, list[float], bytes]:
    """Run ``work`` while a ticker on the same loop measures how late each 1 ms wake-up comes (ms)."""
    late: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            late.append((time.perf_counter() - before - 0.001) * 1000)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    out = await work()
    took = time.perf_counter() - start
    done.set()
    await tick
    return took, late, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=10.0)
    parser.add_argument("--tools", type=int, default=20_000)
    parser.add_argument("--granted", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a 2 MB answer, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.tools, args.rounds = 2.0, 4000, 2
    body = answer(args.mb, args.tools)
    granted = {"add", *(f"tool_{i:06d}" for i in range(0, args.tools, max(1, args.tools // args.granted)))}

    def allowed(name: str) -> bool:
        return name in granted

    sse_body = b"event: message\ndata: " + body + b"\n\n"

    async def json_loop() -> bytes:
        return mcp.filter_json_body(body, allowed)[0]

    async def sse_loop() -> bytes:
        f = mcp.SseListsFilter(allowed)
        out = [b"".join(f(sse_body[i:i + 16384])) for i in range(0, len(sse_body), 16384)]
        return b"".join(out) + b"".join(f(b""))

    def threaded(raw: bytes, sse: bool) -> Callable[[], Awaitable[bytes]]:
        async def run() -> bytes:
            return (await asyncio.to_thread(lambda: mcp.filter_answer(mcp.read_answer(raw, sse), allowed)))[0]
        return run

    ways = {("json", "on the loop"): json_loop, ("json", "worker thread"): threaded(body, False),
            ("sse", "on the loop"): sse_loop, ("sse", "worker thread"): threaded(sse_body, True)}
    got: dict[tuple[str, str], list[tuple[float, float, float]]] = {k: [] for k in ways}
    print(f"list parse benchmark  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  nproc {os.cpu_count()}  "
          f"python {sys.version.split()[0]}  load average {os.getloadavg()[0]:.2f}")
    print(f"  answer {len(body) / 1e6:.1f} MB, {args.tools + 1} tools, {len(granted)} granted, {args.rounds} rounds")
    for _ in range(args.rounds):
        outs: dict[str, bytes] = {}
        for key, work in ways.items():
            took, late, out = asyncio.run(stalls(work))
            late.sort()
            got[key].append((took, late[-1], late[int(len(late) * 0.99)] if late else 0.0))
            previous = outs.setdefault(key[0], out)
            assert previous == out, f"the two ways disagree on the {key[0]} answer"
    print("\n| answer | way | filter s | longest stall ms | p99 stall ms | longest stall x on the loop |")
    print("|---|---|---:|---:|---:|---:|")
    for kind in ("json", "sse"):
        base = statistics.median(r[1] for r in got[kind, "on the loop"])
        for way in ("on the loop", "worker thread"):
            rows = got[kind, way]
            longest = statistics.median(r[1] for r in rows)
            print(f"| {kind} | {way} | {statistics.median(r[0] for r in rows):.3f} | {longest:.1f} | "
                  f"{statistics.median(r[2] for r in rows):.1f} | {longest / base:.2f} |")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
