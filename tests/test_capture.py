"""Capture encoding: the fast path writes exactly what mitmproxy's own serialisation of the redacted flow is.

The sidecar writes each call's flow twice (before it leaves, and when it resolves) and reuses each
connection's serialised state while the connection is unchanged. These tests hold that encoding to
``tnetstring.dumps`` of the redacted ``get_state()``, byte for byte, for plain, TLS, failed and
redacted flows, and after a connection changes under the cache. End-to-end capture (a real sidecar, the
HAR export) is in test_sidecar_http.py.
"""

from __future__ import annotations

import asyncio
import enum
import json
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy import certs, http
from mitmproxy.io import tnetstring
from mitmproxy.test import tflow

from tether.capture.segments import read_flows
from tether.proxy.capture import (
    _SECRET,
    CaptureWriter,
    ConnectionStates,
    _redact_state,
    encode_flow,
    snapshot,
    tnet_dumps,
)

FIELDS = frozenset({"api_key", "password"})


def reference(flow: http.HTTPFlow) -> bytes:
    return tnetstring.dumps(snapshot(flow, FIELDS))


def tls_flow(tmp_path: Path) -> http.HTTPFlow:
    store = certs.CertStore.from_store(tmp_path, "test", 2048)
    entry = store.get_cert("tool.example", [])
    flow = tflow.tflow(resp=True)
    flow.request.scheme, flow.request.port = "https", 443
    for conn in (flow.client_conn, flow.server_conn):
        conn.tls, conn.tls_version, conn.cipher, conn.sni = True, "TLSv1.3", "TLS_AES_256_GCM_SHA384", "tool.example"
        conn.alpn = b"http/1.1"
    flow.server_conn.certificate_list = [entry.cert, store.default_ca]
    flow.server_conn.timestamp_tls_setup = flow.server_conn.timestamp_tcp_setup
    return flow


def secret_flow() -> http.HTTPFlow:
    flow = tflow.tflow(resp=True)
    flow.request.path = "/v1/items?api_key=abc&q=1"
    flow.request.headers["Authorization"] = "Bearer s3cret"
    flow.request.headers["Cookie"] = "session=1"
    flow.request.headers["Content-Type"] = "application/json"
    flow.request.content = json.dumps({"password": "hunter2", "nested": [{"api_key": "k"}], "ok": 1}).encode()
    flow.response.headers["Set-Cookie"] = "session=2"
    return flow


@pytest.mark.parametrize("make", [
    lambda _: tflow.tflow(),
    lambda _: tflow.tflow(resp=True),
    lambda _: tflow.tflow(err=True),
    lambda _: secret_flow(),
    tls_flow,
], ids=["request-only", "with-response", "error", "secrets", "tls"])
def test_fast_encoding_is_mitmproxys_serialisation_of_the_redacted_flow(make, tmp_path: Path) -> None:
    flow = make(tmp_path)
    flow.metadata["tether.call"] = object()  # tether's bookkeeping never reaches the file
    conns = ConnectionStates()
    first = encode_flow(flow, FIELDS, conns)
    assert first == reference(flow)
    assert encode_flow(flow, FIELDS, conns) == first  # from the cached connection states: still exact
    assert tnetstring.loads(first)["metadata"] == {}


INJECTED = (b"Bearer tok-0123456789", b"tok-0123456789")  # what a sidecar injected, longest first


def scrubbed_everywhere(flow: http.HTTPFlow) -> bytes:
    """The exact by-value scrub: every header, body and path searched for every injected value."""
    metadata, flow.metadata = flow.metadata, {}
    try:
        state = flow.get_state()
    finally:
        flow.metadata = metadata
    return tnetstring.dumps(_redact_state(state, FIELDS, _SECRET, INJECTED))


@pytest.mark.parametrize("where", ["nowhere", "request header", "response header", "response body", "path",
                                   "request body"])
def test_injected_values_are_scrubbed_wherever_they_are(where: str) -> None:
    flow = secret_flow()
    flow.request.headers["Authorization"] = "Bearer tok-0123456789"  # redacted by name in any case
    if where == "request header":
        flow.request.headers["X-Forwarded-Auth"] = "tok-0123456789"
    elif where == "response header":
        flow.response.headers["X-Echo"] = "saw Bearer tok-0123456789"
    elif where == "response body":
        flow.response.content = b'{"echo": "Bearer tok-0123456789"}'
    elif where == "path":
        flow.request.path = "/v1/items?token=tok-0123456789"
    elif where == "request body":
        flow.request.content = b"token=tok-0123456789"
    encoded = encode_flow(flow, FIELDS, ConnectionStates(), _SECRET, INJECTED)
    assert encoded == scrubbed_everywhere(flow)
    assert b"tok-0123456789" not in encoded
    if where != "nowhere":
        assert b"[REDACTED]" in encoded


def test_redaction_reaches_the_file(tmp_path: Path) -> None:
    path = tmp_path / "flows.mitm"
    path.write_bytes(encode_flow(secret_flow(), FIELDS, ConnectionStates()))
    (flow,) = read_flows(path)
    assert flow.request.headers["Authorization"] == "[REDACTED]"
    assert flow.request.headers["Cookie"] == "[REDACTED]"
    assert flow.response.headers["Set-Cookie"] == "[REDACTED]"
    assert json.loads(flow.request.content) == {"password": "[REDACTED]", "nested": [{"api_key": "[REDACTED]"}],
                                                "ok": 1}
    assert "abc" not in flow.request.path and "q=1" in flow.request.path


def test_a_connection_that_changes_is_serialised_again(tmp_path: Path) -> None:
    conns = ConnectionStates()
    flow = tls_flow(tmp_path)
    encode_flow(flow, FIELDS, conns)
    flow.server_conn.timestamp_end = flow.server_conn.timestamp_start + 5  # closed
    flow.server_conn.certificate_list = list(flow.server_conn.certificate_list[:1])  # same list, shorter
    flow.client_conn.error = "connection reset"
    encoded = encode_flow(flow, FIELDS, conns)
    assert encoded == reference(flow)
    state = tnetstring.loads(encoded)
    assert state["server_conn"]["timestamp_end"] == flow.server_conn.timestamp_end
    assert len(state["server_conn"]["certificate_list"]) == 1
    assert state["client_conn"]["error"] == "connection reset"


def test_a_list_changed_in_place_is_noticed(tmp_path: Path) -> None:
    conns = ConnectionStates()
    flow = tls_flow(tmp_path)
    encode_flow(flow, FIELDS, conns)
    flow.server_conn.certificate_list.pop()  # the same list object, one certificate fewer
    assert encode_flow(flow, FIELDS, conns) == reference(flow)


def test_the_cache_is_bounded() -> None:
    conns = ConnectionStates(limit=4)
    for _ in range(10):
        flow = tflow.tflow(resp=True)  # new connections each time
        assert encode_flow(flow, FIELDS, conns) == reference(flow)
    assert len(conns._cache) <= 4


class Flag(enum.IntEnum):
    ON = 1


SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.binary(max_size=40)
           | st.text(max_size=40) | st.just(Flag.ON))
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.lists(inner, max_size=5).map(tuple)
    | st.dictionaries(st.text(max_size=10) | st.binary(max_size=10), inner, max_size=5),
    max_leaves=40,
)


@given(VALUES)
@settings(max_examples=300, deadline=None)
def test_tnet_dumps_is_mitmproxys_tnetstring_byte_for_byte(value: object) -> None:
    assert tnet_dumps(value) == tnetstring.dumps(value)


def test_tnet_dumps_refuses_what_mitmproxy_refuses() -> None:
    with pytest.raises(ValueError):
        tnet_dumps({"x": object()})


@pytest.mark.parametrize(("content_type", "body", "secret"), [
    ("Application/JSON", b'{"password": "hunter2"}', b"hunter2"),
    ("text/plain", b'  {"api_key": "k-123"}', b"k-123"),
    ("", b'[{"password": "p-456"}]', b"p-456"),
    ("application/x-www-form-urlencoded", b"user=a&password=f-789", b"f-789"),
    ("Application/X-WWW-Form-Urlencoded; charset=utf-8", b"api_key=f-000&x=1", b"f-000"),
], ids=["json-any-case", "json-as-text", "json-untyped", "form", "form-any-case"])
def test_configured_fields_are_redacted_whatever_the_declared_media_type(
        content_type: str, body: bytes, secret: bytes, tmp_path: Path) -> None:
    flow = tflow.tflow(resp=True)
    flow.request.method = "POST"
    if content_type:
        flow.request.headers["Content-Type"] = content_type
    flow.request.content = body
    path = tmp_path / "flows.mitm"
    path.write_bytes(encode_flow(flow, FIELDS, ConnectionStates()))
    assert secret not in path.read_bytes()
    (captured,) = read_flows(path)
    assert b"REDACTED" in captured.request.content


def test_a_body_that_is_not_json_is_kept_as_it_was(tmp_path: Path) -> None:
    flow = tflow.tflow(resp=True)
    flow.request.headers["Content-Type"] = "text/plain"
    flow.request.content = b"password is not a field here"
    path = tmp_path / "flows.mitm"
    path.write_bytes(encode_flow(flow, FIELDS, ConnectionStates()))
    (captured,) = read_flows(path)
    assert captured.request.content == b"password is not a field here"


class ThreadsAsked(frozenset[str]):
    """Field names (a plain set works wherever a ``Fields`` does) that note which thread asks about them: the
    redaction's walk of a body is where a capture's cost lies."""

    threads: set[str]

    def __contains__(self, name: object) -> bool:
        self.threads.add(threading.current_thread().name)
        return frozenset.__contains__(self, name)


def big_json_flow(mb: int = 10) -> http.HTTPFlow:
    """A ``tools/list``-sized answer whose every item has a key redaction must look at."""
    flow = tflow.tflow(resp=True)
    flow.response.headers["Content-Type"] = "application/json"
    item = {"name": "t", "description": "x" * 200, "inputSchema": {"token": "s3cret-in-the-answer"}}
    n = mb * (1 << 20) // len(json.dumps(item))
    flow.response.content = json.dumps({"result": {"tools": [item] * n}}).encode()
    return flow


def test_a_final_state_is_encoded_off_the_event_loop_and_close_writes_it(tmp_path: Path) -> None:
    """``write_later`` takes the state on the loop and leaves the redaction and the encoding to the encoder
    thread; the loop is back at once, and ``close`` (the sidecar's stop) waits for the record."""
    fields = ThreadsAsked({"api_key", "token"})
    fields.threads = set()
    writer = CaptureWriter(tmp_path / "flows.mitm")
    writer.fields = fields
    flow = big_json_flow()
    request_only = tflow.tflow()

    async def on_the_loop() -> tuple[float, float]:
        started = time.perf_counter()
        writer.write_later(flow)
        taken = time.perf_counter() - started
        started = time.perf_counter()
        assert writer.write(request_only)  # the request-time capture: at once, on the loop, as before
        return taken, time.perf_counter() - started

    loop_thread = threading.current_thread().name
    taken_s, other_s = asyncio.run(on_the_loop())
    writer.close()
    assert fields.threads - {loop_thread} == {"tether-capture-encoder"}  # the big body was walked there
    started = time.perf_counter()
    assert writer.write(flow)  # the same flow encoded on the caller's thread: what the loop paid before
    direct_s = time.perf_counter() - started
    assert taken_s < direct_s / 5, (taken_s, direct_s)
    flows = {f.id: f for f in read_flows(tmp_path / "flows.mitm")}
    assert set(flows) == {flow.id, request_only.id}
    body = flows[flow.id].response.content
    assert b"s3cret-in-the-answer" not in body and body.count(b'"token": "[REDACTED]"') > 1000
    assert writer.failures == 0 and other_s < direct_s


def test_final_states_land_in_the_order_they_were_taken(tmp_path: Path) -> None:
    writer = CaptureWriter(tmp_path / "flows.mitm")
    flows = [tflow.tflow(resp=True) for _ in range(50)]
    for i, flow in enumerate(flows):
        flow.response.content = b"%d" % i * (i * 1000)
        writer.write_later(flow)
    assert writer.flush(60)
    writer.close()
    assert [f.id for f in read_flows(tmp_path / "flows.mitm")] == [f.id for f in flows]
    assert writer.write_later(tflow.tflow(resp=True)) is None and len(read_flows(tmp_path / "flows.mitm")) == 51


def test_a_small_final_state_with_nothing_waiting_is_written_at_once_and_one_behind_a_big_one_waits(
        tmp_path: Path) -> None:
    """Handing a small state to the encoder thread costs more than encoding it (most calls): it is written on
    the spot, unless a bigger one is still waiting, which it must not overtake."""
    writer = CaptureWriter(tmp_path / "flows.mitm")
    small = tflow.tflow(resp=True)
    writer.write_later(small)
    assert writer.encoder.pending == 0 and writer.encoder._thread is None  # no thread was needed
    assert [f.id for f in read_flows(tmp_path / "flows.mitm")] == [small.id]
    big, behind = tflow.tflow(resp=True), tflow.tflow(resp=True)
    big.response.content = b"x" * (4 << 20)
    writer.write_later(big)
    writer.write_later(behind)
    assert writer.flush(60)
    writer.close()
    assert [f.id for f in read_flows(tmp_path / "flows.mitm")] == [small.id, big.id, behind.id]
