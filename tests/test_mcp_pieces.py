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
