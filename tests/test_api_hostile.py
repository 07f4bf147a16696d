"""Hostile input to the control plane's API, against a real server process: malformed, oversized, deeply
nested and ill-typed bodies, existence oracles, per-agent metrics, proofs dated ahead, jti collisions.

Every case here was a 500 with a traceback, a leak or a silent loss before the API read its bodies through
``tether/controlplane/body.py`` and authenticated before looking anything up (issue 11)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tether.capability import keys
from tether.capability.catalog import parse_catalog
from tether.capability.chain import mint_root, parse_chain_unverified
from tether.capability.proof import make_proof
from tether.controlplane.client import Signer

from .harness import ADMIN_TOKEN, ControlPlaneProcess, Identity, prepare_controlplane

DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneProcess]:
    proc = prepare_controlplane(tmp_path_factory.mktemp("hostile"), 1, 2, 3).start()
    try:
        yield proc
    finally:
        proc.stop()


def signer(ident: Identity) -> Signer:
    """Signs as the identity's one sidecar run."""
    return Signer(ident.agent, parse_chain_unverified(ident.wire)[-1].hash,
                  keys.load_private(ident.key_path.read_bytes()), f"run-{ident.agent}")


def send(cp: ControlPlaneProcess, method: str, path: str, body: bytes = b"", *, admin: bool = False,
         sign: Signer | None = None, proof: str | None = None) -> tuple[int, dict[str, str], Any]:
    """One raw request: the body's bytes exactly as given (no client-side JSON encoding)."""
    headers = {"Content-Type": "application/json"}
    if admin:
        headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
    if sign is not None:
        proof = make_proof(sign.key, agent=sign.agent, method=method, path=path, body=body, now=time.time(),
                           link=sign.link, run=sign.run)
    if proof is not None:
        headers["Tether-Proof"] = proof
    req = urllib.request.Request(cp.url + path, data=body if method != "GET" else None, method=method,
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, answer, raw = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        status, answer, raw = exc.code, dict(exc.headers), exc.read()
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = raw.decode(errors="replace")
    return status, answer, doc


def assert_refused(result: tuple[int, dict[str, str], Any], status: int, code: str, *fragments: str) -> None:
    got, headers, doc = result
    assert got == status, doc
    assert headers.get("Tether-Error") == code and doc["error"]["code"] == code, doc
    for fragment in fragments:
        assert fragment in doc["error"]["message"], doc


@pytest.fixture(scope="module")
def sidecar(cp: ControlPlaneProcess) -> Signer:
    ident = cp.issue("hostile-sidecar", {"issues.read": "direct", "issues.write": "approval"})
    s = signer(ident)
    body = json.dumps({"chain": ident.wire}).encode()
    assert send(cp, "POST", "/v1/chains/register", body, sign=s)[0] == 200
    return s


# -- one JSON reader ----------------------------------------------------------------------------------------
def test_deeply_nested_bodies_are_a_400_on_every_route(cp: ControlPlaneProcess, sidecar: Signer) -> None:
    """100k levels of ``[`` was a RecursionError (500 and a traceback) on every route, unauthenticated too."""
    spec = send(cp, "GET", "/openapi.json")[2]
    posts = [p for p, ops in spec["paths"].items() if "post" in ops]
    assert len(posts) >= 10
    for template in posts:
        path = template.replace("{jti}", "nope").replace("{agent}", "nobody").replace("{id}", "nope")
        for admin in (True, False):
            status, headers, doc = send(cp, "POST", path, DEEP, admin=admin)
            assert status < 500, (path, admin, status, doc)
            if status >= 400:  # (a route that reads no body, such as /ui/logout, may answer 200)
                assert headers["Tether-Error"] == doc["error"]["code"], (path, doc)
    for path in ("/v1/sidecars/heartbeat", "/v1/reports", "/v1/approvals", "/v1/sidecars/quiesced"):
        assert_refused(send(cp, "POST", path, DEEP, sign=sidecar), 400, "tether.bad_request", "nested too deeply")
    assert_refused(send(cp, "POST", "/v1/grants", DEEP, admin=True), 400, "tether.bad_request", "nested too deeply")
    shallow_but_deep = b'{"reports": ' + b"[" * 40 + b"]" * 40 + b"}"  # parses, but deeper than any document we read
    assert_refused(send(cp, "POST", "/v1/reports", shallow_but_deep, sign=sidecar), 400, "tether.bad_request",
                   "nested too deeply")


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/v1/sidecars/heartbeat", b"[]", "must be a JSON object, not a list"),
        ("/v1/sidecars/heartbeat", b"5", "must be a JSON object, not a number"),
        ("/v1/sidecars/heartbeat", b'"serving"', "must be a JSON object, not a string"),
        ("/v1/sidecars/heartbeat", b'{"inflight": 5}', "'inflight' must be a list of objects"),
        ("/v1/sidecars/heartbeat", b'{"inflight": [1]}', "'inflight[0]' must be an object"),
        ("/v1/sidecars/heartbeat", b'{"state": ["x"]}', "'state' must be a string"),
        ("/v1/sidecars/heartbeat", b'{"seq": "7"}', "'seq' must be an integer"),
        ("/v1/sidecars/heartbeat", b'{"started_at": NaN}', "not valid JSON"),
        ("/v1/approvals", b"{not json", "not valid JSON"),
        ("/v1/approvals", b'{"call_id": "c1", "timeout_s": "abc"}', "'timeout_s' must be a number, not a string"),
        ("/v1/approvals", b'{"call_id": "c1", "timeout_s": null}', "'timeout_s' must be a number, not null"),
        ("/v1/approvals", b'{"call_id": "c1", "timeout_s": []}', "'timeout_s' must be a number, not a list"),
        ("/v1/approvals", b'{"call_id": "c1", "timeout_s": 1e999}', "not valid JSON"),
        ("/v1/approvals", b'{"timeout_s": 5}', "needs 'call_id'"),
        ("/v1/approvals", b'{"call_id": "c1", "request": {"body_size": "abc"}}', "'body_size' must be an integer"),
        ("/v1/sidecars/quiesced", b'{"termination_id": ["term-1"]}', "'termination_id' must be a string, not a list"),
        ("/v1/sidecars/quiesced", b"{}", "needs 'termination_id'"),
        ("/v1/reports", b'{"reports": 5}', "'reports' must be a list of objects"),
        ("/v1/reports", b'{"reports": [{"call_id": 5}]}', "'call_id' must be a string"),
        ("/v1/reports", b'{"reports": [], "starts": {"a": 1}}', "'starts' must be a list of objects"),
        ("/v1/reports", b"\xff\xfe", "not valid JSON"),
        ("/v1/budgets/slices", b'{"capability": "issues.read", "slice": "t", "want": "2"}',
         "'want' must be an integer, not a string (the slice request)"),
        ("/v1/budgets/slices", b'{"capability": "issues.read", "slice": "t", "settle": [{"slice": "s", "used": -1}]}',
         "'settle[0]': 'used' must be at least 0"),
        ("/v1/budgets/slices", b'{"want": 1, "slice": "t"}', "the slice request needs 'capability'"),
        ("/v1/budgets/slices/return", b"{}", "the slice return needs 'slices'"),
        ("/v1/budgets/slices/return", b'{"slices": [{"used": 1}]}', "'slices[0]': a slice settlement needs 'slice'"),
    ],
)
def test_ill_typed_sidecar_bodies_are_a_400_naming_the_field(cp: ControlPlaneProcess, sidecar: Signer, path: str,
                                                            body: bytes, fragment: str) -> None:
    assert_refused(send(cp, "POST", path, body, sign=sidecar), 400, "tether.bad_request", fragment)


GOOD_HELD = {"method": "POST", "url": "http://127.0.0.1/x", "headers": [["content-type", "application/json"]],
             "body": "{}", "body_encoding": "text", "body_size": 2, "call_hash": "sha256:ab"}


@pytest.mark.parametrize(("held", "field", "fragment"), [
    ({"headers": [["content-type"]]}, "request.headers", "[name, value] pairs of strings"),
    ({"headers": {"content-type": "x"}}, "request.headers", "[name, value] pairs of strings"),
    ({"body_encoding": "gzip"}, "request.body_encoding", "'body_encoding' must be one of text, base64"),
    ({"method": ["POST"]}, "request.method", "'method' must be a string, not a list"),
    ({"call_hash": "h" * 81}, "request.call_hash", "'call_hash' is longer than 80 characters"),
    ({"body_size": None}, "request.body_size", "'body_size' must be an integer, not null"),
])
def test_a_bad_held_call_is_a_400_naming_its_field_and_stores_nothing(cp: ControlPlaneProcess, sidecar: Signer,
                                                                      held: dict, field: str, fragment: str) -> None:
    call_id = f"bad-held-{field}-{len(json.dumps(held))}"
    body = json.dumps({"call_id": call_id, "capability": "issues.write", "request": {**GOOD_HELD, **held}}).encode()
    status, headers, doc = send(cp, "POST", "/v1/approvals", body, sign=sidecar)
    assert_refused((status, headers, doc), 400, "tether.bad_request", "'request': ", fragment)
    assert doc["error"]["field"] == field
    listed = send(cp, "GET", "/v1/approvals?agent=hostile-sidecar", admin=True)[2]
    assert call_id not in {a["call_id"] for a in listed}


def test_a_held_call_filed_whole_is_answered_with_the_filing(cp: ControlPlaneProcess, sidecar: Signer) -> None:
    """The answer is ``ApprovalFiled``: the approval's id, status, expiry, call and hash; the stored approval holds
    the held call as its message writes it."""
    body = json.dumps({"call_id": "good-held", "capability": "issues.write", "timeout_s": 60,
                       "request": GOOD_HELD, "call_hash": "sha256:ab"}).encode()
    status, _, filed = send(cp, "POST", "/v1/approvals", body, sign=sidecar)
    assert status == 201, filed
    assert set(filed) == {"id", "status", "expires_at", "call_id", "call_hash", "requested_at"}
    assert (filed["status"], filed["call_id"], filed["call_hash"]) == ("pending", "good-held", "sha256:ab")
    assert 59 <= filed["expires_at"] - filed["requested_at"] <= 60
    stored = send(cp, "GET", f"/v1/approvals/{filed['id']}", admin=True)[2]
    assert stored["request"] == {**GOOD_HELD, "body_truncated": False, "body_streamed": False}
    assert send(cp, "POST", f"/v1/approvals/{filed['id']}/deny", b"{}", admin=True)[0] == 200


@pytest.mark.parametrize(
    ("field", "raw", "fragment"),
    [
        ("ttl_s", '"inf"', "'ttl_s' must be a number, not a string"),
        ("ttl_s", '"nan"', "'ttl_s' must be a number, not a string"),
        ("ttl_s", '"1e309"', "'ttl_s' must be a number, not a string"),
        ("ttl_s", "1e309", "not valid JSON"),
        ("ttl_s", "Infinity", "not valid JSON"),
        ("ttl_s", "NaN", "not valid JSON"),
        ("ttl_s", str(10**400), "'ttl_s' must be a finite number"),
        ("ttl_s", "-5", "'ttl_s' must be between"),
        ("ttl_s", "true", "'ttl_s' must be a number, not a boolean"),
        ("depth", '"3"', "'depth' must be an integer, not a string"),
        ("depth", "2.5", "'depth' must be an integer, not a number"),
        ("depth", "100000", "'depth' must be between"),
        ("agent", "5", "'agent' must be a string"),
        ("caps", "[]", "'caps' must be an object"),
        ("caps", '{"issues.read": ["direct"]}', "tier must be one of"),
        ("role", "{}", "'role' must be a string"),
    ],
)
def test_ill_typed_grant_fields_are_a_400(cp: ControlPlaneProcess, field: str, raw: str, fragment: str) -> None:
    fields = {"agent": '"typed"', "subject_key": json.dumps(keys.to_jwk(keys.generate().public_key())),
              "caps": '{"issues.read": "direct"}', field: raw}
    body = ("{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}").encode()
    assert_refused(send(cp, "POST", "/v1/grants", body, admin=True), 400, "tether.bad_request", fragment)


def test_admin_bodies_and_queries_are_typed(cp: ControlPlaneProcess, sidecar: Signer) -> None:
    ident = cp.issue("typed-target", {"issues.read": "direct"})
    assert send(cp, "POST", "/v1/chains/register", json.dumps({"chain": ident.wire}).encode(), admin=True)[0] == 200
    for body, fragment in [(b'{"window_s": "30"}', "'window_s' must be a number"),
                           (b'{"window_s": 1e308}', "'window_s' must be between 0 and 86400"),
                           (b'{"mode": "explode"}', "'mode' must be one of drain, abort"),
                           (b'{"reason": {"a": 1}}', "'reason' must be a string")]:
        assert_refused(send(cp, "POST", "/v1/agents/typed-target/terminate", body, admin=True), 400,
                       "tether.bad_request", fragment)
    assert_refused(send(cp, "POST", f"/v1/grants/{ident.jti}/revoke", b'{"reason": 5}', admin=True), 400,
                   "tether.bad_request", "'reason' must be a string")
    assert_refused(send(cp, "POST", "/v1/chains/register", b'{"chain": 5}', admin=True), 400, "tether.bad_request",
                   "'chain'")
    assert_refused(send(cp, "POST", "/v1/audit/diff", b'{"old": [], "new": {}}', admin=True), 400,
                   "tether.bad_request", "'old' must be an object")
    assert_refused(send(cp, "POST", "/v1/audit/diff", b'{"old": {"agents": 5}, "new": {}}', admin=True), 400,
                   "tether.bad_request", "surface")
    assert_refused(send(cp, "POST", "/ui/session", b'{"token": 5}'), 400, "tether.bad_request", "'token'")
    for query in ("wait=nan", "wait=inf", "wait=abc", "after=1.5", "after=" + "9" * 40):
        assert_refused(send(cp, "GET", f"/v1/events?{query}", sign=sidecar), 400, "tether.bad_request",
                       "query parameter")


def test_oversized_bodies_are_refused_with_the_error_shape(cp: ControlPlaneProcess) -> None:
    big = b'{"reason": "' + b"x" * (9 * 1024 * 1024) + b'"}'
    assert_refused(send(cp, "POST", "/v1/grants", big, admin=True), 413, "tether.bad_request", "larger than")


def test_unknown_routes_and_methods_answer_the_error_shape(cp: ControlPlaneProcess) -> None:
    assert_refused(send(cp, "GET", "/v1/nothing-here"), 404, "tether.not_found")
    status, headers, doc = send(cp, "DELETE", "/v1/grants")
    assert (status, headers.get("Tether-Error"), "POST" in headers.get("Allow", "")) == (405, "tether.bad_request",
                                                                                         True), doc


# -- proofs -------------------------------------------------------------------------------------------------
def forged_iat(s: Signer, method: str, path: str, body: bytes, iat: str) -> str:
    """A correctly signed proof whose iat is written as ``iat`` (JSON text)."""
    h, p, _sig = make_proof(s.key, agent=s.agent, method=method, path=path, body=body, now=time.time(),
                            link=s.link, run=s.run).split(".")
    claims = json.loads(keys.b64url_decode(p))
    payload = keys.b64url(json.dumps({**claims, "iat": 0}).replace('"iat": 0', f'"iat": {iat}').encode())
    return f"{h}.{payload}.{keys.b64url(s.key.sign(f'{h}.{payload}'.encode()))}"


@pytest.mark.parametrize("iat", [str(10**400), "1e999", "NaN", "Infinity", '"now"', "true"])
def test_a_proof_with_an_unreadable_iat_is_a_401(cp: ControlPlaneProcess, sidecar: Signer, iat: str) -> None:
    proof = forged_iat(sidecar, "POST", "/v1/sidecars/heartbeat", b"{}", iat)
    assert_refused(send(cp, "POST", "/v1/sidecars/heartbeat", b"{}", proof=proof), 401, "tether.unauthorized", "iat")


def test_a_proof_dated_ahead_is_bounded_by_the_clock_leeway(cp: ControlPlaneProcess, sidecar: Signer) -> None:
    ahead = forged_iat(sidecar, "POST", "/v1/sidecars/heartbeat", b"{}", f"{time.time() + 30:.3f}")
    assert_refused(send(cp, "POST", "/v1/sidecars/heartbeat", b"{}", proof=ahead), 401, "tether.unauthorized",
                   "in the future")
    skewed = forged_iat(sidecar, "POST", "/v1/sidecars/heartbeat", b"{}", f"{time.time() + 2:.3f}")
    assert send(cp, "POST", "/v1/sidecars/heartbeat", b"{}", proof=skewed)[0] == 200
    aged = forged_iat(sidecar, "POST", "/v1/sidecars/heartbeat", b"{}", f"{time.time() - 50:.3f}")
    assert send(cp, "POST", "/v1/sidecars/heartbeat", b"{}", proof=aged)[0] == 200  # the 60 s age bound stays


# -- oracles and leaks ------------------------------------------------------------------------------------
def test_revoke_and_terminate_authenticate_before_looking_up(cp: ControlPlaneProcess) -> None:
    known = cp.issue("oracle-known", {"issues.read": "direct"})
    assert send(cp, "POST", "/v1/chains/register", json.dumps({"chain": known.wire}).encode(), admin=True)[0] == 200
    for path in (f"/v1/grants/{known.jti}/revoke", "/v1/grants/0123456789abcdef/revoke",
                 "/v1/agents/oracle-known/revoke", "/v1/agents/oracle-nobody/revoke",
                 "/v1/agents/oracle-known/terminate", "/v1/agents/oracle-nobody/terminate"):
        assert_refused(send(cp, "POST", path, b"{}"), 401, "tether.unauthorized")
        assert_refused(send(cp, "POST", path, DEEP), 401, "tether.unauthorized")  # not even the body is read
    # An admin still tells them apart.
    assert send(cp, "POST", "/v1/grants/0123456789abcdef/revoke", b"{}", admin=True)[0] == 404
    assert send(cp, "POST", "/v1/agents/oracle-nobody/terminate", b"{}", admin=True)[0] == 404


def test_per_agent_metrics_are_for_admins_only(cp: ControlPlaneProcess) -> None:
    ident = cp.issue("metrics-secret-agent", {"issues.read": "direct"})
    s = signer(ident)
    assert send(cp, "POST", "/v1/chains/register", json.dumps({"chain": ident.wire}).encode(), sign=s)[0] == 200
    assert send(cp, "POST", "/v1/sidecars/heartbeat", b'{"seq": 0}', sign=s)[0] == 200
    public = send(cp, "GET", "/metrics")[2]
    assert "metrics-secret-agent" not in public and "agent=" not in public
    assert "tether_subscriber_lag_events_max" in public
    admin = send(cp, "GET", "/metrics", admin=True)[2]
    assert 'tether_subscriber_lag_events{agent="metrics-secret-agent"}' in admin


def test_a_link_whose_jti_is_taken_is_a_409_and_never_stored(cp: ControlPlaneProcess) -> None:
    first = cp.issue("jti-first", {"issues.read": "direct"})
    assert send(cp, "POST", "/v1/chains/register", json.dumps({"chain": first.wire}).encode(), admin=True)[0] == 200
    signing = keys.load_private(cp.signing_key_path.read_bytes())
    catalog = parse_catalog(cp.catalog_path.read_text(), str(cp.catalog_path))
    twin = mint_root(signing, agent="jti-twin", subject_key=keys.generate().public_key(),
                     caps={"issues.read": "direct"}, now=time.time(), ttl_s=600, depth=1, catalog=catalog,
                     jti=first.jti)
    assert_refused(send(cp, "POST", "/v1/chains/register", json.dumps({"chain": twin}).encode(), admin=True), 409,
                   "tether.conflict", first.jti)
    agents = send(cp, "GET", "/v1/agents", admin=True)[2]["agents"]
    assert [a["agent"] for a in agents if a["jti"] == first.jti] == ["jti-first"]
