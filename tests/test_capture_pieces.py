"""A large answer's capture without copies (issue 23 item 6): its record is written in pieces (the body itself,
never joined into a copy), and redaction by field name reads a JSON answer's keys off the list filter's parse
(``capture.ParsedBody``) instead of searching its bytes. The record stays mitmproxy's serialisation byte for
byte, and the parse is trusted only for the very bytes it was made from: a stale one redacts as if there were none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy import http
from mitmproxy.io import tnetstring
from mitmproxy.net.encoding import encode
from mitmproxy.test import tflow

from tether.capture.segments import read_flows
from tether.proxy import mcp
from tether.proxy.capture import (
    _SLICE,
    PIECE_BYTES,
    CaptureWriter,
    ConnectionStates,
    Fields,
    ParsedBody,
    encode_flow,
    encode_pieces,
    json_keys,
    snapshot,
    take,
    tnet_dumps,
    tnet_pieces,
)

FIELDS = Fields.of()


def listing(tools: list[dict]) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"tools": tools}}).encode()


def big_tools(count: int = 40, schema: dict | None = None) -> list[dict]:
    pad = "x" * (PIECE_BYTES // 8)
    return [{"name": f"tool_{i:03d}", "description": pad, "inputSchema": schema or {"type": "object"}}
            for i in range(count)]


def answer_flow(body: bytes, media: str = "application/json") -> http.HTTPFlow:
    flow = tflow.tflow(resp=True)
    flow.request.content = b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}'
    flow.response.headers["content-type"] = media
    flow.response.content = body
    return flow


def parsed_of(flow: http.HTTPFlow, allowed=lambda _: True) -> ParsedBody:
    """What the sidecar's list filter hands the capture: its parse of the body the flow now holds."""
    done = mcp.filtered(mcp.read_answer(flow.response.raw_content, sse=False), allowed)
    if done.removed:
        flow.response.content = done.body
    return ParsedBody(flow.response.raw_content, done.value)


def reference(flow: http.HTTPFlow) -> bytes:
    return tnetstring.dumps(snapshot(flow, FIELDS))


big = st.binary(min_size=PIECE_BYTES, max_size=PIECE_BYTES + 3)
leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8) \
    | st.binary(max_size=8) | big
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                           max_size=3), max_leaves=8)


@settings(max_examples=60, deadline=None)
@given(values)
def test_pieces_join_to_tnet_dumps_byte_for_byte(value: object) -> None:
    pieces: list[bytes] = []
    size = tnet_pieces(value, pieces)
    assert b"".join(pieces) == tnet_dumps(value) and size == len(b"".join(pieces))


def test_a_long_body_is_a_piece_of_its_own_not_a_copy() -> None:
    body = listing(big_tools())
    flow = answer_flow(body)
    pieces = encode_pieces(take(flow, ConnectionStates()), FIELDS)
    assert any(piece is flow.response.raw_content for piece in pieces)
    assert b"".join(pieces) == reference(flow) == encode_flow(flow, FIELDS, ConnectionStates())


def test_a_record_written_in_pieces_reads_back_whole(tmp_path: Path) -> None:
    writer = CaptureWriter(tmp_path / "agent" / "captures" / "flows.mitm")
    flows = [answer_flow(listing(big_tools())), tflow.tflow(resp=True), answer_flow(listing(big_tools(3)))]
    for flow in flows:
        writer.write_later(flow, parsed_of(flow) if b'"tools"' in (flow.response.raw_content or b"") else None)
    writer.close()
    read = read_flows(writer.path)
    assert [f.id for f in read] == [f.id for f in flows]
    assert [f.response.content for f in read] == [f.response.content for f in flows]


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"password": {"type": "string"}}},
    {"type": "object", "properties": {"q": {"type": "string", "client_secret": "s"}}},
    {"type": "object", "x": [{"deep": [{"API-Key": 1}]}]},
], ids=["property", "nested", "in-a-list"])
def test_a_parse_with_a_secret_key_redacts_as_the_search_does(schema: dict) -> None:
    flow = answer_flow(listing(big_tools(schema=schema)))
    hinted = b"".join(encode_pieces(take(flow, ConnectionStates(), parsed=parsed_of(flow)), FIELDS))
    assert hinted == reference(flow)  # exactly what redaction without the parse writes
    assert b"[REDACTED]" in hinted


def test_a_parse_with_no_secret_key_keeps_the_body_as_it_came() -> None:
    flow = answer_flow(listing(big_tools()))
    taken = take(flow, ConnectionStates(), parsed=parsed_of(flow))
    assert b"".join(encode_pieces(taken, FIELDS)) == reference(flow)
    assert json_keys(taken.parsed) == {"jsonrpc", "id", "result", "tools", "name", "description", "inputSchema",
                                       "type"}


def test_a_filtered_answer_s_parse_is_the_value_of_what_passes() -> None:
    tools = big_tools(10, {"type": "object", "properties": {"token": {}}})
    flow = answer_flow(listing(tools))
    parsed = parsed_of(flow, allowed=lambda name: name != "tool_003")
    assert json.loads(flow.response.raw_content) == parsed.value and parsed.content is flow.response.raw_content
    assert b"".join(encode_pieces(take(flow, ConnectionStates(), parsed=parsed), FIELDS)) == reference(flow)


def test_a_stale_parse_is_not_trusted() -> None:
    """A parse of other bytes (a body changed after the filter, or one decoded from the wire) says nothing of
    what the flow holds: the capture searches the body itself."""
    flow = answer_flow(listing(big_tools()))
    clean = parsed_of(flow)
    flow.response.content = listing(big_tools(schema={"password": "hunter2"}))
    stale = b"".join(encode_pieces(take(flow, ConnectionStates(), parsed=clean), FIELDS))
    assert b"hunter2" not in stale and stale == reference(flow)
    equal_not_same = ParsedBody(bytes(bytearray(flow.response.raw_content)), clean.value)
    assert b"hunter2" not in b"".join(encode_pieces(take(flow, ConnectionStates(), parsed=equal_not_same), FIELDS))


def test_a_parse_of_an_encoded_body_is_not_trusted() -> None:
    body = listing(big_tools(schema={"password": "hunter2"}))
    flow = answer_flow(body)
    flow.response.headers["content-encoding"] = "gzip"
    flow.response.raw_content = encode(body, "gzip")
    parsed = ParsedBody(flow.response.raw_content, json.loads(listing(big_tools())))  # claims no secret key
    data = b"".join(encode_pieces(take(flow, ConnectionStates(), parsed=parsed), FIELDS))
    assert b"hunter2" not in data and b"[REDACTED]" in data


@pytest.mark.parametrize("name", [b"pa_ssword", b"TO-KEN", b"se_c-r_et", b"api__key", b"Pass_Phrase"])
def test_a_name_spelt_with_dashes_and_underscores_inside_a_marker_is_redacted(name: bytes) -> None:
    """Names are compared without "-" and "_" (``pa_ssword`` is ``password``): the cheap look before the parse
    drops them too, where it once searched the raw bytes and missed such a name."""
    body = b'{"ok": 1, "' + name + b'": "hunter2"}'
    assert FIELDS.may_hold(body)
    flow = tflow.tflow(resp=True)
    flow.request.headers["content-type"] = "application/json"
    flow.request.content = body
    assert b"hunter2" not in encode_flow(flow, FIELDS, ConnectionStates())


@pytest.mark.parametrize("offset", [1, 5, 12, 40])
def test_a_marker_spelt_with_underscores_across_the_look_s_slices_is_seen(offset: int) -> None:
    name = b"_".join(bytes([c]) for c in b"authorization")  # 25 bytes: longer than the slices' overlap
    body = bytearray(b"x" * (3 * _SLICE))
    body[_SLICE - offset:_SLICE - offset + len(name)] = name
    assert FIELDS.may_hold(bytes(body))
    assert not FIELDS.may_hold(b"x_" * (2 * _SLICE))


@pytest.mark.parametrize("raw", [b'{"a": [1, 2, {"b": "\\u00e9"}]}', b"\xef\xbb\xbf{}", b'["\\ud800"]', b"[1,",
                                 '{"é": 1}'.encode("utf-16"), b" 7 "])
def test_a_view_parses_as_its_bytes_do(raw: bytes) -> None:
    """An SSE event of one data line is parsed from a view of the answer (no copy of its payload first)."""
    try:
        expected: object = json.loads(raw)
    except ValueError as exc:
        expected = type(exc)
    try:
        got: object = mcp.loads_pieces(memoryview(raw))
    except ValueError as exc:
        got = type(exc)
    assert got == expected


def test_a_one_line_event_s_payload_is_a_view_and_a_blank_one_is_none() -> None:
    body = b"event: message\ndata: " + listing(big_tools(3)) + b"\n\n"
    (event,) = mcp.whole_events(body)
    _, _, payload = mcp.event_data(event)  # type: ignore[misc]
    assert isinstance(payload, memoryview) and payload.obj is body and json.loads(bytes(payload))
    assert mcp.event_data(b"data:  \t\n\n") is None and mcp.event_data(b"data: \ndata: \n\n") is None
    assert mcp.event_data(b"data: 1\ndata: 2\n\n")[2] == b"1\n2"  # type: ignore[index]


def sse_flow(body: bytes) -> http.HTTPFlow:
    return answer_flow(body, "text/event-stream")


def test_an_sse_answer_s_data_is_redacted_by_field_name() -> None:
    """An MCP server answers a call as SSE by default: each event's data is read as its client reads it, and a
    secret-named key in it is redacted in the capture (it was kept: only JSON bodies were read)."""
    secret = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"structuredContent": {"db_password": "hunter2"}}})
    body = (b"event: message\nid: 7\ndata: " + secret.encode() + b"\n\n: a comment\n\n"
            b"data: not json, kept\n\nevent: message\ndata: {\"ok\": 1}\n\n")
    data = encode_flow(sse_flow(body), FIELDS, ConnectionStates())
    assert b"hunter2" not in data
    record = tnetstring.loads(data)["response"]["content"]
    assert record.startswith(b"event: message\nid: 7\ndata: {") and b'"db_password": "[REDACTED]"' in record
    assert record.endswith(b'\n\n: a comment\n\ndata: not json, kept\n\nevent: message\ndata: {"ok": 1}\n\n')
    clean = b'event: message\ndata: {"ok": 1}\n\n'
    assert tnetstring.loads(encode_flow(sse_flow(clean), FIELDS, ConnectionStates()))["response"]["content"] == clean


def test_an_sse_list_s_parse_stands_for_its_events() -> None:
    """The list filter's parse of an SSE answer is its events' values: the capture reads their keys off it."""
    tools = big_tools(10, {"type": "object"})
    body = b"event: message\ndata: " + listing(tools) + b"\n\n"
    for allowed in (lambda _: True, lambda name: name != "tool_004"):
        flow = sse_flow(body)
        done = mcp.filtered(mcp.read_answer(flow.response.raw_content, sse=True), allowed)
        if done.removed:
            flow.response.content = done.body
        parsed = ParsedBody(flow.response.raw_content, done.value)
        assert done.value == [json.loads(e.split(b"data: ", 1)[1]) for e in mcp.whole_events(done.body)]
        assert b"".join(encode_pieces(take(flow, ConnectionStates(), parsed=parsed), FIELDS)) == reference(flow)
    secret = sse_flow(b"data: " + listing(big_tools(3, {"token": "t0ps3cret"})) + b"\n\n")
    done = mcp.filtered(mcp.read_answer(secret.response.raw_content, sse=True), lambda _: True)
    data = b"".join(encode_pieces(take(secret, ConnectionStates(),
                                       parsed=ParsedBody(secret.response.raw_content, done.value)), FIELDS))
    assert b"t0ps3cret" not in data and data == reference(secret)


class CountingFile:
    """The capture's real file, counting its writes (each one a system call: the file is unbuffered)."""

    def __init__(self, real: Any) -> None:
        self.real, self.sizes = real, []  # type: ignore[var-annotated]

    def write(self, data: Any) -> int:
        self.sizes.append(len(data))
        return self.real.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_small_flows_record_is_one_write_and_a_large_body_is_written_as_it_is(tmp_path: Path) -> None:
    writer = CaptureWriter(tmp_path / "flows.mitm")
    assert writer.write(tflow.tflow(resp=True))
    counting = CountingFile(writer._open())
    writer._file = counting  # type: ignore[assignment]
    assert writer.write(tflow.tflow(resp=True))
    assert len(counting.sizes) == 1  # a record is some 70 pieces: one write, not one each
    big = tflow.tflow(resp=True)
    big.response.content = b"z" * (1 << 20)
    counting.sizes.clear()
    assert writer.write(big)
    assert (1 << 20) in counting.sizes and len(counting.sizes) <= 3  # the small runs around the body, joined
    flows = list(read_flows(tmp_path / "flows.mitm"))
    assert flows[-1].response.content == b"z" * (1 << 20)
