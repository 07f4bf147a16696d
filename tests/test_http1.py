"""The sidecar's own HTTP/1.1 client (``tether/proxy/http1.py``): against a real aiohttp server, a real control
plane over TLS (the channel's calls and its event stream), and hostile servers that break framing, send heads or
bodies without end, or answer too slowly. Every failure is a clear error and memory stays bounded."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from tether.capability import keys
from tether.capability.chain import parse_chain_unverified
from tether.capability.errors import CONTROLPLANE_UNREACHABLE, ApiError
from tether.capability.protocol import Heartbeat
from tether.proxy import http1
from tether.proxy.channel import ControlChannel

from . import harness
from .harness import ControlPlaneProcess, Identity, prepare_controlplane


# -- a real aiohttp server in the test's loop ------------------------------------------------------------------
class Served:
    def __init__(self) -> None:
        self.peers: list[tuple[str, int]] = []  # the client's address of every request: its connection
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> Served:
        app = web.Application()
        app.router.add_route("*", "/echo", self.echo)
        app.router.add_get("/chunked", self.chunked)
        app.router.add_get("/gzip", self.gzipped)
        app.router.add_get("/big", self.big)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = harness.free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    def seen(self, request: web.Request) -> None:
        self.peers.append(request.transport.get_extra_info("peername") if request.transport else ("?", 0))

    async def echo(self, request: web.Request) -> web.Response:
        self.seen(request)
        body = await request.read()
        return web.json_response({"method": request.method, "len": len(body), "sha": body[:16].hex(),
                                  "ctype": request.headers.get("Content-Type"), "host": request.host})

    async def chunked(self, request: web.Request) -> web.StreamResponse:
        self.seen(request)
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(50):
            await resp.write(f"line {i}\n".encode())
        await resp.write_eof()
        return resp

    async def gzipped(self, request: web.Request) -> web.Response:
        self.seen(request)
        return web.Response(body=gzip.compress(b"x" * 100_000), headers={"Content-Encoding": "gzip"})

    async def big(self, request: web.Request) -> web.Response:
        self.seen(request)
        return web.Response(body=os.urandom(3 * 1024 * 1024))


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    server = await Served().start()
    try:
        yield server
    finally:
        await server.stop()


async def test_answers_framed_every_way_read_whole_on_kept_alive_connections(served: Served) -> None:
    client = http1.Client()
    try:
        posted = await client.request("POST", served.url + "/echo", body=b"a" * 70_000,
                                      headers={"Content-Type": "application/json"})
        assert posted.status == 200 and posted.content_type == "application/json; charset=utf-8"
        doc = json.loads(posted.body)
        assert doc == {"method": "POST", "len": 70_000, "sha": (b"a" * 16).hex(), "ctype": "application/json",
                       "host": served.url.removeprefix("http://")}
        chunked = await client.request("GET", served.url + "/chunked")
        assert chunked.body == b"".join(f"line {i}\n".encode() for i in range(50))
        unzipped = await client.request("GET", served.url + "/gzip")
        assert unzipped.body == b"x" * 100_000
        empty = await client.request("POST", served.url + "/echo")
        assert json.loads(empty.body)["len"] == 0
        head = await client.request("HEAD", served.url + "/echo")
        assert head.status == 200 and head.body == b"" and int(head.headers["content-length"]) > 0
        assert len(served.peers) == 5 and len(set(served.peers)) == 1  # one connection, kept alive
    finally:
        await client.close()
    assert client.closed and not client._open


async def test_concurrent_requests_open_no_more_connections_than_the_limit(served: Served) -> None:
    client = http1.Client(limit=3)
    try:
        answers = await asyncio.gather(*(client.request("GET", served.url + "/chunked") for _ in range(12)))
        assert {a.status for a in answers} == {200}
        assert len(set(served.peers)) <= 3
    finally:
        await client.close()


async def test_a_body_over_the_limit_ends_the_request_with_an_error_that_says_so(served: Served) -> None:
    client = http1.Client(max_body=1024 * 1024)
    try:
        with pytest.raises(http1.ClientError, match="over 1048576 bytes"):
            await client.request("GET", served.url + "/big")
        with pytest.raises(http1.ClientError, match="over 50000 bytes decoded"):  # a small gzip, large inside
            await http1.Client(max_body=50_000).request("GET", served.url + "/gzip")
        assert (await client.request("GET", served.url + "/chunked")).status == 200  # the client still works
    finally:
        await client.close()


async def test_a_pooled_connection_the_server_closed_is_not_reused_for_a_get(served: Served) -> None:
    client = http1.Client()
    try:
        await client.request("GET", served.url + "/chunked")
        (conn,) = [c for pool in client._idle.values() for c in pool]
        conn.writer.transport.abort()  # as a server's idle timeout or restart would: the pooled socket is dead
        await asyncio.sleep(0.05)
        assert (await client.request("GET", served.url + "/chunked")).status == 200
        assert len(set(served.peers)) == 2
    finally:
        await client.close()


async def test_unreachable_and_wrong_urls_are_clear_errors() -> None:
    client = http1.Client()
    try:
        with pytest.raises(ConnectionRefusedError):
            await client.request("GET", f"http://127.0.0.1:{harness.free_port()}/x")
        with pytest.raises(http1.ClientError, match="not an http"):
            await client.request("GET", "ftp://127.0.0.1/x")
        with pytest.raises(http1.ClientError, match="bad request"):
            await client.request("GET", "http://127.0.0.1:9/x", headers={"X-Bad": "a\r\nInjected: 1"})
    finally:
        await client.close()


# -- hostile servers ------------------------------------------------------------------------------------------
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def raw_server(handler: Handler) -> tuple[asyncio.Server, str, list[int]]:
    """A server that reads one request head and then does what ``handler`` does; counts the bytes it sent."""
    sent: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            sent.append(writer.transport.get_write_buffer_size())
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/", sent


async def endless(writer: asyncio.StreamWriter, head: bytes, piece: bytes, until: float = 20.0) -> None:
    writer.write(head)
    deadline = time.monotonic() + until
    while time.monotonic() < deadline:
        writer.write(piece)
        await writer.drain()


async def bad_chunking(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\nnope\r\n0\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(5)


async def huge_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await endless(writer, b"HTTP/1.1 200 OK\r\n", b"X-Filler: " + b"a" * 1000 + b"\r\n")


async def endless_chunks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    piece = b"4000\r\n" + b"b" * 0x4000 + b"\r\n"
    await endless(writer, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", piece)


async def cut_short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"c" * 10)
    await writer.drain()


async def bad_gzip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nContent-Encoding: gzip\r\n\r\nnot gzip at all"[:-3])
    await writer.drain()


async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
    await writer.drain()


async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)


@pytest.mark.parametrize("handler, error", [
    (bad_chunking, "malformed answer"),
    (huge_head, "malformed answer"),  # h11: the head is over MAX_HEAD
    (cut_short, "malformed answer"),  # closed before its Content-Length
    (bad_gzip, "does not decode"),
    (not_http, "malformed answer"),
])
async def test_a_hostile_answer_is_a_clear_error(handler: Handler, error: str) -> None:
    server, url, _ = await raw_server(handler)
    client = http1.Client()
    try:
        with pytest.raises(http1.ClientError, match=error):
            await client.request("GET", url, timeout=30)
        assert not client._idle  # a connection that failed is never pooled
    finally:
        await client.close()
        server.close()


async def test_an_endless_body_stops_at_the_limit_and_memory_stays_bounded() -> None:
    server, url, _ = await raw_server(endless_chunks)
    client = http1.Client(max_body=4 * 1024 * 1024)
    before = rss_mib()
    try:
        with pytest.raises(http1.ClientError, match="over 4194304 bytes"):
            await client.request("GET", url, timeout=60)
        assert rss_mib() - before < 40  # the 4 MiB kept and the pieces read, not what the server kept sending
    finally:
        await client.close()
        server.close()


async def test_a_slow_answer_times_out_for_a_request_and_for_a_stream_read() -> None:
    server, url, _ = await raw_server(slow)
    client = http1.Client()
    try:
        with pytest.raises(TimeoutError):
            await client.request("GET", url, timeout=0.5)
        with pytest.raises(TimeoutError):
            async with client.stream("GET", url, connect_timeout=0.5, read_timeout=0.5):
                pass
    finally:
        await client.close()
        server.close()


async def test_a_stream_read_waits_at_most_its_read_timeout_between_pieces() -> None:
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n")
        await writer.drain()
        await asyncio.sleep(30)

    server, url, _ = await raw_server(trickle)
    client = http1.Client()
    got: list[bytes] = []
    try:
        with pytest.raises(TimeoutError):
            async with client.stream("GET", url, read_timeout=0.5) as resp:
                assert resp.status == 200
                async for piece in resp.chunks():
                    got.append(piece)
        assert got == [b"one"]
    finally:
        await client.close()
        server.close()


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# -- the control channel to a real control plane over TLS ----------------------------------------------------
@pytest.fixture(scope="module")
def tls_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlaneProcess, harness.TestCA]]:
    ca = harness.make_test_ca(tmp_path_factory.mktemp("ca"))
    cp = prepare_controlplane(tmp_path_factory.mktemp("tlscp"), 1, 2, 3, tls=ca).start()
    try:
        yield cp, ca
    finally:
        cp.stop()


def channel(cp: ControlPlaneProcess, ident: Identity) -> ControlChannel:
    leaf = parse_chain_unverified(ident.wire)[-1].hash
    return ControlChannel(cp.url, ident.agent, leaf, keys.load_private(ident.key_path.read_bytes()),
                          run=f"run-{leaf[7:19]}")


async def test_the_channel_speaks_to_a_tls_control_plane_it_trusts(
        tls_plane: tuple[ControlPlaneProcess, harness.TestCA], monkeypatch: pytest.MonkeyPatch) -> None:
    cp, ca = tls_plane
    assert cp.url.startswith("https://")
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.ca_pem))  # the system trust store's override, as for aiohttp
    ident = cp.issue("h1-tls", {"issues.read": "direct"})
    ch = channel(cp, ident)
    try:
        registered = await ch.register(ident.wire)
        assert registered.agent == "h1-tls" and registered.jtis == [ident.jti]
        lease = await ch.heartbeat(Heartbeat(state="serving"))
        assert lease.lease_expires_at > time.time()
        answer = await ch.events(-1, 0.2)  # a long poll that ends with nothing new
        assert isinstance(answer, dict) and "events" in answer
        big = [json.dumps({"call_id": f"c{i}", "capability": "issues.read", "resolution": "refused"})
               for i in range(400)]  # over COMPRESS_ABOVE: sent gzip-compressed
        assert await ch.reports(big) == {"accepted": 400, "duplicates": 0}  # read compressed, signed
        stream = ch.stream_events(-1, idle_s=30)
        first = await asyncio.wait_for(anext(stream), 20)
        assert "next" in first
        await stream.aclose()
        assert len(ch.session._open) == 1  # the stream's connection closed; the calls' one kept alive
    finally:
        await ch.close()


async def test_a_tls_control_plane_it_does_not_trust_is_unreachable_and_says_why(
        tls_plane: tuple[ControlPlaneProcess, harness.TestCA]) -> None:
    cp, _ = tls_plane
    ident = cp.issue("h1-untrusted", {"issues.read": "direct"})
    ch = channel(cp, ident)
    try:
        with pytest.raises(ApiError) as failed:
            await ch.register(ident.wire)
        assert failed.value.code == CONTROLPLANE_UNREACHABLE
        assert "TLS: unable to get local issuer certificate" in failed.value.message, failed.value.message
        with pytest.raises(ApiError, match=r"event stream .* broken: TLS"):
            async for _ in ch.stream_events(-1):
                pass
    finally:
        await ch.close()


def test_messages_name_the_cause_in_a_few_words() -> None:
    from tether.proxy.channel import why

    assert why(TimeoutError()) == "timed out"
    assert why(ConnectionRefusedError(111, "Connect call failed")) == "connection refused"
    assert why(http1.ClientError("malformed answer: bad chunk")) == "malformed answer: bad chunk"


# -- a pooled connection is reused only when it is clean (review findings, 2026-12-03) ---------------------------
async def keep_alive_server(answer: Callable[[int, bytes], bytes | None]) -> tuple[asyncio.Server, str, list[bytes]]:
    """A server keeping each connection open: for the n-th request on a connection, writes ``answer(n, head)``
    (None: closes the connection instead, as a server whose keep-alive ran out does when the next one comes)."""
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                heads.append(head)
                out = answer(n, head)
                n += 1
                if out is None:
                    break
                writer.write(out)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/", heads


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s%s" % (len(body), body, extra)


async def test_a_connection_holding_bytes_nobody_asked_for_is_not_reused() -> None:
    # The first answer carries a second answer past its Content-Length: reused, the connection would hand that
    # to the next request as its answer, and every answer after it would be one late.
    def answer(_: int, head: bytes) -> bytes:
        path = head.split(b" ")[1]
        return ok(b"first", ok(b"INJECTED")) if path == b"/one" else ok(b"real " + path)

    server, url, _ = await keep_alive_server(answer)
    client = http1.Client()
    try:
        assert (await client.request("GET", url + "one")).body == b"first"
        await asyncio.sleep(0.05)
        assert (await client.request("GET", url + "two")).body == b"real /two"
        assert (await client.request("GET", url + "three")).body == b"real /three"
    finally:
        await client.close()
        server.close()


async def test_a_connection_the_server_wrote_to_while_idle_is_not_reused_for_a_heartbeat() -> None:
    stale = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 5\r\n\r\nSTALE"
    server, url, _ = await keep_alive_server(lambda _, head: ok(b"beat" if b"/heartbeat" in head else b"A"))
    client = http1.Client()
    try:
        assert (await client.request("GET", url)).body == b"A"
        (conn,) = [c for pool in client._idle.values() for c in pool]
        conn.reader.feed_data(stale)  # as if the server had sent it while the connection sat in the pool
        answer = await client.request("POST", url + "heartbeat", body=b"{}")
        assert (answer.status, answer.body) == (200, b"beat")
    finally:
        await client.close()
        server.close()


async def test_a_get_on_a_pooled_connection_the_server_closed_as_it_came_is_sent_again() -> None:
    server, url, heads = await keep_alive_server(lambda n, _: ok(b"ok") if n == 0 else None)
    client = http1.Client()
    try:
        await client.request("GET", url)
        answer = await client.request("GET", url)  # the pooled one closes on it (FIN, no byte): a new one answers
        assert answer.body == b"ok" and len(heads) == 3
        with pytest.raises(http1.ClientError):  # a POST is never sent twice: it may have been acted on
            await client.request("POST", url, body=b"{}")
        assert len(heads) == 4
    finally:
        await client.close()
        server.close()


@pytest.mark.parametrize("method, status_line", [
    ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 1234\r\n\r\n"),
    ("GET", b"HTTP/1.1 204 No Content\r\nContent-Encoding: gzip\r\n\r\n"),
    ("POST", b"HTTP/1.1 202 Accepted\r\nContent-Encoding: gzip\r\nContent-Length: 0\r\n\r\n"),
])
async def test_an_answer_without_a_body_is_empty_whatever_its_content_encoding(method: str, status_line: bytes) -> None:
    server, url, _ = await keep_alive_server(lambda n, _: status_line)
    client = http1.Client()
    try:
        answer = await client.request(method, url, body=b"{}" if method == "POST" else None)
        assert answer.body == b""
    finally:
        await client.close()
        server.close()


async def test_deflate_is_read_zlib_wrapped_and_raw() -> None:
    text = b"tether " * 1000
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    bodies = [zlib.compress(text), raw.compress(text) + raw.flush()]
    server, url, _ = await keep_alive_server(
        lambda n, _: b"HTTP/1.1 200 OK\r\nContent-Encoding: deflate\r\nContent-Length: %d\r\n\r\n%s"
        % (len(bodies[n % 2]), bodies[n % 2]))
    client = http1.Client()
    try:
        assert (await client.request("GET", url)).body == text
        assert (await client.request("GET", url)).body == text
    finally:
        await client.close()
        server.close()


async def test_the_wait_for_a_free_slot_counts_in_a_requests_deadline() -> None:
    server, url, _ = await raw_server(slow)
    client = http1.Client(limit=1)
    try:
        async with client.stream("GET", url, connect_timeout=0.5) as _:
            pass
    except TimeoutError:
        pass  # the slow server never answers the stream's head: it held the only slot until then
    try:
        held = asyncio.create_task(client.request("GET", url, timeout=30))  # holds the only slot
        await asyncio.sleep(0.1)
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            await client.request("GET", url, timeout=0.3)
        assert time.monotonic() - began < 10  # bounded by its own deadline (30 s if the slot wait were not)
        held.cancel()
    finally:
        await client.close()
        server.close()


async def test_a_stream_hands_a_compressed_flood_over_in_bounded_pieces() -> None:
    flood = gzip.compress(b"\0" * (64 * 1024 * 1024))  # 64 MiB of zeros in ~64 KiB

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s" % (len(flood), flood))
        await writer.drain()

    server, url, _ = await raw_server(handler)
    client = http1.Client()
    try:
        async with client.stream("GET", url) as answer:
            sizes = [len(piece) async for piece in answer.chunks()]
        assert sum(sizes) == 64 * 1024 * 1024 and max(sizes) <= http1.STREAM_PIECE
    finally:
        await client.close()
        server.close()
