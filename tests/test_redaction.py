"""Redaction on what a reader will see: decoded bodies, every injected value in every spelling, secret field names.

Units: the default field names, a gzip-compressed body redacted as decoded (fields and injected values), the
spellings of an injected value, websocket messages. End to end: a real control plane and sidecar in front of an
echo tool (HTTPS, its certificate from the CA the sidecar trusts) that answers with what it got, gzip-compressed:
its headers (the injected credential among them), the injected value under a neutral name and in base64, and the
body it parsed. The agent sends passwords, client secrets and tokens in JSON (plain and gzip-compressed) and form
bodies and through an approval-tier call. Then every file the world wrote is searched for every secret: the
captures, the HAR that ``tether capture export`` writes, the console's view of the approval (``/v1/approvals``,
what the console renders), logs, the spool, the record, and the control plane's SQLite files with their WAL.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import secrets
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from aiohttp import web
from mitmproxy import http
from mitmproxy.test import tflow

from tether.capture.har import to_har
from tether.capture.segments import read_flows
from tether.proxy.capture import ConnectionStates as Conns
from tether.proxy.capture import Fields, encode_flow
from tether.proxy.credentials import spelled

from .harness import (
    PYTHON,
    ControlPlaneProcess,
    Identity,
    SidecarProcess,
    close_loop,
    free_port,
    make_test_ca,
    wait_until,
)

SECRET = "inj-" + secrets.token_hex(16)  # the credential the sidecar injects
PASSWORD = "pw-" + secrets.token_hex(12)
CLIENT_SECRET = "cs-" + secrets.token_hex(12)
API_KEY = "ak-" + secrets.token_hex(12)
REFRESH = "rt-" + secrets.token_hex(12)  # sent in a gzip-compressed request body
FORM_PASSWORD = "fp-" + secrets.token_hex(12)
HELD_PASSWORD = "hp-" + secrets.token_hex(12)  # in an approval-tier call
ALL = {"injected": SECRET, "password": PASSWORD, "client_secret": CLIENT_SECRET, "apiKey": API_KEY,
       "refresh_token": REFRESH, "form password": FORM_PASSWORD, "held password": HELD_PASSWORD}


# -- units -----------------------------------------------------------------------------------------------------
def test_the_default_field_names_say_secret_and_others_pass() -> None:
    fields = Fields.of()
    for name in ("password", "Password", "db_password", "passwd", "secret", "client_secret", "clientSecret", "token",
                 "access_token", "refresh_token", "id_token", "api_key", "apiKey", "X-Api-Key", "private_key",
                 "authorization", "credentials"):
        assert name in fields, name
    for name in ("user", "total_tokens", "keyboard", "tokenizer", "passenger", "description", "secrets_count"):
        assert name not in fields, name
    off = Fields.of(["Session-Id"], defaults=False)
    assert "password" not in off and "session_id" in off and "sessionid" in off
    assert not Fields.of(defaults=False) and Fields.of()


@pytest.mark.parametrize(("media", "body"), [
    ("application/json", b'{"a": [{"b": {"Client-Secret": "SECRET"}}]}'),
    ("application/json", b'{"pass\\u0077ord": "SECRET"}'),  # an escaped name is the same key
    ("text/plain", b'  {"refreshToken" : "SECRET"}'),
    ("application/x-www-form-urlencoded", b"user=u&pass%77ord=SECRET"),
], ids=["nested", "escaped-name", "json-as-text", "form-escaped-name"])
def test_default_fields_are_redacted_however_the_name_is_written(media: str, body: bytes) -> None:
    flow = tflow.tflow(resp=True)
    flow.request.method, flow.request.headers["Content-Type"], flow.request.content = "POST", media, body
    data = encode_flow(flow, Fields.of(), Conns())
    assert b"SECRET" not in data and b"REDACTED" in data
    assert b"SECRET" in encode_flow(flow, Fields.of(defaults=False), Conns())  # the default is what redacted it


def json_flow(body: dict[str, Any], *, gzipped: bool) -> http.HTTPFlow:
    flow = tflow.tflow(resp=True)
    flow.response.headers["Content-Type"] = "application/json"
    raw = json.dumps(body).encode()
    if gzipped:
        flow.response.headers["Content-Encoding"] = "gzip"
        flow.response.raw_content = gzip.compress(raw)
    else:
        flow.response.raw_content = raw
    return flow


@pytest.mark.parametrize("gzipped", [False, True], ids=["plain", "gzip"])
def test_a_compressed_body_is_redacted_as_it_reads_and_the_har_shows_no_secret(gzipped: bool, tmp_path: Path) -> None:
    injected = sorted(spelled(SECRET.encode()), key=len, reverse=True)
    flow = json_flow({"user": "u", "password": PASSWORD, "echo": f"Bearer {SECRET}",
                      "echo_b64": base64.b64encode(f"x:{SECRET}".encode()).decode()}, gzipped=gzipped)
    path = tmp_path / "flows.mitm"
    path.write_bytes(encode_flow(flow, Fields.of(), Conns(), values=injected))
    data = path.read_bytes()
    (captured,) = read_flows(path)
    text = captured.response.get_text()
    assert "Content-Encoding" not in captured.response.headers  # kept decoded: it was redacted
    doc = json.loads(text)
    assert doc["user"] == "u" and doc["password"] == "[REDACTED]" and SECRET not in text
    har = json.dumps(to_har([captured]))
    for value in (PASSWORD, SECRET, base64.b64encode(f"x:{SECRET}".encode()).decode()[4:-4]):
        assert value not in har and value.encode() not in data
    assert "[REDACTED]" in har


def test_a_body_without_secrets_keeps_the_bytes_it_travelled_as() -> None:
    flow = json_flow({"user": "u", "total_tokens": 12}, gzipped=True)
    data = encode_flow(flow, Fields.of(), Conns(), values=[SECRET.encode()])
    assert flow.response.raw_content in data and b"Content-Encoding" in data


def test_an_undecodable_encoded_body_is_not_kept() -> None:
    flow = tflow.tflow(resp=True)
    flow.response.headers["Content-Encoding"] = "gzip"
    flow.response.raw_content = b"not gzip " + SECRET.encode()
    data = encode_flow(flow, Fields.of(defaults=False), Conns(), values=[SECRET.encode()])
    assert SECRET.encode() not in data and b"undecodable encoded body" in data


def test_an_injected_value_is_found_in_each_spelling_a_tool_may_echo() -> None:
    value = SECRET.encode() + b"/+?&"  # characters that percent-encoding and base64 change
    forms = spelled(value)
    texts = [value, requests.utils.quote(value, safe="").encode(), json.dumps(value.decode()).encode(),
             *(base64.b64encode(prefix + value + b"tail") for prefix in (b"", b"u", b"us", b"usr:")),
             *(base64.urlsafe_b64encode(prefix + value) for prefix in (b"", b"a", b"ab"))]
    for text in texts:
        assert any(form in text for form in forms), text


def test_websocket_messages_are_scrubbed_of_injected_values() -> None:
    flow = tflow.twebsocketflow()
    flow.websocket.messages[0].content = b"echo Bearer " + SECRET.encode()
    data = encode_flow(flow, Fields.of(), Conns(), values=[SECRET.encode()])
    assert SECRET.encode() not in data and b"[REDACTED]" in data


# -- end to end ------------------------------------------------------------------------------------------------
@dataclass
class Echo:
    """An HTTPS tool that answers with what it got, gzip-compressed (and remembers it: the positive control)."""

    ca: Any
    port: int = field(default_factory=free_port)
    got: list[bytes] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> Echo:
        ready = threading.Event()

        async def echo(request: web.Request) -> web.Response:
            body = await request.read()  # (aiohttp has decoded a gzip-compressed request body)
            auth = request.headers.get("Authorization", "")
            self.got.append(auth.encode() + b"\n" + body)
            parsed: Any
            if request.content_type == "application/x-www-form-urlencoded":
                parsed = dict((await request.post()).items())
            else:
                parsed = json.loads(body) if body else None
            doc = {"headers": dict(request.headers), "seen": auth, "seen_b64": base64.b64encode(
                f"tool:{auth}".encode()).decode(), "got": parsed, "user": "visible"}
            return web.Response(body=gzip.compress(json.dumps(doc).encode()),
                                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", echo)
            runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port,
                                                ssl_context=self.ca.server_context()).start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            close_loop(loop)

        threading.Thread(target=run, daemon=True).start()
        assert ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)


CATALOG = """
credentials:
  tool: {{header: Authorization, format: "Bearer {{secret}}"}}
capabilities:
  echo.write: {{http: {{host: 127.0.0.1, port: {port}, scheme: https, methods: [POST], path: "/echo*"}},
               credential: tool}}
  echo.held:  {{http: {{host: 127.0.0.1, port: {port}, scheme: https, methods: [POST], path: "/held*"}},
               credential: tool}}
"""


@dataclass
class World:
    root: Path
    cp: ControlPlaneProcess
    identity: Identity
    sidecar: SidecarProcess
    echo: Echo

    def post(self, path: str, **kwargs: Any) -> requests.Response:
        return requests.post(f"https://127.0.0.1:{self.echo.port}{path}", proxies=self.sidecar.proxies(),
                             verify=self.sidecar.ca, timeout=60, **kwargs)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("redaction")
    ca = make_test_ca(tmp_path_factory.mktemp("redaction-ca"), ["localhost"])  # outside the searched tree
    secret_dir = tmp_path_factory.mktemp("redaction-secret")
    (secret_dir / "tool").write_text(SECRET)
    echo = Echo(ca).start()
    cp = ControlPlaneProcess(root / "cp")
    cp.directory.mkdir(parents=True)
    cp.catalog_path.write_text(CATALOG.format(port=echo.port))
    from tether.capability import keys

    cp.signing_key_path.write_bytes(keys.private_pem(keys.generate()))
    os.environ["TETHER_CAPTURES"] = str(cp.directory / "sidecars")  # the console's HAR download reads them
    try:
        cp.start()
    finally:
        os.environ.pop("TETHER_CAPTURES", None)
    identity = cp.issue("redact.agent", {"echo.write": "direct", "echo.held": "approval"})
    sidecar = SidecarProcess(cp, identity, ["--secret", f"tool=file:{secret_dir / 'tool'}"])
    sidecar.start(upstream_ca=ca.ca_pem)
    try:
        yield World(root, cp, identity, sidecar, echo)
    finally:
        sidecar.stop()
        cp.stop()
        echo.stop()


def hits(root: Path) -> list[tuple[str, str]]:
    """(file, secret) for every secret found in any file under root, raw or base64-encoded."""
    found = []
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        for name, value in ALL.items():
            if any(form in data for form in spelled(value.encode()) if len(form) >= 12):
                found.append((str(path.relative_to(root)), name))
    return found


def test_no_secret_in_any_capture_har_console_view_log_spool_record_or_store(world: World) -> None:
    # JSON with secret fields at two depths; the tool echoes them back, and the injected credential, gzipped
    resp = world.post("/echo/json", json={"user": "u", "password": PASSWORD,
                                          "profile": {"client_secret": CLIENT_SECRET, "apiKey": API_KEY}})
    assert resp.status_code == 200, resp.text
    echoed = resp.json()  # the agent's own answer is not redacted (the tool chose to send it)
    assert echoed["seen"] == f"Bearer {SECRET}" and echoed["got"]["password"] == PASSWORD
    # a gzip-compressed request body, and a form
    resp = world.post("/echo/gzip", data=gzip.compress(json.dumps({"refresh_token": REFRESH}).encode()),
                      headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert resp.status_code == 200 and resp.json()["got"] == {"refresh_token": REFRESH}, resp.text
    resp = world.post("/echo/form", data={"user": "u", "password": FORM_PASSWORD})
    assert resp.status_code == 200 and resp.json()["got"]["password"] == FORM_PASSWORD, resp.text
    # an approval-tier call: the approver's card (what the console shows) is redacted, the call goes out whole
    admin = world.cp.client()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(world.post, "/held/x", json={"note": "visible", "password": HELD_PASSWORD})
        pending = wait_until(lambda: [a for a in admin.request("GET", "/v1/approvals?status=pending")
                                      if a["agent"] == "redact.agent"], 30, interval=0.2, what="the held call")
        card = json.dumps(pending)
        assert HELD_PASSWORD not in card and "[REDACTED]" in card and "visible" in card
        admin.request("POST", f"/v1/approvals/{pending[0]['id']}/approve", {})
        resp = held.result(60)
    assert resp.status_code == 200 and resp.json()["got"]["password"] == HELD_PASSWORD, resp.text
    assert HELD_PASSWORD not in json.dumps(admin.request("GET", "/v1/approvals?status=approved"))
    # the positive control: every secret did reach the tool, so the searches below look for something real
    got = b"\n".join(world.echo.got)
    assert all(value.encode() in got for value in ALL.values())

    # the HAR, while the control plane runs (its SQLite WAL is live)
    har_path = world.root / "export.har"
    done = subprocess.run([PYTHON, "-m", "tether", "capture", "export", "--agent", "redact.agent", "--captures",
                           str(world.cp.directory / "sidecars"), "--har", str(har_path)],
                          capture_output=True, text=True, timeout=120, env=world.cp.env(), check=False)
    assert done.returncode == 0, done.stderr
    har = json.loads(har_path.read_text())
    texts = [e["response"]["content"].get("text", "") for e in har["log"]["entries"]]
    assert len(har["log"]["entries"]) >= 4 and any('"visible"' in t for t in texts)  # decoded, and shown
    assert any("[REDACTED]" in t for t in texts)
    # the console's HAR download (the same export, served by the control plane)
    console_har = admin.request("GET", "/v1/captures/har?agent=redact.agent")
    assert len(console_har["log"]["entries"]) == len(har["log"]["entries"])
    (world.root / "console.har").write_text(json.dumps(console_har))
    assert list(world.cp.directory.glob("*.db-wal")), "the control plane's WAL is where this test looks"
    assert hits(world.root) == []

    # a termination writes the record; the sidecar delivers its spool and stops
    tid = admin.request("POST", "/v1/agents/redact.agent/terminate", {"mode": "drain", "window_s": 1})
    tid = tid.get("termination_id") or tid.get("id")
    wait_until(lambda: admin.request("GET", f"/v1/terminations/{tid}").get("state") == "terminated", 30,
               interval=0.2, what="the termination's record")
    records = json.dumps(admin.request("GET", "/v1/records"))
    assert "/echo/json" in records and not [v for v in ALL.values() if v in records]
    world.sidecar.stop()
    assert hits(world.root) == []
    world.cp.stop()  # (the WAL is checkpointed into the database file now)
    assert hits(world.root) == []


@pytest.mark.parametrize("offset", [0, 3, 12, 13, 1 << 20])
@pytest.mark.parametrize("name", [b"TOKEN", b"Authorization", b"api_key"])
def test_a_field_name_across_the_look_s_slices_is_still_seen(offset: int, name: bytes) -> None:
    """``Fields.may_hold`` looks at a large body a slice at a time: a name that straddles two slices is found."""
    from tether.proxy.capture import _SLICE

    body = bytearray(b"x" * (3 * _SLICE))
    at = 2 * _SLICE - offset if offset < _SLICE else _SLICE * 3 - len(name)
    body[at:at + len(name)] = name
    assert Fields.of(()).may_hold(bytes(body))
    assert not Fields.of(()).may_hold(b"x" * (3 * _SLICE))
