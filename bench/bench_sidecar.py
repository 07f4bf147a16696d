"""What enforcement costs per call: tether's sidecar against bare mitmproxy and against no proxy at all.

Run: python bench/bench_sidecar.py          (1-3 minutes on 2 cores, depending on load; --quick for a smoke run)

Three setups, all measured in this run with the same client: *direct* (client -> tool server), *mitmdump*
(bare mitmproxy, no addons: ``mitmdump --set connection_strategy=lazy -q``) and *tether* (a real
``tether sidecar`` process with full enforcement: chain check, lease, capture to disk, call reports to a
real ``tether controlplane serve`` process, with the capability granted). Each over plain HTTP and over
HTTPS (the tool server's certificate comes from a private CA; the proxies intercept TLS with their own
CA, which the client trusts), with 1 and 8 concurrent clients.

Client: aiohttp, one ``ClientSession`` with one keep-alive connection per concurrent client, identical for
every setup (``proxy=`` is the only difference). The tool server runs in its own process (the harness's
``ToolServer``), so it does not share a GIL with the client. Each client's first requests warm up its
connection and are not counted. Rounds of the three setups alternate (the order rotates), so load from
other work on the machine hits the baseline and the measured path alike.

Targets (the sidecar's enforcement against bare mitmproxy, same scheme and concurrency):
  - p50 latency at most 1.10x bare mitmproxy's;
  - p99 latency at most 1 ms above bare mitmproxy's.
Also printed: RSS of an idle sidecar against an idle bare mitmdump, after start and after the benchmark,
and the call reports the control plane received from the sidecar (every call must arrive).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from tests.harness import (  # noqa: E402
    SidecarProcess,
    TestCA,
    free_port,
    make_test_ca,
    prepare_controlplane,
    wait_until,
)

P50_RATIO_TARGET = 1.10
P99_DELTA_TARGET_MS = 1.0
ISSUES = "/repos/o/r/issues"
MITMDUMP = str(Path(sys.executable).with_name("mitmdump"))

# The tool server in a process of its own. stdin takes commands ("active", "hits"); EOF stops it.
TOOL_SERVER_CODE = """
import json, sys
sys.path.insert(0, {root!r})
from pathlib import Path
from tests.harness import TestCA, ToolServer
args = json.loads(sys.argv[1])
tls = TestCA(Path(args["ca"]), Path(args["cert"]), Path(args["key"]))
servers = [ToolServer(args["http"]).start(), ToolServer(args["https"], tls=tls).start()]
print("ready", flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "active":
        print(sum(s.active for s in servers), flush=True)
    elif cmd == "hits":
        print(sum(len(s.hits) for s in servers), flush=True)
for s in servers:
    s.stop()
"""


# -- processes ----------------------------------------------------------------------------------------------
class ToolServerProcess:
    """The harness's aiohttp ToolServer (HTTP and HTTPS) in a child process."""

    def __init__(self, ca: TestCA) -> None:
        self.ca = ca
        self.http_port = free_port()
        self.https_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def https_base(self) -> str:
        return f"https://localhost:{self.https_port}"

    def start(self) -> ToolServerProcess:
        args = {"http": self.http_port, "https": self.https_port, "ca": str(self.ca.ca_pem),
                "cert": str(self.ca.cert_pem), "key": str(self.ca.key_pem)}
        self.proc = subprocess.Popen([sys.executable, "-c", TOOL_SERVER_CODE.format(root=str(ROOT)), json.dumps(args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready", "tool server failed"
        return self

    def ask(self, command: str) -> int:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(10)
        except (subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class MitmdumpProcess:
    """Bare mitmproxy: no addons of ours."""

    def __init__(self, directory: Path, upstream_ca: Path) -> None:
        self.directory = directory
        self.upstream_ca = upstream_ca
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def proxy(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        return self.directory / "mitmproxy-ca-cert.pem"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> MitmdumpProcess:
        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.directory / "mitmdump.log", "ab")
        self.proc = subprocess.Popen(
            [MITMDUMP, "--listen-host", "127.0.0.1", "-p", str(self.port), "--set", "connection_strategy=lazy",
             "--set", f"confdir={self.directory}", "--set", f"ssl_verify_upstream_trusted_ca={self.upstream_ca}",
             "-q"], stdout=log, stderr=log)

        def listening() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"mitmdump exited: {(self.directory / 'mitmdump.log').read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            except OSError:
                return False
            return self.ca.exists()

        wait_until(listening, 30, what="mitmdump")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


@contextmanager
def stopping(thing: object) -> Iterator[object]:
    try:
        yield thing
    finally:
        thing.stop()  # type: ignore[attr-defined]


# -- measurement ----------------------------------------------------------------------------------------------
@dataclass
class Setup:
    name: str
    proxy: str | None
    ssl_context: ssl.SSLContext
    pid: int | None = None  # the proxy process, whose CPU time is metered during its rounds


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process: unlike latency, barely moved by other work on the machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class Figures:
    latencies: list[float] = field(default_factory=list)  # seconds
    requests: int = 0
    wall: float = 0.0
    cpu: float = 0.0  # seconds of the proxy process during the counted rounds

    def pct(self, q: float) -> float:
        data = sorted(self.latencies)
        return data[min(len(data) - 1, int(q * len(data)))] * 1000

    @property
    def rps(self) -> float:
        return self.requests / self.wall if self.wall else 0.0

    @property
    def cpu_ms_per_call(self) -> float:
        return 1000 * self.cpu / self.requests if self.requests else 0.0


class Client:
    """One concurrent client: a session with exactly one keep-alive connection."""

    def __init__(self, setup: Setup, url: str) -> None:
        self.setup = setup
        self.url = url
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1, ssl=setup.ssl_context, family=socket.AF_INET,
                                           force_close=False),
            timeout=aiohttp.ClientTimeout(total=30))
        self.sent = 0

    async def one(self) -> float:
        start = time.perf_counter()
        async with self.session.get(self.url, proxy=self.setup.proxy) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{self.setup.name}: {resp.status} {resp.headers.get('Tether-Error')} "
                                   f"{(await resp.text())[:300]}")
        self.sent += 1
        return time.perf_counter() - start

    async def run(self, n: int, out: list[float]) -> None:
        for _ in range(n):
            out.append(await self.one())

    async def close(self) -> None:
        await self.session.close()


async def measure(setups: list[Setup], url: str, concurrency: int, rounds: int, per_client: int,
                  warmup: int) -> tuple[dict[str, Figures], dict[str, int]]:
    figures = {s.name: Figures() for s in setups}
    clients = {s.name: [Client(s, url) for _ in range(concurrency)] for s in setups}
    try:
        for s in setups:  # warm-up: connections (and TLS tunnels) opened, first-call costs paid, not counted
            await asyncio.gather(*(c.run(warmup, []) for c in clients[s.name]))
        for r in range(rounds):
            order = setups[r % len(setups):] + setups[:r % len(setups)]
            for s in order:
                lat: list[float] = []
                cpu0 = cpu_seconds(s.pid) if s.pid else 0.0
                start = time.perf_counter()
                await asyncio.gather(*(c.run(per_client, lat) for c in clients[s.name]))
                fig = figures[s.name]
                fig.wall += time.perf_counter() - start
                fig.cpu += (cpu_seconds(s.pid) - cpu0) if s.pid else 0.0
                fig.latencies += lat
                fig.requests += len(lat)
    finally:
        for cs in clients.values():
            for c in cs:
                await c.close()
    sent = {name: sum(c.sent for c in cs) for name, cs in clients.items()}
    return figures, sent


def context(cafile: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cafile))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few requests only (smoke run)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests-c1", type=int, default=1200, help="counted requests per setup at concurrency 1")
    parser.add_argument("--requests-c8", type=int, default=2400, help="counted requests per setup at concurrency 8")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests_c1, args.requests_c8 = 2, 100, 320

    work = Path(tempfile.mkdtemp(prefix="tether-bench-sidecar-"))
    started = time.monotonic()
    print(f"tether sidecar benchmark  {time.strftime('%Y-%m-%d %H:%M')}  nproc {os.cpu_count()}  "
          f"python {platform.python_version()}  aiohttp {aiohttp.__version__}  "
          f"load average {os.getloadavg()[0]:.2f}")
    try:
        with ExitStack() as stack:
            ca = make_test_ca(work / "toolca")
            tools = stack.enter_context(stopping(ToolServerProcess(ca).start()))
            cp = prepare_controlplane(work / "cp", tools.http_port, tools.https_port, free_port(), lease_ttl=15.0)
            stack.enter_context(stopping(cp.start()))
            identity = cp.issue("bench-agent", {"issues.read": "direct", "secure.issues": "direct"})
            sidecar = SidecarProcess(cp, identity)
            stack.enter_context(stopping(sidecar))
            sidecar.start(upstream_ca=ca.ca_pem)
            mitm = stack.enter_context(stopping(MitmdumpProcess(work / "mitmdump", ca.ca_pem).start()))
            time.sleep(2.0)  # let both settle before the idle reading
            rss_start = {"tether sidecar": rss_mib(sidecar.proc.pid), "bare mitmdump": rss_mib(mitm.pid)}

            rows = []
            sent_through_sidecar = 0
            for scheme in ("http", "https"):
                base = tools.http_base if scheme == "http" else tools.https_base
                setups = [
                    Setup("direct", None, context(ca.ca_pem)),
                    Setup("mitmdump", mitm.proxy, context(mitm.ca), mitm.pid),
                    Setup("tether", sidecar.proxy, context(Path(sidecar.ca)), sidecar.proc.pid),
                ]
                for conc, total in ((1, args.requests_c1), (8, args.requests_c8)):
                    per_client = max(1, total // (args.rounds * conc))
                    cp_cpu0 = cpu_seconds(cp.proc.pid)
                    figures, sent = asyncio.run(measure(setups, base + ISSUES, conc, args.rounds, per_client,
                                                        warmup=20))
                    # The control plane takes the sidecar's reports (and nothing else but heartbeats) meanwhile.
                    cp_ms = 1000 * (cpu_seconds(cp.proc.pid) - cp_cpu0) / sent["tether"]
                    sent_through_sidecar += sent["tether"]
                    rows.append((scheme, conc, figures, cp_ms))
                    print(f"  measured {scheme} c={conc}: " + ", ".join(
                        f"{n} p50 {f.pct(0.5):.2f} ms" for n, f in figures.items()), flush=True)

            # Every call through the sidecar must reach the control plane as a report.
            client = cp.client()
            def reports() -> list[dict]:
                return client.request("GET", f"/v1/reports?agent={identity.agent}")
            try:
                wait_until(lambda: len(reports()) >= sent_through_sidecar, 30, interval=0.5, what="reports")
            except AssertionError:
                pass
            delivered = reports()
            by_resolution: dict[str, int] = {}
            for rep in delivered:
                key = f"{rep.get('resolution')}/{rep.get('status')}"
                by_resolution[key] = by_resolution.get(key, 0) + 1
            time.sleep(1.0)
            rss_end = {"tether sidecar": rss_mib(sidecar.proc.pid), "bare mitmdump": rss_mib(mitm.pid)}

        print_results(rows, rss_start, rss_end, sent_through_sidecar, len(delivered), by_resolution,
                      len({r["call_id"] for r in delivered}), time.monotonic() - started)
    except BaseException:
        args.keep = True  # the logs of what failed stay for a look
        raise
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def print_results(rows: list, rss_start: dict, rss_end: dict, sent: int, delivered: int, by_resolution: dict,
                  unique: int, elapsed: float) -> None:
    print()
    print("| setup | scheme | clients | requests | p50 ms | p99 ms | calls/s | proxy CPU ms/call |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for scheme, conc, figures, cp_ms in rows:
        for name, f in figures.items():
            cpu = "-" if name == "direct" else f"{f.cpu_ms_per_call:.2f}"
            if name == "tether":
                cpu += f" (+{cp_ms:.2f} control plane)"
            print(f"| {name} | {scheme} | {conc} | {f.requests} | {f.pct(0.5):.2f} | {f.pct(0.99):.2f} | {f.rps:.0f} "
                  f"| {cpu} |")
    print()
    print("tether against bare mitmproxy (targets: p50 <= "
          f"{P50_RATIO_TARGET:.2f}x, p99 <= +{P99_DELTA_TARGET_MS:.1f} ms):")
    print()
    print("| scheme | clients | p50 ratio | p50 target | p99 delta ms | p99 target | calls/s ratio | CPU/call ratio |")
    print("|---|---:|---:|---|---:|---|---:|---:|")
    all_p50 = all_p99 = True
    for scheme, conc, figures, _ in rows:
        t, m = figures["tether"], figures["mitmdump"]
        ratio = t.pct(0.5) / m.pct(0.5)
        delta = t.pct(0.99) - m.pct(0.99)
        ok50, ok99 = ratio <= P50_RATIO_TARGET, delta <= P99_DELTA_TARGET_MS
        all_p50 &= ok50
        all_p99 &= ok99
        print(f"| {scheme} | {conc} | {ratio:.2f}x | {'met' if ok50 else 'MISSED'} | {delta:+.2f} | "
              f"{'met' if ok99 else 'MISSED'} | {t.rps / m.rps:.2f}x | {t.cpu_ms_per_call / m.cpu_ms_per_call:.2f}x |")
    print()
    print("| process (idle) | RSS after start MiB | RSS after benchmark MiB |")
    print("|---|---:|---:|")
    for name in rss_start:
        print(f"| {name} | {rss_start[name]:.1f} | {rss_end[name]:.1f} |")
    print(f"| sidecar / mitmdump | {rss_start['tether sidecar'] / rss_start['bare mitmdump']:.2f}x | "
          f"{rss_end['tether sidecar'] / rss_end['bare mitmdump']:.2f}x |")
    print()
    print(f"reports: {sent} calls sent through the sidecar (warm-up included); the control plane holds "
          f"{delivered} reports ({unique} distinct call ids): "
          + ", ".join(f"{k} {v}" for k, v in sorted(by_resolution.items()))
          + (" -- all arrived" if unique == sent else f" -- {sent - unique} MISSING"))
    print(f"verdict: p50 target {'met' if all_p50 else 'MISSED'}; p99 target {'met' if all_p99 else 'MISSED'}")
    print(f"elapsed {elapsed:.0f} s; load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
