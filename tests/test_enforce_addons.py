"""The enforcement addons (tether/proxy/enforce.py) on mitmproxy's test flows, in tether's own pipeline.

Real parts: mitmproxy's ``tflow`` flows, tether's ``Pipeline``, a real catalog, chain state, in-flight table
and spool (``Reporter``). The one stand-in is the person who answers an approval: ``Holds`` takes that answer
as a callable, so a test gives it the answer a person would. What the sidecar process adds on top (the
control plane, real sockets) is tested end to end in test_sidecar_http and test_mcp.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import http
from mitmproxy.test import tflow, tutils

from tether.capability import errors as codes
from tether.capability import keys
from tether.capability.catalog import parse_catalog
from tether.capability.chain import Verifier, mint_root
from tether.proxy.addons import Capture, Resolver, Tracker
from tether.proxy.capture import CaptureWriter
from tether.proxy.channel import ControlChannel
from tether.proxy.enforce import Enforcer, Forwarder, Holds, Tunnels
from tether.proxy.flowstate import link_call, state_of
from tether.proxy.pipeline import Pipeline
from tether.proxy.reporting import Reporter
from tether.proxy.state import Call, CallTable, SidecarState

CATALOG = parse_catalog("""
capabilities:
  files.read:  {http: {host: files.example, methods: [GET], path: "/files/*"}}
  files.write: {http: {host: files.example, methods: [PUT], path: "/files/*"}}
  files.purge: {http: {host: files.example, methods: [DELETE], path: "/files/*"}}
  mail.send:   {mcp: {url: "http://mcp.example/mcp", tool: send}}
  mail.delete: {mcp: {url: "http://mcp.example/mcp", tool: delete}}
""")
TRUST, AGENT = keys.generate(), keys.generate()


class Rig:
    """The enforcement part of a sidecar's pipeline, around one chain state."""

    def __init__(self, tmp_path: Path, answer: str = "approved", *, spool: Path | None = None,
                 capture: Capture | None = None) -> None:
        wire = mint_root(TRUST, agent="agent-1", subject_key=AGENT.public_key(), now=time.time(), ttl_s=600, depth=0,
                         caps={"files.read": "direct", "files.write": "approval", "mail.send": "direct"},
                         catalog=CATALOG)
        verifier = Verifier(TRUST.public_key(), catalog_hash=CATALOG.hash)
        self.state = SidecarState(verifier.verify(wire, now=time.time()), verifier, lease_ttl_s=15.0)
        self.state.renewed(time.monotonic())
        self.calls = CallTable(link_call)
        self.spool = spool or tmp_path / "spool"
        self.reporter = Reporter(ControlChannel("http://127.0.0.1:9", "agent-1", "link", AGENT), self.spool)
        self.answer = answer
        self.asked: list[str | None] = []
        self.pipeline = Pipeline([
            Tracker("agent-1", self.track), Tunnels(CATALOG, self.state, self.track, self.resolve),
            Enforcer(CATALOG, self.state), Holds(self.state, self.approve),
            Forwarder(self.state, None, self.reporter.start), *([capture] if capture else []), Resolver(self.resolve)])

    def track(self, call: Call, flow: http.HTTPFlow) -> None:
        self.calls.start(call, flow)

    def resolve(self, call: Call, resolution: str, *, detail: str | None = None, **more: Any) -> None:
        self.calls.resolve(call.call_id, resolution, time.time(), detail=detail or call.detail, **more)

    async def approve(self, call: Call) -> str:
        self.asked.append(call.capability)
        return self.answer

    async def send(self, flow: http.HTTPFlow) -> http.HTTPFlow:
        """The request hooks as mitmproxy runs them, then the response hook."""
        for hook in (self.pipeline.requestheaders, self.pipeline.request):
            waiting = hook(flow)
            if waiting is not None:
                await waiting
        if flow.response is None:
            flow.response = tutils.tresp()  # the tool answered
        self.pipeline.response(flow)
        return flow


def request(method: str = "GET", path: str = "/files/a", host: str = "files.example", body: bytes = b"",
            **headers: str) -> http.HTTPFlow:
    fields = ((b"host", host.encode()), *((k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()))
    req = tutils.treq(method=method.encode(), host=host, port=80, path=path.encode(), content=body,
                      headers=http.Headers(fields))
    return tflow.tflow(req=req)


def error_of(flow: http.HTTPFlow) -> dict[str, Any]:
    assert flow.response is not None
    return json.loads(flow.response.content or b"")


async def test_a_granted_call_is_written_ahead_and_leaves(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    flow = await rig.send(request())
    assert flow.response is not None and flow.response.status_code == 200  # the tool's answer
    state = state_of(flow)
    assert state.refused is None and state.call is not None and state.call.capability == "files.read"
    assert rig.reporter.inflight == 1 and "files.read" in rig.spool.read_text()  # its start, spooled
    assert rig.calls.counts["completed"] == 1


@pytest.mark.parametrize(("flow", "status", "code"), [
    (request("DELETE"), 403, codes.CAPABILITY_ABSENT),
    (request(host="evil.example"), 403, codes.UNKNOWN_DESTINATION),
    (request(x_original_url="/files/b"), 403, codes.CAPABILITY_ABSENT),
    (request(tether_chain="a.b.c"), 403, codes.CHAIN_INVALID),
])
async def test_a_refusal_answers_the_agent_and_nothing_leaves(tmp_path: Path, flow: http.HTTPFlow, status: int,
                                                             code: str) -> None:
    rig = Rig(tmp_path)
    await rig.send(flow)
    assert flow.response is not None and flow.response.status_code == status
    assert flow.response.headers["Tether-Error"] == code
    call = state_of(flow).call
    assert call is not None and error_of(flow)["error"]["call_id"] == call.call_id
    assert error_of(flow)["error"]["code"] == code
    assert rig.reporter.inflight == 0 and rig.calls.counts["refused"] == 1 and call.code == code


async def test_the_sidecars_own_chain_does_not_reach_the_tool(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    flow = await rig.send(request(tether_chain=rig.state.wire))
    assert state_of(flow).refused is None and "Tether-Chain" not in flow.request.headers


async def test_no_call_leaves_without_its_start_on_disk(tmp_path: Path) -> None:
    rig = Rig(tmp_path, spool=tmp_path / "missing" / "spool")
    flow = await rig.send(request())
    assert flow.response is not None and flow.response.status_code == 503
    assert flow.response.headers["Tether-Error"] == codes.SPOOL_UNAVAILABLE


@pytest.mark.parametrize("allow_uncaptured", [False, True])
async def test_a_call_that_cannot_be_captured(tmp_path: Path, allow_uncaptured: bool) -> None:
    (tmp_path / "a-directory").mkdir()  # the capture file cannot be opened
    rig = Rig(tmp_path, capture=Capture(CaptureWriter(tmp_path / "a-directory"), allow_uncaptured))
    flow = await rig.send(request())
    assert flow.response is not None
    if allow_uncaptured:
        call = state_of(flow).call
        assert flow.response.status_code == 200 and call is not None and call.detail is not None
        assert call.detail.startswith("uncaptured")
    else:
        assert flow.response.status_code == 503
        assert flow.response.headers["Tether-Error"] == codes.CAPTURE_UNAVAILABLE


async def test_a_revocation_between_the_headers_and_the_body_stops_the_call(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    flow = request()
    rig.pipeline.requestheaders(flow)
    rig.state.revoke(list(rig.state.chain.jtis), time.monotonic())
    rig.pipeline.request(flow)
    assert flow.response is not None and flow.response.headers["Tether-Error"] == codes.CHAIN_REVOKED
    assert rig.reporter.inflight == 0


@pytest.mark.parametrize(("answer", "code"), [("approved", None), ("denied", codes.APPROVAL_DENIED),
                                               ("timeout", codes.APPROVAL_TIMEOUT)])
async def test_an_approval_call_waits_for_its_answer(tmp_path: Path, answer: str, code: str | None) -> None:
    rig = Rig(tmp_path, answer)
    flow = await rig.send(request("PUT", body=b"new content"))
    assert rig.asked == ["files.write"]
    assert flow.response is not None and flow.response.headers.get("Tether-Error") == code
    assert rig.reporter.inflight == (1 if code is None else 0)


async def test_an_mcp_refusal_is_a_jsonrpc_error_for_that_request(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    body = json.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "delete"}}).encode()
    flow = await rig.send(request("POST", "/mcp", host="mcp.example", body=body))
    answer = error_of(flow)
    # A refused tools/call is the result SDKs hand the model as a tool error; tether's error rides in _meta.
    assert answer["id"] == 7 and answer["result"]["isError"] is True, answer
    error = answer["result"]["_meta"]["tether/error"]
    assert error["code"] == codes.CAPABILITY_ABSENT and error["capability"] == "mail.delete"
    assert codes.CAPABILITY_ABSENT in answer["result"]["content"][0]["text"]
    assert flow.response is not None and flow.response.headers["Tether-Error"] == codes.CAPABILITY_ABSENT
    # Any other refused request is a JSON-RPC error carrying the tether code in data.code.
    body = json.dumps({"jsonrpc": "2.0", "id": 8, "method": "prompts/get", "params": {"name": "p"}}).encode()
    answer = error_of(await rig.send(request("POST", "/mcp", host="mcp.example", body=body)))
    assert answer["id"] == 8 and answer["error"]["data"]["code"] == codes.CAPABILITY_ABSENT, answer


async def test_a_granted_tool_call_leaves_with_its_body_read(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "send"}}).encode()
    flow = await rig.send(request("POST", "/mcp", host="mcp.example", body=body))
    state = state_of(flow)
    assert state.refused is None and state.mcp_tools == ("mail.send",) and state.mcp_methods == ["tools/call"]
    assert rig.reporter.inflight == 1


def test_tunnels_only_to_the_catalog_and_no_raw_streams(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    allowed = tflow.tflow(req=tutils.treq(method=b"CONNECT", host="files.example", port=443, path=b""))
    rig.pipeline.http_connect(allowed)
    assert allowed.response is None
    refused = tflow.tflow(req=tutils.treq(method=b"CONNECT", host="evil.example", port=443, path=b""))
    rig.pipeline.http_connect(refused)
    assert refused.response is not None and refused.response.headers["Tether-Error"] == codes.UNKNOWN_DESTINATION
    assert rig.calls.counts["refused"] == 1  # a refused tunnel is a call on the record
    raw = tflow.ttcpflow()
    rig.pipeline.tcp_start(raw)
    assert raw.error is not None  # killed


@pytest.mark.parametrize("module", ["addons", "enforce", "flowstate", "credentials", "decision", "state", "phases",
                                    "quiesce", "stopping", "loops", "approvals", "cutting"])
def test_no_addon_imports_the_sidecar(module: str) -> None:
    """The sidecar builds the addons; an addon (or what it imports) never imports the sidecar back, and the
    credential injector and the flow state do not need the other addons."""
    code = f"import sys, json, tether.proxy.{module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    loaded = set(json.loads(out.stdout))
    assert "tether.proxy.sidecar" not in loaded
    assert module == "addons" or "tether.proxy.addons" not in loaded


def test_the_decision_imports_no_mitmproxy() -> None:
    code = "import sys, tether.proxy.decision; print([m for m in sys.modules if m.split('.')[0] == 'mitmproxy'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
