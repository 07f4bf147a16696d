"""The console on a phone and on a wide screen, every view and every object at its own address, search over
agents and calls, and one call's page with its captured request and response, redacted as captured.

Real processes (a control plane reading the sidecars' captures, three sidecars, a tool server) and Debian's
Chromium through Playwright. Each page is loaded at its own address (so a reload, or a link, lands there) and
checked at 360, 390, 1280 and 1440 px wide: the document is no wider than the window, and every control on
it is on screen and clickable (the element at the centre of each is the control itself, after scrolling it
into view). Over plain HTTP: the calls search, the call view, and the page routes.
"""

from __future__ import annotations

import json
import os
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import requests

from . import harness
from .conftest import World, build_world, teardown_world
from .harness import ADMIN_TOKEN, wait_until
from .test_console import HAR_SCHEMA, browser, shot  # noqa: F401  (browser: the fixture, Debian's chromium)

VIEWPORTS = ((390, 844), (1440, 900), (360, 740), (1280, 800))
LONG = "summarizer-" + "0123456789" * 5  # a long agent id: it must wrap, never widen the page
SECRET, PASSWORD = "s3cret-bearer-token", "hunter2-password"
WAIT = 30


@dataclass
class Rich:
    world: World
    lead: Any
    calls: dict[str, dict[str, Any]] = field(default_factory=dict)  # what each call was for -> its report
    approval: dict[str, Any] = field(default_factory=dict)
    termination: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)


def http(url: str, admin: bool = True) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"} if admin else {})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.fixture(scope="module")
def rich(tmp_path_factory: pytest.TempPathFactory, test_ca: harness.TestCA) -> Iterator[Rich]:
    """A tree of three (one with a long id), a completed call carrying secrets, a refused call, a held call
    waiting for a decision, and the middle agent's subtree terminated with a call cut in flight."""
    w = build_world(tmp_path_factory.mktemp("layout"), test_ca)
    os.environ["TETHER_CAPTURES"] = str(w.cp.directory / "sidecars")
    try:
        w.cp.start()
    finally:
        del os.environ["TETHER_CAPTURES"]
    held: threading.Thread | None = None
    try:
        admin = w.cp.client()
        lead = w.cp.issue("lead", {"echo.any": "approval", "issues.read": "direct", "issues.write": "direct",
                                   "hang.read": "direct"})
        mid = w.cp.delegate(lead, LONG, {"issues.read": "direct", "issues.write": "direct", "hang.read": "direct"})
        leaf = w.cp.delegate(mid, "helper", {"issues.read": "direct"})
        sc_lead, sc_mid, sc_leaf = w.sidecar(lead), w.sidecar(mid), w.sidecar(leaf)
        base = f"{w.tools.base}/repos/acme/site/issues"
        assert requests.get(base, proxies=sc_lead.proxies(), timeout=WAIT).status_code == 200
        secret = requests.post(base, json={"title": "T-9", "password": PASSWORD}, proxies=sc_mid.proxies(),
                               headers={"Authorization": f"Bearer {SECRET}"}, timeout=WAIT)
        assert secret.status_code == 200 and secret.json()["authorization_seen"]
        refused = requests.post(base, json={"title": "no"}, proxies=sc_leaf.proxies(), timeout=WAIT)
        assert refused.headers["Tether-Error"] == "tether.capability_absent"
        held = threading.Thread(target=lambda: requests.post(f"{w.tools.base}/echo", json={"ticket": "T-10"},
                                                             proxies=sc_lead.proxies(), timeout=600), daemon=True)
        held.start()

        def hang() -> None:
            try:
                requests.get(f"{w.tools.base}/hang", proxies=sc_mid.proxies(), timeout=WAIT)
            except requests.RequestException:
                pass  # the abort cuts it

        cut = threading.Thread(target=hang, daemon=True)
        cut.start()
        wait_until(lambda: w.tools.hits_for("/hang") == 1, WAIT, what="the /hang call to reach the tool")
        (approval,) = wait_until(lambda: admin.request("GET", "/v1/approvals?status=pending"), WAIT, what="held")
        term = admin.request("POST", f"/v1/agents/{LONG}/terminate", {"mode": "abort", "window_s": 2,
                                                                       "reason": "layout test"})
        (record,) = wait_until(lambda: admin.request("GET", "/v1/records"), 60, what="the record")
        cut.join(WAIT)
        reports = wait_until(lambda: (r := admin.request("GET", "/v1/reports")) and len(r) >= 4 and r, WAIT,
                             what="the reports")
        by = {"secret": next(r for r in reports if r["agent"] == LONG and r["method"] == "POST"),
              "refused": next(r for r in reports if r["resolution"] == "refused"),
              "cut": next(r for r in reports if r["url"].endswith("/hang")),
              "lead": next(r for r in reports if r["agent"] == "lead")}
        yield Rich(w, lead, by, approval, admin.request("GET", f"/v1/terminations/{term['termination_id']}"),
                   record)
    finally:
        for a in w.cp.client().request("GET", "/v1/approvals?status=pending"):
            w.cp.client().request("POST", f"/v1/approvals/{a['id']}/deny")  # lets the held call go
        if held is not None:
            held.join(WAIT)
        teardown_world(w)


def sign_in(page: Any) -> None:
    page.get_by_label("Operator or admin token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()


LAYOUT = """(scope) => {
  const root = scope ? document.querySelector(scope) : document;
  const problems = [];
  const width = document.documentElement.scrollWidth;
  if (width > window.innerWidth) problems.push(`the page is ${width} px wide in a ${window.innerWidth} px window`);
  let checked = 0;
  for (const el of root.querySelectorAll("a[href], button, input, select, textarea, summary")) {
    if (!el.checkVisibility({ visibilityProperty: true })) continue;
    el.scrollIntoView({ block: "center", inline: "center" });
    const r = [...el.getClientRects()].find((b) => b.width > 0 && b.height > 0);
    if (!r) continue;
    const label = el.getAttribute("aria-label") || el.textContent || el.value || el.id || "";
    const name = `${el.tagName.toLowerCase()} "${label.trim().slice(0, 50)}"`;
    if (r.left < -0.5 || r.right > window.innerWidth + 0.5) problems.push(`${name} reaches past the window`);
    const hit = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
    if (!hit || !(hit === el || el.contains(hit))) {
      const over = hit ? `${hit.tagName} ${hit.id} ${hit.className}` : "nothing";
      problems.push(`${name}: its centre is covered by ${over}`);
    }
    checked += 1;
  }
  window.scrollTo(0, 0);
  return { problems, checked };
}"""


def check_layout(page: Any, where: str, scope: str | None = None, minimum: int = 3) -> None:
    """At every viewport: no horizontal scroll, every control on screen and clickable."""
    for width, height in VIEWPORTS:
        page.set_viewport_size({"width": width, "height": height})
        result = page.evaluate(LAYOUT, scope)
        assert not result["problems"], f"{where} at {width}x{height}: " + "; ".join(result["problems"])
        assert result["checked"] >= minimum, f"{where} at {width}x{height}: only {result['checked']} controls"
    page.set_viewport_size({"width": 1440, "height": 900})


def phone_shot(page: Any, name: str) -> None:
    page.set_viewport_size({"width": 390, "height": 844})
    shot(page, name)
    page.set_viewport_size({"width": 1440, "height": 900})


def test_every_page_fits_from_360_px_to_wide_and_every_control_is_clickable(rich: Rich, browser: Any,  # noqa: F811
                                                                            tmp_path: Path) -> None:
    from playwright.sync_api import expect

    w, calls = rich.world, rich.calls
    url = w.cp.url
    context = browser.new_context(viewport={"width": 390, "height": 844})
    page = context.new_page()

    # Signed out, at an object's address: only the sign-in shows (the views' links stay hidden), and signing
    # in lands on that object.
    page.goto(f"{url}/ui/calls/{calls['secret']['call_id']}")
    expect(page.get_by_label("Operator or admin token")).to_be_visible()
    expect(page.get_by_role("navigation", name="Views")).to_be_hidden()
    expect(page.get_by_role("search")).to_be_hidden()
    check_layout(page, "sign-in", minimum=2)
    sign_in(page)
    expect(page.get_by_label("Captured request")).to_be_visible()
    phone_shot(page, "phone-call")

    apr, rec = rich.approval["id"], rich.record["record_id"]
    pages = [  # address, what shows when it has loaded, the title's start
        ("/ui/agents", 'table[aria-label="Agent tree"] tr[data-agent="helper"]', "Agents"),
        (f"/ui/agents/{LONG}", ".agent-name", LONG),
        ("/ui/approvals", "article.approval", "Approvals"),
        (f"/ui/approvals/{apr}", f'article[data-approval="{apr}"]', apr),
        ("/ui/calls", 'table[aria-label="Calls"] tbody tr', "Calls"),
        ("/ui/calls?resolution=refused", 'table[aria-label="Calls"] tbody tr', "Calls"),
        (f"/ui/calls/{calls['secret']['call_id']}", 'pre[aria-label="Captured response"]', calls["secret"]["call_id"]),
        (f"/ui/calls/{calls['cut']['call_id']}", 'pre[aria-label="Captured response"]', calls["cut"]["call_id"]),
        ("/ui/terminations", 'table[aria-label="Terminations"]', "Terminations"),
        (f"/ui/terminations/{rich.termination['id']}", "ol.steps", rich.termination["id"]),
        ("/ui/records", 'table[aria-label="Records"]', "Records"),
        (f"/ui/records/{rec}", 'table[aria-label="Calls in this record"]', rec),
        ("/ui/search?q=helper", 'table[aria-label="Matching agents"]', "helper"),
    ]
    for path, ready, title in pages:
        page.goto(url + path)  # a fresh load of the address: what a reload or a followed link does
        expect(page.locator(ready).first).to_be_visible(timeout=WAIT * 1000)
        assert page.title().startswith(title), (path, page.title())
        view = path.split("/")[2].split("?")[0]
        current = page.get_by_role("navigation", name="Views").locator('[aria-current="page"]')
        if view != "search":
            expect(current).to_have_attribute("data-view", view)
        check_layout(page, path)
        if path == "/ui/agents":
            phone_shot(page, "phone-agents")

    # The confirmation dialog, on a phone as on a wide screen.
    page.goto(f"{url}/ui/agents")
    page.get_by_role("button", name="Terminate lead").click()
    dialog = page.get_by_role("dialog")
    expect(dialog.get_by_label("Mode")).to_be_visible()
    check_layout(page, "the terminate dialog", scope="dialog[open]")
    dialog.get_by_role("button", name="Cancel").click()
    expect(dialog).to_be_hidden()
    # The tree is drawn anew as heartbeats come in; the control that had the focus keeps it.
    page.get_by_role("button", name="Revoke lead").focus()
    page.evaluate("window.tetherTree = document.querySelector('#agents-body table')")
    page.wait_for_function("() => document.querySelector('#agents-body table') !== window.tetherTree",
                           timeout=WAIT * 1000)
    assert page.evaluate("document.activeElement.getAttribute('aria-label')") == "Revoke lead"

    # The audit panes side by side (one above the other on a narrow screen), never wider than the window.
    surface = w.cp.client().request("GET", "/v1/audit/surface")
    wider = json.loads(json.dumps(surface))
    wider["agents"]["lead"]["echo.any"]["tier"] = "direct"
    long_name = "a.capability." + "with-a-very-long-name-" * 8  # a long line in each pane
    wider["agents"]["lead"][long_name] = dict(surface["agents"]["lead"]["issues.read"])
    (tmp_path / "old.json").write_text(json.dumps(surface))
    (tmp_path / "new.json").write_text(json.dumps(wider))
    page.goto(f"{url}/ui/audit")
    page.get_by_label("Old surface").set_input_files(str(tmp_path / "old.json"))
    page.get_by_label("New surface").set_input_files(str(tmp_path / "new.json"))
    page.get_by_role("button", name="Compare").click()
    expect(page.get_by_role("list", name="What widened").get_by_role("listitem").first).to_be_visible()
    check_layout(page, "/ui/audit with a diff")
    context.close()


def test_the_call_page_shows_the_captured_exchange_redacted(rich: Rich, browser: Any) -> None:  # noqa: F811
    from playwright.sync_api import expect

    url, secret = rich.world.cp.url, rich.calls["secret"]
    context = browser.new_context(viewport={"width": 1440, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page.goto(f"{url}/ui/")
    sign_in(page)
    # Search from the header: the agent by the start of its jti, the call by its capability and code.
    page.get_by_role("searchbox", name="Search agents and calls").fill(rich.lead.jti[:10])
    page.get_by_role("search", name="Search agents and calls").get_by_role("button", name="Search").click()
    expect(page).to_have_url(f"{url}/ui/search?q={rich.lead.jti[:10]}")
    expect(page.get_by_role("table", name="Matching agents").locator("tbody tr")).to_have_count(1)
    expect(page.get_by_role("table", name="Matching agents").locator('tr[data-agent="lead"]')).to_be_visible()
    page.get_by_role("searchbox", name="Search agents and calls").fill("issues.write capability_absent")
    page.get_by_role("searchbox", name="Search agents and calls").press("Enter")
    found = page.get_by_role("table", name="Matching calls").locator("tbody tr")
    expect(found).to_have_count(1)
    expect(found.first.locator(".resolution")).to_have_text("refused tether.capability_absent")

    # The calls view: the secret call, opened from its row.
    page.get_by_role("navigation", name="Views").get_by_role("link", name="Calls").click()
    page.get_by_label("Agent", exact=True).fill(LONG)
    expect(page).to_have_url(re.compile(rf".*/ui/calls\?agent={LONG}$"))
    rows = page.get_by_role("table", name="Calls").locator("tbody tr")
    expect(rows).to_have_count(sum(1 for c in rich.world.cp.client().request("GET", "/v1/reports")
                                   if c["agent"] == LONG))
    rows.filter(has_text="POST").get_by_role("link", name=secret["call_id"]).click()
    expect(page).to_have_url(f"{url}/ui/calls/{secret['call_id']}")
    request, response = page.get_by_label("Captured request"), page.get_by_label("Captured response")
    expect(request).to_contain_text(f"POST {secret['url']} HTTP/1.1")
    expect(request).to_contain_text("Authorization: [REDACTED]")
    expect(request).to_contain_text('"password": "[REDACTED]"')
    expect(request).to_contain_text('"title": "T-9"')
    expect(response).to_contain_text("HTTP/1.1 200 OK")
    expect(response).to_contain_text('"authorization_seen": true')
    text = page.locator("main").inner_text()
    assert SECRET not in text and PASSWORD not in text
    expect(page.locator(".call-resolution")).to_have_text("completed")
    expect(page.locator("main")).to_contain_text(rich.record["record_id"])
    shot(page, "call")
    with page.expect_download() as info:
        page.get_by_role("link", name="Download this call's HAR").click()
    har = json.loads(Path(info.value.path()).read_text())
    jsonschema.Draft202012Validator(HAR_SCHEMA).validate(har)
    (entry,) = har["log"]["entries"]
    assert entry["_tether"]["call_id"] == secret["call_id"] and SECRET not in json.dumps(har)

    # A cut call: no response, and the record's word for it.
    page.goto(f"{url}/ui/calls/{rich.calls['cut']['call_id']}")
    expect(page.get_by_label("Captured response")).to_contain_text("no response: tether: unknown (tether.aborted)")
    expect(page.locator(".call-resolution")).to_have_text("unknown tether.aborted")
    # An object that is not there: said so, not an empty page.
    for path in ("calls/no-such-call", "records/rec-none", "approvals/apr-none", "terminations/term-none"):
        page.goto(f"{url}/ui/{path}")
        expect(page.get_by_role("alert")).to_contain_text("tether.not_found")
    page.goto(f"{url}/ui/agents/nobody")
    expect(page.get_by_role("alert")).to_contain_text("No registered link is held by nobody")
    context.close()


def test_calls_search_and_the_call_view_over_http(rich: Rich) -> None:
    url, calls = rich.world.cp.url, rich.calls
    status, headers, body = http(f"{url}/v1/calls")
    listed = json.loads(body)
    assert status == 200 and int(headers["Tether-Total"]) == len(listed) >= 4
    assert [c["started_at"] for c in listed] == sorted((c["started_at"] for c in listed), reverse=True)
    # Every word must match, in any field; agent and resolution narrow; pages add up.
    status, headers, body = http(f"{url}/v1/calls?q=REFUSED+capability_absent+helper")
    assert [c["call_id"] for c in json.loads(body)] == [calls["refused"]["call_id"]]
    status, headers, body = http(f"{url}/v1/calls?agent=lead&resolution=completed")
    assert {c["call_id"] for c in json.loads(body)} == {calls["lead"]["call_id"]}
    first = json.loads(http(f"{url}/v1/calls?limit=2")[2])
    rest = json.loads(http(f"{url}/v1/calls?offset=2")[2])
    assert [c["call_id"] for c in first + rest] == [c["call_id"] for c in listed]
    status, headers, body = http(f"{url}/v1/calls?offset=-1")
    assert status == 400 and headers["Tether-Error"] == "tether.bad_request"

    status, _, body = http(f"{url}/v1/calls/{calls['secret']['call_id']}")
    view = json.loads(body)
    assert status == 200 and view["call"]["call_id"] == calls["secret"]["call_id"] and view["capture_note"] is None
    assert view["records"] == [{"record_id": rich.record["record_id"],
                                "termination_id": rich.record["termination_id"]}]
    capture = view["capture"]
    assert capture["request"]["method"] == "POST" and capture["response"]["status"] == 200
    assert SECRET not in body.decode() and PASSWORD not in body.decode()
    status, headers, body = http(f"{url}/v1/calls/no-such-call")
    assert status == 404 and headers["Tether-Error"] == "tether.not_found"
    assert http(f"{url}/v1/calls", admin=False)[0] == 401

    # The page is served at every view's address, with the console's headers; anything else is not a page.
    for path in ("/ui/agents", f"/ui/agents/{LONG}", "/ui/calls/x", "/ui/search", "/ui/records/rec-1"):
        status, headers, body = http(url + path, admin=False)
        assert status == 200 and headers["Content-Type"].startswith("text/html"), path
        assert "frame-ancestors 'none'" in headers["Content-Security-Policy"] and b"/ui/static/main.js" in body
    assert http(f"{url}/ui/nowhere", admin=False)[0] == 404
    status, headers, body = http(f"{url}/ui/session", admin=False)  # still the session route
    assert status == 401 and headers["Tether-Error"] == "tether.unauthorized"


def test_a_control_plane_without_captures_says_so_on_the_call(world: World) -> None:
    ident = world.cp.issue("plain", {"issues.read": "direct"})
    sc = world.sidecar(ident)
    requests.get(f"{world.tools.base}/repos/acme/site/issues", proxies=sc.proxies(), timeout=WAIT)
    (report,) = wait_until(lambda: world.cp.client().request("GET", "/v1/reports"), WAIT, what="the report")
    status, _, body = http(f"{world.cp.url}/v1/calls/{report['call_id']}")
    view = json.loads(body)
    assert status == 200 and view["capture"] is None and "TETHER_CAPTURES" in view["capture_note"]
