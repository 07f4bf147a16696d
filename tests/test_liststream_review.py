"""Review of the streamed list filter (branch ``review-ls``): an item that names its judged field twice, a judge
that fails mid-piece, an item full of closing braces read in small pieces."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tether.proxy import liststream, mcp, streamlayer

from .test_liststream import agrees, buffered, chunked

HIDDEN = "delete_everything"


@pytest.mark.parametrize("item", [
    '{"name": "delete_everything", "name": "add"}',  # a client that keeps the first key reads the hidden name
    '{"na\\u006de": "delete_everything", "name": "add"}',
    '{"name": "add", "description": "x", "name": "add", "name\\u0000": 1}',
    '{"name"\n  :\t"delete_everything", "inputSchema": {"name": {}}, "name": "add"}',
    '{"\\u006e\\u0061me": "delete_everything", "name": "add"}',
    '{"name": "delete_everything", "n\\u0061m\\u0065": "add"}',
])
def test_an_item_that_names_its_field_twice_never_passes(item: str) -> None:
    body = ('{"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "send_email"}, ' + item + ']}}').encode()
    want = buffered(body)
    assert want[0] == "passed" and want[2] == 1, want  # removed by the buffered filter
    assert json.loads(want[1])["result"]["tools"] == [{"name": "send_email"}]
    for edges in ([], list(range(0, len(body), 7))):
        assert agrees(body, chunked(body, edges)) == want  # and by the stream, the same bytes


def test_an_item_that_names_another_key_twice_passes_as_the_server_wrote_it() -> None:
    body = b'{"id": 1, "result": {"tools": [{"name": "add", "d": 1, "d": 2}, {"name": "slow"}]}}'
    want = buffered(body)
    assert want[0] == "passed" and want[2] == 1 and b'"d": 1, "d": 2' in want[1]
    assert agrees(body, [body]) == want


def test_a_kept_sampling_tool_that_names_its_field_twice_is_removed() -> None:
    value = mcp.loads_pieces('{"id": 1, "method": "sampling/createMessage", "params": {"tools": '
                             '[{"name": "delete_everything", "name": "add"}, {"name": "add"}]}}')
    value, removed = mcp.filter_lists_message(value, lambda name: name == "add")
    assert removed == 1 and value["params"]["tools"] == [{"name": "add"}]


@pytest.mark.parametrize("head", [b'{"id": 1, "result": {"tools": [{"name": "add"}, ',
                                  b'{"id": 1, "result": {"tools": ['])
def test_a_judge_that_fails_mid_piece_refuses_the_answer_and_never_reads_the_piece_twice(head: bytes) -> None:
    """The hook's failure is logged and swallowed (``pipeline._finish``); the stream step then judges the piece
    itself (``streamlayer``): the piece must not be read twice on a half-advanced reader, and a judge that cannot
    decide must not let the answer go on (fail closed)."""
    calls: list[str] = []

    def judge(name: str) -> bool:
        calls.append(name)
        if name == "boom" and calls.count("boom") == 1:
            raise RuntimeError("the catalog failed")
        return name in ("add", "boom")

    held = streamlayer.StreamedList(liststream.JsonListStream(judge))
    out = b""
    pieces = (head, b'{"name": "boom"}, {"name": "x"}, ', b'{"name": "add"}]}}')
    for n, piece in enumerate(pieces):
        held.judged, held.next = None, (piece, False)
        try:
            asyncio.run(held.judge(piece, False))
        except RuntimeError:
            pass  # as tether's pipeline does with a failing hook
        got, failed = held.judged if held.judged is not None else held.run(piece, False)
        if isinstance(failed, liststream.Fallback):  # nothing passed: every byte, once, for the buffered filter
            assert out == b"" and held.stream.raw is not None
            assert b"".join(held.stream.raw + list(pieces[n + 1:])) == b"".join(pieces)
            return
        if failed is not None:
            assert isinstance(failed, liststream.Cut) and out and held.run(b"", True)[1] is not None
            return  # cut, and never judged again
        out += got
    out += held.stream.finish()
    pytest.fail(f"a judge that failed did not stop the answer: {out!r} (judged {calls})")


class _Counting:
    """``json.JSONDecoder`` counting the characters each ``raw_decode`` starts before."""

    def __init__(self) -> None:
        self.read = 0
        self.inner = json.JSONDecoder()

    def raw_decode(self, s: str, idx: int = 0) -> tuple[Any, int]:
        self.read += len(s) - idx
        return self.inner.raw_decode(s, idx)


@pytest.mark.parametrize("size", [1 << 20, 48 << 10])
def test_an_item_full_of_closing_braces_is_not_read_again_per_piece(size: int, monkeypatch: Any) -> None:
    """Each small piece of a large item brings a ``}`` (an inputSchema's nested objects): a try per piece is
    quadratic in the item (a 1 MB item in 4 KiB pieces: ~130 MB parsed on the event loop, pieces under
    ``THREAD_BYTES`` are judged there)."""
    schema = '{"a": {}}, ' * (size // 11)
    body = ('{"id": 1, "result": {"tools": [{"name": "add", "inputSchema": [' + schema + '{}]}, '
            + '{"name": "slow"}]}}').encode()
    counting = _Counting()
    monkeypatch.setattr(liststream, "_DECODER", counting)
    for piece in (4096, 512):
        counting.read = 0
        pieces = chunked(body, list(range(0, len(body), piece)))
        assert agrees(body, pieces) == buffered(body)
        assert counting.read < 8 * len(body), (piece, counting.read / len(body))


def test_the_piece_that_ends_a_large_item_is_judged_off_the_event_loop(monkeypatch: Any) -> None:
    """A large item dribbled in small pieces is parsed whole when its last (small) piece arrives: that parse (and
    that of every other unread text) belongs in the worker thread, not on the sidecar's event loop."""
    body = b'{"id": 1, "result": {"tools": [{"name": "add", "description": "' + b"d" * (2 << 20) + b'"}]}}'
    threaded: list[int] = []
    real = asyncio.to_thread

    async def to_thread(func: Any, *args: Any) -> Any:
        threaded.append(held.stream.pending_chars() + len(args[0]))
        return await real(func, *args)

    monkeypatch.setattr(asyncio, "to_thread", to_thread)
    held = streamlayer.StreamedList(liststream.JsonListStream(lambda name: name == "add"))
    out = b""
    for piece in chunked(body, list(range(0, len(body), 16384))):
        asyncio.run(held.judge(piece, False))
        assert held.judged is not None and held.judged[1] is None
        out += held.judged[0]
        if out and not threaded:
            pytest.fail("the 2 MB item was parsed on the event loop")
    assert threaded and json.loads(out + held.stream.finish())["result"]["tools"][0]["name"] == "add"
