"""A list answer whose text a client could read differently from the filter never shows it a hidden item.

JSON keeps the last of a key named twice; some clients keep the first. ``{"name": "hidden", "name": "granted"}``
is judged ``granted``, and a client keeping the first would list ``hidden``: such an item is removed
(``mcp.names_field_twice``). A message whose envelope names a key twice (two ``tools`` lists, two results) is written
from what the filter judged (``mcp.ReadAnswer.twice``), its kept items as the server wrote them. In every path: a whole
JSON answer, a batch, a whole SSE answer, an SSE stream, and the JSON list filtered as it arrives (``liststream``,
which writes the whole-answer filter's bytes, and falls back to it for an envelope naming a key twice).
"""

from __future__ import annotations

import json

import pytest

from tether.proxy import liststream, mcp

from .test_liststream import agrees, chunked

GRANTED = {"add", "send_email", "a\u00e9"}  # test_liststream's

TWO_WAYS = {
    "an item naming its name twice": '{"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "slow", '
                                     '"description": "hidden", "name": "add"}]}}',
    "the second spelled with an escape": '{"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "slow", '
                                         '"na\\u006de": "add"}]}}',
    "two tools lists": '{"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "slow"}], '
                       '"tools": [{"name": "add"}]}}',
    "two results": '{"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "slow"}]}, '
                   '"result": {"tools": [{"name": "add"}]}}',
    "a batch": '[{"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "slow", "name": "add"}]}}]',
}


def first_wins(text: str | bytes) -> object:
    """How a client that keeps the first of a key reads a JSON text."""
    def first(pairs: list[tuple[str, object]]) -> dict[str, object]:
        out: dict[str, object] = {}
        for key, value in pairs:
            out.setdefault(key, value)
        return out
    return json.loads(text, object_pairs_hook=first)


def names(value: object) -> set[str]:
    """Every tool name anywhere in a decoded value."""
    if isinstance(value, list):
        return set().union(*(names(v) for v in value)) if value else set()
    if isinstance(value, dict):
        own = {value["name"]} if isinstance(value.get("name"), str) else set()
        return own.union(*(names(v) for v in value.values()))
    return set()


def allowed(name: str) -> bool:
    return name in GRANTED


@pytest.mark.parametrize("shape", sorted(TWO_WAYS))
def test_a_whole_json_answer_read_two_ways_is_written_from_what_was_judged(shape: str) -> None:
    body = TWO_WAYS[shape].encode()
    assert "slow" in names(first_wins(body))  # what the server's own text shows a first-wins client
    out = mcp.filtered(mcp.read_answer(body, False), allowed).body
    assert b"slow" not in out and b"hidden" not in out
    assert names(first_wins(out)) == names(json.loads(out)) <= GRANTED


@pytest.mark.parametrize("shape", sorted(TWO_WAYS))
def test_an_sse_answer_read_two_ways_is_written_from_what_was_judged_whole_and_streamed(shape: str) -> None:
    body = b"event: message\ndata: " + TWO_WAYS[shape].encode() + b"\n\n"
    whole = mcp.filtered(mcp.read_answer(body, True), allowed).body
    stream = mcp.SseListsFilter(allowed)
    streamed = b"".join([*stream(body[:30]), *stream(body[30:]), *stream(b"")])
    for out in (whole, streamed):
        assert b"slow" not in out and b"hidden" not in out
        data = out.split(b"data: ", 1)[1].strip()
        assert names(first_wins(data)) == names(json.loads(data)) <= GRANTED


def big(items: list[str]) -> bytes:
    filler = [json.dumps({"name": "add", "description": "x" * 2000}) for _ in range(40)]  # past STREAM_FROM
    return ('{"jsonrpc": "2.0", "id": 1, "result": {"tools": [' + ", ".join(items + filler) + ']}}').encode()


def test_a_streamed_list_with_an_item_read_two_ways_removes_it_as_the_whole_answer_filter_does() -> None:
    twice = '{"name": "slow", "description": "hidden", "name": "add"}'
    escaped = '{"na\\u006de": "slow", "description": "hidden", "name": "add"}'
    for items in ([twice], ['{"name": "add"}', twice], [escaped, '{"name": "send_email"}']):
        body = big(items)
        assert len(body) > liststream.STREAM_FROM
        for edges in ([200, *range(4096, len(body), 4096)], list(range(0, len(body), 1000))):
            got = agrees(body, chunked(body, edges))  # byte for byte the whole-answer filter's
            assert got[0] == "passed" and b"slow" not in got[1] and b"hidden" not in got[1]
            assert names(first_wins(got[1])) <= GRANTED and got[2] == 1


def test_an_item_naming_another_key_twice_is_not_removed() -> None:
    body = b'{"jsonrpc":"2.0","id":1,"result":{"tools":[{"name":"add","title":"a","title":"b"}]}}'
    assert mcp.filtered(mcp.read_answer(body, False), allowed).body == body


def test_an_answer_read_one_way_still_passes_as_the_server_wrote_it() -> None:
    body = b'{"jsonrpc":"2.0","id":1,"result":{"tools":[{"name":"add","description":"name name"}]}}'
    assert mcp.filtered(mcp.read_answer(body, False), allowed).body == body
