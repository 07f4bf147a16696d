"""Credentials the agent never holds (docs/contract.md section 10), end to end with real processes.

The tool server here speaks plain HTTP on loopback, so every credential says ``insecure_plain_http: loopback``
(tests/test_credential_tls.py covers the TLS rule itself).

A tool server that records every ``Authorization`` it receives and accepts only the injected secret or an
unexpired token; an OAuth2 token endpoint (aiohttp) that counts its token requests and expires its tokens;
a real control plane and real sidecar subprocesses given their secrets with ``--secret``. At the end every
file the world wrote (captures, HAR, spool, reports, logs, the records' store) is searched for the secrets.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from aiohttp import web

from tether.capability.catalog import parse_catalog
from tether.capability.errors import CatalogError
from tether.proxy.credentials import load_secrets, token_times

from .harness import (
    PYTHON,
    ControlPlaneProcess,
    Identity,
    SidecarProcess,
    close_loop,
    free_port,
    wait_until,
)

STATIC = "static-" + secrets.token_hex(16)
APIKEY = "apikey-" + secrets.token_hex(16)
CLIENT_SECRET = "client-" + secrets.token_hex(16)
AGENT_COPY = "agent-copy-" + secrets.token_hex(8)
TOKEN_LIFE = 1.5


@dataclass
class AuthServers:
    """A token endpoint and a tool server on one private loop (two ports)."""

    token_port: int = field(default_factory=free_port)
    tool_port: int = field(default_factory=free_port)
    token_requests: int = 0
    token_failing: bool = False
    issued: dict[str, float] = field(default_factory=dict)  # token -> expiry (time.time())
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (path, credential headers)
    _loop: asyncio.AbstractEventLoop | None = None
    _runners: list[web.AppRunner] = field(default_factory=list)

    def token_app(self) -> web.Application:
        async def token(request: web.Request) -> web.Response:
            self.token_requests += 1
            form = await request.post()
            expected = "Basic " + base64.b64encode(f"tether:{CLIENT_SECRET}".encode()).decode()
            if self.token_failing:
                return web.json_response({"error": "temporarily_unavailable"}, status=503)
            if request.headers.get("Authorization") != expected or form.get("grant_type") != "client_credentials":
                return web.json_response({"error": "invalid_client"}, status=401)
            value = "tok-" + secrets.token_hex(16)
            self.issued[value] = time.time() + TOKEN_LIFE
            return web.json_response({"access_token": value, "token_type": "Bearer", "expires_in": TOKEN_LIFE,
                                      "scope": form.get("scope")})

        app = web.Application()
        app.router.add_post("/token", token)
        return app

    def tool_app(self) -> web.Application:
        def credential_headers(request: web.Request) -> dict[str, str]:
            return {k.lower(): v for k, v in request.headers.items()
                    if k.lower() in ("authorization", "x-api-key", "x-custom-key", "cookie", "proxy-authorization")}

        async def handle(request: web.Request) -> web.Response:
            got = credential_headers(request)
            self.seen.append((request.path, got))
            auth = got.get("authorization", "")
            path = request.path
            if path.startswith("/static"):
                ok = auth == f"Bearer {STATIC}"
            elif path.startswith("/key"):
                ok = got.get("x-custom-key") == APIKEY
            elif path.startswith("/crm"):
                token = auth.removeprefix("Bearer ")
                ok = auth.startswith("Bearer ") and self.issued.get(token, 0) > time.time()
            elif path.startswith("/mcp"):
                ok = auth == f"Bearer {STATIC}"
                if ok:
                    body = await request.json()
                    return web.json_response({"jsonrpc": "2.0", "id": body.get("id"),
                                              "result": {"content": [{"type": "text", "text": "3"}]}})
            else:  # /plain: a destination without an injected credential
                ok = True
            if not ok:
                return web.json_response({"error": "unauthorized"}, status=401)
            # /static/echo answers with the credential it received, as some tools do: a capture must hide it
            return web.json_response({"ok": True, "echo": auth if path.endswith("/echo") else None})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        return app

    def start(self) -> AuthServers:
        ready = threading.Event()

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            for app, port in ((self.token_app(), self.token_port), (self.tool_app(), self.tool_port)):
                runner = web.AppRunner(app, access_log=None)
                loop.run_until_complete(runner.setup())
                loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
                self._runners.append(runner)
            ready.set()
            loop.run_forever()
            for runner in self._runners:
                loop.run_until_complete(runner.cleanup())
            close_loop(loop)

        threading.Thread(target=run, daemon=True).start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    def auth_seen(self, prefix: str) -> list[dict[str, str]]:
        return [h for p, h in self.seen if p.startswith(prefix)]


CATALOG = """
credentials:
  static: {{header: Authorization, format: "Bearer {{secret}}", insecure_plain_http: loopback}}
  apikey: {{header: X-Custom-Key, format: "{{secret}}", insecure_plain_http: loopback}}
  crm:    {{oauth2_client_credentials: {{token_url: "http://127.0.0.1:{token}/token", client_id: tether,
            scope: crm.read}}, header: Authorization, format: "Bearer {{token}}",
            insecure_plain_http: loopback}}
  lacking: {{header: Authorization, format: "Bearer {{secret}}", insecure_plain_http: loopback}}
capabilities:
  static.any:   {{http: {{host: 127.0.0.1, port: {tool}, scheme: http, methods: [GET, POST], path: "/static*"}},
                 credential: static}}
  key.read:     {{http: {{host: 127.0.0.1, port: {tool}, scheme: http, methods: [GET], path: "/key*"}},
                 credential: apikey}}
  crm.read:     {{http: {{host: 127.0.0.1, port: {tool}, scheme: http, methods: [GET], path: "/crm*"}},
                 credential: crm}}
  lacking.read: {{http: {{host: 127.0.0.1, port: {tool}, scheme: http, methods: [GET], path: "/lacking*"}},
                 credential: lacking}}
  plain.read:   {{http: {{host: 127.0.0.1, port: {tool}, methods: [GET], path: "/plain*"}}}}
  mcp.add:      {{mcp: {{url: "http://127.0.0.1:{tool}/mcp", tool: add}}, credential: static}}
"""
CAPS = {c: "direct" for c in ("static.any", "key.read", "crm.read", "lacking.read", "plain.read", "mcp.add")}


@dataclass
class CredWorld:
    root: Path
    servers: AuthServers
    cp: ControlPlaneProcess
    secret_dir: Path
    sidecars: list[SidecarProcess] = field(default_factory=list)

    def sidecar(self, agent: str, *extra: str) -> tuple[Identity, SidecarProcess]:
        identity = self.cp.issue(agent, CAPS)
        sidecar = SidecarProcess(self.cp, identity, list(extra))
        self.sidecars.append(sidecar)
        env_backup = os.environ.get("TEST_STATIC_SECRET")
        os.environ["TEST_STATIC_SECRET"] = STATIC  # the sidecar's environment only (cp.env() copies os.environ)
        try:
            sidecar.start()
        finally:
            if env_backup is None:
                os.environ.pop("TEST_STATIC_SECRET", None)
        return identity, sidecar

    def secret_args(self) -> list[str]:
        return ["--secret", "static=env:TEST_STATIC_SECRET", "--secret", f"apikey=file:{self.secret_dir / 'apikey'}",
                "--secret", f"crm=file:{self.secret_dir / 'client'}"]


@pytest.fixture(scope="module")
def cworld(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CredWorld]:
    root = tmp_path_factory.mktemp("cred-world")
    secret_dir = tmp_path_factory.mktemp("secrets")  # outside the searched tree: it holds the values on purpose
    (secret_dir / "apikey").write_text(APIKEY + "\n")
    (secret_dir / "client").write_text(CLIENT_SECRET)
    servers = AuthServers().start()
    cp = ControlPlaneProcess(root / "cp")
    cp.directory.mkdir(parents=True)
    cp.catalog_path.write_text(CATALOG.format(token=servers.token_port, tool=servers.tool_port))
    from tether.capability import keys

    key = keys.generate()
    cp.signing_key_path.write_bytes(keys.private_pem(key))
    cp.start()
    world = CredWorld(root, servers, cp, secret_dir)
    try:
        yield world
    finally:
        for sidecar in world.sidecars:
            sidecar.stop()
        cp.stop()
        servers.stop()


def _get(sidecar: SidecarProcess, url: str, **kwargs: Any) -> requests.Response:
    return requests.get(url, proxies=sidecar.proxies(), timeout=15, **kwargs)


# -- the catalog ---------------------------------------------------------------------------------------------
def test_catalog_credentials_are_validated_and_hashed() -> None:
    base = CATALOG.format(token=1, tool=2)
    catalog = parse_catalog(base)
    assert catalog.credential_of("static.any").header == "Authorization"
    assert catalog.credential_of("plain.read") is None
    # the hash covers the credentials: changing how one is injected is another catalog
    assert parse_catalog(base.replace('format: "{secret}"', 'format: "Key {secret}"')).hash != catalog.hash
    bad = {
        "credential: static}": "credential: nope}",  # a capability naming an unknown credential
        'format: "{secret}"': 'format: "no placeholder"',
        "header: X-Custom-Key": "header: Host",
        'token_url: "http://127.0.0.1': 'token_url: "http://auth.example.com',  # client secret in clear text
    }
    for old, new in bad.items():
        with pytest.raises(CatalogError):
            parse_catalog(base.replace(old, new, 1))
    # one MCP server, one credential
    with pytest.raises(CatalogError, match="same credential"):
        parse_catalog(base + '  mcp.other: {mcp: {url: "http://127.0.0.1:2/mcp", tool: sub}, credential: apikey}\n')


def test_secrets_come_from_env_or_file_and_a_named_missing_source_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "s").write_text("from-file\n")
    assert load_secrets(["a=env:X", f"b=file:{tmp_path / 's'}"], {"X": "from-env"}) == {"a": "from-env",
                                                                                         "b": "from-file"}
    for spec in ("a=env:MISSING", f"a=file:{tmp_path / 'none'}", "a=vault:x", "a"):
        with pytest.raises(Exception, match="--secret"):
            load_secrets([spec], {})


def test_token_refresh_time_is_before_expiry() -> None:
    expires_at, refresh_at = token_times(100.0, 3600)
    assert expires_at == 3700.0 and refresh_at == 3670.0
    expires_at, refresh_at = token_times(0.0, 2.0)
    assert 0 < refresh_at < expires_at == 2.0


# -- injection -------------------------------------------------------------------------------------------------
def test_the_tool_sees_the_injected_credential_never_the_agents(cworld: CredWorld) -> None:
    _, sc = cworld.sidecar("cred.static", *cworld.secret_args())
    base = f"http://127.0.0.1:{cworld.servers.tool_port}"
    resp = _get(sc, f"{base}/static/repos", headers={"Authorization": f"Bearer {AGENT_COPY}", "X-Api-Key": AGENT_COPY,
                                                     "Cookie": f"session={AGENT_COPY}"})
    assert resp.status_code == 200, resp.text
    assert cworld.servers.auth_seen("/static/repos") == [{"authorization": f"Bearer {STATIC}"}]
    # a credential in its own header: the agent's Authorization is stripped all the same
    resp = _get(sc, f"{base}/key/list", headers={"Authorization": f"Bearer {AGENT_COPY}"})
    assert resp.status_code == 200, resp.text
    assert cworld.servers.auth_seen("/key/list") == [{"x-custom-key": APIKEY}]
    # a destination without a credential keeps what the agent sent
    assert _get(sc, f"{base}/plain/x", headers={"Authorization": "Bearer own"}).status_code == 200
    assert cworld.servers.auth_seen("/plain/x") == [{"authorization": "Bearer own"}]


def test_a_credential_the_sidecar_lacks_refuses_the_call_before_it_leaves(cworld: CredWorld) -> None:
    _, sc = cworld.sidecar("cred.lacking", *cworld.secret_args())
    resp = _get(sc, f"http://127.0.0.1:{cworld.servers.tool_port}/lacking/x",
                headers={"Authorization": f"Bearer {AGENT_COPY}"})
    assert resp.status_code == 503
    assert resp.headers["Tether-Error"] == "tether.credential_unavailable"
    assert resp.json()["error"]["credential"] == "lacking"
    assert cworld.servers.auth_seen("/lacking") == []  # nothing left, with or without the agent's copy


def test_mcp_requests_carry_the_injected_bearer(cworld: CredWorld) -> None:
    _, sc = cworld.sidecar("cred.mcp", *cworld.secret_args())
    url = f"http://127.0.0.1:{cworld.servers.tool_port}/mcp"
    body = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    resp = requests.post(url, json=body, proxies=sc.proxies(), timeout=15,
                         headers={"Accept": "application/json, text/event-stream", "Authorization": "Bearer mine"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["result"]["content"][0]["text"] == "3"
    assert cworld.servers.auth_seen("/mcp") == [{"authorization": f"Bearer {STATIC}"}]


def test_oauth2_token_fetched_once_per_expiry_and_refreshed(cworld: CredWorld) -> None:
    _, sc = cworld.sidecar("cred.oauth", *cworld.secret_args())
    base = f"http://127.0.0.1:{cworld.servers.tool_port}"
    before = cworld.servers.token_requests
    # a burst of concurrent first calls shares one token request
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda i: _get(sc, f"{base}/crm/burst{i}").status_code, range(8)))
    assert statuses == [200] * 8
    assert cworld.servers.token_requests - before == 1
    # calls over several lifetimes: every one is accepted (never an expired token), one request per expiry
    started = time.monotonic()
    calls = 0
    while time.monotonic() - started < 3 * TOKEN_LIFE:
        assert _get(sc, f"{base}/crm/steady").status_code == 200
        calls += 1
        time.sleep(0.05)
    fetched = cworld.servers.token_requests - before
    lifetimes = (time.monotonic() - started) / (TOKEN_LIFE * 0.9) + 1
    assert 3 <= fetched <= lifetimes + 1, (fetched, calls)
    assert calls > 3 * fetched  # tokens are reused across calls
    seen = {h["authorization"] for h in cworld.servers.auth_seen("/crm/steady")}
    assert len(seen) >= 3 and all(v.startswith("Bearer tok-") for v in seen)


def test_a_failing_token_endpoint_refuses_never_an_uncredentialed_call(cworld: CredWorld) -> None:
    _, sc = cworld.sidecar("cred.oauthfail", *cworld.secret_args())
    cworld.servers.token_failing = True
    try:
        resp = _get(sc, f"http://127.0.0.1:{cworld.servers.tool_port}/crm/down",
                    headers={"Authorization": f"Bearer {AGENT_COPY}"})
    finally:
        cworld.servers.token_failing = False
    assert resp.status_code == 503 and resp.headers["Tether-Error"] == "tether.credential_unavailable", resp.text
    assert cworld.servers.auth_seen("/crm/down") == []
    # the endpoint is back: the next call gets a token (after the short hold on failures)
    ok = wait_until(lambda: _get(sc, f"http://127.0.0.1:{cworld.servers.tool_port}/crm/back").status_code == 200,
                    10, interval=0.3, what="a token once the endpoint recovers")
    assert ok


def test_revoked_agent_holding_nothing_cannot_reach_the_tool_by_any_path(cworld: CredWorld) -> None:
    identity, sc = cworld.sidecar("cred.revoke", *cworld.secret_args())
    url = f"http://127.0.0.1:{cworld.servers.tool_port}/static/work"
    assert _get(sc, url).status_code == 200
    cworld.cp.client().request("POST", f"/v1/grants/{identity.jti}/revoke", {"reason": "test"})
    wait_until(lambda: _get(sc, url).headers.get("Tether-Error") == "tether.chain_revoked", 30, interval=0.1,
               what="the revoked agent refused")
    assert _get(sc, url).status_code == 403
    # around the sidecar, with everything the agent holds (its own copy of an old key, nothing else): refused
    direct = requests.get(url, headers={"Authorization": f"Bearer {AGENT_COPY}"}, timeout=5)
    assert direct.status_code == 401


def test_tether_run_removes_the_secret_variable_from_the_command(cworld: CredWorld, tmp_path: Path) -> None:
    identity = cworld.cp.issue("cred.run", CAPS)
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, sys, urllib.request\n"
        "out = {'env': os.environ.get('TEST_STATIC_SECRET')}\n"
        "with urllib.request.urlopen(sys.argv[1] + '/static/echo', timeout=10) as r:\n"
        "    out['status'] = r.status\n"
        "print(json.dumps(out))\n")
    env = {**cworld.cp.env(), "TEST_STATIC_SECRET": STATIC}
    done = subprocess.run(
        [PYTHON, "-m", "tether", "run", "--controlplane", cworld.cp.url, "--chain", str(identity.chain_path),
         "--key", str(identity.key_path), "--state-dir", str(cworld.root / "run-state"), *cworld.secret_args(),
         "--", PYTHON, str(script), f"http://127.0.0.1:{cworld.servers.tool_port}"],
        capture_output=True, text=True, timeout=90, env=env, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"env": None, "status": 200}


def test_zz_no_secret_value_in_any_capture_har_spool_report_log_or_record(cworld: CredWorld) -> None:
    """Runs last in the module: everything above wrote its captures, spools, logs and reports."""
    identity, sc = cworld.sidecar("cred.grep", *cworld.secret_args())
    base = f"http://127.0.0.1:{cworld.servers.tool_port}"
    assert _get(sc, f"{base}/static/echo").json()["echo"] == f"Bearer {STATIC}"  # the tool echoes it back
    assert _get(sc, f"{base}/crm/grep").status_code == 200
    # a termination writes a record; a HAR export reads the captures
    admin = cworld.cp.client()
    tid = admin.request("POST", f"/v1/agents/{identity.agent}/terminate", {"mode": "abort", "window_s": 1})
    tid = tid.get("termination_id") or tid.get("id")
    wait_until(lambda: admin.request("GET", f"/v1/terminations/{tid}").get("state") == "terminated", 20,
               interval=0.2, what="the termination's record")
    for sidecar in cworld.sidecars:
        sidecar.stop()
    har = cworld.root / "all.har"
    for agent_dir in (cworld.cp.directory / "sidecars").iterdir():
        subprocess.run([PYTHON, "-m", "tether", "capture", "export", "--agent", agent_dir.name,
                        "--captures", str(agent_dir.parent), "--har", str(har.with_suffix(f".{agent_dir.name}.har"))],
                       capture_output=True, timeout=60, env=cworld.cp.env(), check=False)
    assert list(cworld.root.glob("all.*.har")), "no HAR was exported"
    values = [STATIC, APIKEY, CLIENT_SECRET, *cworld.servers.issued]
    hits = []
    files = 0
    for path in cworld.root.rglob("*"):
        if not path.is_file():
            continue
        files += 1
        data = path.read_bytes()
        hits += [(str(path), v[:12]) for v in values if v.encode() in data]
    assert files > 10
    assert hits == []
    # and the captures did record the calls (the grep searched something real)
    assert any(p.name == "flows.mitm" and p.stat().st_size > 0 for p in cworld.root.rglob("flows.mitm"))
