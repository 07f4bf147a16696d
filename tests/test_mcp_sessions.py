"""An MCP session belongs to the sidecar run that saw it issued, and hidden tools are absent from the server's own
messages too (issue 23 item 4). Two agents' sidecars in front of one SDK server; a wiretap on the server says
what reached it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from mcp import Client

from .harness import SidecarProcess, wait_until
from .mcp_next import HEADERS, LEGACY, WAIT, NextWorld, next_world

UNKNOWN = "tether.mcp_session_unknown"
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NextWorld]:
    yield from next_world(tmp_path_factory.mktemp("mcp-sessions"))


def open_session(http: httpx.Client, url: str) -> str:
    answer = http.post(url, json=INIT, headers=HEADERS)
    assert answer.status_code == 200, answer.text
    session = answer.headers["mcp-session-id"]
    done = http.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                     headers={**HEADERS, "mcp-session-id": session, "mcp-protocol-version": LEGACY})
    assert done.status_code == 202, done.text
    return session


def rpc(method: str, params: dict[str, Any] | None = None, id_: int = 2) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id_, "method": method, "params": params or {}}


def with_session(session: str) -> dict[str, str]:
    return {**HEADERS, "mcp-session-id": session, "mcp-protocol-version": LEGACY}


def refused_unknown(answer: httpx.Response) -> None:
    assert answer.status_code == 404, (answer.status_code, answer.text)
    assert answer.headers["tether-error"] == UNKNOWN
    body = answer.json()
    error = body["error"]
    assert error.get("data", error).get("code") == UNKNOWN, body


def test_a_session_opened_through_one_sidecar_is_refused_through_another(world: NextWorld) -> None:
    caps = {"next.add": "direct"}
    first, second = world.sidecar("sess-first", caps), world.sidecar("sess-second", caps)
    url = world.server.url

    def reached(session: str) -> int:
        return sum(1 for _, headers, _ in world.wiretap.requests if headers.get("mcp-session-id") == session)

    with httpx.Client(proxy=first.proxy, trust_env=False, timeout=WAIT) as a, \
            httpx.Client(proxy=second.proxy, trust_env=False, timeout=WAIT) as b:
        session = open_session(a, url)
        seen = reached(session)

        refused_unknown(b.post(url, json=rpc("tools/list"), headers=with_session(session)))
        refused_unknown(b.post(url, json=rpc("tools/call", {"name": "add", "arguments": {"a": 1, "b": 2}}),
                               headers=with_session(session)))
        refused_unknown(b.get(url, headers=with_session(session)))
        refused_unknown(b.delete(url, headers=with_session(session)))
        assert reached(session) == seen  # none of the second agent's requests reached the server
        assert "add" not in world.server.calls

        called = a.post(url, json=rpc("tools/call", {"name": "add", "arguments": {"a": 1, "b": 2}}),
                        headers=with_session(session))
        assert called.status_code == 200 and '"text":"3"' in called.text.replace(" ", ""), called.text
        assert a.delete(url, headers=with_session(session)).status_code == 200
        after = reached(session)
        # Ended through the first sidecar: no longer usable through it either (the server would say 404 too).
        refused_unknown(a.post(url, json=rpc("tools/list"), headers=with_session(session)))
        assert reached(session) == after

    reports = wait_until(lambda: len(r := world.reports("sess-second")) >= 4 and r, WAIT, what="the refusals")
    assert [(r["resolution"], r["code"], r["method"]) for r in reports] == [
        ("refused", UNKNOWN, "POST"), ("refused", UNKNOWN, "POST"), ("refused", UNKNOWN, "GET"),
        ("refused", UNKNOWN, "DELETE")]


def test_an_sdk_session_through_its_own_sidecar_is_unaffected(world: NextWorld) -> None:
    sidecar = world.sidecar("sess-sdk", {"next.add": "direct"})

    async def body(client: Client) -> Any:
        await client.list_tools()
        return await client.call_tool("add", {"a": 2, "b": 3})

    result = world.session(sidecar, "legacy", body)
    assert not result.is_error and result.content[0].text == "5"
    reports = wait_until(lambda: (r := world.reports("sess-sdk")) and all(x["resolution"] for x in r) and r, WAIT,
                         what="the session's reports")
    assert not [r for r in reports if r["code"] == UNKNOWN], reports


def test_a_sampling_request_offers_the_client_only_the_tools_the_agent_holds(world: NextWorld) -> None:
    from mcp.types import CreateMessageResultWithTools, SamplingCapability, SamplingToolsCapability, TextContent

    sidecar: SidecarProcess = world.sidecar("sess-sampling", {"next.add": "direct", "next.ask": "direct"})
    offered: list[list[str]] = []

    async def sample(context: Any, params: Any) -> CreateMessageResultWithTools:
        offered.append([tool.name for tool in params.tools or []])
        return CreateMessageResultWithTools(role="assistant", content=[TextContent(type="text", text="fine")],
                                            model="host-model")

    async def body(client: Client) -> Any:
        return await client.call_tool("ask", {"question": "which tools?"})

    result = world.session(sidecar, "legacy", body, sampling_callback=sample,
                           sampling_capabilities=SamplingCapability(tools=SamplingToolsCapability()))
    assert not result.is_error and result.content[0].text == "the model said fine", result
    assert offered == [["add"]]  # delete_everything is not granted: it is not offered either
    # The server did offer both: the wiretap sees only client->server traffic, so check the server's own log.
    assert "ask" in world.server.calls


def test_the_filter_removes_hidden_tools_from_server_requests_and_input_required_results() -> None:
    from tether.proxy import mcp

    visible = mcp.Visible(tool=lambda name: name == "add")
    tools = [{"name": "add"}, {"name": "delete_everything"}, "junk"]
    request = {"jsonrpc": "2.0", "id": 7, "method": "sampling/createMessage",
               "params": {"messages": [], "maxTokens": 5, "tools": list(tools)}}
    value, removed = mcp.filter_lists_message(json.loads(json.dumps(request)), visible)
    assert removed == 2 and value["params"]["tools"] == [{"name": "add"}]
    embedded = {"jsonrpc": "2.0", "id": 8, "result": {"resultType": "input_required", "inputRequests": {
        "s": {"method": "sampling/createMessage", "params": {"messages": [], "maxTokens": 5, "tools": list(tools)}},
        "e": {"method": "elicitation/create", "params": {"message": "ok?"}}}}}
    value, removed = mcp.filter_lists_message(json.loads(json.dumps(embedded)), visible)
    assert removed == 2 and value["result"]["inputRequests"]["s"]["params"]["tools"] == [{"name": "add"}]
    assert value["result"]["inputRequests"]["e"] == embedded["result"]["inputRequests"]["e"]
