"""The sidecar's decision state and its in-flight table. Pure: no I/O, time passed in.

``SidecarState.refusal`` answers one question for every call: may anything leave right now? (``admit`` raises
its answer.) It is the chain state ``proxy.decision`` reads: the tiers, and it holds
the mode the control plane commanded (serving, draining, aborting, terminated), the revoked jtis from
the event stream, and the lease (renewed by heartbeats; with no contact for the TTL it fails closed).

``CallTable`` follows every call from arrival to one of the five resolutions of docs/contract.md section 5, and is
the one owner of which flow carries which call (``flow_of``): the drain, the cut and the watchdog find a call's flow
there, and its resolution unlinks both at once. A call's phase changes only through ``Call.enter`` (the table in
``proxy.phases``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from tether.capability import errors as codes
from tether.capability.chain import VerifiedChain, Verifier
from tether.capability.errors import ChainError
from tether.capability.protocol import (  # a run's states, as on the wire
    ABORTING,
    DRAINING,
    SERVING,
    STOPPING,
    TERMINATED,
)
from tether.capability.report import IN_FLIGHT_FIELDS, CallReport
from tether.capability.shared import RESOLUTIONS

from .decision import Refusal
from .phases import ARRIVED, DONE, LEFT, Phase, advance

__all__ = ["Call", "CallTable", "Refusal", "SidecarState", "error_resolution"]  # Refusal: its old home, still read


class SidecarState:
    def __init__(self, chain: VerifiedChain, verifier: Verifier, lease_ttl_s: float, wire: str | None = None) -> None:
        self.chain = chain
        self.wire = chain.wire if wire is None else wire  # as the sidecar was given it (Tether-Chain must equal it)
        self.agent = chain.agent
        self.verifier = verifier
        self.lease_ttl_s = lease_ttl_s
        self.revoked: set[str] = set()
        self.learned: dict[str, float] = {}  # our chain's revoked jtis -> when (monotonic) we learned each
        self.mode = SERVING
        self.command: dict[str, Any] | None = None
        self.lease_until = float("-inf")  # monotonic; no call leaves before the first heartbeat
        self.registered = False
        # The chain's own verdict (revocations, validity in time) is checked once, then holds while nothing it
        # reads changed: ``_epoch`` moves with every revocation learned, and a clearance covers the wall-clock span
        # from the time it was checked to the chain's expiry (a clock that steps back is checked again).
        self._epoch = 0
        self._clear: tuple[int, float, float] | None = None  # (epoch, checked at, clear until): wall clock

    # -- inputs ---------------------------------------------------------------------------------------
    def renewed(self, sent_at_mono: float, ttl_s: float | None = None) -> None:
        """A heartbeat sent at ``sent_at_mono`` succeeded: the lease runs from the moment it was sent."""
        if ttl_s is not None:
            self.lease_ttl_s = ttl_s
        self.lease_until = max(self.lease_until, sent_at_mono + self.lease_ttl_s)

    def revoke(self, jtis: set[str] | list[str], now_mono: float) -> bool:
        """Add revoked jtis (learned at ``now_mono``); True when one of them is in our chain and was not known
        yet (a heartbeat repeats what the control plane holds: said once, not at every beat)."""
        given = set(jtis)
        news = (given & set(self.chain.jtis)) - self.revoked
        for jti in news:
            self.learned[jti] = now_mono
        if not given <= self.revoked:
            self.revoked |= given
            self._epoch += 1  # the chain's clearance no longer holds: the next call checks it again
        return bool(news)

    def revocations_held(self, now_mono: float) -> dict[str, float]:
        """Our chain's revocations and how long ago we learned each: the heartbeat's acknowledgement of them,
        from which the control plane measures propagation on its own clock (tether/controlplane/metrics.py)."""
        return {jti: round(now_mono - at, 4) for jti, at in self.learned.items()}

    def commanded(self, command: dict[str, Any]) -> str:
        """Apply a drain/abort command from the control plane; returns the new mode."""
        if self.mode == TERMINATED:
            return self.mode
        if self.command and self.command.get("termination_id") == command.get("termination_id"):
            if not (self.mode == DRAINING and command.get("mode") == "abort"):
                return self.mode
        mode = ABORTING if command.get("mode") == "abort" else DRAINING
        if self.mode == ABORTING and mode == DRAINING:
            return self.mode  # an abort under way is never softened by another termination's drain
        self.command = dict(command)
        self.mode = mode
        return self.mode

    def quiesced(self) -> None:
        self.mode = TERMINATED

    def stopping(self) -> None:
        """The sidecar stops: admit nothing more (a termination under way keeps its own mode and refusal)."""
        if self.mode == SERVING:
            self.mode = STOPPING

    # -- the decision ---------------------------------------------------------------------------------
    def admit(self, now: float, now_mono: float) -> None:
        """Raise Refusal unless a call may be forwarded now."""
        refusal = self.refusal(now, now_mono)
        if refusal is not None:
            raise refusal

    def refusal(self, now: float, now_mono: float) -> Refusal | None:
        """Why no call may be forwarded now, or None when one may.

        Asked twice per call (at the decision and at the last look before it leaves) and more for one that waited;
        the chain itself is checked once per call at most: after a clearance, only the mode, the lease and the
        clearance's bounds are compared (O(1)). Anything the clearance does not cover checks the chain again."""
        if self.mode == TERMINATED:
            return Refusal(codes.TERMINATED, "this agent has been terminated by the control plane")
        if self.mode in (DRAINING, ABORTING):
            return Refusal(codes.DRAINING, "this agent is being terminated; no new calls are accepted")
        if self.mode == STOPPING:
            return Refusal(codes.STOPPING, "this agent's sidecar is stopping; no new calls are accepted")
        clear = self._clear
        if clear is None or clear[0] != self._epoch or not clear[1] <= now < clear[2]:
            try:
                self.chain.check(now, self.revoked, self.verifier.leeway)
            except ChainError as exc:
                return Refusal(exc.code, exc.message, reason=exc.reason)
            # Valid now, so valid at any later instant before its expiry while no revocation arrives (nbf and the
            # links' issue times only ever lie behind a later now).
            self._clear = (self._epoch, now, self.chain.exp + self.verifier.leeway)
        if now_mono >= self.lease_until:
            return Refusal(codes.LEASE_EXPIRED, "no contact with the control plane within the lease; "
                           "calls resume when it is reachable again")
        return None

    def tier(self, capability: str) -> str:
        return self.chain.tier(capability)


# -- calls ------------------------------------------------------------------------------------------


@dataclass
class Call:
    call_id: str
    agent: str
    method: str
    url: str
    started_at: float
    capability: str | None = None
    tier: str | None = None
    phase: Phase = ARRIVED  # changed only by enter() (proxy.phases holds the table)
    resolution: str | None = None
    status: int | None = None
    code: str | None = None
    ended_at: float | None = None
    capture_ref: str | None = None
    termination_id: str | None = None
    detail: str | None = None
    reissue_of: str | None = None  # an MCP call that re-sends one the client cancelled (tether/proxy/mcpcalls.py)

    def enter(self, phase: Phase) -> None:
        """Move to ``phase``; raises ``proxy.phases.IllegalPhase`` when the table has no such edge."""
        self.phase = advance(self.phase, phase)

    @property
    def left(self) -> bool:
        """The request may have reached the tool (forwarding or forwarded)."""
        return self.phase in LEFT

    def report(self) -> dict[str, Any]:
        """The call as a ``capability.report.CallReport`` document: the report's fields, read off the call (all
        scalars, so no copy is made; ``run_id`` is the control plane's to stamp)."""
        return {name: getattr(self, name) for name in _REPORT_FIELDS}

    def summary(self) -> dict[str, Any]:
        """The call while in flight: what a report knows before the end, and the phase it is in."""
        return {**{name: getattr(self, name) for name in IN_FLIGHT_FIELDS}, "phase": self.phase}


_REPORT_FIELDS = tuple(f.name for f in fields(CallReport) if f.name != "run_id")


def error_resolution(*, connected: bool, sent: bool, aborted: bool) -> str:
    """What a call that ended without a complete answer became.

    Nothing left (no upstream connection, or aborted before forwarding): not sent. Otherwise the
    request may have reached the tool, and we cannot know what it did: ``unknown``, never retried.
    """
    if sent or connected:
        return "unknown"
    return "cancelled_not_sent" if aborted else "failed_not_sent"


class CallTable[Flow]:  # Flow: mitmproxy's HTTPFlow in the sidecar; this module stays free of mitmproxy
    """The calls in flight and which flow carries each: the one owner of the call-to-flow link, both ways (``link``
    gives the flow its call, ``flowstate.link_call`` in the sidecar, so the flow's hooks find it)."""

    def __init__(self, link: Callable[[Flow, Call], None] | None = None) -> None:
        self.inflight: dict[str, Call] = {}
        self._flows: dict[str, Flow] = {}
        self._link = link
        self.counts: dict[str, int] = dict.fromkeys(RESOLUTIONS, 0)

    def start(self, call: Call, flow: Flow | None = None) -> Call:
        """A call arrived (on ``flow``, when one carries it): in flight until its one resolution."""
        if flow is not None:
            if self._link is not None:
                self._link(flow, call)
            self._flows[call.call_id] = flow
        self.inflight[call.call_id] = call
        return call

    def flow_of(self, call_id: str) -> Flow | None:
        """The flow carrying the call, while it is in flight."""
        return self._flows.get(call_id)

    def leaving(self) -> list[Call]:
        """Calls in flight that were forwarded (or are being): the ones a drain waits for and an abort cuts."""
        return [c for c in self.inflight.values() if c.phase in LEFT]

    def unsent_with_flow(self) -> bool:
        """A call that arrived but never left is still in flight on a flow of its own (whose hooks will resolve
        it with what its client saw)."""
        return any(c.phase not in LEFT and c.call_id in self._flows for c in self.inflight.values())

    def resolve(self, call_id: str, resolution: str, now: float, *, status: int | None = None,
                code: str | None = None, detail: str | None = None) -> Call | None:
        """Move a call to its final resolution. A call resolves once; later resolutions are ignored."""
        if resolution not in RESOLUTIONS:
            raise ValueError(f"unknown resolution {resolution}")
        call = self.inflight.pop(call_id, None)
        self._flows.pop(call_id, None)
        if call is None:
            return None
        call.enter(DONE)
        call.resolution, call.status, call.code, call.ended_at = resolution, status, code, now
        call.detail = detail
        self.counts[resolution] += 1
        return call

    def snapshot(self) -> list[dict[str, Any]]:
        return [c.summary() for c in self.inflight.values()]
