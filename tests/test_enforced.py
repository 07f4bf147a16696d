"""``tether run``'s default is enforced, without root: whatever client the command uses, its only way out is its
sidecar.

Run by an unprivileged user (the test creates one when it runs as root; otherwise it is the user running the
tests), ``tether run`` encloses a script in user, network, mount and PID namespaces (tether/proxy/rootless.py). The
script first deletes every CA variable from its own environment, then tries each client to a granted and an
ungranted server, by HTTP and HTTPS, on the host's loopback: Python's urllib, aiohttp's default session (which
ignores proxy variables) and its websockets, the ``websockets`` library, ``curl --noproxy '*'``, a raw socket, Node's
built-in ``fetch`` (no CA variable either), Java's HttpClient, IPv6 loopback by address, a stdio MCP server that
the official Python SDK starts with its minimal environment and that fetches over HTTPS with httpx (certifi's
bundle), and an SDK MCP server on loopback behind the SDK's DNS-rebinding guard. The upstreams count every
connection they get: an ungranted one must get none. The script also reports its environment, every file it can
read under its own directory, its view of /proc, and whether it can change its namespace's rules or lift a cover.

Skipped, with the reason printed, where the kernel forbids unprivileged user namespaces or a tool is missing.
When the tests run as root, the directories on the way to the venv's interpreter are made traversable (o+x) for
the test's user while the test runs, and put back after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import ssl
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tether.capability import keys

from .harness import ADMIN_TOKEN, PYTHON, ControlPlaneProcess, McpServer, ToolServer, make_test_ca
from .test_isolate import Counting

USER = "tether-enforced"
REPO = Path(__file__).resolve().parents[1]

AGENT = r'''
import asyncio, json, os, socket, ssl, subprocess, sys
cfg = json.loads(sys.argv[1])
for name in ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"):
    os.environ.pop(name, None)  # from here on, every client trusts what the system's stores hold
out = {}

def verdict(status, headers, body):
    err = headers.get("tether-error") or headers.get("Tether-Error")
    return f"{status} {err or body[:40]}"

def urllib_get(url):
    import urllib.error, urllib.request
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return verdict(r.status, r.headers, r.read().decode())
    except urllib.error.HTTPError as e:
        return verdict(e.code, e.headers, "")
    except Exception as e:
        return f"error {type(e).__name__}"

async def aiohttp_get(url):
    import aiohttp
    try:
        async with aiohttp.ClientSession() as s:  # trust_env=False: no proxy variable is read
            async with s.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
                return verdict(r.status, r.headers, await r.text())
    except Exception as e:
        return f"error {type(e).__name__}"

def curl(url):
    done = subprocess.run(["curl", "--noproxy", "*", "-s", "-m", "10", "-D", "/dev/stderr", "-w", "\n%{http_code}",
                           url], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if not lines or lines[-1] == "000":
        return f"error curl {done.returncode}"
    err = [l.split(":", 1)[1].strip() for l in done.stderr.splitlines() if l.lower().startswith("tether-error")]
    return f"{lines[-1]} {err[0] if err else lines[0][:40]}"

def raw(port):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(f"GET /x HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        headers = dict(l.decode().split(": ", 1) for l in head.split(b"\r\n")[1:] if b": " in l)
        return verdict(int(head.split()[1]), {k.lower(): v for k, v in headers.items()}, body.decode())
    except Exception as e:
        return f"error {type(e).__name__}"

def node(url):
    js = ("fetch(process.argv[1]).then(async r => console.log(r.status + ' ' + (r.headers.get('tether-error') || "
          "(await r.text()).slice(0, 40)))).catch(e => console.log('error ' + (e.cause && e.cause.code || e.name)))")
    # no NODE_EXTRA_CA_CERTS here either (Node trusts only its bundled roots and that variable): the enclosure's
    # node sets it itself when it is missing
    return subprocess.run(["node", "-e", js, url], capture_output=True, text=True, timeout=30).stdout.strip()

async def websocket(url):
    import aiohttp
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(url, timeout=aiohttp.ClientWSTimeout(ws_close=5)) as ws:
            await ws.send_str("hi")
            return (await ws.receive(timeout=10)).data
    except aiohttp.WSServerHandshakeError as e:
        return f"{e.status} {e.headers.get('Tether-Error') if e.headers else None}"
    except Exception as e:
        return f"error {type(e).__name__}"

def websockets_client(url):
    from websockets.sync.client import connect
    try:
        with connect(url, open_timeout=10, proxy=None) as ws:
            ws.send("hey")
            return ws.recv(timeout=10)
    except Exception as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        headers = getattr(getattr(e, "response", None), "headers", {}) or {}
        return f"{status} {headers.get('Tether-Error')}" if status else f"error {type(e).__name__}"

def java(url):
    if not cfg["java"]:
        return "skipped: no java"
    done = subprocess.run(["java", cfg["java"], url], capture_output=True, text=True, timeout=90)
    return done.stdout.strip() or f"error {done.stderr.strip()[-200:]}"

async def stdio_fetch(urls):
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client
    params = StdioServerParameters(command=sys.executable, args=[cfg["stdio_server"]])  # the SDK's minimal env
    async with stdio_client(params) as (r, w), ClientSession(r, w) as session:
        await session.initialize()
        return [(await session.call_tool("fetch", {"url": u})).content[0].text for u in urls]

async def guarded_mcp(url):
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    async with streamable_http_client(url) as (r, w, *_), ClientSession(r, w) as session:
        await session.initialize()
        listed = sorted(t.name for t in (await session.list_tools()).tools)
        added = (await session.call_tool("add", {"a": 2, "b": 3})).content[0].text
        try:
            hidden = await session.call_tool("delete_everything", {})
            hidden = "error" if hidden.isError else "called"
        except Exception as e:
            hidden = f"error {type(e).__name__}"
        return {"listed": listed, "add": added, "delete_everything": hidden}

for dest, ports in (("granted", cfg["granted"]), ("ungranted", cfg["other"])):
    for scheme, port in zip(("http", "https"), ports):
        host = "127.0.0.1" if scheme == "http" else "localhost"
        url = f"{scheme}://{host}:{port}/x"
        out[f"urllib {dest} {scheme}"] = urllib_get(url)
        out[f"aiohttp {dest} {scheme}"] = asyncio.run(aiohttp_get(url))
        out[f"curl {dest} {scheme}"] = curl(url)
        out[f"node {dest} {scheme}"] = node(url)
    out[f"java {dest} https"] = java(f"https://localhost:{ports[1]}/x")  # its trust store is cacerts, not PEM
    out[f"raw {dest}"] = raw(ports[0])
out["controlplane"] = [urllib_get(f"http://{h}:{cfg['cp']}/healthz") for h in ("127.0.0.1", "localhost")]
out["ws granted"] = asyncio.run(websocket(f"ws://127.0.0.1:{cfg['ws']}/ws"))  # ignores proxy variables
out["ws ungranted"] = asyncio.run(websocket(f"ws://127.0.0.1:{cfg['ws']}/ws-plain"))
out["websockets granted"] = websockets_client(f"ws://127.0.0.1:{cfg['ws']}/ws")
out["websockets ungranted"] = websockets_client(f"ws://127.0.0.1:{cfg['ws']}/ws-plain")
out["v6 granted"] = urllib_get(f"http://[::1]:{cfg['v6']}/x")  # the host's IPv6 loopback, by its address
out["v6 ungranted"] = urllib_get(f"http://[::1]:{cfg['v6']}/y")  # a path no capability names
out["stdio"] = asyncio.run(stdio_fetch([f"https://localhost:{cfg['granted'][1]}/x",
                                        f"https://localhost:{cfg['other'][1]}/x"]))
try:
    out["guarded mcp"] = asyncio.run(guarded_mcp(cfg["mcp"]))
except Exception as e:
    out["guarded mcp"] = f"error {type(e).__name__}: {e}"

files = {}
for root, dirs, names in os.walk(cfg["home"]):
    for name in names:
        path = os.path.join(root, name)
        try:
            with open(path, "rb") as f:
                files[path] = f.read(1 << 16).decode(errors="replace")
        except OSError as e:
            files[path] = f"unreadable {type(e).__name__}"
out["files"] = files
out["env"] = dict(os.environ)
out["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
out["uid"] = os.getuid()
out["iptables"] = subprocess.run(["iptables", "-w", "-t", "nat", "-F"], capture_output=True).returncode
out["umount"] = subprocess.run(["umount", cfg["key"]], capture_output=True).returncode
print("RESULT " + json.dumps(out), flush=True)
'''

JAVA_CLIENT = r'''
import java.net.URI;
import java.net.http.*;

public class Get {
    public static void main(String[] args) throws Exception {
        HttpClient client = HttpClient.newBuilder().proxy(HttpClient.Builder.NO_PROXY).build();
        try {
            HttpResponse<String> r = client.send(HttpRequest.newBuilder(URI.create(args[0])).build(),
                                                 HttpResponse.BodyHandlers.ofString());
            String body = r.body();
            System.out.println(r.statusCode() + " " + r.headers().firstValue("tether-error")
                .orElse(body.substring(0, Math.min(40, body.length()))));
        } catch (Exception e) {
            System.out.println("error " + e.getClass().getSimpleName());
        }
    }
}
'''

STDIO_SERVER = r'''
import httpx
from mcp.server.mcpserver import MCPServer

server = MCPServer("fetcher")

@server.tool()
def fetch(url: str) -> str:
    """Fetch a URL (the way fetch servers do: httpx, certifi's bundle, no proxy settings)."""
    try:
        r = httpx.get(url, timeout=10)
        return f"{r.status_code} {r.headers.get('tether-error') or r.text[:40]}"
    except Exception as e:
        return f"error {type(e).__name__}"

server.run()
'''


def _unavailable(user: pwd.struct_passwd | None) -> str | None:
    missing = [t for t in ("ip", "iptables", "curl", "node", "setpriv", "unshare") if shutil.which(t) is None]
    if sys.platform != "linux" or missing:
        return f"needs Linux and {', '.join(missing)}"
    probe = ["unshare", "--user", "--map-root-user", "--net", "--mount", "true"]
    if user is not None:
        probe = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *probe]
    done = subprocess.run(probe, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"the kernel refuses unprivileged user namespaces here: {done.stderr.strip()}"
    return None


@contextlib.contextmanager
def _traversable(paths: list[Path]) -> Iterator[None]:
    """o+x on every directory on the way to ``paths`` that lacks it, for as long as the block runs."""
    changed: list[tuple[Path, int]] = []
    try:
        for path in paths:
            for d in reversed(path.resolve().parents):
                mode = d.stat().st_mode
                if not mode & stat.S_IXOTH:
                    changed.append((d, stat.S_IMODE(mode)))
                    os.chmod(d, stat.S_IMODE(mode) | stat.S_IXOTH)
        yield
    finally:
        for d, mode in reversed(changed):
            os.chmod(d, mode)


@pytest.fixture
def enforced_world(tmp_path: Path) -> Iterator[dict[str, Any]]:
    user = None
    if os.geteuid() == 0:
        with contextlib.suppress(KeyError):
            user = pwd.getpwnam(USER)
        if user is None:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
                           check=True, capture_output=True)
            user = pwd.getpwnam(USER)
    reason = _unavailable(user)
    if reason:
        print(f"SKIP test_enforced: {reason}")
        pytest.skip(reason)
    home = Path(tempfile.mkdtemp(prefix="tether-enforced-", dir="/tmp"))
    test_ca = make_test_ca(tmp_path / "ca", ["localhost"])
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(test_ca.cert_pem, test_ca.key_pem)
    servers = {"granted": (Counting("granted"), Counting("granted-tls", tls)),
               "other": (Counting("other"), Counting("other-tls", tls))}
    mcp = McpServer(guarded=True).start()  # behind the SDK's DNS-rebinding guard
    ws = ToolServer().start()
    v6 = Counting("granted-v6", host="::1")
    cp = ControlPlaneProcess(tmp_path / "cp")
    cp.directory.mkdir(parents=True)
    g = servers["granted"]
    cp.catalog_path.write_text(f"""
capabilities:
  granted.http:  {{http: {{host: 127.0.0.1, port: {g[0].port}, methods: [GET], path: "/*"}}}}
  granted.https: {{http: {{host: localhost, port: {g[1].port}, methods: [GET], path: "/*"}}}}
  guarded.add:   {{mcp: {{url: "http://127.0.0.1:{mcp.port}/mcp", tool: add}}}}
  ws.chat:       {{http: {{host: 127.0.0.1, port: {ws.port}, methods: [GET], path: "/ws", websocket: true}}}}
  ws.plain:      {{http: {{host: 127.0.0.1, port: {ws.port}, methods: [GET], path: "/ws-plain"}}}}
  oops.cp:       {{http: {{host: 127.0.0.1, port: {cp.port}, methods: [GET], path: "/*"}}}}
  v6.read:       {{http: {{host: "[::1]", port: {v6.port}, methods: [GET], path: "/x"}}}}
""")
    cp.signing_key_path.write_bytes(keys.private_pem(keys.generate()))
    cp.start()
    ident = cp.issue("enforced.agent", {"granted.http": "direct", "granted.https": "direct", "guarded.add": "direct",
                                        "ws.chat": "direct", "ws.plain": "direct", "oops.cp": "direct",
                                        "v6.read": "direct"})
    for name in ("chain", "key"):
        shutil.copyfile(getattr(ident, f"{name}_path"), home / name)
    (home / "secret").write_text("file-secret-4b1d9e\n")
    (home / "agent.py").write_text(AGENT)
    (home / "stdio_server.py").write_text(STDIO_SERVER)
    (home / "Get.java").write_text(JAVA_CLIENT)
    shutil.copyfile(test_ca.ca_pem, home / "upstream-ca.pem")
    for path in [home, *home.rglob("*")]:
        if user is not None:
            os.chown(path, user.pw_uid, user.pw_gid)
    os.chmod(home, 0o700)
    os.chmod(home / "key", 0o600)
    os.chmod(home / "secret", 0o600)
    try:
        with _traversable([Path(PYTHON), REPO / "cli"] if user is not None else []):
            yield {"cp": cp, "servers": servers, "mcp": mcp, "home": home, "user": user, "ws": ws, "v6": v6}
    finally:
        cp.stop()
        mcp.stop()
        ws.stop()
        v6.stop()
        for pair in servers.values():
            for server in pair:
                server.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_every_client_is_enforced_without_root_and_the_command_holds_no_authority(
        enforced_world: dict[str, Any]) -> None:
    w = enforced_world
    home: Path = w["home"]
    servers = w["servers"]
    cfg = {"granted": [s.port for s in servers["granted"]], "other": [s.port for s in servers["other"]],
           "mcp": f"http://127.0.0.1:{w['mcp'].port}/mcp", "stdio_server": str(home / "stdio_server.py"),
           "home": str(home), "key": str(home / "key"), "ws": w["ws"].port, "cp": w["cp"].port,
           "v6": w["v6"].port,
           "java": str(home / "Get.java") if shutil.which("java") else None}
    env = {"PATH": f"{Path(PYTHON).parent}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(home),
           "LANG": "C.UTF-8", "TETHER_ADMIN_TOKEN": ADMIN_TOKEN, "TETHER_TOKEN": "operator-token-77c2",
           "RUN_SECRET": "env-secret-0e5a"}
    command = [PYTHON, "-m", "tether", "run", "--controlplane", w["cp"].url, "--chain", str(home / "chain"), "--key",
               str(home / "key"), "--state-dir", str(home / "state"), "--upstream-ca", str(home / "upstream-ca.pem"),
               "--secret", "one=env:RUN_SECRET", "--secret", f"two=file:{home / 'secret'}", "--",
               PYTHON, str(home / "agent.py"), json.dumps(cfg)]
    user = w["user"]
    if user is not None:
        command = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *command]
    done = subprocess.run(command, cwd=home, env=env, capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    out = json.loads(lines[-1].removeprefix("RESULT "))
    print(json.dumps({k: v for k, v in out.items() if k not in ("files", "env")}, indent=1))

    for client in ("urllib", "aiohttp", "curl", "node"):
        assert out[f"{client} granted http"] == "200 granted", (client, out)
        assert out[f"{client} granted https"] == "200 granted-tls", (client, out)
        for scheme in ("http", "https"):
            assert out[f"{client} ungranted {scheme}"] == "403 tether.unknown_destination", (client, scheme, out)
    assert out["raw granted"] == "200 granted" and out["raw ungranted"] == "403 tether.unknown_destination"
    if cfg["java"]:  # Java verifies with its own trust store (cacerts), which shows the CA too
        assert out["java granted https"] == "200 granted-tls", out
        assert out["java ungranted https"] == "403 tether.unknown_destination", out
    assert out["stdio"] == ["200 granted-tls", "403 tether.unknown_destination"], out["stdio"]
    assert out["guarded mcp"]["listed"] == ["add"] and out["guarded mcp"]["add"] == "5", out["guarded mcp"]
    assert out["guarded mcp"]["delete_everything"].startswith("error"), out["guarded mcp"]
    assert w["mcp"].calls == ["add"]
    assert out["ws granted"] == "echo: hi" and out["ws ungranted"] == "403 tether.capability_absent", out
    assert out["websockets granted"] == "echo: hey", out["websockets granted"]
    assert out["websockets ungranted"] == "403 tether.capability_absent", out["websockets ungranted"]
    assert w["ws"].ws_messages == ["hi", "hey"]
    assert out["v6 granted"] == "200 granted-v6" and out["v6 ungranted"] == "403 tether.capability_absent", out
    # the control plane is no tool, even where a catalog names its address (here: oops.cp)
    assert out["controlplane"] == ["403 tether.capability_absent"] * 2, out["controlplane"]
    assert all(s.connections == 0 for s in servers["other"]), "an ungranted server was reached"
    assert servers["granted"][0].connections >= 5 and servers["granted"][1].connections >= 5

    # Nothing of tether's authority is in the command's reach: not in its environment, not in a file it can read.
    needles = [ADMIN_TOKEN, "operator-token-77c2", "env-secret-0e5a", "file-secret-4b1d9e", "PRIVATE KEY"]
    assert not [n for n in needles if n in json.dumps(out["env"])]
    assert not {k for k in out["env"] if k in ("TETHER_ADMIN_TOKEN", "TETHER_TOKEN", "RUN_SECRET", "TETHER_KEY")}
    leaked = {path: n for path, text in out["files"].items() for n in needles if n in text}
    assert not leaked, leaked
    assert out["files"][str(home / "key")] == "" and out["files"][str(home / "secret")] == ""
    assert not [p for p in out["files"] if p.startswith(str(home / "state") + "/")]  # the state root is covered
    assert (home / "state" / "enforced.agent" / "ca" / "mitmproxy-ca.pem").exists()  # (it is there, outside)
    assert out["iptables"] != 0 and out["umount"] != 0  # the rules and covers are not the command's to change
    assert 1 in out["pids"] and len(out["pids"]) < 20  # its own PID namespace: the sidecar is not in sight
    if user is not None:
        assert out["uid"] == user.pw_uid


DELEGATING_AGENT = r'''
import json, os, subprocess, sys
cfg = json.loads(sys.argv[1])
child = ("import sys, urllib.request, urllib.error\n"
         "def get(u):\n"
         "    try:\n"
         "        return urllib.request.urlopen(u, timeout=10).status\n"
         "    except urllib.error.HTTPError as e:\n"
         "        return f'{e.code} {e.headers.get(\"Tether-Error\")}'\n"
         f"print('CHILD', get('http://127.0.0.1:{cfg['granted'][0]}/x'), '|', get('https://localhost:{cfg['granted'][1]}/x'))\n"
         "sys.exit(3)\n")
run = [sys.executable, "-m", "tether", "run", "--parent-chain", os.environ["TETHER_CHAIN"]]
out = {"key": "TETHER_KEY" in os.environ}
done = subprocess.run([*run, "--agent", "enforced.child", "--cap", "granted.http=direct", "--", sys.executable, "-c",
                       child], capture_output=True, text=True, timeout=120)
out["child"] = [done.returncode, [l for l in done.stdout.splitlines() if l.startswith("CHILD")], done.stderr[-600:]]
wider = subprocess.run([*run, "--agent", "enforced.wider", "--cap", "other.cap=direct", "--", "true"],
                       capture_output=True, text=True, timeout=120)
out["wider"] = [wider.returncode, wider.stderr[-400:]]
# the requester's environment and directory are its child command's, never the delegating run's: a PYTHONPATH
# (or working directory) holding a package named like tether's must not run outside the enclosure
evil = os.path.join(cfg["home"], "evil")
os.makedirs(os.path.join(evil, "cli"), exist_ok=True)
with open(os.path.join(evil, "cli", "__init__.py"), "w") as f:
    f.write("import os\n"  # which network namespace the planted code ran in, one line each time
            f"open({os.path.join(cfg['home'], 'evil-ran')!r}, 'a').write(os.readlink('/proc/self/ns/net') + '\\n')\n")
planted = subprocess.run([*run, "--agent", "enforced.planted", "--cap", "granted.http=direct", "--", sys.executable,
                          "-c", "print('PLANTED ok')"], capture_output=True, text=True, timeout=120, cwd=evil,
                         env={**os.environ, "PYTHONPATH": evil})
out["planted"] = [planted.returncode, planted.stdout.strip()[-200:], planted.stderr[-400:]]
secret = subprocess.run([*run, "--agent", "enforced.secret", "--cap", "granted.http=direct", "--secret",
                         f"x=file:{cfg['key']}", "--", "true"], capture_output=True, text=True, timeout=120)
out["secret"] = [secret.returncode, secret.stderr[-400:]]
print("RESULT " + json.dumps(out), flush=True)
'''


def test_an_enforced_command_delegates_to_sub_agents_through_its_tether_run(enforced_world: dict[str, Any]) -> None:
    """It holds no key, yet spawns a sub-agent under ``tether run --parent-chain "$TETHER_CHAIN"``: the enclosing
    run mints the narrower link and runs the child enforced; the child may not widen, nor set a secret."""
    w = enforced_world
    home: Path = w["home"]
    (home / "delegating.py").write_text(DELEGATING_AGENT)
    if w["user"] is not None:
        os.chown(home / "delegating.py", w["user"].pw_uid, w["user"].pw_gid)
    cfg = {"granted": [s.port for s in w["servers"]["granted"]], "key": str(home / "key"), "home": str(home)}
    env = {"PATH": f"{Path(PYTHON).parent}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(home),
           "LANG": "C.UTF-8"}
    command = [PYTHON, "-m", "tether", "run", "--controlplane", w["cp"].url, "--chain", str(home / "chain"), "--key",
               str(home / "key"), "--state-dir", str(home / "state"), "--upstream-ca", str(home / "upstream-ca.pem"),
               "--", PYTHON, str(home / "delegating.py"), json.dumps(cfg)]
    if w["user"] is not None:
        command = ["setpriv", f"--reuid={w['user'].pw_uid}", f"--regid={w['user'].pw_gid}", "--clear-groups", *command]
    done = subprocess.run(command, cwd=home, env=env, capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["key"] is False
    code, printed, stderr = out["child"]
    assert code == 3, out["child"]  # the child's own exit status, relayed
    assert printed == ["CHILD 200 | 403 tether.capability_absent"], out["child"]  # its grant, not its parent's
    assert "enforced.child runs enforced" in stderr
    assert out["wider"][0] == 2 and "other.cap" in out["wider"][1], out["wider"]
    assert out["secret"][0] == 2 and "--secret" in out["secret"][1] and "tether.bad_request" in out["secret"][1]
    assert out["planted"][0] == 0 and "PLANTED ok" in out["planted"][1], out["planted"]
    # Inside the enclosure the requester's own processes may run what they like (the stub did); outside, where
    # the delegating run holds the key, nothing of it may run.
    ran = (home / "evil-ran").read_text().split() if (home / "evil-ran").exists() else []
    assert os.readlink("/proc/self/ns/net") not in ran, f"the planted package ran outside the enclosure: {ran}"
    agents = w["cp"].client().request("GET", "/v1/agents")["agents"]
    child = next(a for a in agents if a["agent"] == "enforced.child")
    assert child["issuer"] == "enforced.agent" and child["caps"] == {"granted.http": "direct"}
    assert not [a for a in agents if a["agent"] in ("enforced.wider", "enforced.secret")]
