"""Streamed answers are captured as they pass (issue 21, item 6): SSE (every tool result of the SDKs' default
servers), chunked and large bodies land in the capture up to 1 MiB per flow, and the flow says when the capture
holds only the first part. Real parts: the harness's tool server and MCP server, a sidecar subprocess."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import requests
from aiohttp import web
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from tether.capture.segments import read_flows

from .conftest import World
from .harness import SidecarProcess, ToolServer, free_port, prepare_controlplane, wait_until


def _flows(sc: SidecarProcess, path: str) -> list:
    return [f for f in read_flows(sc.state_dir / "captures" / "flows.mitm") if f.request.path.startswith(path)]


def test_sse_chunked_and_large_answers_are_in_the_capture_up_to_the_bound(world: World,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ident = world.cp.issue("stream-capture", {"stream.read": "direct", "big.read": "direct", "mcp.add": "direct"})
    sc = SidecarProcess(world.cp, ident).start()
    world.sidecars.append(sc)
    resp = requests.get(f"{world.tools.base}/sse?n=4&delay=0.05", proxies=sc.proxies(), timeout=30)
    assert resp.status_code == 200 and resp.text.count("event: tick") == 4
    resp = requests.get(f"{world.tools.base}/big?mb=3", proxies=sc.proxies(), timeout=60)
    assert len(resp.content) == 3 * 1024 * 1024

    async def mcp_call() -> str:
        async with streamable_http_client(world.mcp.url) as (r, w, *_), ClientSession(r, w) as session:
            await session.initialize()
            return (await session.call_tool("add", {"a": 20, "b": 22})).content[0].text

    for name, value in (("HTTP_PROXY", sc.proxy), ("http_proxy", sc.proxy), ("NO_PROXY", ""), ("no_proxy", "")):
        monkeypatch.setenv(name, value)  # the SDK's client follows the proxy variables
    assert asyncio.run(mcp_call()) == "42"

    def captured() -> bool:
        return bool(_flows(sc, "/sse")) and bool(_flows(sc, "/big")) and any(
            b'"result"' in (f.response.raw_content or b"") for f in _flows(sc, "/mcp") if f.response is not None)

    wait_until(captured, 20, what="the streamed answers in the capture")
    [sse] = _flows(sc, "/sse")
    assert sse.response.raw_content.count(b"event: tick") == 4 and not sse.comment
    [big] = _flows(sc, "/big")
    assert len(big.response.raw_content) == 1 << 20
    assert f"first {1 << 20} of {3 * 1024 * 1024} bytes" in big.comment
    results = [f for f in _flows(sc, "/mcp") if f.response is not None and b'"result"' in f.response.raw_content]
    texts = [json.loads(line[5:]) for f in results for line in f.response.raw_content.decode().splitlines()
             if line.startswith("data:")]
    assert any(m.get("result", {}).get("content", [{}])[0].get("text") == "42" for m in texts), texts


class BigListServer(ToolServer):
    """POST /mcp: ``tools/list`` answers about ``mb`` MB of JSON (one body, filtered by the sidecar's list filter
    as it arrives and captured whole), each tool with a key redaction walks; anything else answers ``add`` at
    once."""

    def __init__(self, mb: int = 10) -> None:
        super().__init__()
        item = {"description": "x" * 40, "inputSchema": {"type": "object", "token": "in-every-tool"}}  # many keys
        count = mb * (1 << 20) // (len(json.dumps(item)) + 30)
        self.tools = [{"name": "add", "description": "adds", "inputSchema": {"type": "object"}}]
        self.tools += [{"name": f"tool_{i % 50:02d}", **item} for i in range(count)]  # 50 names, granted

    def _app(self) -> web.Application:
        async def mcp(request: web.Request) -> web.Response:
            sent = json.loads(await request.read())
            result = {"tools": self.tools} if sent.get("method") == "tools/list" else {
                "content": [{"type": "text", "text": "2"}]}
            return web.json_response({"jsonrpc": "2.0", "id": sent.get("id"), "result": result})

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/mcp", mcp)
        return app


MCP_HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream"}


def test_a_big_answer_s_capture_blocks_no_other_call_and_a_stop_right_after_keeps_it(tmp_path: Path) -> None:
    """Issue 23 item 6: a 10 MB ``tools/list`` the agent holds whole is captured whole, its final state encoded
    off the sidecar's event loop (tests/test_capture.py holds the thread to it): a call right after it is
    answered while that capture is being written, and a sidecar stopped at once still writes it before it ends."""
    upstream = BigListServer().start()
    cp = prepare_controlplane(tmp_path / "cp", free_port(), free_port(), upstream.port)
    caps = "".join(f'  list.tool_{i:02d}: {{mcp: {{url: "http://127.0.0.1:{upstream.port}/mcp", '
                   f'tool: tool_{i:02d}}}}}\n' for i in range(50))
    cp.catalog_path.write_text(cp.catalog_path.read_text().replace("roles:", caps + "roles:"))
    cp.start()
    sc = SidecarProcess(cp, cp.issue("big-list", {"mcp.add": "direct",
                                                  **{f"list.tool_{i:02d}": "direct" for i in range(50)}}))
    try:
        sc.start()
        url = f"http://127.0.0.1:{upstream.port}/mcp"
        with requests.Session() as agent, requests.Session() as other:
            listed = agent.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                                headers=MCP_HEADERS, proxies=sc.proxies(), timeout=120)
            assert listed.status_code == 200 and len(listed.json()["result"]["tools"]) == len(upstream.tools)
            add = other.post(url, json={"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                                        "params": {"name": "add", "arguments": {"a": 1, "b": 1}}},
                             headers=MCP_HEADERS, proxies=sc.proxies(), timeout=120)
            assert add.status_code == 200 and add.json()["result"]["content"][0]["text"] == "2"
        sc.stop()  # at once: the big answer's final state may still be being encoded
        assert sc.proc is not None and sc.proc.wait(60) == 0, sc.log_text[-2000:]
    finally:
        sc.stop()
        cp.stop()
        upstream.stop()
    flows = read_flows(sc.state_dir / "captures" / "flows.mitm")
    [big] = [f for f in flows if f.response is not None and b"tools/list" in (f.request.content or b"")]
    body = big.response.content or b""
    assert len(body) > 9 << 20 and b"in-every-tool" not in body and not big.comment
    assert json.loads(body)["result"]["tools"][1]["inputSchema"]["token"] == "[REDACTED]"
    assert any(f.response is not None and b'"text": "2"' in (f.response.content or b"") for f in flows)
    assert "capture failed" not in sc.log_text
