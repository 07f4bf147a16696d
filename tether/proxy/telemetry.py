"""The sidecar's OpenTelemetry spans: one ``execute_tool`` span per call, in the agent's trace.

A Pipeline stage placed right after the Tracker: when a request's headers arrive it opens the call's span,
child of the agent's W3C ``traceparent`` when the request carries one, and rewrites ``traceparent`` to
name this span, so the tool server's own spans join the agent's trace below tether's. The span ends
where the call resolves (``Sidecar.resolve``, whichever addon or loop resolved it), named for the MCP
tool of a ``tools/call``, else the capability, else ``unknown`` (refused before anything matched), with
the GenAI semantic-convention attributes and tether's own; a call that did not complete ends in status
ERROR, described by its tether code (or its resolution).

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set: ``call_tracing`` then returns no stage and nothing
here imports OpenTelemetry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tether.capability.tracing import enabled, tracer

from .flowstate import call_of, state_of

log = logging.getLogger("tether.sidecar")

if TYPE_CHECKING:
    from mitmproxy import http

    from .state import Call


def call_tracing(agent: str, run_id: str, resolved: list[Callable[[Call], None]]) -> list[Any]:
    """The tracing stage for the sidecar's pipeline, its spans ended by the sidecar's ``resolved`` hooks; none
    when tracing is off."""
    if not enabled():
        return []
    return [CallTracing(tracer("tether-sidecar", {"tether.agent": agent, "tether.run_id": run_id}), resolved)]


class CallTracing:
    def __init__(self, tracer: Any, resolved: list[Callable[[Call], None]]) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # reads tracestate too
        from opentelemetry.trace.status import Status, StatusCode

        self.tracer = tracer
        self._kind = trace.SpanKind.CLIENT
        self._error = lambda text: Status(StatusCode.ERROR, text)
        self._w3c = TraceContextTextMapPropagator()
        self.open: dict[str, tuple[Any, http.HTTPFlow]] = {}  # call id -> its span and flow, until it resolves
        resolved.append(self.ended)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        call = call_of(flow)
        if call is None or call.call_id in self.open:
            return
        headers = flow.request.headers
        parent = self._w3c.extract({k: headers[k] for k in ("traceparent", "tracestate") if k in headers})
        span = self.tracer.start_span("execute_tool", context=parent, kind=self._kind,
                                      start_time=int(call.started_at * 1e9))
        self.open[call.call_id] = (span, flow)
        # What leaves names tether's span as the tool server's parent (the agent's tracestate passes as sent).
        ctx = span.get_span_context()
        headers["traceparent"] = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def ended(self, call: Call) -> None:
        try:
            self._end(call)
        except Exception:  # a span is never worth a call's resolution (Sidecar.resolve calls this)
            log.exception("could not end the span of call %s", call.call_id)

    def _end(self, call: Call) -> None:
        span, flow = self.open.pop(call.call_id, (None, None))
        if span is None:  # resolved before its headers reached this stage (a refused CONNECT)
            span = self.tracer.start_span("execute_tool", kind=self._kind, start_time=int(call.started_at * 1e9))
        parsed = state_of(flow).mcp_parsed if flow is not None else None
        tools = [m.tool for m in parsed.messages if m.method == "tools/call" and m.tool] if parsed else []
        plumbing = [m.method for m in parsed.messages if m.method] if parsed and not tools else []
        name = ",".join(tools) or call.capability or ",".join(plumbing) or "unknown"
        span.update_name(f"execute_tool {name}")
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name,
            "tether.agent": call.agent, "tether.capability": call.capability or "unknown",
            "tether.call_id": call.call_id, "tether.resolution": call.resolution or "unknown",
            "http.request.method": call.method, "url.full": call.url,
        }
        if call.tier:
            attributes["tether.tier"] = call.tier
        if call.status is not None:
            attributes["http.response.status_code"] = call.status
        if call.code:
            attributes["tether.code"] = call.code
        if call.termination_id:
            attributes["tether.termination_id"] = call.termination_id
        if call.capture_ref:
            attributes["tether.capture_ref"] = call.capture_ref
        span.set_attributes(attributes)
        if call.resolution != "completed":
            reason = call.code or call.resolution or "unknown"
            span.set_attribute("error.type", reason)
            if call.detail:
                span.set_attribute("tether.detail", call.detail)
            span.set_status(self._error(reason))
        span.end(end_time=int((call.ended_at or call.started_at) * 1e9))
