"""The sidecar on the HTTP side, end to end with real processes (docs/contract.md sections 1, 5, 7).

Enforcement by host, method and path; revocation and expiry; the approval tier; streaming without
buffering; redacted captures and their HAR export; a capture that cannot be written; ``tether run``
around an unmodified agent. Control-plane outages, tool faults and hostile input live in
``test_sidecar_faults.py``.

One world (tool servers, control plane) is shared by the module; every test uses its own agents and
its own request paths, so ``world.tools.hits`` is read per path.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import requests

from tether.capability import keys
from tether.capability.catalog import parse_catalog
from tether.capability.chain import mint_root
from tether.capture.segments import read_flows

from .conftest import World, build_world, teardown_world
from .harness import PYTHON, Identity, SidecarProcess, ToolServer, reports_for, wait_until

if TYPE_CHECKING:
    from .harness import TestCA

CODES = {
    "tether.capability_absent", "tether.unknown_destination", "tether.chain_invalid", "tether.chain_revoked",
    "tether.chain_expired", "tether.lease_expired", "tether.draining", "tether.terminated",
    "tether.approval_denied", "tether.approval_timeout", "tether.capture_unavailable",
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, test_ca: TestCA) -> Iterator[World]:
    w = build_world(tmp_path_factory.mktemp("http-world"), test_ca)
    w.cp.start()
    try:
        yield w
    finally:
        teardown_world(w)


# -- helpers --------------------------------------------------------------------------------------------
def assert_refused(resp: requests.Response, code: str, status: int | None = None,
                   capability: str | None = None) -> dict[str, Any]:
    """The refusal contract of docs/contract.md section 5: status, Tether-Error header, JSON error body."""
    assert resp.headers.get("Tether-Error") == code, (resp.status_code, resp.headers, resp.text[:500])
    if status is not None:
        assert resp.status_code == status, resp.text[:500]
    else:
        assert resp.status_code >= 400
    assert resp.headers.get("Content-Type", "").startswith("application/json")
    error = resp.json()["error"]
    assert set(error) >= {"code", "message", "call_id", "capability"}, error
    assert error["code"] == code
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["call_id"], str) and error["call_id"]
    if capability is not None:
        assert error["capability"] == capability
    return error


class HitsSince:
    """Requests that reached a tool server since this object was made (the module shares its servers)."""

    def __init__(self, server: ToolServer) -> None:
        self.server = server
        self.mark = len(server.hits)

    def __call__(self, path: str) -> int:
        return sum(1 for _, p in self.server.hits[self.mark:] if p == path)


def reports_by_call(world: World, agent: str) -> dict[str, dict[str, Any]]:
    reports = reports_for(world.cp, agent)
    ids = [r["call_id"] for r in reports]
    assert len(ids) == len(set(ids)), f"a call was reported twice: {ids}"
    return {r["call_id"]: r for r in reports}


def wait_reports(world: World, agent: str, count: int, timeout: float = 15.0) -> dict[str, dict[str, Any]]:
    wait_until(lambda: len(reports_for(world.cp, agent)) >= count, timeout, what=f"{count} reports for {agent}")
    return reports_by_call(world, agent)


def approvals(world: World, agent: str, status: str = "pending") -> list[dict[str, Any]]:
    return [a for a in world.cp.client().request("GET", f"/v1/approvals?status={status}") if a["agent"] == agent]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def issue_expiring(world: World, agent: str, caps: dict[str, str], expires_in: float) -> Identity:
    """A root grant whose exp lies ``expires_in`` seconds past the verifier's leeway from now.

    Chains are checked with a clock leeway (LEEWAY_S), so a grant that expired a little less than the
    leeway ago still starts a sidecar; it then expires for good ``expires_in`` seconds later.
    """
    from tether.capability.chain import LEEWAY_S

    signing = keys.load_private(world.cp.signing_key_path.read_bytes())
    catalog = parse_catalog(world.cp.catalog_path.read_text(), str(world.cp.catalog_path))
    key = keys.generate()
    now = time.time()
    issued = now - 600
    exp = now - LEEWAY_S + expires_in
    wire = mint_root(signing, agent=agent, subject_key=key.public_key(), caps=caps, now=issued, ttl_s=exp - issued,
                     depth=2, catalog=catalog)
    directory = world.cp.directory / "ids" / agent
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "chain").write_text(wire + "\n")
    (directory / "key").write_bytes(keys.private_pem(key))
    return Identity(agent, directory / "chain", directory / "key")


# -- enforcement ----------------------------------------------------------------------------------------
def test_http_calls_are_matched_by_host_method_and_path(shared: World) -> None:
    w = shared
    ident = w.cp.issue("enf-a", {"issues.read": "direct", "slow.read": "absent"})
    hits = HitsSince(w.tools)
    sc = w.sidecar(ident)
    px = sc.proxies()
    base = w.tools.base

    ok = requests.get(f"{base}/repos/enf/one/issues?state=open", proxies=px, timeout=10)
    assert ok.status_code == 200 and ok.json()["repo"] == "one"  # the query is not part of the path

    wrong_method = requests.post(f"{base}/repos/enf/two/issues", json={"t": 1}, proxies=px, timeout=10)
    assert_refused(wrong_method, "tether.capability_absent", 403, capability="issues.write")
    wrong_path = requests.get(f"{base}/admin", proxies=px, timeout=10)
    assert_refused(wrong_path, "tether.capability_absent", 403)
    explicitly_absent = requests.get(f"{base}/slow?s=0", proxies=px, timeout=10)
    assert_refused(explicitly_absent, "tether.capability_absent", 403, capability="slow.read")
    other_cap = requests.get(f"{base}/fail", proxies=px, timeout=10)
    assert_refused(other_cap, "tether.capability_absent", 403, capability="fail.read")
    # The catalog names the port: the same host on another port is not a destination at all.
    other_port = requests.get(f"http://127.0.0.1:{w.secure.port}/repos/enf/three/issues", proxies=px, timeout=10)
    assert_refused(other_port, "tether.unknown_destination", 403)
    unknown_host = requests.get("http://tools.invalid/repos/enf/four/issues", proxies=px, timeout=10)
    assert_refused(unknown_host, "tether.unknown_destination", 403)

    assert w.tools.hits_for("/repos/enf/one/issues") == 1
    assert w.tools.hits_for("/repos/enf/two/issues") == 0
    assert hits("/admin") == 0 and hits("/slow") == 0 and hits("/fail") == 0
    assert w.secure.hits_for("/repos/enf/three/issues") == 0

    reports = wait_reports(w, "enf-a", 7)
    assert sorted(r["resolution"] for r in reports.values()) == ["completed"] + ["refused"] * 6
    refusal_ids = {resp.json()["error"]["call_id"] for resp in (wrong_method, wrong_path, explicitly_absent,
                                                                 other_cap, other_port, unknown_host)}
    assert refusal_ids <= set(reports), "every refusal's call_id is the one reported"
    assert {reports[i]["code"] for i in refusal_ids} == {"tether.capability_absent", "tether.unknown_destination"}
    completed = next(r for r in reports.values() if r["resolution"] == "completed")
    assert completed["status"] == 200 and completed["capability"] == "issues.read"


def test_https_calls_are_enforced_inside_the_tunnel(shared: World) -> None:
    w = shared
    ident = w.cp.issue("enf-s", {"secure.issues": "direct"})
    hits = HitsSince(w.secure)
    sc = w.sidecar(ident)
    url = f"https://localhost:{w.secure.port}"
    ok = requests.get(f"{url}/repos/enf/tls/issues", proxies=sc.proxies(), verify=sc.ca, timeout=10)
    assert ok.status_code == 200
    refused = requests.get(f"{url}/slow?s=0", proxies=sc.proxies(), verify=sc.ca, timeout=10)
    assert_refused(refused, "tether.capability_absent", 403, capability="secure.slow")
    assert w.secure.hits_for("/repos/enf/tls/issues") == 1
    assert hits("/slow") == 0


# -- revocation and expiry ----------------------------------------------------------------------------------
def _refused_with(sc: SidecarProcess, url: str, code: str) -> list[requests.Response]:
    """[response] once the sidecar refuses with ``code`` (a list: a 4xx Response is falsy)."""
    resp = requests.get(url, proxies=sc.proxies(), timeout=10)
    return [resp] if resp.headers.get("Tether-Error") == code else []


def test_revocation_from_the_stream_applies_to_the_next_call_down_the_chain(shared: World) -> None:
    w = shared
    parent = w.cp.issue("rev-parent", {"issues.read": "direct", "slow.read": "direct"})
    hits = HitsSince(w.tools)
    child_a = w.cp.delegate(parent, "rev-child-a", {"issues.read": "direct", "slow.read": "direct"})
    child_b = w.cp.delegate(parent, "rev-child-b", {"issues.read": "direct"})
    sc_a, sc_b = w.sidecar(child_a), w.sidecar(child_b)
    base = w.tools.base
    for sc, repo in ((sc_a, "a"), (sc_b, "b")):
        assert requests.get(f"{base}/repos/rev/{repo}/issues", proxies=sc.proxies(), timeout=10).status_code == 200

    admin = w.cp.client()
    admin.request("POST", f"/v1/grants/{child_a.jti}/revoke", {"reason": "test"})
    (refused,) = wait_until(lambda: _refused_with(sc_a, f"{base}/repos/rev/a2/issues", "tether.chain_revoked"),
                            10, interval=0.1, what="child a refused after its link was revoked")
    assert_refused(refused, "tether.chain_revoked", 403)
    hits_a = w.tools.hits_for("/repos/rev/a2/issues")
    # From then on it refuses everything, every capability, and nothing more reaches the tool.
    for path in ("/repos/rev/a2/issues", "/slow?s=0"):
        assert_refused(requests.get(base + path, proxies=sc_a.proxies(), timeout=10), "tether.chain_revoked", 403)
    assert w.tools.hits_for("/repos/rev/a2/issues") == hits_a
    assert hits("/slow") == 0
    # A sibling is untouched by its sibling's revocation...
    assert requests.get(f"{base}/repos/rev/b2/issues", proxies=sc_b.proxies(), timeout=10).status_code == 200

    # ...and dies when a link above it is revoked (revocation flows down the chain).
    admin.request("POST", f"/v1/grants/{parent.jti}/revoke", {"reason": "test"})
    wait_until(lambda: _refused_with(sc_b, f"{base}/repos/rev/b3/issues", "tether.chain_revoked"),
               10, interval=0.1, what="child b refused after its parent's link was revoked")
    before = w.tools.hits_for("/repos/rev/b3/issues")
    assert_refused(requests.get(f"{base}/repos/rev/b3/issues", proxies=sc_b.proxies(), timeout=10),
                   "tether.chain_revoked", 403)
    assert w.tools.hits_for("/repos/rev/b3/issues") == before


def test_an_expired_chain_refuses_everything(shared: World) -> None:
    w = shared
    # Long enough for the first call to pass on a loaded machine (a sidecar may take seconds to start then).
    ident = issue_expiring(w, "exp-a", {"issues.read": "direct", "slow.read": "direct"}, expires_in=20)
    hits = HitsSince(w.tools)
    sc = w.sidecar(ident)
    base = w.tools.base
    assert requests.get(f"{base}/repos/exp/live/issues", proxies=sc.proxies(), timeout=10).status_code == 200
    wait_until(lambda: _refused_with(sc, f"{base}/repos/exp/dead/issues", "tether.chain_expired"),
               60, interval=0.25, what="the chain to expire")
    before = w.tools.hits_for("/repos/exp/dead/issues")
    for path in ("/repos/exp/dead/issues", "/slow?s=0"):
        assert_refused(requests.get(base + path, proxies=sc.proxies(), timeout=10), "tether.chain_expired", 403)
    assert w.tools.hits_for("/repos/exp/dead/issues") == before
    assert hits("/slow") == 0


# -- the approval tier --------------------------------------------------------------------------------------
def test_approval_holds_the_call_without_blocking_the_agents_other_calls(shared: World) -> None:
    w = shared
    ident = w.cp.issue("apr-a", {"issues.write": "approval", "issues.read": "direct"})
    sc = w.sidecar(ident, "--approval-timeout", "4")
    base, px = w.tools.base, sc.proxies()
    admin = w.cp.client()

    def post(repo: str) -> requests.Response:
        return requests.post(f"{base}/repos/apr/{repo}/issues", json={"title": repo}, proxies=px, timeout=30)

    with ThreadPoolExecutor(4) as pool:
        # Approved: held until a person approves, then forwarded once.
        held = pool.submit(post, "approved")
        pending = wait_until(lambda: approvals(w, "apr-a"), 10, what="a pending approval")
        assert len(pending) == 1
        approval = pending[0]
        assert approval["capability"] == "issues.write" and approval["method"] == "POST"
        assert approval["url"].endswith("/repos/apr/approved/issues")
        # While it is held, nothing has left and the agent's other calls go through.
        for i in range(3):
            other = requests.get(f"{base}/repos/apr/other{i}/issues", proxies=px, timeout=10)
            assert other.status_code == 200
        assert not held.done()
        assert w.tools.hits_for("/repos/apr/approved/issues") == 0
        admin.request("POST", f"/v1/approvals/{approval['id']}/approve", {})
        resp = held.result(timeout=15)
        assert resp.status_code == 200 and resp.json()["body"] == {"title": "approved"}
        assert w.tools.hits_for("/repos/apr/approved/issues") == 1

        # Denied: refused with approval_denied; nothing left.
        held = pool.submit(post, "denied")
        pending = wait_until(lambda: approvals(w, "apr-a"), 10, what="a second pending approval")
        admin.request("POST", f"/v1/approvals/{pending[0]['id']}/deny", {})
        error = assert_refused(held.result(timeout=15), "tether.approval_denied", 403, capability="issues.write")
        assert error["call_id"] == pending[0]["call_id"]
        assert w.tools.hits_for("/repos/apr/denied/issues") == 0

        # Nobody answers: refused with approval_timeout once --approval-timeout has passed.
        held = pool.submit(post, "ignored")
        wait_until(lambda: approvals(w, "apr-a"), 10, what="a third pending approval")
        assert_refused(held.result(timeout=30), "tether.approval_timeout", 403, capability="issues.write")
        assert w.tools.hits_for("/repos/apr/ignored/issues") == 0

    reports = wait_reports(w, "apr-a", 6)
    by_url = {r["url"].split("/repos/apr/")[1]: r for r in reports.values()}
    assert by_url["approved/issues"]["resolution"] == "completed" and by_url["approved/issues"]["status"] == 200
    assert by_url["denied/issues"]["resolution"] == "refused"
    assert by_url["denied/issues"]["code"] == "tether.approval_denied"
    assert by_url["ignored/issues"]["resolution"] == "refused"
    assert by_url["ignored/issues"]["code"] == "tether.approval_timeout"


# -- streaming ----------------------------------------------------------------------------------------------
def test_sse_events_stream_through_while_the_tool_is_still_sending(shared: World) -> None:
    w = shared
    ident = w.cp.issue("sse-a", {"stream.read": "direct"})
    sc = w.sidecar(ident)
    n = 15
    events: list[dict[str, Any]] = []
    active_at_first: int | None = None
    with requests.get(f"{w.tools.base}/sse?n={n}&delay=0.2", proxies=sc.proxies(), stream=True,
                      timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))
                if active_at_first is None:
                    # The tool is still writing the other n-1 events: nothing was buffered whole.
                    active_at_first = w.tools.active
    assert active_at_first is not None and active_at_first > 0
    assert [e["i"] for e in events] == list(range(n))
    reports = wait_reports(w, "sse-a", 1)
    (report,) = reports.values()
    assert report["resolution"] == "completed" and report["status"] == 200 and report["capability"] == "stream.read"


def test_a_64mb_body_arrives_intact_without_the_sidecar_buffering_it(shared: World) -> None:
    w = shared
    ident = w.cp.issue("big-a", {"big.read": "direct"})
    sc = w.sidecar(ident)
    assert sc.proc is not None
    pid = sc.proc.pid
    # Warm up the path (TLS-free, but the first flow allocates) before taking the baseline.
    assert len(requests.get(f"{w.tools.base}/big?mb=1", proxies=sc.proxies(), timeout=30).content) == 1024 * 1024
    baseline = rss_kb(pid)
    peak, samples = baseline, 0
    size = 64 * 1024 * 1024
    received = 0
    wrong = 0
    with requests.get(f"{w.tools.base}/big?mb=64", proxies=sc.proxies(), stream=True, timeout=120) as resp:
        assert resp.status_code == 200
        for chunk in resp.iter_content(256 * 1024):
            received += len(chunk)
            wrong += len(chunk) - chunk.count(b"x")
            # Sampled while the body is still in flight (the tool is still sending most of the time).
            peak, samples = max(peak, rss_kb(pid)), samples + 1
    assert received == size and wrong == 0 and samples >= 64
    # Buffered whole, the body alone would add 64 MB (mitmproxy keeps more than one copy); streamed, the
    # sidecar only holds a few chunks. Half the body is a generous bound that still tells them apart.
    growth_mb = (peak - baseline) / 1024
    assert growth_mb < 32, f"sidecar RSS grew by {growth_mb:.1f} MB while relaying a 64 MB body"
    reports = wait_reports(w, "big-a", 2)
    assert all(r["resolution"] == "completed" and r["status"] == 200 for r in reports.values())


def test_an_eof_delimited_body_streams_through_with_the_sidecar_memory_flat(shared: World) -> None:
    """No Content-Length, not chunked, ended by closing the connection: the agent gets bytes while the tool is
    still sending, and the sidecar holds a few chunks, not the body (it buffered it whole, growing without end,
    and the agent got nothing until EOF)."""
    w = shared
    ident = w.cp.issue("eof-a", {"big.read": "direct"})
    sc = w.sidecar(ident)
    assert sc.proc is not None
    pid = sc.proc.pid
    assert len(requests.get(f"{w.tools.base}/big?mb=1&framing=eof", proxies=sc.proxies(), timeout=30).content) \
        == 1024 * 1024
    baseline = rss_kb(pid)
    peak, received, wrong = baseline, 0, 0
    # The tool would send 1 GiB; the agent reads 64 MiB and hangs up, long before the tool could have finished.
    with requests.get(f"{w.tools.base}/big?mb=1024&framing=eof", proxies=sc.proxies(), stream=True,
                      timeout=120) as resp:
        assert resp.status_code == 200 and "content-length" not in resp.headers
        for chunk in resp.iter_content(256 * 1024):
            received += len(chunk)
            wrong += len(chunk) - chunk.count(b"x")
            peak = max(peak, rss_kb(pid))
            if received >= 64 * 1024 * 1024:
                break
    assert received >= 64 * 1024 * 1024 and wrong == 0
    growth_mb = (peak - baseline) / 1024
    assert growth_mb < 32, f"sidecar RSS grew by {growth_mb:.1f} MB while relaying 64 MB of an EOF-delimited body"


# -- captures -----------------------------------------------------------------------------------------------
SECRETS = ("sk-SECRET-AUTH-7731", "SECRET-COOKIE-4410", "SECRET-PASSWORD-9921", "SECRET-TOKEN-1187")


@dataclass
class Captured:
    world: World
    sidecar: SidecarProcess
    path: Path  # the sidecar's capture file
    sent_body: dict[str, Any]
    har_text: str


@pytest.fixture(scope="module")
def captured(shared: World, tmp_path_factory: pytest.TempPathFactory) -> Captured:
    """Two calls carrying secrets through a sidecar with --redact-field, then `tether capture export`."""
    w = shared
    ident = w.cp.issue("cap-a", {"issues.read": "direct", "issues.write": "direct"})
    sc = w.sidecar(ident, "--redact-field", "password", "--redact-field", "api_token")
    base, px = w.tools.base, sc.proxies()
    read = requests.get(f"{base}/repos/cap/r/issues", proxies=px, timeout=10,
                        headers={"Authorization": f"Bearer {SECRETS[0]}", "Cookie": f"session={SECRETS[1]}"})
    assert read.status_code == 200 and read.json()["authorization_seen"] is True  # redaction is capture-only
    body = {"title": "kept", "password": SECRETS[2], "nested": {"api_token": SECRETS[3], "keep": "me"}}
    write = requests.post(f"{base}/repos/cap/w/issues", json=body, proxies=px, timeout=10)
    assert write.status_code == 200 and write.json()["body"] == body  # the tool saw the real values
    path = sc.state_dir / "captures" / "flows.mitm"

    def answered() -> set[str]:
        done = {f.request.path for f in read_flows(path) if f.response is not None} if path.exists() else set()
        return done if done >= {"/repos/cap/r/issues", "/repos/cap/w/issues"} else set()

    wait_until(answered, 10, what="both calls captured with their responses")
    wait_reports(w, "cap-a", 2)
    har_path = tmp_path_factory.mktemp("har") / "cap.har"
    out = subprocess.run([PYTHON, "-m", "tether", "capture", "export", "--agent", "cap-a",
                          "--har", str(har_path), "--captures", str(w.cp.directory / "sidecars")],
                         capture_output=True, text=True, timeout=60, env=w.cp.env())
    assert out.returncode == 0, out.stdout + out.stderr
    return Captured(w, sc, path, body, har_path.read_text())


def test_captures_redact_authorization_cookies_and_named_fields(captured: Captured) -> None:
    raw = captured.path.read_bytes()
    for secret in SECRETS:
        assert secret.encode() not in raw, f"{secret} is in the capture file"
    last = {f.request.path: f for f in read_flows(captured.path) if f.response is not None}
    got = last["/repos/cap/r/issues"]
    assert got.request.headers["Authorization"] == "[REDACTED]"
    assert got.request.headers["Cookie"] == "[REDACTED]"
    assert got.response.status_code == 200
    posted = last["/repos/cap/w/issues"]
    sent = json.loads(posted.request.content)
    assert sent["password"] == "[REDACTED]" and sent["nested"]["api_token"] == "[REDACTED]"
    assert sent["title"] == "kept" and sent["nested"]["keep"] == "me"  # only the named fields go
    assert json.loads(posted.response.content)["body"]["password"] == "[REDACTED]"


def test_capture_export_writes_a_redacted_har(captured: Captured) -> None:
    har = json.loads(captured.har_text)
    entries = har["log"]["entries"]
    base = captured.world.tools.base
    assert {e["request"]["url"] for e in entries} == {f"{base}/repos/cap/r/issues", f"{base}/repos/cap/w/issues"}
    assert {e["response"]["status"] for e in entries} == {200}
    for secret in SECRETS:
        assert secret not in captured.har_text, f"{secret} is in the HAR export"


def test_each_call_is_one_flow_in_the_capture_and_its_report_points_at_it(captured: Captured) -> None:
    # A flow is written when it leaves and again when it resolves; readers keep its last state, so
    # the capture (and the HAR) hold one flow per call, and capture_ref names that flow.
    flows = read_flows(captured.path)
    assert sorted(f.request.path for f in flows) == ["/repos/cap/r/issues", "/repos/cap/w/issues"]
    assert len(json.loads(captured.har_text)["log"]["entries"]) == 2
    flow_ids = {f.id for f in flows}
    for report in reports_for(captured.world.cp, "cap-a"):
        name, _, flow_id = (report["capture_ref"] or "").partition("#")
        assert name == "flows.mitm" and flow_id in flow_ids, (report["capture_ref"], flow_ids)


def _broken_capture_dir(world: World, agent: str) -> Path:
    """Make the capture directory unwritable the blunt way: a regular file where the directory goes."""
    state_dir = world.cp.directory / "sidecars" / agent
    state_dir.mkdir(parents=True, exist_ok=True)
    blocker = state_dir / "captures"
    blocker.write_text("a file where the captures directory should be\n")
    return blocker


def test_a_capture_that_cannot_be_written_refuses_that_call_only(shared: World) -> None:
    w = shared
    base = w.tools.base
    strict = w.cp.issue("cap-broken", {"issues.read": "direct"})
    blocker = _broken_capture_dir(w, "cap-broken")
    sc = w.sidecar(strict)
    for i in range(2):
        resp = requests.get(f"{base}/repos/capx/n{i}/issues", proxies=sc.proxies(), timeout=10)
        assert_refused(resp, "tether.capture_unavailable", 503, capability="issues.read")
        assert w.tools.hits_for(f"/repos/capx/n{i}/issues") == 0
    # The sidecar kept serving; once the capture can be written again, calls flow (and are captured).
    blocker.unlink()
    again = requests.get(f"{base}/repos/capx/back/issues", proxies=sc.proxies(), timeout=10)
    assert again.status_code == 200 and w.tools.hits_for("/repos/capx/back/issues") == 1
    assert (sc.state_dir / "captures" / "flows.mitm").is_file()
    reports = wait_reports(w, "cap-broken", 3)
    assert sorted((r["resolution"], r["code"]) for r in reports.values()) == [
        ("completed", None), ("refused", "tether.capture_unavailable"), ("refused", "tether.capture_unavailable")]

    lenient = w.cp.issue("cap-lenient", {"issues.read": "direct"})
    _broken_capture_dir(w, "cap-lenient")
    sc2 = w.sidecar(lenient, "--allow-uncaptured")
    resp = requests.get(f"{base}/repos/capx/lenient/issues", proxies=sc2.proxies(), timeout=10)
    assert resp.status_code == 200 and "Tether-Error" not in resp.headers
    assert w.tools.hits_for("/repos/capx/lenient/issues") == 1
    (report,) = wait_reports(w, "cap-lenient", 1).values()
    assert report["resolution"] == "completed" and report["status"] == 200


# -- tether run -----------------------------------------------------------------------------------------------
AGENT_SCRIPT = r'''
"""An agent that knows nothing about tether: plain requests and httpx, no proxy or CA settings."""
import json
import sys

import httpx
import requests

base, secure, tag = sys.argv[1], sys.argv[2], sys.argv[3]
out = {}
r = requests.get(f"{base}/repos/{tag}/req/issues", timeout=15)
out["requests_get"] = r.status_code
r = requests.post(f"{base}/repos/{tag}/req/issues", json={"x": 1}, timeout=15)
out["requests_post"] = [r.status_code, r.headers.get("Tether-Error")]
out["requests_https"] = requests.get(f"{secure}/repos/{tag}/req/issues", timeout=15).status_code
with httpx.Client(timeout=15) as client:
    out["httpx_get"] = client.get(f"{base}/repos/{tag}/hx/issues").status_code
    out["httpx_https"] = client.get(f"{secure}/repos/{tag}/hx/issues").status_code
    r = client.post(f"{base}/repos/{tag}/hx/issues", json={"x": 1})
    out["httpx_post"] = [r.status_code, r.headers.get("Tether-Error")]
print("RESULT " + json.dumps(out), flush=True)
sys.exit(3)
'''


def _processes_mentioning(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next((ln for ln in (entry / "status").read_text().splitlines() if ln.startswith("State:")), "")
        except OSError:
            continue
        if marker in cmdline and "Z" not in state.split()[1:2]:
            found.append(int(entry.name))
    return found


def _tether_run(world: World, state_root: Path, run_args: list[str], tag: str) -> tuple[dict[str, Any], int]:
    script = state_root.parent / "agent.py"
    script.write_text(AGENT_SCRIPT)
    env = {k: v for k, v in world.cp.env().items()
           if k.upper() not in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "SSL_CERT_FILE",
                                "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")}
    cmd = [PYTHON, "-m", "tether", "run", "--controlplane", world.cp.url, "--state-dir", str(state_root),
           "--upstream-ca", str(world.ca.ca_pem), *run_args, "--",
           PYTHON, str(script), world.tools.base, f"https://localhost:{world.secure.port}", tag]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"agent printed no result (exit {out.returncode}):\n{out.stdout}\n{out.stderr}"
    return json.loads(line[len("RESULT "):]), out.returncode


def test_tether_run_puts_an_unmodified_agent_under_control(shared: World, tmp_path: Path) -> None:
    w = shared
    ident = w.cp.issue("run-a", {"issues.read": "direct", "secure.issues": "direct"})
    state_root = tmp_path / "state"
    result, code = _tether_run(w, state_root, ["--chain", str(ident.chain_path), "--key", str(ident.key_path)],
                               "runa")
    assert code == 3, "tether run returns the command's exit code"
    assert result == {
        "requests_get": 200, "requests_post": [403, "tether.capability_absent"], "requests_https": 200,
        "httpx_get": 200, "httpx_https": 200, "httpx_post": [403, "tether.capability_absent"]}
    assert w.tools.hits_for("/repos/runa/req/issues") == 1 and w.tools.hits_for("/repos/runa/hx/issues") == 1
    assert w.secure.hits_for("/repos/runa/req/issues") == 1 and w.secure.hits_for("/repos/runa/hx/issues") == 1
    reports = wait_reports(w, "run-a", 6)
    assert sorted(r["resolution"] for r in reports.values()) == ["completed"] * 4 + ["refused"] * 2
    assert _processes_mentioning(str(state_root)) == [], "the sidecar outlived its command"


def test_tether_run_delegates_a_narrower_chain_first(shared: World, tmp_path: Path) -> None:
    w = shared
    parent = w.cp.issue("run-parent", {"issues.read": "direct", "issues.write": "direct", "secure.issues": "direct"})
    state_root = tmp_path / "state"
    result, code = _tether_run(w, state_root, [
        "--parent-chain", str(parent.chain_path), "--parent-key", str(parent.key_path), "--agent", "run-child",
        "--cap", "issues.read=direct", "--cap", "secure.issues=direct"], "runc")
    assert code == 3
    # The parent may write; the child it delegated to may not.
    assert result["requests_get"] == 200 and result["httpx_get"] == 200
    assert result["requests_post"] == [403, "tether.capability_absent"]
    assert result["httpx_post"] == [403, "tether.capability_absent"]
    assert w.tools.hits_for("/repos/runc/req/issues") == 1 and w.tools.hits_for("/repos/runc/hx/issues") == 1
    agents = w.cp.client().request("GET", "/v1/agents")["agents"]
    child = next(a for a in agents if a["agent"] == "run-child")
    assert child["issuer"] == "run-parent" and child["caps"] == {"issues.read": "direct", "secure.issues": "direct"}
    reports = wait_reports(w, "run-child", 6)
    assert all(r["agent"] == "run-child" for r in reports.values())
    assert reports_for(w.cp, "run-parent") == []
    assert _processes_mentioning(str(state_root)) == [], "the sidecar outlived its command"
