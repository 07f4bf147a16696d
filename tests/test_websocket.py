"""Websockets are governed, not refused (issue 21, item 5).

An http capability with ``websocket: true`` lets a GET there upgrade; the upgrade is decided like any call, frames
pass both ways, and the whole connection is one call in flight: reported when it closes, cut (``unknown``,
``tether.aborted``) by an abort, captured with its messages up to a bound. A websocket where no capability says
``websocket: true`` is refused before the server sees it. Real parts: the harness's aiohttp tool server (an echo
websocket at /ws and /ws-plain), a sidecar subprocess, aiohttp's websocket client through the proxy (as an
``http://`` URL: mitmproxy's explicit mode refuses the ``ws://`` absolute form with its own 400; enforced, where
clients dial ``ws://`` directly, tests/test_enforced.py covers it).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp

from tether.capture.segments import read_flows

from .conftest import World
from .harness import SidecarProcess, reports_for, wait_until


def _sidecar(world: World, agent: str, caps: dict[str, str]) -> SidecarProcess:
    ident = world.cp.issue(agent, caps)
    sc = SidecarProcess(world.cp, ident).start()
    world.sidecars.append(sc)
    return sc


async def _talk(proxy: str, url: str, messages: list[str | bytes], *, hold_s: float = 0.0) -> dict[str, Any]:
    out: dict[str, Any] = {"echoes": []}
    async with aiohttp.ClientSession() as session:
        try:
            async with session.ws_connect(url, proxy=proxy, timeout=aiohttp.ClientWSTimeout(ws_close=5)) as ws:
                for m in messages:
                    await (ws.send_str(m) if isinstance(m, str) else ws.send_bytes(m))
                    reply = await ws.receive(timeout=20)
                    out["echoes"].append(reply.data)
                deadline = time.monotonic() + hold_s
                while time.monotonic() < deadline:
                    reply = await ws.receive(timeout=max(0.1, deadline - time.monotonic()))
                    if reply.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                        out["closed_by_tether"] = True
                        break
        except aiohttp.WSServerHandshakeError as exc:
            out["refused"] = (exc.status, exc.headers.get("Tether-Error") if exc.headers else None)
        except TimeoutError:
            out["timeout"] = True
    return out


def _report(world: World, agent: str, path: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        return next((r for r in reports_for(world.cp, agent) if r.get("url", "").endswith(path)
                     and r.get("resolution")), None)

    return wait_until(found, 30, what=f"the report of {agent}'s websocket")


def test_a_granted_websocket_passes_frames_and_is_one_call_reported_at_its_close(world: World) -> None:
    sc = _sidecar(world, "ws-agent", {"ws.chat": "direct"})
    out = asyncio.run(_talk(sc.proxy, f"http://127.0.0.1:{world.tools.port}/ws", ["hello", b"\x00" * 10, "bye"]))
    assert out["echoes"] == ["echo: hello", "echo: 10 bytes", "echo: bye"], out
    assert world.tools.ws_messages == ["hello", "<10 bytes>", "bye"]
    report = _report(world, "ws-agent", "/ws")
    assert report["resolution"] == "completed" and report["capability"] == "ws.chat", report
    assert "websocket closed by the client" in (report.get("detail") or ""), report
    [flow] = [f for f in read_flows(sc.state_dir / "captures" / "flows.mitm") if f.request.path == "/ws"]
    assert flow.websocket is not None
    assert [m.content for m in flow.websocket.messages] == [b"hello", b"echo: hello", b"\x00" * 10,
                                                            b"echo: 10 bytes", b"bye", b"echo: bye"]


def test_a_websocket_no_capability_grants_is_refused_before_the_server_sees_it(world: World) -> None:
    sc = _sidecar(world, "ws-plain-agent", {"ws.plain": "direct", "ws.chat": "absent"})
    before = world.tools.hits_for("/ws-plain")
    out = asyncio.run(_talk(sc.proxy, f"http://127.0.0.1:{world.tools.port}/ws-plain", ["x"]))
    assert out.get("refused") == (403, "tether.capability_absent"), out
    out = asyncio.run(_talk(sc.proxy, f"http://127.0.0.1:{world.tools.port}/ws", ["x"]))  # granted absent
    assert out.get("refused") == (403, "tether.capability_absent"), out
    assert world.tools.hits_for("/ws-plain") == before and world.tools.ws_messages == []


def test_an_abort_cuts_an_open_websocket_and_the_record_says_so(world: World) -> None:
    sc = _sidecar(world, "ws-abort", {"ws.chat": "direct"})

    async def scenario() -> dict[str, Any]:
        talk = asyncio.create_task(_talk(sc.proxy, f"http://127.0.0.1:{world.tools.port}/ws", ["first"],
                                         hold_s=60))
        await asyncio.to_thread(wait_until, lambda: "first" in world.tools.ws_messages, 20, what="the first frame")
        doc = await asyncio.to_thread(world.cp.client().request, "POST", "/v1/agents/ws-abort/terminate",
                                      {"mode": "abort", "window_s": 0, "reason": "test"})
        out = await talk
        out["termination"] = doc["id"]
        return out

    out = asyncio.run(scenario())
    assert out["echoes"] == ["echo: first"] and out.get("closed_by_tether"), out

    def terminated() -> bool:
        return world.cp.client().request("GET", f"/v1/terminations/{out['termination']}")["state"] == "terminated"

    wait_until(terminated, 60, what="the termination to finish")
    rec = world.cp.client().request("GET", f"/v1/records/{out['termination']}")
    [call] = [c for c in rec["calls"] if c.get("url", "").endswith("/ws")]
    assert call["resolution"] == "unknown" and call.get("code") == "tether.aborted", call


def test_a_long_websocket_keeps_its_capture_bounded_and_every_frame_passes(world: World, tmp_path: Path) -> None:
    sc = _sidecar(world, "ws-long", {"ws.chat": "direct"})
    chunk = "x" * (256 * 1024)
    out = asyncio.run(_talk(sc.proxy, f"http://127.0.0.1:{world.tools.port}/ws", [chunk] * 12))  # 3 MiB each way
    assert len(out["echoes"]) == 12 and all(e == f"echo: {chunk}" for e in out["echoes"])
    assert _report(world, "ws-long", "/ws")["resolution"] == "completed"
    [flow] = [f for f in read_flows(sc.state_dir / "captures" / "flows.mitm") if f.request.path == "/ws"]
    kept = sum(len(m.content) for m in flow.websocket.messages)
    assert 0 < kept <= (1 << 20) + len(chunk) + 16, kept  # the bound, plus the message that crossed it
