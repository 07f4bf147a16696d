"""mitmproxy's side of a list answer filtered as it arrives (``liststream``; issue 23 item 6).

mitmproxy sends a streamed answer's headers as soon as its ``responseheaders`` hook returns, and hands each piece
of the body to ``flow.response.stream``, a function that must answer at once. ``stream_lists()`` changes two steps
of its HTTP stream for an answer whose ``stream`` is a ``StreamedList`` (every other answer is untouched):

* each piece is judged through a hook of tether's own (``ListPieceHook``, answered by ``ListPieces``, a stage of
  ``proxy.pipeline``): mitmproxy's stream waits for it as for any hook, the event loop does not, as a piece of
  ``THREAD_BYTES`` or more is judged in a worker thread (the items' C parse holds the interpreter an item at a
  time, so other calls go on between items); without the addon the step judges the piece itself;
* the headers wait for the first judged byte: until then the answer may still go to the buffered filter whole
  (``liststream.Fallback``: mitmproxy then reads it as any answer it holds, the response hook filters it), with
  the server's headers as they came. Once a byte passes they go, with no ``Content-Length`` (chunked on
  HTTP/1.1), as for any filtered stream;
* at the body's end the rest is judged (``finish``) and the final body is put on the flow for the response hook
  and the capture, as mitmproxy's ``store_streamed_bodies`` would; a failure after the first byte cuts the
  answer (``liststream.Cut``: mitmproxy's own way for an upstream that fails mid-answer, the agent's connection
  closed with the message's closing brace never sent).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from mitmproxy import http
from mitmproxy.proxy import commands
from mitmproxy.proxy.layers import http as http_layer
from mitmproxy.proxy.layers.http import (
    ErrorCode,
    ResponseData,
    ResponseEndOfMessage,
    ResponseHeaders,
    ResponseProtocolError,
    ResponseTrailers,
    SendHttp,
)
from mitmproxy.proxy.utils import expect

from .liststream import Cut, Fallback, JsonListStream

log = logging.getLogger("tether.sidecar")


class StreamedList:
    """``flow.response.stream`` for a list answer filtered as it arrives. Not a function mitmproxy may call: only
    the steps ``stream_lists`` installs read it."""

    def __init__(self, stream: JsonListStream) -> None:
        self.stream = stream
        self.fell_back = False
        self.headers_sent = False
        self.cut: str | None = None
        self.failed = False  # the reader raised what it should not (``run``)
        self.next: tuple[bytes, bool] | None = None  # the piece to judge, and whether it is the end
        self.judged: tuple[bytes, Exception | None] | None = None  # what it gave (``judge``)

    def run(self, piece: bytes, final: bool) -> tuple[bytes, Exception | None]:
        if self.failed:  # a failed judge left the reader half-advanced: the piece is never read twice
            return b"", Cut(self.stream.reason)
        try:
            return (self.stream.finish() if final else self.stream.feed(piece)), None
        except (Fallback, Cut) as exc:
            return b"", exc
        except Exception as exc:  # a judge that cannot decide refuses (fail closed): filtered whole, or cut
            self.failed = True
            self.stream.reason = f"the filter failed: {exc!r}"
            return b"", (Cut if self.stream.sent else Fallback)(self.stream.reason)

    async def judge(self, piece: bytes, final: bool) -> None:
        """Judge a piece away from the event loop when it is large (the hook ``ListPieceHook`` starts)."""
        # a small piece may end a large item (read whole then), so what waits unread counts as well as the piece
        if len(piece) + self.stream.pending_chars() >= THREAD_BYTES:
            self.judged = await asyncio.to_thread(self.run, piece, final)
        else:
            self.judged = self.run(piece, final)

    def __call__(self, chunk: bytes) -> list[bytes]:
        raise RuntimeError("a StreamedList is read by tether's stream steps only (streamlayer.stream_lists)")


THREAD_BYTES = 64 * 1024  # a piece from this size on is judged in a worker thread


@dataclass
class ListPieceHook(commands.StartHook):
    """A piece of a streamed list answer to judge (``StreamedList.judge``): the stream waits for it, the event
    loop does not (other calls go on while a worker thread parses the piece's items)."""

    name = "tether_list_piece"
    flow: http.HTTPFlow  # its ``response.stream`` (a ``StreamedList``) holds the piece (``next``)


class ListPieces:
    """The addon that answers ``ListPieceHook`` (one stage of ``proxy.pipeline``)."""

    def tether_list_piece(self, flow: http.HTTPFlow) -> Any:
        held = flow.response.stream if flow.response is not None else None
        if isinstance(held, StreamedList) and held.next is not None:
            return held.judge(*held.next)
        return None


def installed() -> bool:
    return bool(getattr(http_layer.HttpStream, "tether_list_stream", False))


def stream_lists() -> None:
    """Install the two steps (the module docstring); idempotent, for this process."""
    cls = http_layer.HttpStream
    if installed():
        return
    start, body = cls.start_response_stream, cls.state_stream_response_body

    def start_response_stream(self: Any) -> Any:
        if isinstance(self.flow.response.stream, StreamedList):
            self.server_state = self.state_stream_response_body  # the headers wait for the first judged byte
            return
        yield from start(self)

    @expect(ResponseData, ResponseTrailers, ResponseEndOfMessage)
    def state_stream_response_body(self: Any, event: Any) -> Any:
        resp = self.flow.response
        held = resp.stream if resp is not None else None
        if not isinstance(held, StreamedList):
            yield from body(self, event)
            return
        if isinstance(event, ResponseTrailers):
            resp.trailers = event.trailers  # sent after the response hook, as mitmproxy does
            return
        stream = held.stream
        final = isinstance(event, ResponseEndOfMessage)
        out, raw = b"", stream.raw
        if held.fell_back:
            if not final:
                assert stream.raw is not None
                stream.raw.append(event.data)
        else:
            held.judged, held.next = None, (b"" if final else event.data, final)
            yield ListPieceHook(self.flow)
            held.next = None
            if (yield from self.check_killed(True)) or self.flow.response is not resp:
                return  # killed or replaced while it was judged (cut by tether): nothing more of this answer
            out, failed = held.judged if held.judged is not None else held.run(b"" if final else event.data, final)
            if isinstance(failed, Fallback):
                held.fell_back = True
                log.info("a list answer from %s is filtered whole: %s", self.flow.request.pretty_url, stream.reason)
            elif isinstance(failed, Cut):
                held.cut = stream.reason
                log.warning("cutting a list answer from %s: %s", self.flow.request.pretty_url, stream.reason)
                yield from self.handle_protocol_error(ResponseProtocolError(
                    self.stream_id, f"tether cut the list answer: {stream.reason}", ErrorCode.GENERIC_SERVER_ERROR))
                return
        if final and (held.fell_back or not held.headers_sent):
            # Nothing passed: the answer is read as any answer mitmproxy holds (the response hook filters it).
            assert raw is not None
            resp.stream = False
            resp.data.content = b"".join(raw)
            stream.raw = None
            yield from self.send_response()
            return
        if out:
            if not held.headers_sent:
                held.headers_sent = True
                resp.headers.pop("content-length", None)
                if self.flow.request.http_version == "HTTP/1.1" and "transfer-encoding" not in resp.headers:
                    resp.headers["transfer-encoding"] = "chunked"
                yield SendHttp(ResponseHeaders(self.stream_id, resp, end_stream=False), self.context.client)
            yield SendHttp(ResponseData(self.stream_id, out), self.context.client)
        if final:
            resp.data.content = stream.body()  # the final body, for the response hook and the capture
            yield from self.send_response(already_streamed=True)

    cls.start_response_stream = start_response_stream  # type: ignore[method-assign]
    cls.state_stream_response_body = state_stream_response_body  # type: ignore[method-assign]
    cls.tether_list_stream = True  # type: ignore[attr-defined]


def is_streamed_list(resp: http.Response | None) -> bool:
    return resp is not None and isinstance(resp.stream, StreamedList)
