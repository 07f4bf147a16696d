"""A call the agent cancels is ``cancelled`` in the record, and its re-send is a new call linked to it
(``reissue_of``), never charged twice against a budget. The official SDK client cancels as it does in each
protocol version: ``notifications/cancelled`` in 2025-11-25 (legacy), closing the request's stream in
2026-07-28, where closing it is the cancellation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from mcp import Client

from .harness import wait_until
from .mcp_next import MODERN, WAIT, NextWorld, next_world

SLOW = 8.0  # seconds the cancelled call would take: long enough to be cancelled, short enough to re-send whole


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NextWorld]:
    yield from next_world(tmp_path_factory.mktemp("mcp-cancel"))


async def cancel_once_started(world: NextWorld, client: Client, seconds: float) -> None:
    """Call ``slow`` and cancel it once the server runs it (so it surely left), as a caller giving up does."""
    started = world.server.calls.count(f"slow {seconds}")
    call = asyncio.ensure_future(client.call_tool("slow", {"seconds": seconds}))
    for _ in range(int(WAIT / 0.05)):
        if world.server.calls.count(f"slow {seconds}") > started:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the call never reached the server")
    assert not call.done(), "the call finished before it could be cancelled"
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call


@pytest.mark.parametrize("mode", ["legacy", MODERN])
def test_a_cancelled_call_is_cancelled_and_its_resend_is_a_new_call_not_charged_again(
        world: NextWorld, mode: str) -> None:
    agent = f"cancel-{mode}"
    world.server.calls.clear()
    sidecar = world.sidecar(agent, {"next.slow": {"tier": "direct", "calls": 1}, "next.add": "direct"})

    async def body(client: Client) -> tuple[Any, Any]:
        await client.list_tools()
        await cancel_once_started(world, client, SLOW)
        # The cancellation and the re-send are separate requests: a re-send the sidecar sees before the
        # cancellation is a call still in flight, charged like any other (the conservative side). Re-send once
        # the sidecar has resolved the first call, as a client that waits for its cancellation to land does.
        await asyncio.to_thread(wait_until, lambda: [r for r in world.tool_reports(agent, "next.slow")
                                                     if r["resolution"] == "cancelled"], WAIT, 0.1,
                                "the first call resolved as cancelled")
        resent = await client.call_tool("slow", {"seconds": SLOW})  # the same request: a re-issue
        other = await client.call_tool("slow", {"seconds": 0.1})  # a new call: the budget of one is spent
        return resent, other

    resent, other = world.session(sidecar, mode, body)
    assert not resent.is_error and resent.content[0].text == f"slept {SLOW}", resent
    assert other.is_error and other.meta["tether/error"]["code"] == "tether.budget_exhausted", other

    reports = wait_until(lambda: len(r := world.tool_reports(agent, "next.slow")) == 3 and r, WAIT,
                         what="three calls of next.slow reported")
    first, again, third = reports
    assert first["resolution"] == "cancelled", first
    assert first.get("reissue_of") is None
    assert again["resolution"] == "completed" and again["reissue_of"] == first["call_id"], again
    assert third["resolution"] == "refused" and third["code"] == "tether.budget_exhausted", third
    assert third.get("reissue_of") is None
    assert world.server.calls.count(f"slow {SLOW}") == 2  # never merged: the server ran both sends

    # The record lists the link.
    admin = world.cp.client()
    tid = admin.request("POST", f"/v1/agents/{agent}/terminate", {"mode": "abort", "reason": "test"})["id"]
    wait_until(lambda: admin.request("GET", f"/v1/terminations/{tid}")["state"] == "terminated", WAIT,
               what="the termination")
    record = admin.request("GET", f"/v1/records/{tid}")
    entries = {c["call_id"]: c for c in record["calls"]}
    assert entries[first["call_id"]]["resolution"] == "cancelled"
    assert entries[again["call_id"]]["reissue_of"] == first["call_id"]


def test_a_call_that_completes_is_charged_again_when_repeated(world: NextWorld) -> None:
    """Only a call whose answer the agent never read is re-issued: repeating a finished call is a new call."""
    agent = "cancel-repeat"
    sidecar = world.sidecar(agent, {"next.add": {"tier": "direct", "calls": 1}})

    async def body(client: Client) -> tuple[Any, Any]:
        return await client.call_tool("add", {"a": 1, "b": 2}), await client.call_tool("add", {"a": 1, "b": 2})

    done, repeated = world.session(sidecar, "legacy", body)
    assert not done.is_error
    assert repeated.is_error and repeated.meta["tether/error"]["code"] == "tether.budget_exhausted", repeated
    reports = wait_until(lambda: len(r := world.tool_reports(agent, "next.add")) == 2 and r, WAIT, what="reports")
    assert [r["resolution"] for r in reports] == ["completed", "refused"]
    assert all(r.get("reissue_of") is None for r in reports)
