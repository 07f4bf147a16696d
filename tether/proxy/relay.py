"""A body nobody inspects goes straight from one socket to the other (issue 28 item 4).

mitmproxy passes every piece of a streamed body through its layer stack and copies it several times on the way
(``tether/proxy/framing.py``, ``bulk_transfers()``, made the pieces larger). Once tether has decided a call, the
answer's headers are through and its body is one tether neither filters nor reads whole, nothing needs to see the
rest of that body but a counter: ``direct_relay()`` then moves it between the two connections' sockets with
``splice(2)`` (through a pipe, in the kernel: the bytes never enter Python), for its ``Content-Length`` or, for an
answer delimited by the upstream closing the connection, up to that close. Both ways: a streamed upload with a
``Content-Length`` goes to the upstream the same way.

Chunked bodies (both ways; ``relay_chunked`` plaintext on both sides, ``relay_chunked_tls`` from a TLS source, to
either). mitmproxy sends a chunked message on
chunked, every piece it passes a chunk of its own, so the sink is always between chunks when the relay starts: the
source's bytes from there on pass as they are, framing included. The relay reads only the chunk-size lines and the
CRLF closing each chunk (``scan_chunks``, peeking at the socket: nothing leaves the source until it is known to be
framing or data) and splices runs of whole chunks, or the rest of one chunk's data, at a time. It relays a
chunk-size line of hex digits alone, canonical and at most 7 of them (every upstream reads it as the relay does: a
longer size, which a server keeping 32 bits would read short, would let the chunk's data smuggle a request past
tether); the zero-size last chunk (with the trailer section, which tether discards:
``framing.py``), a line with an extension or anything else, and a malformed chunk end are left where they are and
the relay ends before them: mitmproxy's path (h11, whose reader is put where the source stands) reads, or refuses,
them as it always did, and sends the end. Started inside a chunk mitmproxy passed the start of, the relay first
sends the rest of it as a chunk of its own. What follows the body on the source (a pipelined request) is never
touched. From a TLS source the body is decrypted and encrypted in bulk as below, and the chunk-size lines are read
with ``SSL_peek``: what the relay leaves stays in OpenSSL for mitmproxy's TLS layer, handed an empty read after the
relay. A plaintext source with a TLS sink keeps mitmproxy's path (with ``bulk_transfers()``).

When. At every read of a connection, before it reads, the reader asks (``_leg``) whether the connection
carries a body in mid-stream that may be relayed: an HTTP/1 message on both sides, its stream plain
(``flow.response.stream is True``, or a capture's tee that has kept all it keeps: ``relayable()``), the layers
idle (no hook pending, nothing buffered in h11). What the connection's reader already holds of the body, and what
waits to be written to the other side, go first.
Anything else, or anything unexpected, keeps mitmproxy's path: relaying is an optimisation, never a decision.

How. Plaintext on both sides: ``splice(2)``. TLS on either side (mitmproxy terminates it with pyOpenSSL over
memory BIOs): the relay takes over the two connections' asyncio streams and the two TLS objects for the body's
length, decrypting into one buffer of 1 MiB with ``SSL_read`` and encrypting it with one ``SSL_write``, one socket
write per MiB (mitmproxy's TLS layer sends 64 KiB at a time, and every piece climbs its layer stack). A body
delimited by the close is relayed only when the upstream is plaintext (a TLS close is mitmproxy's to read).

What stays as it was. The layers see the body's end as they would have (the h11 reader is told the bytes it no
longer expects, then handed an empty read, and ends the message: mitmproxy's response hook, the call's report,
the capture's final state and its timing are what they were). A capture keeps the answer's first 1 MiB (taken
through mitmproxy's path before the relay starts) and the count of the rest. An abort (``cutting.py``) cancels the
connection handler's tasks, the relay among them, at its next wait: the sockets it holds (its own duplicates)
close at once, and the agent sees the cut. A failure to write to the other side ends the relay and hands the
connection back to mitmproxy's path, which sees the failure as it would have; an upstream that closes early is a
body cut short, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from h11._readers import ChunkedReader, ContentLengthReader, Http10Reader
from mitmproxy.proxy import events, tunnel
from mitmproxy.proxy import layer as proxy_layer
from mitmproxy.proxy import server as proxy_server
from mitmproxy.proxy.layers import http as http_layer
from mitmproxy.proxy.layers import tls as tls_layer
from mitmproxy.proxy.layers.http import _http1
from OpenSSL import SSL

log = logging.getLogger("tether.sidecar")

CHUNK = 1 << 20  # bytes: what one step of the TLS relay decrypts, encrypts and writes at most
PIPE_BYTES = 1 << 20  # the splice pipe's capacity (the default limit for an unprivileged process)
YIELD_EVERY = 16  # splices without a wait after which the relay lets the event loop run other work
RELAY_MIN = 64 << 10  # bytes: a smaller rest of a body is not worth the set-up
SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
CHUNK_PEEK = 64 << 10  # bytes: how much of a chunked body's source a look for its next chunk sizes peeks at
CHUNK_HEAD_MAX = 9  # bytes: the longest chunk-size line relayed (7 hex digits and CRLF; others: mitmproxy's)
CHUNK_SIZE_MAX = (1 << 28) - 1  # the largest chunk relayed (7 hex digits): no upstream's integer overflows on it
RELAYED = "tether.relayed_bytes"  # flow.metadata: how many of the body's bytes were relayed

_streams: dict[str, Any] = {}  # connection id -> the HttpStream whose body that connection is sending


@dataclass(frozen=True, slots=True)
class BodyLeft:
    """What a body reader still expects: ``count`` bytes, or (``count is None``) everything up to the close."""

    count: int | None


def body_left(reader: Any) -> BodyLeft | None:
    """The rest of the body an h11 reader (possibly wrapped, ``framing.TrailerlessReader``) expects, when it is
    framed so that it can be relayed unread: a Content-Length's rest, or up to the close. None otherwise."""
    inner = getattr(reader, "reader", reader)
    if isinstance(inner, ContentLengthReader):
        return BodyLeft(inner._remaining)
    if isinstance(inner, Http10Reader):
        return BodyLeft(None)
    return None


def taken(reader: Any, count: int) -> None:
    """Tell a Content-Length reader ``count`` of its bytes went past it."""
    inner = getattr(reader, "reader", reader)
    if isinstance(inner, ContentLengthReader):
        inner._remaining -= count


def chunk_reader(reader: Any) -> ChunkedReader | None:
    """The h11 chunked reader under ``reader`` (possibly wrapped), when it is between chunks or inside one's data
    (not reading the trailer section, not in the middle of a chunk's closing CRLF), with less of the chunk left
    than ``CHUNK_SIZE_MAX`` (the relay frames that rest as a chunk of its own): where a relay may start."""
    inner = getattr(reader, "reader", reader)
    if (isinstance(inner, ChunkedReader) and not inner._reading_trailer and not inner._bytes_to_discard
            and inner._bytes_in_chunk <= CHUNK_SIZE_MAX):
        return inner
    return None


# The agent's chunk-size lines reach the upstream as they are: only the canonical spelling of a size every parser
# holds (no leading zero, at most 7 digits) is relayed. A larger size, read by a server that keeps 32 bits of it,
# would end the chunk early and parse its data (a last chunk and a request tether never saw) as the next request.
_CHUNK_SIZE = re.compile(rb"[1-9A-Fa-f][0-9A-Fa-f]{0,6}")


@dataclass(frozen=True, slots=True)
class ChunkPos:
    """Where a relay stands in a chunked body: ``data_left`` bytes of the current chunk's data still to pass, then
    (``crlf``) the CRLF that closes it; neither: at the next chunk-size line."""

    data_left: int = 0
    crlf: bool = False


@dataclass(frozen=True, slots=True)
class ChunkScan:
    """What ``scan_chunks`` found: the first ``passable`` bytes of the window may pass as they are (``data`` of
    them the body's own bytes), leaving the relay at ``pos``; ``stop``: the relay ends there (the last chunk, or a
    chunk-size line it does not relay: an extension, a size too long), and mitmproxy's path reads what follows."""

    passable: int
    data: int
    pos: ChunkPos
    stop: bool


def scan_chunks(pos: ChunkPos, window: bytes | bytearray) -> ChunkScan:
    """Walk the chunked framing in ``window`` (the source's next bytes) from ``pos``. Only a chunk-size line of
    hex digits alone, canonical and at most ``CHUNK_SIZE_MAX`` (``_CHUNK_SIZE``), is relayed; the zero-size last
    chunk (with the trailer section, which tether discards: ``framing.py``), any other line, and a chunk's closing
    CRLF that is not one are left to mitmproxy's path (which reads or refuses them as it always did). Pure."""
    at, data, left, crlf, end = 0, 0, pos.data_left, pos.crlf, len(window)
    while True:
        if left:
            step = min(left, end - at)
            at, data, left = at + step, data + step, left - step
            if left:
                return ChunkScan(at, data, ChunkPos(left, crlf), False)
        if crlf:
            footer = window[at:at + 2]
            if footer != b"\r\n"[:len(footer)]:
                return ChunkScan(at, data, ChunkPos(0, True), True)  # malformed: h11 says so, as before
            if len(footer) < 2:
                return ChunkScan(at, data, ChunkPos(0, True), False)
            at, crlf = at + 2, False
        line_end = window.find(b"\r\n", at, at + CHUNK_HEAD_MAX)
        if line_end < 0:
            return ChunkScan(at, data, ChunkPos(), end - at >= CHUNK_HEAD_MAX)  # more to come, or not ours
        size_text = window[at:line_end]
        if not _CHUNK_SIZE.fullmatch(size_text) or int(size_text, 16) == 0:
            return ChunkScan(at, data, ChunkPos(), True)
        at, left, crlf = line_end + 2, int(size_text, 16), True


def plain_stream(stream: Any) -> bool:
    """A body stream setting that passes the bytes as they are and needs to see no more of them."""
    if stream is True:
        return True
    relayable = getattr(stream, "relayable", None)
    return callable(relayable) and bool(relayable())


@dataclass(slots=True)  # not frozen: it counts what the relay moved
class Leg:
    """One body to relay: from ``source`` (whose read asked) to ``sink``, with the layers that frame it."""

    stream: Any  # the HttpStream
    source: Any  # the connection the body comes from
    sink: Any  # the connection it goes to
    reader: Any  # the source's h11 body reader
    left: BodyLeft | None  # None: a chunked body (``chunks``)
    response: bool  # the answer's body (download), or the request's (upload)
    source_tls: Any = None  # the source's pyOpenSSL connection, when it speaks TLS
    sink_tls: Any = None
    chunks: ChunkedReader | None = None  # a chunked body's h11 reader
    taken: int = 0  # of the body's bytes, how many left the source
    given: int = 0  # and how many reached the sink: a relay that stops between the two lost some


def _layers(top: Any) -> tuple[list[Any], dict[str, Any]]:
    """The HTTP layers under ``top``, and the TLS layers by the id of the connection each speaks TLS on."""
    found: list[Any] = []
    tls: dict[str, Any] = {}
    todo, seen = [top], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, proxy_layer.NextLayer):
            todo.append(node.layer)
            continue
        if isinstance(node, tls_layer.TLSLayer):
            tls[node.conn.id] = node
        if isinstance(node, http_layer.HttpLayer):
            found.append(node)
            todo.extend(s.child_layer for s in node.streams.values())
            todo.extend(node.connections.values())
        todo.append(getattr(node, "child_layer", None))
        delegate = getattr(node.__dict__.get("_handle_event"), "__self__", None)  # a mode layer hands its
        if isinstance(delegate, proxy_layer.Layer) and delegate is not node:  # events on to a layer it made
            todo.append(delegate)
    return found, tls


def _http1_of(node: Any) -> Any:
    """The HTTP/1 layer of a connection: an upstream connection's is under its TLS layer (if any) and mitmproxy's
    ``HttpClient``."""
    while isinstance(node, tls_layer.TLSLayer | http_layer.HttpClient):
        node = getattr(node, "child_layer", None)
    return node


def _open_tls(layer: Any) -> Any:
    """The pyOpenSSL connection of an established TLS layer that can relay (memory BIOs, not shut down)."""
    tls = getattr(layer, "tls", None)
    if (layer is None or layer.tunnel_state is not tunnel.TunnelState.OPEN or tls is None
            or getattr(tls, "_from_ssl", None) is None or getattr(tls, "_into_ssl", None) is None
            or tls.get_shutdown()):
        return None
    return tls


def _idle(*layers: Any) -> bool:
    return all(getattr(x, "_paused", None) is None and not getattr(x, "_paused_event_queue", ()) for x in layers)


def _leg(handler: Any, connection: Any) -> Leg | None:
    stream = _streams.get(connection.id)
    if stream is None:
        return None
    flow = stream.flow
    response = connection is stream.context.server
    streaming = stream.server_state == stream.state_stream_response_body if response else \
        stream.client_state == stream.state_stream_request_body
    message = flow.response if response else flow.request
    if not streaming or message is None or flow.error is not None or flow.websocket is not None:
        _streams.pop(connection.id, None)
        return None
    sink = stream.context.client if response else stream.context.server
    coding = message.headers.get("transfer-encoding", "").strip().lower()
    if (coding and coding != "chunked") or stream.context.options.store_streamed_bodies or (
            coding and flow.request.http_version != "HTTP/1.1"):
        _streams.pop(connection.id, None)  # a coding besides chunked, an HTTP/1.0 peer, or mitmproxy keeps what
        return None  # streams: never relayed
    if not plain_stream(message.stream):
        return None
    http_layers, tls_layers = _layers(handler.layer)
    layer = next((h for h in http_layers if h.streams.get(stream.stream_id) is stream), None)
    source_tls = _open_tls(tls_layers.get(connection.id)) if connection.tls else None
    sink_tls = _open_tls(tls_layers.get(sink.id)) if sink.tls else None
    if layer is None or (connection.tls and source_tls is None) or (sink.tls and sink_tls is None):
        return None
    source_layer, sink_layer = _http1_of(layer.connections.get(connection)), _http1_of(layer.connections.get(sink))
    if any(isinstance(x, http_layer.HttpConnection) and not isinstance(x, _http1.Http1Connection)
           for x in (source_layer, sink_layer)):
        _streams.pop(connection.id, None)  # HTTP/2 (or 3) on either side, for good: never relayed, not walked again
        return None
    want_source = _http1.Http1Client if response else _http1.Http1Server
    want_sink = _http1.Http1Server if response else _http1.Http1Client
    if not (isinstance(source_layer, want_source) and isinstance(sink_layer, want_sink)
            and source_layer.state == source_layer.read_body and not source_layer.buf
            and source_layer.stream_id == stream.stream_id and sink_layer.stream_id == stream.stream_id
            and _idle(stream, layer, source_layer, sink_layer)):
        return None
    if coding:  # chunked: the sink frames it chunked too (mitmproxy frames every piece as a chunk of its own)
        chunks = chunk_reader(source_layer.body_reader)
        if isinstance(getattr(source_layer.body_reader, "reader", source_layer.body_reader), ChunkedReader) and (
                source_tls is not None or sink_tls is None):
            return Leg(stream, connection, sink, source_layer.body_reader, None, response, source_tls, sink_tls,
                       chunks) if chunks is not None else None  # in a chunk's CRLF: at a later read
        _streams.pop(connection.id, None)  # not chunked after all, or plaintext in and TLS out: mitmproxy's path
        return None
    left = body_left(source_layer.body_reader)
    if left is None or (left.count is not None and left.count < RELAY_MIN) or (
            left.count is None and (not response or source_tls is not None)):
        _streams.pop(connection.id, None)  # its framing (or what is left of it) will not change: never relayed
        return None
    return Leg(stream, connection, sink, source_layer.body_reader, left, response, source_tls, sink_tls)


async def _wait(fd: int, write: bool) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    (loop.add_writer if write else loop.add_reader)(fd, wake)
    try:
        await ready
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


class SinkFailed(Exception):
    """Writing to the other side failed (it closed or reset): the relay stops, mitmproxy's path sees the rest."""


def open_pipe() -> tuple[int, int]:
    """A non-blocking pipe of ``PIPE_BYTES`` (as large as the system lets an unprivileged process make it)."""
    pipe_r, pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.fcntl(pipe_w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return pipe_r, pipe_w


async def splice_body(source_fd: int, sink_fd: int, count: int | None, took: Callable[[int], None],
                      gave: Callable[[int], None], alive: Callable[[], None],
                      pipe: tuple[int, int] | None = None) -> bool:
    """Move ``count`` bytes (None: up to the source's end) from ``source_fd`` to ``sink_fd`` through a pipe
    (``pipe``, empty, kept open for the next call; else one of its own). ``took(n)``: n bytes left the source;
    ``gave(n)``: n reached the sink. Returns whether the source ended (EOF) first, the pipe empty. A read error of
    the source raises OSError; a write error of the sink, SinkFailed."""
    pipe_r, pipe_w = pipe or open_pipe()
    in_pipe, wanted, ended, since_yield = 0, count, False, 0
    try:
        while True:
            moved = False
            if not ended and (wanted is None or wanted > 0) and in_pipe < PIPE_BYTES:
                try:
                    n = os.splice(source_fd, pipe_w, PIPE_BYTES - in_pipe if wanted is None else
                                  min(PIPE_BYTES - in_pipe, wanted), flags=SPLICE_FLAGS)
                except BlockingIOError:
                    n = -1
                if n == 0:
                    ended = True
                elif n > 0:
                    in_pipe += n
                    wanted = None if wanted is None else wanted - n
                    took(n)
                    moved = True
            write_blocked = False
            if in_pipe:
                try:
                    m = os.splice(pipe_r, sink_fd, in_pipe, flags=SPLICE_FLAGS)
                except BlockingIOError:
                    m, write_blocked = 0, True
                except OSError as exc:
                    raise SinkFailed(str(exc)) from exc
                if m > 0:
                    in_pipe -= m
                    gave(m)
                    moved = True
            if in_pipe == 0 and (ended or wanted == 0):
                return ended
            if moved:
                alive()
                since_yield += 1
                if since_yield >= YIELD_EVERY:  # both sides ready for long: other connections get their turn
                    since_yield = 0
                    await asyncio.sleep(0)
                continue
            await _wait(sink_fd, True) if write_blocked or ended or wanted == 0 else await _wait(source_fd, False)
    finally:
        if pipe is None:
            os.close(pipe_r)
            os.close(pipe_w)


def _counters(leg: Leg) -> tuple[Callable[[int], None], Callable[[int], None], Callable[[int], None]]:
    """``took(n)``: n bytes left the source (a Content-Length reader is told); ``gave(n)``: n reached the sink;
    ``body(n)``: n of the body's own bytes passed (the flow's count, and the capture's tee, are told): what
    ``gave`` counts, but for a chunked body's, whose framing passes too."""
    flow = leg.stream.flow
    message = flow.response if leg.response else flow.request
    counted = getattr(message.stream, "passed", None)

    def body(n: int) -> None:
        flow.metadata[RELAYED] = flow.metadata.get(RELAYED, 0) + n
        if counted is not None:
            counted(n)

    def took(n: int) -> None:
        leg.taken += n
        taken(leg.reader, n)

    def gave(n: int) -> None:
        leg.given += n
        if leg.chunks is None:
            body(n)

    return took, gave, body


def _ready(handler: Any, leg: Leg) -> tuple[Any, Any, Any, Any] | None:
    """The two connections' transports and streams, when both are open."""
    source_io, sink_io = handler.transports.get(leg.source), handler.transports.get(leg.sink)
    source_transport = getattr(getattr(source_io, "writer", None), "transport", None)
    sink_transport = getattr(getattr(sink_io, "writer", None), "transport", None)
    reader = getattr(source_io, "reader", None)
    if (source_transport is None or sink_transport is None or not isinstance(reader, asyncio.StreamReader)
            or reader.at_eof() or source_transport.is_closing() or sink_transport.is_closing()
            or source_transport.get_extra_info("socket") is None or sink_transport.get_extra_info("socket") is None):
        return None
    return source_transport, sink_transport, source_io, sink_io


async def _flushed(writer: asyncio.StreamWriter) -> None:
    """Wait until nothing is left in the writer's buffer (drain waits only for its low-water mark)."""
    transport = writer.transport
    if not transport.get_write_buffer_size():
        return
    low, high = transport.get_write_buffer_limits()  # asyncio answers (low, high)
    transport.set_write_buffer_limits(high=0, low=0)
    try:
        await writer.drain()
    finally:
        if not transport.is_closing():
            transport.set_write_buffer_limits(high=high, low=low)


async def relay_sockets(handler: Any, leg: Leg, read_raw: Callable[[int], Any]) -> bool:
    """Plaintext both ways: splice the body between the two sockets; True when the source ended (EOF) during it.
    What the source's reader holds already, and what the sink's writer has not sent yet, go first."""
    ready = _ready(handler, leg)
    if ready is None:
        return False
    source_transport, sink_transport, source_io, sink_io = ready
    took, gave, _ = _counters(leg)
    held = len(source_io.reader._buffer)
    assert leg.left is not None
    count = leg.left.count
    first = await read_raw(held if count is None else min(held, count)) if held else b""  # at hand: no wait
    reading = source_transport.is_reading()  # the transport must not read what the splice is moving
    if reading:
        source_transport.pause_reading()
    try:
        if first:
            took(len(first))
            sink_io.writer.write(first)
        try:
            await _flushed(sink_io.writer)
        except OSError as exc:
            raise SinkFailed(str(exc)) from exc
        if first:
            gave(len(first))
        if sink_transport.is_closing() or source_transport.is_closing() or (count is not None and count == len(first)):
            return False
        source_fd = os.dup(source_transport.get_extra_info("socket").fileno())  # ours: a close elsewhere cannot
        sink_fd = os.dup(sink_transport.get_extra_info("socket").fileno())  # hand their numbers to another one
        try:
            return await splice_body(source_fd, sink_fd, None if count is None else count - len(first), took, gave,
                                     handler.timeout_watchdog.register_activity)
        finally:
            os.close(source_fd)
            os.close(sink_fd)
    finally:
        if reading and not source_transport.is_closing():
            source_transport.resume_reading()


def _hand_back(leg: Leg, pos: ChunkPos, sink_writer: asyncio.StreamWriter) -> None:
    """A chunked relay ends at ``pos``: the h11 reader is put where the source stands, and a chunk whose data the
    relay passed is closed towards the sink (mitmproxy frames what follows as chunks of its own; the source's CRLF
    is then h11's to check and drop). Only a sink that is gone sees a relay end inside a chunk's data."""
    reader = leg.chunks
    assert reader is not None
    reader._bytes_in_chunk = pos.data_left
    reader._bytes_to_discard = b"\r\n" if pos.crlf and not pos.data_left else b""
    if pos.crlf and not pos.data_left:
        sink_writer.write(b"\r\n")


def _announce(leg: Leg, how: str) -> None:
    request = leg.stream.flow.request
    what = "chunked" if leg.left is None else "up to the close" if leg.left.count is None else f"{leg.left.count} bytes"
    log.info("relaying the rest of %s %s's %s directly: %s (%s)", request.method, request.pretty_url,
             "answer" if leg.response else "request body", what, how)


async def relay_chunked(handler: Any, leg: Leg, read_raw: Callable[[int], Any]) -> bool:
    """Plaintext both ways, a chunked body: its bytes pass as they are, framing included (the sink reads the
    same chunks), spliced a run of whole chunks, or the rest of one chunk's data, at a time; the relay reads
    only the chunk-size lines and closing CRLFs, peeking at the source's socket (``scan_chunks``). It ends before
    the last chunk (mitmproxy's path reads it, the trailer section and the end, as always), or before a line it
    does not relay. True when the source ended (EOF) during it."""
    ready = _ready(handler, leg)
    if ready is None or leg.chunks is None:
        return False
    source_transport, sink_transport, source_io, sink_io = ready
    left = leg.chunks._bytes_in_chunk
    pos = ChunkPos(left, bool(left))
    scan = scan_chunks(pos, source_io.reader._buffer)
    if scan.stop:  # the body ends in what is at hand (or a line the relay leaves comes first): mitmproxy's path
        _streams.pop(leg.source.id, None)
        return False
    _announce(leg, "splice, chunked")
    took, gave, body = _counters(leg)
    writer = sink_io.writer
    reading = source_transport.is_reading()  # the transport must not read what the splice is moving
    if reading:
        source_transport.pause_reading()
    try:
        first = await read_raw(scan.passable) if scan.passable else b""  # at hand: no wait
        took(len(first))
        head = b"%x\r\n" % left if left else b""  # the rest of a chunk mitmproxy passed the start of: its own chunk
        if head or first:
            writer.write(head + first)
        try:
            await _flushed(writer)
        except OSError as exc:
            raise SinkFailed(str(exc)) from exc
        gave(len(first))
        body(scan.data)
        pos = scan.pos
        if source_io.reader._buffer or sink_transport.is_closing() or source_transport.is_closing():
            _hand_back(leg, pos, writer)  # a line not all there yet is in the reader: mitmproxy's path reads it
            return False
        return await _splice_chunks(handler, leg, pos, source_transport, sink_transport, writer)
    finally:
        if reading and not source_transport.is_closing():
            source_transport.resume_reading()


async def _splice_chunks(handler: Any, leg: Leg, pos: ChunkPos, source_transport: Any, sink_transport: Any,
                         writer: asyncio.StreamWriter) -> bool:
    took, gave, body = _counters(leg)
    source = socket.socket(fileno=os.dup(source_transport.get_extra_info("socket").fileno()))  # ours, as in
    sink_fd = os.dup(sink_transport.get_extra_info("socket").fileno())  # relay_sockets
    pipe = open_pipe()
    try:
        while True:
            try:
                window = source.recv(CHUNK_PEEK, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                await _wait(source.fileno(), False)
                continue
            if not window:
                return True  # the source closed inside the body: mitmproxy's path sees it cut short
            scan = scan_chunks(pos, window)
            run, data, pos = scan.passable, scan.data, scan.pos
            if pos.data_left:  # the window ends inside a chunk's data: the run takes the rest of it
                run, data, pos = run + pos.data_left, data + pos.data_left, ChunkPos(0, True)
            if run:
                if await splice_body(source.fileno(), sink_fd, run, took, gave,
                                     handler.timeout_watchdog.register_activity, pipe):
                    return True
                body(data)
            if scan.stop or not run:  # the last chunk, a line the relay leaves, or a line not all there yet
                if scan.stop:
                    _streams.pop(leg.source.id, None)
                _hand_back(leg, pos, writer)
                return False
    finally:
        source.close()
        os.close(sink_fd)
        os.close(pipe[0])
        os.close(pipe[1])


def _tls_ssl(tls: Any) -> Any:
    return tls._ssl


def _decrypt_into(tls: Any, buf: bytearray, at: int, most: int, peek: bool = False) -> int:
    """SSL_read (``peek``: SSL_peek, which leaves them to the next read) of at most ``most`` bytes straight into
    ``buf[at:]``: the bytes read, 0 when OpenSSL needs more ciphertext; raises SSL.ZeroReturnError at the peer's
    close_notify, SSL.Error on a TLS failure."""
    with SSL._ffi.from_buffer(buf) as view:
        got = (SSL._lib.SSL_peek if peek else SSL._lib.SSL_read)(_tls_ssl(tls), view + at, most)
        if got > 0:
            return int(got)
        try:
            tls._raise_ssl_error(_tls_ssl(tls), got)
        except SSL.WantReadError:
            return 0
    return 0


_OUT = bytearray(CHUNK + (64 << 10))  # where BIO_read puts the ciphertext (copied out before the next await)


def _encrypted(tls: Any) -> bytes:
    """What the TLS object has encrypted and not yet sent (pyOpenSSL's bio_read would allocate its whole size
    on every call: 1 MiB each time)."""
    parts: list[bytes] = []
    with SSL._ffi.from_buffer(_OUT) as out:
        while (got := SSL._lib.BIO_read(tls._from_ssl, out, len(_OUT))) > 0:
            parts.append(bytes(memoryview(_OUT)[:got]))
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _plaintext(leg: Leg, read_raw: Callable[[int], Any], source_writer: Any, buf: bytearray,
                     want: int) -> int:
    """Up to ``want`` (<= len(buf)) bytes of the body into ``buf``: decrypted if the source speaks TLS; 0 when the
    source ended."""
    tls = leg.source_tls
    if tls is None:
        data = await read_raw(want)
        buf[:len(data)] = data
        return len(data)
    while True:
        got = 0
        try:
            while got < want and (n := _decrypt_into(tls, buf, got, want - got)):
                got += n
        except SSL.ZeroReturnError:
            return got
        reply = _encrypted(tls)  # a TLS 1.3 key update's answer, a ticket: the source's own traffic
        if reply:
            source_writer.write(reply)
        if got:
            return got
        data = await read_raw(CHUNK)
        if not data:
            return 0
        tls.bio_write(data)


async def relay_streams(handler: Any, leg: Leg, read_raw: Callable[[int], Any]) -> bool:
    """TLS on either side: the body through one buffer, decrypted and encrypted in bulk; True when the source ended
    during it. A TLS source keeps the body's last byte for mitmproxy's path (its TLS layer then sees the end)."""
    ready = _ready(handler, leg)
    if ready is None or leg.left is None or leg.left.count is None:
        return False
    _, _, source_io, sink_io = ready
    took, gave, _ = _counters(leg)
    left = leg.left.count - (1 if leg.source_tls is not None else 0)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while left > 0:
        got = await _plaintext(leg, read_raw, source_io.writer, buf, min(left, CHUNK))
        if not got:
            return True
        took(got)
        left -= got
        if leg.sink_tls is not None:
            leg.sink_tls.sendall(view[:got])
            out = _encrypted(leg.sink_tls)
        else:
            out = bytes(view[:got])
        try:
            sink_io.writer.write(out)
            await sink_io.writer.drain()
        except OSError as exc:
            raise SinkFailed(str(exc)) from exc
        gave(got)
        handler.timeout_watchdog.register_activity()
    return False


async def relay_chunked_tls(handler: Any, leg: Leg, read_raw: Callable[[int], Any]) -> bool:
    """A chunked body from a TLS source (to a TLS or plaintext sink): as ``relay_chunked``, its bytes pass as they
    are, framing included, decrypted and encrypted in bulk as ``relay_streams`` does; the chunk-size lines are read
    with SSL_peek, so what the relay leaves (the last chunk, a line it does not relay) is still OpenSSL's to hand
    mitmproxy's TLS layer. True when the source ended during it."""
    ready = _ready(handler, leg)
    tls = leg.source_tls
    if ready is None or leg.chunks is None or tls is None:
        return False
    _, _, source_io, sink_io = ready
    took, gave, body = _counters(leg)
    left = leg.chunks._bytes_in_chunk
    pos = ChunkPos(left, bool(left))
    buf, peeked = bytearray(CHUNK), bytearray(CHUNK_PEEK)
    view = memoryview(buf)
    announced = False

    async def send(data: bytes | memoryview) -> None:
        if leg.sink_tls is not None:
            leg.sink_tls.sendall(data)
            data = _encrypted(leg.sink_tls)
        try:
            sink_io.writer.write(bytes(data))
            await sink_io.writer.drain()
        except OSError as exc:
            raise SinkFailed(str(exc)) from exc

    if left:  # the rest of a chunk mitmproxy passed the start of: a chunk of its own
        _announce(leg, "TLS in bulk, chunked")
        announced = True
        await send(b"%x\r\n" % left)
    while True:
        if pos.data_left:
            got = await _plaintext(leg, read_raw, source_io.writer, buf, min(pos.data_left, CHUNK))
            if not got:
                return True
            took(got)
            await send(view[:got])
            gave(got)
            body(got)
            pos = ChunkPos(pos.data_left - got, True)
            handler.timeout_watchdog.register_activity()
            continue
        try:
            seen = _decrypt_into(tls, peeked, 0, CHUNK_PEEK, peek=True)
        except SSL.ZeroReturnError:
            return True
        if not seen:
            reply = _encrypted(tls)  # a TLS 1.3 key update's answer, a ticket: the source's own traffic
            if reply:
                source_io.writer.write(reply)
            data = await read_raw(CHUNK)
            if not data:
                return True
            tls.bio_write(data)
            continue
        scan = scan_chunks(pos, peeked[:seen])
        if scan.stop and not announced:  # the body ends in what is at hand: mitmproxy's path, as if never asked
            _streams.pop(leg.source.id, None)
            return False
        if not announced:
            _announce(leg, "TLS in bulk, chunked")
            announced = True
        if scan.passable:
            got = _decrypt_into(tls, buf, 0, scan.passable)  # peeked already: all there
            if got != scan.passable:
                raise OSError(f"TLS read {got} of the {scan.passable} bytes it had shown")
            took(got)
            await send(view[:got])
            gave(got)
            body(scan.data)
        pos = scan.pos
        if scan.stop or not scan.passable:  # the last chunk, a line the relay leaves, or one not all there yet
            if scan.stop:
                _streams.pop(leg.source.id, None)
            if pos.crlf and not pos.data_left:
                await send(b"\r\n")  # closes the chunk towards the sink; h11 checks and drops the source's
            leg.chunks._bytes_in_chunk = pos.data_left
            leg.chunks._bytes_to_discard = b"\r\n" if pos.crlf and not pos.data_left else b""
            return False


async def relay_before_read(handler: Any, connection: Any, read_raw: Callable[[int], Any]) -> bool:
    """Relay what may be relayed of the body ``connection`` is sending, if any; True when the connection ended
    (EOF) during it. After a relayed Content-Length body, the layers are handed an empty read: the reader's rest
    is 0 and it ends the message (a TLS source: its TLS layer decrypts the last byte, which ends it)."""
    leg = _leg(handler, connection)
    if leg is None:
        return False
    if leg.chunks is None:
        _announce(leg, "splice" if leg.source_tls is None and leg.sink_tls is None else "TLS in bulk")
    try:
        if leg.chunks is not None and leg.source_tls is not None:
            ended = await relay_chunked_tls(handler, leg, read_raw)
        elif leg.chunks is not None:
            ended = await relay_chunked(handler, leg, read_raw)
        elif leg.source_tls is None and leg.sink_tls is None:
            ended = await relay_sockets(handler, leg, read_raw)
        else:
            ended = await relay_streams(handler, leg, read_raw)
    except (SinkFailed, SSL.Error) as exc:
        if leg.taken != leg.given or leg.chunks is not None:  # bytes left the source that never reached the sink
            # (the body is broken), or a chunked body's reader no longer knows where the source stands
            log.info("the relay of a body stopped with %d bytes lost: %s (the connection is closed)",
                     leg.taken - leg.given, exc)
            raise OSError(f"the relay of a body lost {leg.taken - leg.given} bytes: {exc}") from exc
        log.info("the relay of a body stopped: %s (mitmproxy's path takes the rest)", exc)
        return False
    except (OSError, asyncio.CancelledError):
        raise  # a broken source, an abort: mitmproxy's connection handler ends the connection
    except Exception as exc:  # a bug of the relay's: never the connection's task, which mitmproxy would not see end
        log.exception("the relay of a body failed (the connection is closed)")
        raise OSError(f"the relay of a body failed: {exc!r}") from exc
    if leg.chunks is not None and leg.given:
        log.info("the relay of %s's chunked %s passed %d bytes; %s", leg.stream.flow.request.pretty_url,
                 "answer" if leg.response else "request body", leg.given,
                 "the source closed" if ended else "mitmproxy's path reads on")
    if not ended and ((leg.left is not None and leg.left.count is not None) or (
            leg.chunks is not None and leg.source_tls is not None)):  # a TLS source: what OpenSSL holds, to h11
        await handler.server_event(events.DataReceived(connection, b""))
    return ended


def _register_streams() -> None:
    stream_cls = http_layer.HttpStream
    start_response, start_request = stream_cls.start_response_stream, stream_cls.start_request_stream

    def start_response_stream(self: Any) -> Any:
        yield from start_response(self)
        _streams[self.context.server.id] = self

    def start_request_stream(self: Any) -> Any:
        yield from start_request(self)
        _streams[self.context.client.id] = self

    stream_cls.start_response_stream = start_response_stream  # type: ignore[method-assign]
    stream_cls.start_request_stream = start_request_stream  # type: ignore[method-assign]


def install_relay(reader: asyncio.StreamReader, handler: Any, connection: Any) -> None:
    """Make ``reader.read`` relay a relayable body before it reads (see the module docstring)."""
    read = reader.read

    async def read_relaying(n: int = -1) -> bytes:
        if connection.id in _streams and await relay_before_read(handler, connection, read):
            return b""  # the source ended: mitmproxy's path sees the close
        return await read(n)

    reader.read = read_relaying  # type: ignore[method-assign]


def forget(connection: Any) -> None:
    _streams.pop(connection.id, None)


def direct_relay() -> None:
    """Relay bodies nobody inspects between the sockets (the module docstring); idempotent, for this process.
    Call after ``framing.bulk_transfers()``."""
    handler_cls = proxy_server.ConnectionHandler
    if getattr(handler_cls, "tether_direct_relay", False):
        return
    _register_streams()
    handle_connection = handler_cls.handle_connection

    async def handle_relaying(self: Any, connection: Any) -> None:
        io = self.transports.get(connection)
        if io is not None and isinstance(io.reader, asyncio.StreamReader):
            install_relay(io.reader, self, connection)
        try:
            await handle_connection(self, connection)
        finally:
            forget(connection)

    handler_cls.handle_connection = handle_relaying  # type: ignore[method-assign]
    handler_cls.tether_direct_relay = True  # type: ignore[attr-defined]
