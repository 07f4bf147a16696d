"""Streamed answers are captured as they pass (issue 21, item 6): SSE (every tool result of the SDKs' default
servers), chunked and large bodies land in the capture up to 1 MiB per flow, and the flow says when the capture
holds only the first part. Real parts: the harness's tool server and MCP server, a sidecar subprocess."""

from __future__ import annotations

import asyncio
import json

import pytest
import requests
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from tether.capture.segments import read_flows

from .conftest import World
from .harness import SidecarProcess, wait_until


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
