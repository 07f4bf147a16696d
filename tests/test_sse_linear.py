"""The SSE list filter reads a stream in one pass (each byte scanned a bounded number of times), and what it
passes is right however the stream is cut: every split of a stream reads as one whole chunk reads, a CR
at a chunk's end waits for its LF even across chunks that decode to nothing, and a multi-MB ``tools/list``
delivered in small writes through a real sidecar arrives with exactly the granted tools, whole.

Correctness only: how long a large answer takes is measured in bench/bench_tools_list.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.proxy import mcp

from .conftest import World, teardown_world
from .harness import McpServer, TestCA, ToolServer, prepare_controlplane

GRANTED = {"add", "send_email"}


def allowed(name: str) -> bool:
    return name in GRANTED


def listing(msg_id: Any, names: list[str]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": msg_id, "result": {"tools": [{"name": n, "inputSchema": {}} for n in names]}}


def run(f: mcp.SseListsFilter, pieces: list[bytes]) -> bytes:
    out = b""
    for piece in pieces:
        got = list(f(piece))
        assert all(got), "a non-final call yields no empty chunk"
        out += b"".join(got)
    return out + b"".join(f(b""))


def cut(body: bytes, edges: list[int]) -> list[bytes]:
    points = sorted({e % (len(body) + 1) for e in edges} | {0, len(body)})
    return [body[a:b] for a, b in itertools.pairwise(points) if b > a]


EOLS = [b"\n", b"\r\n", b"\r"]


def as_read(output: bytes) -> list[list[bytes]]:
    """The events a client reads from ``output``: each the list of its lines (a CR then an LF is one line end,
    so a filter that already ended a line at the CR may leave the LF out: the same stream to a client)."""
    events: list[list[bytes]] = [[]]
    for line in re.split(rb"\r\n|\r|\n", output):
        if line:
            events[-1].append(line)
        elif events[-1]:
            events.append([])
    return events


def stream(eols: list[int]) -> bytes:
    """Events in every shape the filter treats apart, each line ended by the line ending ``eols`` picks."""
    pick = iter(eols * 50)

    def line(text: bytes) -> bytes:
        return text + EOLS[next(pick) % 3]

    big = json.dumps(listing(2, ["add", "delete_everything", "x" * 5000, "send_email"])).encode()
    out = b"\xef\xbb\xbf" + line(b": a comment") + line(b"retry: 10") + line(b"")
    out += line(b"id: p") + line(b"data: ") + line(b"")  # the SDK's priming event
    out += line(b"event: message") + line(b"data: " + big[:100]) + line(b"data:" + big[100:]) + line(b"")
    out += line(b"data: {not json") + line(b"")
    out += line(b"data: " + json.dumps(listing(3, ["add"])).encode()) + line(b"")
    return out + line(b"data: " + json.dumps(listing(4, ["send_email", "slow"])).encode())  # no blank line: EOF


@settings(max_examples=150, deadline=None)
@given(eols=st.lists(st.integers(0, 2), min_size=1, max_size=12),
       edges=st.lists(st.integers(0, 1 << 16), max_size=40))
def test_every_split_of_a_stream_passes_what_one_chunk_passes(eols: list[int], edges: list[int]) -> None:
    body = stream(eols)
    whole = mcp.SseListsFilter(allowed)
    expected = run(whole, [body])
    assert b"delete_everything" not in expected and b"slow" not in expected and b"xxxxx" not in expected
    assert len(as_read(expected)) == len(as_read(body))  # rewritten or refused, every event is still one
    split = mcp.SseListsFilter(allowed)
    assert as_read(run(split, cut(body, edges))) == as_read(expected)
    assert (split.removed, split.dropped, split.answered) == (whole.removed, whole.dropped, whole.answered)


@settings(max_examples=150, deadline=None)
@given(eols=st.lists(st.integers(0, 2), min_size=1, max_size=12),
       extra=st.lists(st.sampled_from([b"\n", b"\r", b"\r\n", b"\n\n", b"data: 1", b"\xef\xbb\xbf", b" "]),
                      max_size=6),
       bom=st.booleans())
def test_a_whole_answer_is_cut_and_filtered_as_the_streaming_filter_does(eols: list[int], extra: list[bytes],
                                                                        bom: bool) -> None:
    """``read_answer`` cuts a whole body with ``whole_events`` (slices, no copies), not with the streaming
    cutter: the events, and what the client then gets, must be the same bytes, whatever the line ends, a BOM,
    an event left without its blank line, or stray line ends at the start and the end."""
    body = (b"\xef\xbb\xbf" if bom else b"") + b"".join(extra[:2]) + stream(eols)[3:] + b"".join(extra[2:])
    cutter = mcp.SseListsFilter(allowed)
    assert mcp.whole_events(body) == [*cutter.cut(body), *cutter.cut(b"")]
    streamed = mcp.SseListsFilter(allowed)
    expected = run(streamed, [body])
    got, removed, seen = mcp.filter_answer(mcp.read_answer(body, True), allowed)
    assert got == expected
    assert (removed, seen.dropped, seen.answered) == (streamed.removed, streamed.dropped, streamed.answered)


def test_a_one_event_answer_is_read_without_copying_the_event() -> None:
    """The one copy of a 2 MB event's data is its payload: the event is the body itself, its lines are views."""
    body = b"event: message\ndata: " + json.dumps(listing(1, ["add", "x" * 2_000_000])).encode() + b"\n\n"
    (event,) = mcp.whole_events(body)
    assert event is body
    data = mcp.event_data(event)
    assert data is not None
    lines, data_idx, payload = data
    assert all(isinstance(line, memoryview) and line.obj is body for line in lines) and data_idx == [1]
    assert payload == body[len(b"event: message\ndata: "):-2]
    out, removed, _ = mcp.filter_answer(mcp.read_answer(body, True), allowed)
    assert removed == 1 and json.loads(out.split(b"data: ", 1)[1]) == listing(1, ["add"])


def test_the_lf_of_a_split_crlf_inside_an_event_is_not_read_twice() -> None:
    """``retry: 10\\r`` | ``\\n\\n...``: the CR ends the line at once, its LF follows in the next chunk, then a
    blank line. Sent on as CR LF LF the client reads the same line end and blank line (not CR LF: no blank line,
    and the next event would merge into this one)."""
    granted = json.dumps(listing(1, ["add"])).encode()
    body = b"retry: 10\r\n\nid: 2\ndata: " + granted + b"\n\n"
    for at in range(1, len(body)):
        out = run(mcp.SseListsFilter(allowed), [body[:at], body[at:]])
        assert as_read(out) == [[b"retry: 10"], [b"id: 2", b"data: " + granted], []], (at, out)


def test_a_cr_at_a_chunks_end_waits_for_its_lf_across_chunks_that_decode_to_nothing() -> None:
    """A compressed stream fed a byte at a time: most bytes decode to nothing. The CR that ended an event
    still owns the LF that follows (it is not a blank line that would show up as a stray line at the client)."""
    encoder = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    first = b"data: " + json.dumps(listing(1, ["add", "delete_everything"])).encode() + b"\r\r"
    body = encoder.compress(first) + encoder.flush(zlib.Z_SYNC_FLUSH)
    body += encoder.compress(b"\ndata: {\r\r") + encoder.flush()
    f = mcp.SseListsFilter(allowed, mcp.Decoder(("gzip",)))
    out = run(f, [body[i:i + 1] for i in range(len(body))])
    plain = mcp.SseListsFilter(allowed)
    assert out == run(plain, [first]) + mcp.DROPPED
    assert b"delete_everything" not in out and not f.broken


# -- end to end: a multi-MB list in small writes, through a real sidecar -------------------------------------
def big_tools() -> list[dict[str, Any]]:
    """About 4.5 MB of tools: two granted ones that are large themselves, thousands that are not granted."""
    tools = [{"name": "add", "description": "add " + "\u00e9\u2215 \\n " * 170_000, "inputSchema": {"type": "object"}}]
    tools += [{"name": f"tool_{i:05d}", "description": f"filler {i} " + "y" * 900, "inputSchema": {}}
              for i in range(3000)]
    tools.append({"name": "send_email", "description": "mail " + "z" * 500_000, "inputSchema": {"type": "object"}})
    tools.append({"name": "delete_everything", "description": "never", "inputSchema": {}})
    return tools


PIECES = [1, 3001, 7, 4096, 1000]  # the sizes of the server's writes, in turn: edges land everywhere


class BigListMcp(ToolServer):
    """Answers every POST tools/list with ``big_tools()``, as SSE (``x-kind: sse``, ``x-eol`` its line ending)
    or JSON, chunked, in small writes each awaited."""

    def __init__(self) -> None:
        super().__init__()
        self.tools = big_tools()
        self.sent: list[int] = []  # bytes of each answer written

    def _app(self) -> web.Application:
        async def handle(request: web.Request) -> web.StreamResponse:
            sent = json.loads(await request.read())
            answer = json.dumps({"jsonrpc": "2.0", "id": sent["id"], "result": {"tools": self.tools}}).encode()
            sse = request.headers.get("x-kind") == "sse"
            if sse:
                eol = {"LF": b"\n", "CRLF": b"\r\n", "CR": b"\r"}[request.headers.get("x-eol", "LF")]
                answer = (b"id: p" + eol + b"data: " + eol + eol
                          + b"event: message" + eol + b"data: " + answer + eol + eol)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream" if sse else "application/json"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            at, turn = 0, 0
            while at < len(answer):
                size = PIECES[turn % len(PIECES)]
                await resp.write(answer[at:at + size])
                at, turn = at + size, turn + 1
                if turn % 64 == 0:
                    await asyncio.sleep(0)  # let the writes leave as separate reads at the sidecar
            await resp.write_eof()
            self.sent.append(len(answer))
            return resp

        app = web.Application()
        app.router.add_post("/mcp", handle)
        return app


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory, test_ca: TestCA) -> Iterator[tuple[BigListMcp, Any]]:
    directory = tmp_path_factory.mktemp("big-list")
    tools, secure = ToolServer().start(), ToolServer(tls=test_ca).start()
    server = BigListMcp().start()
    cp = prepare_controlplane(directory / "cp", tools.port, secure.port, server.port)
    world = World(directory, tools, secure, McpServer(port=server.port), test_ca, cp)  # McpServer never started
    cp.start()
    try:
        yield server, world.sidecar(cp.issue("big-list", {"mcp.add": "direct", "mcp.send": "direct"}))
    finally:
        server.stop()
        teardown_world(world)


def sse_payloads(body: bytes) -> list[str]:
    """The data of each event, read as the spec says (the test's own reader, not tether's)."""
    events, data = [], []
    for line in body.decode().replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if line == "":
            if data:
                events.append("\n".join(data))
            data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    return events


@pytest.mark.parametrize("kind,eol", [("sse", "LF"), ("sse", "CRLF"), ("sse", "CR"), ("json", "")])
def test_a_multi_mb_list_in_small_writes_arrives_with_exactly_the_granted_tools(big: Any, kind: str,
                                                                                eol: str) -> None:
    server, sidecar = big
    body = json.dumps({"jsonrpc": "2.0", "id": 9, "method": "tools/list"}).encode()
    with httpx.Client(proxy=sidecar.proxy, trust_env=False, timeout=180) as client:
        resp = client.post(f"http://127.0.0.1:{server.port}/mcp", content=body,
                           headers={"content-type": "application/json", "x-kind": kind, "x-eol": eol,
                                    "accept": "application/json, text/event-stream"})
    assert resp.status_code == 200, resp.content[:500]
    assert server.sent[-1] > 4_000_000  # the answer really was multi-MB
    if kind == "sse":
        payloads = sse_payloads(resp.content)
        assert payloads[0] == ""  # the priming event passes as it was
        assert len(payloads) == 2, [p[:80] for p in payloads]
        value = json.loads(payloads[1])
    else:
        value = resp.json()
    expected = [t for t in server.tools if t["name"] in GRANTED]
    assert value == {"jsonrpc": "2.0", "id": 9, "result": {"tools": expected}}
    assert b"delete_everything" not in resp.content and b"tool_0" not in resp.content
