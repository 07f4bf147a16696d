"""The sidecar's half of termination and of its stop, pure (tether/proxy/quiesce.py), and a call's phases
(tether/proxy/phases.py): no sockets, no clock, milliseconds per test.

Tables: every edge of each transition table is taken or refused as the table says. Properties: over arbitrary
sequences of commands, call ends and clock ticks, a termination ends terminated with every termination that
reached the sidecar acknowledged exactly once, no call is cut that had not left, the window is never cut short
while a call that left is still running, and the sweep comes only after the cut.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.proxy import phases
from tether.proxy import quiesce as q
from tether.proxy.phases import IllegalPhase, Phase
from tether.proxy.state import Call, CallTable

T0 = 1000.0  # monotonic
WALL = 1_750_000_000.0


# -- phases ------------------------------------------------------------------------------------------------------

LEGAL_PHASES = {
    (Phase.ARRIVED, Phase.HELD), (Phase.ARRIVED, Phase.FORWARDING), (Phase.ARRIVED, Phase.DONE),
    (Phase.HELD, Phase.ARRIVED), (Phase.HELD, Phase.DONE),
    (Phase.FORWARDING, Phase.FORWARDED), (Phase.FORWARDING, Phase.DONE),
    (Phase.FORWARDED, Phase.FORWARDED), (Phase.FORWARDED, Phase.DONE),
}


@pytest.mark.parametrize(("start", "to"), list(itertools.product(Phase, Phase)))
def test_every_phase_edge_is_legal_or_raises(start: Phase, to: Phase) -> None:
    if (start, to) in LEGAL_PHASES:
        assert phases.advance(start, to) == to
    else:
        with pytest.raises(IllegalPhase):
            phases.advance(start, to)


def test_a_call_changes_phase_only_along_the_table() -> None:
    call = Call(call_id="c1", agent="a", method="GET", url="http://h:80/", started_at=WALL)
    assert call.phase == "arrived" and not call.left  # the wire's string: the heartbeat lists it as is
    call.enter(Phase.HELD)
    with pytest.raises(IllegalPhase):
        call.enter(Phase.FORWARDING)  # a held call goes back to the last look first
    call.enter(Phase.ARRIVED)
    call.enter(Phase.FORWARDING)
    assert call.left
    call.enter(Phase.FORWARDED)
    call.enter(Phase.DONE)
    with pytest.raises(IllegalPhase):
        call.enter(Phase.FORWARDING)  # a resolved call never leaves
    assert call.phase == "done"


def test_the_table_owns_the_call_to_flow_link() -> None:
    table: CallTable[str] = CallTable()
    sent = Call(call_id="c1", agent="a", method="GET", url="http://h:80/", started_at=WALL)
    held = Call(call_id="c2", agent="a", method="GET", url="http://h:80/", started_at=WALL)
    table.start(sent, "flow-1")
    table.start(held, "flow-2")
    sent.enter(Phase.FORWARDING)
    assert table.flow_of("c1") == "flow-1" and table.leaving() == [sent] and table.unsent_with_flow()
    table.resolve("c2", "refused", WALL)
    assert table.flow_of("c2") is None and not table.unsent_with_flow()
    done = table.resolve("c1", "completed", WALL)
    assert done is sent and sent.phase == Phase.DONE and table.flow_of("c1") is None and table.leaving() == []


# -- the drain's table -------------------------------------------------------------------------------------------

DRAIN_LEGAL = {(q.DRAINING, q.PAUSING), (q.PAUSING, q.CUTTING), (q.CUTTING, q.SETTLING), (q.CUTTING, q.DRAINED),
               (q.SETTLING, q.DRAINED)}
QUIESCE_LEGAL = {(q.SERVING, q.DRAINING), (q.DRAINING, q.DRAINING), (q.DRAINING, q.RELEASING),
                 (q.RELEASING, q.ACKING), (q.ACKING, q.TERMINATED)}


@pytest.mark.parametrize(("start", "to"), list(itertools.product(q.Stage, q.Stage)))
def test_every_stage_edge_is_legal_or_raises(start: q.Stage, to: q.Stage) -> None:
    for table, legal in ((q.DRAIN_TRANSITIONS, DRAIN_LEGAL), (q.QUIESCE_TRANSITIONS, QUIESCE_LEGAL)):
        if (start, to) in legal:
            assert q._go(table, start, to) == to
        else:
            with pytest.raises(q.IllegalStage):
                q._go(table, start, to)


def view(leaving: set[str] = frozenset(), inflight: set[str] | None = None, unsent: bool = False) -> q.View:
    return q.View(frozenset(leaving), frozenset(leaving if inflight is None else inflight), unsent)


def test_a_drain_waits_for_what_left_then_pauses_and_cuts_what_is_still_running() -> None:
    drain, begun = q.Drain.begin(q.Plan(window_s=10.0, settle_s=2.0, arrivals_s=1.0), T0)
    assert begun == (q.CancelHeld(),) and drain.wake_at == T0 + 10.0
    assert drain.tick(T0 + 5, view({"a", "b"})) == ()  # within the window, two calls still running
    assert drain.tick(T0 + 10, view({"b"})) == (q.CancelHeld(),) and drain.stage == q.PAUSING
    assert drain.wake_at == pytest.approx(T0 + 10 + q.PAUSE_S)
    assert drain.tick(T0 + 10.01, view({"b"})) == ()  # the pause holds
    assert drain.tick(T0 + 10.1, view({"b"})) == (q.Cut(("b",)),) and drain.stage == q.CUTTING
    assert drain.tick(T0 + 11, view({"b"})) == ()  # the cut call has not ended yet
    assert drain.tick(T0 + 11.5, view(set(), unsent=True)) == () and drain.stage == q.SETTLING
    assert drain.tick(T0 + 12, view(set(), unsent=True)) == ()
    assert drain.tick(T0 + 12.6, view(set(), unsent=True)) == (q.Sweep(q.TERMINATION_SWEEP),)
    assert drain.drained and drain.wake_at is None


def test_a_drain_with_nothing_in_flight_ends_at_once_but_for_the_pause() -> None:
    drain, _ = q.Drain.begin(q.Plan(window_s=30.0, settle_s=2.0, arrivals_s=1.0), T0)
    assert drain.tick(T0, view()) == (q.CancelHeld(),)  # nothing left for the upstream: no waiting for the window
    assert drain.tick(T0 + q.PAUSE_S, view()) == (q.Sweep(q.TERMINATION_SWEEP),) and drain.drained


def test_a_stop_drains_without_settling_arrivals_or_sweeping() -> None:
    drain, _ = q.Drain.begin(q.stop_plan(10.0), T0)
    assert drain.plan.settle_s == q.STOP_SETTLE_S
    drain.tick(T0 + 10, view({"a"}))
    assert drain.tick(T0 + 11, view({"a"})) == (q.Cut(("a",)),)
    assert drain.tick(T0 + 11 + q.STOP_SETTLE_S, view({"a"})) == () and drain.drained  # the proxy's close ends it


@pytest.mark.parametrize(("command", "draining", "window"), [
    ({"mode": "drain", "window_s": 30, "remaining_s": 12.5}, True, 12.5),  # the control plane's clock counts
    ({"mode": "drain", "window_s": 10, "remaining_s": 99}, True, 10.0),  # never past the window
    ({"mode": "drain", "window_s": 10, "remaining_s": -3}, True, 0.0),
    ({"mode": "drain", "window_s": 10, "deadline": WALL + 4}, True, 4.0),  # an older control plane: the deadline
    ({"mode": "drain", "window_s": 3, "deadline": WALL + 40}, True, 3.0),
    ({"mode": "abort", "window_s": 30, "remaining_s": 30}, False, 0.0),  # an abort has no window
])
def test_a_terminations_window(command: dict[str, Any], draining: bool, window: float) -> None:
    plan = q.termination_plan(command, draining, WALL)
    assert plan.window_s == pytest.approx(window) and plan.arrivals_s == q.ARRIVALS_S
    assert plan.settle_s == 5.0
    assert q.termination_plan({**command, "grace_s": 4}, draining, WALL).settle_s == 2.0  # half the grace


# -- a termination --------------------------------------------------------------------------------------------


def command(tid: str, mode: str = "drain", window: float = 5.0) -> dict[str, Any]:
    return {"termination_id": tid, "mode": mode, "window_s": window, "remaining_s": window}


def test_a_termination_drains_releases_and_acknowledges_every_one_that_reached_it_once() -> None:
    m = q.Quiesce()
    actions = m.command(command("t1"), mode_changed=True, draining=True, now=T0, wall=WALL)
    assert actions == (q.Stamp("t1"), q.CancelHeld()) and m.draining and m.wake_at == T0 + 5.0
    assert m.command(command("t0"), mode_changed=False, draining=True, now=T0 + 1, wall=WALL) == ()  # noted
    m.tick(T0 + 5, view())
    assert m.tick(T0 + 5 + q.PAUSE_S, view()) == (q.Sweep(q.TERMINATION_SWEEP), q.MarkQuiesced(),
                                                   q.Release(q.RELEASE_TIMEOUT_S))
    assert m.stage == q.RELEASING and not m.draining
    (first,) = m.released()
    assert first == q.Acknowledge("t0", {**command("t1"), "termination_id": "t0"})  # in order, the last command's
    assert m.command(command("t1"), mode_changed=False, draining=False, now=T0 + 6, wall=WALL) == ()  # queued
    (second,) = m.acked_one("t0")
    assert second.termination_id == "t1"
    assert m.acked_one("t1") == () and m.stage == q.TERMINATED
    # Terminated: a new termination (an ancestor's) is acknowledged at once, and only once.
    (late,) = m.command(command("t2"), mode_changed=False, draining=False, now=T0 + 7, wall=WALL)
    assert late == q.Acknowledge("t2", command("t2"))
    assert m.command(command("t2"), mode_changed=False, draining=False, now=T0 + 8, wall=WALL) == ()
    m.acked_one("t2")
    assert m.command(command("t2"), mode_changed=False, draining=False, now=T0 + 9, wall=WALL) == ()
    assert m.acked == {"t0", "t1", "t2"}


def test_an_abort_escalating_a_drain_starts_it_anew_without_a_window() -> None:
    m = q.Quiesce()
    m.command(command("t1", window=60), mode_changed=True, draining=True, now=T0, wall=WALL)
    assert m.tick(T0 + 1, view({"slow"})) == ()
    again = m.command(command("t1", "abort"), mode_changed=True, draining=False, now=T0 + 2, wall=WALL)
    assert again == (q.Stamp("t1"), q.CancelHeld()) and m.wake_at == T0 + 2
    assert m.tick(T0 + 2, view({"slow"})) == (q.CancelHeld(),)
    assert m.tick(T0 + 2 + q.PAUSE_S, view({"slow"})) == (q.Cut(("slow",)),)


def test_a_command_that_changes_nothing_starts_no_drain() -> None:
    m = q.Quiesce()
    assert m.command({"termination_id": "t1"}, mode_changed=False, draining=True, now=T0, wall=WALL) == ()
    assert m.stage == q.SERVING and m.commanded == {"t1"} and m.wake_at is None


def test_released_with_nothing_commanded_is_terminated() -> None:
    m = q.Quiesce()
    m.command({"mode": "abort"}, mode_changed=True, draining=False, now=T0, wall=WALL)  # no termination id
    m.tick(T0, view())
    m.tick(T0 + 1, view())
    assert m.stage == q.RELEASING and m.released() == () and m.stage == q.TERMINATED


# -- properties ---------------------------------------------------------------------------------------------------

EVENTS = st.lists(st.one_of(
    st.tuples(st.just("command"), st.sampled_from(["t1", "t2", "t3"]), st.sampled_from(["drain", "abort"])),
    st.tuples(st.just("finish"), st.integers(0, 5)),
    st.tuples(st.just("arrive"), st.integers(0, 5)),
    st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
), max_size=40)


class World:
    """The in-flight table and the sidecar's mode as the edge would keep them, around the pure machine."""

    def __init__(self) -> None:
        self.m = q.Quiesce()
        self.now = T0
        self.mode = "serving"
        self.leaving: set[str] = {f"left-{i}" for i in range(3)}
        self.unsent: set[str] = {"unsent-0"}
        self.cut: set[str] = set()
        self.acks: list[str] = []
        self.swept = False
        self.window_end = float("inf")

    def view(self) -> q.View:
        return q.View(frozenset(self.leaving), frozenset(self.leaving | self.unsent), bool(self.unsent))

    def perform(self, actions: tuple[q.Action, ...]) -> None:
        for action in actions:
            if isinstance(action, q.Cut):
                assert set(action.call_ids) <= self.leaving  # only a call that left is cut
                assert self.now >= self.window_end or self.mode == "aborting"  # never inside the window
                self.cut |= set(action.call_ids)
            elif isinstance(action, q.Sweep):
                assert not self.swept
                self.swept = True
                self.leaving.clear()
                self.unsent.clear()
            elif isinstance(action, q.MarkQuiesced):
                assert self.swept
                self.mode = "terminated"
            elif isinstance(action, q.Release):
                self.perform(self.m.released())
            elif isinstance(action, q.Acknowledge):
                self.acks.append(action.termination_id)
                self.perform(self.m.acked_one(action.termination_id))

    def command(self, tid: str, mode: str) -> None:
        before = self.mode
        if self.mode not in ("terminated", "aborting") and not (self.mode == "draining" and mode == "drain"):
            self.mode = "aborting" if mode == "abort" else "draining"
        if self.mode != before:
            window = 0.0 if mode == "abort" else 2.0
            self.window_end = self.now + window
        self.perform(self.m.command(command(tid, mode, 2.0), mode_changed=self.mode != before,
                                    draining=self.mode == "draining", now=self.now, wall=WALL))

    def tick(self) -> None:
        self.perform(self.m.tick(self.now, self.view()))


@settings(max_examples=300, deadline=None)
@given(events=EVENTS)
def test_every_termination_ends_terminated_each_acknowledged_once(events: list[Any]) -> None:
    w = World()
    commanded: set[str] = set()
    for event in events:
        if event[0] == "command":
            commanded.add(event[1])
            w.command(event[1], event[2])
        elif event[0] == "finish":
            w.leaving.discard(f"left-{event[1]}")
            w.unsent.discard(f"unsent-{event[1]}")
            w.tick()
        elif event[0] == "arrive" and w.mode == "serving":
            w.unsent.add(f"unsent-{event[1]}")  # refused by its own flow once a termination began
        elif event[0] == "tick":
            w.now += event[1]
            w.tick()
    if not commanded:
        assert w.m.stage == q.SERVING and not w.acks
        return
    for _ in range(100):  # the edge's wake-ups, with no call ever finishing on its own
        if not w.m.draining:
            break
        w.now = max(w.now, w.m.wake_at or w.now)
        w.tick()
    assert w.m.stage == q.TERMINATED and w.mode == "terminated" and w.swept
    assert sorted(w.acks) == sorted(commanded) and len(w.acks) == len(set(w.acks))


def test_the_machines_read_no_clock_and_load_no_io() -> None:
    """Pure: the clock is passed in. Neither module imports time, asyncio, mitmproxy or aiohttp (in a fresh
    interpreter, so nothing loaded by another test hides it)."""
    import ast
    import json
    import subprocess
    import sys
    from pathlib import Path

    for module in (q, phases):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
                    for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
        assert not imported & {"time", "asyncio", "mitmproxy", "aiohttp", "os", "socket"}, module.__name__
    code = "import sys, json, tether.proxy.quiesce, tether.proxy.phases; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    loaded = {name.split(".")[0] for name in json.loads(out.stdout)}
    assert not loaded & {"mitmproxy", "aiohttp"}
