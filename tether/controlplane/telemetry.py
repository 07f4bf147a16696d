"""OpenTelemetry traces, on only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (OTLP over HTTP).

Owns the tracer setup shared by both roles (``tracer``), and the control plane's spans: one per revocation
made outside a termination, and one trace per termination (a root span from request to ``terminated``,
children for the subtree's revocations and one per sidecar run's drain or abort, from the command to its
acknowledgement).

With the variable unset nothing here imports OpenTelemetry and every entry point returns at its first
line. A termination's trace is written when it ends, from the times its documents hold (history,
revocations, acknowledgements): the replica that finishes it may not be the one that started it, and a
control plane restarted mid-termination still writes the whole trace.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tether.capability.tracing import tracer

Doc = dict[str, Any]
Facts = Callable[[], Awaitable[tuple[list[Doc], dict[str, Doc], dict[str, Doc]]]]

log = logging.getLogger("tether.telemetry")


def _ns(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1e9)


def _via(doc: dict[str, Any]) -> str:
    """How the person who decided signed in (``token``, ``oidc``), or ``principal`` for a chain holder."""
    return str((doc.get("operator") or {}).get("via") or "principal")


def revoked(doc: dict[str, Any], link: dict[str, Any]) -> None:
    """A link revoked by a person or principal; revocations made by a termination go in its trace instead."""
    t = tracer("tether-controlplane")
    if t is None or doc.get("termination_id"):
        return
    span = t.start_span(f"revoke {doc['agent']}", start_time=_ns(doc["at"]), attributes={
        "tether.agent": doc["agent"], "tether.jti": doc["jti"], "tether.revoked_by": doc["by"],
        "tether.operator.via": _via(doc),
        "tether.reason": doc.get("reason") or "", "tether.link": link.get("hash", "")})
    span.end()


def checkpoint(origin: str, size: int, root_b64: str, note: str, now: float) -> None:
    """A checkpoint of the record log, as a span carrying the signed note (a third sink beside the directory
    and the witnesses: whatever keeps the traces keeps the checkpoints too)."""
    t = tracer("tether-controlplane")
    if t is None:
        return
    span = t.start_span(f"checkpoint {origin} {size}", start_time=_ns(now), attributes={
        "tether.log.origin": origin, "tether.log.size": size, "tether.log.root": root_b64,
        "tether.log.checkpoint": note})
    span.end()


async def termination_finished(doc: dict[str, Any], facts: Facts, now: float) -> None:
    """Write a finished termination's trace: one root span, a span per revocation and per sidecar run.
    ``facts`` gathers (runs, acknowledgements by run, revocations), asked only when tracing is on."""
    t = tracer("tether-controlplane")
    if t is None:
        return
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    try:
        runs, acks, revocations = await facts()
    except Exception:  # a trace is never worth failing a termination over
        log.exception("termination %s: could not gather its trace", doc["id"])
        return
    commanded = next((h["at"] for h in doc["history"] if h["state"] in ("draining", "aborting")),
                     doc["requested_at"])
    end = doc.get("completed_at") or now
    root = t.start_span(f"terminate {doc['subject']}", start_time=_ns(doc["requested_at"]), attributes={
        "tether.termination_id": doc["id"], "tether.agent": doc["subject"], "tether.mode": doc["mode"],
        "tether.window_s": doc["window_s"], "tether.requested_by": doc["requested_by"],
        "tether.operator.via": _via(doc),
        "tether.record_id": doc.get("record_id") or "", "tether.agents": list(doc["agents"]),
        "tether.agents_unaccounted": list(doc.get("open_agents") or [])})
    parent = trace.set_span_in_context(root)
    for state in doc["history"]:
        root.add_event(state["state"], timestamp=_ns(state["at"]))
    for jti, revocation in sorted(revocations.items()):
        if revocation.get("termination_id") != doc["id"]:
            continue
        t.start_span(f"revoke {revocation['agent']}", context=parent, start_time=_ns(revocation["at"]), attributes={
            "tether.agent": revocation["agent"], "tether.jti": jti, "tether.termination_id": doc["id"]}
        ).end(end_time=_ns(revocation["at"]))
    verb = "drain" if doc["mode"] == "drain" else "abort"
    for run in sorted(runs, key=lambda r: (r.get("agent") or "", r["run_id"])):
        ack = acks.get(run["run_id"])
        span = t.start_span(f"{verb} {run.get('agent')}", context=parent, start_time=_ns(commanded), attributes={
            "tether.agent": run.get("agent") or "", "tether.run_id": run["run_id"],
            "tether.link": run.get("link") or "", "tether.termination_id": doc["id"]})
        if ack is not None:
            span.set_attribute("tether.acknowledged", True)
            for resolution, n in sorted((ack.get("calls") or {}).items()):
                span.set_attribute(f"tether.calls.{resolution}", n)
            span.end(end_time=_ns(max(commanded, ack["at"])))
        elif run.get("final"):  # stopped (or superseded) before the command: nothing left to drain
            span.set_attribute("tether.final", run["final"])
            span.end(end_time=_ns(commanded))
        else:
            span.set_status(Status(StatusCode.ERROR, "unaccounted: no acknowledgement before the window and grace"))
            span.end(end_time=_ns(end))
    root.end(end_time=_ns(end))
