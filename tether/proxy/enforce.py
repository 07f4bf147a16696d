"""Enforcement at mitmproxy's edge: read a flow's facts, ask ``proxy.decision``, act on the answer.

Four addons, in pipeline order, each with the few collaborators it uses:
``Tunnels`` (CONNECT, the TLS server name, raw TCP/UDP), ``Enforcer`` (the HTTP and MCP request decision),
``Holds`` (a person's approval for an ``approval``-tier call) and ``Forwarder`` (the final look, the budget
unit and the write-ahead record, just before a call leaves). They share the flow's ``FlowState``.

Decisions run synchronously (no coroutine per call); only a call that must wait (for a person, a budget
slice) returns an awaitable, which mitmproxy awaits for that flow alone. Any failure to decide refuses the
call (fail closed: an exception escaping a mitmproxy hook would let the call through).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from mitmproxy import http

from tether.capability import errors as codes
from tether.capability.catalog import Catalog
from tether.capability.events import APPROVAL_BODY_LIMIT
from tether.capability.kinds.http import override_refusal

from .decision import (
    REWRITE_HEADERS,
    SPELLED_HEADERS,
    ChainState,
    Decision,
    Facts,
    Hold,
    ReadBody,
    Refusal,
    Refused,
    after_approval,
    body_override,
    decide,
    decide_tunnel,
)
from .flowstate import FlowState, refuse, state_of
from .framing import BODY_LIMIT, BodyLimit, no_continue
from .phases import ARRIVED, FORWARDING, HELD, advance
from .state import Call

log = logging.getLogger("tether.sidecar")

STREAM_THRESHOLD = 1024 * 1024
Spend = Callable[[list[str], str], Awaitable[None] | None]


def announced_length(req: http.Request) -> int | None:
    """The body length the request's Content-Length announces; None when it announces none (chunked, HTTP/2
    without one) or one that is not a number."""
    length = req.headers.get("content-length", "")
    return int(length) if length.isdigit() else None


def large_upload(req: http.Request) -> bool:
    """A body too large (or of unknown length) to hold in memory: it streams through once decided, unless its
    call is held for approval (``Holds`` reads such a body whole, or refuses it)."""
    length = announced_length(req)
    return (length is not None and length > STREAM_THRESHOLD) or "chunked" in req.headers.get("transfer-encoding", "")


def body_too_large(size: int | None) -> Refusal:
    told = f"{size} bytes" if size is not None else "a body that was still growing"
    refusal = Refusal(codes.APPROVAL_BODY_TOO_LARGE, f"an approval-tier call's body is shown whole to the approver, "
                      f"up to {APPROVAL_BODY_LIMIT} bytes; this one has {told}: refused (send a smaller body, or "
                      "ask for a direct grant)", limit=APPROVAL_BODY_LIMIT)
    refusal.http_status = 413
    return refusal


_READ = frozenset({*(n.encode() for n in REWRITE_HEADERS), b"upgrade", b"tether-chain", b"mcp-method", b"mcp-name",
                   b"content-encoding"})
_SPELLED = frozenset(n.replace("-", "_").encode() for n in SPELLED_HEADERS)
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a field name (RFC 9110 token)
_BAD_VALUE = re.compile(rb"[\x00\r\n]")  # obs-fold reaches here as CRLF + space inside the value (mitmproxy joins it)


class HeaderFacts(dict[str, str]):
    """The headers the decision reads, by lower-case name, with what is wrong with the field set (if anything)."""

    malformed: str | None = None  # the first field RFC 9112 does not allow, named for the refusal
    spelled: tuple[str, ...] = ()  # underscore spellings of SPELLED_HEADERS, as sent


def header_facts(fields: tuple[tuple[bytes, bytes], ...]) -> HeaderFacts:
    """The headers the decision reads, by lower-case name, in one pass over the request's fields (a lookup in
    mitmproxy's ``Headers`` scans them all, per name). Repeated fields join with ", " as ``Headers`` joins them.
    The same pass notes a malformed field and underscore spellings (``proxy.decision`` refuses either)."""
    found = HeaderFacts()
    spelled: list[str] = []
    for raw_name, raw_value in fields:
        key = raw_name.lower()
        if found.malformed is None and (_BAD_VALUE.search(raw_value) or not _TOKEN.fullmatch(raw_name)):
            found.malformed = repr(raw_name.decode("utf-8", "replace"))[:80]
        if key in _READ:
            name, value = key.decode(), raw_value.decode("utf-8", "surrogateescape")
            found[name] = f"{found[name]}, {value}" if name in found else value
        elif b"_" in key and key in _SPELLED:
            spelled.append(raw_name.decode("ascii", "replace"))
    found.spelled = tuple(spelled)
    return found


# Hop-by-hop fields (RFC 9110 7.6.1) the agent's connection to the sidecar may carry: never the tool's business.
# Connection itself stays (mitmproxy reads it for the agent's connection); what it names goes, but an Upgrade
# of a granted websocket. Proxy-Authorization would be the agent's credential for its proxy: it stops here.
# Trailer announces trailer fields, which the sidecar discards (tether/proxy/framing.py): it goes with them.
HOP_BY_HOP = ("proxy-connection", "keep-alive", "te", "trailer", "proxy-authorization", "proxy-authenticate")


def drop_hop_by_hop(headers: http.Headers, websocket: bool) -> None:
    named = {t.strip().lower() for t in ",".join(headers.get_all("connection")).split(",") if t.strip()}
    for name in (*HOP_BY_HOP, *named):
        if name in ("close", "connection", "host") or (websocket and name == "upgrade"):
            continue
        headers.pop(name, None)


def undecided(flow: http.HTTPFlow, exc: Exception) -> None:
    log.error("could not decide on %s %s; refusing it", flow.request.method, flow.request.pretty_url, exc_info=exc)
    refuse(flow, Refusal(codes.CAPABILITY_ABSENT, f"tether could not decide on this call ({exc!r}); refused"))


async def guarded(flow: http.HTTPFlow, waiting: Awaitable[None]) -> None:
    """Await a call's wait; a refusal (or any failure) answers the client instead of letting it go."""
    try:
        await waiting
    except Refusal as refusal:
        refuse(flow, refusal)
    except Exception as exc:
        undecided(flow, exc)


class Tunnels:
    """Connections before any request: CONNECT to a destination in the catalog only, upstream TLS named for
    it, and nothing that is not HTTP."""

    def __init__(self, catalog: Catalog, chain: ChainState, track: Callable[[Call, http.HTTPFlow], None],
                 resolve: Callable[..., None]) -> None:
        self.catalog, self.chain, self.track, self.resolve = catalog, chain, track, resolve

    def http_connect(self, flow: http.HTTPFlow) -> None:
        host, port = flow.request.host, flow.request.port
        refusal = decide_tunnel(self.catalog, self.chain, host, port, time.time(), time.monotonic())
        if refusal is None:
            return
        call = Call(call_id=str(uuid.uuid4()), agent=self.chain.agent, method="CONNECT", url=f"{host}:{port}",
                    started_at=time.time())
        self.track(call, flow)  # the in-flight table links the call and the flow, both ways
        refuse(flow, refusal)
        self.resolve(call, "refused", code=refusal.code)

    def tls_clienthello(self, data: Any) -> None:
        """Upstream TLS names the destination the policy checked (the CONNECT host), never another name.

        mitmproxy would pass the agent's SNI upstream: on a shared CDN, a CONNECT to a granted host carrying
        another site's name in its SNI would reach that site (domain fronting)."""
        server = data.context.server
        if server.address is None:
            return
        host = str(server.address[0])
        sni = data.client_hello.sni
        if sni and sni.lower().rstrip(".") != host.lower().rstrip("."):
            log.warning("agent %s sent TLS server name %r inside a tunnel to %s; upstream gets %r",
                        self.chain.agent, sni, host, host)
        server.sni = host

    # Anything that is not HTTP has no capability to match: it does not exist for the agent.
    def tcp_start(self, flow: Any) -> None:
        log.warning("refusing a raw TCP stream to %s", flow.server_conn.address)
        flow.kill()

    def udp_start(self, flow: Any) -> None:
        flow.kill()


LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


def own_destinations(controlplane_url: str) -> frozenset[tuple[str, int]]:
    """Where the sidecar's own control plane listens, as (host, port) a request could name (a loopback address in
    each of its spellings): never a tool, whatever the catalog says."""
    from urllib.parse import urlsplit

    parts = urlsplit(controlplane_url)
    host = (parts.hostname or "").lower()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    hosts = LOOPBACK_NAMES if host in LOOPBACK_NAMES else {host}
    return frozenset((h, port) for h in hosts)


class Enforcer:
    """Absence, not gates: match every call to a capability and let go only what the chain grants. The sidecar's
    own control plane is never a destination (``forbidden``): an agent reaches it only through what the sidecar
    itself sends, even under a catalog that names its address."""

    def __init__(self, catalog: Catalog, chain: ChainState,
                 forbidden: frozenset[tuple[str, int]] = frozenset()) -> None:
        self.catalog, self.chain, self.forbidden = catalog, chain, forbidden

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is None:
            self._decide(flow, at_headers=True)
            if flow.response is not None:
                no_continue(flow)  # refused at its headers: a client waiting for 100 Continue is answered now

    def request(self, flow: http.HTTPFlow) -> None:
        # Trailer fields stop here (tether/proxy/framing.py drops them from HTTP/1 bodies; an HTTP/2 agent's would be
        # sent on after this hook): nothing was decided on them.
        flow.request.trailers = None
        if flow.response is not None or flow.request.stream:
            return  # answered by tether already, or decided at the headers and streaming
        state = state_of(flow)
        if state.call is None or (not state.decided and state.mcp_server is not None and state.mcp_parsed is None):
            self._decide(flow, at_headers=False)  # a JSON-RPC body decides once it is here
        elif state.decided and state.mcp_server is None:
            self._body_override(flow, state.call)

    def _body_override(self, flow: http.HTTPFlow, call: Call) -> None:
        """A method override in the body (``_method=DELETE`` in a form): refused unless the call's capability
        grants that method too. Read as sent: a body with a Content-Encoding is not decoded (servers do not)."""
        req = flow.request
        try:
            override = body_override(req.headers.get("content-type"), req.raw_content or b"")
            if override is None:
                return
            facts = Facts(method=req.method, sent_method=req.method, host=req.host, port=req.port, path=req.path,
                          url=call.url, now=time.time(), now_mono=time.monotonic())
            refusal = override_refusal(self.catalog, facts, call.capability, override)
        except Exception as exc:
            undecided(flow, exc)
            return
        if refusal is not None:
            state_of(flow).hold = None  # refused: nobody is asked to approve it
            refuse(flow, refusal)

    def _decide(self, flow: http.HTTPFlow, *, at_headers: bool) -> None:
        state = state_of(flow)
        if state.call is None:  # every request is tracked; one that is not cannot be decided on
            refuse(flow, Refusal(codes.CAPABILITY_ABSENT, "an untracked request is not forwarded"))
            return
        if (flow.request.host.lower().strip("[]"), flow.request.port) in self.forbidden:
            refuse(flow, Refusal(codes.CAPABILITY_ABSENT, "the sidecar's control plane is not a tool: an agent "
                                 "reaches it only through its sidecar", reason="controlplane"))
            return
        try:
            req = flow.request
            facts = self._facts(req, state.call, None if at_headers else req.raw_content or b"")
            self._apply(flow, state, state.call, decide(self.catalog, self.chain, facts), facts)
        except Exception as exc:
            undecided(flow, exc)

    @staticmethod
    def _facts(req: http.Request, call: Call, body: bytes | None) -> Facts:
        found = header_facts(req.headers.fields)
        return Facts(method=req.method, sent_method=req.data.method.decode("utf-8", "replace"), host=req.host,
                     port=req.port, path=req.path, url=call.url, now=time.time(), now_mono=time.monotonic(),
                     rewrite_headers=tuple(n for n in REWRITE_HEADERS if n in found), upgrade="upgrade" in found,
                     malformed_field=found.malformed, spelled_headers=found.spelled,
                     websocket="websocket" in found.get("upgrade", "").lower(),
                     chain_header=found.get("tether-chain"), host_header=req.host_header,
                     mcp_method=found.get("mcp-method"), mcp_name=found.get("mcp-name"),
                     content_encoding=found.get("content-encoding"), body=body)

    def _apply(self, flow: http.HTTPFlow, state: FlowState, call: Call, answer: Decision, facts: Facts) -> None:
        call.capability, call.tier, call.detail = answer.capability, answer.tier, answer.detail  # for the report
        state.mcp_server, state.mcp_parsed = answer.server, answer.parsed
        if isinstance(answer, ReadBody):
            return
        if facts.chain_header is not None and facts.chain_header.strip() == self.chain.wire:
            del flow.request.headers["Tether-Chain"]  # the sidecar's own chain is not the tool's business
        if isinstance(answer, Refused):
            refuse(flow, answer.refusal)
            return
        drop_hop_by_hop(flow.request.headers, facts.websocket)
        if answer.parsed is not None:
            # Every message's method, a batch with tools/call in it included: ToolsFilter reads the answer of any
            # request that lists tools, whatever else shares its batch.
            state.mcp_methods = [m.method for m in answer.parsed.messages]
            state.mcp_tools = answer.tools
            state.mcp_callers = answer.callers or {}
        state.decided = True
        if isinstance(answer, Hold):
            # Held at the headers only when the body will stream through (unseen by the approver); otherwise
            # once the body is here, so the approver sees what would leave.
            state.hold = "headers" if facts.body is None and large_upload(flow.request) else "body"


# What the control plane answers when it will not file a held call: the call is refused with the same code.
_FILING_REFUSED = {codes.APPROVAL_QUEUE_FULL: 429, codes.APPROVAL_BODY_TOO_LARGE: 413}


def filing_refused(code: str, message: str) -> Refusal | None:
    """The refusal of a held call the control plane would not file (its run's queue is full, its body too large
    to keep whole), or None when the answer is not one of those."""
    status = _FILING_REFUSED.get(code)
    if status is None:
        return None
    refusal = Refusal(code, f"the control plane did not file this call for approval: {message}")
    refusal.http_status = status
    return refusal


def _refuse_growing(flow: http.HTTPFlow) -> None:
    state_of(flow).hold = None
    refuse(flow, body_too_large(None))


class Holds:
    """Wait for a person's decision on an ``approval``-tier call; other calls go on meanwhile.

    The approver sees everything that would leave, or the call does not go: a held call's body is read whole
    before it is shown, never streamed past the approver. An upload the Enforcer would have held at its headers
    (one that announces more than ``APPROVAL_BODY_LIMIT`` bytes, or a chunked one) is refused at once when its
    announced length is past the limit, and otherwise read whole here like any other body (mitmproxy does not
    stream a request whose hold moved to its body); a chunked body is refused as soon as the part read passes the
    limit (``proxy.framing.BodyLimit``: the refusal is sent then, the rest is read and dropped).
    """

    def __init__(self, chain: ChainState, await_approval: Callable[[Call], Awaitable[str]]) -> None:
        self.chain, self.await_approval = chain, await_approval

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        if flow.response is not None or state.hold != "headers" or state.call is None:
            return
        length = announced_length(flow.request)
        if length is not None and length > APPROVAL_BODY_LIMIT:
            state.hold = None
            no_continue(flow)
            refuse(flow, body_too_large(length))
            return
        state.hold = "body"  # read it whole first (the Forwarder streams nothing that is held) ...
        # ... but not past the limit: a chunked body is refused as soon as it passes it, not once it has ended.
        flow.metadata[BODY_LIMIT] = BodyLimit(APPROVAL_BODY_LIMIT, _refuse_growing)

    def request(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        state = state_of(flow)
        if flow.response is not None or flow.request.stream or state.hold != "body" or state.call is None:
            return None
        state.hold = None
        size = len(flow.request.raw_content or b"")
        if size > APPROVAL_BODY_LIMIT:
            refuse(flow, body_too_large(size))
            return None
        return self._hold(flow, state.call)

    async def _hold(self, flow: http.HTTPFlow, call: Call) -> None:
        call.enter(HELD)
        try:
            decision = await self.await_approval(call)
            call.enter(ARRIVED)
            refusal, outcome = after_approval(decision, self.chain, call.capability, time.time(), time.monotonic())
        except Refusal as refused:  # the control plane would not file it (a full queue, a body it cannot keep)
            call.enter(ARRIVED)
            refuse(flow, refused)
            return
        except Exception as exc:
            undecided(flow, exc)
            return
        if refusal is None and state_of(flow).mcp_cancelled:  # the agent gave up on it while it was held
            refusal, outcome = Refusal(codes.CLIENT_CANCELLED, "the agent cancelled this call while it waited for "
                                       "its approval: it does not leave"), "cancelled_not_sent"
        if refusal is not None:
            refuse(flow, refusal, outcome=outcome)


class Forwarder:
    """The last step before a call leaves: a last look at the state (a revocation or drain may have arrived
    meanwhile), a unit of each budget it uses, and its start written ahead to the spool.

    Only a forwarded call counts against a budget: its unit is taken here, after every check and any approval.
    A large upload streams: its decision at the headers is final and it leaves from there."""

    def __init__(self, chain: ChainState, spend: Spend | None, start: Callable[[Call], bool]) -> None:
        self.chain, self.spend, self.start = chain, spend, start

    def requestheaders(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        state = state_of(flow)
        req = flow.request
        if (flow.response is not None or not state.decided or state.hold or state.mcp_server is not None
                or state.call is None or not large_upload(req)):
            return None
        req.stream = True  # large uploads pass through; the decision above is final
        return self._leave(flow, state.call, state, look=False)

    def request(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        if flow.response is not None or flow.request.stream:
            return None
        state = state_of(flow)
        if not state.decided or state.call is None:  # fail closed: nothing undecided leaves
            refuse(flow, Refusal(codes.CAPABILITY_ABSENT, "tether did not decide on this call; refused"))
            return None
        return self._leave(flow, state.call, state, look=True)

    def _leave(self, flow: http.HTTPFlow, call: Call, state: FlowState, *, look: bool) -> Awaitable[None] | None:
        """None when the call may leave now; an awaitable when it waits for a budget slice."""
        try:
            if look:
                self._look()
            if self.spend is not None:
                tools = state.mcp_tools
                waiting = self.spend(list(tools) if tools is not None else [call.capability or ""], call.call_id)
                if waiting is not None:
                    return guarded(flow, self._after(waiting, call))
            self._forward(call)
        except Refusal as refusal:
            refuse(flow, refusal)
        except Exception as exc:
            undecided(flow, exc)
        return None

    def _look(self) -> None:
        refusal = self.chain.refusal(time.time(), time.monotonic())
        if refusal is not None:
            raise refusal

    async def _after(self, waiting: Awaitable[None], call: Call) -> None:
        await waiting
        self._look()  # the wait may have outlasted a revocation
        self._forward(call)

    def _forward(self, call: Call) -> None:
        advance(call.phase, FORWARDING)  # raises for a call resolved meanwhile (swept by a stop): it never leaves
        if not self.start(call):  # write-ahead: spooled before the first byte leaves
            raise Refusal(codes.SPOOL_UNAVAILABLE, "the call's start cannot be written to the sidecar's spool "
                          "(is its disk full?); a call is never sent without a record that survives a crash")
        call.enter(FORWARDING)
