"""The sidecar's side of the budget and approval messages (tether/capability/protocol.py): an answer it cannot read
is never acted on. A slice answer it cannot read is no answer (nothing spent from it, its request given up on, the
settlements it carried sent again); an approval answer without an id refuses the held call; a decision it cannot
read denies the approval it names. Over real HTTP: a real control plane, and a real aiohttp server on 127.0.0.1
answering what no control plane should."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from tether.capability import errors as codes
from tether.capability import keys, protocol
from tether.capability.chain import Verifier, parse_chain_unverified
from tether.capability.errors import ApiError
from tether.capability.events import APPROVED, DENIED
from tether.proxy.approvals import Approvals, on_approval
from tether.proxy.budget import REFUSAL_MEMORY_S, Budgets
from tether.proxy.channel import ControlChannel
from tether.proxy.decision import Refusal
from tether.proxy.state import Call

from .harness import ControlPlaneProcess, Identity, prepare_controlplane


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneProcess]:
    proc = prepare_controlplane(tmp_path_factory.mktemp("unreadable"), 1, 2, 3, lease_ttl=30.0).start()
    try:
        yield proc
    finally:
        proc.stop()


def channel(cp: ControlPlaneProcess, ident: Identity, run: str) -> ControlChannel:
    leaf = parse_chain_unverified(ident.wire)[-1].hash
    return ControlChannel(cp.url, ident.agent, leaf, keys.load_private(ident.key_path.read_bytes()), run=run)


@asynccontextmanager
async def answering(doc: Any, status: int = 200) -> AsyncIterator[tuple[str, list[Any]]]:
    """A server on 127.0.0.1 answering every POST with ``doc``; yields its URL and the bodies it was sent."""
    seen: list[Any] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response(doc, status=status)

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


def budget_of(cp: ControlPlaneProcess, ident: Identity) -> dict[str, Any]:
    return cp.client().request("GET", f"/v1/budgets/{ident.jti}")["links"][0]["budgets"]["issues.read"]


@pytest.mark.parametrize("unreadable", [{"slice": 5, "calls": 3}, {"calls": "3", "slice": "x"}, {"calls": 3},
                                        [], {"calls": 0, "error": {"code": 7}}])
def test_a_slice_answer_the_sidecar_cannot_read_is_no_answer(cp: ControlPlaneProcess, unreadable: Any) -> None:
    name = f"unreadable-{os.urandom(4).hex()}"
    ident = cp.issue(name, {"issues.read": {"tier": "direct", "calls": 40}})
    trust = keys.load_private(cp.signing_key_path.read_bytes()).public_key()
    verified = Verifier(trust).verify(ident.wire, now=time.time())

    async def go() -> None:
        ch = channel(cp, ident, f"run-{name}")
        budgets = Budgets(verified, ch)
        pool = budgets.pools["issues.read"]
        try:
            await ch.register(ident.wire)
            waiting = budgets.spend(["issues.read"], "call-1")
            assert waiting is not None
            await waiting
            if pool.fetching is not None:
                await pool.fetching  # the next slice, asked for as the first was spent
            for s in pool.slices:
                s.spent = s.n  # every unit used: the next spend settles them and asks for more
            used = [s.tag for s in pool.slices]
            used_calls = sum(s.n for s in pool.slices)
            real = ch.url
            async with answering(unreadable) as (url, seen):
                ch.url = url
                asked = budgets.asked
                with pytest.raises(Refusal) as refused:
                    waiting = budgets.spend(["issues.read"], "call-2")
                    assert waiting is not None
                    await waiting
                assert refused.value.code == codes.BUDGET_EXHAUSTED
                assert refused.value.details.get("reason") == "slice_unavailable"
                assert "from the control plane" in str(refused.value)
            (sent,) = seen
            assert budgets.asked == asked + 1 and sent["seq"] == asked + 1
            assert sorted(s["slice"].rsplit("/", 1)[1] for s in sent["settle"]) == sorted(used)
            # Nothing was spent from the answer, its request is given up on (the sweep returns what it may have
            # leased), and the settlements it carried wait to be sent again.
            assert not pool.slices and not budgets.asking
            assert sent["slice"] not in budgets.held()["held"]  # type: ignore[index]
            assert sorted(s.tag for s in budgets.to_settle) == sorted(used)
            ch.url = real
            await asyncio.sleep(REFUSAL_MEMORY_S)  # past the refusal's memory, the real control plane is asked
            await budgets.flush()
            assert budgets.held() == {"asked": budgets.asked, "held": []}
            assert (budget_of(cp, ident)["used"], budget_of(cp, ident)["leased"]) == (used_calls, 0)
        finally:
            await ch.close()

    asyncio.run(go())


def test_a_settlement_answer_the_sidecar_cannot_read_leaves_the_slices_held_and_to_be_sent_again(
        cp: ControlPlaneProcess) -> None:
    ident = cp.issue("unreadable-settle", {"issues.read": {"tier": "direct", "calls": 40}})
    trust = keys.load_private(cp.signing_key_path.read_bytes()).public_key()
    verified = Verifier(trust).verify(ident.wire, now=time.time())

    async def go() -> None:
        ch = channel(cp, ident, "run-settle")
        budgets = Budgets(verified, ch)
        pool = budgets.pools["issues.read"]
        try:
            await ch.register(ident.wire)
            waiting = budgets.spend(["issues.read"], "call-1")
            assert waiting is not None
            await waiting
            if pool.fetching is not None:
                await pool.fetching
            tags = sorted(s.tag for s in pool.slices)
            real = ch.url
            async with answering({"settled": [{"slice": "x", "used": "one"}]}) as (url, seen):
                ch.url = url
                with pytest.raises(ApiError) as unreadable:
                    await budgets.release()
                assert unreadable.value.http_status == 503 and "settled slice" in unreadable.value.message
            (sent,) = seen
            assert sorted(s["slice"].rsplit("/", 1)[1] for s in sent["slices"]) == tags
            assert budgets.held() == {"asked": budgets.asked, "held": tags}  # still held: never returned whole
            assert sorted(s.tag for s in budgets.to_settle) == tags
            ch.url = real
            await budgets.flush()
            assert budgets.held() == {"asked": budgets.asked, "held": []}
            assert budget_of(cp, ident)["leased"] == 0
        finally:
            await ch.close()

    asyncio.run(go())


def test_a_slice_request_with_one_bad_settlement_is_refused_whole_and_settles_nothing(cp: ControlPlaneProcess) -> None:
    ident = cp.issue("bad-settlement", {"issues.read": {"tier": "direct", "calls": 40}})

    async def go() -> None:
        ch = channel(cp, ident, "run-bad-settle")
        try:
            await ch.register(ident.wire)
            lease = protocol.SliceLease.read(await ch.call("POST", protocol.SLICES, protocol.SliceRequest(
                "issues.read", 3, "first", 1).to_doc()))
            assert lease.slice is not None and lease.calls >= 1
            before = budget_of(cp, ident)
            with pytest.raises(ApiError) as refused:
                await ch.call("POST", protocol.SLICES, {"capability": "issues.read", "want": 1, "slice": "second",
                                                        "seq": 2, "settle": [{"slice": lease.slice, "used": 0},
                                                                             {"slice": lease.slice, "used": -1}]})
            assert (refused.value.http_status, refused.value.code, refused.value.details.get("field")) == (
                400, "tether.bad_request", "settle")
            assert "'settle[1]': 'used' must be at least 0" in refused.value.message
            assert budget_of(cp, ident) == before  # the good settlement before it was not applied either
            with pytest.raises(ApiError) as refused:
                await ch.call("POST", protocol.SLICES_RETURN, {"slices": [{"slice": lease.slice, "used": 0},
                                                                          {"slice": lease.slice}]})
            assert refused.value.details.get("field") == "slices" and "needs 'used'" in refused.value.message
            assert budget_of(cp, ident) == before
        finally:
            await ch.close()

    asyncio.run(go())


def test_an_approval_answer_without_an_id_refuses_the_held_call() -> None:
    async def go() -> None:
        key = keys.generate()
        async with answering({"status": "pending", "expires_at": 1.0}, status=201) as (url, seen):
            ch = ControlChannel(url, "agent", "sha256:l", key, run="run-1")
            desk = Approvals(ch, lambda call_id: None, None, timeout_s=5.0)  # type: ignore[arg-type]
            call = Call("c-1", "agent", "POST", "http://127.0.0.1:9/tickets", 1.0, capability="tickets.write")
            try:
                answer = await desk.await_approval(call)
            finally:
                await ch.close()
        assert answer.startswith("approval could not be requested: ") and "'id'" in answer
        assert answer != APPROVED and not desk.approvals
        (sent,) = seen
        assert sent == protocol.ApprovalRequest("c-1", "tickets.write", "POST", "http://127.0.0.1:9/tickets", 5.0,
                                                None, None).to_doc()  # no flow: no held call to show

    asyncio.run(go())


class Desk:
    """What ``on_approval`` reads: the futures of the calls waiting, by approval id."""

    def __init__(self) -> None:
        self.approvals: dict[str, asyncio.Future[str]] = {}


@pytest.mark.parametrize(("doc", "result"), [
    ({"id": "apr-1", "status": APPROVED, "call_hash": "h"}, APPROVED),
    ({"id": "apr-1", "status": APPROVED, "call_hash": "other"}, DENIED),
    ({"id": "apr-1", "status": 5, "call_hash": "h"}, DENIED),
    ({"id": "apr-1", "status": APPROVED, "call_hash": ["h"]}, DENIED),
    ({"id": "apr-1"}, DENIED),
])
def test_a_decision_is_applied_as_read_and_one_that_cannot_be_read_is_a_denial(doc: dict, result: str) -> None:
    async def go() -> str:
        desk = Desk()
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        future.call_hash = "h"  # type: ignore[attr-defined]
        desk.approvals["apr-1"] = future
        on_approval(desk, doc)
        return await asyncio.wait_for(future, 1.0)

    assert asyncio.run(go()) == result


def test_a_decision_naming_no_approval_touches_no_held_call() -> None:
    async def go() -> None:
        desk = Desk()
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        desk.approvals["apr-1"] = future
        for doc in ({"id": 5, "status": APPROVED}, {"status": APPROVED}, [], None):
            on_approval(desk, doc)  # type: ignore[arg-type]
        assert not future.done()

    asyncio.run(go())
