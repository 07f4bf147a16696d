"""Operators (named people with roles) against real processes: a control plane, a sidecar holding a call for
approval, the ``tether`` CLI as a subprocess and the console's HTTP endpoints.

Three operators (a viewer, an approver, a responder) each try the CLI's commands and the console's actions:
what their roles allow succeeds and names them; the rest is refused 403 ``tether.forbidden`` naming the role
needed. Tokens are kept as hashes, rotate, revoke and expire; a termination's record names its operator;
wrong tokens from one source never lock the rightful operator out of the console.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from tether.capability.errors import ApiError
from tether.controlplane.auth import Operator, token_hash
from tether.controlplane.console.sessions import SignInThrottle
from tether.controlplane.metrics import Metrics
from tether.controlplane.services.operators import OperatorService
from tether.controlplane.store import open_store_url

from .conftest import World
from .harness import ADMIN_TOKEN, PYTHON, Identity, RedisServer, wait_until
from .test_console import http


# -- helpers ---------------------------------------------------------------------------------------------
def tether(world: World, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI as a subprocess; with ``token`` it acts as that operator (TETHER_TOKEN, no admin token)."""
    env = {**world.cp.env()}
    if token is not None:
        env.pop("TETHER_ADMIN_TOKEN")
        env["TETHER_TOKEN"] = token
    return subprocess.run([PYTHON, "-m", "tether", *args], env=env, capture_output=True, text=True, timeout=60)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr + result.stdout
    return result.stdout


def forbidden(result: subprocess.CompletedProcess[str], role: str) -> None:
    """Refused with exit 2, ``tether.forbidden``, and the message naming the role needed."""
    assert result.returncode == 2, result.stderr + result.stdout
    assert result.stderr.startswith("error: tether.forbidden:"), result.stderr
    assert f"needs the {role} role" in result.stderr, result.stderr


def add_operator(world: World, name: str, *roles: str, expires: str | None = None) -> str:
    out = ok(tether(world, "operators", "add", name, *[a for r in roles for a in ("--role", r)],
                    *(["--expires", expires] if expires else [])))
    (token,) = re.findall(r"export TETHER_TOKEN=(\S+)", out)
    return token


class Console:
    """One operator signed in to the console, over its HTTP endpoints as the page's scripts call them."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url
        status, headers, body = http(f"{url}/ui/session", "POST", {"token": token})
        assert status == 200, body
        self.session = body
        self.cookie = headers["Set-Cookie"].split(";", 1)[0]

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Cookie": self.cookie}
        if method != "GET":
            headers["X-CSRF-Token"] = self.session["csrf"]
        status, _, answer = http(self.url + path, method, body if body is not None or method == "GET" else {},
                                 headers)
        return status, answer


def refused_for_role(status: int, answer: Any, role: str) -> bool:
    return status == 403 and answer["error"]["code"] == "tether.forbidden" and \
        f"needs the {role} role" in answer["error"]["message"]


def hold_a_call(world: World, sidecar: Any, pool: ThreadPoolExecutor, note: str) -> Any:
    """A POST through the sidecar, held for approval; returns (the future of its answer, the approval)."""
    admin = world.cp.client()
    before = {a["id"] for a in admin.request("GET", "/v1/approvals?status=pending")}
    answer = pool.submit(requests.post, f"{world.tools.base}/echo", json={"note": note}, proxies=sidecar.proxies(),
                         timeout=120)
    approval = wait_until(lambda: [a for a in admin.request("GET", "/v1/approvals?status=pending")
                                   if a["id"] not in before], 30, what=f"the {note} call held for approval")[0]
    return answer, approval


# -- the pure parts --------------------------------------------------------------------------------------
def test_throttle_backs_off_per_source_and_doubles() -> None:
    throttle = SignInThrottle(free=3, base_wait_s=30, max_wait_s=100)
    for at in (0, 1, 2):
        assert throttle.retry_after("10.0.0.1", at) == 0
        throttle.failed("10.0.0.1", at)
    assert throttle.retry_after("10.0.0.1", 2) == 30  # the free tries are used up: wait 30 s from the last one
    assert throttle.retry_after("10.0.0.2", 2) == 0  # another source is not held back
    throttle.failed("10.0.0.1", 40)
    assert throttle.retry_after("10.0.0.1", 40) == 60  # each further wrong token doubles the wait
    throttle.failed("10.0.0.1", 101)
    assert throttle.retry_after("10.0.0.1", 101) == 100  # up to the bound


def test_an_operator_is_named_with_how_they_signed_in() -> None:
    who = Operator("alice", frozenset({"approver"}), "token", token_hash("t"))
    assert who.attribution(5.0) == {"operator": "alice", "via": "token", "at": 5.0}
    assert who.may(frozenset({"approver", "admin"})) and not who.may(frozenset({"responder", "admin"}))
    assert token_hash("t") == token_hash(" t ") != token_hash("u")


# -- both stores, two replicas ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_a_single_sign_on_name_is_one_persons(kind: str, tmp_path: Path) -> None:
    """A provider account may not sign in under a token operator's name, nor under a name another account of the
    provider signed in with first; a token operator may not be added under a single sign-on person's name. Two
    replicas see the same owner."""
    server = RedisServer(tmp_path / "redis").start() if kind == "redis" else None
    url = server.url(0) if server else f"sqlite:///{tmp_path / 'tether.db'}"
    stores = [open_store_url(url), open_store_url(url)]
    try:
        for store in stores:
            await store.open()
        a, b = (OperatorService(store, Metrics([]), lambda: 1000.0) for store in stores)
        admin = Operator("admin", frozenset({"admin"}))
        issuer = "https://idp.example"
        await a.add("alice", ["approver"], None, admin)
        with pytest.raises(ApiError) as held:
            await b.sign_in("alice", ("approver",), 3600, "sub-mallory", issuer)
        assert (held.value.code, held.value.details["reason"]) == ("tether.forbidden", "name_held_by_token_operator")

        token, rita = await a.sign_in("rita", ("responder",), 3600, "sub-rita", issuer)
        assert rita.name == "rita" and await b.by_token(token, 1000.0) is not None
        again, _ = await b.sign_in("rita", ("responder",), 3600, "sub-rita", issuer)  # the same person, again
        assert again != token
        for subject, iss in (("sub-mallory", issuer), ("sub-rita", "https://other.example")):
            with pytest.raises(ApiError) as taken:
                await b.sign_in("rita", ("admin",), 3600, subject, iss)
            assert (taken.value.code, taken.value.details["reason"]) == ("tether.forbidden", "name_taken")
        with pytest.raises(ApiError) as clash:
            await b.add("rita", ["viewer"], None, admin)
        assert clash.value.code == "tether.conflict" and clash.value.http_status == 409

        await a.revoke("alice", admin)  # a revoked token operator's name is free for the person who signs in
        _, alice = await b.sign_in("alice", ("approver",), 3600, "sub-alice", issuer)
        assert alice.via == "oidc"
    finally:
        for store in stores:
            await store.close()
        if server:
            server.stop()


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_operators_hold_across_replicas_of_either_store(kind: str, tmp_path: Path) -> None:
    """What one replica adds, rotates or revokes, the other sees at once; two replicas adding one name at
    the same time make one operator."""
    server = RedisServer(tmp_path / "redis").start() if kind == "redis" else None
    url = server.url(0) if server else f"sqlite:///{tmp_path / 'tether.db'}"
    stores = [open_store_url(url), open_store_url(url)]
    try:
        for store in stores:
            await store.open()
        clock = [1000.0]
        a, b = (OperatorService(store, Metrics([]), lambda: clock[0]) for store in stores)
        admin = Operator("admin", frozenset({"admin"}))
        added = await a.add("alice", ["approver", "viewer"], 60, admin)
        assert added["roles"] == ["viewer", "approver"] and "token_hash" not in added
        alice = await b.by_token(added["token"], clock[0])
        assert alice is not None and (alice.name, alice.roles) == ("alice", frozenset({"viewer", "approver"}))
        rotated = await b.rotate("alice", None, admin)
        assert await a.by_token(added["token"], clock[0]) is None  # the old token proves nobody
        assert (await a.by_token(rotated["token"], clock[0])) is not None
        assert rotated["expires_at"] == clock[0] + 60  # a rotation keeps the lifetime
        clock[0] += 61
        assert await a.by_token(rotated["token"], clock[0]) is None  # expired
        await a.revoke("alice", admin)
        assert (await b.list())[0]["status"] == "revoked"
        results = await asyncio.gather(a.add("bob", ["viewer"], None, admin), b.add("bob", ["admin"], None, admin),
                                       return_exceptions=True)
        wins = [r for r in results if isinstance(r, dict)]
        assert len(wins) == 1 and all(isinstance(r, ApiError) and r.code == "tether.conflict"
                                      for r in results if r not in wins)
        (bob,) = [d for d in await a.list() if d["name"] == "bob"]
        assert bob["roles"] == wins[0]["roles"]
        assert await b.by_token(wins[0]["token"], clock[0]) is not None
    finally:
        for store in stores:
            await store.close()
        if server:
            server.stop()


# -- three operators, the CLI and the console -------------------------------------------------------------
def test_three_operators_each_do_what_their_roles_allow(world: World) -> None:
    w = world
    vera = add_operator(w, "vera", "viewer")
    apu = add_operator(w, "apu", "approver")
    rita = add_operator(w, "rita", "responder")
    assert len({vera, apu, rita}) == 3

    # Listed with roles and who added them, never with a token or its hash.
    listed = ok(tether(w, "operators", "list", "--json"))
    assert all(t not in listed for t in (vera, apu, rita)) and "sha256:" not in listed
    docs = {d["name"]: d for d in json.loads(listed)}
    assert {n: d["roles"] for n, d in docs.items()} == {"apu": ["approver"], "rita": ["responder"], "vera": ["viewer"]}
    assert docs["vera"]["history"][0]["operator"] == "admin" and docs["vera"]["history"][0]["via"] == "token"
    assert ok(tether(w, "operators", "whoami", token=apu)).startswith("apu (approver), signed in by token")
    # The store holds the hash, not the token.
    db = b"".join(f.read_bytes() for f in w.cp.directory.glob("tether.db*"))  # the file and its WAL
    assert vera.encode() not in db and token_hash(vera).encode() in db

    root = w.cp.issue("ops-root", {"echo.any": "approval"})
    child = w.cp.delegate(root, "ops-child", {"echo.any": "approval"})
    sidecar = w.sidecar(child)
    with ThreadPoolExecutor(4) as pool:
        first, held = hold_a_call(w, sidecar, pool, "first")

        # The viewer reads everything and decides nothing.
        assert "ops-child" in ok(tether(w, "agents", token=vera))
        assert held["id"] in ok(tether(w, "approvals", "list", token=vera))
        forbidden(tether(w, "approvals", "approve", held["id"], token=vera), "approver")
        forbidden(tether(w, "approvals", "deny", held["id"], token=vera), "approver")
        forbidden(tether(w, "revoke", "--agent", "ops-child", token=vera), "responder")
        forbidden(tether(w, "terminate", "ops-child", token=vera), "responder")
        forbidden(tether(w, "operators", "add", "eve", "--role", "admin", token=vera), "admin")
        forbidden(tether(w, "operators", "revoke", "apu", token=vera), "admin")
        # The responder may not approve, nor the approver revoke or terminate.
        forbidden(tether(w, "approvals", "approve", held["id"], token=rita), "approver")
        forbidden(tether(w, "revoke", root.jti, token=apu), "responder")
        forbidden(tether(w, "terminate", "ops-root", token=apu), "responder")
        forbidden(tether(w, "operators", "rotate", "rita", token=rita), "admin")

        # The approver approves; the decision names them, and the call goes.
        ok(tether(w, "approvals", "approve", held["id"], "--call-hash", held["call_hash"], token=apu))
        assert first.result().status_code == 200
        decided = w.cp.client().request("GET", f"/v1/approvals/{held['id']}")
        assert (decided["status"], decided["decided_by"], decided["operator"]) == (
            "approved", "apu", {"operator": "apu", "via": "token"})
        assert "approved by apu (token)" in ok(tether(w, "approvals", "list", "--all", token=vera))

        # The same, through the console: each operator signed in with their own token.
        consoles = {name: Console(w.cp.url, token) for name, token in (("vera", vera), ("apu", apu), ("rita", rita))}
        assert {n: (c.session["operator"], c.session["roles"]) for n, c in consoles.items()} == {
            "vera": ("vera", ["viewer"]), "apu": ("apu", ["approver"]), "rita": ("rita", ["responder"])}
        second, held2 = hold_a_call(w, sidecar, pool, "second")
        for name in ("vera", "rita"):
            for action in ("approve", "deny"):
                status, answer = consoles[name].call("POST", f"/v1/approvals/{held2['id']}/{action}",
                                                     {"call_hash": held2["call_hash"]} if action == "approve" else {})
                assert refused_for_role(status, answer, "approver"), (name, action, status, answer)
        for name in ("vera", "apu"):
            for path in ("/v1/agents/ops-child/revoke", "/v1/agents/ops-child/terminate",
                         f"/v1/grants/{child.jti}/revoke"):
                status, answer = consoles[name].call("POST", path, {})
                assert refused_for_role(status, answer, "responder"), (name, path, status, answer)
        for name, console in consoles.items():  # everyone reads every view
            for path in ("/v1/agents", "/v1/approvals", "/v1/terminations", "/v1/records", "/v1/audit/records",
                         "/v1/agents/ops-root/subtree", "/v1/operators"):
                status, answer = console.call("GET", path)
                assert status == 200, (name, path, answer)
        status, denied = consoles["apu"].call("POST", f"/v1/approvals/{held2['id']}/deny", {})
        assert status == 200 and denied["operator"] == {"operator": "apu", "via": "token"}
        assert second.result().status_code == 403  # the denial reached the sidecar

        # The responder revokes the child (console) and terminates the tree (CLI); both name them.
        status, revoked = consoles["rita"].call("POST", f"/v1/grants/{child.jti}/revoke", {"reason": "drill"})
        assert status == 200 and (revoked["by"], revoked["operator"]) == ("rita", {"operator": "rita", "via": "token"})
        agents = w.cp.client().request("GET", "/v1/agents")["agents"]
        (child_view,) = [a for a in agents if a["agent"] == "ops-child"]
        assert child_view["revoked"]["operator"]["operator"] == "rita"
        assert "revoked by rita (token)" in ok(tether(w, "agents", token=vera))

    result = tether(w, "terminate", "ops-root", "--mode", "abort", "--window", "0", "--wait", "--json", token=rita)
    assert result.returncode in (0, 1), result.stderr  # 1: an agent unaccounted for (the record says which)
    record = w.cp.client().request("GET", f"/v1/records/{json.loads(result.stdout)['record_id']}")
    assert record["requested_by"] == "rita" and record["operator"] == {"operator": "rita", "via": "token"}
    assert "requested by rita (token)" in ok(tether(w, "records", "show", record["record_id"], token=vera))
    assert ok(tether(w, "records", "verify", token=vera))  # the record, with its operator, is signed and chained


def test_rotate_revoke_and_expire_end_tokens_and_sessions(world: World) -> None:
    w = world
    apu = add_operator(w, "apu", "approver")
    old_console = Console(w.cp.url, apu)
    rotated = ok(tether(w, "operators", "rotate", "apu"))
    (new,) = re.findall(r"export TETHER_TOKEN=(\S+)", rotated)
    assert new != apu
    assert tether(w, "operators", "whoami", token=apu).returncode == 2  # the old token proves nobody
    assert old_console.call("GET", "/v1/agents")[0] == 401  # nor does a session it signed in
    assert ok(tether(w, "operators", "whoami", token=new)).startswith("apu ")
    new_console = Console(w.cp.url, new)
    ok(tether(w, "operators", "revoke", "apu"))
    result = tether(w, "approvals", "list", token=new)
    assert result.returncode == 2 and "tether.forbidden" in result.stderr
    assert new_console.call("GET", "/v1/approvals")[0] == 401
    history = json.loads(ok(tether(w, "operators", "list", "--json")))[0]
    assert [h["action"] for h in history["history"]] == ["added", "rotated", "revoked"]
    assert history["status"] == "revoked"

    temp = add_operator(w, "temp", "viewer", expires="3s")
    assert ok(tether(w, "operators", "whoami", token=temp)).startswith("temp ")
    wait_until(lambda: tether(w, "operators", "whoami", token=temp).returncode == 2, 60, interval=0.5,
               what="the 3 s token to expire")
    assert json.loads(ok(tether(w, "operators", "list", "--json")))[1]["status"] == "expired"
    # Bad input is refused with the field named; the bootstrap name is not anyone's.
    for args, needle in ((("add", "admin", "--role", "viewer"), "bootstrap admin"),
                         (("add", "Bad Name", "--role", "viewer"), "operator name"),
                         (("add", "x", "--role", "viewer", "--expires", "soon"), "--expires")):
        result = tether(w, "operators", *args)
        assert result.returncode == 2 and "tether.bad_request" in result.stderr and needle in result.stderr, result


def test_wrong_tokens_from_one_source_do_not_lock_the_operator_out(world: World) -> None:
    w = world
    token = add_operator(w, "rita", "responder")
    for _ in range(12):
        status, _, body = http(f"{w.cp.url}/ui/session", "POST", {"token": "tether_op_guess"})
        assert status in (401, 429), body
    status, _, body = http(f"{w.cp.url}/ui/session", "POST", {"token": "tether_op_guess"})
    assert status == 429 and body["error"]["retry_after_s"] > 0  # the source is backing off
    status, _, body = http(f"{w.cp.url}/ui/session", "POST", {"token": token})  # the right one is never held back
    assert status == 200 and body["operator"] == "rita", body
    # A short bootstrap admin token (the harness's is) could be guessed: it waits like a wrong one.
    assert len(ADMIN_TOKEN) < SignInThrottle.STRONG_CHARS
    status, _, body = http(f"{w.cp.url}/ui/session", "POST", {"token": ADMIN_TOKEN})
    assert status == 429, body
    assert "shorter than 20 characters" in (w.cp.directory / "controlplane.log").read_text()


def test_an_operator_may_not_approve_calls_of_an_agent_whose_chain_they_registered(world: World,
                                                                                    tmp_path: Path) -> None:
    carol, ann = add_operator(world, "carol", "admin"), add_operator(world, "ann", "approver")
    key = tmp_path / "sod.key"
    ok(tether(world, "keygen", "--out", str(key)))
    ok(tether(world, "grant", "issue", "--agent", "sod-agent", "--subject-key", f"{key}.pub", "--cap",
              "echo.any=approval", "--out", str(tmp_path / "sod.chain"), token=carol))  # carol registers it
    sidecar = world.sidecar(Identity("sod-agent", tmp_path / "sod.chain", key))
    with ThreadPoolExecutor(2) as pool:
        first, held = hold_a_call(world, sidecar, pool, "separation")
        own = tether(world, "approvals", "approve", held["id"], token=carol)
        assert own.returncode == 2 and own.stderr.startswith("error: tether.forbidden:"), own.stderr
        assert "separation of duties" in own.stderr and "carol registered a link" in own.stderr
        ok(tether(world, "approvals", "approve", held["id"], token=ann))  # another person decides
        assert first.result().status_code == 200
    decided = world.cp.client().request("GET", f"/v1/approvals/{held['id']}")
    assert decided["decided_by"] == "ann"
