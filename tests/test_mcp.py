"""MCP through the sidecar, end to end, with the official SDK on both sides.

The agent is ``tests/agents/mcp_agent.py``: the SDK's ``Client`` in its own process, put behind the
sidecar by proxy environment variables only (and once by ``tether run``, exactly as a user would).
The server is the SDK's ``MCPServer`` over streamable HTTP, in SSE mode (the world's) and in JSON mode.
A wiretap on the server's ASGI app records every HTTP request that reaches it, so "the server never
saw it" is checked at the server, not taken from tether's own reports.
"""

from __future__ import annotations

import gzip
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import World, teardown_world
from .harness import (
    PYTHON,
    McpServer,
    TestCA,
    ToolServer,
    prepare_controlplane,
    reports_for,
    wait_until,
)

AGENT_SCRIPT = Path(__file__).parent / "agents" / "mcp_agent.py"
ALL_TOOLS = ["add", "delete_everything", "send_email", "slow"]
REFUSED_JSONRPC = -32003
MODERN = "2026-07-28"


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


def tap(server: McpServer) -> Wiretap:
    config = server._server.config  # uvicorn builds each connection's protocol from config.loaded_app
    wiretap = Wiretap(config.loaded_app)
    config.loaded_app = wiretap
    return wiretap


@pytest.fixture(params=["sse", "json"])
def mcp_world(request: pytest.FixtureRequest, tmp_path: Path, test_ca: TestCA) -> Iterator[World]:
    """A world whose MCP server answers in SSE mode (the SDK default) or in JSON mode."""
    tools = ToolServer().start()
    secure = ToolServer(tls=test_ca).start()
    server = McpServer(json_response=request.param == "json").start()
    cp = prepare_controlplane(tmp_path / "cp", tools.port, secure.port, server.port)
    world = World(tmp_path, tools, secure, server, test_ca, cp)
    try:
        cp.start()
        yield world
    finally:
        teardown_world(world)


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
    assert result["ok"] is False, result
    error = result["error"]
    assert error["type"] == "MCPError" and error["code"] == REFUSED_JSONRPC, error
    assert isinstance(error["data"], dict) and error["data"]["code"] == tether_code, error


def approvals_pending(world: World, agent: str) -> list[dict[str, Any]]:
    return [a for a in world.cp.client().request("GET", "/v1/approvals?status=pending") if a["agent"] == agent]


# -- 1-3, 7: the surface the model sees, granted and ungranted calls, reports -------------------------
@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_only_granted_tools_exist_for_the_agent(mcp_world: World, mode: str) -> None:
    world = mcp_world
    wiretap = tap(world.mcp)
    # Without tether the server offers every tool: the filtering below is the sidecar's doing.
    direct = run_agent(world.mcp.url, proxy_env(None), mode, [{"op": "list"}])
    assert direct["results"][0]["tools"] == ALL_TOOLS
    direct_requests = len(wiretap.requests)

    agent = f"mcp-{mode}"
    ident = world.cp.issue(agent, {"mcp.add": "direct", "mcp.send": "approval"})
    sc = world.sidecar(ident)
    out = run_agent(world.mcp.url, proxy_env(sc.proxy, sc.ca), mode, [
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
    assert world.mcp.calls == ["add"]
    assert len(wiretap.requests) > direct_requests  # the agent really went through the sidecar to the server
    for name in ("delete_everything", "slow", "not_in_the_catalog"):
        assert not wiretap.saw(f'"{name}"'), f"the server saw a request naming {name}"

    reports = wait_until(lambda: (rs := reports_for(world.cp, agent)) and
                         {r.get("capability") for r in rs} >= {"mcp.add", "mcp.delete", "mcp.slow"} and rs,
                         what="reports naming the MCP capabilities")
    by_cap = {r["capability"]: r for r in reports if r.get("capability")}
    assert by_cap["mcp.add"]["resolution"] == "completed" and by_cap["mcp.add"]["status"] == 200
    for cap in ("mcp.delete", "mcp.slow"):
        assert by_cap[cap]["resolution"] == "refused" and by_cap[cap]["code"] == "tether.capability_absent"
    assert all(r["agent"] == agent for r in reports)


# -- 4: approval ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_approval_tier_holds_until_a_person_decides(world: World, mode: str) -> None:
    agent = f"mcp-approval-{mode}"
    ident = world.cp.issue(agent, {"mcp.add": "direct", "mcp.send": "approval"})
    sc = world.sidecar(ident)
    live = LiveAgent(world.mcp.url, proxy_env(sc.proxy, sc.ca), mode)
    admin = world.cp.client()
    try:
        live.send({"op": "call", "name": "send_email", "args": {"to": "ops@example.org", "body": "hi"}})
        pending = wait_until(lambda: approvals_pending(world, agent), what="a pending approval")
        assert len(pending) == 1 and pending[0]["capability"] == "mcp.send", pending
        assert "send_email" not in world.mcp.calls and not live.pending()  # held, not forwarded
        admin.request("POST", f"/v1/approvals/{pending[0]['id']}/approve")
        approved = live.read()
        assert approved["ok"] and approved["text"] == "sent to ops@example.org", approved
        assert world.mcp.calls == ["send_email"]

        live.send({"op": "call", "name": "send_email", "args": {"to": "ceo@example.org", "body": "no"}})
        pending = wait_until(lambda: approvals_pending(world, agent), what="a second pending approval")
        admin.request("POST", f"/v1/approvals/{pending[0]['id']}/deny")
        refused_with(live.read(), "tether.approval_denied")
        assert world.mcp.calls == ["send_email"]

        assert live.ask({"op": "call", "name": "add", "args": {"a": 1, "b": 1}})["text"] == "2"
    finally:
        live.close()
    reports = wait_until(lambda: len(rs := reports_for(world.cp, agent)) and
                         [r for r in rs if r.get("code") == "tether.approval_denied"] and rs,
                         what="the denied call's report")
    sends = sorted((r["resolution"], r.get("code")) for r in reports if r.get("capability") == "mcp.send")
    assert sends == [("completed", None), ("refused", "tether.approval_denied")]


# -- 5: revocation mid-session -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_revoking_the_chain_mid_session_refuses_the_next_call(world: World, mode: str) -> None:
    agent = f"mcp-revoke-{mode}"
    ident = world.cp.issue(agent, {"mcp.add": "direct"})
    sc = world.sidecar(ident)
    live = LiveAgent(world.mcp.url, proxy_env(sc.proxy, sc.ca), mode)
    try:
        assert live.ask({"op": "list"})["tools"] == ["add"]
        assert live.ask({"op": "call", "name": "add", "args": {"a": 20, "b": 22}})["text"] == "42"
        world.cp.client().request("POST", f"/v1/grants/{ident.jti}/revoke", {"reason": "test"})
        wait_until(lambda: f"revoked: {ident.jti}" in sc.log_text, what="the sidecar to learn of the revocation")
        refused_with(live.ask({"op": "call", "name": "add", "args": {"a": 1, "b": 2}}), "tether.chain_revoked")
        refused_with(live.ask({"op": "call", "name": "add", "args": {"a": 1, "b": 3}}), "tether.chain_revoked")
    finally:
        live.close()
    assert world.mcp.calls == ["add"]
    wait_until(lambda: len([r for r in reports_for(world.cp, agent) if r.get("code") == "tether.chain_revoked"])
               == 2, what="reports of the refused calls")


# -- 6: bad input, sent raw ----------------------------------------------------------------------------------
META = {"io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
        "io.modelcontextprotocol/clientCapabilities": {}}
HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json",
           "mcp-protocol-version": MODERN}


def call_body(msg_id: Any, tool: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": msg_id, "method": "tools/call",
            "params": {"name": tool, "arguments": args or {}, "_meta": META}}


def raw_post(client: httpx.Client, url: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(url, content=content, headers={**HEADERS, **(headers or {})})


def assert_jsonrpc_error(value: Any, msg_id: Any, code: str = "tether.capability_absent") -> None:
    assert isinstance(value, dict), value
    assert set(value) == {"jsonrpc", "id", "error"} and value["jsonrpc"] == "2.0", value
    assert value["id"] == msg_id, value
    error = value["error"]
    assert error["code"] == REFUSED_JSONRPC and isinstance(error["message"], str) and error["message"], error
    assert error["data"]["code"] == code, error


def assert_refused(resp: httpx.Response, msg_id: Any) -> None:
    assert resp.status_code == 403, (resp.status_code, resp.text)
    assert resp.headers["Tether-Error"] == "tether.capability_absent"
    assert resp.headers["content-type"].startswith("application/json")
    assert_jsonrpc_error(resp.json(), msg_id)


BAD_BODIES: list[tuple[str, bytes | Any, Any]] = [
    ("not JSON", b'{"jsonrpc": "2.0", "id": "bad-1", "method": "tools/call", ', None),
    ("not JSON-RPC 2.0", {"id": "bad-2", "method": "tools/list"}, "bad-2"),
    ("jsonrpc 1.0", {"jsonrpc": "1.0", "id": "bad-3", "method": "tools/list"}, "bad-3"),
    ("tools/call without a name", {"jsonrpc": "2.0", "id": "bad-4", "method": "tools/call",
                                   "params": {"arguments": {}}}, "bad-4"),
    ("tools/call with a non-string name", {"jsonrpc": "2.0", "id": "bad-5", "method": "tools/call",
                                           "params": {"name": ["add"]}}, "bad-5"),
    ("method not a string", {"jsonrpc": "2.0", "id": "bad-6", "method": 7}, "bad-6"),
    ("neither method nor result", {"jsonrpc": "2.0", "id": "bad-7"}, "bad-7"),
    ("a JSON scalar", b'"bad-8"', None),
    ("an empty batch", b"[]", None),
    ("resources/list", {"jsonrpc": "2.0", "id": "bad-9", "method": "resources/list", "params": {"_meta": META}},
     "bad-9"),
    ("prompts/get", {"jsonrpc": "2.0", "id": 10, "method": "prompts/get",
                     "params": {"name": "p", "_meta": META}}, 10),
    ("resources/read", {"jsonrpc": "2.0", "id": "bad-11", "method": "resources/read",
                        "params": {"uri": "file:///etc/passwd", "_meta": META}}, "bad-11"),
    ("a duplicate name key, the last one ungranted",
     b'{"jsonrpc": "2.0", "id": "bad-12", "method": "tools/call", '
     b'"params": {"name": "add", "name": "delete_everything", "arguments": {}}}', "bad-12"),
]


def test_bad_input_is_refused_as_json_rpc_and_the_session_survives(world: World) -> None:
    wiretap = tap(world.mcp)
    agent = "mcp-raw"
    ident = world.cp.issue(agent, {"mcp.add": "direct"})
    sc = world.sidecar(ident)
    live = LiveAgent(world.mcp.url, proxy_env(sc.proxy, sc.ca), "legacy")  # a session with an id
    url = world.mcp.url
    try:
        assert live.ask({"op": "call", "name": "add", "args": {"a": 1, "b": 1}})["text"] == "2"
        with httpx.Client(proxy=sc.proxy, trust_env=False, timeout=10) as raw:
            # The raw channel itself works: a well-formed granted call goes through.
            ok = raw_post(raw, url, call_body("good-1", "add", {"a": 3, "b": 4}), {"mcp-method": "tools/call",
                                                                                   "mcp-name": "add"})
            assert ok.status_code == 200 and ok.json()["result"]["structuredContent"] == {"result": 7}, ok.text
            assert world.mcp.calls == ["add", "add"]
            seen = len(wiretap.requests)

            for what, body, msg_id in BAD_BODIES:
                resp = raw_post(raw, url, body)
                assert resp.status_code == 403, (what, resp.status_code, resp.text)
                assert_refused(resp, msg_id)

            # A batch that mixes a granted and an ungranted tool is refused whole, one error per request id.
            batch = [call_body("bad-b1", "add", {"a": 1, "b": 2}), call_body("bad-b2", "delete_everything"),
                     {"jsonrpc": "2.0", "method": "notifications/progress",
                      "params": {"progressToken": 1, "progress": 1}}]
            resp = raw_post(raw, url, batch)
            assert resp.status_code == 403 and resp.headers["Tether-Error"] == "tether.capability_absent"
            errors = resp.json()
            assert isinstance(errors, list) and [e["id"] for e in errors] == ["bad-b1", "bad-b2"], errors
            for error in errors:
                assert_jsonrpc_error(error, error["id"])
            # ... and so is a batch of granted tool calls with one method the catalog does not describe.
            resp = raw_post(raw, url, [call_body("bad-b3", "add", {"a": 1, "b": 2}),
                                       {"jsonrpc": "2.0", "id": "bad-b4", "method": "resources/list"}])
            assert resp.status_code == 403 and [e["id"] for e in resp.json()] == ["bad-b3", "bad-b4"], resp.text

            # Headers a server may route on must agree with the body.
            assert_refused(raw_post(raw, url, call_body("bad-h1", "add", {"a": 1, "b": 2}),
                                    {"mcp-method": "tools/call", "mcp-name": "delete_everything"}), "bad-h1")
            assert_refused(raw_post(raw, url, call_body("bad-h2", "delete_everything"),
                                    {"mcp-method": "tools/call", "mcp-name": "add"}), "bad-h2")
            assert_refused(raw_post(raw, url, call_body("bad-h3", "add", {"a": 1, "b": 2}),
                                    {"mcp-method": "tools/list"}), "bad-h3")

            assert len(wiretap.requests) == seen and not wiretap.saw("bad-"), \
                [b[:200] for b in wiretap.bodies()[seen:]]
            assert world.mcp.calls == ["add", "add"]

            again = raw_post(raw, url, call_body("good-2", "add", {"a": 5, "b": 5}), {"mcp-name": "add"})
            assert again.status_code == 200 and again.json()["id"] == "good-2", again.text

        # The agent's own session is untouched by all of that.
        assert live.ask({"op": "list"})["tools"] == ["add"]
        assert live.ask({"op": "call", "name": "add", "args": {"a": 2, "b": 2}})["text"] == "4"
    finally:
        live.close()
    assert world.mcp.calls == ["add", "add", "add", "add"]


@pytest.mark.parametrize("encoding", ["utf-8", "gzip", "bogus"])
def test_a_body_the_sidecar_cannot_decode_is_refused_not_forwarded(world: World, encoding: str) -> None:
    """What the sidecar cannot read it cannot match: it must refuse, never pass the bytes through.

    The server ignores Content-Encoding and parses the raw body, so a body the sidecar fails to decode
    and then forwards anyway would run whatever tool it names.
    """
    wiretap = tap(world.mcp)
    ident = world.cp.issue("mcp-encoding", {"mcp.add": "direct"})
    sc = world.sidecar(ident)
    body = json.dumps(call_body("enc-1", "delete_everything")).encode()
    if encoding == "gzip":
        body = gzip.compress(body)[:-8] + b"\x00" * 8  # a broken gzip trailer: not decodable
    with httpx.Client(proxy=sc.proxy, trust_env=False, timeout=10) as raw:
        resp = raw_post(raw, world.mcp.url, body, {"content-encoding": encoding})
        assert resp.status_code == 403, (resp.status_code, resp.text[:300])
        assert resp.headers.get("Tether-Error") == "tether.capability_absent"
        assert resp.json()["error"]["code"] == REFUSED_JSONRPC
        ok = raw_post(raw, world.mcp.url, call_body("enc-2", "add", {"a": 1, "b": 1}), {"mcp-name": "add"})
        assert ok.status_code == 200, ok.text
    assert world.mcp.calls == ["add"]
    assert not wiretap.saw("enc-1") and len(wiretap.requests) == 1


# -- the whole thing as a user runs it ---------------------------------------------------------------------
def test_tether_run_puts_an_unmodified_mcp_agent_under_control(world: World, tmp_path: Path) -> None:
    agent = "mcp-run"
    ident = world.cp.issue(agent, {"mcp.add": "direct"})
    steps = [{"op": "list"}, {"op": "call", "name": "add", "args": {"a": 40, "b": 2}},
             {"op": "call", "name": "send_email", "args": {"to": "x@example.org", "body": "b"}}]
    tether = Path(sys.executable).with_name("tether")
    env = proxy_env(None)
    env.update({"TETHER_CONTROLPLANE": world.cp.url})
    done = subprocess.run(
        [str(tether), "run", "--controlplane", world.cp.url, "--chain", str(ident.chain_path),
         "--key", str(ident.key_path), "--state-dir", str(tmp_path / "run-state"), "--",
         PYTHON, str(AGENT_SCRIPT), world.mcp.url, "--steps", json.dumps(steps)],
        env=env, capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    listed, added, sent = out["results"]
    assert listed == {"ok": True, "tools": ["add"]}
    assert added["ok"] and added["text"] == "42"
    refused_with(sent, "tether.capability_absent")
    assert world.mcp.calls == ["add"]
    reports = wait_until(lambda: {r.get("capability") for r in reports_for(world.cp, agent)} >= {"mcp.add", "mcp.send"}
                         and reports_for(world.cp, agent), what="reports from the tether run sidecar")
    by_cap = {r["capability"]: r for r in reports if r.get("capability")}
    assert by_cap["mcp.add"]["resolution"] == "completed"
    assert by_cap["mcp.send"]["resolution"] == "refused" and by_cap["mcp.send"]["code"] == "tether.capability_absent"
