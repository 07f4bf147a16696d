"""A JSON list answer filtered as it arrives (``liststream.JsonListStream``) against the buffered filter
(``mcp.read_answer`` and ``mcp.filtered``), over every chunking: the same bytes when it reads the answer to the
end; else a fall-back before its first byte (every byte kept for the buffered filter) or, after it, a cut that
leaves the client no whole JSON text and no tool it does not hold."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.proxy import liststream, mcp

from .test_mcp_pieces import tool_text

GRANTED = {"add", "send_email", "a\u00e9"}
NAMES = ["add", "send_email", "delete_everything", "slow", "a\u00e9"]


def allowed(name: str) -> bool:
    return name in GRANTED


def buffered(body: bytes) -> tuple[Any, ...]:
    try:
        done = mcp.filtered(mcp.read_answer(body, False), allowed)
    except mcp.Unreadable:
        return ("unreadable",)
    return ("passed", done.body, done.removed)


def streamed(body: bytes, pieces: list[bytes], item_limit: int = liststream.ITEM_LIMIT) -> tuple[Any, ...]:
    stream = liststream.JsonListStream(allowed, item_limit)
    out = b""
    fed = 0
    try:
        for piece in pieces:
            fed += 1
            out += stream.feed(piece)
        out += stream.finish()
    except liststream.Fallback:
        assert out == b"" and not stream.sent and stream.raw is not None
        stream.raw.extend(pieces[fed:])  # as tether/proxy/streamlayer.py keeps what follows a fall-back
        assert b"".join(stream.raw) == body, "the fall-back holds every byte"
        return ("fallback",)
    except liststream.Cut:
        assert out and stream.sent, "a cut comes after the first byte only"
        return ("cut", out)
    assert stream.body() == out
    return ("passed", out, stream.removed)


def chunked(body: bytes, edges: list[int]) -> list[bytes]:
    points = sorted({e % (len(body) + 1) for e in edges} | {0, len(body)})
    return [body[a:b] for a, b in itertools.pairwise(points) if b > a]


def agrees(body: bytes, pieces: list[bytes], item_limit: int = liststream.ITEM_LIMIT) -> tuple[Any, ...]:
    """The stream's outcome, held to the buffered filter's (see the module docstring)."""
    want, got = buffered(body), streamed(body, pieces, item_limit)
    if got[0] == "passed":
        assert got == want
    elif got[0] == "cut":
        out = got[1]
        with pytest.raises(ValueError):
            json.loads(out)  # never a whole answer
        for name in NAMES:
            if name not in GRANTED:
                assert f'"{name}"'.encode() not in out, "an unjudged or hidden tool passed before the cut"
    return got


SPACING = st.sampled_from(["", " ", "\n  ", "\t\r\n"])


@st.composite
def answers(draw: Any) -> bytes:
    """A tools/list answer as servers write it: any spacing, tools spelled four ways, members around the list."""
    sp = draw(SPACING)
    tools = draw(st.lists(st.tuples(st.sampled_from(NAMES), st.integers(0, 3)), max_size=10))
    texts = [tool_text(name, style) for name, style in tools]
    listed = "[" + sp + ("," + sp).join(texts) + sp + "]"
    before = draw(st.sampled_from(['', '"_meta": {"k": [1, {"x": null}]},', '"total": 12.5e3,']))
    after = draw(st.sampled_from(['', ',"nextCursor":"c\u00e9"', ', "prompts": [{"name": "greet"}]', ',"n":-0']))
    msg_id = draw(st.sampled_from(['7', '"s"', 'null', '123456789012']))
    payload = (sp + '{' + sp + '"jsonrpc":' + sp + '"2.0",' + sp + '"id": ' + msg_id + ',' + sp + '"result":' + sp
               + '{' + before + '"tools":' + sp + listed + after + sp + '}' + sp + '}' + sp)
    return payload.encode("utf-8", "surrogatepass")


@settings(max_examples=400, deadline=None)
@given(body=answers(), edges=st.lists(st.integers(0, 1 << 16), max_size=12))
def test_a_list_answer_streams_to_the_buffered_filter_s_bytes_in_any_chunks(body: bytes, edges: list[int]) -> None:
    got = agrees(body, chunked(body, edges))
    assert got[0] == "passed", "an answer of the shape it reads is streamed to its end"


@settings(max_examples=60, deadline=None)
@given(body=answers())
def test_every_chunking_of_a_short_answer(body: bytes) -> None:
    for cut in range(len(body) + 1):
        assert agrees(body, chunked(body, [cut]))[0] == "passed"
    assert agrees(body, [body[i:i + 1] for i in range(len(body))])[0] == "passed"  # a byte at a time


@settings(max_examples=300, deadline=None)
@given(body=answers(), edges=st.lists(st.integers(0, 1 << 16), max_size=6), at=st.integers(0, 1 << 16),
       junk=st.sampled_from([b"", b",", b"]", b"}", b":", b"x", b" ", b'"', b"{", b"[", b"\xff", b"\xed\xa0\x80",
                             b"1", b"\\"]))
def test_a_damaged_answer_falls_back_or_is_cut_never_passes_what_the_buffered_filter_refuses(
        body: bytes, edges: list[int], at: int, junk: bytes) -> None:
    at %= len(body) + 1
    damaged = body[:at] + junk + body[at + 1:]  # a byte replaced, removed or added
    got = agrees(damaged, chunked(damaged, edges))
    if buffered(damaged)[0] == "unreadable":
        assert got[0] != "passed"


ODD = {  # shapes the stream leaves to the buffered filter: nothing has passed yet, so they fall back
    "batch": b'[{"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "add"}, {"name": "slow"}]}}]',
    "method and result": b'{"jsonrpc": "2.0", "id": 1, "method": "x", "result": {"tools": [{"name": "slow"}]}}',
    "input requests": b'{"id": 1, "result": {"inputRequests": {"a": {"method": "sampling/createMessage", '
                      b'"params": {"tools": [{"name": "slow"}]}}}, "tools": []}}',
    "result twice": b'{"id": 1, "result": {"tools": []}, "result": {"tools": [{"name": "slow"}]}}',
    "a key twice in a member": b'{"id": 1, "_meta": {"a": 1, "a": 2}, "result": {"tools": [{"name": "slow"}]}}',
    "a BOM": b'\xef\xbb\xbf{"id": 1, "result": {"tools": [{"name": "slow"}]}}',
    "UTF-16": '{"id": 1, "result": {"tools": [{"name": "slow"}]}}'.encode("utf-16"),
    "not JSON": b"<html>busy</html>" + b" " * 100,
    "a scalar": b"42",
    "empty": b"",
    "no list": b'{"jsonrpc": "2.0", "id": 1, "result": {"tools": "none"}, "x": tru}',
}
LATE = {  # odd only after a list has been judged: they fall back when read in one piece, else may be cut
    "tools twice": b'{"id": 1, "result": {"tools": [{"name": "slow"}], "tools": [{"name": "add"}]}}',
    "a method after the list": b'{"id": 1, "result": {"tools": [{"name": "add"}]}, "method": "x"}',
    "two texts": b'{"id": 1, "result": {"tools": [{"name": "add"}]}} {"id": 2}',
    "garbage after": b'{"id": 1, "result": {"tools": [{"name": "add"}]}}x',
}


@pytest.mark.parametrize("name", sorted(ODD))
def test_odd_answers_fall_back_before_their_first_byte(name: str) -> None:
    body = ODD[name]
    for pieces in ([body], [body[i:i + 1] for i in range(len(body))]):
        assert agrees(body, pieces) == ("fallback",)


@pytest.mark.parametrize("name", sorted(LATE))
def test_answers_odd_after_their_list_fall_back_whole_and_are_cut_in_pieces(name: str) -> None:
    body = LATE[name]
    assert agrees(body, [body]) == ("fallback",)
    assert agrees(body, [body[i:i + 1] for i in range(len(body))])[0] == "cut"


def test_an_answer_that_ends_early_is_cut_without_its_closing_brace() -> None:
    body = b'{"id": 1, "result": {"tools": [{"name": "add"}]}'
    assert agrees(body, [body]) == ("cut", body)  # the client holds no whole JSON text: never an answer


def test_a_result_that_is_not_an_object_and_a_list_that_is_not_a_list_pass_as_the_buffered_filter_passes_them(
        ) -> None:
    for body in (b'{"id": 1, "result": [{"name": "slow"}]}', b'{"id": 1, "result": {"tools": {"name": "slow"}}}',
                 b'{"id": 1, "error": {"code": -1, "message": "no"}}', b'{}', b'{"id": 1, "result": {"tools": []}}',
                 b'{"result": {"tools": [7, "slow", {"name": 7}, {"name": "add"}, null]}}'):
        assert agrees(body, chunked(body, [3, 9, 20]))[0] == "passed"


def test_a_number_split_across_chunks_is_read_whole() -> None:
    body = b'{"id": 1234567, "result": {"tools": [], "nextCursor": 98765}}'
    for cut in range(len(body) + 1):
        assert agrees(body, chunked(body, [cut]))[0] == "passed"


def test_an_item_over_the_limit_falls_back_before_the_first_byte_and_is_cut_after_it() -> None:
    big = json.dumps({"name": "add", "description": "x" * 5000})
    first = '{"jsonrpc": "2.0", "id": 1, "result": {"tools": [' + big + ']}}'
    assert agrees(first.encode(), chunked(first.encode(), list(range(0, 6000, 512))), 1000) == ("fallback",)
    later = '{"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "add"}, ' + big + ']}}'
    got = agrees(later.encode(), chunked(later.encode(), list(range(70, 6000, 512))), 1000)
    assert got[0] == "cut" and got[1].endswith(b'{"name": "add"}'), got


def test_a_malformed_item_after_the_first_byte_cuts_the_answer() -> None:
    body = b'{"id": 1, "result": {"tools": [{"name": "add"}, {"name": "slow", "x": tru}, {"name": "add"}]}}'
    got = agrees(body, [body[:50], body[50:]])
    assert got == ("cut", b'{"id": 1, "result": {"tools": [{"name": "add"}')


def test_hidden_items_never_pass_and_kept_ones_pass_as_they_arrive() -> None:
    stream = liststream.JsonListStream(allowed)
    assert stream.feed(b'{"jsonrpc":"2.0","id":1,"result":{"tools":[{"name":"slow"},{"na') == \
        b'{"jsonrpc":"2.0","id":1,"result":{"tools":['
    assert stream.feed(b'me":"add"},{"name":"delete_everything"}') == b'{"name":"add"}'
    assert stream.feed(b',{"name":"send_email"}]}}') == b',{"name":"send_email"}]}'  # the last brace held
    assert stream.finish() == b"}"
    assert stream.removed == 2
    assert stream.value == {"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "add"}, {"name": "send_email"}]}}


def test_the_observer_sees_the_message_as_it_passed() -> None:
    seen: list[Any] = []
    stream = liststream.JsonListStream(mcp.Visible(tool=allowed, observe=seen.append))
    body = b'{"id": 1, "result": {"tools": [{"name": "add"}, {"name": "slow"}]}}'
    assert stream.feed(body) + stream.finish() == buffered(body)[1]
    assert seen == [{"id": 1, "result": {"tools": [{"name": "add"}]}}]


def test_a_large_list_is_read_in_linear_time() -> None:
    """Items read once each: a 4 MB list in 4 KiB chunks costs about what it costs in 1 MiB chunks."""
    import time
    tools = [{"name": NAMES[i % 5], "description": "d" * 20000, "inputSchema": {"p": {"q": {}}}} for i in range(200)]
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"tools": tools}}).encode()

    def cost(piece: int) -> float:
        best = float("inf")
        for _ in range(3):
            began = time.process_time()
            stream = liststream.JsonListStream(allowed)
            for i in range(0, len(body), piece):
                stream.feed(body[i:i + piece])
            stream.finish()
            best = min(best, time.process_time() - began)
        return best

    assert cost(4096) < 4 * cost(1 << 20) + 0.02


def test_a_long_string_item_is_not_read_again_per_chunk() -> None:
    """A value with no closing brace to wait for (a 3 MB string) is tried again only as its text grows by half."""
    import time
    body = b'{"id": 1, "result": {"tools": [{"name": "add"}, "' + b"x" * (3 << 20) + b'"]}}'
    pieces = chunked(body, list(range(0, len(body), 4096)))
    assert agrees(body, pieces)[0] == "passed"

    def cost() -> float:
        began = time.process_time()
        stream = liststream.JsonListStream(allowed)
        for piece in pieces:
            stream.feed(piece)
        stream.finish()
        return time.process_time() - began

    retry_from = liststream.RETRY_FROM
    try:
        whole = cost()
        liststream.RETRY_FROM = 1 << 40  # every chunk re-reads the string (8x the cost here)
        again = cost()
    finally:
        liststream.RETRY_FROM = retry_from
    assert whole < again / 3, (whole, again)


def test_a_filtered_answer_lets_go_of_the_text_it_was_read_from() -> None:
    """The capture keeps the filtered value until it is written: the 10 MB decoded text must not live on with it."""
    import gc
    import weakref
    for removed in (True, False):
        names = ["add", "slow" if removed else "send_email"]
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": n} for n in names]}}).encode()
        read = mcp.read_answer(body, False)
        source = weakref.ref(read.value["result"]["tools"])
        done = mcp.filtered(read, allowed)
        del read
        gc.collect()
        assert source() is None, "the list read (and its text) outlive the filtered value"
        assert json.loads(done.body)["result"]["tools"] == [{"name": n} for n in names if allowed(n)]
