"""``tether run --user`` (root): programs that ignore proxy variables are enforced like those that follow them.

The plan is pure data (rules, addresses) and is checked as such. Then, in a real kernel (root, ``ip netns``,
iptables; skipped with the reason where not permitted): ``tether run --user nobody`` runs a script as ``nobody``
in its namespace, and the script tries Node's built-in ``fetch``, ``curl --noproxy '*'`` and a Python raw
socket, each to a granted and an ungranted destination over HTTP and HTTPS, plus a raw non-HTTP stream and
DNS to an outside resolver, and reads the sidecar's key, CA key and secret. The sidecar resolves the tools'
names through a private ``/etc/hosts`` (``unshare --mount``): the host's own files are never touched.
"""

from __future__ import annotations

import http.server
import ipaddress
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether.capability import keys
from tether.proxy.isolate import Plan, User, readable_by

from .harness import PYTHON, ControlPlaneProcess, free_port, make_test_ca

SUBNET = ipaddress.ip_network("100.64.8.0/30")


# -- the plan as data -------------------------------------------------------------------------------------------
def test_plan_redirects_tcp_and_dns_from_the_veth_only_and_drops_the_rest() -> None:
    plan = Plan("abc123", SUBNET)
    rules = [" ".join(r) for r in plan.rules()]
    assert plan.host_ip == "100.64.8.1" and plan.ns_ip == "100.64.8.2"
    assert "-t nat -A TETHER_ISO_abc123 -p tcp -j REDIRECT --to-ports 15001" in rules
    assert "-t nat -A TETHER_ISO_abc123 -p udp -d 100.64.8.1 --dport 53 -j REDIRECT --to-ports 15053" in rules
    assert rules.index("-t filter -A TETHER_ISO_abc123 -j DROP") > max(
        i for i, r in enumerate(rules) if r.startswith("-t filter -A TETHER_ISO_abc123") and "ACCEPT" in r)
    # jumps only for the veth, and nothing is routed to or from it
    assert "-t filter -I INPUT 1 -i tthabc123 -j TETHER_ISO_abc123" in rules
    assert "-t filter -I FORWARD 1 -i tthabc123 -j DROP" in rules
    assert "-t filter -I FORWARD 1 -o tthabc123 -j DROP" in rules
    assert all("-i tthabc123" in r or "-o tthabc123" in r for r in rules if " -I " in r)
    # teardown removes exactly the jumps it inserted
    assert {" ".join(r).replace("-D", "-I").replace("-I INPUT", "-I INPUT 1").replace("-I FORWARD", "-I FORWARD 1")
            .replace("-I PREROUTING", "-I PREROUTING 1") for r in plan.jumps("-D")} == {
        " ".join(r) for r in plan.jumps("-I")}
    assert "nameserver 100.64.8.1" in plan.resolv_conf()
    assert "::1" not in plan.hosts()


def test_root_is_never_the_isolated_user() -> None:
    from tether.proxy.isolate import IsolateError

    with pytest.raises(IsolateError, match="root"):
        User.lookup("root")


def test_readable_by_follows_the_directories(tmp_path: Path) -> None:
    nobody = User("nobody", 65534, 65534, "/")
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(d, 0o755)
    f = d / "key"
    f.write_text("k")
    os.chmod(f, 0o644)
    assert readable_by(f, nobody) or os.stat(tmp_path.parent).st_mode & 0o001 == 0
    os.chmod(f, 0o600)
    assert not readable_by(f, nobody)
    os.chmod(f, 0o644)
    os.chmod(d, 0o700)
    assert not readable_by(f, nobody)


# -- in a real kernel -------------------------------------------------------------------------------------------
def _isolations(text: str) -> list[str]:
    """The namespace tags ``tether run --isolate`` reported (``isolated in tether-TAG``)."""
    return [word.removeprefix("tether-") for word in text.replace(" as ", " ").split() if word.startswith("tether-")
            and len(word) == 13]


def _not_permitted() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux (network namespaces, iptables, setpriv)"
    missing = [t for t in ("ip", "iptables", "setpriv", "unshare", "curl", "node", "sysctl") if not shutil.which(t)]
    if missing:
        return f"needs {', '.join(missing)}"
    probe = subprocess.run(["ip", "netns", "add", "tether-probe-perm"], capture_output=True, text=True, check=False)
    subprocess.run(["ip", "netns", "del", "tether-probe-perm"], capture_output=True, check=False)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    if subprocess.run(["iptables", "-w", "-S", "INPUT"], capture_output=True, check=False).returncode != 0:
        return "iptables cannot be used here"
    return None


class Counting:
    """HTTP (or HTTPS) on 127.0.0.1 answering its banner; counts every connection that reached it."""

    def __init__(self, banner: str, tls: ssl.SSLContext | None = None, host: str = "127.0.0.1") -> None:
        self.port = free_port()
        self.connections = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = banner.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

            def get_request(self) -> tuple[socket.socket, object]:
                conn, addr = super().get_request()
                outer.connections += 1
                if tls is not None:
                    conn = tls.wrap_socket(conn, server_side=True)
                return conn, addr

        self.server = Server((host, self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()


AGENT = r"""
import json, os, socket, ssl, subprocess, sys
cfg = json.loads(sys.argv[1])
out = {}
sidecar_ip = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")][0]

def raw_http(name, port, tls):
    try:
        s = socket.create_connection((name, port), timeout=8)
        if tls:
            s = ssl.create_default_context().wrap_socket(s, server_hostname=name)
        s.sendall(f"GET /x HTTP/1.1\r\nHost: {name}:{port}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        err = [l.split(b":", 1)[1].strip().decode() for l in head.split(b"\r\n")
               if l.lower().startswith(b"tether-error")]
        return f"{head.split()[1].decode()} {err[0] if err else body.decode()[:40]}"
    except Exception as exc:
        return f"error {type(exc).__name__}"

def curl(url):
    done = subprocess.run(["curl", "--noproxy", "*", "-s", "-m", "8", "-o", "/dev/stdout", "-D", "/dev/stderr",
                           "-w", "\n%{http_code}", url], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    err = [l.split(":", 1)[1].strip() for l in done.stderr.splitlines() if l.lower().startswith("tether-error")]
    if not lines or lines[-1] == "000":
        return f"error curl {done.returncode}"
    return f"{lines[-1]} {err[0] if err else lines[0][:40]}"

def node(url):
    js = ("fetch(process.argv[1]).then(async r => console.log(r.status + ' ' + (r.headers.get('tether-error') || "
          "(await r.text()).slice(0, 40)))).catch(e => console.log('error ' + (e.cause && e.cause.code || e.name)))")
    done = subprocess.run(["node", "-e", js, url], capture_output=True, text=True, timeout=20)
    return done.stdout.strip() or ("error " + done.stderr.strip()[-80:])

for dest, host, port in (("granted", "granted.test", cfg["granted"]), ("ungranted", "other.test", cfg["other"])):
    for scheme, p in (("http", port[0]), ("https", port[1])):
        url = f"{scheme}://{host}:{p}/x"
        out[f"raw {dest} {scheme}"] = raw_http(host, p, scheme == "https")
        out[f"curl {dest} {scheme}"] = curl(url)
        out[f"node {dest} {scheme}"] = node(url)

# by address, around any name: the ungranted server's port on the host end
out["raw ip ungranted http"] = raw_http(sidecar_ip, cfg["other"][0], False)
try:  # not HTTP at all
    s = socket.create_connection((sidecar_ip, cfg["other"][0]), timeout=5)
    s.sendall(b"\x00\x01SSH-2.0-raw\r\n")
    s.settimeout(5)
    out["raw non-http"] = "answered " + repr(s.recv(100)[:20])
except Exception as exc:
    out["raw non-http"] = f"error {type(exc).__name__}"
try:  # DNS to an outside resolver
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(2)
    query = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03com\x00\x00\x01\x00\x01"
    u.sendto(query, ("192.0.2.53", 53))
    out["dns outside"] = "answered " + repr(u.recv(512)[:4])
except Exception as exc:
    out["dns outside"] = f"error {type(exc).__name__}"
for name, path in cfg["secret_files"].items():
    try:
        open(path, "rb").read(1)
        out[f"read {name}"] = "readable"
    except Exception as exc:
        out[f"read {name}"] = f"error {type(exc).__name__}"
out["uid"] = os.getuid()
out["proxy env"] = [k for k in os.environ if k.lower().endswith("_proxy") and os.environ[k]]
out["secret env"] = os.environ.get("ISO_SECRET")
print("RESULT " + json.dumps(out))
"""


@pytest.fixture
def iso_world(tmp_path: Path) -> Iterator[dict]:
    reason = _not_permitted()
    if reason:
        print(f"SKIP test_isolate: {reason}")
        pytest.skip(reason)
    public = Path(tempfile.mkdtemp(prefix="tether-isotest-", dir="/tmp"))
    os.chmod(public, 0o755)
    test_ca = make_test_ca(tmp_path, ["granted.test", "other.test"])
    ca, cert, key = test_ca.ca_pem, test_ca.cert_pem, test_ca.key_pem
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    servers = {"granted": (Counting("granted"), Counting("granted-tls", tls)),
               "other": (Counting("other", host="0.0.0.0"), Counting("other-tls", tls))}
    cp = ControlPlaneProcess(tmp_path / "cp")
    cp.directory.mkdir(parents=True)
    g = servers["granted"]
    cp.catalog_path.write_text(f"""
credentials:
  tool: {{header: Authorization, format: "Bearer {{secret}}"}}
capabilities:
  granted.http:  {{http: {{host: granted.test, port: {g[0].port}, methods: [GET], path: "/*"}}}}
  granted.https: {{http: {{host: granted.test, port: {g[1].port}, scheme: https, methods: [GET], path: "/*"}},
                  credential: tool}}
""")
    signing = keys.generate()
    cp.signing_key_path.write_bytes(keys.private_pem(signing))
    cp.start()
    (public / "agent.py").write_text(AGENT)
    os.chmod(public / "agent.py", 0o644)
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost granted.test other.test\n")
    secret_file = tmp_path / "secret"
    secret_file.write_text("iso-secret-value\n")
    os.chmod(secret_file, 0o600)
    try:
        yield {"cp": cp, "servers": servers, "public": public, "ca": ca, "hosts": hosts, "secret": secret_file,
               "tmp": tmp_path}
    finally:
        cp.stop()
        for pair in servers.values():
            for s in pair:
                s.stop()
        shutil.rmtree(public, ignore_errors=True)


def test_isolated_command_is_enforced_whatever_transport_it_uses(iso_world: dict) -> None:
    cp: ControlPlaneProcess = iso_world["cp"]
    identity = cp.issue("iso.agent", {"granted.http": "direct", "granted.https": "direct"})
    servers = iso_world["servers"]
    state = iso_world["tmp"] / "state"
    cfg = {"granted": [s.port for s in servers["granted"]], "other": [s.port for s in servers["other"]],
           "secret_files": {"key": str(identity.key_path), "secret": str(iso_world["secret"]),
                            "ca key": str(state / "iso.agent" / "ca" / "mitmproxy-ca.pem")}}
    inner = (f"mount --bind {iso_world['hosts']} /etc/hosts && exec {PYTHON} -m tether run --isolate --user nobody "
             f"--controlplane {cp.url} --chain {identity.chain_path} --key {identity.key_path} "
             f"--state-dir {state} --upstream-ca {iso_world['ca']} --secret tool=file:{iso_world['secret']} "
             f"--secret env=env:ISO_SECRET -- /usr/bin/python3 -I {iso_world['public'] / 'agent.py'} "
             f"'{json.dumps(cfg)}'")
    env = {**cp.env(), "ISO_SECRET": "env-secret", "HTTPS_PROXY": "http://127.0.0.1:9", "PYTHONPATH":
           str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    out = json.loads(lines[-1].removeprefix("RESULT "))
    print(json.dumps(out, indent=1))
    for client in ("raw", "curl", "node"):
        assert out[f"{client} granted http"] == "200 granted", (client, out)
        assert out[f"{client} granted https"] == "200 granted-tls", (client, out)
        for scheme in ("http", "https"):
            assert out[f"{client} ungranted {scheme}"] == "403 tether.unknown_destination", (client, scheme, out)
    assert out["raw ip ungranted http"] == "403 tether.unknown_destination"
    assert out["raw non-http"].startswith("error") or out["raw non-http"] == "answered b''", out
    assert out["dns outside"].startswith("error"), out
    assert out["read key"] == out["read secret"] == out["read ca key"] == "error PermissionError", out
    assert out["uid"] == 65534 and out["proxy env"] == [] and out["secret env"] is None
    assert all(s.connections == 0 for s in servers["other"]), "an ungranted server was reached"
    # the granted servers were reached by the sidecar: 3 clients each (HTTP), 3 (HTTPS)
    assert servers["granted"][0].connections >= 3 and servers["granted"][1].connections >= 3
    # and nothing of the namespace is left behind
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    tags = _isolations(done.stderr)
    assert tags, done.stderr[-1000:]
    assert not [t for t in tags if f"tether-{t}" in netns.split()]
    assert not [t for t in tags if Path(f"/etc/netns/tether-{t}").exists() or Path(f"/tmp/tether-isolate-{t}").exists()]
    assert "TETHER_ISO" not in subprocess.run(["iptables", "-w", "-S"], capture_output=True, text=True).stdout
