"""A large body through the sidecar: download and upload rates against no proxy and bare mitmproxy (issue 28 item 4).

Run: python bench/bench_stream.py                  (200 MiB bodies, 5 rounds, HTTP and HTTPS: ~10-20 minutes loaded)
     python bench/bench_stream.py --size 32M --rounds 2 --schemes http   (a quick run)

An aiohttp upstream in its own process serves ``GET /stream/down`` (SIZE bytes, generated in memory: a 1 MiB block
written again and again, with a Content-Length) and takes ``POST /stream/up`` (reads the body as it arrives, counts
it, answers the count), over HTTP and over HTTPS (a private CA). One client (aiohttp, in this process; one transfer
at a time, its body read and counted in 1 MiB pieces, or sent from a 1 MiB block with a Content-Length) fetches and
sends SIZE bytes through each setup. ``--framing chunked``: both ways chunked instead (the upstream's answer has no
Content-Length, so aiohttp writes each 1 MiB block as a chunk; the client's upload has none either, same):

- *direct*: no proxy;
- *mitmdump*: bare mitmproxy, no addons of ours, with ``stream_large_bodies=1m`` (without it mitmdump holds a whole
  body before it passes it on: tether streams bodies over 1 MiB, so this is the like-for-like baseline);
- *tether*: a real ``tether sidecar`` (full enforcement, call reports to a real control plane, capture on);
- *tether --no-capture*: a second sidecar, capture off;
- *tether (before)*, with ``--before DIR``: a third sidecar (capture on) run from the checkout in DIR;
- *splice relay* (plaintext only): no HTTP at all, a process of its own that connects each client connection to
  the upstream and moves the bytes both ways with blocking ``splice(2)`` in two threads (``SPLICE_RELAY_CODE``):
  what a third process on the path costs on this machine, whatever it does with the bytes: the ceiling of any
  proxy, tether's relay included.
- *sockmap relay* (plaintext only, ``--no-sockmap`` to leave it out): the same bare forwarder, but after reading
  each request's head it puts both sockets into an eBPF sockhash (``bench/sockmap_bpf.py``) and the kernel
  redirects every byte received on one to the other's send side (``SOCKMAP_RELAY_CODE``): the forwarder's process
  never wakes for the body. Needs root (or CAP_BPF and CAP_NET_ADMIN).

The client's and the upstream's CPU seconds per GiB are printed too, and the whole machine's (every core's busy
time over the transfer, from /proc/stat: other work on the machine included, and the kernel threads that do a sockmap
redirect's sending, which no process of the setup is charged for) (through a proxy the client and the upstream
pay more per byte than direct: their loopback peer is another process's TCP stack, not each other's).

Rounds interleave the setups (A B A B, the order rotating), so load from other work on the machine falls on every
setup alike. Printed per direction and scheme: the median rate of each setup (MiB/s), its ratio to direct and to
mitmdump (ratios of medians), the proxy's CPU seconds per transferred GiB, and each proxy's peak RSS (VmHWM) over
the whole run against its RSS when idle. Target (issue 28): tether at no less than half the direct rate, capture on
and off, download and upload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import aiohttp  # noqa: E402
import bench_sidecar as bs  # noqa: E402

from tests.harness import SidecarProcess, free_port, make_test_ca, prepare_controlplane  # noqa: E402

TARGET_RATIO = 0.5
MIB = 1 << 20
BLOCK = MIB
DIRECT, MITMDUMP, TETHER, NOCAP = "direct", "mitmdump", "tether", "tether --no-capture"
SPLICE = "splice relay"  # a bare splice forwarder in its own process: the ceiling of a third process on the path
SOCKMAP = "sockmap relay"  # a bare forwarder whose bytes the kernel redirects (eBPF sockhash): no wake-up a byte
BEFORE = "tether (before)"  # --before DIR: a sidecar of the code in DIR, capture on, in the same rotation
DIRECTIONS = ("download", "upload")
STREAM_CAPS = """
  stream.down:  {{http: {{host: 127.0.0.1, port: {http}, methods: [GET], path: "/stream/down"}}}}
  stream.up:    {{http: {{host: 127.0.0.1, port: {http}, methods: [POST], path: "/stream/up"}}}}
  stream.sdown: {{http: {{host: localhost, port: {https}, methods: [GET], path: "/stream/down"}}}}
  stream.sup:   {{http: {{host: localhost, port: {https}, methods: [POST], path: "/stream/up"}}}}
"""
CAPS = {"stream.down": "direct", "stream.up": "direct", "stream.sdown": "direct", "stream.sup": "direct"}

# The upstream in a process of its own (no GIL shared with the client). argv: JSON config. EOF on stdin stops it.
UPSTREAM_CODE = """
import asyncio, json, ssl, sys
from aiohttp import web
cfg = json.loads(sys.argv[1])
size, block = cfg["size"], bytes(range(256)) * (cfg["block"] // 256)

async def down(request):
    length = {} if cfg["chunked"] else {"Content-Length": str(size)}
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream", **length})
    await resp.prepare(request)
    left = size
    while left > 0:
        piece = block if left >= len(block) else block[:left]
        await resp.write(piece)
        left -= len(piece)
    await resp.write_eof()
    return resp

async def up(request):
    got = 0
    async for piece in request.content.iter_any():
        got += len(piece)
    return web.json_response({"bytes": got})

async def main():
    app = web.Application(client_max_size=1 << 40)
    app.router.add_get("/stream/down", down)
    app.router.add_post("/stream/up", up)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cfg["cert"], cfg["key"])
    await web.TCPSite(runner, "127.0.0.1", cfg["http"]).start()
    await web.TCPSite(runner, "127.0.0.1", cfg["https"], ssl_context=tls).start()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await runner.cleanup()

asyncio.run(main())
"""


# A bare forwarder: each accepted connection is joined to the upstream (argv: listen port, upstream port), bytes
# moved both ways by blocking splice(2) through a pipe of 1 MiB, one thread a direction. It reads no HTTP: the
# client's absolute-form request line reaches the upstream as sent (aiohttp's server takes it).
SPLICE_RELAY_CODE = """
import fcntl, os, socket, sys, threading
listen, upstream = int(sys.argv[1]), int(sys.argv[2])

def pump(a, b):
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
    try:
        while n := os.splice(a.fileno(), w, 1 << 20):
            while n:
                n -= os.splice(r, b.fileno(), n)
    except OSError:
        pass
    try:
        b.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    os.close(r)
    os.close(w)

server = socket.create_server(("127.0.0.1", listen))
print("ready", flush=True)
while True:
    client, _ = server.accept()
    peer = socket.create_connection(("127.0.0.1", upstream))
    for a, b in ((client, peer), (peer, client)):
        threading.Thread(target=pump, args=(a, b), daemon=True).start()
"""


# The same forwarder with the kernel moving the bytes (argv: listen port, upstream port, the bench directory): each
# accepted connection's request head is read here and sent on (as a proxy decides before it relays), then both
# sockets go into an eBPF sockhash whose sk_skb verdict program (bench/sockmap_bpf.py) redirects every skb
# received on one to the other's send side: no byte wakes this process. What is queued on the client's socket is read
# with the head (FIONREAD's count of it: a partly read skb would be redirected whole, its first bytes twice; a
# segment coalesced into the last queued skb meanwhile still can be). ``--sockmap-buffers``
# fixes both sockets' buffers (argv[4]; 0: autotuned). Joined after the head is sent, so what the
# kernel redirects follows it. Bytes already queued on a socket when it joins (the upload's first, the answer's)
# would wait for the next bytes to arrive, which a client whose window they fill never sends: setting SO_RCVLOWAT
# runs tcp_data_ready(), and with it the verdict on them, at once. One thread a connection waits for either side's
# close (POLLRDHUP: nothing is read here), then closes both (closing a socket takes it out of the map).
SOCKMAP_RELAY_CODE = """
import fcntl, select, socket, struct, sys, termios, threading
sys.path.insert(0, sys.argv[3])
from sockmap_bpf import Redirector
listen, upstream, buffers = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[4])
try:
    redirect = Redirector.create()
except OSError as e:  # not root, or a kernel without sockmap
    print(f"unavailable: {e}", flush=True)
    sys.exit(1)

def serve(client):
    peer = socket.create_connection(("127.0.0.1", upstream))
    head = b""
    while b"\\r\\n\\r\\n" not in head:
        piece = client.recv(65536)
        if not piece:
            return
        head += piece
    queued = struct.unpack("i", fcntl.ioctl(client, termios.FIONREAD, b"\\0" * 4))[0]
    while queued > 0:  # and all queued with it: a partly read skb would be redirected whole (bytes twice)
        piece = client.recv(queued)
        head += piece
        queued -= len(piece)
    for s in (client, peer) if buffers else ():
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffers)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffers)
    peer.sendall(head)
    for s in (client, peer):
        redirect.set_budget(s, 1 << 62)  # before they join: a socket in the map without a budget passes its bytes
    redirect.join(client, peer)
    for s in (client, peer):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)  # data_ready now: redirect what is already queued
    poll = select.poll()
    for s in (client, peer):
        poll.register(s, select.POLLRDHUP)
    try:
        poll.poll()
    finally:
        client.close()
        peer.close()

server = socket.create_server(("127.0.0.1", listen))
print("ready", flush=True)
while True:
    client, _ = server.accept()
    threading.Thread(target=serve, args=(client,), daemon=True).start()
"""


class SpliceRelay:
    """SPLICE_RELAY_CODE (or another forwarder's code) in a child process, in front of the upstream's plaintext
    port."""

    code = SPLICE_RELAY_CODE

    def __init__(self, upstream_port: int, buffers: int = 0) -> None:
        self.port, self.upstream_port, self.buffers = free_port(), upstream_port, buffers
        self.proc: subprocess.Popen | None = None

    @property
    def proxy(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SpliceRelay:
        self.proc = subprocess.Popen([sys.executable, "-c", self.code, str(self.port), str(self.upstream_port),
                                      str(ROOT / "bench"), str(self.buffers)], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if (line := self.proc.stdout.readline().strip()) != "ready":
            self.stop()
            raise RuntimeError(line or f"{type(self).__name__} failed")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


class SockmapRelay(SpliceRelay):
    """SOCKMAP_RELAY_CODE in a child process."""

    code = SOCKMAP_RELAY_CODE


class Upstream(bs.ToolServerProcess):
    """UPSTREAM_CODE in a child process: HTTP and HTTPS."""

    def __init__(self, ca: bs.TestCA, size: int, chunked: bool = False) -> None:
        super().__init__(ca)
        self.size, self.chunked = size, chunked

    def start(self) -> Upstream:
        cfg = {"http": self.http_port, "https": self.https_port, "cert": str(self.ca.cert_pem),
               "key": str(self.ca.key_pem), "size": self.size, "block": BLOCK,
               "chunked": self.chunked}
        self.proc = subprocess.Popen([sys.executable, "-c", UPSTREAM_CODE, json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready", "upstream failed"
        return self


class StreamingMitmdump(bs.MitmdumpProcess):
    """Bare mitmdump that streams bodies over 1 MiB, as tether does."""

    def command(self) -> list[str]:
        return [*super().command(), "--set", "stream_large_bodies=1m"]


@dataclass
class Setup:
    name: str
    proxy: str | None
    ca: Path
    pid: int | None = None


@dataclass
class Figures:
    rates: list[float] = field(default_factory=list)  # MiB/s, one per transfer
    cpu: float = 0.0  # the proxy's CPU seconds over its transfers
    client_cpu: float = 0.0  # this process's (the client's)
    upstream_cpu: float = 0.0
    machine_cpu: float = 0.0  # every core's busy time (/proc/stat): kernel threads included (a kworker's redirects)
    bytes: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.rates) if self.rates else 0.0

    def per_gib(self, seconds: float) -> float:
        return seconds / (self.bytes / (1 << 30)) if self.bytes else 0.0

    @property
    def cpu_per_gib(self) -> float:
        return self.per_gib(self.cpu)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


def machine_busy() -> float:
    """CPU seconds all cores have spent busy since boot (user, nice, system, irq, softirq, steal)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


def vm_kib(pid: int, field_name: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field_name} for {pid}")


async def download(session: aiohttp.ClientSession, url: str, proxy: str | None, size: int) -> None:
    async with session.get(url, proxy=proxy) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {resp.status} {resp.headers.get('Tether-Error')} {(await resp.text())[:300]}")
        got = 0
        while piece := await resp.content.read(BLOCK):
            got += len(piece)
    if got != size:
        raise RuntimeError(f"downloaded {got} bytes of {size}")


async def upload(session: aiohttp.ClientSession, url: str, proxy: str | None, size: int,
                 chunked: bool = False) -> None:
    block = bytes(range(256)) * (BLOCK // 256)

    async def body():
        left = size
        while left > 0:
            piece = block if left >= len(block) else block[:left]
            left -= len(piece)
            yield piece

    headers = {"Content-Type": "application/octet-stream", **({} if chunked else {"Content-Length": str(size)})}
    async with session.post(url, proxy=proxy, data=body(), headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"POST {resp.status} {resp.headers.get('Tether-Error')} {(await resp.text())[:300]}")
        got = (await resp.json())["bytes"]
    if got != size:
        raise RuntimeError(f"the upstream received {got} bytes of {size}")


async def one_transfer(setup: Setup, direction: str, url: str, size: int, chunked: bool = False) -> float:
    """One transfer on a fresh connection (its TLS handshake and the proxy's decision included): MiB/s."""
    context = ssl.create_default_context(cafile=str(setup.ca))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, ssl=context),
                                     timeout=aiohttp.ClientTimeout(total=900)) as session:
        start = time.perf_counter()
        if direction == "download":
            await download(session, url, setup.proxy, size)
        else:
            await upload(session, url, setup.proxy, size, chunked)
        return size / MIB / (time.perf_counter() - start)


def measure(setups: list[Setup], direction: str, url: str, size: int, rounds: int,
            upstream_pid: int, chunked: bool = False) -> dict[str, Figures]:
    figures = {s.name: Figures() for s in setups}
    asyncio.run(one_transfer(setups[0], direction, url, size, chunked))  # warm-up, not counted: first-call costs paid
    for r in range(rounds):
        for s in setups[r % len(setups):] + setups[:r % len(setups)]:
            cpu0 = bs.cpu_seconds(s.pid) if s.pid else 0.0
            own0, up0, all0 = bs.cpu_seconds(os.getpid()), bs.cpu_seconds(upstream_pid), machine_busy()
            rate = asyncio.run(one_transfer(s, direction, url, size, chunked))
            fig = figures[s.name]
            fig.rates.append(rate)
            fig.bytes += size
            fig.client_cpu += bs.cpu_seconds(os.getpid()) - own0
            fig.upstream_cpu += bs.cpu_seconds(upstream_pid) - up0
            fig.machine_cpu += machine_busy() - all0
            if s.pid:
                fig.cpu += bs.cpu_seconds(s.pid) - cpu0
    return figures


def report(scheme: str, direction: str, figures: dict[str, Figures]) -> list[str]:
    direct, mitm = figures[DIRECT].median, figures[MITMDUMP].median
    lines = [f"{scheme} {direction}:"]
    for name, fig in figures.items():
        rates = " ".join(f"{x:.0f}" for x in fig.rates)
        cpu = f", proxy CPU {fig.cpu_per_gib:.2f} s/GiB" if fig.cpu else ""
        cpu += (f", client {fig.per_gib(fig.client_cpu):.2f}, upstream {fig.per_gib(fig.upstream_cpu):.2f}, "
                f"machine {fig.per_gib(fig.machine_cpu):.2f} s/GiB")
        lines.append(f"  {name:<22} median {fig.median:7.1f} MiB/s  {fig.median / direct:5.2f}x direct  "
                     f"{fig.median / mitm:5.2f}x mitmdump{cpu}   (each: {rates})")
    for name in (n for n in (SPLICE, SOCKMAP, TETHER, NOCAP, BEFORE) if n in figures):
        ratio = figures[name].median / direct
        lines.append(f"  target {name}: >= {TARGET_RATIO:.2f}x direct: {'met' if ratio >= TARGET_RATIO else 'MISSED'}"
                     f" ({ratio:.2f}x)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="200M", help="body size (200M; K, M, G are powers of 1024)")
    parser.add_argument("--rounds", type=int, default=5, help="transfers per setup, direction and scheme")
    parser.add_argument("--schemes", default="http,https", help="http, https or both")
    parser.add_argument("--directions", default=",".join(DIRECTIONS))
    parser.add_argument("--before", metavar="DIR", help="also a sidecar (capture on) of the checkout in DIR, e.g. "
                        "git archive COMMIT | tar -x -C DIR: the code before a change, in the same rotation")
    parser.add_argument("--setups", default=",".join((DIRECT, MITMDUMP, TETHER, NOCAP)),
                        help="which setups (direct and mitmdump always run: they are the baselines)")
    parser.add_argument("--no-splice", action="store_true", help="leave out the bare splice relay (plaintext)")
    parser.add_argument("--no-sockmap", action="store_true", help="leave out the bare sockmap relay (plaintext)")
    parser.add_argument("--sockmap-buffers", type=parse_size, default=0, metavar="SIZE",
                        help="the sockmap relay's SO_SNDBUF and SO_RCVBUF on both sockets (default: autotuned)")
    parser.add_argument("--framing", choices=("length", "chunked"), default="length",
                        help="bodies with a Content-Length (default), or chunked both ways")
    args = parser.parse_args()
    size = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="tether-bench-stream-"))
    print(f"tether stream benchmark  {time.strftime('%Y-%m-%d %H:%M')}  nproc {os.cpu_count()}  "
          f"python {platform.python_version()}  aiohttp {aiohttp.__version__}  size {size / MIB:.0f} MiB  "
          f"rounds {args.rounds}  framing {args.framing}  "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    wanted = set(args.setups.split(",")) | {DIRECT, MITMDUMP} | ({BEFORE} if args.before else set())
    out: list[str] = []
    with ExitStack() as stack:
        ca = make_test_ca(work / "toolca")
        upstream = stack.enter_context(bs.stopping(Upstream(ca, size, args.framing == "chunked").start()))
        cp = prepare_controlplane(work / "cp", upstream.http_port, upstream.https_port, free_port(), lease_ttl=15.0)
        cp.catalog_path.write_text(cp.catalog_path.read_text().replace(
            "roles:", STREAM_CAPS.format(http=upstream.http_port, https=upstream.https_port).lstrip("\n") + "roles:"))
        stack.enter_context(bs.stopping(cp.start()))
        sidecars = {name: SidecarProcess(cp, cp.issue(agent, CAPS), extra=extra) for name, agent, extra in (
            (TETHER, "stream-agent", []), (NOCAP, "stream-agent-nocap", ["--no-capture"]),
            (BEFORE, "stream-agent-before", [])) if name in wanted}
        here = os.getcwd()
        for name, sc in sidecars.items():
            stack.enter_context(bs.stopping(sc))
            if name == BEFORE:  # `python -m tether` imports from its working directory
                os.chdir(args.before)
            try:
                sc.start(upstream_ca=ca.ca_pem)
            finally:
                os.chdir(here)
        mitm = stack.enter_context(bs.stopping(StreamingMitmdump(work / "mitmdump", ca.ca_pem).start()))
        relays = {}
        for name, cls, off, buffers in ((SPLICE, SpliceRelay, args.no_splice, 0),
                                        (SOCKMAP, SockmapRelay, args.no_sockmap, args.sockmap_buffers)):
            if not off:
                try:
                    relays[name] = stack.enter_context(bs.stopping(cls(upstream.http_port, buffers).start()))
                except RuntimeError as e:
                    print(f"  {name}: left out: {e}", flush=True)
        time.sleep(2.0)
        pids = {MITMDUMP: mitm.pid, **{n: sc.proc.pid for n, sc in sidecars.items()}}
        relay_setups = [Setup(n, r.proxy, ca.ca_pem, r.proc.pid) for n, r in relays.items() if r.proc]
        idle = {n: vm_kib(pid, "VmRSS") for n, pid in pids.items()}
        print("  pids: " + ", ".join(f"{n} {pid}" for n, pid in pids.items()), flush=True)
        for scheme in args.schemes.split(","):
            base = f"http://127.0.0.1:{upstream.http_port}" if scheme == "http" else \
                f"https://localhost:{upstream.https_port}"
            setups = [Setup(DIRECT, None, ca.ca_pem), *(relay_setups if scheme == "http" else []),
                      Setup(MITMDUMP, mitm.proxy, mitm.ca, mitm.pid),
                      *(Setup(n, sc.proxy, Path(sc.ca), sc.proc.pid) for n, sc in sidecars.items())]
            for direction in args.directions.split(","):
                url = base + ("/stream/down" if direction == "download" else "/stream/up")
                figures = measure(setups, direction, url, size, args.rounds, upstream.proc.pid,
                                  args.framing == "chunked")
                lines = report(scheme, direction, figures)
                out += lines
                print("\n".join(lines), flush=True)
        peak = {n: vm_kib(pid, "VmHWM") for n, pid in pids.items()}
        out.append("RSS (MiB): " + ", ".join(f"{n} idle {idle[n]:.1f}, peak {peak[n]:.1f}" for n in pids))
        print(out[-1])
        captures = {n: sum(f.stat().st_size for f in (sc.state_dir / "captures").glob("flows*"))
                    for n, sc in sidecars.items() if (sc.state_dir / "captures").exists()}
        print("capture on disk (bytes): " + ", ".join(f"{n} {b}" for n, b in captures.items()))
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
