"""The chunked relay passes the agent's chunk framing to the upstream as it is: only framing that every parser
reads the same way may pass so (a real sidecar, a raw upstream that logs what it parses)."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from h11._readers import ChunkedReader

from tether.proxy.relay import CHUNK_SIZE_MAX, ChunkPos, ChunkScan, chunk_reader, scan_chunks

from .conftest import World, build_world, teardown_world
from .harness import TestCA, free_port, wait_until

UPSTREAM_CAPS = """  raw.up: {{http: {{host: 127.0.0.1, port: {port}, methods: [POST], path: "/up"}}}}
"""


class Wrapping32Upstream:
    """A raw HTTP/1.1 upstream whose chunk-size parser keeps 32 bits (as some embedded and legacy servers do):
    it logs every request line it parses and every byte it receives, answering each request ``200``."""

    def __init__(self) -> None:
        self.port = free_port()
        self.lines: list[bytes] = []
        self.received = bytearray()
        self._server = socket.create_server(("127.0.0.1", self.port))

    def start(self) -> Wrapping32Upstream:
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        buf = bytearray()

        def line() -> bytes:
            while b"\r\n" not in buf:
                got = conn.recv(65536)
                if not got:
                    raise EOFError
                self.received.extend(got)
                buf.extend(got)
            end = buf.index(b"\r\n")
            out = bytes(buf[:end])
            del buf[:end + 2]
            return out

        def take(n: int) -> None:
            while len(buf) < n:
                got = conn.recv(65536)
                if not got:
                    raise EOFError
                self.received.extend(got)
                buf.extend(got)
            del buf[:n]

        with conn:
            try:
                while True:
                    self.lines.append(line())
                    chunked = False
                    while field := line():
                        chunked |= field.lower().replace(b" ", b"") == b"transfer-encoding:chunked"
                    while chunked and (size := int(re.match(rb"[0-9a-fA-F]*", line()).group() or b"0", 16)
                                       % (1 << 32)):
                        take(size + 2)
                    if chunked:
                        while line():
                            pass
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            except (EOFError, OSError):
                return


@pytest.fixture
def raw_world(tmp_path: Path, test_ca: TestCA) -> Iterator[tuple[World, Wrapping32Upstream]]:
    upstream = Wrapping32Upstream().start()
    w = build_world(tmp_path, test_ca)
    w.cp.catalog_path.write_text(w.cp.catalog_path.read_text().replace(
        "roles:", UPSTREAM_CAPS.format(port=upstream.port) + "roles:"))
    w.cp.start()
    try:
        yield w, upstream
    finally:
        teardown_world(w)
        upstream.stop()


def test_a_chunk_size_past_32_bits_is_not_relayed_raw_so_no_request_is_smuggled_inside_it(
        raw_world: tuple[World, Wrapping32Upstream]) -> None:
    """A chunked upload tether decided (POST /up), then a chunk-size line of 0x100000005 whose "data" holds the
    last chunk and a second request. Relayed raw, an upstream that keeps 32 bits of the size reads 5 bytes of
    data, the end of the body, and a request tether never saw (smuggled past the kill switch). mitmproxy's path
    re-frames the chunk (sizes of its own): the upstream parses one request, and never sees the agent's line."""
    world, upstream = raw_world
    sc = world.sidecar(world.cp.issue("raw-chunks", {"raw.up": "direct"}))
    host, port = sc.proxy.removeprefix("http://").split(":")
    url = f"http://127.0.0.1:{upstream.port}/up"
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(f"POST {url} HTTP/1.1\r\nHost: 127.0.0.1:{upstream.port}\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n".encode())
        wait_until(lambda: b"hello" in upstream.received, 30, what="the first chunk upstream")
        conn.sendall(b"3\r\nabc\r\n")  # read by mitmproxy's path, which then arms the relay for the next read
        wait_until(lambda: b"abc" in upstream.received, 30, what="the second chunk upstream")
        smuggled = b"DELETE /admin HTTP/1.1\r\nHost: x\r\n\r\n"
        conn.sendall(b"100000005\r\nworld\r\n0\r\n\r\n" + smuggled + b"x" * 200_000)
        wait_until(lambda: len(upstream.received) > 200_000, 30, what="the long chunk's bytes upstream")
    assert b"100000005\r\n" not in upstream.received
    assert all(not line.startswith(b"DELETE") for line in upstream.lines), upstream.lines


def test_only_canonical_chunk_sizes_below_256_mib_are_relayed_and_a_larger_rest_is_not_started() -> None:
    """The scan stops before a leading zero, 8 digits or more, and relays 1 to 7 digits of either case; a relay
    does not start inside a chunk with more than ``CHUNK_SIZE_MAX`` left (it would frame that rest itself)."""
    for line in (b"05", b"10000000", b"100000005", b"ffffffffffffffff"):
        assert scan_chunks(ChunkPos(), line + b"\r\nhello\r\n") == ChunkScan(0, 0, ChunkPos(), True), line
    for line, size in ((b"5", 5), (b"aBc", 0xABC), (b"fffffff", CHUNK_SIZE_MAX)):
        assert scan_chunks(ChunkPos(), line + b"\r\n") == ChunkScan(len(line) + 2, 0, ChunkPos(size, True), False)
    reader = ChunkedReader()
    reader._bytes_in_chunk = CHUNK_SIZE_MAX + 1
    assert chunk_reader(reader) is None
    reader._bytes_in_chunk = CHUNK_SIZE_MAX
    assert chunk_reader(reader) is reader
