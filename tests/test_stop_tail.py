"""The stop's tail as a pure machine (tether/proxy/stoptail.py) and its edge (tether/proxy/stopping.py ``finish``).

The table is walked edge by edge; every path a stop can take gives its actions in the order ``Sidecar.stop``
always took them; each action carries the time limit and the tolerance the stop always gave that step; the edge
has one carrier per action, carries them out in the machine's order, swallows a tolerant step's failure or
timeout and lets any other step's error out. What a real stop does end to end is tests/test_sidecar_stop.py's.
"""

from __future__ import annotations

import asyncio
from itertools import product
from types import SimpleNamespace
from typing import Any

import pytest

from tether.proxy import stoptail
from tether.proxy.stopping import STOP_CARRIERS, StopParts, carry, finish
from tether.proxy.stoptail import (
    ACTION_OF,
    TAIL_TRANSITIONS,
    CloseConnections,
    CloseEnclosure,
    CloseFiles,
    CloseSessions,
    Farewell,
    IllegalStep,
    Join,
    Pause,
    ReleaseBudget,
    ShutDown,
    StopListening,
    Stopped,
    StopTail,
    SweepLeft,
)

AFTER_SHUTDOWN = [Join, SweepLeft, ReleaseBudget, Farewell, CloseSessions, CloseFiles, Stopped]


def walk(*, proxy: bool, enclosed: bool, closed: bool) -> tuple[list[type], list[tuple[str, str]]]:
    tail = StopTail(proxy=proxy, enclosed=enclosed)
    actions, steps = [], []
    action = tail.begin()
    previous = tail.step
    while action is not None:
        actions.append(type(action))
        action = tail.done(closed=closed and isinstance(action, CloseConnections))
        if action is not None:
            steps.append((previous, tail.step))
            previous = tail.step
    return actions, steps


@pytest.mark.parametrize(("proxy", "enclosed", "closed", "expected"), [
    (True, True, True, [StopListening, CloseEnclosure, CloseConnections, Pause, ShutDown, *AFTER_SHUTDOWN]),
    (True, True, False, [StopListening, CloseEnclosure, CloseConnections, ShutDown, *AFTER_SHUTDOWN]),
    (True, False, True, [StopListening, CloseConnections, Pause, ShutDown, *AFTER_SHUTDOWN]),
    (True, False, False, [StopListening, CloseConnections, ShutDown, *AFTER_SHUTDOWN]),
    (False, False, False, AFTER_SHUTDOWN),  # it never listened: nothing of the proxy to close
    (False, False, True, AFTER_SHUTDOWN),
])
def test_every_path_gives_the_stops_steps_in_their_order(proxy: bool, enclosed: bool, closed: bool,
                                                        expected: list[type]) -> None:
    assert walk(proxy=proxy, enclosed=enclosed, closed=closed)[0] == expected


def test_the_paths_walk_every_edge_of_the_table_and_no_other() -> None:
    walked = set()
    for proxy, enclosed, closed in product([True, False], repeat=3):
        walked |= set(walk(proxy=proxy, enclosed=enclosed and proxy, closed=closed)[1])
    table = {(a, b) for a, targets in TAIL_TRANSITIONS.items() for b in targets}
    assert walked == table


def test_each_step_keeps_its_time_limit_and_tolerance() -> None:
    limits = {type(a).__name__: (a.timeout_s, a.tolerant) for a in ACTION_OF.values()}
    assert limits == {
        "StopListening": (5.0, True), "ReleaseBudget": (3.0, True), "Farewell": (3.0, True),
        **{name: (None, False) for name in ("CloseEnclosure", "CloseConnections", "Pause", "ShutDown", "Join",
                                            "SweepLeft", "CloseSessions", "CloseFiles", "Stopped")}}
    assert ACTION_OF[stoptail.SETTLING] == Pause(seconds=0.2)
    assert ACTION_OF[stoptail.SWEEPING] == SweepLeft(detail="the sidecar stopped while the call was in flight")


def test_a_step_out_of_the_table_raises() -> None:
    with pytest.raises(IllegalStep, match="before the tail began"):
        StopTail(proxy=True, enclosed=False).done()
    tail = StopTail(proxy=False, enclosed=False)
    tail.begin()
    with pytest.raises(IllegalStep, match="began already"):
        tail.begin()
    while tail.done() is not None:
        pass
    with pytest.raises(IllegalStep, match="after the tail finished"):
        tail.done()
    bad = StopTail(proxy=True, enclosed=False)
    bad.begin()
    with pytest.raises(IllegalStep, match="not in the table"):
        bad._enter(stoptail.FAREWELL)  # unlistening -> farewell skips the rest


def test_the_edge_has_one_carrier_for_each_action_of_the_machine() -> None:
    assert set(STOP_CARRIERS) == {type(a) for a in ACTION_OF.values()}


# -- the edge -----------------------------------------------------------------------------------------------------
def parts(proxy: Any = None) -> StopParts:
    none: Any = None
    return StopParts(proxy, none, [], none, none, none, none, none, None, none, none, none, asyncio.Event())


def recording(done: list[str], *, closed: bool = False, failing: type | None = None,
              slow: type | None = None) -> dict[type, Any]:
    def carrier(kind: type) -> Any:
        async def run(_parts: StopParts, action: Any) -> bool | None:
            done.append(kind.__name__)
            if kind is failing:
                raise RuntimeError(f"{kind.__name__} failed")
            if kind is slow:
                await asyncio.sleep(3600)
            return closed if kind is CloseConnections else None
        return run
    return {kind: carrier(kind) for kind in STOP_CARRIERS}


def test_finish_carries_the_actions_out_in_the_machines_order() -> None:
    done: list[str] = []
    asyncio.run(finish(parts(SimpleNamespace(enclosure=("listener", "socket"))), recording(done, closed=True)))
    assert done == ["StopListening", "CloseEnclosure", "CloseConnections", "Pause", "ShutDown", "Join", "SweepLeft",
                    "ReleaseBudget", "Farewell", "CloseSessions", "CloseFiles", "Stopped"]
    done.clear()
    asyncio.run(finish(parts(), recording(done)))
    assert done == [kind.__name__ for kind in AFTER_SHUTDOWN]


@pytest.mark.parametrize("kind", [StopListening, ReleaseBudget, Farewell])
def test_a_tolerant_step_that_fails_does_not_stop_the_tail(kind: type) -> None:
    done: list[str] = []
    asyncio.run(finish(parts(SimpleNamespace(enclosure=None)), recording(done, failing=kind)))
    assert kind.__name__ in done and done[-1] == "Stopped"


@pytest.mark.parametrize("kind", [StopListening, ReleaseBudget, Farewell])
def test_a_tolerant_step_is_given_up_at_its_time_limit(kind: type) -> None:
    """The carrier never ends by itself; the step's limit (shortened here) ends it, and the tail goes on."""
    done: list[str] = []
    assert asyncio.run(carry(parts(), kind(timeout_s=0.05), recording(done, slow=kind))) is None
    assert done == [kind.__name__]
    with pytest.raises(TimeoutError):  # the same limit on a step that tolerates nothing ends the stop
        asyncio.run(carry(parts(), kind(timeout_s=0.05, tolerant=False), recording(done, slow=kind)))


@pytest.mark.parametrize("kind", [CloseConnections, ShutDown, Join, SweepLeft, CloseSessions, CloseFiles])
def test_any_other_step_that_fails_ends_the_stop_with_its_error(kind: type) -> None:
    done: list[str] = []
    with pytest.raises(RuntimeError, match=f"{kind.__name__} failed"):
        asyncio.run(finish(parts(SimpleNamespace(enclosure=None)), recording(done, failing=kind)))
    assert done[-1] == kind.__name__ and "Stopped" not in done
