"""Every kind of MCP item through the sidecar, with the official SDK as client and server.

The server (``harness.McpItemsServer``) offers tools, resources, resource templates, prompts, completions,
logging and resource subscriptions. The agent holds part of each. What it does not hold must be absent
exactly as an ungranted tool is: never listed (JSON and SSE answers), refused on use with the tether code,
and never seen by the server (its handler log and a wiretap on its ASGI app are the ground truth). A refused
request is an MCP error the SDK reads, not a transport failure, and the session goes on after it.
"""

from __future__ import annotations

import asyncio
import json
import warnings
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.types import PromptReference, ResourceTemplateReference

from .harness import (
    ControlPlaneProcess,
    Identity,
    McpItemsServer,
    SidecarProcess,
    free_port,
    prepare_controlplane,
    reports_for,
    wait_until,
)
from .test_mcp import Wiretap, tap

REFUSED_JSONRPC = -32003
ABSENT = "tether.capability_absent"
WAIT = 30.0  # bounded waits, generous for a loaded machine; nothing asserts on timing

ITEMS = {  # capability -> its item on the server (the JSON-mode server's capabilities are these with "j.")
    "items.add": {"tool": "add"},
    "items.delete": {"tool": "delete_everything"},
    "docs.public": {"resource": "docs://public/*"},
    "docs.private": {"resource": "docs://private/*"},
    "blob.logo": {"resource": "blob://public/logo"},
    "users.profile": {"resource": "users://{id}/profile"},
    "vault.any": {"resource": "vault://*"},
    "prompt.greet": {"prompt": "greet"},
    "prompt.leak": {"prompt": "leak_secrets"},
    "items.logging": {"logging": True},
    "items.completion": {"completion": True},
    "items.subscriptions": {"subscriptions": True},
}
HOLDS = {"items.add": "direct", "docs.public": "direct", "blob.logo": "direct", "users.profile": "direct",
         "prompt.greet": "direct", "items.logging": "direct", "items.completion": "direct",
         "items.subscriptions": "direct"}  # absent: items.delete, docs.private, vault.any, prompt.leak


@dataclass
class ItemsWorld:
    cp: ControlPlaneProcess
    server: McpItemsServer
    wiretap: Wiretap
    sidecars: list[SidecarProcess] = field(default_factory=list)

    def sidecar(self, agent: str, caps: dict[str, Any]) -> SidecarProcess:
        sidecar = SidecarProcess(self.cp, self.cp.issue(agent, caps))
        self.sidecars.append(sidecar)
        return sidecar.start()

    def identity_sidecar(self, identity: Identity) -> SidecarProcess:
        sidecar = SidecarProcess(self.cp, identity)
        self.sidecars.append(sidecar)
        return sidecar.start()


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ItemsWorld]]:
    """One control plane, two servers: one answers in SSE (the SDK default), one in JSON."""
    directory = tmp_path_factory.mktemp("mcp-items")
    servers = {"sse": McpItemsServer().start(), "json": McpItemsServer(json_response=True).start()}
    cp = prepare_controlplane(directory / "cp", free_port(), free_port(), servers["sse"].port)
    capabilities = {f"{prefix}{name}": {"mcp": {"url": servers[mode].url, **item}}
                    for mode, prefix in (("sse", ""), ("json", "j.")) for name, item in ITEMS.items()}
    cp.catalog_path.write_text(json.dumps({"capabilities": capabilities}))  # JSON is YAML
    out = {mode: ItemsWorld(cp, server, tap(server)) for mode, server in servers.items()}
    cp.start()
    try:
        yield out
    finally:
        cp.stop()
        for server in servers.values():
            server.stop()


def _fresh(w: ItemsWorld) -> Iterator[ItemsWorld]:
    w.server.calls.clear()
    w.wiretap.clear()
    try:
        yield w
    finally:
        for sidecar in w.sidecars:
            sidecar.stop()
        w.sidecars.clear()


@pytest.fixture(params=["sse", "json"])
def any_world(request: pytest.FixtureRequest, worlds: dict[str, ItemsWorld]) -> Iterator[ItemsWorld]:
    yield from _fresh(worlds[request.param])


@pytest.fixture
def world(worlds: dict[str, ItemsWorld]) -> Iterator[ItemsWorld]:
    yield from _fresh(worlds["sse"])


def cap(w: ItemsWorld, name: str) -> str:
    """A capability of ``ITEMS`` as the world's server names it."""
    return f"j.{name}" if w.server.json_response else name


def caps_for(w: ItemsWorld, caps: dict[str, Any]) -> dict[str, Any]:
    return {cap(w, name): tier for name, tier in caps.items()}


def session(w: ItemsWorld, sidecar: SidecarProcess | None, mode: str,
            body: Callable[[Client], Awaitable[Any]]) -> Any:
    """Run ``body`` in one SDK client session, through the sidecar (or straight to the server with None)."""
    async def run() -> Any:
        proxy = sidecar.proxy if sidecar is not None else None
        async with httpx2.AsyncClient(proxy=proxy, trust_env=False, timeout=30) as http_client, \
                Client(streamable_http_client(w.server.url, http_client=http_client), mode=mode) as client:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the SDK deprecates the 2025 methods (logging, subscribe)
                return await body(client)
    return asyncio.run(run())


async def refusal(call: Awaitable[Any]) -> dict[str, Any]:
    """The SDK's MCPError for a refused request, as {code, data}; fails when the call was not refused."""
    try:
        result = await call
    except MCPError as exc:
        return {"code": exc.code, "data": exc.data}
    raise AssertionError(f"not refused: {result!r}")


def assert_refused(error: dict[str, Any], code: str = ABSENT) -> None:
    assert error["code"] == REFUSED_JSONRPC, error
    assert isinstance(error["data"], dict) and error["data"]["code"] == code, error


# -- what the agent sees and may use -------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_only_granted_resources_templates_and_prompts_exist(any_world: ItemsWorld, mode: str) -> None:
    w = any_world

    async def everything(client: Client) -> dict[str, Any]:
        return {
            "resources": sorted(r.uri for r in (await client.list_resources(cache_mode="bypass")).resources),
            "templates": sorted(t.uri_template for t in (await client.list_resource_templates(
                cache_mode="bypass")).resource_templates),
            "prompts": sorted(p.name for p in (await client.list_prompts(cache_mode="bypass")).prompts),
            "tools": sorted(t.name for t in (await client.list_tools(cache_mode="bypass")).tools),
        }

    # Without tether the server offers all of it: what goes missing below is the sidecar's doing.
    assert session(w, None, mode, everything) == {
        "resources": ["blob://public/logo", "docs://private/plan", "docs://public/readme"],
        "templates": ["docs://public/{page}", "users://{id}/profile", "vault://{key}"],
        "prompts": ["greet", "leak_secrets"], "tools": ["add", "delete_everything"]}
    w.server.calls.clear()
    w.wiretap.clear()

    agent = f"items-{mode}-{'json' if w.server.json_response else 'sse'}"
    sc = w.sidecar(agent, caps_for(w, HOLDS))

    async def agent_session(client: Client) -> dict[str, Any]:
        out = await everything(client)
        out["readme"] = (await client.read_resource("docs://public/readme")).contents[0].text
        out["page"] = (await client.read_resource("docs://public/intro")).contents[0].text  # through a template
        out["profile"] = json.loads((await client.read_resource("users://7/profile")).contents[0].text)
        out["logo"] = (await client.read_resource("blob://public/logo")).contents[0].blob
        out["greet"] = (await client.get_prompt("greet", {"name": "Ada"})).messages[0].content.text
        out["complete_prompt"] = (await client.complete(PromptReference(type="ref/prompt", name="greet"),
                                                        {"name": "name", "value": "A"})).completion.values
        out["complete_template"] = (await client.complete(
            ResourceTemplateReference(type="ref/resource", uri="users://{id}/profile"),
            {"name": "id", "value": "4"})).completion.values
        out["refused"] = {
            "private": await refusal(client.read_resource("docs://private/plan")),
            "vault": await refusal(client.read_resource("vault://root")),
            "traversal": await refusal(client.read_resource("docs://public/../private/plan")),
            "leak": await refusal(client.get_prompt("leak_secrets")),
            "complete_leak": await refusal(client.complete(PromptReference(type="ref/prompt", name="leak_secrets"),
                                                           {"name": "x", "value": ""})),
            "complete_vault": await refusal(client.complete(
                ResourceTemplateReference(type="ref/resource", uri="vault://{key}"), {"name": "key", "value": ""})),
        }
        deleted = await client.call_tool("delete_everything")
        out["delete"] = {"is_error": deleted.is_error, "text": "".join(getattr(c, "text", "") for c in deleted.content),
                         "meta": (deleted.meta or {}).get("tether/error")}
        out["again"] = sorted(r.uri for r in (await client.list_resources(cache_mode="bypass")).resources)
        return out

    out = session(w, sc, mode, agent_session)
    assert out["resources"] == ["blob://public/logo", "docs://public/readme"], out
    assert out["templates"] == ["docs://public/{page}", "users://{id}/profile"], out
    assert out["prompts"] == ["greet"] and out["tools"] == ["add"], out
    assert (out["readme"], out["page"], out["profile"]) == ("read me", "page intro", {"id": "7"})
    assert out["logo"] and out["greet"] == "Say hello to Ada."
    assert out["complete_prompt"] == ["A-1", "A-2"] and out["complete_template"] == ["4-1", "4-2"]
    for what, error in out["refused"].items():
        assert_refused(error), what
    # A refused tools/call is an ordinary tool error for the SDK (no exception), carrying the tether code.
    assert out["delete"]["is_error"] is True and ABSENT in out["delete"]["text"], out["delete"]
    assert out["delete"]["meta"]["code"] == ABSENT, out["delete"]
    assert out["again"] == out["resources"]  # the session survived every refusal

    assert sorted(w.server.calls) == sorted([
        "resources/read docs://public/readme", "resources/read docs://public/intro",
        "resources/read users://7/profile", "resources/read blob://public/logo", "prompts/get greet",
        "completion/complete greet", "completion/complete users://{id}/profile"])
    for marker in ("docs://private", "vault://", "leak_secrets", "delete_everything"):
        assert not w.wiretap.saw(marker), f"the server saw a request naming {marker}"

    refused = wait_until(lambda: len(r := [x for x in reports_for(w.cp, agent) if x["resolution"] == "refused"]) >= 7
                         and r, timeout=WAIT, what="all seven refusals reported")
    assert len(refused) == 7 and all(r["code"] == ABSENT for r in refused), refused
    assert {r.get("capability") for r in refused} >= {cap(w, "docs.private"), cap(w, "prompt.leak"),
                                                       cap(w, "items.delete")}, refused


@pytest.mark.parametrize("granted", [True, False])
def test_logging_and_subscriptions_are_plumbing_a_grant_names(world: ItemsWorld, granted: bool) -> None:
    """The 2025-11-25 plumbing (logging/setLevel, resources/subscribe and unsubscribe) exists only when granted;
    a subscription also needs the resource."""
    w = world
    holds = dict(HOLDS) if granted else {k: v for k, v in HOLDS.items() if k not in (
        "items.logging", "items.subscriptions")}
    sc = w.sidecar(f"items-plumbing-{granted}", holds)

    async def plumbing(client: Client) -> dict[str, Any]:
        async def outcome(call: Awaitable[Any]) -> Any:
            try:
                await call
                return "ok"
            except MCPError as exc:
                return {"code": exc.code, "data": exc.data}
        return {
            "level": await outcome(client.set_logging_level("debug")),
            "subscribe": await outcome(client.subscribe_resource("docs://public/readme")),
            "unsubscribe": await outcome(client.unsubscribe_resource("docs://public/readme")),
            "private": await outcome(client.subscribe_resource("docs://private/plan")),
            "read": (await client.read_resource("docs://public/readme")).contents[0].text,
        }

    out = session(w, sc, "legacy", plumbing)
    assert out["read"] == "read me"
    assert_refused(out["private"])
    if granted:
        assert (out["level"], out["subscribe"], out["unsubscribe"]) == ("ok", "ok", "ok"), out
        assert [c for c in w.server.calls if not c.startswith("resources/read")] == [
            "logging/setLevel debug", "resources/subscribe docs://public/readme",
            "resources/unsubscribe docs://public/readme"]
    else:
        for what in ("level", "subscribe", "unsubscribe"):
            assert_refused(out[what]), what
        assert w.server.calls == ["resources/read docs://public/readme"]
    assert not w.wiretap.saw("docs://private")


def test_an_approval_tier_resource_waits_for_a_person(world: ItemsWorld) -> None:
    w = world
    agent = "items-approval"
    sc = w.sidecar(agent, {**HOLDS, "docs.private": "approval"})
    admin = w.cp.client()

    async def read_while_approved(client: Client) -> dict[str, Any]:
        listed = sorted(r.uri for r in (await client.list_resources(cache_mode="bypass")).resources)
        read = asyncio.create_task(client.read_resource("docs://private/plan"))
        pending = await asyncio.to_thread(wait_until, lambda: [
            a for a in admin.request("GET", "/v1/approvals?status=pending") if a["agent"] == agent],
            WAIT, 0.1, "a pending approval")
        held = list(w.server.calls)
        await asyncio.to_thread(admin.request, "POST", f"/v1/approvals/{pending[0]['id']}/approve")
        return {"listed": listed, "held": held, "capability": pending[0]["capability"],
                "text": (await read).contents[0].text}

    out = session(w, sc, "auto", read_while_approved)
    assert "docs://private/plan" in out["listed"]  # an approval-tier resource exists for the agent
    assert out["capability"] == "docs.private" and out["held"] == [], out  # held: the server saw nothing yet
    assert out["text"] == "the secret plan" and w.server.calls == ["resources/read docs://private/plan"]


def test_a_resource_budget_counts_reads(world: ItemsWorld) -> None:
    w = world
    sc = w.sidecar("items-budget", {**HOLDS, "docs.public": {"tier": "direct", "calls": 2}})

    async def three_reads(client: Client) -> list[Any]:
        out: list[Any] = []
        for page in ("a", "b", "c"):
            try:
                out.append((await client.read_resource(f"docs://public/{page}")).contents[0].text)
            except MCPError as exc:
                out.append({"code": exc.code, "data": exc.data})
        return out

    first, second, third = session(w, sc, "auto", three_reads)
    assert (first, second) == ("page a", "page b")
    assert_refused(third, "tether.budget_exhausted")
    assert w.server.calls == ["resources/read docs://public/a", "resources/read docs://public/b"]


# -- refusals as an MCP server gives them, seen raw --------------------------------------------------------
META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
        "io.modelcontextprotocol/clientCapabilities": {}}
HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json",
           "mcp-protocol-version": "2026-07-28"}


def raw_post(client: httpx.Client, url: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return client.post(url, content=json.dumps(body).encode(), headers={**HEADERS, **(headers or {})})


def test_refused_requests_are_answered_200_with_the_tether_code(world: ItemsWorld) -> None:
    w = world
    sc = w.sidecar("items-raw", HOLDS)
    url = w.server.url
    with httpx.Client(proxy=sc.proxy, trust_env=False, timeout=20) as raw:
        read = raw_post(raw, url, {"jsonrpc": "2.0", "id": "r1", "method": "resources/read",
                                   "params": {"uri": "docs://private/plan", "_meta": META}},
                        {"mcp-method": "resources/read", "mcp-name": "docs://private/plan"})
        assert read.status_code == 200 and read.headers["Tether-Error"] == ABSENT, read.text
        value = read.json()
        assert value["id"] == "r1" and value["error"]["code"] == REFUSED_JSONRPC, value
        assert value["error"]["data"]["code"] == ABSENT and value["error"]["data"]["capability"] == "docs.private"

        call = raw_post(raw, url, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                                   "params": {"name": "delete_everything", "arguments": {}, "_meta": META}},
                        {"mcp-method": "tools/call", "mcp-name": "delete_everything"})
        assert call.status_code == 200 and call.headers["Tether-Error"] == ABSENT, call.text
        result = call.json()["result"]
        assert result["isError"] is True and result["_meta"]["tether/error"]["code"] == ABSENT, result
        assert result["content"][0]["type"] == "text" and ABSENT in result["content"][0]["text"]

        # The Mcp-Name header must name what the body names, for a resource as for a tool.
        mismatch = raw_post(raw, url, {"jsonrpc": "2.0", "id": "r3", "method": "resources/read",
                                       "params": {"uri": "docs://public/readme", "_meta": META}},
                            {"mcp-method": "resources/read", "mcp-name": "docs://private/plan"})
        assert mismatch.status_code == 200 and mismatch.json()["error"]["data"]["code"] == ABSENT, mismatch.text
        b64 = raw_post(raw, url, {"jsonrpc": "2.0", "id": "r4", "method": "resources/read",
                                  "params": {"uri": "docs://public/readme", "_meta": META}},
                       {"mcp-method": "resources/read", "mcp-name": "=?base64?ZG9jczovL3B1YmxpYy9yZWFkbWU=?="})
        assert b64.status_code == 200 and "error" not in b64.json(), b64.text

        # A message without an id is not a request: refused, it keeps an HTTP error status (no JSON-RPC answer
        # exists for it), as a server that cannot accept a notification answers.
        note = raw_post(raw, url, {"jsonrpc": "2.0", "method": "resources/read",
                                   "params": {"uri": "docs://private/plan"}})
        assert note.status_code == 403 and note.headers["Tether-Error"] == ABSENT, note.text
    assert w.server.calls == ["resources/read docs://public/readme"]
    assert not w.wiretap.saw("docs://private") and not w.wiretap.saw("delete_everything")


# -- the client's listen stream ---------------------------------------------------------------------------------
def test_a_listen_stream_the_client_closes_is_not_a_lost_call(world: ItemsWorld) -> None:
    """A 2025-11-25 client opens a GET stream for the server's messages and, as the TypeScript SDK does at the end
    of a session, closes it itself (no DELETE that would let the server end it first)."""
    w = world
    agent = "items-listen"
    sc = w.sidecar(agent, HOLDS)
    legacy = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
    with httpx.Client(proxy=sc.proxy, trust_env=False, timeout=20) as raw:
        init = raw.post(w.server.url, headers=legacy, content=json.dumps({
            "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}))
        assert init.status_code == 200, init.text
        sid = {"mcp-session-id": init.headers["mcp-session-id"], "mcp-protocol-version": "2025-11-25"}
        done = raw.post(w.server.url, headers={**legacy, **sid},
                        content=json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}))
        assert done.status_code == 202, done.text
        with raw.stream("GET", w.server.url, headers={"accept": "text/event-stream", **sid}) as listen:
            assert listen.status_code == 200 and listen.headers["content-type"].startswith("text/event-stream")
            wait_until(lambda: any(m == "GET" for m, _, _ in w.wiretap.requests), WAIT, what="the GET at the server")
        # Leaving the block closes the stream, as the client's end of the session does.
    gets = wait_until(lambda: [r for r in reports_for(w.cp, agent) if r["method"] == "GET"], timeout=WAIT,
                      what="the listen stream reported")
    assert [(r["resolution"], r["status"], r["detail"]) for r in gets] == [
        ("completed", 200, "listen stream closed by the client")], gets
    assert not [r for r in reports_for(w.cp, agent) if r["resolution"] == "unknown"]


def test_a_stateless_listen_is_governed_and_closing_it_loses_nothing(world: ItemsWorld) -> None:
    """2026-07-28's ``subscriptions/listen``: list changes are plumbing, resource updates need subscriptions and
    every resource named; the stream the client closes is completed, like the GET listen stream."""
    w = world
    agent = "items-stateless-listen"
    sc = w.sidecar(agent, HOLDS)

    def body(msg_id: str, uris: list[str] | None) -> dict[str, Any]:
        notifications: dict[str, Any] = {"resourcesListChanged": True}
        if uris is not None:
            notifications["resourceSubscriptions"] = uris
        return {"jsonrpc": "2.0", "id": msg_id, "method": "subscriptions/listen",
                "params": {"notifications": notifications, "_meta": META}}

    routing = {"mcp-method": "subscriptions/listen"}
    with httpx.Client(proxy=sc.proxy, trust_env=False, timeout=20) as raw:
        refused = raw_post(raw, w.server.url, body("l1", ["docs://public/readme", "docs://private/plan"]), routing)
        assert refused.status_code == 200 and refused.json()["error"]["data"]["code"] == ABSENT, refused.text
        with raw.stream("POST", w.server.url, content=json.dumps(body("l2", ["docs://public/readme"])).encode(),
                        headers={**HEADERS, **routing}) as listen:
            assert listen.status_code == 200 and listen.headers["content-type"].startswith("text/event-stream")
            first = next(listen.iter_lines())  # the server acknowledges before anything else
            assert first, first
    assert not w.wiretap.saw("docs://private")
    listens = wait_until(lambda: [r for r in reports_for(w.cp, agent) if r["resolution"] != "refused"], timeout=WAIT,
                         what="the listen stream reported")
    assert [(r["resolution"], r["capability"], r["detail"]) for r in listens] == [
        ("completed", "items.subscriptions", "listen stream closed by the client")], listens
