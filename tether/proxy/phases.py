"""A call's phase inside the sidecar, as a closed set with its transition table in one place. Pure.

::

    arrived -> held -> arrived            (a person's approval, then the same road as any call)
    arrived -> forwarding -> forwarded    (its start written ahead, then the answer's headers came back)
    any but done -> done                  (its one resolution, docs/contract.md section 5)

``forwarding`` and ``forwarded`` are the phases in which the request may have reached the tool (``LEFT``): a drain
waits for those calls, an abort cuts them, and a call cut or swept in them is ``unknown``, never "not sent".
Every phase change goes through ``advance`` (``proxy.state.Call.enter``), so a change the table does not hold
raises ``IllegalPhase`` instead of leaving a call in a phase that says something untrue about it.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum


class Phase(StrEnum):
    """Values are the strings the heartbeat's in-flight list carries (docs/contract.md section 5)."""

    ARRIVED = "arrived"
    HELD = "held"
    FORWARDING = "forwarding"
    FORWARDED = "forwarded"
    DONE = "done"


ARRIVED, HELD, FORWARDING, FORWARDED, DONE = Phase

TRANSITIONS: Mapping[Phase, frozenset[Phase]] = {
    ARRIVED: frozenset({HELD, FORWARDING, DONE}),
    HELD: frozenset({ARRIVED, DONE}),  # the approval's answer, then the same last look as any call
    FORWARDING: frozenset({FORWARDED, DONE}),
    # A websocket's upgrade is seen twice (its answer's headers, then its response hook): forwarded stays.
    FORWARDED: frozenset({FORWARDED, DONE}),
    DONE: frozenset(),
}

LEFT = frozenset({FORWARDING, FORWARDED})  # the request may have reached the tool


class IllegalPhase(Exception):
    """A phase change the table does not hold: a bug in the sidecar, never a fact about the call."""


def advance(current: Phase, to: Phase) -> Phase:
    """The phase after ``current`` moves to ``to``; raises ``IllegalPhase`` when the table has no such edge."""
    if to not in TRANSITIONS[current]:
        raise IllegalPhase(f"a call cannot go from {current} to {to}")
    return to
