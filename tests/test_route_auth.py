"""Authentication is declared with each route and enforced in one place (tether/controlplane/routes/__init__.py):
every route names an auth kind, the OpenAPI document publishes it, and every route that is not public
answers 401 to a request that carries no credentials, before it looks anything up or reads its body.
Every route an operator may call names the roles it allows, and every such route is tried with an operator
of every role: allowed ones get past the check, the others get 403 tether.forbidden naming the role.
Against a real server process; the budget view's ancestor rule through a signed request."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether.capability import keys
from tether.capability.chain import parse_chain_unverified
from tether.capability.errors import ApiError
from tether.cli.controlplane import build
from tether.controlplane.auth import ROLES
from tether.controlplane.client import Client, Signer
from tether.controlplane.routes import (
    ADMIN,
    ADMIN_OR_ANCESTOR,
    ADMIN_OR_HOLDER,
    ADMIN_OR_SIDECAR,
    AUTH_KINDS,
    NONE,
    Route,
)

from .harness import ADMIN_TOKEN, ControlPlaneProcess, Identity, prepare_controlplane


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneProcess]:
    proc = prepare_controlplane(tmp_path_factory.mktemp("auth"), 1, 2, 3).start()
    try:
        yield proc
    finally:
        proc.stop()


def signer(ident: Identity) -> Signer:
    leaf = parse_chain_unverified(ident.wire)[-1].hash
    return Signer(ident.agent, leaf, keys.load_private(ident.key_path.read_bytes()), f"run-{leaf[7:23]}")


def served_routes(tmp_path: Path) -> list[Route]:
    prepared = prepare_controlplane(tmp_path, 1, 2, 3)
    return build(f"sqlite:///{tmp_path}/cp.db", str(prepared.catalog_path), str(prepared.signing_key_path),
                 ADMIN_TOKEN).routes


def test_every_route_declares_an_auth_kind(tmp_path: Path) -> None:
    routes = served_routes(tmp_path)
    assert len(routes) > 30
    for route in routes:
        assert route.auth in AUTH_KINDS, (route.method, route.path, route.auth)
    # The public ones are these, and a new route is public only when added here on purpose.
    public = {(r.method, r.path) for r in routes if r.auth == NONE}
    assert public == {("GET", "/healthz"), ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/v1/trust"),
                      ("GET", "/v1/catalog"), ("POST", "/v1/chains/verify"), ("GET", "/ui"), ("GET", "/ui/"),
                      ("GET", "/ui/{view}"), ("GET", "/ui/{view}/{id}"),  # the same page, at each view's address
                      ("GET", "/ui/static/{name}"), ("POST", "/ui/session"), ("GET", "/ui/session"),
                      ("POST", "/ui/logout"), ("GET", "/v1/records/checkpoint")}  # a checkpoint: hashes, signed
    with pytest.raises(ValueError, match="auth"):
        Route("GET", "/nowhere", routes[0].handler, "a route nobody secured", "admin-ish")
    with pytest.raises(ValueError, match="names its roles"):  # a change never defaults to every role
        Route("POST", "/nowhere", routes[0].handler, "a change nobody scoped", ADMIN)
    with pytest.raises(ValueError, match="no operator"):
        Route("GET", "/healthz2", routes[0].handler, "public, with roles", NONE, roles=frozenset({"admin"}))


# Who may change what: written out here, not read from the code, so a route that widens shows in this diff.
# Every other route an operator may call reads, and every role reads.
CHANGES = {
    ("POST", "/v1/approvals/{id}/approve"): {"approver", "admin"},
    ("POST", "/v1/approvals/{id}/deny"): {"approver", "admin"},
    ("POST", "/v1/grants/{jti}/revoke"): {"responder", "admin"},
    ("POST", "/v1/agents/{agent}/revoke"): {"responder", "admin"},
    ("POST", "/v1/agents/{agent}/terminate"): {"responder", "admin"},
    ("POST", "/v1/grants"): {"admin"},
    ("POST", "/v1/chains/register"): {"admin"},
    ("POST", "/v1/operators"): {"admin"},
    ("POST", "/v1/operators/{name}/rotate"): {"admin"},
    ("POST", "/v1/operators/{name}/revoke"): {"admin"},
    ("POST", "/v1/audit/diff"): set(ROLES),  # a read: two documents in, what widened out
}
OPERATOR_KINDS = (ADMIN, ADMIN_OR_ANCESTOR, ADMIN_OR_SIDECAR, ADMIN_OR_HOLDER)


def test_every_operator_route_declares_the_roles_it_allows(tmp_path: Path) -> None:
    routes = [r for r in served_routes(tmp_path) if r.auth in OPERATOR_KINDS]
    declared = {(r.method, r.path): set(r.roles or ()) for r in routes}
    assert {k: v for k, v in declared.items() if k in CHANGES} == CHANGES
    for (method, path), roles in declared.items():
        if (method, path) not in CHANGES:
            assert method == "GET" and roles == set(ROLES), (method, path, roles)


def test_every_route_against_every_role(cp: ControlPlaneProcess) -> None:
    """An operator of each role calls every route an operator may call: a role the route does not allow is
    refused before anything is looked up (403 tether.forbidden naming the role); one it allows gets past the
    check (whatever the route then answers: 200, 400 for the probe body, 404 for the probe id)."""
    admin = cp.client()
    tokens = {role: admin.request("POST", "/v1/operators", {"name": f"every-{role}", "roles": [role]})["token"]
              for role in ROLES}
    ident = cp.issue("role-probe", {"issues.read": "direct"})
    body = json.dumps({"chain": ident.wire}).encode()
    routes = [r for r in served_routes(cp.directory / "routes") if r.auth in OPERATOR_KINDS]
    checked = 0
    for route in routes:
        path = re.sub(r"{\w+}", "probe", route.path)
        for role, token in tokens.items():
            req = urllib.request.Request(cp.url + path, data=body if route.method == "POST" else None,
                                         method=route.method, headers={"Content-Type": "application/json",
                                                                       "Authorization": f"Bearer {token}"})
            try:
                with urllib.request.urlopen(req, timeout=20) as resp:
                    status, answer = resp.status, None
            except urllib.error.HTTPError as exc:
                status, answer = exc.code, json.loads(exc.read() or b"null")
            code = (answer or {}).get("error", {}).get("code") if isinstance(answer, dict) else None
            if role in (route.roles or ()):
                assert status not in (401, 403), (route.method, route.path, role, status, answer)
            else:
                assert (status, code) == (403, "tether.forbidden"), (route.method, route.path, role, status, answer)
                narrow = [r for r in ROLES if r in (route.roles or ()) and r != "admin"]
                needs = f"the {' or '.join(narrow)} role (or admin)" if narrow else "the admin role"
                assert answer["error"]["message"].endswith(f"it needs {needs}"), answer
                assert answer["error"]["operator"] == f"every-{role}"
            checked += 1
    assert checked == 4 * len(routes) and len(routes) > 25
    with urllib.request.urlopen(cp.url + "/openapi.json", timeout=10) as resp:  # and the document says so
        paths = json.load(resp)["paths"]
    for route in routes:
        published = paths[route.path][route.method.lower()]["x-tether-roles"]
        assert published == [r for r in ROLES if r in (route.roles or ())], (route.method, route.path)
        assert set(published) == CHANGES.get((route.method, route.path), set(ROLES))
    assert Client(cp.url, tokens["viewer"]).request("GET", "/v1/operators/me")["operator"] == "every-viewer"


def test_every_route_but_the_public_ones_answers_401_without_credentials(cp: ControlPlaneProcess) -> None:
    ident = cp.issue("auth-probe", {"issues.read": "direct"})
    body = json.dumps({"chain": ident.wire}).encode()  # a well-formed body: the refusal must be the auth's
    with urllib.request.urlopen(cp.url + "/openapi.json", timeout=10) as resp:
        paths = json.load(resp)["paths"]
    checked = 0
    for path, operations in paths.items():
        for method, op in operations.items():
            if op["security"] == []:
                continue  # declared public
            url = cp.url + re.sub(r"{\w+}", "probe", path)
            req = urllib.request.Request(url, data=body if method == "post" else None, method=method.upper(),
                                         headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(req, timeout=10)
            assert info.value.code == 401, (method, path, info.value.code)
            assert info.value.headers["Tether-Error"] == "tether.unauthorized", (method, path)
            checked += 1
    assert checked >= 25


def test_a_budget_view_is_an_admins_or_an_ancestors(cp: ControlPlaneProcess) -> None:
    root = cp.issue("bv-root", {"issues.read": {"tier": "direct", "calls": 5}})
    child = cp.delegate(root, "bv-child", {"issues.read": {"tier": "direct", "calls": 2}})
    client = cp.client(admin=False)
    for ident in (root, child):
        client.request("POST", "/v1/chains/register", {"chain": ident.wire}, signer=signer(ident))
    view = client.request("GET", f"/v1/budgets/{child.jti}", signer=signer(root))
    assert view["links"][0]["agent"] == "bv-child"
    with pytest.raises(ApiError) as info:
        client.request("GET", f"/v1/budgets/{root.jti}", signer=signer(child))
    assert (info.value.http_status, info.value.code) == (403, "tether.forbidden")


def test_an_acknowledgement_reads_its_reports_as_a_batch_does(cp: ControlPlaneProcess) -> None:
    """One way in: a quiesce acknowledgement's reports meet the same reader and the same agent check as
    ``POST /v1/reports``, and nothing of a refused acknowledgement is stored."""
    ident = cp.issue("ack-one-way", {"issues.read": "direct"})
    client = cp.client(admin=False)
    client.request("POST", "/v1/chains/register", {"chain": ident.wire}, signer=signer(ident))
    tid = cp.client().request("POST", "/v1/agents/ack-one-way/terminate", {"mode": "abort", "window_s": 30})[
        "termination_id"]
    for reports, status, code in (([{"call_id": "k-1", "status": "200"}], 400, "tether.bad_request"),
                                  ([{"call_id": "k-1", "agent": "someone-else", "resolution": "completed"}], 403,
                                   "tether.forbidden")):
        for path, doc in (("/v1/reports", {"reports": reports}),
                          ("/v1/sidecars/quiesced", {"termination_id": tid, "reports": reports})):
            with pytest.raises(ApiError) as info:
                client.request("POST", path, doc, signer=signer(ident))
            assert (info.value.http_status, info.value.code) == (status, code), (path, reports)
    assert cp.client().request("GET", "/v1/reports?agent=ack-one-way") == []
    assert "ack-one-way" in cp.client().request("GET", f"/v1/terminations/{tid}")["waiting_for"]
    answer = client.request("POST", "/v1/sidecars/quiesced", {"termination_id": tid, "reports": [
        {"call_id": "k-1", "resolution": "completed", "status": 200}]}, signer=signer(ident))
    assert answer["ok"] is True
    stored = cp.client().request("GET", "/v1/reports?agent=ack-one-way")
    assert [(r["call_id"], r["agent"], r["run_id"]) for r in stored] == [("k-1", "ack-one-way", answer["run_id"])]
