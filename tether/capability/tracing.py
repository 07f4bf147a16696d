"""OpenTelemetry set-up shared by both sides: enabled only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the traces
endpoint) is set, and imported lazily, so a process with tracing off never loads OpenTelemetry at all.
What each side records lives with it: ``tether/proxy/telemetry.py`` (a call's span),
``tether/controlplane/telemetry.py`` (revocations and terminations)."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("tether.telemetry")
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_tracers: dict[str, Any] = {}


def enabled() -> bool:
    return any(os.environ.get(name) for name in ENDPOINT_VARS) and os.environ.get("OTEL_SDK_DISABLED", "").lower() \
        != "true"


def tracer(service: str, resource: dict[str, str] | None = None) -> Any:
    """The tracer for this process (``tether-controlplane`` or ``tether-sidecar``), or None when tracing is off.
    ``resource``: attributes of the whole process (the sidecar's agent and run), sent once per batch.

    The exporter reads the standard variables itself (endpoint, headers, timeout, compression); the batch
    processor exports from its own thread, so a call never waits for the collector."""
    if not enabled():
        return None
    if service not in _tracers:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        attributes = {**(resource or {}), **({} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service})}
        provider = TracerProvider(resource=Resource.create(attributes))  # flushed at exit (shutdown_on_exit)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        _tracers[service] = provider.get_tracer("tether")
        log.info("exporting traces over OTLP/HTTP to %s", os.environ.get(ENDPOINT_VARS[1])
                 or os.environ.get(ENDPOINT_VARS[0]))
    return _tracers[service]
