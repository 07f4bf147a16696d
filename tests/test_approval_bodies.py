"""The approver sees everything that will leave, or the call does not go (issue 23, "Blind approvals").

Real parts: a sidecar process in front of an aiohttp echo server and the MCP SDK's server, the control plane as a
process. Before: an approval-tier call with a chunked body was held at its headers ("-1 bytes, first 0 shown")
and once approved a 1.2 MB body nobody saw went out; MCP arguments past 16 KiB were cut in the approval view;
another agent's key could file enough approvals to push a real held call off the Approvals page (50 newest
shown). Now a held body is read whole (up to ``APPROVAL_BODY_LIMIT``) and shown whole, a longer one is refused
(``tether.approval_body_too_large``) before a byte reaches the tool, pending approvals are capped per run
(``tether.approval_queue_full``), listings page to their end and count per agent, and a request filed with an
agent's key is told apart from a call its sidecar holds.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from tether.capability.events import APPROVAL_BODY_LIMIT
from tether.controlplane.client import Signer
from tether.controlplane.services.approvals import MAX_PENDING_PER_LINK, MAX_PENDING_PER_RUN

from . import harness
from .conftest import World, build_world, teardown_world
from .harness import Identity, reports_for, wait_until
from .test_api_hostile import send, signer
from .test_mcp import LiveAgent, proxy_env

WAIT = 60.0  # generous: the machine is loaded; nothing here asserts on timing


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, test_ca: harness.TestCA) -> Iterator[World]:
    w = build_world(tmp_path_factory.mktemp("approval-bodies"), test_ca)
    w.cp.start()
    try:
        yield w
    finally:
        teardown_world(w)


def pending_of(world: World, agent: str) -> list[dict[str, Any]]:
    return world.cp.client().request("GET", f"/v1/approvals?status=pending&agent={agent}")


def one_pending(world: World, agent: str) -> dict[str, Any]:
    return wait_until(lambda: (p := pending_of(world, agent)) and p[0], WAIT, what=f"{agent}'s approval")


def chunks(data: bytes, size: int = 64 * 1024) -> Iterator[bytes]:
    """A generator body: requests sends it chunked (no Content-Length)."""
    for start in range(0, len(data), size):
        yield data[start:start + size]


def text_body(n: int) -> bytes:
    line = b'{"ticket": "T-1", "note": "the part after any cut is what an approver must see"}\n'
    return (line * (n // len(line) + 1))[:n - 6] + b"THEEND"


# -- bodies ----------------------------------------------------------------------------------------------------
def test_a_chunked_upload_is_read_whole_shown_whole_and_forwarded_once_approved(world: World) -> None:
    sc = world.sidecar(world.cp.issue("chunked", {"echo.any": "approval"}))
    body = text_body(300_000)  # chunked, and far past the 16 KiB the view used to show
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(requests.post, f"{world.tools.base}/echo", data=chunks(body), proxies=sc.proxies(),
                           timeout=WAIT + 30, headers={"Content-Type": "application/json"})
        approval = one_pending(world, "chunked")
        req = approval["request"]
        headers = {k.lower(): v for k, v in req["headers"]}
        assert headers.get("transfer-encoding") == "chunked", headers  # it was streamed by the agent
        assert req["body_size"] == len(body) and not req["body_truncated"] and not req["body_streamed"], req
        assert req["body_encoding"] == "text" and req["body"].encode() == body
        assert world.tools.hits_for("/echo") == 0 and not held.done()

        out = subprocess.run([sys.executable, "-m", "tether", "approvals", "show", approval["id"]], env=world.cp.env(),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert f"-- body: {len(body)} bytes, whole" in out.stdout and "THEEND" in out.stdout

        # Its sidecar reports the call held (the next heartbeat): a held call, not a filed request.
        wait_until(lambda: pending_of(world, "chunked")[0]["origin"] == "held", WAIT, what="origin held")
        world.cp.client().request("POST", f"/v1/approvals/{approval['id']}/approve", {"call_hash": req["call_hash"]})
        resp = held.result(timeout=WAIT)
    assert resp.status_code == 200, resp.text
    assert resp.json()["body"].encode() == body  # what left is what was shown
    assert world.tools.hits_for("/echo") == 1


@pytest.mark.parametrize("how", ["chunked", "content-length"])
def test_a_body_past_the_limit_is_refused_and_never_reaches_the_tool(world: World, how: str) -> None:
    agent = f"too-large-{how}"
    sc = world.sidecar(world.cp.issue(agent, {"echo.any": "approval"}))
    body = text_body(1_200_000)
    assert len(body) > APPROVAL_BODY_LIMIT
    before = world.tools.hits_for("/echo")
    data: Any = chunks(body) if how == "chunked" else body
    resp = requests.post(f"{world.tools.base}/echo", data=data, proxies=sc.proxies(), timeout=WAIT)
    assert resp.status_code == 413, resp.text
    assert resp.headers["Tether-Error"] == "tether.approval_body_too_large"
    error = resp.json()["error"]
    assert error["code"] == "tether.approval_body_too_large" and error["limit"] == APPROVAL_BODY_LIMIT
    assert str(APPROVAL_BODY_LIMIT) in error["message"]
    assert world.tools.hits_for("/echo") == before  # nothing reached the tool
    assert pending_of(world, agent) == [] and world.cp.client().request(
        "GET", f"/v1/approvals?agent={agent}") == []  # and no person was asked to approve what they cannot see
    (report,) = wait_until(lambda: reports_for(world.cp, agent), WAIT, what="the refusal's report")
    assert report["resolution"] == "refused" and report["code"] == "tether.approval_body_too_large"


def raw_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The first final answer on a raw socket: status, headers (lower-case names), body (by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the sidecar closed without an answer: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    while len(rest) < int(headers.get("content-length", "0")):
        more = sock.recv(65536)
        if not more:
            break
        rest += more
    return int(head.split(b" ", 2)[1]), headers, rest


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(world: World) -> None:
    """The refusal comes while the body is still being sent: it never ends here (no last chunk), so a refusal
    that waited for the whole body would never come."""
    agent = "too-large-unfinished"
    sc = world.sidecar(world.cp.issue(agent, {"echo.any": "approval"}))
    before = world.tools.hits_for("/echo")
    host, port = sc.proxy.removeprefix("http://").rsplit(":", 1)
    piece = b"x" * 65536
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        sock.sendall(f"POST {world.tools.base}/echo HTTP/1.1\r\nHost: {world.tools.base.split('//')[1]}\r\n"
                     "Transfer-Encoding: chunked\r\nContent-Type: text/plain\r\n\r\n".encode())
        for _ in range(APPROVAL_BODY_LIMIT // len(piece) + 2):  # just past the limit, and no last chunk
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        status, headers, body = raw_answer(sock)
    assert status == 413 and headers["tether-error"] == "tether.approval_body_too_large", (status, body)
    assert headers.get("connection") == "close", headers
    assert json.loads(body)["error"]["limit"] == APPROVAL_BODY_LIMIT
    assert world.tools.hits_for("/echo") == before and pending_of(world, agent) == []
    (report,) = wait_until(lambda: reports_for(world.cp, agent), WAIT, what="the refusal's report")
    assert report["resolution"] == "refused" and report["code"] == "tether.approval_body_too_large"


def test_an_announced_body_past_the_limit_that_waits_for_100_continue_is_refused_at_once(world: World) -> None:
    agent = "too-large-expect"
    sc = world.sidecar(world.cp.issue(agent, {"echo.any": "approval"}))
    host, port = sc.proxy.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT) as sock:
        sock.sendall(f"POST {world.tools.base}/echo HTTP/1.1\r\nHost: {world.tools.base.split('//')[1]}\r\n"
                     f"Content-Length: {APPROVAL_BODY_LIMIT + 1}\r\nExpect: 100-continue\r\n\r\n".encode())
        status, headers, _ = raw_answer(sock)  # no 100 first, and no body sent: the refusal cannot wait for one
    assert status == 413 and headers["tether-error"] == "tether.approval_body_too_large", headers


def test_a_20_kb_mcp_argument_is_shown_whole(world: World) -> None:
    sc = world.sidecar(world.cp.issue("mcp-long", {"mcp.add": "direct", "mcp.send": "approval"}))
    text = "".join(f"line {i:05d}: the approver reads every word of this message\n" for i in range(400)) + "THEEND"
    assert len(text.encode()) > 20_000
    live = LiveAgent(world.mcp.url, proxy_env(sc.proxy, sc.ca), "auto")
    try:
        live.send({"op": "call", "name": "send_email", "args": {"to": "ops@example.org", "body": text}})
        approval = one_pending(world, "mcp-long")
        req = approval["request"]
        assert not req["body_truncated"] and req["body_size"] > 20_000
        message = json.loads(req["body"])  # the JSON-RPC request, whole: it parses
        assert message["method"] == "tools/call" and message["params"]["arguments"]["body"] == text
        assert "send_email" not in world.mcp.calls
        world.cp.client().request("POST", f"/v1/approvals/{approval['id']}/approve", {"call_hash": req["call_hash"]})
        answer = live.read(WAIT)
        assert answer["ok"] and answer["text"] == "sent to ops@example.org", answer
        assert world.mcp.calls.count("send_email") == 1
    finally:
        live.close()


# -- the queue: a flood of filed requests never hides a held call -------------------------------------------
def fake_request(world: World, i: int) -> dict[str, Any]:
    url = f"{world.tools.base}/echo"
    return {"call_id": f"filed-{i}", "capability": "echo.any", "method": "POST", "url": url,
            "request": {"method": "POST", "url": url, "headers": [["content-type", "application/json"]],
                        "body": '{"approve": "me"}', "body_encoding": "text", "body_size": 17,
                        "call_hash": "sha256:" + f"{i:064x}"}}


def file_as(world: World, s: Signer, i: int) -> tuple[int, dict[str, str], Any]:
    return send(world.cp, "POST", "/v1/approvals", json.dumps(fake_request(world, i)).encode(), sign=s)


def sibling_signer(world: World, ident: Identity, run: str) -> Signer:
    base = signer(ident)
    return Signer(base.agent, base.link, base.key, run)


@pytest.fixture(scope="module")
def flooded(world: World) -> dict[str, Any]:
    """A real held call from ``coder``, then 60 requests filed with its sibling's key (two runs of 30: each run may
    have ``MAX_PENDING_PER_RUN`` pending)."""
    lead = world.cp.issue("lead", {"echo.any": "approval"})
    coder = world.cp.delegate(lead, "coder", {"echo.any": "approval"})
    sibling = world.cp.delegate(lead, "sibling", {"echo.any": "approval"})
    sc = world.sidecar(coder)
    pool = ThreadPoolExecutor(1)
    held = pool.submit(requests.post, f"{world.tools.base}/echo", json={"deploy": "prod"}, proxies=sc.proxies(),
                       timeout=300)
    real = one_pending(world, "coder")
    s = signer(sibling)
    assert send(world.cp, "POST", "/v1/chains/register", json.dumps({"chain": sibling.wire}).encode(), sign=s)[0] == 200
    runs = [sibling_signer(world, sibling, f"run-sibling-{n}") for n in range(3)]
    for i in range(MAX_PENDING_PER_RUN):
        status, _, doc = file_as(world, runs[0], i)
        assert status == 201, doc
    full = file_as(world, runs[0], 999)
    for i in range(MAX_PENDING_PER_RUN, 60):
        status, _, doc = file_as(world, runs[1], i)
        assert status == 201, doc
    yield {"real": real, "held": held, "full": full, "runs": runs, "sibling": sibling}
    world.cp.client().request("POST", f"/v1/approvals/{real['id']}/deny")
    held.result(timeout=60)
    pool.shutdown()


def test_a_run_past_its_queue_is_refused_with_the_code(world: World, flooded: dict[str, Any]) -> None:
    status, headers, doc = flooded["full"]
    assert status == 429 and headers["Tether-Error"] == "tether.approval_queue_full", doc
    assert doc["error"]["code"] == "tether.approval_queue_full" and doc["error"]["limit"] == MAX_PENDING_PER_RUN
    assert f"{MAX_PENDING_PER_RUN} calls waiting" in doc["error"]["message"]
    calls = {a["call_id"] for a in pending_of(world, "sibling")}
    assert "filed-999" not in calls and len(calls) == 60


def test_the_held_call_stays_in_sight_with_paging_and_counts(world: World, flooded: dict[str, Any]) -> None:
    admin = world.cp.client()
    real = flooded["real"]
    summary = wait_until(lambda: (s := admin.request("GET", "/v1/approvals/summary"))["agents"].get(
        "coder", {}).get("held") == 1 and s, WAIT, what="the held call counted as held")
    assert summary["agents"]["coder"] == {"pending": 1, "held": 1, "filed": 0}
    assert summary["agents"]["sibling"] == {"pending": 60, "held": 0, "filed": 60}
    assert summary["limits"] == {"per_run": MAX_PENDING_PER_RUN, "per_link": MAX_PENDING_PER_LINK}

    # The first page, whatever its size, starts with the held call: the 60 newer filed requests come after it.
    first = admin.request("GET", "/v1/approvals?status=pending&limit=20")
    assert first[0]["id"] == real["id"] and first[0]["origin"] == "held"
    assert {a["origin"] for a in first[1:]} == {"filed"}
    # Paging reaches every one of them, and the total says how many there are.
    seen: list[str] = []
    offset = 0
    while True:
        status, headers, page = send(world.cp, "GET", f"/v1/approvals?status=pending&offset={offset}&limit=25",
                                     admin=True)
        assert status == 200 and int(headers["Tether-Total"]) == summary["pending"]
        if not page:
            break
        seen += [a["id"] for a in page]
        offset += 25
    assert len(seen) == len(set(seen)) == summary["pending"] and real["id"] in seen
    # Filters: per agent, per origin.
    assert [a["id"] for a in admin.request("GET", "/v1/approvals?agent=coder")] == [real["id"]]
    assert len(admin.request("GET", "/v1/approvals?status=pending&origin=filed&agent=sibling")) == 60
    assert admin.request("GET", "/v1/approvals?status=pending&origin=held&agent=sibling") == []


def test_tether_approvals_list_shows_every_pending_one_and_the_counts(world: World, flooded: dict[str, Any]) -> None:
    wait_until(lambda: world.cp.client().request("GET", f"/v1/approvals/{flooded['real']['id']}")["origin"] == "held",
               WAIT, what="origin held")
    out = subprocess.run([sys.executable, "-m", "tether", "approvals", "list"], env=world.cp.env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    listed = [line for line in out.stdout.splitlines() if line.startswith("apr-")]
    assert len(listed) == 61  # every pending one, none hidden (the tests before left nothing pending)
    assert listed[0].startswith(flooded["real"]["id"]) and " held " in listed[0]
    assert sum(1 for line in listed if " sibling " in line and " filed " in line) == 60
    assert "61 pending (1 held by a sidecar, 60 filed without a held call):" in out.stdout
    counts = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("  ")}
    assert "60  (0 held, 60 filed)" in counts["sibling"] and "1  (1 held, 0 filed)" in counts["coder"]

    only = subprocess.run([sys.executable, "-m", "tether", "approvals", "list", "--agent", "coder", "--origin", "held"],
                          env=world.cp.env(), capture_output=True, text=True, timeout=60)
    assert [line.split()[0] for line in only.stdout.splitlines() if line.startswith("apr-")] == [flooded["real"]["id"]]


def test_a_link_past_its_queue_is_refused_whatever_run_it_names(world: World, flooded: dict[str, Any]) -> None:
    """A key can name a new run on every request: the link's own cap still holds."""
    sibling = flooded["sibling"]
    filed = 60
    n = 0
    while filed < MAX_PENDING_PER_LINK:
        status, _, doc = file_as(world, sibling_signer(world, sibling, f"run-many-{n}"), 1000 + n)
        assert status == 201, doc
        filed, n = filed + 1, n + 1
    status, _, doc = file_as(world, sibling_signer(world, sibling, "run-one-more"), 5000)
    assert status == 429 and doc["error"]["code"] == "tether.approval_queue_full", doc
    assert "link has" in doc["error"]["message"]
    for a in pending_of(world, "sibling"):  # make room again for the tests after this one
        if a["call_id"].startswith("filed-1") and len(a["call_id"]) > 9:
            world.cp.client().request("POST", f"/v1/approvals/{a['id']}/deny")


def test_the_approvals_page_in_a_browser(world: World, flooded: dict[str, Any], tmp_path: Path) -> None:
    from playwright.sync_api import expect

    from .test_console import CHROMIUM, shot

    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent; the console's browser test needs it")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is a dev dependency (.[dev])")
    wait_until(lambda: world.cp.client().request("GET", f"/v1/approvals/{flooded['real']['id']}")["origin"] == "held",
               WAIT, what="origin held")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1366, "height": 900})
            page.goto(f"{world.cp.url}/ui/")
            page.get_by_label("Admin token").fill(harness.ADMIN_TOKEN)
            page.get_by_role("button", name="Sign in").click()
            page.get_by_role("navigation", name="Views").get_by_role("link", name="Approvals").click()
            body = page.locator("#approvals-body")
            # The held call is the first card of the first page, marked as held.
            first = body.locator("article.approval").first
            expect(first).to_have_attribute("data-approval", flooded["real"]["id"], timeout=WAIT * 1000)
            expect(first.locator(".origin")).to_have_text("held call")
            # Counts per agent, filed requests apart.
            counts = page.get_by_role("table", name="Pending approvals per agent")
            expect(counts.locator('tr[data-agent="sibling"] .count-filed')).to_have_text("60")
            expect(counts.locator('tr[data-agent="coder"] .count-held')).to_have_text("1")
            shot(page, "approvals-queue")
            # Paging to the end: every pending one is reachable.
            ids: set[str] = set()
            pager = body.locator("nav.pager").first
            while True:
                expect(body.locator("article.approval").first).to_be_visible()
                ids |= {a.get_attribute("data-approval") for a in body.locator("article.approval").all()}
                next_button = pager.get_by_role("button", name="Next page")
                if next_button.is_disabled():
                    break
                text = pager.locator(".page-of").inner_text()
                next_button.click()
                expect(pager.locator(".page-of")).not_to_have_text(text)
            pending = world.cp.client().request("GET", "/v1/approvals?status=pending")
            assert {a["id"] for a in pending} <= ids
            # One agent at a time.
            counts.get_by_role("button", name="Show only coder").click()
            expect(body.locator("article.approval")).to_have_count(1)
            expect(body.locator("article.approval").first).to_have_attribute("data-approval", flooded["real"]["id"])
        finally:
            browser.close()


def test_the_sidecar_refuses_the_call_when_the_control_plane_will_not_file_it(world: World) -> None:
    """A run whose queue is full (its key filed the rest): its held call is refused with the same code."""
    ident = world.cp.issue("queued", {"echo.any": "approval"})
    sc = world.sidecar(ident)
    run = json.loads((sc.state_dir / "run.json").read_text())["run_id"]  # the sidecar writes its run id there
    s = sibling_signer(world, ident, run)
    for i in range(MAX_PENDING_PER_RUN):
        status, _, doc = file_as(world, s, 7000 + i)
        assert status == 201, doc
    before = world.tools.hits_for("/echo")
    resp = requests.post(f"{world.tools.base}/echo", json={"x": 1}, proxies=sc.proxies(), timeout=WAIT)
    assert resp.status_code == 429 and resp.headers["Tether-Error"] == "tether.approval_queue_full", resp.text
    assert world.tools.hits_for("/echo") == before
