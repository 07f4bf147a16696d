"""What the sidecar's own stop does once its drain is over, as a pure machine: one step at a time, each an action
with its own time limit, nothing read or sent here. ``proxy.stopping.finish`` is the async edge that carries the
actions out (``STOP_CARRIERS`` there, one per action) and reports each step's end back.

The steps, in order (``TAIL_TRANSITIONS``)::

    unlistening   StopListening (5 s, errors tolerated)   the proxy's servers stop accepting
    enclosure     CloseEnclosure                          the enclosure's listener (only under ``tether run``)
    closing       CloseConnections                        the agent connections; the edge says if any were open
    settling      Pause(0.2 s)                            (only when some were) their last hooks resolve their calls
    shutting      ShutDown                                mitmproxy's master shuts down
    joining       Join                                    the loops are cancelled; they and the proxy's task end
    sweeping      Sweep                                   what no hook will ever finish is resolved
    releasing     ReleaseBudget (3 s, errors tolerated)   unused budget goes back (what is not returned is spent)
    farewell      Farewell (3 s, errors tolerated)        every report, then the ``stopped`` heartbeat
    sessions      CloseSessions                           the HTTP client sessions
    files         CloseFiles                              DNS, the enclosure's socket, the capture, the state lock
    stopped       Stopped                                 ``Sidecar.stopped`` is set

A stop with no proxy (it never listened) starts at ``joining``. ``begin`` gives the first action, ``done`` the next
once the edge finished one (``None`` after the last); a step outside the table raises ``IllegalStep``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

LISTEN_TIMEOUT_S = 5.0  # the proxy's servers stop accepting within this, or the stop goes on without it
CONNECTIONS_SETTLE_S = 0.2  # after closing the agent connections: their last hooks resolve (and report) their calls
RELEASE_TIMEOUT_S = 3.0  # a stop hands unused budget back for at most this long
FAREWELL_TIMEOUT_S = 3.0  # the last reports and the stopped heartbeat get at most this long
STOP_SWEEP = "the sidecar stopped while the call was in flight"


class Step(StrEnum):
    UNLISTENING = "unlistening"
    ENCLOSURE = "enclosure"
    CLOSING = "closing"
    SETTLING = "settling"
    SHUTTING = "shutting"
    JOINING = "joining"
    SWEEPING = "sweeping"
    RELEASING = "releasing"
    FAREWELL = "farewell"
    SESSIONS = "sessions"
    FILES = "files"
    STOPPED = "stopped"


(UNLISTENING, ENCLOSURE, CLOSING, SETTLING, SHUTTING, JOINING, SWEEPING, RELEASING, FAREWELL, SESSIONS, FILES,
 STOPPED) = Step

TAIL_TRANSITIONS: Mapping[Step, frozenset[Step]] = {
    UNLISTENING: frozenset({ENCLOSURE, CLOSING}),
    ENCLOSURE: frozenset({CLOSING}),
    CLOSING: frozenset({SETTLING, SHUTTING}),
    SETTLING: frozenset({SHUTTING}),
    SHUTTING: frozenset({JOINING}),
    JOINING: frozenset({SWEEPING}),
    SWEEPING: frozenset({RELEASING}),
    RELEASING: frozenset({FAREWELL}),
    FAREWELL: frozenset({SESSIONS}),
    SESSIONS: frozenset({FILES}),
    FILES: frozenset({STOPPED}),
    STOPPED: frozenset(),
}
FIRST_STEPS = frozenset({UNLISTENING, JOINING})  # with a proxy, without one


class IllegalStep(Exception):
    """A step the table does not hold (a ``done`` after the last step, or out of order)."""


# -- the actions: what the edge does at each step; ``timeout_s`` bounds it, ``tolerant`` swallows its errors ----
@dataclass(frozen=True, slots=True)
class Action:
    """An action with no limit whose errors end the stop: the default; the actions below say where they differ."""

    timeout_s: float | None = None
    tolerant: bool = False


@dataclass(frozen=True, slots=True)
class StopListening(Action):
    timeout_s: float | None = LISTEN_TIMEOUT_S
    tolerant: bool = True


@dataclass(frozen=True, slots=True)
class CloseEnclosure(Action):
    pass


@dataclass(frozen=True, slots=True)
class CloseConnections(Action):
    """The edge answers whether any connection was open (``done(closed=...)``)."""


@dataclass(frozen=True, slots=True)
class Pause(Action):
    seconds: float = CONNECTIONS_SETTLE_S


@dataclass(frozen=True, slots=True)
class ShutDown(Action):
    pass


@dataclass(frozen=True, slots=True)
class Join(Action):
    pass


@dataclass(frozen=True, slots=True)
class SweepLeft(Action):
    detail: str = STOP_SWEEP


@dataclass(frozen=True, slots=True)
class ReleaseBudget(Action):
    timeout_s: float | None = RELEASE_TIMEOUT_S
    tolerant: bool = True


@dataclass(frozen=True, slots=True)
class Farewell(Action):
    timeout_s: float | None = FAREWELL_TIMEOUT_S
    tolerant: bool = True


@dataclass(frozen=True, slots=True)
class CloseSessions(Action):
    pass


@dataclass(frozen=True, slots=True)
class CloseFiles(Action):
    pass


@dataclass(frozen=True, slots=True)
class Stopped(Action):
    pass


TailAction = (StopListening | CloseEnclosure | CloseConnections | Pause | ShutDown | Join | SweepLeft | ReleaseBudget
              | Farewell | CloseSessions | CloseFiles | Stopped)
ACTION_OF: Mapping[Step, TailAction] = {
    UNLISTENING: StopListening(), ENCLOSURE: CloseEnclosure(), CLOSING: CloseConnections(), SETTLING: Pause(),
    SHUTTING: ShutDown(), JOINING: Join(), SWEEPING: SweepLeft(), RELEASING: ReleaseBudget(), FAREWELL: Farewell(),
    SESSIONS: CloseSessions(), FILES: CloseFiles(), STOPPED: Stopped(),
}


class StopTail:
    """One stop's tail: where it is, and what comes next."""

    def __init__(self, *, proxy: bool, enclosed: bool) -> None:
        self.proxy, self.enclosed = proxy, enclosed
        self.step: Step | None = None
        self.finished = False  # the last step (``Stopped``) was carried out

    def begin(self) -> TailAction:
        if self.step is not None:
            raise IllegalStep(f"the tail began already (at {self.step})")
        return self._enter(UNLISTENING if self.proxy else JOINING)

    def done(self, *, closed: bool = False) -> TailAction | None:
        """The current step finished (``closed``: ``CloseConnections`` found connections open); the next action,
        or None once stopped."""
        step = self.step
        if step is None:
            raise IllegalStep("done before the tail began")
        if step is STOPPED:
            if self.finished:
                raise IllegalStep("done after the tail finished")
            self.finished = True
            return None
        return self._enter(self._next(step, closed))

    def _next(self, step: Step, closed: bool) -> Step:
        if step is UNLISTENING:
            return ENCLOSURE if self.enclosed else CLOSING
        if step is CLOSING:
            return SETTLING if closed else SHUTTING
        (only,) = TAIL_TRANSITIONS[step]
        return only

    def _enter(self, step: Step) -> TailAction:
        current = self.step
        if (current is None and step not in FIRST_STEPS) or (current is not None
                                                             and step not in TAIL_TRANSITIONS[current]):
            raise IllegalStep(f"{current} -> {step} is not in the table")
        self.step = step
        return ACTION_OF[step]


__all__ = ["ACTION_OF", "TAIL_TRANSITIONS", "IllegalStep", "Step", "StopTail", "TailAction"]
