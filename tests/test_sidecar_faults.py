"""The sidecar under faults and hostile input (docs/contract.md sections 1.4 and 5).

A control plane that goes away (the lease fails closed, reports are spooled and arrive once), tools
that fail, reset or hang (that call only, resolved and reported, never retried), and bad input from
the agent (unknown destinations, raw-IP CONNECTs, path traversal, borrowed chains, lying Host headers,
huge headers and bodies). After every fault the sidecar keeps serving other calls.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
import pytest
import requests
from requests.structures import CaseInsensitiveDict

from .conftest import World, teardown_world
from .harness import (
    McpServer,
    SidecarProcess,
    ToolServer,
    free_port,
    prepare_controlplane,
    reports_for,
    wait_until,
)
from .test_sidecar_http import HitsSince, assert_refused, reports_by_call, wait_reports

if TYPE_CHECKING:
    from .harness import TestCA

UNROUTABLE = "10.255.255.1"  # never answers; a proxy that tried to reach it would hang, not refuse


@dataclass
class Faulty:
    world: World
    dead_port: int  # in the catalog (dead.read, dead.tls), nothing listens there


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory, test_ca: TestCA) -> Iterator[Faulty]:
    directory = tmp_path_factory.mktemp("faults-world")
    tools = ToolServer().start()
    secure = ToolServer(tls=test_ca).start()
    mcp = McpServer(port=free_port())  # in the catalog only; these tests speak plain HTTP
    # A lease three times the tests' usual 3 s (the heartbeat, a third of it, still shows a hanging call):
    # these tests push 16 MiB bodies and 200 KB headers through a sidecar, which on a loaded machine can hold
    # its event loop past a 3 s lease; none of them is about the lease (the outage test, which is, runs on the
    # shared `world` with the short one).
    cp = prepare_controlplane(directory / "cp", tools.port, secure.port, mcp.port, lease_ttl=9.0)
    dead = free_port()
    catalog = cp.catalog_path.read_text().replace("\nroles:", (
        f'\n  dead.read: {{http: {{host: 127.0.0.1, port: {dead}, methods: [GET], path: "/dead*"}}}}'
        f'\n  dead.tls: {{http: {{host: localhost, port: {dead}, methods: [GET], path: "/dead*"}}}}'
        "\nroles:"), 1)
    assert "dead.tls" in catalog
    cp.catalog_path.write_text(catalog)
    world = World(directory, tools, secure, mcp, test_ca, cp)
    cp.start()
    try:
        yield Faulty(world, dead)
    finally:
        teardown_world(world)


def proxy_address(sc: SidecarProcess) -> tuple[str, int]:
    host, port = sc.proxy.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def raw_request(sc: SidecarProcess, method: str, target: str, headers: dict[str, str] | None = None,
                body: bytes | None = None) -> requests.Response:
    """Send ``target`` to the proxy byte for byte (requests would normalize dot segments away)."""
    host, port = proxy_address(sc)
    conn = http.client.HTTPConnection(host, port, timeout=15)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        answer = conn.getresponse()
        resp = requests.Response()
        resp.status_code = answer.status
        resp.headers = CaseInsensitiveDict(answer.getheaders())
        resp._content = answer.read()
        return resp
    finally:
        conn.close()


def healthy(world: World, sc: SidecarProcess, tag: str) -> None:
    """The sidecar still serves an ordinary granted call (needs issues.read)."""
    assert sc.proc is not None and sc.proc.poll() is None, "the sidecar process died"
    resp = requests.get(f"{world.tools.base}/repos/ok/{tag}/issues", proxies=sc.proxies(), timeout=10)
    assert resp.status_code == 200, resp.text[:300]


def by_path(reports: dict[str, dict], path: str) -> list[dict]:
    return [r for r in reports.values() if r["url"].split("://", 1)[1].split("/", 1)[1] == path.lstrip("/")]


def inflight_seen_by_controlplane(world: World, agent: str) -> int:
    agents = world.cp.client().request("GET", "/v1/agents")["agents"]
    doc = next((a for a in agents if a["agent"] == agent), None)
    return (doc or {}).get("sidecar", {}).get("inflight", 0) if doc and doc["sidecar"] else 0


# -- control plane outage ----------------------------------------------------------------------------------
def test_control_plane_outage_fails_closed_at_the_lease_and_loses_no_report(world: World) -> None:
    ident = world.cp.issue("out-a", {"issues.read": "direct"})
    sc = world.sidecar(ident)
    base, px = world.tools.base, sc.proxies()
    calls: list[tuple[str, requests.Response]] = []

    def call(tag: str) -> requests.Response:
        path = f"/repos/out/{tag}/issues"
        resp = requests.get(base + path, proxies=px, timeout=10)
        calls.append((path, resp))
        return resp

    assert call("before").status_code == 200
    world.cp.kill()
    # The lease (3 s, renewed every second) still runs: calls continue...
    assert call("during-0").status_code == 200
    deadline = time.monotonic() + 20
    n = 1
    while (resp := call(f"during-{n}")).status_code == 200:
        assert time.monotonic() < deadline, "calls were still forwarded long after the lease TTL"
        n += 1
        time.sleep(0.1)
    # ...until it runs out, then everything is refused with lease_expired, and nothing leaves.
    assert_refused(resp, "tether.lease_expired", 503, capability="issues.read")
    for i in range(3):
        assert_refused(call(f"expired-{i}"), "tether.lease_expired", 503)
    for path, r in calls:
        assert world.tools.hits_for(path) == (1 if r.status_code == 200 else 0), path
    assert sc.proc is not None and sc.proc.poll() is None

    spooled = [json.loads(line) for line in (sc.state_dir / "reports.spool").read_text().splitlines()]
    spooled_urls = {r["url"].split("/repos/out/")[1] for r in spooled}
    made_during = {p.split("/repos/out/")[1] for p, _ in calls if "/before/" not in p}
    assert made_during <= spooled_urls, "the sidecar spools every report while the control plane is away"

    world.cp.start()
    m = 0

    def forwarded_again() -> bool:
        nonlocal m
        m += 1
        return call(f"after-{m}").status_code == 200

    wait_until(forwarded_again, 20, interval=0.2, what="calls to be forwarded after the control plane returned")
    wait_until(lambda: len(reports_for(world.cp, "out-a")) >= len(calls), 20, what="every report delivered")
    time.sleep(1.0)  # a late duplicate delivery would land here
    reports = reports_by_call(world, "out-a")  # asserts no call_id appears twice
    assert len(reports) == len(calls)
    for path, r in calls:
        (report,) = by_path(reports, path)
        if r.status_code == 200:
            assert report["resolution"] == "completed" and report["status"] == 200
        else:
            assert report["call_id"] == r.json()["error"]["call_id"]
            assert report["resolution"] == "refused" and report["code"] == r.headers["Tether-Error"]
    wait_until(lambda: (sc.state_dir / "reports.spool").read_text() == "", 10, what="the spool to drain")


# -- tool faults ------------------------------------------------------------------------------------------------
def test_tool_faults_affect_only_their_call_and_are_never_retried(faulty: Faulty) -> None:
    w, dead = faulty.world, faulty.dead_port
    ident = w.cp.issue("flt-a", {"issues.read": "direct", "fail.read": "direct", "flaky.read": "direct",
                                 "hang.read": "direct", "dead.read": "direct", "dead.tls": "direct"})
    hits = HitsSince(w.tools)
    sc = w.sidecar(ident)
    base, px = w.tools.base, sc.proxies()

    failed = requests.get(f"{base}/fail", proxies=px, timeout=10)
    assert failed.status_code == 500 and failed.json() == {"error": "tool failed"}  # the tool's answer, untouched
    assert "Tether-Error" not in failed.headers
    healthy(w, sc, "after-fail")

    reset = requests.get(f"{base}/reset", proxies=px, timeout=10)
    assert reset.status_code == 502 and "Tether-Error" not in reset.headers
    healthy(w, sc, "after-reset")

    not_sent = requests.get(f"http://127.0.0.1:{dead}/dead", proxies=px, timeout=10)
    assert not_sent.status_code == 502 and "Tether-Error" not in not_sent.headers
    not_sent_tls = requests.get(f"https://localhost:{dead}/dead-tls", proxies=px, verify=sc.ca, timeout=10)
    assert not_sent_tls.status_code == 502
    healthy(w, sc, "after-dead")

    with ThreadPoolExecutor(1) as pool:
        hanging = pool.submit(requests.get, f"{base}/hang", proxies=px, timeout=(5, 12))
        wait_until(lambda: w.tools.active > 0, 10, what="the hanging call to reach the tool")
        # The hang holds one call; the agent's other calls do not wait for it.
        healthy(w, sc, "during-hang")
        wait_until(lambda: inflight_seen_by_controlplane(w, "flt-a") >= 1, 11,
                   what="the control plane to see the call in flight")
        with pytest.raises(requests.exceptions.ReadTimeout):
            hanging.result(timeout=30)
    healthy(w, sc, "after-hang")
    wait_until(lambda: inflight_seen_by_controlplane(w, "flt-a") == 0, 10, what="the in-flight table to empty")

    # Never retried: each faulty call reached the tool exactly once (the dead port: not at all).
    assert hits("/fail") == 1
    assert hits("/reset") == 1
    assert hits("/hang") == 1
    assert w.tools.hits_for("/dead") == 0 and w.secure.hits_for("/dead-tls") == 0

    reports = wait_reports(w, "flt-a", 10)
    assert len(reports) == 10
    expected = {"/fail": ("completed", 500), "/reset": ("unknown", None), "/hang": ("unknown", None),
                "/dead": ("failed_not_sent", None), "/dead-tls": ("failed_not_sent", None)}
    for path, (resolution, status) in expected.items():
        (report,) = by_path(reports, path)
        assert (report["resolution"], report["status"]) == (resolution, status), (path, report)
    assert len([r for r in reports.values() if r["url"].endswith("/issues")]) == 5
    assert sc.proc is not None and sc.proc.poll() is None


def test_a_held_call_cancelled_by_termination_is_cancelled_not_sent(faulty: Faulty) -> None:
    w = faulty.world
    ident = w.cp.issue("cxl-a", {"issues.write": "approval", "issues.read": "direct"})
    sc = w.sidecar(ident)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(requests.post, f"{w.tools.base}/repos/cxl/held/issues", json={"t": 1},
                           proxies=sc.proxies(), timeout=30)
        wait_until(lambda: [a for a in w.cp.client().request("GET", "/v1/approvals?status=pending")
                            if a["agent"] == "cxl-a"], 10, what="the held call's approval")
        w.cp.client().request("POST", "/v1/agents/cxl-a/terminate", {"mode": "drain", "window_s": 1,
                                                                     "reason": "test"})
        resp = held.result(timeout=20)
    assert resp.headers.get("Tether-Error") in ("tether.draining", "tether.terminated"), resp.text
    assert_refused(resp, resp.headers["Tether-Error"], 503)
    assert w.tools.hits_for("/repos/cxl/held/issues") == 0
    (report,) = wait_reports(w, "cxl-a", 1).values()
    assert report["resolution"] == "cancelled_not_sent"
    assert report["call_id"] == resp.json()["error"]["call_id"]


# -- bad input --------------------------------------------------------------------------------------------------
def test_connect_to_a_raw_ip_outside_the_catalog_is_refused_by_the_proxy(faulty: Faulty) -> None:
    w = faulty.world
    ident = w.cp.issue("bad-ip", {"issues.read": "direct"})
    sc = w.sidecar(ident)
    # A proxy that tried to reach the unroutable address would time out; tether answers at once with 403.
    with pytest.raises(requests.exceptions.ProxyError, match="403"):
        requests.get(f"https://{UNROUTABLE}/", proxies=sc.proxies(), timeout=8)
    with httpx.Client(proxy=sc.proxy, timeout=8) as client, pytest.raises(httpx.ProxyError, match="403"):
        client.get(f"https://{UNROUTABLE}/")
    host, port = proxy_address(sc)
    with socket.create_connection((host, port), timeout=8) as s:
        s.sendall(f"CONNECT {UNROUTABLE}:443 HTTP/1.1\r\nHost: {UNROUTABLE}:443\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403"), head
    assert b"tether-error: tether.unknown_destination" in head.lower()
    assert json.loads(body)["error"]["code"] == "tether.unknown_destination"
    reports = wait_reports(w, "bad-ip", 3)
    assert {(r["method"], r["resolution"], r["code"]) for r in reports.values()} == {
        ("CONNECT", "refused", "tether.unknown_destination")}
    healthy(w, sc, "after-connect")


TRAVERSALS = (
    "/repos/a/b/issues/../../../admin",
    "/repos/a/b/issues/./../../../admin",
    "/repos/a/b/issues/%2e%2e/%2e%2e/%2e%2e/admin",
    "/repos/a/b/issues/%2E%2E/%2E%2E/%2E%2E/admin",
    "/repos/a/b/issues/.%2e/.%2e/.%2e/admin",
    "/repos/a/b/issues/..%2f..%2f..%2fadmin",
    "/repos/a/b/issues/..%2F..%2F..%2Fadmin",
    "/repos/a/b/issues/%252e%252e/%252e%252e/%252e%252e/admin",
    "/repos/a/b/issues/..\\..\\..\\admin",
    "/repos/a/b/issues/..%5c..%5c..%5cadmin",
    "/repos/a/b/issues%2f..%2f..%2f..%2fadmin",
)


def test_path_traversal_is_refused_before_it_reaches_the_tool(faulty: Faulty) -> None:
    w = faulty.world
    ident = w.cp.issue("bad-path", {"issues.read": "direct", "echo.any": "direct"})
    sc = w.sidecar(ident)
    before = list(w.tools.hits)
    for path in TRAVERSALS:
        resp = raw_request(sc, "GET", f"http://127.0.0.1:{w.tools.port}{path}")
        assert_refused(resp, "tether.capability_absent", 403)
    assert w.tools.hits == before, "a traversal reached the tool server"
    reports = wait_reports(w, "bad-path", len(TRAVERSALS))
    assert {r["resolution"] for r in reports.values()} == {"refused"}
    healthy(w, sc, "after-traversal")


def test_a_borrowed_or_forged_chain_header_is_refused(faulty: Faulty) -> None:
    w = faulty.world
    mine = w.cp.issue("bad-chain", {"issues.read": "direct", "echo.any": "direct"})
    other = w.cp.issue("bad-chain-other", {"issues.read": "direct", "echo.any": "direct", "fail.read": "direct"})
    sc = w.sidecar(mine)
    base, px = w.tools.base, sc.proxies()
    hits = HitsSince(w.tools)
    for forged in ("garbage", other.wire, mine.wire + "," + other.wire.split(",")[-1], other.wire + " "):
        resp = requests.get(f"{base}/repos/chain/x/issues", headers={"Tether-Chain": forged}, proxies=px, timeout=10)
        assert_refused(resp, "tether.chain_invalid", 403)
    # The other agent's chain does not unlock its capabilities either.
    resp = requests.get(f"{base}/fail", headers={"Tether-Chain": other.wire}, proxies=px, timeout=10)
    assert resp.headers.get("Tether-Error") in ("tether.chain_invalid", "tether.capability_absent")
    assert w.tools.hits_for("/repos/chain/x/issues") == 0 and hits("/fail") == 0
    # The sidecar's own chain is accepted, and it never reaches the tool.
    echoed = requests.get(f"{base}/echo", headers={"Tether-Chain": mine.wire}, proxies=px, timeout=10)
    assert echoed.status_code == 200
    assert "tether-chain" not in {k.lower() for k in echoed.json()["headers"]}
    healthy(w, sc, "after-chain")


def test_a_host_header_naming_another_host_is_refused(faulty: Faulty) -> None:
    w = faulty.world
    ident = w.cp.issue("bad-host", {"issues.read": "direct", "secure.issues": "direct"})
    sc = w.sidecar(ident)
    target = f"http://127.0.0.1:{w.tools.port}/repos/host/x/issues"
    for host in ("evil.example", f"evil.example:{w.tools.port}", f"localhost:{w.secure.port}", "localhost"):
        resp = raw_request(sc, "GET", target, headers={"Host": host})
        assert_refused(resp, "tether.unknown_destination", 403)
    assert w.tools.hits_for("/repos/host/x/issues") == 0
    # A Host header that does name the destination is fine.
    assert raw_request(sc, "GET", target, headers={"Host": f"127.0.0.1:{w.tools.port}"}).status_code == 200
    assert w.tools.hits_for("/repos/host/x/issues") == 1
    healthy(w, sc, "after-host")


def test_huge_headers_and_bodies_are_handled_per_call(faulty: Faulty) -> None:
    w = faulty.world
    ident = w.cp.issue("bad-big", {"issues.read": "direct", "echo.any": "direct"})
    sc = w.sidecar(ident)
    base, px = w.tools.base, sc.proxies()
    hits = HitsSince(w.tools)
    huge = "h" * 200_000

    # Absent stays absent however big the request is, and nothing leaves.
    refused = requests.post(f"{base}/repos/big/absent/issues", headers={"X-Huge": huge}, proxies=px, timeout=30)
    assert_refused(refused, "tether.capability_absent", 403)
    refused = requests.post(f"{base}/repos/big/absent/issues", data=b"b" * (16 * 1024 * 1024), proxies=px,
                            timeout=60)
    assert_refused(refused, "tether.capability_absent", 403)
    assert w.tools.hits_for("/repos/big/absent/issues") == 0
    healthy(w, sc, "after-absent")

    # A granted call with a 200 KB header gets a clean HTTP answer (the tool's or tether's), resolved once.
    granted = requests.get(f"{base}/repos/big/hdr/issues", headers={"X-Huge": huge}, proxies=px, timeout=30)
    assert 200 <= granted.status_code < 600
    assert w.tools.hits_for("/repos/big/hdr/issues") <= 1
    healthy(w, sc, "after-huge-header")

    # Granted 16 MB bodies pass intact, with a length and chunked.
    body = b"0123456789abcdef" * (1024 * 1024)
    echoed = requests.post(f"{base}/echo", data=body, proxies=px, timeout=60)
    assert echoed.status_code == 200 and echoed.json()["body"].encode() == body

    def chunks() -> Iterator[bytes]:
        for i in range(64):
            yield (b"%02d" % (i % 100)) * 131072

    chunked = requests.post(f"{base}/echo", data=chunks(), proxies=px, timeout=60)
    assert chunked.status_code == 200
    assert len(chunked.json()["body"]) == 64 * 262144
    assert hits("/echo") == 2
    healthy(w, sc, "after-bodies")

    reports = wait_reports(w, "bad-big", 8)
    assert len(reports) == 8
    assert {r["resolution"] for r in reports.values()} <= {"completed", "refused"}
    (hdr,) = by_path(reports, "/repos/big/hdr/issues")
    if hdr["resolution"] == "completed":
        assert hdr["status"] == granted.status_code
    else:
        assert granted.headers.get("Tether-Error") == hdr["code"]
