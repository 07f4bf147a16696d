"""What enforcement costs per call: tether's sidecar against bare mitmproxy and against no proxy at all.

Run: python bench/bench_sidecar.py          (2-9 minutes on 2 cores, depending on load; --quick for a smoke run)
     python bench/bench_sidecar.py --boundary  (as root: also the --isolate rows, about 1.5 minutes more)

Four setups, all measured in this run with the same client: *direct* (client -> tool server), *mitmdump*
(bare mitmproxy, no addons: ``mitmdump --set connection_strategy=lazy -q``), *tether* (a real
``tether sidecar`` process with full enforcement: chain check, lease, capture to disk, call reports to a
real ``tether controlplane serve`` process, with the capability granted) and *tether --no-capture* (a second
sidecar, its own agent under the same control plane, started with ``--no-capture``: enforcement, call
tracking and reports, no traffic capture) and *tether + tracing* (a third sidecar with OpenTelemetry on:
``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing at a local OTLP/HTTP receiver in its own process, which decodes and
counts the spans). Each over plain HTTP and over
HTTPS (the tool server's certificate comes from a private CA; the proxies intercept TLS with their own
CA, which the client trusts), with 1 and 8 concurrent clients.

Client: aiohttp, one ``ClientSession`` with one keep-alive connection per concurrent client, identical for
every setup (``proxy=`` is the only difference). The tool server runs in its own process (the harness's
``ToolServer``), so it does not share a GIL with the client. Each client's first requests warm up its
connection and are not counted. Rounds of the four setups alternate (the order rotates), so load from
other work on the machine hits the baseline and the measured path alike.

Targets (each tether setup against bare mitmproxy, same scheme and concurrency; a verdict for each):
  - p50 latency at most 1.10x bare mitmproxy's;
  - p99 latency at most 1 ms above bare mitmproxy's.
Tracing on against off (tether + tracing against tether, same scheme and concurrency): p50 at most 1.10x.
Also printed: RSS of an idle sidecar against an idle bare mitmdump, after start and after the benchmark,
and the call reports the control plane received from each sidecar (every call must arrive). The control
plane's CPU per call is metered over all rounds and divided by the calls of both sidecars (their reports are
batched (every second, or per 200), so they cannot be told apart per round).

Credentials and isolation (issue 13). *tether + credential* is a fourth sidecar like *tether* (capture on),
whose agent holds a capability naming a catalog credential, given as ``--secret bench=file:PATH``: every call
to the same tool gets ``Authorization: Bearer <secret>`` injected (the tool server's answer says it saw one).
It is in the rotation above; target: p50 no slower than *tether*'s within noise (<= 1.05x).
With ``--before DIR`` (a checkout of earlier code, e.g. ``git archive COMMIT | tar -x -C DIR``), *tether* and
*tether + credential* also run from DIR's code (the sidecar process started in DIR), in the same rotation:
the code before and after a change, compared in one run (latency, CPU per call, RSS).
With ``--boundary`` (Linux, root, ``ip netns``, iptables; skipped with the reason printed otherwise): one
``tether run --isolate`` sidecar serves two copies of the same client program (aiohttp, one keep-alive
connection per client, run as a child process): one on the host through the sidecar's explicit listener
(``proxy=``), one inside the isolated namespace as ``nobody`` with no proxy variables, dialling the tool by
name, intercepted transparently. Rounds alternate; target: transparent p50 within 1.10x of explicit's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shlex
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
    close_stdin_and_wait,
    free_port,
    make_test_ca,
    prepare_controlplane,
    stop_process,
    wait_until,
)

P50_RATIO_TARGET = 1.10
CRED_RATIO_TARGET = 1.05  # "no slower within noise": repeated runs of one setup differ by a few per cent
ISO_RATIO_TARGET = 1.10
P99_DELTA_TARGET_MS = 1.0
ISSUES = "/repos/o/r/issues"
MITMDUMP = str(Path(sys.executable).with_name("mitmdump"))
CORE = "mitmproxy, sidecar addon set"
TETHER = "tether"
NOCAP = "tether --no-capture"
TRACED = "tether + tracing"
CRED = "tether + credential"
SIDECARS = (TETHER, NOCAP, TRACED, CRED)
BEFORE = "tether (before)"  # --before DIR: the same two sidecars run from another checkout, in the same rotation
CRED_BEFORE = "tether + credential (before)"
EXPLICIT = "explicit"
TRANSPARENT = "transparent (--isolate)"
BOUNDARY_HOST = "tools.bench"  # the tool's name for the isolated client (resolved by the sidecar's /etc/hosts)
CREDENTIAL_CATALOG = """
credentials:
  bench: {header: Authorization, format: "Bearer {secret}", insecure_plain_http: loopback}
"""
CREDENTIAL_CAPS = """
  cred.issues: {{http: {{host: 127.0.0.1, port: {http}, scheme: http, methods: [GET], path: "/repos/*/*/issues*"}},
                credential: bench}}
  cred.secure: {{http: {{host: localhost, port: {https}, scheme: https, methods: [GET],
                path: "/repos/*/*/issues*"}}, credential: bench}}
"""
BOUNDARY_CAPS = """
  iso.issues:    {{http: {{host: {host}, port: {http}, methods: [GET], path: "/repos/*/*/issues*"}}}}
  iso.secure:    {{http: {{host: {host}, port: {https}, methods: [GET], path: "/repos/*/*/issues*"}}}}
"""

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

# A local OTLP/HTTP trace receiver in a process of its own: decodes every export, counts the spans.
# stdin: "spans" -> the count so far; EOF stops it.
RECEIVER_CODE = """
import asyncio, sys, threading
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest as Req
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse as Resp
spans = [0]
async def traces(request):
    export = Req.FromString(await request.read())
    spans[0] += sum(len(s.spans) for r in export.resource_spans for s in r.scope_spans)
    return web.Response(body=Resp().SerializeToString(), content_type="application/x-protobuf")
def serve():
    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, handle_signals=False)
threading.Thread(target=serve, daemon=True).start()
print("ready", flush=True)
for line in sys.stdin:
    print(spans[0], flush=True)
"""


# The client of the --boundary rows, in a process of its own: the same program on the host (explicit: through the
# proxy, CONNECT for HTTPS) and inside the isolated namespace (transparent: no proxy, the tool dialled by name).
# Standard library only (the system's python3: the isolated user, nobody, cannot read a venv under /root); one
# thread and one keep-alive connection per concurrent client. argv: JSON config. stdin: "setup SCHEME CONC"
# (connections opened, warmed up) -> "ok"; "run N" (N calls per client) -> JSON latencies in seconds; "close";
# EOF ends it. First line out: who and where it runs.
CLIENT_PYTHON = "/usr/bin/python3"
CLIENT_CODE = r"""
import http.client, json, os, ssl, sys, threading, time
from urllib.parse import urlsplit
cfg = json.loads(sys.argv[1])
proxy = urlsplit(cfg["proxy"]) if cfg.get("proxy") else None
ctx = ssl.create_default_context(cafile=cfg.get("cafile") or os.environ.get("SSL_CERT_FILE"))
print(json.dumps({"uid": os.getuid(), "proxy_env": sorted(k for k in os.environ if k.lower().endswith("_proxy")
                                                          and os.environ[k]), "proxy": cfg.get("proxy")}), flush=True)

class Client:
    def __init__(self, url):
        u = urlsplit(url)
        tls = u.scheme == "https"
        host, port = (proxy.hostname, proxy.port) if proxy else (u.hostname, u.port)
        self.conn = (http.client.HTTPSConnection(host, port, context=ctx, timeout=30) if tls
                     else http.client.HTTPConnection(host, port, timeout=30))
        if proxy and tls:
            self.conn.set_tunnel(u.hostname, u.port)
        self.target = url if proxy and not tls else u.path

    def one(self):
        start = time.perf_counter()
        self.conn.request("GET", self.target)
        resp = self.conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{resp.status} {resp.getheader('Tether-Error')} {body[:300]!r}")
        return time.perf_counter() - start

    def many(self, n, out):
        out.extend(self.one() for _ in range(n))

def together(clients, n):
    outs = [[] for _ in clients]
    threads = [threading.Thread(target=c.many, args=(n, o)) for c, o in zip(clients, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [x for o in outs for x in o]

clients = []
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "setup":
        clients = [Client(cfg["urls"][cmd[1]]) for _ in range(int(cmd[2]))]
        together(clients, cfg["warmup"])
        print("ok", flush=True)
    elif cmd[0] == "run":
        lat = together(clients, int(cmd[1]))
        if len(lat) != int(cmd[1]) * len(clients):
            raise SystemExit("a client failed")
        print(json.dumps(lat), flush=True)
    elif cmd[0] == "close":
        for c in clients:
            c.conn.close()
        clients = []
        print("ok", flush=True)
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
        close_stdin_and_wait(self.proc)
        self.proc = None


class ReceiverProcess(ToolServerProcess):
    """The OTLP/HTTP receiver the traced sidecar exports to."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ReceiverProcess:
        self.proc = subprocess.Popen([sys.executable, "-c", RECEIVER_CODE, str(self.port)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready", "receiver failed"
        wait_until(lambda: socket.socket().connect_ex(("127.0.0.1", self.port)) == 0, 10, what="OTLP receiver")
        return self


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

    def command(self) -> list[str]:
        return [MITMDUMP, "--listen-host", "127.0.0.1", "-p", str(self.port), "--set", "connection_strategy=lazy",
                "--set", f"confdir={self.directory}", "--set", f"ssl_verify_upstream_trusted_ca={self.upstream_ca}",
                "-q"]

    def start(self) -> MitmdumpProcess:
        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.directory / "mitmdump.log", "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=log)

        def listening() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"{self.command()[:2]} exited: "
                                     f"{(self.directory / 'mitmdump.log').read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            except OSError:
                return False
            return self.ca.exists()

        wait_until(listening, 30, what="mitmdump")
        return self

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None


class MinimalMitmproxyProcess(MitmdumpProcess):
    """mitmproxy with the sidecar's addon set only (bench/minimal_mitmproxy.py): tether's own cost."""

    def command(self) -> list[str]:
        script = Path(__file__).with_name("minimal_mitmproxy.py")
        return [sys.executable, str(script), str(self.port), str(self.directory), str(self.upstream_ca)]


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
    headers: dict[str, str] | None = None  # sent with every call (bench_credential.py's control)


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process: unlike latency, barely moved by other work on the machine."""
    return sum(cpu_split(pid))


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


@dataclass
class Figures:
    latencies: list[float] = field(default_factory=list)  # seconds
    requests: int = 0
    wall: float = 0.0
    cpu: float = 0.0  # seconds of the proxy process during the counted rounds
    sys_cpu: float = 0.0  # the kernel's part of it

    def pct(self, q: float) -> float:
        data = sorted(self.latencies)
        return data[min(len(data) - 1, int(q * len(data)))] * 1000

    @property
    def rps(self) -> float:
        return self.requests / self.wall if self.wall else 0.0

    @property
    def cpu_ms_per_call(self) -> float:
        return 1000 * self.cpu / self.requests if self.requests else 0.0

    @property
    def sys_ms_per_call(self) -> float:
        return 1000 * self.sys_cpu / self.requests if self.requests else 0.0


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
        async with self.session.get(self.url, proxy=self.setup.proxy, headers=self.setup.headers) as resp:
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
                u0, s0 = cpu_split(s.pid) if s.pid else (0.0, 0.0)
                start = time.perf_counter()
                await asyncio.gather(*(c.run(per_client, lat) for c in clients[s.name]))
                fig = figures[s.name]
                fig.wall += time.perf_counter() - start
                if s.pid:
                    u1, s1 = cpu_split(s.pid)
                    fig.cpu += (u1 - u0) + (s1 - s0)
                    fig.sys_cpu += s1 - s0
                fig.latencies += lat
                fig.requests += len(lat)
    finally:
        for cs in clients.values():
            for c in cs:
                await c.close()
    sent = {name: sum(c.sent for c in cs) for name, cs in clients.items()}
    return figures, sent


# -- credentials and isolation (issue 13) ----------------------------------------------------------------------
def boundary_not_permitted() -> str | None:
    """Why the --isolate rows cannot run here, or None."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux (network namespaces, iptables, setpriv)"
    missing = [t for t in ("ip", "iptables", "setpriv", "unshare", "mount", "sysctl") if not shutil.which(t)]
    if missing:
        return f"needs {', '.join(missing)}"
    probe = subprocess.run(["ip", "netns", "add", "tether-bench-perm"], capture_output=True, text=True, check=False)
    subprocess.run(["ip", "netns", "del", "tether-bench-perm"], capture_output=True, check=False)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    if subprocess.run(["iptables", "-w", "-S", "INPUT"], capture_output=True, check=False).returncode != 0:
        return "iptables cannot be used here"
    from tether.proxy.isolate import User, readable_by

    nobody = User.lookup(None)
    for path in (Path(CLIENT_PYTHON).resolve(),):
        if not path.exists() or not readable_by(path, nobody):
            return f"{path} is not readable by {nobody.name}, who runs the isolated client"
    return None


class ClientProcess:
    """CLIENT_CODE in a child process (``command`` runs it, directly or under ``tether run --isolate``)."""

    def __init__(self, name: str, command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = log
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(log, "ab"), text=True, env=env)
        self.hello = json.loads(self._line())

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"{self.name} client ended: {self.log.read_text(errors='replace')[-3000:]}")
        return line

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def stop(self) -> None:
        close_stdin_and_wait(self.proc)


def boundary_rounds(clients: dict[str, ClientProcess], pid: int, scheme: str, conc: int, rounds: int,
                    per_client: int) -> dict[str, Figures]:
    """Explicit and transparent rounds through one sidecar, alternating; its CPU metered per round."""
    figures = {name: Figures() for name in clients}
    for c in clients.values():
        assert c.ask(f"setup {scheme} {conc}").strip() == "ok", c.name
    names = list(clients)
    for r in range(rounds):
        for name in names[r % 2:] + names[:r % 2]:
            u0, s0 = cpu_split(pid)
            start = time.perf_counter()
            lat = json.loads(clients[name].ask(f"run {per_client}"))
            fig = figures[name]
            fig.wall += time.perf_counter() - start
            u1, s1 = cpu_split(pid)
            fig.cpu += (u1 - u0) + (s1 - s0)
            fig.sys_cpu += s1 - s0
            fig.latencies += lat
            fig.requests += len(lat)
    for c in clients.values():
        assert c.ask("close").strip() == "ok", c.name
    return figures


def run_boundary(stack: ExitStack, work: Path, cp: object, tools: ToolServerProcess, args: argparse.Namespace) -> list:
    """One ``tether run --isolate`` sidecar; its isolated command is the transparent client."""
    identity = cp.issue("bench-agent-iso", {"iso.issues": "direct", "iso.secure": "direct"})  # type: ignore[attr-defined]
    public = Path(tempfile.mkdtemp(prefix="tether-bench-iso-", dir="/tmp"))  # the client program, for nobody
    stack.callback(shutil.rmtree, public, True)
    os.chmod(public, 0o755)
    client = public / "client.py"
    client.write_text(CLIENT_CODE)
    os.chmod(client, 0o644)
    hosts = work / "hosts"  # the sidecar's view (a private mount): the tool's name is this machine
    hosts.write_text(f"127.0.0.1 localhost {BOUNDARY_HOST}\n")
    state = work / "iso-state"
    urls = {"http": f"http://{BOUNDARY_HOST}:{tools.http_port}{ISSUES}",
            "https": f"https://{BOUNDARY_HOST}:{tools.https_port}{ISSUES}"}
    inner = (f"mount --bind {hosts} /etc/hosts && exec {shlex.quote(sys.executable)} -m tether run "
             f"--isolate --listen 127.0.0.1:0 --controlplane {cp.url} --chain {identity.chain_path} "  # type: ignore[attr-defined]
             f"--key {identity.key_path} --state-dir {state} --upstream-ca {tools.ca.ca_pem} -- "
             f"{CLIENT_PYTHON} -I {client} {shlex.quote(json.dumps({'urls': urls, 'warmup': 20}))}")
    env = {**cp.env(), "PYTHONPATH": str(ROOT)}  # type: ignore[attr-defined]
    print(f"  --isolate: unshare --mount --propagation private sh -c {shlex.quote(inner)}", flush=True)
    transparent = stack.enter_context(stopping(ClientProcess(
        TRANSPARENT, ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner], work / "iso-run.log",
        env=env)))
    info = json.loads((state / identity.agent / "sidecar.ready").read_text())
    explicit = stack.enter_context(stopping(ClientProcess(
        EXPLICIT, [CLIENT_PYTHON, "-I", str(client), json.dumps({"urls": urls, "warmup": 20, "proxy": info["proxy"],
                                                             "cafile": info["ca"]})], work / "explicit.log")))
    print(f"  --isolate sidecar pid {info['pid']}; transparent client {transparent.hello}; "
          f"explicit client {explicit.hello}", flush=True)
    clients = {EXPLICIT: explicit, TRANSPARENT: transparent}
    rows = []
    for scheme in ("http", "https"):
        for conc, total in ((1, args.requests_c1), (8, args.requests_c8)):
            per_client = max(1, total // (args.rounds * conc))
            figures = boundary_rounds(clients, info["pid"], scheme, conc, args.rounds, per_client)
            rows.append((scheme, conc, figures))
            print(f"  measured --isolate {scheme} c={conc}: " + ", ".join(
                f"{n} p50 {f.pct(0.5):.2f} ms" for n, f in figures.items()), flush=True)
    return rows


def injected(sidecar: SidecarProcess, url: str) -> bool:
    """Whether the tool server saw an Authorization header on a call through this sidecar."""
    import requests

    resp = requests.get(url, proxies=sidecar.proxies(), verify=sidecar.ca, timeout=10)
    resp.raise_for_status()
    return bool(resp.json()["authorization_seen"])


def print_credential(rows: list, seen: dict[str, bool]) -> None:
    pairs = [(CRED, TETHER), (CRED_BEFORE, BEFORE)] if BEFORE in rows[0][2] else [(CRED, TETHER)]
    met = True
    for on_name, off_name in pairs:
        print()
        print(f"injected credential against none ({on_name} against {off_name}; target p50 <= "
              f"{CRED_RATIO_TARGET:.2f}x):")
        print()
        print("| scheme | clients | p50 without ms | p50 with ms | p50 ratio | p50 target | p99 delta ms "
              "| CPU/call without ms | with ms | CPU/call ratio |")
        print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
        for scheme, conc, figures, _ in rows:
            on, off = figures[on_name], figures[off_name]
            ratio = on.pct(0.5) / off.pct(0.5)
            if on_name == CRED:
                met &= ratio <= CRED_RATIO_TARGET
            print(f"| {scheme} | {conc} | {off.pct(0.5):.2f} | {on.pct(0.5):.2f} | {ratio:.2f}x | "
                  f"{'met' if ratio <= CRED_RATIO_TARGET else 'MISSED'} | {on.pct(0.99) - off.pct(0.99):+.2f} | "
                  f"{off.cpu_ms_per_call:.3f} | {on.cpu_ms_per_call:.3f} | "
                  f"{on.cpu_ms_per_call / off.cpu_ms_per_call:.2f}x |")
    print()
    print("Authorization seen by the tool server: " + ", ".join(f"{k} {v}" for k, v in seen.items()))
    print(f"verdict, credential: p50 target {'met' if met else 'MISSED'}")


def print_boundary(rows: list | None, skipped: str | None) -> None:
    print()
    if rows is None:
        print(f"transparent (--isolate) against explicit: SKIPPED: {skipped}")
        return
    print("transparent mode under --isolate against explicit mode, one sidecar "
          f"(target p50 <= {ISO_RATIO_TARGET:.2f}x):")
    print()
    print("| scheme | clients | requests | p50 explicit ms | p50 transparent ms | p50 ratio | p50 target "
          "| p99 explicit ms | p99 transparent ms | sidecar CPU/call explicit ms | transparent ms |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    met = True
    for scheme, conc, figures in rows:
        e, t = figures[EXPLICIT], figures[TRANSPARENT]
        ratio = t.pct(0.5) / e.pct(0.5)
        met &= ratio <= ISO_RATIO_TARGET
        print(f"| {scheme} | {conc} | {t.requests} | {e.pct(0.5):.2f} | {t.pct(0.5):.2f} | {ratio:.2f}x | "
              f"{'met' if ratio <= ISO_RATIO_TARGET else 'MISSED'} | {e.pct(0.99):.2f} | {t.pct(0.99):.2f} | "
              f"{e.cpu_ms_per_call:.2f} | {t.cpu_ms_per_call:.2f} |")
    print()
    print(f"verdict, transparent under --isolate: p50 target {'met' if met else 'MISSED'}")


def context(cafile: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cafile))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few requests only (smoke run)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests-c1", type=int, default=1200, help="counted requests per setup at concurrency 1")
    parser.add_argument("--requests-c8", type=int, default=4800, help="counted requests per setup at concurrency 8")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--boundary", action="store_true", help="also transparent mode under tether run --isolate "
                        "against explicit mode (root, ip netns, iptables; ~1 minute more)")
    parser.add_argument("--before", metavar="DIR", help="also run tether and tether + credential from the checkout in "
                        "DIR (the code before a change), in the same rotation")
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
            skipped = boundary_not_permitted() if args.boundary else "not asked for (--boundary)"
            extra_caps = CREDENTIAL_CAPS.format(http=tools.http_port, https=tools.https_port).lstrip("\n")
            if skipped is None:  # a tool server whose certificate names the tool as the isolated client dials it
                iso_tools = stack.enter_context(stopping(ToolServerProcess(make_test_ca(work / "isoca",
                                                                                        [BOUNDARY_HOST])).start()))
                extra_caps += BOUNDARY_CAPS.format(host=BOUNDARY_HOST, http=iso_tools.http_port,
                                                   https=iso_tools.https_port).lstrip("\n")
            cp.catalog_path.write_text(CREDENTIAL_CATALOG.lstrip("\n") + cp.catalog_path.read_text().replace(
                "roles:", extra_caps + "roles:"))
            secret = work / "bench.secret"  # the sidecar's alone; the client sends no Authorization
            secret.write_text("bench-" + secrets.token_hex(16) + "\n")
            os.chmod(secret, 0o600)
            stack.enter_context(stopping(cp.start()))
            caps = {"issues.read": "direct", "secure.issues": "direct"}
            receiver = stack.enter_context(stopping(ReceiverProcess().start()))
            sidecars = {TETHER: SidecarProcess(cp, cp.issue("bench-agent", caps)),
                        NOCAP: SidecarProcess(cp, cp.issue("bench-agent-nocap", caps), extra=["--no-capture"]),
                        TRACED: SidecarProcess(cp, cp.issue("bench-agent-traced", caps)),
                        CRED: SidecarProcess(cp, cp.issue("bench-agent-cred", {"cred.issues": "direct",
                                                                               "cred.secure": "direct"}),
                                             extra=["--secret", f"bench=file:{secret}"])}
            if args.before:
                sidecars[BEFORE] = SidecarProcess(cp, cp.issue("bench-agent-before", caps))
                sidecars[CRED_BEFORE] = SidecarProcess(cp, cp.issue("bench-agent-cred-before", {
                    "cred.issues": "direct", "cred.secure": "direct"}), extra=["--secret", f"bench=file:{secret}"])
            here = os.getcwd()
            for n, sc in sidecars.items():
                stack.enter_context(stopping(sc))
                # Only the traced sidecar inherits the exporter's variables (the control plane runs already).
                otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint} if n == TRACED else {}
                os.environ.update(otel)
                if n in (BEFORE, CRED_BEFORE):  # `python -m tether` imports from its working directory
                    os.chdir(args.before)
                try:
                    sc.start(upstream_ca=ca.ca_pem)
                finally:
                    os.chdir(here)
                    for key in otel:
                        os.environ.pop(key, None)
            if args.before:
                print("  --before: " + ", ".join(f"{n} runs in {os.readlink(f'/proc/{sidecars[n].proc.pid}/cwd')}"
                                                 for n in (BEFORE, CRED_BEFORE)), flush=True)
            mitm = stack.enter_context(stopping(MitmdumpProcess(work / "mitmdump", ca.ca_pem).start()))
            core = stack.enter_context(stopping(MinimalMitmproxyProcess(work / "mitm-core", ca.ca_pem).start()))
            print(f"  pids: {', '.join(f'{n} {sc.proc.pid}' for n, sc in sidecars.items())}, mitmdump {mitm.pid}, "
                  f"control plane {cp.proc.pid}", flush=True)
            time.sleep(2.0)  # let them settle before the idle reading

            def rss_all() -> dict[str, float]:
                return {**{f"{n} sidecar": rss_mib(sc.proc.pid) for n, sc in sidecars.items()},
                        f"{CORE} (bench/minimal_mitmproxy.py)": rss_mib(core.pid), "bare mitmdump": rss_mib(mitm.pid)}

            rss_start = rss_all()
            rows = []
            names = tuple(sidecars)
            sent_through = dict.fromkeys(names, 0)
            sent_all: dict[str, int] = {}  # every setup's calls, warm-ups included (for the RSS table)
            for scheme in ("http", "https"):
                base = tools.http_base if scheme == "http" else tools.https_base
                setups = [
                    Setup("direct", None, context(ca.ca_pem)),
                    Setup("mitmdump", mitm.proxy, context(mitm.ca), mitm.pid),
                    Setup(CORE, core.proxy, context(core.ca), core.pid),
                    *(Setup(n, sc.proxy, context(Path(sc.ca)), sc.proc.pid) for n, sc in sidecars.items()),
                ]
                for conc, total in ((1, args.requests_c1), (8, args.requests_c8)):
                    per_client = max(1, total // (args.rounds * conc))
                    cp_cpu0 = cpu_seconds(cp.proc.pid)
                    figures, sent = asyncio.run(measure(setups, base + ISSUES, conc, args.rounds, per_client,
                                                        warmup=20))
                    # The control plane takes both sidecars' reports (and nothing else but heartbeats) meanwhile.
                    cp_ms = 1000 * (cpu_seconds(cp.proc.pid) - cp_cpu0) / sum(sent[n] for n in names)
                    for n in names:
                        sent_through[n] += sent[n]
                    for n, count in sent.items():
                        sent_all[n] = sent_all.get(n, 0) + count
                    rows.append((scheme, conc, figures, cp_ms))
                    print(f"  measured {scheme} c={conc}: " + ", ".join(
                        f"{n} p50 {f.pct(0.5):.2f} ms" for n, f in figures.items()), flush=True)

            seen = {n: injected(sidecars[n], tools.http_base + ISSUES) for n in (TETHER, CRED, BEFORE, CRED_BEFORE)
                    if n in sidecars}
            for n in seen:
                sent_through[n] += 1  # its report is awaited below with the others
            boundary = run_boundary(stack, work, cp, iso_tools, args) if skipped is None else None

            # Every call through each sidecar must reach the control plane as a report.
            client = cp.client()

            def reports(agent: str) -> list[dict]:
                return client.request("GET", f"/v1/reports?agent={agent}")

            delivery = {}
            for n, sc in sidecars.items():
                agent = sc.identity.agent
                try:
                    wait_until(lambda agent=agent, n=n: len(reports(agent)) >= sent_through[n], 30, interval=0.5,
                               what="reports")
                except AssertionError:
                    pass
                delivered = reports(agent)
                by_resolution: dict[str, int] = {}
                for rep in delivered:
                    key = f"{rep.get('resolution')}/{rep.get('status')}"
                    by_resolution[key] = by_resolution.get(key, 0) + 1
                delivery[n] = (sent_through[n], len(delivered), len({r["call_id"] for r in delivered}), by_resolution)
            time.sleep(1.0)
            rss_end = rss_all()
            spans = receiver.ask("spans")
            exported = (sent_through[TRACED], wait_until(lambda: receiver.ask("spans") >= sent_through[TRACED], 20,
                                                         interval=0.5, what="spans") and receiver.ask("spans"))
        rss_calls = {**{f"{n} sidecar": sent_all.get(n, 0) for n in names},
                     f"{CORE} (bench/minimal_mitmproxy.py)": sent_all.get(CORE, 0),
                     "bare mitmdump": sent_all.get("mitmdump", 0)}
        print_results(rows, rss_start, rss_end, delivery, time.monotonic() - started, names, rss_calls)
        print_tracing(rows, exported, spans)
        print_credential(rows, seen)
        print_boundary(boundary, skipped)
        print(f"load average at the end {os.getloadavg()[0]:.2f}")
    except BaseException:
        args.keep = True  # the logs of what failed stay for a look
        raise
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def print_tracing(rows: list, exported: tuple[int, int], spans_at_end: int) -> None:
    print()
    print(f"tracing on against off ({TRACED} against {TETHER}; target p50 <= {P50_RATIO_TARGET:.2f}x):")
    print()
    print("| scheme | clients | p50 off ms | p50 on ms | p50 ratio | p50 target | p99 delta ms | CPU/call ratio |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    met = True
    for scheme, conc, figures, _ in rows:
        on, off = figures[TRACED], figures[TETHER]
        ratio = on.pct(0.5) / off.pct(0.5)
        met &= ratio <= P50_RATIO_TARGET
        print(f"| {scheme} | {conc} | {off.pct(0.5):.2f} | {on.pct(0.5):.2f} | {ratio:.2f}x | "
              f"{'met' if ratio <= P50_RATIO_TARGET else 'MISSED'} | {on.pct(0.99) - off.pct(0.99):+.2f} | "
              f"{on.cpu_ms_per_call / off.cpu_ms_per_call:.2f}x |")
    calls, spans = exported
    print()
    print(f"spans: {calls} calls through the traced sidecar, {spans} execute_tool spans received by the OTLP receiver "
          f"({spans_at_end} when the measuring ended)")
    print(f"verdict, tracing: p50 target {'met' if met else 'MISSED'}")


def print_results(rows: list, rss_start: dict, rss_end: dict, delivery: dict, elapsed: float,
                  names: tuple[str, ...] = SIDECARS, calls: dict[str, int] | None = None) -> None:
    print()
    print("| setup | scheme | clients | requests | p50 ms | p99 ms | calls/s | proxy CPU ms/call | of which kernel |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for scheme, conc, figures, cp_ms in rows:
        for name, f in figures.items():
            cpu = "-" if name == "direct" else f"{f.cpu_ms_per_call:.2f}"
            kernel = "-" if name == "direct" else f"{f.sys_ms_per_call:.2f}"
            if name in names:
                cpu += f" (+{cp_ms:.2f} control plane)"
            print(f"| {name} | {scheme} | {conc} | {f.requests} | {f.pct(0.5):.2f} | {f.pct(0.99):.2f} | {f.rps:.0f} "
                  f"| {cpu} | {kernel} |")
    print()
    print("(control plane CPU: per call of either sidecar, both sidecars' reports together)")
    print()
    print("each tether setup against bare mitmproxy (targets: p50 <= "
          f"{P50_RATIO_TARGET:.2f}x, p99 <= +{P99_DELTA_TARGET_MS:.1f} ms):")
    print()
    print("| setup | scheme | clients | p50 ratio | p50 target | p99 delta ms | p99 target | calls/s ratio "
          "| CPU/call ratio |")
    print("|---|---|---:|---:|---|---:|---|---:|---:|")
    verdict = {n: [True, True] for n in names}
    for name in names:
        for scheme, conc, figures, _ in rows:
            t, m = figures[name], figures["mitmdump"]
            ratio = t.pct(0.5) / m.pct(0.5)
            delta = t.pct(0.99) - m.pct(0.99)
            ok50, ok99 = ratio <= P50_RATIO_TARGET, delta <= P99_DELTA_TARGET_MS
            verdict[name][0] &= ok50
            verdict[name][1] &= ok99
            print(f"| {name} | {scheme} | {conc} | {ratio:.2f}x | {'met' if ok50 else 'MISSED'} | {delta:+.2f} | "
                  f"{'met' if ok99 else 'MISSED'} | {t.rps / m.rps:.2f}x | "
                  f"{t.cpu_ms_per_call / m.cpu_ms_per_call:.2f}x |")
    print()
    print(f"each tether setup against mitmproxy with the sidecar's own addon set ({CORE}): what tether's")
    print("enforcement, tracking, reporting (and capture) cost by themselves, with the same mitmproxy under them:")
    print()
    print("| setup | scheme | clients | p50 ratio | p99 delta ms | CPU/call ratio |")
    print("|---|---|---:|---:|---:|---:|")
    for name in names:
        for scheme, conc, figures, _ in rows:
            t, m = figures[name], figures[CORE]
            print(f"| {name} | {scheme} | {conc} | {t.pct(0.5) / m.pct(0.5):.2f}x | "
                  f"{t.pct(0.99) - m.pct(0.99):+.2f} | {t.cpu_ms_per_call / m.cpu_ms_per_call:.2f}x |")
    print()
    print("| process (idle) | RSS after start MiB | RSS after benchmark MiB | calls through it meanwhile |")
    print("|---|---:|---:|---:|")
    for name in rss_start:
        through = (calls or {}).get(name)
        print(f"| {name} | {rss_start[name]:.1f} | {rss_end[name]:.1f} | {through if through is not None else '-'} |")
    for name in names:
        key = f"{name} sidecar"
        print(f"| {key} / mitmdump | {rss_start[key] / rss_start['bare mitmdump']:.2f}x | "
              f"{rss_end[key] / rss_end['bare mitmdump']:.2f}x | |")
    print()
    for name, (sent, delivered, unique, by_resolution) in delivery.items():
        print(f"reports, {name}: {sent} calls sent through the sidecar (warm-up included); the control plane holds "
              f"{delivered} reports ({unique} distinct call ids): "
              + ", ".join(f"{k} {v}" for k, v in sorted(by_resolution.items()))
              + (" -- all arrived" if unique == sent else f" -- {sent - unique} MISSING"))
    for name, (ok50, ok99) in verdict.items():
        print(f"verdict, {name}: p50 target {'met' if ok50 else 'MISSED'}; p99 target {'met' if ok99 else 'MISSED'}")
    print(f"elapsed {elapsed:.0f} s; load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
