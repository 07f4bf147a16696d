"""The sidecar's half of termination, and of its own stop, as pure machines: the clock is passed in, nothing is
read or sent here. ``proxy.stopping`` is the async edge that carries out the actions and feeds the events back.

``Drain`` is what a termination's drain or abort and a SIGTERM share: stop holding calls for a person, wait for
the calls that left, cut the ones still in flight, and give every call its own flow's last word::

    draining --(no call left in flight | the window elapsed)--> pausing        CancelHeld
    pausing  --(the pause elapsed)------------------------------> cutting       Cut(the calls still in flight)
    cutting  --(every cut call finished | the settle elapsed)---> settling      (a termination)
                                                               \\-> drained      (a stop: the edge closes the proxy)
    settling --(no unsent call has a flow | arrivals elapsed)---> drained       Sweep (what no hook will finish)

``Quiesce`` wraps a termination around it: a command starts a drain (an abort escalating a drain starts a new one
with no window), and once drained the sidecar is terminated, hands unused budget back and acknowledges every
termination that reached it, one after another::

    serving --command--> draining (Drain) --drained--> releasing --released--> acking --acked(last)--> terminated

A termination commanded once the sidecar is terminated is acknowledged at once (nothing is in flight). Each
termination is acknowledged once: ``acked`` and ``acking`` are the machine's, not the edge's.

Events: ``Quiesce.command`` (command received), ``tick`` (a call finished, or the wake-up time came: the edge
passes the in-flight table's ``View``), ``released`` (budget handed back), ``acked_one`` (the acknowledgement was
delivered). Each returns the actions for the edge, in order. ``wake_at`` says when the edge must tick next even if
no call finishes. An edge outside the tables (``DRAIN_TRANSITIONS``, ``QUIESCE_TRANSITIONS``) raises
``IllegalStage``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

PAUSE_S = 0.05  # after the last cancellation of holds: cancelled holds and unsent calls meet their refusal
ARRIVALS_S = 1.0  # after the cut (a termination): calls that never left get this long to be refused by their flow
STOP_SETTLE_S = 5.0  # after a stop's cut: how long the cut calls' own hooks get to resolve them
RELEASE_TIMEOUT_S = 5.0  # a termination hands unused budget back for at most this long


class Stage(StrEnum):
    SERVING = "serving"
    DRAINING = "draining"
    PAUSING = "pausing"
    CUTTING = "cutting"
    SETTLING = "settling"
    DRAINED = "drained"
    RELEASING = "releasing"
    ACKING = "acking"
    TERMINATED = "terminated"


SERVING, DRAINING, PAUSING, CUTTING, SETTLING, DRAINED, RELEASING, ACKING, TERMINATED = Stage

# A drain's own stages, in order; a termination's drain that must start anew (an abort escalating a drain) is a new
# Drain, not an edge back.
DRAIN_TRANSITIONS: Mapping[Stage, frozenset[Stage]] = {
    DRAINING: frozenset({PAUSING}),
    PAUSING: frozenset({CUTTING}),
    CUTTING: frozenset({SETTLING, DRAINED}),
    SETTLING: frozenset({DRAINED}),
    DRAINED: frozenset(),
}
# A termination's stages: draining is a Drain under way (a new command may start it anew).
QUIESCE_TRANSITIONS: Mapping[Stage, frozenset[Stage]] = {
    SERVING: frozenset({DRAINING}),
    DRAINING: frozenset({DRAINING, RELEASING}),
    RELEASING: frozenset({ACKING}),
    ACKING: frozenset({TERMINATED}),
    TERMINATED: frozenset(),
}
QUIESCED = frozenset({RELEASING, ACKING, TERMINATED})  # the sidecar's state says terminated: nothing is in flight


class IllegalStage(Exception):
    """A stage change the table does not hold: a bug in the sidecar, never a fact about the world."""


def _go(table: Mapping[Stage, frozenset[Stage]], current: Stage, to: Stage) -> Stage:
    if to not in table.get(current, frozenset()):
        raise IllegalStage(f"the sidecar's stop cannot go from {current} to {to}")
    return to


# -- what the edge is told of the in-flight table, and what it is told to do -----------------------------------


@dataclass(frozen=True, slots=True)
class View:
    """The in-flight table when the edge ticks: the calls that left (forwarding, forwarded), every call still in
    flight, and whether a call that never left is still on a flow of its own."""

    leaving: frozenset[str] = frozenset()
    inflight: frozenset[str] = frozenset()
    unsent_on_flow: bool = False


@dataclass(frozen=True, slots=True)
class CancelHeld:
    """Every call held for a person's approval is answered ``cancelled`` (its flow refuses it)."""


@dataclass(frozen=True, slots=True)
class Cut:
    """Cut these calls' flows off now (their own hooks then resolve them ``unknown``)."""

    call_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Sweep:
    """Resolve every call still in flight (no hook will): ``unknown`` if it left, else ``cancelled_not_sent``."""

    detail: str


@dataclass(frozen=True, slots=True)
class Stamp:
    """Calls in flight belong to this termination (their reports name it)."""

    termination_id: str | None


@dataclass(frozen=True, slots=True)
class MarkQuiesced:
    """The sidecar's state becomes terminated: everything is refused with ``tether.terminated`` from now on."""


@dataclass(frozen=True, slots=True)
class Release:
    """Hand unused budget back (within ``timeout_s``); the edge then calls ``Quiesce.released``."""

    timeout_s: float


@dataclass(frozen=True, slots=True)
class Acknowledge:
    """Deliver every report, then acknowledge ``termination_id`` (retrying); the edge then calls ``acked``."""

    termination_id: str
    command: Mapping[str, Any]


Action = CancelHeld | Cut | Sweep | Stamp | MarkQuiesced | Release | Acknowledge

TERMINATION_SWEEP = "aborted; no final event from the proxy"


# -- the drain, shared by a termination and a stop ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    """One drain: how long calls that left may finish, how long cut calls get to end by their own hooks, and (for
    a termination, None for a stop) how long unsent calls get to meet their refusal before the sweep."""

    window_s: float
    settle_s: float
    arrivals_s: float | None = None


@dataclass
class Drain:
    plan: Plan
    stage: Stage = DRAINING
    deadline: float = 0.0  # monotonic: when the current stage ends whatever the calls do
    cut: frozenset[str] = frozenset()

    @classmethod
    def begin(cls, plan: Plan, now: float) -> tuple[Drain, tuple[Action, ...]]:
        return cls(plan, DRAINING, now + plan.window_s), (CancelHeld(),)

    @property
    def drained(self) -> bool:
        return self.stage == DRAINED

    @property
    def wake_at(self) -> float | None:
        return None if self.drained else self.deadline

    def tick(self, now: float, view: View) -> tuple[Action, ...]:
        """Advance as far as ``now`` and ``view`` allow (several stages at once when nothing holds them)."""
        actions: list[Action] = []
        while not self.drained:
            step = self._step(now, view)
            if step is None:
                break
            actions.extend(step)
        return tuple(actions)

    def _step(self, now: float, view: View) -> tuple[Action, ...] | None:
        expired = now >= self.deadline
        if self.stage == DRAINING:
            if view.leaving and not expired:
                return None
            self._enter(PAUSING, now + PAUSE_S)
            return (CancelHeld(),)
        if self.stage == PAUSING:
            if not expired:
                return None
            self.cut = view.leaving
            self._enter(CUTTING, now + self.plan.settle_s)
            return (Cut(tuple(sorted(view.leaving))),) if view.leaving else ()
        if self.stage == CUTTING:
            if self.cut & view.inflight and not expired:
                return None
            if self.plan.arrivals_s is None:
                self._enter(DRAINED, now)
            else:
                self._enter(SETTLING, now + self.plan.arrivals_s)
            return ()
        if self.stage == SETTLING:
            if view.unsent_on_flow and not expired:
                return None
            self._enter(DRAINED, now)
            return (Sweep(TERMINATION_SWEEP),)
        raise IllegalStage(f"a drain does not tick in {self.stage}")

    def _enter(self, stage: Stage, deadline: float) -> None:
        self.stage = _go(DRAIN_TRANSITIONS, self.stage, stage)
        self.deadline = deadline


def stop_plan(window_s: float) -> Plan:
    """A SIGTERM: what left gets the stop window; the proxy's close, not a settle of arrivals, ends the rest."""
    return Plan(window_s=window_s, settle_s=STOP_SETTLE_S)


def termination_plan(command: Mapping[str, Any], draining: bool, wall: float) -> Plan:
    """A command's drain (``draining``) or abort. The window left as the control plane's good clock saw it when it
    handed the command out (``remaining_s``): the sidecar's own wall clock (``wall``, which may be off) counts only
    for a command without it. The cut calls' final events get half the control plane's grace (at most 5 s), which
    leaves the other half for the reports."""
    window_s = 0.0
    if draining and isinstance(command.get("remaining_s"), int | float):
        window_s = max(0.0, min(float(command["remaining_s"]), float(command.get("window_s", 0))))
    elif draining:
        deadline = min(float(command.get("deadline", wall)), wall + float(command.get("window_s", 0)))
        window_s = max(0.0, deadline - wall)
    settle_s = min(STOP_SETTLE_S, float(command.get("grace_s", 10.0)) / 2)
    return Plan(window_s=window_s, settle_s=settle_s, arrivals_s=ARRIVALS_S)


# -- a termination ---------------------------------------------------------------------------------------------


@dataclass
class Quiesce:
    stage: Stage = SERVING
    drain: Drain | None = None
    last: Mapping[str, Any] = field(default_factory=dict)  # the command the drain runs for
    commanded: set[str] = field(default_factory=set)  # terminations that reached us while serving or draining
    acking: set[str] = field(default_factory=set)  # acknowledgements under way
    acked: set[str] = field(default_factory=set)
    queue: list[str] = field(default_factory=list)  # acknowledged one after another once terminated

    @property
    def wake_at(self) -> float | None:
        return self.drain.wake_at if self.stage == DRAINING and self.drain is not None else None

    @property
    def draining(self) -> bool:
        """A drain is under way (the edge ticks it)."""
        return self.stage == DRAINING

    def command(self, command: Mapping[str, Any], *, mode_changed: bool, draining: bool, now: float,
                wall: float) -> tuple[Action, ...]:
        """A command from the control plane. ``mode_changed``: the sidecar's state took it as a new mode
        (``SidecarState.commanded``; an abort under way is never softened); ``draining``: that mode is a drain."""
        tid = command.get("termination_id")
        if self.stage in QUIESCED:
            # Quiesced already (an earlier termination of this agent or an ancestor): nothing is in flight.
            # One that reached us before (commanded) is acknowledged in its turn, by the queue.
            if not tid or tid in self.acked or tid in self.acking or tid in self.commanded:
                return ()
            self.acking.add(tid)
            return (Acknowledge(tid, {**command}),)
        if tid:
            self.commanded.add(tid)
        if not mode_changed:
            return ()
        self.stage = _go(QUIESCE_TRANSITIONS, self.stage, DRAINING)
        self.last = dict(command)
        self.drain, begun = Drain.begin(termination_plan(command, draining, wall), now)
        return (Stamp(tid), *begun)

    def tick(self, now: float, view: View) -> tuple[Action, ...]:
        if not self.draining or self.drain is None:
            return ()
        actions = self.drain.tick(now, view)
        if not self.drain.drained:
            return actions
        self.stage = _go(QUIESCE_TRANSITIONS, self.stage, RELEASING)
        return (*actions, MarkQuiesced(), Release(RELEASE_TIMEOUT_S))

    def released(self) -> tuple[Action, ...]:
        """Unused budget went back (or the attempt ran out): acknowledge every termination that reached us."""
        self.stage = _go(QUIESCE_TRANSITIONS, self.stage, ACKING)
        self.queue = sorted(self.commanded - self.acked)
        return self._next_ack()

    def acked_one(self, termination_id: str) -> tuple[Action, ...]:
        """The acknowledgement of ``termination_id`` was delivered."""
        self.acking.discard(termination_id)
        self.acked.add(termination_id)
        if self.stage == ACKING and self.queue and self.queue[0] == termination_id:
            self.queue.pop(0)
            return self._next_ack()
        return ()

    def _next_ack(self) -> tuple[Action, ...]:
        while self.queue and self.queue[0] in self.acked:
            self.queue.pop(0)
        if not self.queue:
            self.stage = _go(QUIESCE_TRANSITIONS, self.stage, TERMINATED)
            return ()
        tid = self.queue[0]
        self.acking.add(tid)
        return (Acknowledge(tid, {**self.last, "termination_id": tid}),)
