"""The console over TLS (``controlplane serve --tls-cert/--tls-key``): its session cookie is ``__Host-``
prefixed, Secure, HttpOnly and SameSite=Strict, so a listener on another port of the same host never receives
it (cookies are scoped by host, not port); over plain HTTP the control plane says at start-up that it would.
Real control-plane processes; the other port is a real aiohttp server; the browser part uses Debian's
Chromium through Playwright (skipped where it is absent)."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from . import harness
from .harness import ADMIN_TOKEN, ControlPlaneProcess, ToolServer, prepare_controlplane
from .test_console import CHROMIUM

PLAIN_WARNING = "served over plain HTTP"
HOST = "console.test"  # the console's host name, as a browser on the network would use (mapped to 127.0.0.1)


@pytest.fixture
def browser() -> Any:
    """Chromium resolving ``HOST`` to 127.0.0.1. A host name, not 127.0.0.1 itself: Chromium counts loopback
    addresses as secure contexts and sends even Secure cookies to their plain-HTTP ports (docs/console.md)."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent (apt-get install chromium); the browser test needs it")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a dev dependency (.[dev])")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--no-first-run", "--disable-sync", f"--host-resolver-rules=MAP {HOST} 127.0.0.1"])
        try:
            yield b
        finally:
            b.close()


def http(url: str, method: str = "GET", body: Any = None, headers: dict[str, str] | None = None,
         context: ssl.SSLContext | None = None) -> tuple[int, dict[str, str], Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=20, context=context) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"null")


@pytest.fixture
def planes(tmp_path: Path, test_ca: harness.TestCA) -> Iterator[tuple[ControlPlaneProcess, ControlPlaneProcess]]:
    """A control plane over TLS and one over plain HTTP."""
    tls = prepare_controlplane(tmp_path / "tls", 1, 2, 3, tls=test_ca).start()
    try:
        plain = prepare_controlplane(tmp_path / "plain", 1, 2, 3).start()
        try:
            yield tls, plain
        finally:
            plain.stop()
    finally:
        tls.stop()


def test_the_tls_console_sets_a_host_only_secure_cookie(planes: tuple[ControlPlaneProcess, ControlPlaneProcess]
                                                        ) -> None:
    tls, plain = planes
    assert tls.url.startswith("https://")
    status, headers, body = http(f"{tls.url}/ui/session", "POST", {"token": ADMIN_TOKEN}, context=tls.url_context())
    assert status == 200, body
    name_value, *flags = [part.strip() for part in headers["Set-Cookie"].split(";")]
    name, sid = name_value.split("=", 1)
    flags_lower = [f.lower() for f in flags]
    assert name == "__Host-tether_session"
    assert {"secure", "httponly", "samesite=strict", "path=/"} <= set(flags_lower)
    assert not any(f.startswith("domain") for f in flags_lower)  # host-only, as the prefix demands
    # The session reads under its own name only: the same id in a plain-HTTP cookie's name is nobody's.
    assert http(f"{tls.url}/v1/agents", headers={"Cookie": f"__Host-tether_session={sid}"},
                context=tls.url_context())[0] == 200
    assert http(f"{tls.url}/v1/agents", headers={"Cookie": f"tether_session={sid}"},
                context=tls.url_context())[0] == 401
    # Start-up: the plain one says the session is readable by any port of the host; the TLS one does not.
    assert PLAIN_WARNING in (plain.directory / "controlplane.log").read_text()
    tls_log = (tls.directory / "controlplane.log").read_text()
    assert PLAIN_WARNING not in tls_log and "listening on https://" in tls_log


def test_another_port_of_the_host_never_receives_the_tls_session(
        planes: tuple[ControlPlaneProcess, ControlPlaneProcess], browser: Any) -> None:
    """The attack of a shared host: after signing in, the browser visits a page on another port of the same
    host. Over plain HTTP that page's server receives the console's session cookie; over TLS it does not."""
    tls, plain = planes
    other = ToolServer().start()  # "another port of the console's host": its /echo answers the headers it got
    try:
        received = {}
        for cp in (plain, tls):
            context = browser.new_context(ignore_https_errors=True)  # the test CA is not the browser's
            page = context.new_page()
            page.goto(f"{cp.url.replace('127.0.0.1', HOST)}/ui/")
            page.get_by_label("Operator or admin token").fill(ADMIN_TOKEN)
            page.get_by_role("button", name="Sign in").click()
            page.get_by_role("button", name="Sign out").wait_for(timeout=30_000)
            (cookie,) = [c for c in context.cookies() if "tether_session" in c["name"]]
            page.goto(f"http://{HOST}:{other.port}/echo")
            echoed = json.loads(page.locator("body").inner_text())["headers"]
            received[cp is tls] = (cookie, echoed.get("Cookie", ""))
            context.close()
        plain_cookie, plain_sent = received[False]
        assert plain_cookie["name"] == "tether_session" and f"tether_session={plain_cookie['value']}" in plain_sent
        tls_cookie, tls_sent = received[True]
        assert tls_cookie["name"] == "__Host-tether_session" and tls_cookie["secure"]
        assert tls_cookie["httpOnly"] and tls_cookie["sameSite"] == "Strict"
        assert "tether_session" not in tls_sent and tls_cookie["value"] not in tls_sent
    finally:
        other.stop()
