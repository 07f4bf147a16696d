"""A whole list answer is parsed away from the event loop (``mcp.read_answer``, in a worker thread) and filtered on
it (``mcp.filter_answer``). The parse reads long arrays element by element (``mcp.loads_pieces``) so the thread
hands the GIL back to the loop between elements; it must read every text exactly as ``json.loads`` does (the same
value, the same refusals), and the filter must pass exactly what the streaming filter passes. What it does for
other calls' latency is measured in ``bench/bench_tools_list.py``, not here."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.proxy import mcp

from .test_sse_linear import allowed, as_read, listing, run, stream

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner, max_size=5),
    max_leaves=40)


def outcome(parse: Any, text: str | bytes) -> Any:
    try:
        return ("value", parse(text))
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both
        return ("refused",)


@settings(max_examples=300, deadline=None)
@given(value=JSON, indent=st.sampled_from([None, 0, 2, "\t"]), cut=st.integers(0, 1 << 12),
       junk=st.sampled_from(["", ",", "]", "}", ":", "x", " ", '"', "{", "["]))
def test_pieces_read_every_text_as_json_loads_does(value: Any, indent: Any, cut: int, junk: str) -> None:
    text = json.dumps(value, indent=indent)
    assert mcp.loads_pieces(text) == json.loads(text)
    assert mcp.loads_pieces(text.encode("utf-16")) == json.loads(text.encode("utf-16"))
    at = cut % (len(text) + 1)
    broken = text[:at] + junk + text[at + 1:]  # a byte replaced, removed or added: refused by both, or read alike
    assert outcome(mcp.loads_pieces, broken) == outcome(json.loads, broken)


@pytest.mark.parametrize("text", ["NaN", "[Infinity, -Infinity]", '{"a": 1, "a": 2}', "\ufeff{}", b"\xef\xbb\xbf{}",
                                  b'{"a": "\xff"}', "", "  ", '{"a": 1} {}', "[1,]", '{"a" 1}'])
def test_pieces_agree_with_json_loads_on_the_edges(text: str | bytes) -> None:
    got, want = outcome(mcp.loads_pieces, text), outcome(json.loads, text)
    assert repr(got) == repr(want)  # repr: NaN is not equal to itself


def test_a_batch_answer_s_lists_are_read_element_by_element() -> None:
    batch = [listing(1, [f"t{i}" for i in range(100)]), {"jsonrpc": "2.0", "id": 2, "result": {}}]
    assert mcp.loads_pieces(json.dumps(batch)) == batch


@settings(max_examples=100, deadline=None)
@given(eols=st.lists(st.integers(0, 2), min_size=1, max_size=12))
def test_a_whole_sse_answer_filters_as_the_stream_filter_does(eols: list[int]) -> None:
    body = stream(eols)
    streamed = mcp.SseListsFilter(allowed)
    expected = run(streamed, [body])
    out, removed, seen = mcp.filter_answer(mcp.read_answer(body, sse=True), allowed)
    assert as_read(out) == as_read(expected)
    assert (removed, seen.dropped, seen.answered) == (streamed.removed, streamed.dropped, streamed.answered)


def test_a_whole_json_answer_filters_as_the_json_filter_does() -> None:
    body = json.dumps(listing(5, ["add", "delete_everything", "send_email"])).encode()
    out, removed, _ = mcp.filter_answer(mcp.read_answer(body, sse=False), allowed)
    assert (out, removed) == mcp.filter_json_body(body, allowed)
    untouched = json.dumps(listing(6, ["add"])).encode()
    assert mcp.filter_answer(mcp.read_answer(untouched, sse=False), allowed)[:2] == (untouched, 0)
    with pytest.raises(mcp.Unreadable):
        mcp.read_answer(b"{not json", sse=False)


# -- kept items are written back as the server wrote them (not encoded again) ----------------------------------
def tool_text(name: str, style: int) -> str:
    """A tool as servers spell them: json.dumps's spacing, none, pretty-printed, characters unescaped or escaped."""
    tool = {"name": name, "description": "caf\u00e9 \u2215 \\ \"q\"", "inputSchema": {"type": "object"}}
    return [json.dumps(tool), json.dumps(tool, separators=(",", ":"), ensure_ascii=False),
            json.dumps(tool, indent=2), '{"description": "\\u00e9\\ud800", "name" : "' + name + '"}'][style % 4]


@settings(max_examples=200, deadline=None)
@given(tools=st.lists(st.tuples(st.sampled_from(["add", "send_email", "delete_everything", "slow", "a\u00e9"]),
                                st.integers(0, 3)), max_size=12),
       sse=st.booleans(), spacing=st.sampled_from(["", " ", "\n  "]))
def test_a_filtered_list_holds_the_kept_items_as_written_and_nothing_else(tools: list[tuple[str, int]], sse: bool,
                                                                         spacing: str) -> None:
    texts = [tool_text(name, style) for name, style in tools]
    payload = ('{"jsonrpc": "2.0", "id": 7, "result": {"tools": [' + spacing + ("," + spacing).join(texts) + spacing
               + '], "nextCursor": "c\u00e9"}}')
    body = (b"event: message\ndata: " + payload.replace("\n", "\ndata: ").encode() + b"\n\n") if sse \
        else payload.encode()
    out, removed, _ = mcp.filter_answer(mcp.read_answer(body, sse), allowed)
    want, want_removed = mcp.filter_lists_message(json.loads(payload), allowed)
    assert removed == want_removed == sum(name not in mcp_granted() for name, _ in tools)
    if not removed:
        assert out == body  # nothing hidden: the answer passes as it came
    if sse:
        lines = [line for line in out.split(b"\n") if line]
        assert lines[0] == b"event: message" and (len(lines) == 2 or not removed), "one data line, no line end in it"
        data = b"\n".join(line.removeprefix(b"data: ") for line in lines[1:])
        got = json.loads(data.decode("utf-8", "surrogatepass"))
    else:
        got = json.loads(out.decode("utf-8", "surrogatepass"))
    assert got == want  # what the client reads is the filtered list, whatever was re-used
    # A data line cannot hold a line end: an SSE list with a kept item spelled over lines is encoded afresh.
    afresh = sse and any("\n" in tool_text(name, style) for name, style in tools if name in mcp_granted())
    for name, style in tools:
        if name not in mcp_granted():
            assert f'"{name}"'.encode() not in out
        elif removed and not afresh:
            assert tool_text(name, style).encode("utf-8", "surrogatepass") in out  # kept as it was written


def mcp_granted() -> set[str]:
    return {name for name in ("add", "send_email", "delete_everything", "slow", "a\u00e9") if allowed(name)}


def test_a_list_named_twice_is_filtered_as_read_and_the_first_spelling_never_passes() -> None:
    """JSON keeps the last of a repeated key: the list read is the second; nothing of the first may pass."""
    first, second = tool_text("delete_everything", 0), tool_text("add", 1) + ", " + tool_text("slow", 2)
    body = ('{"jsonrpc": "2.0", "id": 1, "result": {"tools": [' + first + '], "tools": [' + second + ']}}').encode()
    out, removed, _ = mcp.filter_answer(mcp.read_answer(body, sse=False), allowed)
    assert removed == 1 and b"delete_everything" not in out and b"slow" not in out
    assert json.loads(out) == {"jsonrpc": "2.0", "id": 1, "result": {"tools": [json.loads(tool_text("add", 1))]}}
    assert tool_text("add", 1).encode() in out


def test_a_server_request_s_offered_tools_keep_their_text_too() -> None:
    """``sampling/createMessage`` params.tools, filtered the same way: the hidden tool gone, the kept as sent."""
    kept, hidden = tool_text("send_email", 1), tool_text("delete_everything", 3)
    body = ('{"jsonrpc": "2.0", "id": 3, "method": "sampling/createMessage", "params": {"messages": [], '
            '"tools": [' + hidden + ", " + kept + "]}}").encode()
    out, removed, _ = mcp.filter_answer(mcp.read_answer(body, sse=False), allowed)
    assert removed == 1 and b"delete_everything" not in out and kept.encode() in out
    assert json.loads(out)["params"]["tools"] == [json.loads(kept)]
