"""Calls held for a person's approval: filed with the control plane, answered from the event stream.

An approval binds to the exact call it showed (its ``call_hash``): one naming another request, or a request that
changed while it was held, is a denial. A termination or a stop cancels every hold (``cancel_held``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from mitmproxy import http

from tether.capability import protocol
from tether.capability.errors import ApiError
from tether.capability.events import APPROVED, CANCELLED, DENIED

from .capture import CaptureWriter, call_hash, held_call
from .channel import ControlChannel
from .enforce import APPROVAL_BODY_LIMIT, filing_refused
from .state import Call

log = logging.getLogger("tether.sidecar")


def on_approval(owner: Any, doc: dict[str, Any]) -> None:
    """A decision from the event stream, for ``owner.approvals`` (the sidecar's, or a benchmark's subscriber),
    read as ``protocol.ApprovalDecision``: one that cannot be read denies the approval it names (fail closed)."""
    decision, problem = protocol.decision_from(doc)
    if problem is not None:
        log.error("an approval decision the sidecar cannot read (%s): %s", problem,
                  f"denying approval {decision.id}" if decision is not None else "it names no approval; dropped")
    if decision is None:
        return
    future = owner.approvals.get(decision.id)
    if future is not None and not future.done():
        status = decision.status  # approved | denied | expired | cancelled (by a termination)
        if status == APPROVED and decision.call_hash != getattr(future, "call_hash", None):
            # An approval binds to the exact call it showed; one for any other request is not ours.
            log.error("approval %s names call hash %s, not this call's; refusing the call",
                      decision.id, decision.call_hash)
            status = DENIED
        future.set_result(status)


class Approvals:
    def __init__(self, channel: ControlChannel, flow_of: Callable[[str], http.HTTPFlow | None],
                 capture: CaptureWriter, timeout_s: float) -> None:
        self.channel, self.flow_of, self.capture, self.timeout_s = channel, flow_of, capture, timeout_s
        self.approvals: dict[str, asyncio.Future[str]] = {}  # approval id -> the held call's answer

    def on_approval(self, doc: dict[str, Any]) -> None:
        on_approval(self, doc)

    def cancel_held(self) -> None:
        for future in self.approvals.values():
            if not future.done():
                future.set_result(CANCELLED)

    async def await_approval(self, call: Call) -> str:
        flow = self.flow_of(call.call_id)
        # The body whole (Holds refused any past the limit): the approver sees everything that would leave.
        shown = protocol.HeldCall(**held_call(flow, self.capture.fields, limit=APPROVAL_BODY_LIMIT)) \
            if flow is not None else None
        shown_hash = shown.call_hash if shown is not None else None
        ask = protocol.ApprovalRequest(call.call_id, call.capability, call.method, call.url, self.timeout_s, shown,
                                       shown_hash)
        try:
            answer = await self.channel.ask_approval(ask.to_doc())
        except ApiError as exc:
            refused = filing_refused(exc.code, exc.message)
            if refused is not None:
                raise refused from None
            return f"approval could not be requested: {exc.message}"
        try:
            filed = protocol.ApprovalFiled.read(answer)
        except ApiError as exc:  # no approval id to wait for: the call is refused, as when filing failed
            log.error("call %s: the control plane's answer to its approval request cannot be read: %s",
                      call.call_id, exc.message)
            return f"approval could not be requested: {exc.message}"
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        future.call_hash = shown_hash  # type: ignore[attr-defined]
        self.approvals[filed.id] = future
        log.info("call %s held for approval %s (%s)", call.call_id, filed.id, call.capability)
        try:
            decision = await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            return "timeout"
        finally:
            self.approvals.pop(filed.id, None)
        if decision == APPROVED and (flow is None or call_hash(flow.request) != shown_hash):
            # The request changed while it was held: the person approved another request than this one.
            log.error("call %s changed while held; approval %s does not apply to it", call.call_id, filed.id)
            return DENIED
        return decision
