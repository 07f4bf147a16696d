"""A large JSON ``tools/list`` through a real sidecar, filtered as it arrives (``tether/proxy/liststream.py``,
``tether/proxy/streamlayer.py``): the official SDK client reads the granted tools of a chunked multi-MB list; the
first judged bytes reach the agent while the server is still writing; an answer the stream cannot read falls back
to the buffered filter before its first byte (refused as when held whole); one that breaks after it is cut."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from aiohttp import web
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tether.capture.segments import read_flows

from .harness import SidecarProcess, ToolServer, free_port, prepare_controlplane, wait_until

BIG = 1 << 20  # characters of description on each granted tool


def tool(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "description": description, "inputSchema": {"type": "object"}}


TOOLS = [tool("add", "a" * BIG)] + [tool(f"filler_{i:03d}", "f" * 8000) for i in range(200)] + [
    tool("send_email", "s" * BIG), tool("delete_everything", "d" * 100)]


class BigListMcp(ToolServer):
    """Enough of an MCP server for the SDK (initialize, notifications, tools/list), answering JSON; ``tools/list``
    is written chunked in 256 KiB writes (so the sidecar judges pieces of 64 KiB or more, in a worker thread), the
    other answers in 8 KiB writes. The ``x-answer`` header picks another answer: ``pause`` (the list, which
    waits after its first tools until ``release`` is set), ``broken`` (a malformed item after the first ones,
    sent once released), ``html`` (100 KB that is not JSON, with a Content-Length)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.released_in_time: bool | None = None

    def _app(self) -> web.Application:
        async def handle(request: web.Request) -> web.StreamResponse:
            if request.method != "POST":
                return web.Response(status=405)
            sent = json.loads(await request.read())
            if "id" not in sent:
                return web.Response(status=202)
            if sent["method"] == "initialize":
                return web.json_response({"jsonrpc": "2.0", "id": sent["id"], "result": {
                    "protocolVersion": sent["params"]["protocolVersion"], "capabilities": {"tools": {}},
                    "serverInfo": {"name": "big-list", "version": "1"}}})
            answer = request.headers.get("x-answer", "")
            if answer == "html":
                return web.Response(body=b"<html>" + b"busy " * 20000 + b"</html>", content_type="application/json")
            body = json.dumps({"jsonrpc": "2.0", "id": sent["id"], "result": {"tools": TOOLS}}).encode()
            if answer == "broken":
                head = json.dumps({"jsonrpc": "2.0", "id": sent["id"], "result": {"tools": TOOLS[:3]}})[:-3]
                body = head.encode() + b', {"name": "delete_everything", "x": tru}]}}'
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            first = len(body)  # the first byte it holds back until released
            if answer == "pause":
                first = body.index(b'"filler_010"')  # the add tool (1 MiB) and ten others written
            elif answer == "broken":
                first = len(body) - 40
            step = 8192 if answer else 256 << 10  # the list itself in large writes: pieces judged in a thread
            for i in range(0, len(body), step):
                if i >= first and self.released_in_time is None:
                    self.released_in_time = await asyncio.to_thread(self.release.wait, 20)
                await resp.write(body[i:i + step])
            await resp.write_eof()
            return resp

        app = web.Application()
        app.router.add_route("*", "/mcp", handle)
        return app


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BigListMcp, SidecarProcess]]:
    server = BigListMcp().start()
    cp = prepare_controlplane(tmp_path_factory.mktemp("liststream") / "cp", free_port(), free_port(), server.port)
    cp.start()
    sidecar = SidecarProcess(cp, cp.issue("big-lister", {"mcp.add": "direct", "mcp.send": "direct"}))
    try:
        sidecar.start()
        yield server, sidecar
    finally:
        sidecar.stop()
        cp.stop()
        server.stop()


def post(sidecar: SidecarProcess, server: BigListMcp, answer: str) -> httpx.Response:
    with httpx.Client(proxy=sidecar.proxy, trust_env=False, timeout=60) as client:
        return client.post(server.base + "/mcp", headers={"x-answer": answer, "content-type": "application/json",
                                                           "accept": "application/json, text/event-stream"},
                           content=json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).encode())


def test_the_sdk_client_lists_the_granted_tools_of_a_big_chunked_list(big: tuple[BigListMcp, SidecarProcess]) -> None:
    server, sidecar = big

    async def listed() -> list[Any]:
        async with httpx2.AsyncClient(proxy=sidecar.proxy, trust_env=False, timeout=60) as http_client, \
                Client(streamable_http_client(server.base + "/mcp", http_client=http_client),
                       mode="legacy") as client:
            return list((await client.list_tools()).tools)

    tools = asyncio.run(listed())
    assert [(t.name, t.description) for t in tools] == [("add", "a" * BIG), ("send_email", "s" * BIG)]
    flows = wait_until(lambda: [f for f in read_flows(sidecar.state_dir / "captures" / "flows.mitm")
                                if f.response is not None and b"tools/list" in (f.request.content or b"")],
                       timeout=30, what="the list answer's capture")
    captured = flows[-1].response.content or b""
    assert [t["name"] for t in json.loads(captured)["result"]["tools"]] == ["add", "send_email"]  # the whole body
    assert not flows[-1].comment


def test_the_first_judged_bytes_reach_the_agent_while_the_server_still_writes(
        big: tuple[BigListMcp, SidecarProcess]) -> None:
    server, sidecar = big
    server.release.clear()
    server.released_in_time = None
    got = b""
    with httpx.Client(proxy=sidecar.proxy, trust_env=False, timeout=60) as client, client.stream(
            "POST", server.base + "/mcp", content=json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
            headers={"x-answer": "pause", "content-type": "application/json"}) as resp:
        assert resp.status_code == 200 and "content-length" not in resp.headers
        for piece in resp.iter_bytes():
            if not got:
                assert piece.startswith(b'{"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "add"')
                server.release.set()  # the server has written 1 of 3.6 MB and waits for this
            got += piece
    assert server.released_in_time is True, "the agent read nothing before the whole answer had been written"
    assert [t["name"] for t in json.loads(got)["result"]["tools"]] == ["add", "send_email"]


def test_an_answer_the_stream_cannot_read_is_refused_as_when_held_whole(big: tuple[BigListMcp, SidecarProcess]) -> None:
    server, sidecar = big
    resp = post(sidecar, server, "html")
    assert resp.status_code == 200 and resp.headers["Tether-Error"] == "tether.capability_absent"
    assert resp.json()["error"]["data"]["reason"] == "unfilterable_answer"


def test_an_answer_that_breaks_after_its_first_bytes_is_cut(big: tuple[BigListMcp, SidecarProcess],
                                                            tmp_path: Path) -> None:
    server, sidecar = big
    server.release.clear()
    server.released_in_time = None
    got = b""
    with pytest.raises(httpx.HTTPError), \
            httpx.Client(proxy=sidecar.proxy, trust_env=False, timeout=60) as client, client.stream(
            "POST", server.base + "/mcp", content=json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
            headers={"x-answer": "broken", "content-type": "application/json"}) as resp:
        for piece in resp.iter_bytes():
            server.release.set()
            got += piece
    assert got.startswith(b'{"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "add"')
    assert b"delete_everything" not in got and b"filler_" not in got
    with pytest.raises(ValueError):
        json.loads(got)
    assert wait_until(lambda: "cutting a list answer" in sidecar.log_text, timeout=10, what="the cut in the log")
