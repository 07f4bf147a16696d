"""OpenTelemetry and Prometheus, end to end: a real OTLP/HTTP receiver (aiohttp, decoding the protobuf with
opentelemetry-proto) receives the spans of a real sidecar subprocess and a real control plane process, and
``/metrics`` counts the calls they made."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tether.controlplane.metrics import Histogram, Metrics

from .conftest import World, build_world, teardown_world
from .harness import TestCA as CA
from .harness import close_loop, free_port, wait_until


class OtlpReceiver:
    """An OTLP/HTTP trace receiver: ``POST /v1/traces`` with an ExportTraceServiceRequest protobuf."""

    def __init__(self) -> None:
        self.port = free_port()
        self.spans: list[dict[str, Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        assert request.headers.get("Content-Type") == "application/x-protobuf"
        export = ExportTraceServiceRequest.FromString(body)
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append({
                        "service": resource.get("service.name"), "name": span.name, "kind": span.kind,
                        "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                        "parent": span.parent_span_id.hex(), "attributes": {a.key: _value(a.value)
                                                                            for a in span.attributes},
                        "status": span.status.code, "message": span.status.message,
                        "start": span.start_time_unix_nano, "end": span.end_time_unix_nano})
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def start(self) -> OtlpReceiver:
        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            app = web.Application()
            app.router.add_post("/v1/traces", self._traces)
            runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
            self._ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            close_loop(loop)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def named(self, name: str) -> list[dict[str, Any]]:
        return [s for s in list(self.spans) if s["name"] == name]


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


SPAN_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


def metric(text: str, series: str) -> float:
    """The value of one series in a Prometheus exposition (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture
def traced(tmp_path: Path, test_ca: CA, monkeypatch: pytest.MonkeyPatch) -> Any:
    receiver = OtlpReceiver().start()
    # The control plane and sidecars are started with this process's environment (harness: cp.env()).
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    world = build_world(tmp_path, test_ca)
    world.cp.start()
    try:
        yield world, receiver
    finally:
        teardown_world(world)
        receiver.stop()


def test_calls_are_execute_tool_spans_in_the_agents_trace_and_metrics_count_them(traced: Any) -> None:
    w, receiver = traced
    w: World
    ident = w.cp.issue("otel-a", {"echo.any": "direct", "issues.write": "approval"})
    sc = w.sidecar(ident, "--approval-timeout", "20")
    admin = w.cp.client()

    def traceparent() -> tuple[str, str, str]:
        trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
        return f"00-{trace_id}-{span_id}-01", trace_id, span_id

    def get(path: str, parent: str, method: str = "GET", **kw: Any) -> requests.Response:
        return requests.request(method, w.tools.base + path, proxies=sc.proxies(), headers={"traceparent": parent},
                                timeout=30, **kw)

    granted, refused, unmatched, held = traceparent(), traceparent(), traceparent(), traceparent()
    assert get("/echo", granted[0]).status_code == 200
    no = get("/repos/o/r/issues", refused[0])
    assert no.status_code == 403 and no.headers["Tether-Error"] == "tether.capability_absent"
    assert get("/nowhere", unmatched[0]).headers["Tether-Error"] == "tether.capability_absent"
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(get, "/repos/o/held/issues", held[0], "POST", json={"title": "t"})
        pending = wait_until(lambda: [a for a in admin.request("GET", "/v1/approvals?status=pending")
                                      if a["agent"] == "otel-a"], 15, what="the held call's approval")
        admin.request("POST", f"/v1/approvals/{pending[0]['id']}/approve", {})
        assert answer.result(30).status_code == 200

    spans = wait_until(lambda: len(s := [x for x in list(receiver.spans) if x["service"] == "tether-sidecar"]) >= 4
                       and s, 20, what="four sidecar spans")
    by_trace = {s["trace_id"]: s for s in spans}
    for (_, trace_id, parent_id), name, capability, resolution in (
            (granted, "execute_tool echo.any", "echo.any", "completed"),
            (refused, "execute_tool issues.read", "issues.read", "refused"),
            (unmatched, "execute_tool unknown", "unknown", "refused"),
            (held, "execute_tool issues.write", "issues.write", "completed")):
        span = by_trace[trace_id]  # in the agent's trace ...
        assert span["parent"] == parent_id  # ... as the child of the agent's span
        assert span["name"] == name
        attrs = span["attributes"]
        assert attrs["gen_ai.operation.name"] == "execute_tool"
        assert attrs["gen_ai.tool.name"] == name.split(" ", 1)[1]
        assert attrs["tether.agent"] == "otel-a" and attrs["tether.capability"] == capability
        assert attrs["tether.resolution"] == resolution and attrs["tether.call_id"]
        if resolution == "refused":
            assert span["status"] == SPAN_ERROR and span["message"] == "tether.capability_absent"
        else:
            assert span["status"] != SPAN_ERROR and attrs["http.response.status_code"] == 200
    assert by_trace[held[1]]["end"] > by_trace[held[1]]["start"]

    # The tool server saw traceparents naming tether's span, in the agent's trace; refused calls never arrived.
    seen = dict(w.tools.traceparents)
    for path, (_, trace_id, _) in (("/echo", granted), ("/repos/o/held/issues", held)):
        assert seen[path] == f"00-{trace_id}-{by_trace[trace_id]['span_id']}-01"
    assert "/repos/o/r/issues" not in seen and "/nowhere" not in seen

    # Every call ID in the spans is a call reported to the control plane, and /metrics counts them.
    def text() -> str:
        return requests.get(w.cp.url + "/metrics", timeout=5).text

    wait_until(lambda: metric(text(), 'tether_calls_total{capability="issues.write",resolution="completed"}') == 1,
               15, what="the reports in /metrics")
    body = text()
    assert metric(body, 'tether_calls_total{capability="echo.any",resolution="completed"}') == 1
    assert metric(body, 'tether_calls_total{capability="issues.read",resolution="refused"}') == 1
    assert metric(body, 'tether_calls_total{capability="none",resolution="refused"}') == 1
    assert metric(body, 'tether_refusals_total{code="tether.capability_absent"}') == 2
    assert sum(float(v) for v in re.findall(r"^tether_calls_total\{.*\} (\S+)$", body, re.M)) == 4
    assert "# TYPE tether_calls_total counter" in body and "# HELP tether_refusals_total" in body
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds",
                 "process_start_time_seconds"):
        assert metric(body, name) > 0, name
    assert "url" not in "".join(re.findall(r"^tether_calls_total(\{.*\})", body, re.M))

    # A revocation: its span, and how long it took to reach the sidecar (acknowledged with a heartbeat).
    other = w.cp.issue("otel-b", {"echo.any": "direct"})
    w.sidecar(other)
    admin.request("POST", f"/v1/grants/{other.jti}/revoke", {"reason": "test"})
    wait_until(lambda: metric(text(), "tether_revocation_propagation_seconds_count") == 1, 15,
               what="the sidecar's acknowledgement of the revocation")
    body = text()
    assert metric(body, "tether_revocations_total") == 1
    assert 0 < metric(body, "tether_revocation_propagation_seconds_sum") < 5  # the event stream, not a lease
    assert metric(body, 'tether_revocation_propagation_seconds_bucket{le="+Inf"}') == 1
    revoke = wait_until(lambda: receiver.named("revoke otel-b"), 15, what="the revocation's span")[0]
    assert revoke["service"] == "tether-controlplane" and revoke["attributes"]["tether.jti"] == other.jti
    by = revoke["attributes"]
    assert (by["tether.revoked_by"], by["tether.operator.via"]) == ("admin", "token")

    # A termination is one trace: a root span, the subtree's revocations, one span per sidecar run's drain.
    tid = admin.request("POST", "/v1/agents/otel-a/terminate", {"mode": "drain", "window_s": 2})["termination_id"]
    root = wait_until(lambda: receiver.named("terminate otel-a"), 20, what="the termination's trace")[0]
    assert root["parent"] == "" and root["attributes"]["tether.termination_id"] == tid
    by = root["attributes"]
    assert (by["tether.requested_by"], by["tether.operator.via"]) == ("admin", "token")
    family = [s for s in list(receiver.spans) if s["trace_id"] == root["trace_id"] and s is not root]
    drains = [s for s in family if s["name"] == "drain otel-a"]
    assert len(drains) == 1 and drains[0]["parent"] == root["span_id"]
    assert drains[0]["attributes"]["tether.run_id"] == json.loads((sc.state_dir / "run.json").read_text())["run_id"]
    assert drains[0]["attributes"]["tether.acknowledged"] is True and drains[0]["status"] != SPAN_ERROR
    assert root["start"] <= drains[0]["start"] <= drains[0]["end"] <= root["end"]
    assert [s["attributes"]["tether.jti"] for s in family if s["name"] == "revoke otel-a"] == [ident.jti]
    body = text()
    # The Grafana dashboard is built on series /metrics really has.
    dashboard = (Path(__file__).parents[1] / "deploy" / "grafana" / "tether.json").read_text()
    for name in set(re.findall(r"\b((?:tether|process)_[a-z_]+)", dashboard)):
        family = name.removesuffix("_bucket")
        assert f"# TYPE {family} " in body, family
    assert metric(body, 'tether_terminations_total{mode="drain"}') == 1
    assert metric(body, 'tether_terminations_total{mode="abort"}') == 0
    assert metric(body, "tether_revocations_total") == 2


def test_labels_stay_bounded_and_the_histogram_is_cumulative() -> None:
    m = Metrics(["a.read"])
    m.call_reported({"capability": "a.read", "resolution": "completed"})
    m.call_reported({"capability": "https://evil.example/x?y", "resolution": "refused", "code": "tether.made_up"})
    m.call_reported({"capability": None, "resolution": "weird"})
    text = "\n".join(m.render())
    assert 'tether_calls_total{capability="a.read",resolution="completed"} 1' in text
    assert 'tether_calls_total{capability="other",resolution="refused"} 1' in text
    assert 'tether_calls_total{capability="none",resolution="other"} 1' in text
    assert 'tether_refusals_total{code="other"} 1' in text and "evil" not in text
    h = Histogram([0.1, 1.0])
    for value in (0.05, 0.5, 5.0):
        h.observe(value)
    assert h.lines("x") == ['x_bucket{le="0.1"} 1', 'x_bucket{le="1"} 2', 'x_bucket{le="+Inf"} 3', "x_sum 5.55",
                            "x_count 3"]


def test_tracing_off_imports_nothing_of_opentelemetry(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = ("import sys, tether.controlplane.app, tether.controlplane.services.terminations, tether.proxy.sidecar;"
            "from tether.proxy.telemetry import call_tracing; assert call_tracing('a', 'r', []) == [];"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"
