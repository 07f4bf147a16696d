"""The security team's console (docs/contract.md section 10, Console), in a real browser against real processes.

Debian's chromium, driven by Playwright (nothing is downloaded): sign in, the agent tree, a held call shown
with its body and approved (the tool server receives it), another denied, a subtree terminated with the
states followed to ``terminated``, the record opened and its HAR downloaded and validated against the
HAR 1.2 schema entry by entry. Around it, over plain HTTP: the session cookie's flags, CSRF refusals, a
wrong token, and an approval bound to its call's hash. Screenshots go to docs/console/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import requests

from tether.capability.errors import ApiError

from .conftest import World
from .harness import ADMIN_TOKEN, wait_until

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "docs" / "console"
HAR_SCHEMA = json.loads((Path(__file__).parent / "har-1.2.schema.json").read_text())


def http(url: str, method: str = "GET", body: Any = None, headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, str], Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"null")


@pytest.fixture
def console_world(world: World) -> World:
    # The control plane reads the sidecars' captures for the console's HAR download.
    world.cp.stop()
    os.environ["TETHER_CAPTURES"] = str(world.cp.directory / "sidecars")
    try:
        world.cp.start()
    finally:
        del os.environ["TETHER_CAPTURES"]
    return world


def sign_in(cp_url: str) -> tuple[str, str, dict[str, str]]:
    status, headers, body = http(f"{cp_url}/ui/session", "POST", {"token": ADMIN_TOKEN})
    assert status == 200, body
    cookie = headers["Set-Cookie"]
    return cookie.split(";", 1)[0].split("=", 1)[1], body["csrf"], headers


def test_session_cookie_flags_csrf_and_wrong_token(world: World) -> None:
    url = world.cp.url
    status, _, body = http(f"{url}/ui/session", "POST", {"token": "not-the-token"})
    assert status == 401 and body["error"]["code"] == "tether.unauthorized"

    sid, csrf, headers = sign_in(url)
    flags = [f.strip().lower() for f in headers["Set-Cookie"].split(";")]
    assert "httponly" in flags and "samesite=strict" in flags and "path=/" in flags
    assert "secure" not in flags  # plain http here; behind https (X-Forwarded-Proto) the cookie is Secure
    _, https_headers, _ = http(f"{url}/ui/session", "POST", {"token": ADMIN_TOKEN},
                               {"X-Forwarded-Proto": "https"})
    assert "secure" in [f.strip().lower() for f in https_headers["Set-Cookie"].split(";")]

    ident = world.cp.issue("csrf-a", {"issues.read": "direct"})
    world.sidecar(ident)
    cookie = {"Cookie": f"tether_session={sid}"}
    # Reads with the session are admin reads.
    status, _, agents = http(f"{url}/v1/agents", headers=cookie)
    assert status == 200 and any(a["agent"] == "csrf-a" for a in agents["agents"])
    # A change without the CSRF token, or with another one, is refused and changes nothing.
    for extra in ({}, {"X-CSRF-Token": "forged"}):
        status, hdrs, body = http(f"{url}/v1/agents/csrf-a/revoke", "POST", {}, {**cookie, **extra})
        assert status == 403 and body["error"]["code"] == "tether.csrf" and hdrs["Tether-Error"] == "tether.csrf"
    assert world.cp.client().request("GET", "/v1/agents")["agents"][0]["status"] == "active"
    # A bearer token is unchanged: no CSRF token needed.
    assert world.cp.client().request("GET", "/v1/agents/csrf-a/subtree")["agents"] == ["csrf-a"]
    # Logout ends the session server-side: the same cookie no longer reads anything.
    status, _, body = http(f"{url}/ui/logout", "POST", {}, {**cookie, "X-CSRF-Token": csrf})
    assert status == 200
    status, _, body = http(f"{url}/v1/agents", headers=cookie)
    assert status == 401 and body["error"]["code"] == "tether.unauthorized"


def test_approval_shows_the_redacted_call_and_binds_to_its_hash(world: World) -> None:
    w = world
    ident = w.cp.issue("bind-a", {"echo.any": "approval"})
    sc = w.sidecar(ident, "--redact-field", "password")
    admin = w.cp.client()
    body = {"to": "ops@example.com", "password": "hunter2", "note": "é" * 10_000}  # > 16 KiB of UTF-8, shown whole

    def post() -> requests.Response:
        return requests.post(f"{w.tools.base}/echo", json=body, proxies=sc.proxies(), timeout=30,
                             headers={"Authorization": "Bearer agent-secret", "X-Trace": "t-1"})

    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(post)
        (approval,) = wait_until(lambda: admin.request("GET", "/v1/approvals?status=pending"), 10, what="approval")
        req = approval["request"]
        assert approval["chain"] == ["bind-a"] and approval["deciders"] == ["approver", "admin"]
        assert req["method"] == "POST" and req["url"] == f"{w.tools.base}/echo"
        headers = dict((k.lower(), v) for k, v in req["headers"])
        assert headers["authorization"] == "[REDACTED]" and headers["x-trace"] == "t-1"
        assert "hunter2" not in req["body"] and "[REDACTED]" in req["body"]
        # Shown whole (issue 23: it was cut at 16 KiB, and the part after the cut was approved unseen).
        assert req["body_size"] == len(json.dumps(body).encode()) and not req["body_truncated"]
        assert json.loads(req["body"])["note"] == body["note"] and req["call_hash"].startswith("sha256:")
        assert approval["call_hash"] == req["call_hash"]

        out = subprocess.run([sys.executable, "-m", "tether", "approvals", "show", approval["id"]],
                             env=w.cp.env(), capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert f"POST {w.tools.base}/echo" in out.stdout and "authorization: [redacted]" in out.stdout.lower()
        assert req["call_hash"] in out.stdout and "ops@example.com" in out.stdout

        with pytest.raises(ApiError) as exc:
            admin.request("POST", f"/v1/approvals/{approval['id']}/approve", {"call_hash": "sha256:" + "0" * 64})
        assert exc.value.http_status == 409 and exc.value.code == "tether.conflict"
        assert not held.done() and w.tools.hits_for("/echo") == 0

        admin.request("POST", f"/v1/approvals/{approval['id']}/approve", {"call_hash": req["call_hash"]})
        resp = held.result(timeout=15)
        assert resp.status_code == 200 and json.loads(resp.json()["body"])["password"] == "hunter2"
        assert w.tools.hits_for("/echo") == 1


# -- the browser ---------------------------------------------------------------------------------------------
@pytest.fixture
def browser() -> Any:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent (apt-get install chromium); the console's browser test needs it")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a dev dependency (.[dev])")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--no-first-run", "--disable-sync"])
        try:
            yield b
        finally:
            b.close()


def shot(page: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=False)


def test_console_end_to_end_in_a_browser(console_world: World, browser: Any, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    w = console_world
    lead = w.cp.issue("lead", {"echo.any": "approval", "issues.read": "direct", "hang.read": "direct"})
    worker = w.cp.delegate(lead, "worker", {"echo.any": "approval", "hang.read": "direct", "issues.read": "direct"})
    helper = w.cp.delegate(worker, "helper", {"issues.read": "direct"})
    sc_lead, sc_worker = w.sidecar(lead), w.sidecar(worker)
    w.sidecar(helper)
    requests.get(f"{w.tools.base}/repos/acme/site/issues", proxies=sc_lead.proxies(), timeout=10)

    context = browser.new_context(viewport={"width": 1366, "height": 800}, accept_downloads=True)
    page = context.new_page()
    page.goto(f"{w.cp.url}/ui/")

    # A wrong token is refused; the right one signs in.
    page.get_by_label("Admin token").fill("wrong-token")
    shot(page, "signin")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text("tether.unauthorized")
    page.get_by_label("Admin token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()

    # The tree: three agents, each sidecar serving with a live lease.
    table = page.get_by_role("table", name="Agent tree")
    for agent in ("lead", "worker", "helper"):
        expect(table.locator(f'tr[data-agent="{agent}"] .sidecar-state')).to_have_text("serving")
    (cookie,) = [c for c in context.cookies() if c["name"] == "tether_session"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and not cookie["secure"]
    # The page's own scripts cannot read the session.
    assert "tether_session" not in page.evaluate("document.cookie")
    # A change from the page without the CSRF token is refused.
    forged = page.evaluate("""async () => { const r = await fetch('/v1/agents/helper/revoke', {method: 'POST'});
                                            return [r.status, (await r.json()).error.code]; }""")
    assert forged == [403, "tether.csrf"]
    shot(page, "agents")

    with ThreadPoolExecutor(3) as pool:
        # A held call, shown with its body, approved from the browser: the tool server receives it.
        approved = pool.submit(requests.post, f"{w.tools.base}/echo", json={"ticket": "T-1", "action": "close"},
                               proxies=sc_worker.proxies(), timeout=30)
        page.get_by_role("button", name="Approvals").click()
        card = page.locator("article.approval").filter(has_text="worker").first
        expect(card.locator("pre.request")).to_contain_text('"ticket": "T-1"')
        expect(card).to_contain_text("lead \u203a worker")
        shot(page, "approval")
        assert w.tools.hits_for("/echo") == 0
        card.get_by_role("button", name="Approve this call").click()
        assert approved.result(timeout=15).status_code == 200
        assert w.tools.hits_for("/echo") == 1

        # Another, denied: refused to the agent, nothing reaches the tool.
        denied = pool.submit(requests.post, f"{w.tools.base}/echo", json={"ticket": "T-2"},
                             proxies=sc_worker.proxies(), timeout=30)
        card = page.locator("article.approval", has_text='"ticket": "T-2"')
        card.get_by_role("button", name="Deny").click()
        resp = denied.result(timeout=15)
        assert resp.status_code == 403 and resp.headers["Tether-Error"] == "tether.approval_denied"
        assert w.tools.hits_for("/echo") == 1

        # A call in flight when the subtree is aborted: it is cut, and the record and HAR say so.
        def hang() -> Any:
            try:
                return requests.get(f"{w.tools.base}/hang", proxies=sc_worker.proxies(), timeout=30)
            except requests.ConnectionError as exc:  # an abort cuts the agent's connection too
                return exc

        cut = pool.submit(hang)
        wait_until(lambda: w.tools.hits_for("/hang") == 1, 10, what="the /hang call to reach the tool")

        # Terminate worker's subtree: the confirmation names exactly who is cut.
        page.get_by_role("button", name="Agents").click()
        page.get_by_role("button", name="Terminate worker").click()
        dialog = page.get_by_role("dialog")
        expect(dialog.get_by_role("list", name="Agents that will be cut").get_by_role("listitem")).to_have_text(
            ["helper", "worker"])
        dialog.get_by_label("Mode").select_option("abort")
        dialog.get_by_label("Window (seconds)").fill("2")
        dialog.get_by_label("Reason").fill("console test")
        shot(page, "terminate")
        dialog.get_by_role("button", name="Terminate 2 agent(s)").click()
        expect(dialog).to_be_hidden()
        cut.result(timeout=30)

    page.get_by_role("button", name="Terminations").click()
    row = page.locator("tr", has_text="worker").filter(has=page.locator(".termination-state"))
    expect(row.locator(".termination-state")).to_have_text("terminated", timeout=30_000)
    page.get_by_role("button", name="Agents").click()
    for agent in ("worker", "helper"):
        expect(table.locator(f'tr[data-agent="{agent}"] .sidecar-state')).to_have_text("terminated", timeout=15_000)
    expect(table.locator('tr[data-agent="lead"] .sidecar-state')).to_have_text("serving")
    page.get_by_role("button", name="Terminations").click()
    shot(page, "terminations")

    # The record: verified, every call, filterable; its HAR lines up with it entry by entry.
    row.get_by_role("button", name="Open record").click()
    expect(page.locator("#record-summary")).to_contain_text("verified")
    (record,) = w.cp.client().request("GET", "/v1/records")
    calls = page.get_by_role("table", name="Calls in this record")
    expect(calls.locator("tbody tr")).to_have_count(len(record["calls"]))
    page.get_by_label("Resolution").select_option("unknown")
    expect(calls.locator("tbody tr")).to_have_count(sum(c["resolution"] == "unknown" for c in record["calls"]))
    expect(calls.locator("tbody tr").first).to_contain_text("/hang")
    shot(page, "record")
    expect(page.locator("#records-checkpoint")).to_contain_text("Checkpoint: tether/records, 1 record(s)")
    expect(page.locator(f'tr[data-record="{record["record_id"]}"] td.proved')).to_have_text("in the checkpoint")
    with page.expect_download() as info:
        page.get_by_role("link", name="Download the HAR of this record's calls").click()
    har = json.loads(Path(info.value.path()).read_text())
    check_har_against_record(har, record)

    # The audit surface: two files side by side, what widened.
    surface = w.cp.client().request("GET", "/v1/audit/surface")
    wider = json.loads(json.dumps(surface))
    wider["agents"]["lead"]["echo.any"]["tier"] = "direct"
    (tmp_path / "old.json").write_text(json.dumps(surface))
    (tmp_path / "new.json").write_text(json.dumps(wider))
    page.get_by_role("button", name="Audit").click()
    page.get_by_label("Old surface").set_input_files(str(tmp_path / "old.json"))
    page.get_by_label("New surface").set_input_files(str(tmp_path / "new.json"))
    page.get_by_role("button", name="Compare").click()
    expect(page.get_by_role("list", name="What widened").get_by_role("listitem")).to_have_text(
        ["lead: echo.any approval -> direct (tier raised)"])
    shot(page, "audit")

    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_label("Admin token")).to_be_visible()
    context.close()


def check_har_against_record(har: dict[str, Any], record: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(HAR_SCHEMA).validate(har)
    entries = har["log"]["entries"]
    started = [e["startedDateTime"] for e in entries]
    assert started == sorted(started), "entries in time order"
    captured = {c["capture_ref"]: c for c in record["calls"] if c.get("capture_ref")}
    assert len(entries) == len(captured) and captured
    for entry in entries:
        tag = entry["_tether"]
        call = captured[tag["capture_ref"]]
        assert (tag["agent"], tag["call_id"], tag["capability"], tag["resolution"]) == (
            call["agent"], call["call_id"], call["capability"], call["resolution"])
        assert entry["request"]["method"] == call["method"] and entry["request"]["url"] == call["url"]
        response = entry["response"]
        if call["resolution"] == "refused":  # tether answered: its refusal is the response
            assert response["status"] == 403 and any(h["name"].lower() == "tether-error" for h in response["headers"])
        elif call["resolution"] != "completed":  # cut: no answer came back
            assert response["status"] == 0 and response["content"] == {"size": 0, "mimeType": "x-unknown"}
            assert response["_error"].startswith(f"tether: {call['resolution']}")
            assert entry["time"] == pytest.approx((call["ended_at"] - call["started_at"]) * 1000, abs=1.0)
    assert any(e["_tether"]["resolution"] == "unknown" for e in entries), "the cut call is in the HAR"


def test_wrong_tokens_are_throttled_per_client(world: World) -> None:
    url = world.cp.url
    for _ in range(10):
        status, _, body = http(f"{url}/ui/session", "POST", {"token": "guess"})
        assert status == 401, body
    status, headers, body = http(f"{url}/ui/session", "POST", {"token": ADMIN_TOKEN})  # even the right one waits
    assert status == 429 and body["error"]["code"] == "tether.rate_limited" and body["error"]["retry_after_s"] > 0
    assert headers["Tether-Error"] == "tether.rate_limited"
    assert "agents" in world.cp.client().request("GET", "/v1/agents")  # the bearer token is not throttled
