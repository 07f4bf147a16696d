"""The decision's vocabulary, pure and shared: what a request's facts are, the answers a decision gives, and the
checks every kind's decider makes. No I/O, no flows, no clock.

A decision reads a request's ``Facts`` and a ``ChainState`` and answers ``Allow`` (forward it once the final
look, the budget and the write-ahead record let it leave), ``Hold`` (a person decides first), ``ReadBody`` (a
JSON-RPC POST to an MCP server: decide again once its body is here) or ``Refused`` with a ``Refusal`` that carries
a stable code from docs/contract.md section 5 and its HTTP status. Every answer also says what the call matched
(capability, tier, MCP server), for the report and for the error body.

It lives in the shared model, not the sidecar, so that each capability kind's decider (its ``decide``, in its
module under ``capability/kinds/``) is written beside the kind's model in the same words. The sidecar's
``decide`` (``tether/proxy/decision.py``) checks the request line and asks the kinds in turn.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from . import errors as codes
from .errors import TetherError

if TYPE_CHECKING:
    from .catalog import Catalog
    from .mcpwire import Parsed

HTTP_STATUS = {
    codes.CAPABILITY_ABSENT: 403,
    codes.UNKNOWN_DESTINATION: 403,
    codes.CHAIN_INVALID: 403,
    codes.CHAIN_REVOKED: 403,
    codes.CHAIN_EXPIRED: 403,
    codes.LEASE_EXPIRED: 503,
    codes.DRAINING: 503,
    codes.STOPPING: 503,
    codes.TERMINATED: 503,
    codes.APPROVAL_DENIED: 403,
    codes.APPROVAL_TIMEOUT: 403,
    codes.CAPTURE_UNAVAILABLE: 503,
    codes.SPOOL_UNAVAILABLE: 503,
    codes.CREDENTIAL_UNAVAILABLE: 503,
    codes.BUDGET_EXHAUSTED: 429,
    codes.RATE_LIMITED: 429,
    codes.BAD_REQUEST: 400,
}

METHOD = re.compile(r"[A-Z]{1,16}")
_RANK = {"direct": 0, "approval": 1}


class Refusal(TetherError):
    """A call tether refuses; nothing was sent upstream."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(message, code=code, **details)
        self.http_status = HTTP_STATUS.get(code, 403)


class ChainState(Protocol):
    """What the decision reads of the sidecar's state (``proxy.state.SidecarState``)."""

    mode: str

    @property
    def agent(self) -> str: ...

    @property
    def wire(self) -> str: ...

    def tier(self, capability: str) -> str: ...

    def refusal(self, now: float, now_mono: float) -> Refusal | None: ...


# Facts and answers are built once per call on the sidecar's hot path and never changed after: plain slotted
# dataclasses, not frozen ones (a frozen dataclass's __init__ costs three times as much).
@dataclass(slots=True, kw_only=True)
class Facts:
    """One request as the agent sent it, and when: everything a decision reads (the edge, tether/proxy/enforce.py,
    reads them off a mitmproxy flow)."""

    method: str  # as matched: upper-cased
    sent_method: str  # as sent (methods are case-sensitive)
    host: str
    port: int
    path: str  # the request target, query included
    url: str  # scheme://host:port/path, no query: the call's URL
    now: float
    now_mono: float
    rewrite_headers: tuple[str, ...] = ()  # of proxy/decision.py's REWRITE_HEADERS, in that order
    malformed_field: str | None = None  # the first header field RFC 9112 does not allow (obs-fold, CR, LF ...)
    spelled_headers: tuple[str, ...] = ()  # underscore spellings of SPELLED_HEADERS, as sent
    upgrade: bool = False
    websocket: bool = False  # the upgrade asked for is a websocket (Upgrade: websocket on a GET)
    chain_header: str | None = None  # Tether-Chain
    host_header: str | None = None  # Host, or :authority
    mcp_method: str | None = None  # the mcp-method header
    mcp_name: str | None = None  # the mcp-name header
    content_encoding: str | None = None
    body: bytes | None = None  # None until the body is here


@dataclass(slots=True, kw_only=True)
class Answer:
    capability: str | None = None  # what the call matched (several, comma-joined, for a batch of item uses)
    tier: str | None = None
    server: str | None = None  # the MCP endpoint, when the call goes to one
    detail: str | None = None  # for the report: which MCP plumbing it was
    tools: tuple[str, ...] | None = None  # the capabilities a JSON-RPC body's messages use (tools, resources,
    #                                       prompts, plumbing): one budget unit each; the name it had for tools only
    parsed: Parsed | None = None  # the JSON-RPC body, once read
    callers: dict[str, str] | None = None  # each tools/call request's capability, by its id (mcpwire.id_key): a task
    #                                        the call creates belongs to it, in a batch too


@dataclass(slots=True, kw_only=True)
class Allow(Answer):
    pass


@dataclass(slots=True, kw_only=True)
class Hold(Answer):
    pass


@dataclass(slots=True, kw_only=True)
class ReadBody(Answer):
    pass


@dataclass(slots=True, kw_only=True)
class Refused(Answer):
    refusal: Refusal


Decision = Allow | Hold | ReadBody | Refused
# A kind's decider: its answer for a request it claims (one its capabilities could grant), None for any other.
Decider = Callable[["Catalog", "ChainState", Facts], "Decision | None"]


def best(chain: ChainState, names: list[str]) -> tuple[str, str]:
    """Of the capabilities a request falls under, the one granted at the best tier, and that tier."""
    ranked = sorted(names, key=lambda n: _RANK.get(chain.tier(n), 2))
    return ranked[0], chain.tier(ranked[0])


def state_and_headers(chain: ChainState, facts: Facts, *, websocket_ok: bool = False) -> Refusal | None:
    """May anything leave now, and do the headers say what the connection does?"""
    refusal = chain.refusal(facts.now, facts.now_mono)
    if refusal is not None:
        return refusal
    if facts.websocket and facts.method == "GET" and websocket_ok:
        pass  # a websocket the capability grants: the connection is the call (tracked, drained, cut, captured)
    elif facts.websocket:
        return Refusal(codes.CAPABILITY_ABSENT, "no capability here grants a websocket (an http capability takes "
                       "websocket: true)", reason="websocket")
    elif facts.upgrade or facts.method == "CONNECT":
        # Another upgraded stream (h2c, a tunnel in a tunnel) would outlive the call's decision (and a
        # revocation, drain or abort) unseen: tether does not let one start.
        return Refusal(codes.CAPABILITY_ABSENT, "protocol upgrades other than granted websockets (h2c, tunnels in "
                       "tunnels) are not forwarded")
    if facts.chain_header is not None and facts.chain_header.strip() != chain.wire:
        return Refusal(codes.CHAIN_INVALID, "the request carries a Tether-Chain that is not this sidecar's; "
                       "an agent cannot borrow another chain", reason="foreign_chain")
    host_header = facts.host_header
    if host_header:
        name, port = host_header, None
        if not host_header.endswith("]") and ":" in host_header:
            name, _, port = host_header.rpartition(":")
        same_port = port is None or (port.isdigit() and int(port) == facts.port)
        if name.strip("[]").lower().rstrip(".") != facts.host.lower().rstrip(".") or not same_port:
            return Refusal(codes.UNKNOWN_DESTINATION,
                           f"Host header {host_header!r} does not name the destination {facts.host}:{facts.port}")
    return None
