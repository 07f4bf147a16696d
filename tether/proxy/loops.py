"""The loops that tie a serving sidecar to its control plane: the lease's heartbeat, the event stream (revocations,
drain/abort commands, approval decisions) and the call watchdog.

Each loop survives the control plane's absence (it retries with backoff, and the lease it cannot renew makes every
call fail closed with ``tether.lease_expired``); what the events say is handed on, never decided here: a command
goes to the termination edge (``proxy.stopping``), a decision to the held call (``proxy.approvals``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from mitmproxy import http

from tether.capability import protocol
from tether.capability.errors import BAD_REQUEST, ApiError
from tether.capability.errors import CONTROLPLANE_UNREACHABLE as UNREACHABLE
from tether.capability.events import APPROVAL, COMMAND, REVOKE

from .channel import ControlChannel, sleep_backoff
from .phases import HELD
from .reporting import Reporter
from .state import CallTable, SidecarState

log = logging.getLogger("tether.sidecar")


class ControlLoops:
    def __init__(self, channel: ControlChannel, reporter: Reporter, calls: CallTable[http.HTTPFlow], *,
                 on_command: Callable[[dict[str, Any]], None], on_approval: Callable[[dict[str, Any]], None],
                 abort: Callable[[http.HTTPFlow], None], call_timeout_s: float, supersedes: str | None,
                 held_slices: Callable[[], dict[str, Any] | None] = lambda: None) -> None:
        self.channel, self.reporter, self.calls = channel, reporter, calls
        self.held_slices = held_slices  # the budget slices this run holds, named in every beat (proxy/budget.py)
        self.on_command, self.on_approval, self.abort = on_command, on_approval, abort
        self.call_timeout_s = call_timeout_s
        self.supersedes = supersedes  # said in the first heartbeat only
        self.state: SidecarState = None  # type: ignore[assignment]  # once the chain verified (Sidecar.prepare)
        self.seq = -1
        self.started_at = time.time()
        self.address: tuple[str, int] | None = None

    # -- the lease ---------------------------------------------------------------------------------------
    async def heartbeat_once(self) -> None:
        sent = time.monotonic()
        beat = protocol.Heartbeat(
            state=self.state.mode, inflight=self.calls.snapshot(), seq=self.seq, pid=os.getpid(),
            proxy=f"{self.address[0]}:{self.address[1]}" if self.address else None, started_at=self.started_at,
            spooled=self.reporter.count, supersedes=self.supersedes or None,
            revocations_held=self.state.revocations_held(time.monotonic()) if self.state.learned else None,
            budget_slices=self.held_slices())
        lease = await self.channel.heartbeat(beat)
        self.supersedes = None
        self.state.renewed(sent, lease.lease_ttl_s)
        if lease.revoked and self.state.revoke(lease.revoked, time.monotonic()):
            log.warning("revoked (learned from the heartbeat): %s", ", ".join(lease.revoked))
        if lease.command:
            self.on_command(lease.command)

    async def heartbeat_loop(self) -> None:
        failures = 0
        while True:
            await asyncio.sleep(max(0.2, self.state.lease_ttl_s / 3) if failures == 0 else 0.5)
            try:
                await self.heartbeat_once()
                if failures:
                    log.info("control plane reachable again; lease renewed")
                failures = 0
            except ApiError as exc:
                failures += 1
                if failures == 1:
                    log.warning("heartbeat failed: %s (lease runs out in %.1fs)", exc.message,
                                self.state.lease_until - time.monotonic())

    # -- events ------------------------------------------------------------------------------------------
    async def sync_events(self, wait: float) -> None:
        self.apply_events(await self.channel.events(self.seq, wait))

    def apply_events(self, doc: Mapping[str, Any]) -> None:
        """One document of the event channel (a long poll's answer, or one line of the stream), read whole
        before any of it is applied: a malformed one is refused like a broken connection (nothing applied, the
        sequence number kept, so the run resumes from where it was)."""
        try:
            answer = protocol.Events.read(doc)
            for event in answer.events:
                _check_event(event)
        except ApiError as exc:
            raise ApiError(503, UNREACHABLE, f"the control plane's events answer: {exc.message}") from None
        if answer.resync:
            self.state.revoke(answer.revoked, time.monotonic())  # revocations are never undone
            if answer.command:
                self.on_command(answer.command)
            for approval in answer.approvals:
                self.on_approval(approval)
        for event in answer.events:
            self.on_event(event)
        self.seq = answer.next

    def on_event(self, event: Mapping[str, Any]) -> None:
        kind, payload = event.get("kind"), event.get("payload", {})
        if kind == REVOKE:
            if self.state.revoke([payload["jti"]], time.monotonic()):
                log.warning("revoked: %s (%s); refusing every call from now on", payload["jti"], payload.get("agent"))
        elif kind == COMMAND:
            self.on_command(payload)
        elif kind == APPROVAL:
            self.on_approval(payload)

    async def events_loop(self) -> None:
        """Follow the event stream (one long-lived response); a control plane without it (404) is followed
        by long poll instead. Either way a broken connection resumes from the last sequence number."""
        attempt = 0
        streaming = True
        while True:
            try:
                if streaming:
                    async for answer in self.channel.stream_events(self.seq):
                        self.apply_events(answer)
                        attempt = 0
                    await sleep_backoff(0)  # the control plane ended it (a restart, or we fell behind): resume
                else:
                    await self.sync_events(wait=20)
                    attempt = 0
            except ApiError as exc:
                if streaming and exc.http_status in (404, 405):
                    log.info("the control plane has no event stream (HTTP %s); following it by long poll",
                             exc.http_status)
                    streaming = False
                    continue
                attempt += 1
                if attempt == 1:
                    log.warning("event stream interrupted: %s", exc.message)
                await sleep_backoff(attempt)

    # -- call timeouts -----------------------------------------------------------------------------------
    async def watchdog_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.overdue(time.time())

    def overdue(self, now: float) -> None:
        """Cut every call in flight past the call timeout (not one held for a person, not a websocket)."""
        for call in list(self.calls.inflight.values()):
            if call.phase != HELD and now - call.started_at > self.call_timeout_s:
                flow = self.calls.flow_of(call.call_id)
                if flow is not None and flow.websocket is None:  # a websocket is meant to last
                    log.warning("call %s exceeded %.0fs; aborting it (outcome unknown)", call.call_id,
                                self.call_timeout_s)
                    self.abort(flow)


def _check_event(event: Mapping[str, Any]) -> None:
    """An event this run acts on carries what acting needs (a revocation its jti, a command or a decision an
    object), or the whole answer is refused before any of it is applied."""
    kind, payload = event.get("kind"), event.get("payload", {})
    if kind in (REVOKE, COMMAND, APPROVAL) and not isinstance(payload, dict):
        raise ApiError(400, BAD_REQUEST, f"a {kind} event's payload is not an object")
    if kind == REVOKE and not isinstance(payload.get("jti"), str):
        raise ApiError(400, BAD_REQUEST, "a revoke event names no jti")
