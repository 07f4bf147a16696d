"""A large MCP ``tools/list`` answer through the sidecar: the list filter's cost, and what it does to other calls.

Run: .venv/bin/python bench/bench_tools_list.py            (~1-3 minutes on 2 cores; --quick for a smoke run)
     .venv/bin/python bench/bench_tools_list.py --mb 10 --rounds 5 --piece 16384
     .venv/bin/python bench/bench_tools_list.py --tools 200 --rounds 15 --kinds json --before PYTHON:TREE

An MCP-ish upstream in a process of its own (aiohttp, POST /mcp) answers ``tools/list`` with about ``--mb`` MB of
tools (``--tools`` of them, descriptions padded to fit), as one SSE event (``text/event-stream``, a single
``data:`` line of that size, the shape that made the filter quadratic) or as one JSON body, written in
``--piece``-byte writes, each awaited (so the proxy reads the answer in many pieces). ``tools/call`` of ``add``
answers a few bytes at once.

Five setups, all with the same aiohttp client and rounds alternating (the order rotates): *direct* (no proxy),
*mitmdump* (bare mitmproxy, no addons: the cost of the proxy alone) and three real ``tether sidecar`` processes
under one real control plane, each an agent granted ``add`` and a share of the listed tools, so the sidecar
reads and parses every byte: *tether all* (every listed tool granted: nothing is removed and the answer passes
as the upstream wrote it), *tether some hidden* (every ``--hide-every``-th tool hidden: most of the answer is
re-encoded and passed) and *tether most hidden* (``--granted`` of the tools held: 1 % passes). Printed per answer
kind and setup, medians over the rounds: the time to read the whole answer (its ratio to direct and to
mitmdump), and the time to read it and parse it as an MCP client does before it can use the list
(``json.loads`` of the body, or of each event's data). Target: tether's read + parse within 1.5x of direct's
(what an agent waits for before it has the tools). Read alone cannot get there for any proxy that filters: the
sidecar must parse the whole answer before it knows what to pass, which costs about what the direct client's
own parse costs. ``--before PYTHON:TREE`` adds each tether setup again as *before ...*, its sidecar running the
code of another checkout, so a change is measured against the code before it in the same run, interleaved.

Meanwhile a second client, in a process of its own and on its own connection through the same proxy, calls
``add`` every 20 ms: its latency while the big answer is in flight (from the request until the big client has
it) against the same call's latency with nothing else going on (printed as p50 and max per setup). A proxy
that is busy filtering delays it; so does the upstream while it writes the big answer, and the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import aiohttp  # noqa: E402
import bench_sidecar as bs  # noqa: E402

from tests import harness  # noqa: E402
from tests.harness import SidecarProcess, free_port, make_test_ca, prepare_controlplane  # noqa: E402

TARGET = 1.5  # tether's tools/list time against direct
MAX_GRANTS = 200  # tool grants one link can carry (a link is a JWS of at most 8 KiB: tether.chain_invalid past it)
KINDS = ("sse", "json")

# The upstream in a process of its own. argv: port, tools, MB, piece, rate (MB/s, 0: as fast as it can). Prints
# "ready" once listening.
UPSTREAM_CODE = r"""
import asyncio, json, sys, time
from aiohttp import web
port, count, mb, piece = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
rate = float(sys.argv[5]) * 1e6
pad = max(0, int(mb * 1024 * 1024 / count) - 120)
tools = [{"name": "add", "description": "adds", "inputSchema": {"type": "object"}}]
tools += [{"name": f"tool_{i:06d}", "description": f"tool {i} " + "x" * pad,
           "inputSchema": {"type": "object", "properties": {"q": {"type": "string"}}}} for i in range(count)]

def answer(msg_id):
    return json.dumps({"jsonrpc": "2.0", "id": msg_id, "result": {"tools": tools}}).encode()

async def mcp(request):
    sent = json.loads(await request.read())
    if sent.get("method") != "tools/list":
        return web.json_response({"jsonrpc": "2.0", "id": sent.get("id"),
                                  "result": {"content": [{"type": "text", "text": "2"}]}})
    body = answer(sent["id"])
    sse = request.headers.get("x-kind") == "sse"
    if sse:
        body = b"event: message\ndata: " + body + b"\n\n"
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream" if sse else "application/json"})
    resp.content_length = len(body)
    await resp.prepare(request)
    view = memoryview(body)
    began = time.monotonic()
    for i in range(0, len(body), piece):
        await resp.write(view[i:i + piece])
        if rate:  # a slow upstream: the answer written at ``rate`` bytes a second
            await asyncio.sleep(max(0.0, began + (i + piece) / rate - time.monotonic()))
    await resp.write_eof()
    return resp

app = web.Application(client_max_size=64 * 1024 * 1024)
app.router.add_post("/mcp", mcp)
print("size", len(answer(1)), flush=True)
web.run_app(app, host="127.0.0.1", port=port, print=lambda *_: print("ready", flush=True), handle_signals=True)
"""


class Upstream:
    def __init__(self, tools: int, mb: float, piece: int, rate: float = 0.0) -> None:
        self.port = free_port()
        self.args = [str(self.port), str(tools), str(mb), str(piece), str(rate)]
        self.proc: subprocess.Popen[str] | None = None
        self.size = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self) -> Upstream:
        self.proc = subprocess.Popen([sys.executable, "-c", UPSTREAM_CODE, *self.args], stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        self.size = int(self.proc.stdout.readline().split()[1])
        assert self.proc.stdout.readline().strip() == "ready", "upstream failed"
        return self

    def stop(self) -> None:
        bs.stop_process(self.proc)


HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream"}


def listed(data: bytes, kind: str) -> list[str]:
    """The tool names in an answer, parsed as an MCP client parses it (each SSE event's data as JSON)."""
    if kind == "json":
        values = [json.loads(data)]
    else:
        values = [json.loads(line[5:]) for line in data.split(b"\n") if line.startswith(b"data:") and line[5:].strip()]
    return [t["name"] for v in values for t in v["result"]["tools"]]


async def big_list(session: aiohttp.ClientSession, url: str, proxy: str | None,
                   kind: str) -> tuple[float, float, int, int]:
    """(seconds to read the answer, seconds to read and parse it, its bytes, the tools in it)."""
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    start = time.perf_counter()
    async with session.post(url, data=body, proxy=proxy, headers={**HEADERS, "x-kind": kind}) as resp:
        data = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"tools/list: {resp.status} {data[:300]!r}")
    read = time.perf_counter() - start
    names = listed(data, kind)
    return read, time.perf_counter() - start, len(data), len(names)


ADD = json.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "add", "arguments": {"a": 1}}})


def add_caller(url: str, proxy: str | None, idle_calls: int, go: Any, stop: Any, out: Any) -> None:
    """The other call, in a process of its own (so the client's own work on the big answer does not delay it):
    ``idle_calls`` calls of ``add`` alone, then, from ``go`` until ``stop``, one every 20 ms."""
    import http.client
    from urllib.parse import urlsplit

    target = urlsplit(url)
    where = urlsplit(proxy) if proxy else target
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=120)

    def one() -> float:
        start = time.perf_counter()
        conn.request("POST", url if proxy else target.path, ADD, HEADERS)
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200 or b'"2"' not in data:
            raise RuntimeError(f"tools/call add: {resp.status} {data[:300]!r}")
        return time.perf_counter() - start

    for _ in range(3):
        one()  # warm the connection
    out.put([one() for _ in range(idle_calls)])
    go.wait()
    during = []
    while not stop.is_set():
        during.append(one())
        stop.wait(0.02)
    out.put(during)


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process so far (``/proc/PID/stat``): the work, which the load of a shared
    machine does not stretch the way it stretches wall-clock times."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_round(url: str, proxy: str | None, kind: str, idle_calls: int, pid: int | None) -> dict[str, Any]:
    """The small call alone, then the big list with the small call repeating beside it (another process); and
    the CPU the proxy process ``pid`` spent from the big request until half a second after the answer (its
    capture of the answer is written after it is sent)."""
    mp = multiprocessing.get_context("spawn")
    go, stop, out = mp.Event(), mp.Event(), mp.Queue()
    caller = mp.Process(target=add_caller, args=(url, proxy, idle_calls, go, stop, out))
    caller.start()
    try:
        idle = await asyncio.to_thread(out.get, True, 120)
        cpu = cpu_s(pid)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as big:
            go.set()
            try:
                elapsed, used, size, tools = await big_list(big, url, proxy, kind)
            finally:
                stop.set()
        during = await asyncio.to_thread(out.get, True, 120)
        await asyncio.sleep(0.5)
        cpu = cpu_s(pid) - cpu
    finally:
        caller.join(30)
        if caller.is_alive():
            caller.kill()
    return {"elapsed": elapsed, "used": used, "size": size, "tools": tools, "idle": idle, "during": during,
            "cpu": cpu}


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=10.0, help="size of the tools/list answer")
    parser.add_argument("--tools", type=int, default=20000, help="tools in the list (besides add)")
    parser.add_argument("--granted", type=int, default=200, help="listed tools the agent holds (besides add)")
    parser.add_argument("--hide-every", type=int, default=10,
                        help="tether some hidden: every N-th listed tool is not granted")
    parser.add_argument("--piece", type=int, default=16384, help="bytes per write of the upstream")
    parser.add_argument("--upstream-rate", type=float, default=0.0, metavar="MB_S",
                        help="the upstream writes the answer at this many MB a second (0: as fast as it can)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", metavar="PYTHON:TREE",
                        help="also run each tether setup's sidecar from another checkout (the code before a change), "
                             "as setups of the same run: TREE's tether/ imported by PYTHON, an interpreter with this "
                             "venv's packages but not its editable install of tether")
    parser.add_argument("--kinds", default=",".join(KINDS), help="the answers to measure: sse, json or both")
    parser.add_argument("--quick", action="store_true", help="2 rounds of a 2 MB answer")
    args = parser.parse_args()
    kinds = tuple(k for k in KINDS if k in args.kinds.split(","))
    if args.quick:
        args.rounds, args.mb, args.tools = 2, 2.0, 4000
    print(f"tools/list benchmark  {time.strftime('%Y-%m-%d %H:%M')} UTC  nproc {os.cpu_count()}  "
          f"python {platform.python_version()}  load average {os.getloadavg()[0]:.2f}")
    work = Path(tempfile.mkdtemp(prefix="tether-bench-list-"))
    with ExitStack() as stack:
        upstream = Upstream(args.tools, args.mb, args.piece, args.upstream_rate).start()
        stack.callback(upstream.stop)
        ca = make_test_ca(work / "ca")
        cp = prepare_controlplane(work / "cp", free_port(), free_port(), upstream.port, lease_ttl=15.0)
        names = [f"tool_{i:06d}" for i in range(args.tools)]
        step = max(1, args.tools // max(1, args.granted))
        grants = {"tether all": names, "tether some hidden": [n for i, n in enumerate(names) if i % args.hide_every],
                  "tether most hidden": names[::step][:args.granted]}
        caps = "".join(f'  list.{n}: {{mcp: {{url: "{upstream.url}", tool: {n}}}}}\n' for n in names)
        cp.catalog_path.write_text(cp.catalog_path.read_text().replace("roles:", caps + "roles:"))
        cp.start()
        stack.callback(cp.stop)
        if grants["tether most hidden"] == grants["tether all"]:
            del grants["tether most hidden"]  # a list this short is held whole: the same setup twice
        for setup in [k for k, v in grants.items() if len(v) > MAX_GRANTS]:
            print(f"  {setup}: skipped, {len(grants.pop(setup))} grants do not fit in one link (a JWS of at most "
                  f"8 KiB holds about {MAX_GRANTS}); run with --tools {MAX_GRANTS} for it")
        setups = ("direct", "mitmdump", *grants)
        sidecars = {}
        if args.before:
            grants.update({k.replace("tether", "before"): v for k, v in grants.items()})
            setups = ("direct", "mitmdump", *grants)
        for setup, granted in grants.items():
            agent = "bench-" + setup.replace(" ", "-")
            sidecar = sidecars[setup] = SidecarProcess(cp, cp.issue(agent, {"mcp.add": "direct", **{
                f"list.{n}": "direct" for n in granted}}))
            stack.callback(sidecar.stop)
            if setup.startswith("before"):
                start_from(sidecar, *args.before.split(":", 1), ca.ca_pem)
            else:
                sidecar.start(upstream_ca=ca.ca_pem)
        mitm = bs.MitmdumpProcess(work / "mitmdump", ca.ca_pem).start()
        stack.callback(mitm.stop)
        proxies = {"direct": None, "mitmdump": mitm.proxy, **{k: v.proxy for k, v in sidecars.items()}}
        pids = {"direct": None, "mitmdump": mitm.proc.pid if mitm.proc else None,
                **{k: v.proc.pid if v.proc else None for k, v in sidecars.items()}}
        print(f"  answer {upstream.size / 1e6:.1f} MB, {args.tools + 1} tools, granted (besides add): "
              f"{', '.join(f'{k} {len(v)}' for k, v in grants.items())}; "
              f"upstream writes of {args.piece} bytes"
              f"{f' at {args.upstream_rate:g} MB/s' if args.upstream_rate else ''}, {args.rounds} rounds")
        results: dict[tuple[str, str], list[dict[str, Any]]] = {(k, s): [] for k in kinds for s in setups}
        for r in range(args.rounds):
            for kind in kinds:
                turn = r % len(setups)
                order = setups[turn:] + setups[:turn]  # the order rotates: load hits every setup alike
                for setup in order:
                    results[kind, setup].append(asyncio.run(one_round(upstream.url, proxies[setup], kind, 20,
                                                                      pids[setup])))
            print(f"  round {r + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.2f}", flush=True)
        verdicts = report(results, setups, kinds)
        print(f"load average at the end {os.getloadavg()[0]:.2f}; sidecar logs under {cp.directory / 'sidecars'}")
    return 0 if all(verdicts) else 1


def start_from(sidecar: SidecarProcess, python: str, tree: str, upstream_ca: Path) -> None:
    """Start ``sidecar`` on the code of another checkout: ``python -m tether`` run in ``tree`` with ``tree`` on its
    path. In ``tree``: ``-m`` puts the working directory first on the path, ahead of ``PYTHONPATH``, so a sidecar
    started from this checkout's directory would import this checkout's code, not the tree's."""
    saved, path, cwd = harness.PYTHON, os.environ.get("PYTHONPATH"), os.getcwd()
    harness.PYTHON, os.environ["PYTHONPATH"] = python, tree
    os.chdir(tree)
    try:
        sidecar.start(upstream_ca=upstream_ca)
    finally:
        os.chdir(cwd)
        harness.PYTHON = saved
        if path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = path


def report(results: dict[tuple[str, str], list[dict[str, Any]]], setups: tuple[str, ...],
           kinds: tuple[str, ...] = KINDS) -> list[bool]:
    verdicts = []
    print()
    print("| answer | setup | read s | x direct | x mitmdump | read + parse s | x direct | tools / bytes to the client "
          "| add p50 idle ms | add p50 during ms | add max during ms | add calls during | proxy CPU s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind in kinds:
        med = {s: statistics.median(r["elapsed"] for r in results[kind, s]) for s in setups}
        used = {s: statistics.median(r["used"] for r in results[kind, s]) for s in setups}
        for setup in setups:
            rows = results[kind, setup]
            idle = [x for r in rows for x in r["idle"]]
            during = [x for r in rows for x in r["during"]]
            print(f"| {kind} | {setup} | {med[setup]:.3f} | {med[setup] / med['direct']:.2f} | "
                  f"{med[setup] / med['mitmdump']:.2f} | {used[setup]:.3f} | {used[setup] / used['direct']:.2f} | "
                  f"{rows[-1]['tools']} / {rows[-1]['size']} | {ms(statistics.median(idle))} | "
                  f"{ms(statistics.median(during)) if during else '-'} | {ms(max(during)) if during else '-'} | "
                  f"{len(during)} | {statistics.median(r['cpu'] for r in rows):.3f} |")
        for setup in setups[2:]:
            ok = used[setup] / used["direct"] <= TARGET
            verdicts.append(ok)
            print(f"|   | {kind}: {setup} read + parse {used[setup] / used['direct']:.2f}x direct, target <= "
                  f"{TARGET}x: {'met' if ok else 'MISSED'}; read alone {med[setup] / med['direct']:.2f}x direct, "
                  f"{med[setup] / med['mitmdump']:.2f}x mitmdump |")
    return verdicts


if __name__ == "__main__":
    raise SystemExit(main())
