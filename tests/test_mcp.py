"""MCP through the sidecar, end to end, with the official SDK on both sides.

The agent is ``tests/agents/mcp_agent.py``: the SDK's ``Client`` in its own process, put behind the
sidecar by proxy environment variables only (and once by ``tether run``, exactly as a user would).
The server is the SDK's ``MCPServer`` over streamable HTTP, in SSE mode (the world's) and in JSON mode.
A wiretap on the server's ASGI app records every HTTP request that reaches it, so "the server never
saw it" is checked at the server, not taken from tether's own reports.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from . import harness
from .conftest import World, teardown_world
from .harness import (
    PYTHON,
    ControlPlaneProcess,
    Identity,
    McpServer,
    SidecarProcess,
    ToolServer,
    prepare_controlplane,
    reports_for,
    wait_until,
)

AGENT_SCRIPT = Path(__file__).parent / "agents" / "mcp_agent.py"
ALL_TOOLS = ["add", "delete_everything", "send_email", "slow"]
REFUSED_JSONRPC = -32003
MODERN = "2026-07-28"
WAIT = 30.0  # bounded waits, generous for a loaded machine; nothing asserts on timing


# -- the world, with a wiretap on the MCP server ------------------------------------------------------
class Wiretap:
    """ASGI middleware in front of the MCP server: records (method, headers, body) of every HTTP request."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.requests: list[tuple[str, dict[str, str], bytes]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        entry = (scope["method"], headers, b"")
        self.requests.append(entry)
        index = len(self.requests) - 1

        async def recording_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request":
                method, hdrs, body = self.requests[index]
                self.requests[index] = (method, hdrs, body + message.get("body", b""))
            return message

        await self.app(scope, recording_receive, send)

    def bodies(self) -> list[bytes]:
        return [body for _, _, body in self.requests]

    def saw(self, marker: str) -> bool:
        return any(marker.encode() in body for body in self.bodies())

    def clear(self) -> None:
        self.requests.clear()


@dataclass
class McpWorld:
    """One world per server mode, shared by the tests of this module (each test uses its own agents)."""

    world: World
    wiretap: Wiretap

    @property
    def cp(self) -> ControlPlaneProcess:
        return self.world.cp

    @property
    def mcp(self) -> McpServer:
        return self.world.mcp

    def sidecar(self, identity: Identity) -> SidecarProcess:
        return self.world.sidecar(identity)


def tap(server: McpServer) -> Wiretap:
    config = server._server.config  # uvicorn builds each connection's protocol from config.loaded_app
    wiretap = Wiretap(config.loaded_app)
    config.loaded_app = wiretap
    return wiretap


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory, test_ca: harness.TestCA) -> Iterator[dict[str, McpWorld]]:
    """Two worlds: the MCP server answers in SSE mode (the SDK default) in one, in JSON mode in the other."""
    out: dict[str, McpWorld] = {}
    try:
        for mode in ("sse", "json"):
            directory = tmp_path_factory.mktemp(f"mcp-{mode}")
            tools = ToolServer().start()
            secure = ToolServer(tls=test_ca).start()
            server = McpServer(json_response=mode == "json").start()
            cp = prepare_controlplane(directory / "cp", tools.port, secure.port, server.port)
            out[mode] = McpWorld(World(directory, tools, secure, server, test_ca, cp), tap(server))
            cp.start()
        yield out
    finally:
        for w in out.values():
            teardown_world(w.world)


def _fresh(w: McpWorld) -> Iterator[McpWorld]:
    w.mcp.calls.clear()
    w.wiretap.clear()
    try:
        yield w
    finally:
        for sidecar in w.world.sidecars:
            sidecar.stop()
        w.world.sidecars.clear()


@pytest.fixture(params=["sse", "json"])
def any_world(request: pytest.FixtureRequest, worlds: dict[str, McpWorld]) -> Iterator[McpWorld]:
    yield from _fresh(worlds[request.param])


@pytest.fixture
def world(worlds: dict[str, McpWorld]) -> Iterator[McpWorld]:
    """The SSE-mode world (the conftest fixture of the same name would start a world per test)."""
    yield from _fresh(worlds["sse"])


# -- the agent, as a separate process behind the proxy ------------------------------------------------
def proxy_env(proxy: str | None, ca: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.lower() not in (
        "http_proxy", "https_proxy", "all_proxy", "no_proxy")}
    if proxy is not None:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
            env[name] = proxy
        env["NO_PROXY"] = env["no_proxy"] = ""
    if ca is not None:
        env["SSL_CERT_FILE"] = ca
    return env


def run_agent(url: str, env: dict[str, str], mode: str, steps: list[dict[str, Any]]) -> dict[str, Any]:
    done = subprocess.run([PYTHON, str(AGENT_SCRIPT), url, "--mode", mode, "--steps", json.dumps(steps)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"agent failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


class LiveAgent:
    """The agent in interactive mode: one session that the test drives step by step."""

    def __init__(self, url: str, env: dict[str, str], mode: str) -> None:
        self.proc = subprocess.Popen([PYTHON, str(AGENT_SCRIPT), url, "--mode", mode], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True).start()
        hello = self.read(30)
        assert hello.get("ready"), hello
        self.protocol = hello["protocol"]

    @staticmethod
    def _pump(stream: Any, sink: Any) -> None:
        for line in stream:
            sink(line)

    def send(self, doc: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(doc) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = 20) -> dict[str, Any]:
        try:
            return json.loads(self.lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"the agent did not answer within {timeout}s; exit={self.proc.poll()} "
                                 f"stderr:\n{''.join(self.stderr)[-3000:]}") from None

    def pending(self) -> bool:
        return not self.lines.empty()

    def ask(self, doc: dict[str, Any], timeout: float = 20) -> dict[str, Any]:
        self.send(doc)
        return self.read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send({"op": "quit"})
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def refused_with(result: dict[str, Any], tether_code: str) -> None:
    """A refused tools/call as the SDK hands it to the agent: an ordinary tool error (no exception) naming the code."""
    assert result["ok"] is True and result["is_error"] is True, result
    assert f"({tether_code})" in result["text"], result


def approvals_pending(w: McpWorld, agent: str) -> list[dict[str, Any]]:
    return [a for a in w.cp.client().request("GET", "/v1/approvals?status=pending") if a["agent"] == agent]


def reports_by_capability(w: McpWorld, agent: str) -> dict[str | None, list[dict[str, Any]]]:
    out: dict[str | None, list[dict[str, Any]]] = {}
    for report in reports_for(w.cp, agent):
        out.setdefault(report.get("capability"), []).append(report)
    return out


async def _list_without_tether(url: str, mode: str) -> list[str]:
    async with httpx2.AsyncClient(trust_env=False) as http_client, \
            Client(streamable_http_client(url, http_client=http_client), mode=mode) as client:
        return sorted(t.name for t in (await client.list_tools()).tools)


# -- the surface the model sees: granted tools only; granted and ungranted calls; their reports -----
@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_only_granted_tools_exist_for_the_agent(any_world: McpWorld, mode: str) -> None:
    w = any_world
    # Without tether the server offers every tool: the filtering below is the sidecar's doing.
    assert asyncio.run(_list_without_tether(w.mcp.url, mode)) == ALL_TOOLS
    w.wiretap.clear()

    agent = f"mcp-list-{mode}"
    sc = w.sidecar(w.cp.issue(agent, {"mcp.add": "direct", "mcp.send": "approval"}))
    out = run_agent(w.mcp.url, proxy_env(sc.proxy, sc.ca), mode, [
        {"op": "list"},
        {"op": "call", "name": "add", "args": {"a": 2, "b": 3}},
        {"op": "call", "name": "delete_everything"},
        {"op": "call", "name": "slow", "args": {"seconds": 0}},
        {"op": "call", "name": "not_in_the_catalog"},
        {"op": "list"},
    ])
    assert out["protocol"] == (MODERN if mode == "auto" else "2025-11-25")
    listed, added, deleted, slowed, unknown, listed_again = out["results"]
    assert listed == {"ok": True, "tools": ["add", "send_email"]}  # approval-tier tools exist; absent ones do not
    assert added["ok"] and added["text"] == "5" and not added["is_error"], added
    refused_with(deleted, "tether.capability_absent")
    refused_with(slowed, "tether.capability_absent")
    refused_with(unknown, "tether.capability_absent")
    assert listed_again == listed  # the session survived three refusals
    assert w.mcp.calls == ["add"]
    assert w.wiretap.requests, "the agent's traffic never reached the server"
    for name in ("delete_everything", "slow", "not_in_the_catalog"):
        assert not w.wiretap.saw(f'"{name}"'), f"the server saw a request naming {name}"

    by_cap = wait_until(lambda: (r := reports_by_capability(w, agent)).keys() >= {"mcp.add", "mcp.delete", "mcp.slow"}
                        and r, timeout=WAIT, what="reports naming the MCP capabilities")
    assert [(r["resolution"], r["status"]) for r in by_cap["mcp.add"]] == [("completed", 200)], by_cap["mcp.add"]
    for cap in ("mcp.delete", "mcp.slow"):
        assert [(r["resolution"], r["code"]) for r in by_cap[cap]] == [("refused", "tether.capability_absent")]


def test_calls_answered_over_sse_are_reported_completed(world: McpWorld) -> None:
    """A legacy client reads its answer off the SSE stream and closes the stream at once (the SDK does so
    as soon as the JSON-RPC response arrives). The call completed: reconciliation must not call it unknown."""
    agent = "mcp-sse-reports"
    sc = world.sidecar(world.cp.issue(agent, {"mcp.add": "direct"}))
    calls = 40
    out = run_agent(world.mcp.url, proxy_env(sc.proxy, sc.ca), "legacy",
                    [{"op": "call", "name": "add", "args": {"a": i, "b": 1}} for i in range(calls)])
    assert [r.get("text") for r in out["results"]] == [str(i + 1) for i in range(calls)]
    assert world.mcp.calls == ["add"] * calls
    reports = wait_until(lambda: len(r := reports_by_capability(world, agent).get("mcp.add", [])) == calls and r,
                         timeout=WAIT, what=f"{calls} reports for mcp.add")
    outcomes = sorted((r["resolution"], r["status"], r.get("detail")) for r in reports)
    assert outcomes == [("completed", 200, None)] * calls, [o for o in outcomes if o[0] != "completed"]


# -- approval ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_approval_tier_holds_until_a_person_decides(world: McpWorld, mode: str) -> None:
    agent = f"mcp-approval-{mode}"
    sc = world.sidecar(world.cp.issue(agent, {"mcp.add": "direct", "mcp.send": "approval"}))
    live = LiveAgent(world.mcp.url, proxy_env(sc.proxy, sc.ca), mode)
    admin = world.cp.client()
    try:
        live.send({"op": "call", "name": "send_email", "args": {"to": "ops@example.org", "body": "hi"}})
        pending = wait_until(lambda: approvals_pending(world, agent), timeout=WAIT, what="a pending approval")
        assert len(pending) == 1 and pending[0]["capability"] == "mcp.send", pending
        assert "send_email" not in world.mcp.calls and not live.pending()  # held, not forwarded
        admin.request("POST", f"/v1/approvals/{pending[0]['id']}/approve")
        approved = live.read()
        assert approved["ok"] and approved["text"] == "sent to ops@example.org", approved
        assert world.mcp.calls == ["send_email"]

        live.send({"op": "call", "name": "send_email", "args": {"to": "ceo@example.org", "body": "no"}})
        pending = wait_until(lambda: approvals_pending(world, agent), timeout=WAIT, what="a second pending approval")
        admin.request("POST", f"/v1/approvals/{pending[0]['id']}/deny")
        refused_with(live.read(), "tether.approval_denied")
        assert world.mcp.calls == ["send_email"]
        assert not world.wiretap.saw("ceo@example.org")

        assert live.ask({"op": "call", "name": "add", "args": {"a": 1, "b": 1}})["text"] == "2"
    finally:
        live.close()
    by_cap = wait_until(lambda: len((r := reports_by_capability(world, agent)).get("mcp.send", [])) == 2 and r,
                        timeout=WAIT, what="both approval-tier calls reported")
    assert sorted((r["resolution"], r["code"]) for r in by_cap["mcp.send"]) == [
        ("completed", None), ("refused", "tether.approval_denied")]


# -- revocation mid-session ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_revoking_the_chain_mid_session_refuses_the_next_call(world: McpWorld, mode: str) -> None:
    agent = f"mcp-revoke-{mode}"
    ident = world.cp.issue(agent, {"mcp.add": "direct"})
    sc = world.sidecar(ident)
    live = LiveAgent(world.mcp.url, proxy_env(sc.proxy, sc.ca), mode)
    try:
        assert live.ask({"op": "list"})["tools"] == ["add"]
        assert live.ask({"op": "call", "name": "add", "args": {"a": 20, "b": 22}})["text"] == "42"
        world.cp.client().request("POST", f"/v1/grants/{ident.jti}/revoke", {"reason": "test"})
        with httpx.Client(proxy=sc.proxy, trust_env=False, timeout=10) as raw:
            # The revocation reaches the sidecar over its event stream; a harmless tools/list shows when.
            listing = {"jsonrpc": "2.0", "id": "probe", "method": "tools/list", "params": {"_meta": META}}
            wait_until(lambda: raw_post(raw, world.mcp.url, listing, {"mcp-method": "tools/list"}).headers.get(
                "Tether-Error") == "tether.chain_revoked", timeout=WAIT, what="the sidecar to learn of the revocation")
            # What the proxy answers, seen raw: a tether refusal that is also a JSON-RPC error with the request's id.
            resp = raw_post(raw, world.mcp.url, call_body("rev-1", "add", {"a": 1, "b": 1}))
        assert resp.status_code == 200 and resp.headers.get("Tether-Error") == "tether.chain_revoked", resp.text
        assert_tool_refused(resp.json(), "rev-1", "tether.chain_revoked")
        # What the agent sees: an ordinary tool error carrying tether's code.
        refused_with(live.ask({"op": "call", "name": "add", "args": {"a": 1, "b": 2}}), "tether.chain_revoked")
        refused_with(live.ask({"op": "call", "name": "add", "args": {"a": 1, "b": 3}}), "tether.chain_revoked")
    finally:
        live.close()
    assert world.mcp.calls == ["add"]
    # Three refused tools/call POSTs (one raw, two from the agent), each naming the capability it asked for
    # (the tools/list probes and a legacy client's closing DELETE are refused and reported too).
    revoked = wait_until(lambda: len(r := [x for x in reports_for(world.cp, agent) if x.get("capability") == "mcp.add"
                                           and x.get("code") == "tether.chain_revoked"]) >= 3 and r,
                         timeout=WAIT, what="reports of the refused tools/call requests naming mcp.add")
    assert len(revoked) == 3 and all(r["resolution"] == "refused" for r in revoked), revoked


# -- bad input, sent raw ----------------------------------------------------------------------------------
META = {"io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
        "io.modelcontextprotocol/clientCapabilities": {}}
HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json",
           "mcp-protocol-version": MODERN}


def call_body(msg_id: Any, tool: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": msg_id, "method": "tools/call",
            "params": {"name": tool, "arguments": args or {}, "_meta": META}}


def raw_post(client: httpx.Client, url: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    """POST one body as a modern client would; a single tools/call gets the mcp-method/mcp-name headers
    the server insists on, unless the test gives its own."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    routing: dict[str, str] = {}
    if isinstance(body, dict) and body.get("method") == "tools/call":
        name = (body.get("params") or {}).get("name")
        routing = {"mcp-method": "tools/call", **({"mcp-name": name} if isinstance(name, str) else {})}
    return client.post(url, content=content, headers={**HEADERS, **routing, **(headers or {})})


def assert_jsonrpc_error(value: Any, msg_id: Any, code: str = "tether.capability_absent") -> None:
    assert isinstance(value, dict), value
    assert set(value) == {"jsonrpc", "id", "error"} and value["jsonrpc"] == "2.0", value
    assert value["id"] == msg_id, value
    error = value["error"]
    assert error["code"] == REFUSED_JSONRPC and isinstance(error["message"], str) and error["message"], error
    assert error["data"]["code"] == code, error


def assert_tool_refused(value: Any, msg_id: Any, code: str = "tether.capability_absent") -> None:
    """A refused tools/call: the result SDKs surface as a tool error, tether's error object in its _meta."""
    assert isinstance(value, dict) and set(value) == {"jsonrpc", "id", "result"}, value
    assert value["id"] == msg_id, value
    result = value["result"]
    assert result["isError"] is True and result["content"][0]["type"] == "text", result
    assert f"({code})" in result["content"][0]["text"], result
    assert result["_meta"]["tether/error"]["code"] == code, result


def assert_refused(resp: httpx.Response, msg_id: Any, *, request: bool = True) -> None:
    """Refused, never forwarded. A JSON-RPC request tether could read is answered as a server would (HTTP 200);
    a body it could not read keeps the refusal's HTTP status, with a JSON-RPC error for whatever id it found."""
    assert resp.status_code == (200 if request else 403), (resp.status_code, resp.text)
    assert resp.headers["Tether-Error"] == "tether.capability_absent"
    assert resp.headers["content-type"].startswith("application/json")
    value = resp.json()
    if isinstance(value, dict) and "result" in value:
        assert_tool_refused(value, msg_id)
    else:
        assert_jsonrpc_error(value, msg_id)


BAD_BODIES: list[tuple[str, bytes | Any, Any, bool]] = [  # (what, body, id, a request tether could read)
    ("not JSON", b'{"jsonrpc": "2.0", "id": "bad-1", "method": "tools/call", ', None, False),
    ("not JSON-RPC 2.0", {"id": "bad-2", "method": "tools/list"}, "bad-2", False),
    ("jsonrpc 1.0", {"jsonrpc": "1.0", "id": "bad-3", "method": "tools/list"}, "bad-3", False),
    ("tools/call without a name", {"jsonrpc": "2.0", "id": "bad-4", "method": "tools/call",
                                   "params": {"arguments": {}}}, "bad-4", False),
    ("tools/call with a non-string name", {"jsonrpc": "2.0", "id": "bad-5", "method": "tools/call",
                                           "params": {"name": ["add"]}}, "bad-5", False),
    ("method not a string", {"jsonrpc": "2.0", "id": "bad-6", "method": 7}, "bad-6", False),
    ("neither method nor result", {"jsonrpc": "2.0", "id": "bad-7"}, "bad-7", False),
    ("a JSON scalar", b'"bad-8"', None, False),
    ("an empty batch", b"[]", None, False),
    ("a method the catalog does not describe", {"jsonrpc": "2.0", "id": "bad-9", "method": "tools/delete",
                                                "params": {"_meta": META}}, "bad-9", True),
    ("prompts/get", {"jsonrpc": "2.0", "id": 10, "method": "prompts/get",
                     "params": {"name": "p", "_meta": META}}, 10, True),
    ("resources/read", {"jsonrpc": "2.0", "id": "bad-11", "method": "resources/read",
                        "params": {"uri": "file:///etc/passwd", "_meta": META}}, "bad-11", True),
    ("resources/read without a uri", {"jsonrpc": "2.0", "id": "bad-13", "method": "resources/read",
                                      "params": {"_meta": META}}, "bad-13", False),
    ("a duplicate name key, the last one (the one servers use) ungranted",
     b'{"jsonrpc": "2.0", "id": "bad-12", "method": "tools/call", '
     b'"params": {"name": "add", "name": "delete_everything", "arguments": {}}}', "bad-12", False),
]


def test_bad_input_is_refused_as_json_rpc_and_the_session_survives(world: McpWorld) -> None:
    sc = world.sidecar(world.cp.issue("mcp-raw", {"mcp.add": "direct"}))
    live = LiveAgent(world.mcp.url, proxy_env(sc.proxy, sc.ca), "legacy")  # a session with an id
    url = world.mcp.url
    try:
        assert live.ask({"op": "call", "name": "add", "args": {"a": 1, "b": 1}})["text"] == "2"
        with httpx.Client(proxy=sc.proxy, trust_env=False, timeout=10) as raw:
            # The raw channel itself works: a well-formed granted call goes through.
            ok = raw_post(raw, url, call_body("good-1", "add", {"a": 3, "b": 4}))
            assert ok.status_code == 200 and ok.json()["result"]["structuredContent"] == {"result": 7}, ok.text
            assert world.mcp.calls == ["add", "add"]
            seen = len(world.wiretap.requests)

            for what, body, msg_id, request in BAD_BODIES:
                resp = raw_post(raw, url, body)
                assert resp.status_code == (200 if request else 403), (what, resp.status_code, resp.text)
                assert_refused(resp, msg_id, request=request)

            # A batch that mixes a granted and an ungranted tool is refused whole, one error per request id.
            batch = [call_body("bad-b1", "add", {"a": 1, "b": 2}), call_body("bad-b2", "delete_everything"),
                     {"jsonrpc": "2.0", "method": "notifications/progress",
                      "params": {"progressToken": 1, "progress": 1}}]
            resp = raw_post(raw, url, batch)
            assert resp.status_code == 200 and resp.headers["Tether-Error"] == "tether.capability_absent"
            errors = resp.json()
            assert isinstance(errors, list) and [e["id"] for e in errors] == ["bad-b1", "bad-b2"], errors
            for error in errors:
                assert_tool_refused(error, error["id"])
            # ... and so is a batch of granted tool calls with one item the agent does not hold.
            resp = raw_post(raw, url, [call_body("bad-b3", "add", {"a": 1, "b": 2}),
                                       {"jsonrpc": "2.0", "id": "bad-b4", "method": "prompts/get",
                                        "params": {"name": "p"}}])
            assert resp.status_code == 200 and [e["id"] for e in resp.json()] == ["bad-b3", "bad-b4"], resp.text
            assert_tool_refused(resp.json()[0], "bad-b3")
            assert_jsonrpc_error(resp.json()[1], "bad-b4")

            # Headers a server may route on must agree with the body.
            assert_refused(raw_post(raw, url, call_body("bad-h1", "add", {"a": 1, "b": 2}),
                                    {"mcp-name": "delete_everything"}), "bad-h1")
            assert_refused(raw_post(raw, url, call_body("bad-h2", "delete_everything"),
                                    {"mcp-name": "add"}), "bad-h2")
            assert_refused(raw_post(raw, url, call_body("bad-h3", "add", {"a": 1, "b": 2}),
                                    {"mcp-method": "tools/list"}), "bad-h3")

            assert len(world.wiretap.requests) == seen and not world.wiretap.saw("bad-"), \
                [b[:200] for b in world.wiretap.bodies()[seen:]]
            assert world.mcp.calls == ["add", "add"]

            again = raw_post(raw, url, call_body("good-2", "add", {"a": 5, "b": 5}))
            assert again.status_code == 200 and again.json()["id"] == "good-2", again.text

        # The agent's own session is untouched by all of that.
        assert live.ask({"op": "list"})["tools"] == ["add"]
        assert live.ask({"op": "call", "name": "add", "args": {"a": 2, "b": 2}})["text"] == "4"
    finally:
        live.close()
    assert world.mcp.calls == ["add", "add", "add", "add"]


@pytest.mark.parametrize("encoding", ["utf-8", "bogus", "gzip"])
def test_a_body_the_sidecar_cannot_decode_is_refused_not_forwarded(world: McpWorld, encoding: str) -> None:
    """What the sidecar cannot read it cannot match: it must refuse, never pass the bytes through.

    The SDK's server ignores Content-Encoding and parses the raw body, so a body that the sidecar fails to
    decode and forwards anyway runs whatever tool it names (here one the agent was never granted).
    """
    sc = world.sidecar(world.cp.issue(f"mcp-encoding-{encoding}", {"mcp.add": "direct"}))
    body = json.dumps(call_body("enc-1", "delete_everything")).encode()
    if encoding == "gzip":
        body = gzip.compress(body)[:-8] + b"\x00" * 8  # a broken gzip trailer: not decodable
    with httpx.Client(proxy=sc.proxy, trust_env=False, timeout=10) as raw:
        resp = raw_post(raw, world.mcp.url, body, {"content-encoding": encoding, "mcp-method": "tools/call",
                                                   "mcp-name": "delete_everything"})
        assert resp.status_code == 403, (resp.status_code, resp.text[:300])
        assert resp.headers.get("Tether-Error") == "tether.capability_absent"
        assert resp.json()["error"]["code"] == REFUSED_JSONRPC
        ok = raw_post(raw, world.mcp.url, call_body("enc-2", "add", {"a": 1, "b": 1}))
        assert ok.status_code == 200, ok.text
    assert world.mcp.calls == ["add"]
    assert not world.wiretap.saw("enc-1") and len(world.wiretap.requests) == 1


# -- the whole thing as a user runs it ---------------------------------------------------------------------
def test_tether_run_puts_an_unmodified_mcp_agent_under_control(world: McpWorld, tmp_path: Path) -> None:
    agent = "mcp-run"
    ident = world.cp.issue(agent, {"mcp.add": "direct"})
    steps = [{"op": "list"}, {"op": "call", "name": "add", "args": {"a": 40, "b": 2}},
             {"op": "call", "name": "send_email", "args": {"to": "x@example.org", "body": "b"}}]
    tether = Path(sys.executable).with_name("tether")
    done = subprocess.run(
        [str(tether), "run", "--controlplane", world.cp.url, "--chain", str(ident.chain_path),
         "--key", str(ident.key_path), "--state-dir", str(tmp_path / "run-state"), "--",
         PYTHON, str(AGENT_SCRIPT), world.mcp.url, "--steps", json.dumps(steps)],
        env=proxy_env(None), capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["protocol"] == MODERN
    listed, added, sent = out["results"]
    assert listed == {"ok": True, "tools": ["add"]}
    assert added["ok"] and added["text"] == "42"
    refused_with(sent, "tether.capability_absent")
    assert world.mcp.calls == ["add"] and not world.wiretap.saw("x@example.org")
    # tether run stops its sidecar when the command exits; the sidecar flushes its reports first.
    by_cap = wait_until(lambda: (r := reports_by_capability(world, agent)).keys() >= {"mcp.add", "mcp.send"} and r,
                        timeout=WAIT, what="reports from the tether run sidecar")
    assert [r["resolution"] for r in by_cap["mcp.add"]] == ["completed"]
    assert [(r["resolution"], r["code"]) for r in by_cap["mcp.send"]] == [("refused", "tether.capability_absent")]
