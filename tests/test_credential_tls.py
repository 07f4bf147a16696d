"""An injected credential leaves only over TLS verified for its capability's host, to its exact host and port.

The rule (``capability.credentials.route_refusal``) is tested as a pure function and through the catalog's
validation; then end to end with a real control plane, a real sidecar subprocess and raw listeners on the
granted host that log every byte they receive: a genuine TLS server (its certificate from the CA the sidecar
trusts, the positive control), a TLS listener with a certificate from another CA, a plain listener on a port
granted for TLS, and the agent's own listener on another port. The secret must reach the genuine server and
nothing else, whichever way the agent words the request (``http://`` absolute URI to the TLS port, plain HTTP
inside a CONNECT, another port).
"""

from __future__ import annotations

import json
import secrets
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import requests
from mitmproxy.test import taddons, tflow, tutils

from tether.capability.catalog import parse_catalog
from tether.capability.credentials import Credential, Leaving, Route, route_refusal
from tether.capability.errors import CatalogError
from tether.proxy.credentials import CredentialRoutes
from tether.proxy.flowstate import state_of
from tether.proxy.state import Call

from .harness import ControlPlaneProcess, SidecarProcess, TestCA, make_test_ca, reports_for, wait_until

SECRET = "tls-secret-" + secrets.token_hex(16)
LOOP_SECRET = "loop-secret-" + secrets.token_hex(16)
REQUIRES_TLS = "tether.credential_requires_tls"


# -- the rule, pure --------------------------------------------------------------------------------------------
KEY = Credential("key")
LOOP = Credential("loop", insecure_plain_http="loopback")
TLS_ROUTE = Route("https", "api.example", 443)


def leaving(scheme: str = "https", host: str = "api.example", port: int = 443, sni: str | None = "api.example",
            verified: bool = True) -> Leaving:
    return Leaving(scheme=scheme, host=host, port=port, sni=sni, verified=verified)


def test_a_credential_goes_only_over_verified_tls_to_its_exact_host_and_port() -> None:
    assert route_refusal(TLS_ROUTE, KEY, leaving()) is None
    refusals = {
        "plain http to the TLS port": leaving(scheme="http"),
        "another port": leaving(port=8443),
        "another host": leaving(host="api.example.evil", sni="api.example.evil"),
        "certificates not verified": leaving(verified=False),
        "verified for another name": leaving(sni="other.example"),
        "no server name to verify": leaving(sni=None),
    }
    for what, how in refusals.items():
        assert route_refusal(TLS_ROUTE, KEY, how), what


def test_plain_http_only_to_loopback_and_only_by_the_credentials_opt_in() -> None:
    loop = Route("http", "127.0.0.1", 8080)
    plain = leaving(scheme="http", host="127.0.0.1", port=8080, sni=None)
    assert route_refusal(loop, LOOP, plain) is None
    assert route_refusal(loop, KEY, plain)  # no opt-in
    assert route_refusal(Route("http", "tools.internal", 8080), LOOP, leaving(
        scheme="http", host="tools.internal", port=8080, sni=None))  # opted in, but not loopback
    assert route_refusal(loop, LOOP, leaving(scheme="https", host="127.0.0.1", port=8080, sni="127.0.0.1"))
    assert route_refusal(loop, LOOP, leaving(scheme="http", host="127.0.0.1", port=8081, sni=None))


# -- the catalog -----------------------------------------------------------------------------------------------
BASE = """
credentials:
  key: {header: Authorization, format: "Bearer {secret}"}
  loop: {header: Authorization, format: "Bearer {secret}", insecure_plain_http: loopback}
capabilities:
"""


def refused(caps: str) -> str:
    with pytest.raises(CatalogError) as info:
        parse_catalog(BASE + caps, "c.yaml")
    return info.value.message


def test_catalog_refuses_a_credentialed_capability_without_its_port_and_scheme_naming_it() -> None:
    no_port = refused('  gh.read: {http: {host: api.github.com, scheme: https, methods: [GET], path: "/*"}, '
                      'credential: key}\n')
    no_scheme = refused('  gh.read: {http: {host: api.github.com, port: 443, methods: [GET], path: "/*"}, '
                        'credential: key}\n')
    for message in (no_port, no_scheme):
        assert "capability 'gh.read'.http" in message and "scheme and port" in message
    ok = parse_catalog(BASE + '  gh.read: {http: {host: api.github.com, port: 443, scheme: https, methods: [GET], '
                       'path: "/*"}, credential: key}\n')
    assert str(ok.route_of("gh.read")) == "https://api.github.com:443"
    # a capability without a credential needs neither (and keeps the hash it had)
    parse_catalog(BASE + '  open: {http: {host: api.github.com, methods: [GET], path: "/*"}}\n')


def test_catalog_allows_plain_http_only_behind_the_loopback_opt_in() -> None:
    plain = '  t.read: {http: {host: HOST, port: 8080, scheme: http, methods: [GET], path: "/*"}, credential: CRED}\n'
    assert "insecure_plain_http: loopback" in refused(plain.replace("HOST", "127.0.0.1").replace("CRED", "key"))
    assert "loopback only" in refused(plain.replace("HOST", "tools.internal").replace("CRED", "loop"))
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "'[::1]'"):
        parse_catalog(BASE + plain.replace("HOST", host).replace("CRED", "loop"))
    # MCP servers: the URL names the scheme (and the port, or its default)
    mcp = '  m.add: {mcp: {url: "URL", tool: add}, credential: CRED}\n'
    assert "capability 'm.add'.mcp" in refused(mcp.replace("URL", "http://mcp.internal:8000/mcp")
                                              .replace("CRED", "loop"))
    assert "plain http" in refused(mcp.replace("URL", "http://127.0.0.1:8000/mcp").replace("CRED", "key"))
    assert str(parse_catalog(BASE + mcp.replace("URL", "https://mcp.internal/mcp").replace("CRED", "key"))
               .route_of("m.add")) == "https://mcp.internal:443"
    with pytest.raises(CatalogError, match="the only value is 'loopback'"):
        parse_catalog(BASE.replace("insecure_plain_http: loopback", "insecure_plain_http: true")
                      + '  o: {http: {host: a.b, methods: [GET], path: "/*"}}\n')


async def test_the_route_check_reads_mitmproxys_upstream_verification_option() -> None:
    catalog = parse_catalog(BASE + '  gh.read: {http: {host: api.github.com, port: 443, scheme: https, '
                            'methods: [GET], path: "/*"}, credential: key}\n')
    guard = CredentialRoutes(catalog)

    def flow(**options: object) -> str | None:
        f = tflow.tflow(req=tutils.treq(scheme=b"https", host="api.github.com", port=443, path=b"/x"))
        f.server_conn.address, f.server_conn.sni = ("api.github.com", 443), "api.github.com"
        state_of(f).call = Call(call_id="c", agent="a", method="GET", url=f.request.url, started_at=0.0,
                                capability="gh.read")
        with taddons.context() as tctx:
            tctx.options.update(**options)
            guard.requestheaders(f)
        return f.response.headers.get("Tether-Error") if f.response else None

    assert flow() is None
    assert flow(ssl_insecure=True) == REQUIRES_TLS


async def test_a_capability_that_names_its_scheme_is_reached_over_it_only() -> None:
    catalog = parse_catalog('capabilities:\n  s.read: {http: {host: a.example, port: 8443, scheme: https, '
                            'methods: [GET], path: "/*"}}\n')
    guard = CredentialRoutes(catalog)
    for scheme, refused_with in ((b"https", None), (b"http", "tether.capability_absent")):
        f = tflow.tflow(req=tutils.treq(scheme=scheme, host="a.example", port=8443, path=b"/x"))
        state_of(f).call = Call(call_id="c", agent="a", method="GET", url=f.request.url, started_at=0.0,
                                capability="s.read")
        with taddons.context():
            guard.request(f)
        assert (f.response.headers.get("Tether-Error") if f.response else None) == refused_with
        if f.response:
            assert json.loads(f.response.content)["error"]["reason"] == "scheme"


# -- end to end ------------------------------------------------------------------------------------------------
class Listener:
    """A TCP listener on 127.0.0.1 that logs every byte it receives (decrypted, for TLS) and answers 200."""

    def __init__(self, tls: TestCA | None = None) -> None:
        self.context = tls.server_context() if tls is not None else None
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.connections = 0
        self.handshake_failures = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self.connections += 1
        conn.settimeout(5)
        try:
            if self.context is not None:
                try:
                    conn = self.context.wrap_socket(conn, server_side=True)
                except (ssl.SSLError, OSError):
                    with self._lock:
                        self.handshake_failures += 1
                    return
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
                if data[:1] == b"\x16":  # a TLS handshake sent to a plain listener: nothing more will come
                    break
            with self._lock:
                self.received += data
            if b"\r\n\r\n" in data:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        except OSError:
            pass
        finally:
            conn.close()

    def saw(self, value: str) -> bool:
        with self._lock:
            return value.encode() in self.received

    def stop(self) -> None:
        self.sock.close()


@dataclass
class World:
    sidecar: SidecarProcess
    genuine: Listener  # TLS, certificate from the trusted CA: the only one that may see the secret
    impostor: Listener  # TLS, certificate from another CA, on a port granted with the credential
    plain: Listener  # plain, on a port granted with the credential over TLS
    loop: Listener  # plain, granted with the loopback opt-in (a second positive control)
    agent: Listener  # the agent's own listener on a port the catalog does not name

    @property
    def listeners(self) -> dict[str, Listener]:
        return {"genuine": self.genuine, "impostor": self.impostor, "plain": self.plain, "loop": self.loop,
                "agent": self.agent}


CATALOG = """
credentials:
  key:  {{header: Authorization, format: "Bearer {{secret}}"}}
  loop: {{header: X-Loop-Key, format: "{{secret}}", insecure_plain_http: loopback}}
capabilities:
  genuine.read:  {{http: {{host: 127.0.0.1, port: {genuine}, scheme: https, methods: [GET], path: "/g*"}},
                  credential: key}}
  impostor.read: {{http: {{host: 127.0.0.1, port: {impostor}, scheme: https, methods: [GET], path: "/i*"}},
                  credential: key}}
  plain.read:    {{http: {{host: 127.0.0.1, port: {plain}, scheme: https, methods: [GET], path: "/p*"}},
                  credential: key}}
  loop.read:     {{http: {{host: 127.0.0.1, port: {loop}, scheme: http, methods: [GET], path: "/l*"}},
                  credential: loop}}
  open.read:     {{http: {{host: 127.0.0.1, methods: [GET], path: "/open*"}}}}
"""
CAPS = {c: "direct" for c in ("genuine.read", "impostor.read", "plain.read", "loop.read", "open.read")}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("cred-tls")
    trusted = make_test_ca(root / "trusted", ["localhost"])
    other = make_test_ca(root / "other", ["localhost"])  # a valid-looking certificate for 127.0.0.1, wrong CA
    secret_dir = tmp_path_factory.mktemp("cred-tls-secrets")
    (secret_dir / "key").write_text(SECRET)
    (secret_dir / "loop").write_text(LOOP_SECRET)
    listeners = [Listener(trusted), Listener(other), Listener(), Listener(), Listener()]
    genuine, impostor, plain, loop, agent = listeners
    cp = ControlPlaneProcess(root / "cp")
    cp.directory.mkdir(parents=True)
    cp.catalog_path.write_text(CATALOG.format(genuine=genuine.port, impostor=impostor.port, plain=plain.port,
                                              loop=loop.port))
    from tether.capability import keys

    cp.signing_key_path.write_bytes(keys.private_pem(keys.generate()))
    cp.start()
    identity = cp.issue("cred.tls", CAPS)
    sidecar = SidecarProcess(cp, identity, ["--secret", f"key=file:{secret_dir / 'key'}",
                                            "--secret", f"loop=file:{secret_dir / 'loop'}"])
    sidecar.start(upstream_ca=trusted.ca_pem)
    try:
        yield World(sidecar, genuine, impostor, plain, loop, agent)
    finally:
        sidecar.stop()
        cp.stop()
        for listener in listeners:
            listener.stop()


def get(world: World, url: str) -> requests.Response:
    return requests.get(url, proxies=world.sidecar.proxies(), verify=world.sidecar.ca, timeout=30)


def refusal_code(resp: requests.Response) -> str | None:
    return resp.headers.get("Tether-Error")


def raw_through_connect(world: World, port: int, request: bytes) -> bytes:
    """CONNECT to 127.0.0.1:port through the sidecar, then send ``request`` as plain HTTP inside the tunnel."""
    host, proxy_port = world.sidecar.proxy.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(proxy_port)), timeout=30) as s:
        s.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
        assert head.startswith(b"HTTP/1.1 200"), head
        s.sendall(request)
        answer = b""
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            answer += chunk
            if b"\r\n\r\n" in answer and b"}" in answer.split(b"\r\n\r\n", 1)[1]:
                break
        return answer


def test_the_secret_reaches_the_genuine_tls_server(world: World) -> None:
    resp = get(world, f"https://127.0.0.1:{world.genuine.port}/g/ok")
    assert resp.status_code == 200 and resp.text == "ok", resp.text
    assert world.genuine.saw(f"Authorization: Bearer {SECRET}")  # the positive control for every grep below
    # the loopback opt-in: plain http, to its exact port only
    resp = get(world, f"http://127.0.0.1:{world.loop.port}/l/ok")
    assert resp.status_code == 200, resp.text
    assert world.loop.saw(LOOP_SECRET)


def test_a_tls_listener_with_an_untrusted_certificate_never_gets_the_secret(world: World) -> None:
    resp = get(world, f"https://127.0.0.1:{world.impostor.port}/i/steal")
    assert resp.status_code == 502, resp.text  # the upstream handshake failed: nothing was sent
    wait_until(lambda: world.impostor.handshake_failures >= 1, 15, what="the impostor's failed handshake")
    assert not world.impostor.saw(SECRET) and not world.impostor.received


def test_http_absolute_uri_to_the_tls_port_is_refused_before_a_byte_leaves(world: World) -> None:
    for listener, path in ((world.plain, "/p/steal"), (world.genuine, "/g/steal")):
        before = listener.connections
        resp = get(world, f"http://127.0.0.1:{listener.port}{path}")
        assert resp.status_code == 403 and refusal_code(resp) == REQUIRES_TLS, resp.text
        error = resp.json()["error"]
        assert error["credential"] == "key" and error["destination"] == f"https://127.0.0.1:{listener.port}"
        assert listener.connections == before  # not even a connection was opened
    assert not world.plain.saw(SECRET)


def test_plain_http_inside_a_connect_to_the_tls_port_is_refused(world: World) -> None:
    before = world.plain.connections
    answer = raw_through_connect(world, world.plain.port, f"GET /p/steal HTTP/1.1\r\nHost: 127.0.0.1:"
                                 f"{world.plain.port}\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 403") and REQUIRES_TLS.encode() in answer, answer[:400]
    assert world.plain.connections == before and not world.plain.saw(SECRET)


def test_https_to_a_plain_listener_on_the_granted_port_never_carries_the_secret(world: World) -> None:
    resp = get(world, f"https://127.0.0.1:{world.plain.port}/p/steal")
    assert resp.status_code == 502, resp.text
    assert not world.plain.saw(SECRET)
    # and the loopback route is plain http only: TLS to it is refused as another route
    resp = get(world, f"https://127.0.0.1:{world.loop.port}/l/x")
    assert refusal_code(resp) == REQUIRES_TLS, resp.text


def test_the_agents_own_listener_on_another_port_gets_no_secret(world: World) -> None:
    port = world.agent.port
    for url in (f"http://127.0.0.1:{port}/g/steal", f"https://127.0.0.1:{port}/g/steal",
                f"http://127.0.0.1:{port}/l/steal"):
        resp = get(world, url)
        assert resp.status_code == 403, (url, resp.text)  # no capability holds that port
    assert world.agent.connections == 0
    # a port-less capability without a credential reaches it, with nothing injected
    resp = get(world, f"http://127.0.0.1:{port}/open/x")
    assert resp.status_code == 200, resp.text
    assert world.agent.connections == 1
    assert not world.agent.saw(SECRET) and not world.agent.saw(LOOP_SECRET)


def test_zz_only_the_genuine_listeners_saw_a_secret_and_refusals_are_reported(world: World) -> None:
    for name, listener in world.listeners.items():
        assert listener.saw(SECRET) == (name == "genuine"), name
        assert listener.saw(LOOP_SECRET) == (name == "loop"), name
    # every refusal is reported as one, with its code (nothing left: not failed_not_sent, not unknown)

    def refused_urls() -> set[str]:
        return {r["url"] for r in reports_for(world.sidecar.cp, "cred.tls")
                if r["resolution"] == "refused" and r["code"] == REQUIRES_TLS}

    plain, genuine = world.plain.port, world.genuine.port
    wanted = {f"http://127.0.0.1:{plain}/p/steal", f"http://127.0.0.1:{genuine}/g/steal"}
    wait_until(lambda: wanted <= refused_urls(), 30, interval=0.3, what="the refusals' reports")
    # the impostor's certificate failed the connection before the request was written
    impostor = f"https://127.0.0.1:{world.impostor.port}/i/steal"
    resolutions = {r["url"]: r["resolution"] for r in reports_for(world.sidecar.cp, "cred.tls")}
    assert resolutions.get(impostor) == "failed_not_sent", resolutions
    assert SECRET not in world.sidecar.log_text and LOOP_SECRET not in world.sidecar.log_text
