"""Review of the streamed list filter through a real sidecar, against a server that writes raw bytes: a
Content-Length that lies (longer, shorter), trailing garbage, chunk extensions, an item naming its name twice."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .harness import SidecarProcess, free_port, prepare_controlplane

TOOLS = [{"name": "add", "description": "a" * 30000}] + [
    {"name": f"filler_{i:02d}", "description": "f" * 8000} for i in range(20)] + [
    {"name": "send_email", "description": "s" * 30000}]
BODY = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"tools": TOOLS}}).encode()
TWICE = BODY.replace(b'{"name": "filler_05"', b'{"name": "delete_everything", "name": "add"')


def answer(kind: str) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
    if kind == "long":  # says 1000 bytes more than it sends, and closes
        return head + b"Content-Length: %d\r\n\r\n" % (len(BODY) + 1000) + BODY
    if kind == "short":  # says 20 bytes fewer than its JSON text
        return head + b"Content-Length: %d\r\n\r\n" % (len(BODY) - 20) + BODY
    if kind == "garbage":  # a second JSON text after the message
        body = BODY + b'\n{"result": {"tools": [{"name": "delete_everything"}]}}'
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    body = TWICE if kind == "twice" else BODY
    pieces = [body[i:i + 5000] for i in range(0, len(body), 5000)]
    return head + b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(
        b"%x;ext=\"a;b\"\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0;last\r\n\r\n"


class RawMcp:
    """Answers every POST with the bytes ``answer`` makes for its ``x-answer`` header, then closes."""

    def __init__(self) -> None:
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        length = int(head.split("content-length:")[1].split("\r\n")[0]) if "content-length:" in head else 0
        await reader.readexactly(length)
        kind = head.split("x-answer:")[1].split("\r\n")[0].strip() if "x-answer:" in head else ""
        writer.write(answer(kind))
        await writer.drain()
        writer.close()

    def start(self) -> RawMcp:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(asyncio.start_server(self._serve, "127.0.0.1", self.port),
                                         self._loop).result(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RawMcp, SidecarProcess]]:
    server = RawMcp().start()
    cp = prepare_controlplane(tmp_path_factory.mktemp("liststream-review") / "cp", free_port(), free_port(),
                              server.port)
    cp.start()
    sidecar = SidecarProcess(cp, cp.issue("raw-lister", {"mcp.add": "direct", "mcp.send": "direct"}))
    try:
        sidecar.start()
        yield server, sidecar
    finally:
        sidecar.stop()
        cp.stop()
        server.stop()


def fetch(raw: tuple[RawMcp, SidecarProcess], kind: str) -> tuple[int | None, bytes]:
    server, sidecar = raw
    got, status = b"", None
    try:
        with httpx.Client(proxy=sidecar.proxy, trust_env=False, timeout=30) as client, client.stream(
                "POST", server.base + "/mcp", headers={"x-answer": kind, "content-type": "application/json"},
                content=json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})) as resp:
            status = resp.status_code
            for piece in resp.iter_raw():
                got += piece
    except httpx.HTTPError:
        pass
    return status, got


def listed(got: bytes) -> list[Any]:
    return [t["name"] for t in json.loads(got)["result"]["tools"]]


@pytest.mark.parametrize("kind", ["long", "short", "garbage"])
def test_an_answer_whose_length_lies_or_that_goes_on_is_never_a_whole_answer(
        raw: tuple[RawMcp, SidecarProcess], kind: str) -> None:
    status, got = fetch(raw, kind)
    assert b"delete_everything" not in got and b"filler_" not in got
    if status == 200 and got:
        with pytest.raises(ValueError):
            listed(got)


def test_chunk_extensions_and_an_item_naming_its_name_twice(raw: tuple[RawMcp, SidecarProcess]) -> None:
    status, got = fetch(raw, "chunked")
    assert status == 200 and listed(got) == ["add", "send_email"]
    status, got = fetch(raw, "twice")
    assert status == 200 and b"delete_everything" not in got and listed(got) == ["add", "send_email"]
