"""The sidecar's state and its in-flight table (tether/proxy/state.py), directly: no proxy, no control plane.

``SidecarState`` is what every decision reads (mode, revocations, lease, chain time); ``CallTable`` gives
every call exactly one of the five resolutions. Both take the time as an argument, so every rule is
checked at the instant it turns.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.capability import errors as codes
from tether.capability import keys
from tether.capability.catalog import parse_catalog
from tether.capability.chain import Verifier, mint_child, mint_root, parse_chain_unverified
from tether.capability.shared import RESOLUTIONS
from tether.proxy.decision import Refusal
from tether.proxy.phases import Phase
from tether.proxy.state import ABORTING, DRAINING, SERVING, TERMINATED, Call, CallTable, SidecarState, error_resolution

CATALOG = parse_catalog("capabilities:\n  a.read: {http: {host: a.example, methods: [GET], path: /a}}\n")
TRUST = keys.generate()
PARENT, CHILD = keys.generate(), keys.generate()
T0 = 1_750_000_000.0
TTL = 600


def two_links() -> str:
    root = mint_root(TRUST, agent="parent", subject_key=PARENT.public_key(), caps={"a.read": "direct"}, now=T0,
                     ttl_s=TTL, depth=1, catalog=CATALOG)
    child = mint_child(parse_chain_unverified(root)[0], PARENT, agent="child", subject_key=CHILD.public_key(),
                       caps={"a.read": "approval"}, now=T0, ttl_s=TTL)
    return f"{root},{child}"


WIRE = two_links()


def new_state(lease_ttl_s: float = 15.0) -> SidecarState:
    verifier = Verifier(TRUST.public_key(), catalog_hash=CATALOG.hash, leeway=30)
    return SidecarState(verifier.verify(WIRE, now=T0), verifier, lease_ttl_s=lease_ttl_s)


def code(state: SidecarState, now: float = T0 + 1, mono: float = 101.0) -> str | None:
    refusal = state.refusal(now, mono)
    return refusal.code if refusal else None


def test_the_chain_it_reads() -> None:
    state = new_state()
    assert (state.agent, state.wire) == ("child", WIRE)
    assert state.tier("a.read") == "approval" and state.tier("b.write") == "absent"


def test_no_call_leaves_before_the_first_lease_and_after_it_runs_out() -> None:
    state = new_state()
    assert code(state) == codes.LEASE_EXPIRED
    state.renewed(100.0)  # the heartbeat that succeeded was sent at 100
    assert code(state, mono=114.99) is None
    assert code(state, mono=115.0) == codes.LEASE_EXPIRED
    state.renewed(90.0)  # a late answer to an older heartbeat never shortens the lease
    assert code(state, mono=114.99) is None
    state.renewed(110.0, ttl_s=5.0)  # the control plane sets the TTL
    assert state.lease_ttl_s == 5.0 and code(state, mono=114.99) is None and code(state, mono=115.0) is not None
    with pytest.raises(Refusal) as raised:
        state.admit(T0, 200.0)
    assert raised.value.code == codes.LEASE_EXPIRED and raised.value.http_status == 503


def test_revocations_of_any_link_refuse_and_are_acknowledged_with_their_age() -> None:
    state = new_state()
    state.renewed(100.0)
    assert state.revoke(["someone-elses"], 100.5) is False and code(state) is None
    parent_jti = parse_chain_unverified(WIRE)[0].jti
    assert state.revoke([parent_jti], 100.5) is True  # an ancestor's revocation ends the chain
    assert code(state) == codes.CHAIN_REVOKED
    assert state.revoke([parent_jti], 103.0) is False  # learned once (and said once): the age runs from the first
    assert code(state) == codes.CHAIN_REVOKED
    assert state.revocations_held(101.0) == {parent_jti: 0.5}


def test_chain_time_with_its_leeway() -> None:
    state = new_state()
    state.renewed(100.0)
    assert code(state, now=T0 - 30) is None and code(state, now=T0 - 31) == codes.CHAIN_EXPIRED
    assert code(state, now=T0 + TTL + 29) is None and code(state, now=T0 + TTL + 30) == codes.CHAIN_EXPIRED


@pytest.mark.parametrize(("commands", "mode", "refused"), [
    ([], SERVING, None),
    ([{"termination_id": "t1", "mode": "drain"}], DRAINING, codes.DRAINING),
    ([{"termination_id": "t1", "mode": "abort"}], ABORTING, codes.DRAINING),
    # the same termination escalates from drain to abort, never back
    ([{"termination_id": "t1", "mode": "drain"}, {"termination_id": "t1", "mode": "abort"}], ABORTING, codes.DRAINING),
    ([{"termination_id": "t1", "mode": "abort"}, {"termination_id": "t1", "mode": "drain"}], ABORTING, codes.DRAINING),
    # another termination's abort takes over; its drain never softens an abort under way (both get acknowledged)
    ([{"termination_id": "t1", "mode": "drain"}, {"termination_id": "t2", "mode": "abort"}], ABORTING, codes.DRAINING),
    ([{"termination_id": "t1", "mode": "abort"}, {"termination_id": "t2", "mode": "drain"}], ABORTING, codes.DRAINING),
])
def test_commands(commands: list[dict], mode: str, refused: str | None) -> None:
    state = new_state()
    state.renewed(100.0)
    for command in commands:
        state.commanded(command)
    assert state.mode == mode and code(state) == refused
    assert (state.command or {}).get("mode", "serve") == {SERVING: "serve", DRAINING: "drain", ABORTING: "abort"}[mode]


def test_terminated_is_final_and_refuses_before_anything_else() -> None:
    state = new_state()
    state.commanded({"termination_id": "t1", "mode": "drain"})
    state.quiesced()
    state.revoke([state.chain.jtis[-1]], 0.0)
    assert state.commanded({"termination_id": "t2", "mode": "drain"}) == TERMINATED
    assert code(state, mono=0.0) == codes.TERMINATED  # no lease, revoked: the termination is what it says


def call(call_id: str = "c1") -> Call:
    return Call(call_id=call_id, agent="child", method="GET", url="http://a.example:80/a", started_at=T0)


def test_a_call_resolves_once() -> None:
    table = CallTable()
    first = table.start(call())
    assert table.snapshot() == [{"call_id": "c1", "capability": None, "method": "GET",
                                 "url": "http://a.example:80/a", "started_at": T0, "phase": "arrived"}]
    done = table.resolve("c1", "completed", T0 + 2, status=201, detail="ok")
    assert done is first and (done.resolution, done.status, done.ended_at, done.phase) == ("completed", 201, T0 + 2,
                                                                                          "done")
    assert table.resolve("c1", "unknown", T0 + 3) is None  # a later resolution is ignored
    assert first.resolution == "completed" and table.inflight == {} and table.snapshot() == []
    assert table.counts == {**dict.fromkeys(RESOLUTIONS, 0), "completed": 1}


def test_the_table_alone_links_a_call_and_its_flow_both_ways() -> None:
    """``CallTable.start`` gives the flow its call (``link``, ``flowstate.link_call`` in the sidecar) as it files
    the flow under the call; a call on no flow links nothing; the resolution unlinks the table's side."""
    flows: dict[str, Call] = {}
    table: CallTable[str] = CallTable(lambda flow, c: flows.__setitem__(flow, c))
    on_flow = table.start(call("c1"), "flow-1")
    table.start(call("c2"))
    assert flows == {"flow-1": on_flow} and table.flow_of("c1") == "flow-1" and table.flow_of("c2") is None
    table.resolve("c1", "completed", T0 + 1)
    assert table.flow_of("c1") is None and flows["flow-1"] is on_flow  # the flow's hooks still find their call


def test_every_resolution_is_counted_and_no_other_is_taken() -> None:
    table = CallTable()
    for index, resolution in enumerate(RESOLUTIONS):
        table.start(call(f"c{index}"))
        table.resolve(f"c{index}", resolution, T0, code="tether.x" if resolution == "refused" else None)
    assert table.counts == dict.fromkeys(RESOLUTIONS, 1)
    table.start(call("bad"))
    with pytest.raises(ValueError):
        table.resolve("bad", "maybe", T0)


@pytest.mark.parametrize(("connected", "sent", "aborted", "resolution"), [
    (False, False, False, "failed_not_sent"),
    (False, False, True, "cancelled_not_sent"),
    (True, False, False, "unknown"),
    (True, False, True, "unknown"),
    (False, True, False, "unknown"),
    (True, True, True, "unknown"),
])
def test_error_resolution(connected: bool, sent: bool, aborted: bool, resolution: str) -> None:
    assert error_resolution(connected=connected, sent=sent, aborted=aborted) == resolution


def test_a_calls_report_is_a_call_report_and_reads_back_whole() -> None:
    """The sidecar's call and the report type cannot drift: every report field but run_id is on the call, and
    what the sidecar sends is read by the control plane's reader as it was sent."""
    from dataclasses import fields

    from tether.capability.report import CallReport

    call = Call(call_id="c-1", agent="a", method="POST", url="http://h:80/x", started_at=1.5, capability="t.write",
                tier="direct", resolution="completed", status=201, code=None, ended_at=2.0, capture_ref="f#1",
                termination_id="t-1", detail="ok")
    call.enter(Phase.DONE)
    assert {f.name for f in fields(CallReport)} - {f.name for f in fields(Call)} == {"run_id"}
    doc = call.report()
    assert "phase" not in doc
    assert CallReport.read(doc).to_doc() == {**doc, "run_id": None}
    assert call.summary() == {"call_id": "c-1", "capability": "t.write", "method": "POST", "url": "http://h:80/x",
                              "started_at": 1.5, "phase": "done"}


STEPS = st.lists(st.one_of(
    st.tuples(st.just("wall"), st.floats(-120.0, 400.0)),  # the wall clock moves, backwards too (a step)
    st.tuples(st.just("revoke"), st.sampled_from(["other-jti", "leaf", "root"])),
    st.tuples(st.just("ask"), st.just(0.0)),
), max_size=30)


@settings(max_examples=200, deadline=None)
@given(steps=STEPS, start=st.floats(-60.0, TTL + 60.0))
def test_the_chain_is_checked_once_and_the_clearance_never_outlives_its_facts(steps: list, start: float) -> None:
    """Every answer of the memoised refusal equals a fresh check of the chain at that instant, whatever the clock
    and the revocations did in between; and asking again with nothing changed does not check the chain."""
    state = new_state()
    state.renewed(0.0)
    jtis = {"leaf": state.chain.jtis[-1], "root": state.chain.jtis[0], "other-jti": "other-jti"}
    now = T0 + start
    for kind, value in steps:
        if kind == "wall":
            now += value
        elif kind == "revoke":
            state.revoke([jtis[value]], 0.0)
        fresh = new_state()
        fresh.renewed(0.0)
        fresh.revoke(list(state.revoked), 0.0)
        expected = fresh.refusal(now, 1.0)
        got = state.refusal(now, 1.0)
        assert (got.code if got else None) == (expected.code if expected else None)
        clearance = state._clear
        again = state.refusal(now, 1.0)
        assert (again.code if again else None) == (got.code if got else None)
        if got is None:
            assert state._clear is clearance  # cleared: the second look compares, it does not check the chain
