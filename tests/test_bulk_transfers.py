"""Large bodies pass mitmproxy in bulk (tether/proxy/framing.py, ``bulk_transfers()``; issue 28 item 4): reads of up
to 1 MiB, h11's receive buffer handed over whole. What passes, and in what order, is what passed before: h11's
readers against a model over random splits of the input, a reader's pieces, and large bodies both ways through a
real sidecar over HTTP and HTTPS, chunked and not, compared byte for byte."""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Iterator
from pathlib import Path

import h11
import pytest
import requests
from h11._readers import ChunkedReader, ContentLengthReader
from h11._receivebuffer import ReceiveBuffer
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.proxy.framing import BULK_READ, bulk_transfers, read_in_bulk

from .conftest import World, build_world, teardown_world
from .harness import SidecarProcess, TestCA

bulk_transfers()  # as the sidecar does: the readers below run with the patched buffer


def _feed(reader: object, pieces: list[bytes]) -> tuple[bytes, bool]:
    """Run an h11 body reader over ``pieces`` arriving one by one: the body it extracted, and whether it ended."""
    buf = ReceiveBuffer()
    out = bytearray()
    for piece in pieces or [b""]:  # an empty body ends without a byte arriving
        buf += piece
        while True:
            event = reader(buf)  # type: ignore[operator]
            if event is None:
                break
            if isinstance(event, h11.EndOfMessage):
                return bytes(out), True
            out += bytes(event.data)
    return bytes(out), False


def _splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=3000), cuts=st.lists(st.integers(min_value=0), max_size=12),
       extra=st.binary(max_size=20))
def test_a_content_length_body_reads_the_same_however_it_arrives(body: bytes, cuts: list[int], extra: bytes) -> None:
    got, ended = _feed(ContentLengthReader(len(body)), _splits(body + extra, cuts))
    assert (got, ended) == (body, True)


@settings(max_examples=200, deadline=None)
@given(chunks=st.lists(st.binary(min_size=1, max_size=700), max_size=6), cuts=st.lists(st.integers(min_value=0),
                                                                                       max_size=12))
def test_a_chunked_body_reads_the_same_however_it_arrives(chunks: list[bytes], cuts: list[int]) -> None:
    wire = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    got, ended = _feed(ChunkedReader(), _splits(wire, cuts))
    assert (got, ended) == (b"".join(chunks), True)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.one_of(st.binary(max_size=50), st.integers(min_value=0, max_value=80)), max_size=30))
def test_the_receive_buffer_extracts_what_a_plain_buffer_would(ops: list[bytes | int]) -> None:
    buf, model = ReceiveBuffer(), b""
    for op in ops:
        if isinstance(op, bytes):
            buf += op
            model += op
            continue
        got = buf.maybe_extract_at_most(op)
        want, model = model[:op], model[op:]
        assert (bytes(got) if got is not None else b"") == want
        assert bytes(buf) == model and len(buf) == len(model)
        if got is not None:  # what was handed over is not the buffer's any more
            got += b"!"
            assert bytes(buf) == model
    assert buf.maybe_extract_next_line() == (None if b"\r\n" not in model else model[: model.index(b"\r\n") + 2])


def test_a_reader_hands_over_what_arrived_up_to_the_bulk_size() -> None:
    async def run() -> list[int]:
        reader = asyncio.StreamReader()
        read_in_bulk(reader)
        reader.feed_data(b"a" * (BULK_READ + 5000))
        sizes = [len(await reader.read(65535)), len(await reader.read(65535))]
        reader.feed_data(b"b" * 10)  # a small piece is returned as it is: nothing waits for more
        sizes.append(len(await reader.read(65535)))
        reader.feed_eof()
        sizes.append(len(await reader.read(65535)))
        return sizes

    assert asyncio.run(run()) == [BULK_READ, 5000, 10, 0]


SECURE_ECHO = '  secure.echo: {{http: {{host: localhost, port: {port}, methods: [POST], path: "/echo"}}}}\n'


@pytest.fixture
def echo_world(tmp_path: Path, test_ca: TestCA) -> Iterator[World]:
    """The usual world, whose catalog also lets a POST to the TLS tool server's /echo through."""
    w = build_world(tmp_path, test_ca)
    w.cp.catalog_path.write_text(w.cp.catalog_path.read_text().replace(
        "roles:", SECURE_ECHO.format(port=w.secure.port) + "roles:"))
    w.cp.start()
    try:
        yield w
    finally:
        teardown_world(w)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_large_bodies_pass_the_sidecar_both_ways_intact(echo_world: World, scheme: str) -> None:
    """6 MiB up (with a Content-Length, then chunked in uneven pieces) and 6 MiB back (the echo's answer), both
    streamed by the sidecar (over 1 MiB), equal byte for byte."""
    world = echo_world
    sc: SidecarProcess = world.sidecar(world.cp.issue("bulk", {"echo.any": "direct", "secure.echo": "direct"}))
    base = world.tools.base if scheme == "http" else f"https://localhost:{world.secure.port}"
    body = secrets.token_hex(3 << 20)  # 6 MiB of text (the echo answers it inside JSON)

    def pieces() -> Iterator[bytes]:
        data, at, step = body.encode(), 0, 1
        while at < len(data):
            yield data[at:at + step]
            at, step = at + step, step * 3 + 1

    for data in (body.encode(), pieces()):
        resp = requests.post(f"{base}/echo", data=data, proxies=sc.proxies(), verify=sc.ca, timeout=120)
        assert resp.status_code == 200, resp.text[:500]
        assert resp.json()["body"] == body
