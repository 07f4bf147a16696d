"""The tools/list filter, table by table: every content type spelling, content coding, SSE line ending,
batch shape, streamed or whole. Rule under test: an ungranted tool never reaches the client, and an answer
tether cannot read is refused, never passed.

Unit rows run the pure filter (``proxy.mcp``) against an independent SSE reader written from the spec.
End-to-end rows run a real sidecar in front of a real aiohttp server that answers in exactly that shape,
and read the answer as raw bytes at the client.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import brotli
import httpx
import pytest
from aiohttp import web

from tether.proxy import mcp

from .conftest import World, teardown_world
from .harness import McpServer, TestCA, ToolServer, prepare_controlplane

try:
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:
    from backports import zstd

ALL = ["add", "delete_everything", "send_email", "slow"]
GRANTED = {"add"}


def allowed(name: str) -> bool:
    return name in GRANTED


def tools_result(msg_id: Any, names: list[str] = ALL) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": msg_id,
            "result": {"tools": [{"name": n, "inputSchema": {"type": "object"}} for n in names]}}


def call_result(msg_id: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": msg_id, "result": {"content": [{"type": "text", "text": "2"}]}}


# -- an SSE reader written from the spec (the test's oracle, not tether's parser) -------------------------
def sse_data(stream: bytes) -> list[str]:
    """The data of every dispatched event, as a browser's EventSource would see it."""
    text = stream.decode("utf-8")
    text = text.removeprefix("\ufeff")
    out: list[str] = []
    data: list[str] = []
    for line in re.split(r"\r\n|\r|\n", text):
        if line == "":
            if data:
                out.append("\n".join(data))
            data = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    return out  # an event without its closing blank line at the end of the stream is discarded, as the spec says


def seen_tools(stream: bytes) -> list[str]:
    names: list[str] = []
    for payload in sse_data(stream):
        if not payload.strip():
            continue
        value = json.loads(payload)
        for item in value if isinstance(value, list) else [value]:
            names += [t["name"] for t in (item.get("result") or {}).get("tools", [])]
    return names


# -- codings ------------------------------------------------------------------------------------------------
def raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-15)
    return c.compress(data) + c.flush()


ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "identity": lambda b: b,
    "gzip": gzip.compress,
    "x-gzip": gzip.compress,
    "deflate": zlib.compress,
    "deflate-raw": raw_deflate,  # sent as "deflate" without the zlib wrapper, as some servers do
    "br": brotli.compress,
    "zstd": zstd.compress,
    "gzip, br": lambda b: brotli.compress(gzip.compress(b)),
    "GZIP": gzip.compress,
}


def header_for(coding: str) -> str:
    return "deflate" if coding == "deflate-raw" else coding


def sse_stream(events: list[Any], eol: bytes) -> bytes:
    out = b""
    for i, value in enumerate(events):
        out += b"event: message" + eol + b"id: " + str(i).encode() + eol
        out += b"data: " + json.dumps(value).encode() + eol + eol
    return out


def run_filter(f: mcp.SseToolsFilter, body: bytes, chunk: int) -> bytes:
    out = b""
    for i in range(0, len(body), chunk):
        pieces = list(f(body[i:i + chunk]))
        assert all(pieces), "a non-final call must never yield an empty chunk (it would end a chunked body)"
        out += b"".join(pieces)
    return out + b"".join(f(b""))


EOLS = {"LF": b"\n", "CRLF": b"\r\n", "CR": b"\r"}
SHAPES: dict[str, list[Any]] = {
    "single": [tools_result(1)],
    "batch [call, list]": [[call_result(1), tools_result(2)]],
    "call then list": [call_result(1), tools_result(2)],
}


@pytest.mark.parametrize("coding", list(ENCODERS))
@pytest.mark.parametrize("eol", list(EOLS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_sse_answers_lose_ungranted_tools_in_every_shape(coding: str, eol: str, shape: str, chunk: int) -> None:
    plain = sse_stream(SHAPES[shape], EOLS[eol])
    assert set(seen_tools(plain)) == set(ALL)  # the oracle sees every tool unfiltered
    codings = mcp.content_codings(header_for(coding))
    f = mcp.SseToolsFilter(allowed, mcp.Decoder(codings) if codings else None)
    out = run_filter(f, ENCODERS[coding](plain), chunk)
    assert seen_tools(out) == ["add"], out
    assert len(sse_data(out)) == len(SHAPES[shape])  # every event still arrives, none merged or lost
    assert f.removed == 3 and not f.broken


def test_sse_details_the_spec_allows() -> None:
    granted = json.dumps(tools_result(1)).encode()
    cases = {
        "a byte order mark first": b"\xef\xbb\xbfdata: " + granted + b"\n\n",
        "data without the space": b"data:" + granted + b"\n\n",
        "data split over lines": b"data: " + granted[:10] + b"\ndata: " + granted[10:] + b"\n\n",
        "a comment and a retry first": b": hi\nretry: 10\n\ndata: " + granted + b"\n\n",
        "a CR at a chunk edge then LF": b"data: " + granted + b"\r\n\r\n",
        "mixed line endings": b"id: 1\rdata: " + granted + b"\r\n\n",
        "CRLF data lines split at every edge": b"data: " + granted[:10] + b"\r\ndata: " + granted[10:] + b"\r\n\r\n",
    }
    for what, body in cases.items():
        for chunk in (1, 2, 3, len(body)):
            out = run_filter(mcp.SseToolsFilter(allowed), body, chunk)
            assert seen_tools(out) == ["add"], (what, chunk, out)


def test_a_cr_only_event_is_delivered_without_waiting_for_the_next_byte() -> None:
    """A listen stream may go quiet right after an event; the event must not wait behind a possible LF."""
    f = mcp.SseToolsFilter(allowed)
    out = b"".join(f(b"data: " + json.dumps(tools_result(1)).encode() + b"\r\r"))
    assert seen_tools(out) == ["add"]
    assert b"".join(f(b"\ndata: {\r\r")) == mcp.DROPPED  # the LF of a late CRLF is not a blank line


def test_sse_events_that_cannot_be_read_are_dropped_and_a_broken_coding_cuts_the_stream() -> None:
    priming = b"id: p\ndata: \n\n"
    assert run_filter(mcp.SseToolsFilter(allowed), priming, 4) == priming  # the SDK's resumption event passes
    unreadable = b'data: {"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "delete_everything"\n\n'
    out = run_filter(mcp.SseToolsFilter(allowed), unreadable, 5)
    assert b"delete_everything" not in out and out == mcp.DROPPED
    # A gzip stream that stops decoding: what decoded before passes filtered, nothing after it does.
    good = sse_stream([tools_result(1)], b"\n")
    body = gzip.compress(good) + b"garbage that is not gzip, then the secret delete_everything"
    f = mcp.SseToolsFilter(allowed, mcp.Decoder(("gzip",)))
    out = run_filter(f, body, 16)
    assert seen_tools(out) == ["add"] and b"delete_everything" not in out and f.broken
    # Truncated: the stream ends inside the gzip member.
    f = mcp.SseToolsFilter(allowed, mcp.Decoder(("br",)))
    run_filter(f, brotli.compress(good)[:-3], 4)
    assert f.broken


@pytest.mark.parametrize("header", ["compress", "bogus", "gzip, snappy", "x-custom"])
def test_unknown_codings_are_unreadable(header: str) -> None:
    with pytest.raises(mcp.Unreadable):
        mcp.content_codings(header)


@pytest.mark.parametrize("header,expected", [
    ("", ()), ("identity", ()), (" GZIP ", ("gzip",)), ("deflate, br", ("deflate", "br")), ("zstd", ("zstd",))])
def test_known_codings_in_order(header: str, expected: tuple[str, ...]) -> None:
    assert mcp.content_codings(header) == expected


@pytest.mark.parametrize("ctype,media", [
    ("text/event-stream", "text/event-stream"), ("Text/Event-Stream", "text/event-stream"),
    ("TEXT/EVENT-STREAM; charset=utf-8", "text/event-stream"),
    ("Application/JSON; charset=UTF-8", "application/json"), (" application/json ", "application/json")])
def test_media_types_are_case_insensitive(ctype: str, media: str) -> None:
    assert mcp.media_type(ctype) == media


@pytest.mark.parametrize("coding", list(ENCODERS))
@pytest.mark.parametrize("shape", ["single", "batch [call, list]"])
def test_json_answers_lose_ungranted_tools_in_every_coding(coding: str, shape: str) -> None:
    value = SHAPES[shape][0]
    raw = ENCODERS[coding](json.dumps(value).encode())
    body, removed = mcp.filter_json_body(mcp.decode_body(raw, mcp.content_codings(header_for(coding))), allowed)
    items = json.loads(body)
    items = items if isinstance(items, list) else [items]
    assert [t["name"] for i in items for t in (i.get("result") or {}).get("tools", [])] == ["add"]
    assert removed == 3


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd"])
def test_an_empty_body_in_any_coding_is_empty(coding: str) -> None:
    assert mcp.decode_body(b"", (coding,)) == b""
    f = mcp.SseToolsFilter(allowed, mcp.Decoder((coding,)))
    assert list(f(b"")) == [] and not f.broken


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe", gzip.compress(b"{}", mtime=0)],
                         ids=["not-json", "not-utf8", "gzip-in-identity"])
def test_a_json_answer_that_is_not_json_is_unreadable(body: bytes) -> None:
    with pytest.raises(mcp.Unreadable):
        mcp.filter_json_body(body, allowed)


@pytest.mark.parametrize("coding", ["gzip", "br", "zstd", "deflate"])
def test_a_broken_coding_is_unreadable(coding: str) -> None:
    with pytest.raises(mcp.Unreadable):
        mcp.decode_body(ENCODERS[coding](b'{"a": 1}')[:-4] + b"\x00\x01", (coding,))


# -- end to end: a real sidecar in front of a server that answers in each shape -------------------------
class ShapedMcp(ToolServer):
    """An aiohttp server on the catalog's MCP URL answering tools/list in the shape named by the request's
    ``x-shape`` header: "sse|json", a coding, a line ending, a Content-Type spelling, chunked or not."""

    def __init__(self) -> None:
        super().__init__()
        self.accept_encodings: list[str | None] = []

    def _app(self) -> web.Application:
        async def handle(request: web.Request) -> web.StreamResponse:
            self.accept_encodings.append(request.headers.get("accept-encoding"))
            shape = dict(part.split("=", 1) for part in request.headers["x-shape"].split(";"))
            if request.method == "GET":
                value: Any = tools_result(7)
            else:
                sent = json.loads(await request.read())
                items = sent if isinstance(sent, list) else [sent]
                answers = [tools_result(m["id"]) if m["method"] == "tools/list" else call_result(m["id"])
                           for m in items]
                value = answers if isinstance(sent, list) else answers[0]
            eol = EOLS[shape.get("eol", "LF")]
            body = (sse_stream([value], eol) if shape["kind"] == "sse" else json.dumps(value).encode())
            coding = shape.get("coding", "identity")
            encoded = ENCODERS[coding](body) if coding in ENCODERS else gzip.compress(body)
            headers = {"Content-Type": shape["ctype"]}
            if coding != "identity":
                headers["Content-Encoding"] = header_for(coding)
            resp = web.StreamResponse(headers=headers)
            if shape.get("chunked") == "1":
                resp.enable_chunked_encoding()
            else:
                resp.content_length = len(encoded)
            await resp.prepare(request)
            for i in range(0, len(encoded), 9):  # small writes: the sidecar sees many chunks
                await resp.write(encoded[i:i + 9])
            await resp.write_eof()
            return resp

        app = web.Application()
        app.router.add_route("*", "/mcp", handle)
        return app


@pytest.fixture(scope="module")
def shaped(tmp_path_factory: pytest.TempPathFactory, test_ca: TestCA) -> Iterator[tuple[World, ShapedMcp, Any]]:
    directory = tmp_path_factory.mktemp("mcp-shapes")
    tools, secure = ToolServer().start(), ToolServer(tls=test_ca).start()
    server = ShapedMcp().start()
    cp = prepare_controlplane(directory / "cp", tools.port, secure.port, server.port)
    world = World(directory, tools, secure, McpServer(port=server.port), test_ca, cp)  # McpServer never started
    cp.start()
    try:
        sidecar = world.sidecar(cp.issue("shapes", {"mcp.add": "direct"}))
        yield world, server, sidecar
    finally:
        server.stop()
        teardown_world(world)


LIST = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
BATCH = [{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "add", "arguments": {}}},
         {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}]

E2E_ROWS = [  # (request, shape)
    (LIST, "kind=sse;ctype=text/event-stream;coding=gzip"),
    (LIST, "kind=sse;ctype=text/event-stream;coding=br;chunked=1"),
    (LIST, "kind=sse;ctype=text/event-stream;coding=zstd"),
    (LIST, "kind=sse;ctype=text/event-stream;coding=deflate-raw;chunked=1"),
    (LIST, "kind=sse;ctype=Text/Event-Stream;eol=CR"),
    (LIST, "kind=sse;ctype=text/event-stream;eol=CRLF;chunked=1"),
    (LIST, "kind=sse;ctype=text/event-stream"),  # with a Content-Length that no longer fits once filtered
    (LIST, "kind=json;ctype=Application/JSON; charset=UTF-8;coding=gzip"),
    (LIST, "kind=json;ctype=application/json;coding=br;chunked=1"),
    (BATCH, "kind=json;ctype=application/json;chunked=1"),
    (BATCH, "kind=json;ctype=APPLICATION/JSON;coding=gzip;chunked=1"),
    (BATCH, "kind=sse;ctype=text/event-stream;coding=gzip;chunked=1;eol=CR"),
]


def post(sidecar: Any, port: int, body: Any, shape: str) -> httpx.Response:
    with httpx.Client(proxy=sidecar.proxy, trust_env=False, timeout=20) as client:
        return client.post(f"http://127.0.0.1:{port}/mcp", content=json.dumps(body).encode(),
                           headers={"content-type": "application/json", "x-shape": shape,
                                    "accept": "application/json, text/event-stream", "accept-encoding": "gzip, br"})


def tools_in(resp: httpx.Response) -> list[str]:
    # httpx would raise on a body shorter than its Content-Length; it decodes any coding left on it.
    if resp.headers.get("content-type", "").lower().startswith("text/event-stream"):
        return seen_tools(resp.content)
    value = resp.json()
    return [t["name"] for i in (value if isinstance(value, list) else [value])
            for t in (i.get("result") or {}).get("tools", [])]


@pytest.mark.parametrize("request_body,shape", E2E_ROWS, ids=[s for _, s in E2E_ROWS])
def test_through_a_sidecar_only_granted_tools_arrive(shaped: Any, request_body: Any, shape: str) -> None:
    _, server, sidecar = shaped
    resp = post(sidecar, server.port, request_body, shape)
    assert resp.status_code == 200, resp.text
    assert tools_in(resp) == ["add"], resp.content
    assert b"delete_everything" not in resp.content
    assert server.accept_encodings[-1] == "identity"  # the agent's gzip, br is not what the server was asked


@pytest.mark.parametrize("shape", [
    "kind=sse;ctype=text/event-stream;coding=snappy",
    "kind=sse;ctype=text/event-stream;coding=snappy;chunked=1",
    "kind=json;ctype=application/json;coding=snappy",
    "kind=json;ctype=application/json;coding=snappy;chunked=1",
    "kind=json;ctype=text/plain",
])
@pytest.mark.parametrize("request_body", [LIST, BATCH], ids=["list", "batch"])
def test_through_a_sidecar_an_unreadable_tools_answer_is_refused(shaped: Any, request_body: Any,
                                                                shape: str) -> None:
    _, server, sidecar = shaped
    resp = post(sidecar, server.port, request_body, shape)
    # Answered as a server answers a request it cannot serve: HTTP 200, a JSON-RPC error for each request.
    assert resp.status_code == 200, (resp.status_code, resp.content[:300])
    assert resp.headers["Tether-Error"] == "tether.capability_absent"
    assert b"delete_everything" not in resp.content
    errors = resp.json()
    errors = errors if isinstance(errors, list) else [errors]
    assert sorted(e["id"] for e in errors) == sorted(
        m["id"] for m in (request_body if isinstance(request_body, list) else [request_body]))
    assert all(e["error"]["data"]["reason"] == "unfilterable_answer" for e in errors)


@pytest.mark.parametrize("shape", ["kind=sse;ctype=text/event-stream;coding=gzip;chunked=1",
                                   "kind=sse;ctype=Text/Event-Stream;coding=zstd;eol=CR"])
def test_through_a_sidecar_a_compressed_listen_stream_is_filtered(shaped: Any, shape: str) -> None:
    _, server, sidecar = shaped
    with httpx.Client(proxy=sidecar.proxy, trust_env=False, timeout=20) as client:
        resp = client.get(f"http://127.0.0.1:{server.port}/mcp",
                          headers={"x-shape": shape, "accept": "text/event-stream", "accept-encoding": "gzip"})
    assert resp.status_code == 200 and seen_tools(resp.content) == ["add"], resp.content


# -- every kind of list, and notifications about resources ---------------------------------------------------
VISIBLE = mcp.Visible(tool=lambda n: n == "add", resource=lambda u: u.startswith("docs://public/"),
                      template=lambda t: t == "docs://public/{page}", prompt=lambda n: n == "greet")


def items_result(msg_id: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": msg_id, "result": {
        "resources": [{"uri": "docs://public/a", "name": "a"}, {"uri": "docs://private/b", "name": "b"},
                      {"name": "no uri"}, {"uri": 7, "name": "not a string"}],
        "resourceTemplates": [{"uriTemplate": "docs://public/{page}", "name": "p"},
                              {"uriTemplate": "vault://{key}", "name": "v"}],
        "prompts": [{"name": "greet"}, {"name": "leak_secrets"}]}}


def updated(uri: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": "notifications/resources/updated", "params": {"uri": uri}}


def test_every_list_loses_what_the_agent_does_not_hold() -> None:
    value, removed = mcp.filter_lists_message(items_result(1), VISIBLE)
    result = value["result"]
    assert [r["uri"] for r in result["resources"]] == ["docs://public/a"]
    assert [t["uriTemplate"] for t in result["resourceTemplates"]] == ["docs://public/{page}"]
    assert [p["name"] for p in result["prompts"]] == ["greet"] and removed == 5
    body, removed = mcp.filter_json_body(json.dumps([items_result(1), tools_result(2)]).encode(), VISIBLE)
    assert removed == 8 and b"private" not in body and b"vault" not in body and b"leak" not in body
    # A predicate on tool names alone (the old spelling) hides every other kind: fail closed.
    value, _ = mcp.filter_lists_message(items_result(1), allowed)
    assert value["result"]["resources"] == [] and value["result"]["prompts"] == []


def test_a_message_with_both_a_method_and_a_result_has_its_result_filtered_too() -> None:
    """A server can write ``method`` beside ``result`` in one message: no client answers it as a request, and a
    client reading it as an answer must not find a hidden tool in it (it used to pass whole)."""
    def both() -> dict[str, Any]:
        return {**tools_result(5), "method": "notifications/message", "params": {}}

    value, removed = mcp.filter_lists_message(both(), allowed)
    assert removed == 3 and b"delete_everything" not in json.dumps(value).encode()
    body, removed_in_body = mcp.filter_json_body(json.dumps(both()).encode(), allowed)
    assert removed_in_body == 3 and b"send_email" not in body


def test_updates_about_resources_the_agent_does_not_hold_are_dropped() -> None:
    assert mcp.filter_lists_message(updated("docs://public/a"), VISIBLE) == (updated("docs://public/a"), 0)
    assert mcp.filter_lists_message(updated("docs://private/b"), VISIBLE) == (None, 1)
    assert mcp.filter_lists_message(updated(None), VISIBLE) == (None, 1)
    value, removed = mcp.filter_lists_message([updated("docs://private/b"), items_result(3)], VISIBLE)
    assert removed == 6 and len(value) == 1 and value[0]["id"] == 3
    stream = sse_stream([updated("docs://public/a"), updated("docs://private/b"), items_result(4)], b"\r\n")
    for chunk in (1, 9, 1 << 20):
        f = mcp.SseListsFilter(VISIBLE)
        out = run_filter(f, stream, chunk)
        events = [json.loads(d) for d in sse_data(out)]
        assert [e.get("method") or e.get("id") for e in events] == ["notifications/resources/updated", 4], out
        assert b"private" not in out and b"vault" not in out and b"leak" not in out
        assert f.answered == {mcp.id_key(4)}
