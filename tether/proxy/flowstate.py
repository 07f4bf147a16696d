"""What tether knows about one flow, kept in one object under one ``flow.metadata`` key; and refusing a flow.

Every addon reads and writes the flow's ``FlowState`` (``state_of``), never ad-hoc metadata keys. ``refuse``
answers the client from the sidecar in the docs/contract.md section 5 shape (a JSON-RPC error for an MCP POST).
Addons and the credential injector import this module; it imports no addon.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import http

from tether.capability import errors as codes

from . import mcp
from .decision import Refusal
from .state import Call

KEY = "tether"


@dataclass(slots=True)
class FlowState:
    call: Call | None = None
    refused: str | None = None  # the code, once tether answered the flow itself
    outcome: str = "refused"  # the resolution a refusal gets (cancelled_not_sent for a cancelled hold)
    aborted: str | None = None  # the code, once the sidecar cut the flow off
    mcp_server: str | None = None  # the MCP endpoint the call goes to
    mcp_parsed: mcp.Parsed | None = None  # its JSON-RPC body, once read
    mcp_methods: list[str | None] | None = None  # every message's method (ToolsFilter reads tools/list answers)
    mcp_tools: tuple[str, ...] | None = None  # capabilities of the body's tools/call messages, one unit each
    mcp_callers: dict[str, str] = field(default_factory=dict)  # each tools/call request's capability, by id_key
    mcp_sse: mcp.SseToolsFilter | None = None  # the filter an SSE answer streams through
    no_stream: bool = False  # the answer is read whole (a tools/list answer in JSON)
    hold: str | None = None  # "headers" | "body": when the call waits for a person
    decided: bool = False  # the decision let it go: the forwarder takes it from there
    # proxy.mcpcalls: the client cancelled the call before its answer passed; the ledger keys of its requests;
    # how a follow-up round of it would look; the first call of its chain (re-issues, rounds); what it was
    # charged for (or would have been, when it was not)
    mcp_cancelled: bool = False
    mcp_keys: list[tuple[str, str | None, str]] = field(default_factory=list)
    mcp_round: str | None = None
    mcp_root: str | None = None
    mcp_charged: tuple[str, ...] = ()


def state_of(flow: http.HTTPFlow) -> FlowState:
    state = flow.metadata.get(KEY)
    if state is None:
        state = flow.metadata[KEY] = FlowState()
    return state


def link_call(flow: http.HTTPFlow, call: Call) -> None:
    """The flow's way back to its call, set once as the call arrives, by the in-flight table alone
    (``CallTable(link=link_call)``: ``CallTable.start`` owns the link both ways)."""
    state_of(flow).call = call


def call_of(flow: http.HTTPFlow) -> Call | None:
    state = flow.metadata.get(KEY)
    return state.call if state is not None else None


# Refusals a server would never have answered (the request never was its to answer): they keep their 4xx. An
# unknown MCP session keeps its 404 too: that is how a server answers one, and what makes a client start anew.
NOT_THE_SERVERS_ANSWER = frozenset({codes.UNKNOWN_DESTINATION, codes.CHAIN_INVALID, codes.MCP_SESSION_UNKNOWN})


def refuse(flow: http.HTTPFlow, refusal: Refusal, *, outcome: str = "refused") -> None:
    """Answer the client from the sidecar; nothing leaves for the upstream.

    A refused JSON-RPC request gets its JSON-RPC answer at HTTP 200, as a server answers one: an SDK reads a 403
    as a transport or authorization failure, not as the refusal of one request (``Tether-Error`` stays). Requests
    that are not JSON-RPC keep the refusal's status, and so do refusals of where the request goes rather than of
    what it asks (an unknown destination, a ``Host`` naming another server: a DNS-rebinding probe expects a 4xx,
    as a server's own guard answers one)."""
    state = state_of(flow)
    call = state.call
    error: dict[str, Any] = {"code": refusal.code, "message": refusal.message,
                             "call_id": call.call_id if call else None, "capability": call.capability if call else None}
    error.update({k: v for k, v in refusal.details.items() if v is not None})
    status = refusal.http_status
    if state.mcp_server and flow.request.method == "POST":
        body = mcp.error_body(state.mcp_parsed, mcp.request_id(flow.request.raw_content or b""), refusal.message,
                              error)
        if mcp.answers_requests(state.mcp_parsed) and refusal.code not in NOT_THE_SERVERS_ANSWER:
            status = 200
    else:
        body = json.dumps({"error": error}).encode()
    flow.response = http.Response.make(
        status, body,
        {"Content-Type": "application/json", "Tether-Error": refusal.code, "Cache-Control": "no-store"},
    )
    state.refused = refusal.code
    state.outcome = outcome
