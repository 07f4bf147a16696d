"""The sidecar's own HTTP/1.1 client: asyncio streams and h11 (both loaded by mitmproxy already), no aiohttp.

The sidecar makes few kinds of requests of its own: to the control plane (``proxy/channel.py``: signed JSON
requests, long polls, the event stream), to an OAuth2 token endpoint (``proxy/credentials.py``) and to an MCP
server it tells of a cancelled call (``proxy/cutting.py``). aiohttp's client cost each sidecar ~8 MiB of resident
memory for them (bench/RESULTS.md, "A lighter sidecar"); this module does the same with what mitmproxy has loaded.

What it does: HTTP and HTTPS (``ssl.create_default_context()``, or the context given: the system's trust store,
``SSL_CERT_FILE`` honoured, as aiohttp's default); keep-alive connections pooled per origin (idle ones dropped
after ``IDLE_S``, at most ``limit`` open at once); answers framed by Content-Length, chunked or the connection's
end (h11 reads the framing: bad chunking or a malformed answer is a ``ClientError``); gzip and deflate bodies
decoded; a deadline for a whole request, or a connect timeout and a per-read timeout for a stream. Memory is
bounded: a head longer than ``MAX_HEAD`` or a body (decoded) longer than ``max_body`` ends the request with a
``ClientError`` that says so. It never goes through a proxy.

Errors: ``TimeoutError`` when a deadline passes, ``ClientError`` (an ``OSError``: callers catch one family) for
everything else, with a message in a few words.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
import zlib
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import h11

MAX_HEAD = 64 * 1024  # bytes of an answer's status line and headers
MAX_BODY = 64 * 1024 * 1024  # bytes of an answer's body, decoded, unless the client is told otherwise
READ_SIZE = 64 * 1024
STREAM_PIECE = 1024 * 1024  # the most a stream hands its reader at once, decoded
IDLE_S = 15.0  # a pooled connection unused this long is closed rather than reused
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})  # aiohttp's list


class ClientError(OSError):
    """A request that got no usable answer: refused or broken connection, bad framing, an answer too large."""


@dataclass(frozen=True)
class Origin:
    scheme: str
    host: str
    port: int

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


def split_url(url: str) -> tuple[Origin, str]:
    """The origin and the request target of an absolute http(s) URL; ClientError for any other."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ClientError(f"not an http(s) URL: {url!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ClientError(f"bad port in {url!r}") from None
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Origin(parts.scheme, parts.hostname, port), target


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # names in lower case; a repeated header's values joined by ", "
    body: bytes = b""

    @property
    def content_type(self) -> str | None:
        return self.headers.get("content-type")


class Decoder:
    """An answer's body as sent (identity, gzip or deflate) to its bytes, never more than ``limit`` of them."""

    def __init__(self, encoding: str | None, limit: int) -> None:
        self.limit, self.total, self.fed = limit, 0, 0
        coding = (encoding or "identity").strip().lower()
        self._deflate = coding == "deflate"  # zlib-wrapped as the RFC says, or raw (as some servers send it)
        if coding in ("gzip", "x-gzip"):
            self._z: zlib._Decompress | None = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif coding == "deflate":
            self._z = zlib.decompressobj()
        elif coding == "identity":
            self._z = None
        else:
            raise ClientError(f"the answer's Content-Encoding {encoding!r} is not one this client reads")

    def _first(self, data: bytes) -> None:
        if self._deflate and not self.fed and data and data[0] & 0x0F != 8:  # no zlib header: raw deflate
            self._z = zlib.decompressobj(-zlib.MAX_WBITS)
        self.fed += len(data)

    def feed(self, data: bytes) -> bytes:
        if self._z is not None:
            self._first(data)
            try:
                data = self._z.decompress(data, self.limit - self.total + 1)
            except zlib.error as exc:
                raise ClientError(f"the answer's body does not decode ({exc})") from None
            if self._z.unconsumed_tail:
                raise ClientError(f"the answer's body is over {self.limit} bytes decoded")
        self.total += len(data)
        if self.total > self.limit:
            raise ClientError(f"the answer's body is over {self.limit} bytes")
        return data

    def pieces(self, data: bytes, most: int) -> Iterator[bytes]:
        """``data`` decoded, in pieces of at most ``most`` bytes: a small read of a compressed stream can decode
        to a great deal, and a stream's reader holds one piece at a time."""
        if self._z is None:
            yield self.feed(data)
            return
        self._first(data)
        while data:
            try:
                out = self._z.decompress(data, most)
            except zlib.error as exc:
                raise ClientError(f"the answer's body does not decode ({exc})") from None
            data = self._z.unconsumed_tail
            if out:
                yield self.feed_decoded(out)

    def end(self) -> bytes:
        if self._z is None or not self.fed:  # nothing was sent (a HEAD's, a 204's answer): nothing to decode
            return b""
        try:
            rest = self._z.flush()
        except zlib.error as exc:
            raise ClientError(f"the answer's body does not decode ({exc})") from None
        if not self._z.eof:
            raise ClientError("the answer's compressed body is cut short")
        return self.feed_decoded(rest)

    def feed_decoded(self, data: bytes) -> bytes:
        self.total += len(data)
        if self.total > self.limit:
            raise ClientError(f"the answer's body is over {self.limit} bytes")
        return data


@dataclass(eq=False)  # hashed by identity: the client keeps a set of its open connections
class Connection:
    origin: Origin
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    h11: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD))
    idle_since: float = 0.0
    reused: bool = False
    received: int = 0  # bytes read on this connection

    def usable(self, now: float) -> bool:
        """Idle, open, and holding no byte nobody asked for: bytes the server sent past its answer, or while the
        connection sat idle (a 408 before it closes), would be read as the next request's answer."""
        return (now - self.idle_since < IDLE_S and not self.reader.at_eof() and not self.writer.is_closing()
                and self.h11.our_state is h11.IDLE and self.h11.their_state is h11.IDLE
                and not self.h11.trailing_data[0] and not self.reader._buffer)  # asyncio keeps no public count

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()

    async def send(self, *events: h11.Event) -> None:
        for event in events:
            data = self.h11.send(event)
            if data:
                self.writer.write(data)
        await self.writer.drain()

    async def next_event(self) -> h11.Event:
        """The answer's next event, reading the socket as h11 needs; ClientError on bad framing."""
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise ClientError(f"malformed answer: {exc}") from None
            if event is not h11.NEED_DATA:
                return event
            data = await self.reader.read(READ_SIZE)  # b"": the server closed; h11 says what that means
            self.received += len(data)
            try:
                self.h11.receive_data(data)
            except h11.RemoteProtocolError as exc:
                raise ClientError(f"malformed answer: {exc}") from None


class Client:
    """Pooled HTTP/1.1 connections to any number of origins (one pool per origin)."""

    def __init__(self, *, ssl_context: ssl.SSLContext | None = None, limit: int = 16,
                 max_body: int = MAX_BODY) -> None:
        self._ssl = ssl_context
        self._slots = asyncio.Semaphore(limit) if limit > 0 else None
        self._idle: dict[Origin, list[Connection]] = {}
        self._open: set[Connection] = set()
        self.max_body = max_body
        self.closed = False

    # -- connections -----------------------------------------------------------------------------------
    def _context(self, origin: Origin) -> ssl.SSLContext | None:
        if origin.scheme != "https":
            return None
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    async def _connect(self, origin: Origin) -> Connection:
        context = self._context(origin)
        reader, writer = await asyncio.open_connection(
            origin.host, origin.port, ssl=context, server_hostname=origin.host if context else None,
            limit=READ_SIZE)
        conn = Connection(origin, reader, writer)
        self._open.add(conn)
        return conn

    def _pooled(self, origin: Origin) -> Connection | None:
        now = time.monotonic()
        idle = self._idle.get(origin, [])
        while idle:
            conn = idle.pop()
            if conn.usable(now):
                conn.reused = True
                return conn
            self._discard(conn)
        return None

    def _release(self, conn: Connection) -> None:
        """Back to the pool when the exchange ended cleanly and both sides keep the connection; else closed."""
        if self.closed or conn.h11.our_state is not h11.DONE or conn.h11.their_state is not h11.DONE:
            self._discard(conn)
            return
        try:
            conn.h11.start_next_cycle()
        except h11.LocalProtocolError:
            self._discard(conn)
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.origin, []).append(conn)

    def _discard(self, conn: Connection) -> None:
        self._open.discard(conn)
        conn.close()

    async def close(self) -> None:
        self.closed = True
        conns = list(self._open)
        self._idle.clear()
        self._open.clear()
        for conn in conns:
            conn.close()
        for conn in conns:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.writer.wait_closed(), 1.0)

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        if self.closed:
            raise ClientError("the client is closed")
        if self._slots is None:
            yield
            return
        async with self._slots:
            yield

    # -- requests ----------------------------------------------------------------------------------------
    def _head(self, method: str, origin: Origin, target: str, headers: Mapping[str, str],
              body: bytes | None) -> h11.Request:
        names = {k.lower() for k in headers}
        lines = [("Host", origin.host_header)] if "host" not in names else []
        lines += [(k, v) for k, v in headers.items()]
        if "accept-encoding" not in names:
            lines.append(("Accept-Encoding", "gzip, deflate"))
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(("Content-Length", str(len(body or b""))))
        try:
            return h11.Request(method=method, target=target, headers=lines)
        except h11.LocalProtocolError as exc:
            raise ClientError(f"bad request: {exc}") from None

    async def _exchange_head(self, conn: Connection, request: h11.Request, body: bytes | None) -> h11.Response:
        events: list[h11.Event] = [request]
        if body:
            events.append(h11.Data(data=body))
        events.append(h11.EndOfMessage())
        await conn.send(*events)
        while True:
            event = await conn.next_event()
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                return event
            raise ClientError("the connection closed before an answer")  # ConnectionClosed

    async def _start(self, method: str, url: str, headers: Mapping[str, str], body: bytes | None,
                     pooled: bool = True) -> tuple[Connection, h11.Response]:
        """A connection (pooled, or new) with the request sent and the answer's head read. A pooled connection
        the server had closed before a byte of the answer came is tried once more on a new one, for a request
        that may be repeated (as aiohttp does)."""
        origin, target = split_url(url)
        request = self._head(method, origin, target, headers, body)
        conn = self._pooled(origin) if pooled else None
        if conn is not None:
            before = conn.received
            try:
                return conn, await self._exchange_head(conn, request, body)
            except OSError as exc:  # ClientError, a reset, a TLS error: the server closed it, or never answered
                self._discard(conn)
                if method not in IDEMPOTENT or conn.received != before:  # a byte of an answer came: not again
                    raise _client_error(exc) from None
            except BaseException:
                self._discard(conn)
                raise
        conn = await self._connect(origin)
        try:
            return conn, await self._exchange_head(conn, request, body)
        except BaseException:
            self._discard(conn)
            raise

    async def request(self, method: str, url: str, *, body: bytes | None = None,
                      headers: Mapping[str, str] | None = None, timeout: float = 10.0) -> Response:
        """One request and its whole answer, within ``timeout`` seconds (TimeoutError past it), the wait for a
        free connection slot included."""
        async with asyncio.timeout(timeout), self._slot():
            conn, head = await self._start(method.upper(), url, headers or {}, body)
            try:
                answer = Response(head.status_code, _headers(head))
                answer.body = await _read_body(conn, answer, self.max_body)
            except BaseException:
                self._discard(conn)
                raise
            self._release(conn)
            return answer

    @contextlib.asynccontextmanager
    async def stream(self, method: str, url: str, *, headers: Mapping[str, str] | None = None,
                     connect_timeout: float = 10.0, read_timeout: float = 30.0) -> AsyncIterator[Streamed]:
        """A request whose answer is read as it arrives (``Streamed.chunks``): ``connect_timeout`` for a free
        slot, the connection and the answer's head, ``read_timeout`` for each read after it (TimeoutError past
        either). A new connection, closed afterwards: a stream may last for hours, and takes no pooled one."""
        until = asyncio.get_running_loop().time() + connect_timeout
        async with contextlib.AsyncExitStack() as held:
            async with asyncio.timeout_at(until):
                await held.enter_async_context(self._slot())
                conn, head = await self._start(method.upper(), url, headers or {}, None, pooled=False)
            try:
                yield Streamed(conn, Response(head.status_code, _headers(head)), read_timeout, self.max_body)
            finally:
                self._discard(conn)


class Streamed:
    """An answer being read: its status and headers now, its body piece by piece."""

    def __init__(self, conn: Connection, head: Response, read_timeout: float, max_body: int) -> None:
        self._conn, self.head, self.read_timeout, self.max_body = conn, head, read_timeout, max_body

    @property
    def status(self) -> int:
        return self.head.status

    @property
    def headers(self) -> dict[str, str]:
        return self.head.headers

    async def read(self) -> bytes:
        """The whole rest of the body (at most ``max_body`` bytes decoded)."""
        async with asyncio.timeout(self.read_timeout):
            return await _read_body(self._conn, self.head, self.max_body)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, decoded; a read that waits longer than ``read_timeout`` is a TimeoutError.
        Not bounded in total (a stream may run for days): the caller bounds what it keeps."""
        decoder = Decoder(self.head.headers.get("content-encoding"), 1 << 62)
        while True:
            async with asyncio.timeout(self.read_timeout):
                event = await self._conn.next_event()
            if isinstance(event, h11.Data):
                for data in decoder.pieces(bytes(event.data), STREAM_PIECE):
                    if data:
                        yield data
            elif isinstance(event, h11.EndOfMessage):
                rest = decoder.end()
                if rest:
                    yield rest
                return
            else:
                raise ClientError("the connection closed in the middle of the answer")


async def _read_body(conn: Connection, head: Response, limit: int) -> bytes:
    """The rest of the answer, decoded (h11 knows the framing, a HEAD's or a 204's empty body included)."""
    decoder = Decoder(head.headers.get("content-encoding"), limit)
    pieces: list[bytes] = []
    while True:
        event = await conn.next_event()
        if isinstance(event, h11.Data):
            pieces.append(decoder.feed(bytes(event.data)))
        elif isinstance(event, h11.EndOfMessage):
            pieces.append(decoder.end())
            return b"".join(pieces)
        else:
            raise ClientError("the connection closed in the middle of the answer")


def _headers(head: h11.Response) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in head.headers:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        out[key] = f"{out[key]}, {text}" if key in out else text
    return out


def _client_error(exc: BaseException) -> OSError:
    """A failed exchange as the one error family callers catch (an OSError keeps its errno)."""
    if isinstance(exc, OSError):
        return exc
    return ClientError(str(exc) or type(exc).__name__)
