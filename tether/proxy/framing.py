"""HTTP/1 framing mitmproxy does not handle: trailer fields of a chunked body, and answering before the body.

Trailers. mitmproxy 12's HTTP/1 layer raises ``NotImplementedError`` when a chunked body ends in trailer fields (a
request's or a response's): a traceback in the sidecar's log and a connection left hanging. RFC 9112 section
7.1.2 lets a recipient that removes the chunked coding discard trailers, and tether does: the body goes on
(re-chunked or not, as mitmproxy frames it), its trailers stop at the sidecar. Forwarding them would also let
a server that merges trailers into its headers read fields tether never decided on (an override header after
the body). ``discard_trailers()`` wraps the body reader mitmproxy makes for every HTTP/1 message.

Answering before the body. mitmproxy reads a request's whole body before it sends an answer an addon set at the
headers. Two answers must not wait for it (``answer_early()``):

* a request refused at its headers that sent ``Expect: 100-continue`` (RFC 9110 10.1.1): tether sends no 100
  (the body is not wanted), so the client waits (curl a second, some clients their whole timeout) before it sends
  the body the refusal then waits for. An addon marks such a flow (``ANSWER_BEFORE_BODY``) and it is answered at
  once;
* a body that must be read whole but passes a limit on the way (an approval-tier body past the approval limit,
  chunked so its length was not known at the headers): an addon gives the flow a ``BodyLimit``; as soon as the
  body read passes it, ``BodyLimit.refuse`` sets the answer, which is sent at once, and nothing more is read.

Either way the answer carries ``Connection: close``: what the client still sends of the body is read and
dropped (never kept), and the connection closes when the body ends or the client closes it. Closing at once
instead would reset a connection whose client is still writing, and the client could lose the answer. HTTP/1
only: an HTTP/2 or HTTP/3 request keeps mitmproxy's order (the body is read, then the answer sent).

Large bodies in bulk. A large body's cost in mitmproxy is the number of trips its bytes make through the layer
stack and the copies made on the way, not the bytes: ``bulk_transfers()`` (bench/bench_stream.py, bench/RESULTS.md
"Streams") changes three things, none of what passes or in what order:

* each read of a connection takes what has arrived, up to ``BULK_READ`` (1 MiB), where mitmproxy takes 64 KiB:
  a 200 MiB body is 200 or more events, not 3,200 (a read never waits for more than is there, so small exchanges
  are unchanged). The connection's reader then buffers up to twice that before it stops reading the socket
  (mitmproxy's 128 KiB): at most 2 MiB in flight per connection;
* h11's receive buffer, from which the HTTP/1 layer extracts a body, hands over its whole content without copying
  it twice when the body takes all of it (``maybe_extract_at_most``, the body readers' one way in).

A streamed body nobody inspects does not even take that path past its first piece: ``relay.py`` moves it from
socket to socket. mitmproxy's TLS layer still sends what it encrypted 64 KiB at a time: joining it into one write
was tried and cost more than it saved (a 1 MiB buffer allocated per read of OpenSSL's memory BIO, and a copy;
HTTPS uploads 0.6x as fast in bench/bench_stream.py; ``relay.py`` reads the BIO into one buffer it keeps).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import h11
from h11._receivebuffer import ReceiveBuffer
from mitmproxy import http
from mitmproxy.proxy import server as proxy_server
from mitmproxy.proxy.layers import http as http_layer
from mitmproxy.proxy.layers.http import _http1

log = logging.getLogger("tether.sidecar")

ANSWER_BEFORE_BODY = "tether.answer_before_body"  # flow.metadata: the answer set at the headers goes at once
BODY_LIMIT = "tether.body_limit"  # flow.metadata: a BodyLimit on the body read whole
BULK_READ = 1 << 20  # bytes: the most one read of a connection hands mitmproxy's layers (bulk_transfers())


class TrailerlessReader:
    """One of h11's body readers, whose end of message never carries trailer fields."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def __call__(self, buf: Any) -> Any:
        event = self.reader(buf)
        if isinstance(event, h11.EndOfMessage) and event.headers:
            names = sorted({name.decode("latin-1") for name, _ in event.headers})
            log.info("discarded the trailer fields %s of a chunked body (trailers are not forwarded)", names)
            return h11.EndOfMessage()
        return event

    def read_eof(self) -> Any:
        return self.reader.read_eof()


def discard_trailers() -> None:
    """Make every HTTP/1 body reader of this process discard trailers (idempotent)."""
    make = _http1.make_body_reader
    if getattr(make, "discards_trailers", False):
        return

    def make_body_reader(expected_size: int | None) -> Any:
        return TrailerlessReader(make(expected_size))

    make_body_reader.discards_trailers = True  # type: ignore[attr-defined]
    _http1.make_body_reader = make_body_reader


@dataclass(frozen=True, slots=True)
class BodyLimit:
    """At most ``limit`` bytes of this request's body are read; past them ``refuse(flow)`` sets the answer."""

    limit: int
    refuse: Callable[[http.HTTPFlow], None]


def no_continue(flow: http.HTTPFlow) -> None:
    """A request refused at its headers that waits for ``100 Continue`` gets none (mitmproxy sends one after the
    hook while the header is there: the body is not wanted) and is answered at once, not once the client gives up
    waiting and sends the body anyway."""
    if flow.request.headers.get("expect", "").strip().lower() == "100-continue":
        del flow.request.headers["expect"]
        flow.metadata[ANSWER_BEFORE_BODY] = True


def _answer_now(stream: Any) -> Generator[Any, Any, None]:
    """Send the answer an addon set on ``stream.flow`` without waiting for (the rest of) the request body."""
    flow = stream.flow
    assert flow.response is not None
    stream.request_body_buf.clear()
    flow.request.data.content = b""  # what was read of a body nobody will see is not kept either
    flow.request.timestamp_end = time.time()
    flow.response.headers["connection"] = "close"
    stream.client_state = stream.state_errored  # what the client still sends of its body is dropped
    yield http_layer.HttpRequestHook(flow)  # the addons see the request end as they would after its body
    flow.response.timestamp_start = time.time()
    yield http_layer.HttpResponseHeadersHook(flow)
    yield from stream.send_response()
    yield from stream.flow_done()  # the HTTP/1 connection reads the body's rest, then closes (Connection: close)


def _http1_flow(stream: Any) -> bool:
    request = stream.flow.request if stream.flow is not None else None
    return request is not None and not (request.is_http2 or request.is_http3)


def answer_early() -> None:
    """Make mitmproxy's HTTP layer answer marked flows before their body (see the module docstring); idempotent."""
    stream_cls = http_layer.HttpStream
    if getattr(stream_cls, "tether_answers_early", False):
        return
    headers_state = stream_cls.state_wait_for_request_headers
    body_state = stream_cls.state_consume_request_body

    def state_wait_for_request_headers(self: Any, event: Any) -> Generator[Any, Any, None]:
        yield from headers_state(self, event)
        flow = self.flow
        if (flow is not None and flow.response is not None and flow.metadata.get(ANSWER_BEFORE_BODY)
                and self.client_state == self.state_consume_request_body and _http1_flow(self)):
            yield from _answer_now(self)

    def state_consume_request_body(self: Any, event: Any) -> Generator[Any, Any, None]:
        yield from body_state(self, event)
        flow = self.flow
        bound = flow.metadata.get(BODY_LIMIT) if flow is not None else None
        if (isinstance(bound, BodyLimit) and isinstance(event, http_layer.RequestData) and flow.response is None
                and self.client_state == self.state_consume_request_body and len(self.request_body_buf) > bound.limit
                and _http1_flow(self)):
            log.info("refusing %s %s: its body passed %d bytes while it was read", flow.request.method,
                     flow.request.pretty_url, bound.limit)
            bound.refuse(flow)
            if flow.response is not None:
                yield from _answer_now(self)

    stream_cls.state_wait_for_request_headers = state_wait_for_request_headers  # type: ignore[method-assign]
    stream_cls.state_consume_request_body = state_consume_request_body  # type: ignore[method-assign]
    stream_cls.tether_answers_early = True  # type: ignore[attr-defined]


def read_in_bulk(reader: asyncio.StreamReader, size: int = BULK_READ) -> None:
    """Make ``reader.read(n)`` return what is buffered up to ``size`` bytes, whatever smaller ``n`` it is asked for;
    its transport pauses at ``2 * size`` bytes buffered (asyncio's high-water mark is twice the limit)."""
    if getattr(reader, "tether_reads_in_bulk", False):
        return
    reader._limit = max(reader._limit, size)
    read = reader.read

    async def read_bulk(n: int = -1) -> bytes:
        return await read(size if 0 < n < size else n)

    reader.read = read_bulk  # type: ignore[method-assign]
    reader.tether_reads_in_bulk = True  # type: ignore[attr-defined]


def _bulk_reads(size: int) -> None:
    """Every TCP connection mitmproxy handles reads in pieces of up to ``size`` bytes. UDP and other readers
    (``mitmproxy_rs`` streams) are left as they are."""
    handler_cls = proxy_server.ConnectionHandler
    handle_connection = handler_cls.handle_connection

    async def handle_in_bulk(self: Any, connection: Any) -> None:
        io = self.transports.get(connection)
        if io is not None and isinstance(io.reader, asyncio.StreamReader):
            read_in_bulk(io.reader, size)
        await handle_connection(self, connection)

    handler_cls.handle_connection = handle_in_bulk  # type: ignore[method-assign]


def _extract_whole_buffers() -> None:
    """h11's ``maybe_extract_at_most`` slices its buffer once to test it is not empty and again to extract: when
    the count covers the whole buffer, the buffer itself is handed over (a new, empty one takes its place)."""
    extract = ReceiveBuffer.maybe_extract_at_most

    def maybe_extract_at_most(self: ReceiveBuffer, count: int) -> bytearray | None:
        data = self._data
        if count <= 0 or not data or count < len(data):
            return extract(self, count)
        self._data = bytearray()
        self._next_line_search = 0
        self._multiple_lines_search = 0
        return data

    ReceiveBuffer.maybe_extract_at_most = maybe_extract_at_most  # type: ignore[method-assign]


def bulk_transfers(size: int = BULK_READ) -> None:
    """Large bodies pass mitmproxy in pieces of up to ``size`` bytes with fewer copies (the module docstring);
    idempotent, for this process."""
    if getattr(proxy_server.ConnectionHandler, "tether_bulk_transfers", False):
        return
    _bulk_reads(size)
    _extract_whole_buffers()
    proxy_server.ConnectionHandler.tether_bulk_transfers = True  # type: ignore[attr-defined]
