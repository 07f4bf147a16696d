"""The control plane's API against a real server process: auth, registration, revocation, events,
leases, reports, approvals, audit, OpenAPI. Sidecars are played by signed requests (Signer)."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether.capability import keys
from tether.capability.chain import parse_chain_unverified
from tether.capability.errors import ApiError
from tether.controlplane.client import Client, Signer

from .harness import ControlPlaneProcess, Identity, prepare_controlplane


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneProcess]:
    proc = prepare_controlplane(tmp_path_factory.mktemp("api"), 1, 2, 3).start()
    try:
        yield proc
    finally:
        proc.stop()


def signer(ident: Identity, run: str | None = None) -> Signer:
    """Signs as the identity's sidecar run (one run per identity unless ``run`` names another)."""
    leaf = parse_chain_unverified(ident.wire)[-1].hash
    return Signer(ident.agent, leaf, keys.load_private(ident.key_path.read_bytes()), run or f"run-{leaf[7:23]}")


def register(cp: ControlPlaneProcess, ident: Identity) -> dict:
    return cp.client(admin=False).request("POST", "/v1/chains/register", {"chain": ident.wire}, signer=signer(ident))


def refused(call: object) -> ApiError:
    with pytest.raises(ApiError) as info:
        call()  # type: ignore[operator]
    return info.value


def test_admin_routes_need_the_token(cp: ControlPlaneProcess) -> None:
    anon = Client(cp.url, "")
    assert refused(lambda: anon.request("GET", "/v1/agents")).http_status == 401
    wrong = Client(cp.url, "not-the-token")
    err = refused(lambda: wrong.request("GET", "/v1/agents"))
    assert (err.http_status, err.code) == (403, "tether.forbidden")
    assert isinstance(cp.client().request("GET", "/v1/agents")["agents"], list)


def test_issue_register_and_tree(cp: ControlPlaneProcess) -> None:
    subject = keys.generate()
    grant = cp.client().request("POST", "/v1/grants", {
        "agent": "api-root", "subject_key": keys.to_jwk(subject.public_key()), "role": "reader", "ttl_s": 600})
    assert grant["chain"][0] == grant["link"]
    root = cp.issue("tree-root", {"issues.read": "direct", "slow.read": "direct"})
    mid = cp.delegate(root, "tree-mid", {"issues.read": "direct"})
    leaf = cp.delegate(mid, "tree-leaf", {"issues.read": "direct"})
    for ident in (root, mid, leaf):
        assert register(cp, ident)["agent"] == ident.agent
    assert register(cp, leaf)["new"] == 0  # idempotent
    tree = cp.client().request("GET", "/v1/agents")["tree"]
    node = next(n for n in tree if n["agent"] == "tree-root")
    assert node["children"][0]["agent"] == "tree-mid"
    assert node["children"][0]["children"][0]["agent"] == "tree-leaf"


def test_register_needs_possession_of_the_leaf_key(cp: ControlPlaneProcess) -> None:
    root = cp.issue("reg-root", {"issues.read": "direct"})
    other = cp.issue("reg-other", {"issues.read": "direct"})
    client = cp.client(admin=False)
    err = refused(lambda: client.request("POST", "/v1/chains/register", {"chain": root.wire}))
    assert err.code == "tether.unauthorized"
    stolen = Signer(root.agent, parse_chain_unverified(root.wire)[-1].hash,
                    keys.load_private(other.key_path.read_bytes()))
    err = refused(lambda: client.request("POST", "/v1/chains/register", {"chain": root.wire}, signer=stolen))
    assert err.code == "tether.unauthorized"


def test_a_proof_is_used_once(cp: ControlPlaneProcess) -> None:
    from tether.capability.proof import make_proof

    ident = cp.issue("replay", {"issues.read": "direct"})
    register(cp, ident)
    s = signer(ident)
    proof = make_proof(s.key, agent=s.agent, method="POST", path="/v1/sidecars/heartbeat", body=b"{}",
                       now=time.time(), link=s.link, run=s.run)

    def send() -> int:
        req = urllib.request.Request(cp.url + "/v1/sidecars/heartbeat", data=b"{}", method="POST",
                                     headers={"Tether-Proof": proof, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert send() == 200
    assert send() == 401


def test_revocation_by_ancestor_only(cp: ControlPlaneProcess) -> None:
    root = cp.issue("rv-root", {"issues.read": "direct"})
    a = cp.delegate(root, "rv-a", {"issues.read": "direct"})
    b = cp.delegate(root, "rv-b", {"issues.read": "direct"})
    leaf = cp.delegate(a, "rv-leaf", {"issues.read": "direct"})
    for ident in (root, a, b, leaf):
        register(cp, ident)
    client = cp.client(admin=False)
    for who in (a, b, leaf):  # itself, a sibling, a descendant
        err = refused(lambda who=who: client.request("POST", f"/v1/grants/{a.jti}/revoke", {}, signer=signer(who)))
        assert err.http_status == 403 and err.code == "tether.forbidden"
    doc = client.request("POST", f"/v1/grants/{a.jti}/revoke", {"reason": "test"}, signer=signer(root))
    assert doc["by"] == "principal:rv-root"
    assert set(doc["agents_cut_off"]) == {"rv-a", "rv-leaf"}
    verdict = client.request("POST", "/v1/chains/verify", {"chain": leaf.wire}, admin=False)
    assert not verdict["valid"] and verdict["error"]["code"] == "tether.chain_revoked"
    assert client.request("POST", "/v1/chains/verify", {"chain": b.wire}, admin=False)["valid"]
    # a chain under a revoked ancestor cannot be registered any more
    late = cp.delegate(a, "rv-late", {"issues.read": "direct"})
    assert refused(lambda: register(cp, late)).code == "tether.chain_revoked"


def test_event_stream_resync_wake_and_isolation(cp: ControlPlaneProcess) -> None:
    root = cp.issue("ev-root", {"issues.read": "direct"})
    child = cp.delegate(root, "ev-child", {"issues.read": "direct"})
    other = cp.issue("ev-other", {"issues.read": "direct"})
    for ident in (root, child, other):
        register(cp, ident)
    client = cp.client(admin=False)
    first = client.request("GET", "/v1/events?after=-1&wait=0", signer=signer(child))
    assert first["resync"] is True and first["revoked"] == []
    seq = first["next"]
    other_first = client.request("GET", "/v1/events?after=-1&wait=0", signer=signer(other))

    results: dict[str, dict] = {}

    def poll() -> None:
        results["child"] = client.request("GET", f"/v1/events?after={seq}&wait=20", signer=signer(child))

    waiter = threading.Thread(target=poll)
    waiter.start()
    time.sleep(0.5)
    cp.client().request("POST", f"/v1/grants/{root.jti}/revoke", {})
    waiter.join(timeout=15)
    assert not waiter.is_alive(), "the long poll did not wake on the revocation"
    events = results["child"]["events"]
    assert [e["payload"]["jti"] for e in events if e["kind"] == "revoke"] == [root.jti]
    # another agent's stream does not carry revocations of chains it does not hold
    quiet = client.request("GET", f"/v1/events?after={other_first['next']}&wait=0", signer=signer(other))
    assert quiet["events"] == []
    # a sidecar that reconnects with a stale or future sequence gets a full resync
    again = client.request("GET", f"/v1/events?after={results['child']['next'] + 1000}&wait=0", signer=signer(child))
    assert again["resync"] is True and again["revoked"] == [root.jti]


def test_heartbeat_lease_and_reports_idempotent(cp: ControlPlaneProcess) -> None:
    ident = cp.issue("hb", {"issues.read": "direct"})
    register(cp, ident)
    client = cp.client(admin=False)
    lease = client.request("POST", "/v1/sidecars/heartbeat", {"state": "serving", "inflight": []}, signer=signer(ident))
    assert lease["lease_ttl_s"] == pytest.approx(cp.lease_ttl)
    reports = [{"call_id": f"c{i}", "method": "GET", "url": "http://x/", "resolution": "completed", "status": 200}
               for i in range(3)]
    assert client.request("POST", "/v1/reports", {"reports": reports}, signer=signer(ident)) == {
        "accepted": 3, "duplicates": 0}
    assert client.request("POST", "/v1/reports", {"reports": reports[1:]}, signer=signer(ident)) == {
        "accepted": 0, "duplicates": 2}
    stored = cp.client().request("GET", "/v1/reports?agent=hb")
    assert sorted(r["call_id"] for r in stored) == ["c0", "c1", "c2"]
    forged = [{"call_id": "x", "agent": "someone-else", "resolution": "completed"}]
    err = refused(lambda: client.request("POST", "/v1/reports", {"reports": forged}, signer=signer(ident)))
    assert err.code == "tether.forbidden"
    view = next(a for a in cp.client().request("GET", "/v1/agents")["agents"] if a["agent"] == "hb")
    assert view["sidecar"]["lease"] == "live"


def test_approvals_flow(cp: ControlPlaneProcess) -> None:
    ident = cp.issue("ap", {"issues.write": "approval"})
    register(cp, ident)
    client = cp.client(admin=False)
    seq = client.request("GET", "/v1/events?after=-1&wait=0", signer=signer(ident))["next"]
    doc = client.request("POST", "/v1/approvals", {"call_id": "call-1", "capability": "issues.write",
                                                  "method": "POST", "url": "http://127.0.0.1/x"}, signer=signer(ident))
    pending = cp.client().request("GET", "/v1/approvals?status=pending")
    assert doc["id"] in [a["id"] for a in pending]
    cp.client().request("POST", f"/v1/approvals/{doc['id']}/deny", {})
    err = refused(lambda: cp.client().request("POST", f"/v1/approvals/{doc['id']}/approve", {}))
    assert err.http_status == 409
    events = client.request("GET", f"/v1/events?after={seq}&wait=5", signer=signer(ident))["events"]
    assert [(e["kind"], e["payload"]["status"]) for e in events] == [("approval", "denied")]


def test_surface_lists_every_capability(cp: ControlPlaneProcess) -> None:
    ident = cp.issue("surf", {"issues.read": "direct", "mcp.send": "approval"})
    register(cp, ident)
    doc = cp.client().request("GET", "/v1/audit/surface?agent=surf")
    caps = doc["agents"]["surf"]
    catalog_names = set(caps)
    assert {"issues.read", "mcp.send", "mcp.delete"} <= catalog_names
    assert [caps[c]["tier"] for c in ("issues.read", "mcp.send", "mcp.delete")] == ["direct", "approval", "absent"]
    assert caps["issues.read"]["wire"]["http"]["path"] == "/repos/*/*/issues*" and caps["issues.read"]["budget"] is None
    assert caps["mcp.send"]["wire"]["mcp"]["tool"] == "send_email"
    assert doc["catalog"].startswith("sha256:") and doc["version"] == 2


def test_openapi_health_metrics(cp: ControlPlaneProcess) -> None:
    client = cp.client()
    spec = client.request("GET", "/openapi.json")
    assert spec["openapi"].startswith("3.")
    contract = ["/v1/grants", "/v1/grants/{jti}/revoke", "/v1/chains/register", "/v1/agents",
                "/v1/agents/{agent}/terminate", "/v1/terminations/{id}", "/v1/approvals",
                "/v1/approvals/{id}/approve", "/v1/approvals/{id}/deny", "/v1/events", "/v1/reports",
                "/v1/records", "/v1/audit/surface", "/metrics", "/healthz"]
    assert [p for p in contract if p not in spec["paths"]] == []
    assert client.request("GET", "/healthz")["status"] == "ok"
    metrics = client.request("GET", "/metrics")
    assert "tether_up 1" in metrics and "tether_event_seq" in metrics


def test_bad_input_gets_codes_not_tracebacks(cp: ControlPlaneProcess, tmp_path: Path) -> None:
    client = cp.client()
    req = urllib.request.Request(cp.url + "/v1/grants", data=b"{not json", method="POST",
                                 headers={"Authorization": "Bearer test-admin-token"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=5)
    assert info.value.code == 400 and info.value.headers["Tether-Error"] == "tether.bad_request"
    err = refused(lambda: client.request("POST", "/v1/grants", {"agent": "x", "subject_key": "nope", "caps": {}}))
    assert err.code == "tether.key_invalid"
    subject = keys.to_jwk(keys.generate().public_key())
    err = refused(lambda: client.request("POST", "/v1/grants", {"agent": "x", "subject_key": subject,
                                                                "caps": {"no.such.cap": "direct"}}))
    assert err.code == "tether.unknown_capability"
    err = refused(lambda: client.request("POST", "/v1/chains/register", {"chain": "a.b.c"}))
    assert err.code == "tether.chain_invalid"
    err = refused(lambda: client.request("POST", "/v1/chains/register", {"chain": "x" * 70_000}))
    assert err.code == "tether.chain_invalid"
    assert refused(lambda: client.request("POST", "/v1/grants/nope/revoke", {})).http_status == 404
