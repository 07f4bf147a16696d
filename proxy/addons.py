"""tether's behaviour inside mitmproxy, as addons with one concern each (STYLE.md).

Order matters and is fixed by ``proxy.sidecar``: Tracker (opens a call for every request), Enforcer
(match, check, hold, refuse), ToolsFilter (hide ungranted MCP tools), Streamer (no buffering of SSE
and large bodies), Capture (redacted flows on disk), Resolver (closes each call with its resolution).
They share one ``Call`` per flow, kept in ``flow.metadata``; nothing else reaches into them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from mitmproxy import http

from capability import errors as codes
from capability.events import APPROVED, CANCELLED, DENIED

from . import mcp
from .state import Call, Refusal, error_resolution

if TYPE_CHECKING:
    from .sidecar import Sidecar

log = logging.getLogger("tether.sidecar")

CALL = "tether.call"
REFUSED = "tether.refused"
OUTCOME = "tether.outcome"  # resolution override for refusals that are really cancellations
ABORTED = "tether.aborted"
MCP_SERVER = "tether.mcp_server"
MCP_PARSED = "tether.mcp_parsed"
MCP_SSE = "tether.mcp_sse"
MCP_METHODS = "tether.mcp_methods"
NO_STREAM = "tether.no_stream"
STREAM_THRESHOLD = 1024 * 1024
HOLD_WITH_BODY = "tether.hold_with_body"
MCP_TOOLS = "tether.mcp_tools"  # the capabilities of a JSON-RPC body's tools/call messages (one unit each)
PENDING = "tether.pending"  # a call that waits for a budget slice before it is forwarded
_METHOD = re.compile(r"[A-Z]{1,16}")
# Headers that frameworks (IIS URL Rewrite, Symfony, Laravel, Spring, Express method-override, Rails ...) honour
# to serve another path, method or host than the request line names. Refused rather than stripped: stripping
# would silently change what the agent asked for, and a request that needs one is not the one tether matched.
REWRITE_HEADERS = ("x-original-url", "x-rewrite-url", "x-http-method-override", "x-http-method",
                   "x-method-override", "x-forwarded-host", "x-forwarded-prefix", "forwarded")


def call_of(flow: http.HTTPFlow) -> Call | None:
    return flow.metadata.get(CALL)


def refuse(flow: http.HTTPFlow, refusal: Refusal, *, outcome: str = "refused") -> None:
    """Answer the client from the sidecar; nothing leaves for the upstream."""
    call = call_of(flow)
    error = {"code": refusal.code, "message": refusal.message,
             "call_id": call.call_id if call else None, "capability": call.capability if call else None}
    error.update({k: v for k, v in refusal.details.items() if v is not None})
    parsed = flow.metadata.get(MCP_PARSED)
    if flow.metadata.get(MCP_SERVER) and flow.request.method == "POST":
        body = mcp.error_body(parsed, mcp.request_id(flow.request.raw_content or b""), refusal.message, error)
    else:
        body = json.dumps({"error": error}).encode()
    flow.response = http.Response.make(
        refusal.http_status, body,
        {"Content-Type": "application/json", "Tether-Error": refusal.code, "Cache-Control": "no-store"},
    )
    flow.metadata[REFUSED] = refusal.code
    flow.metadata[OUTCOME] = outcome


class Tracker:
    """The in-flight table's edge: opens a Call for every request as it arrives."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        host = f"[{req.host}]" if ":" in req.host else req.host  # an IPv6 literal, bracketed as in a URL
        call = Call(call_id=str(uuid.uuid4()), agent=self.sidecar.agent, method=req.method,
                    url=f"{req.scheme}://{host}:{req.port}{req.path.split('?', 1)[0]}", started_at=time.time())
        flow.metadata[CALL] = call
        self.sidecar.track(call, flow)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        call = call_of(flow)
        if call is not None and REFUSED not in flow.metadata:
            call.phase = "forwarded"

class Enforcer:
    """Absence, not gates: match every call to a capability and forward only what the chain grants."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    def http_connect(self, flow: http.HTTPFlow) -> None:
        host, port = flow.request.host, flow.request.port
        refusal: Refusal | None = None
        if not self.sidecar.catalog.knows_host(host, port):
            refusal = Refusal(codes.UNKNOWN_DESTINATION,
                              f"{host}:{port} is not a destination in the capability catalog")
        else:
            try:
                self.sidecar.state.admit(time.time(), time.monotonic())  # a terminated agent opens no tunnel
            except Refusal as exc:
                refusal = exc
        if refusal is None:
            return
        call = Call(call_id=str(uuid.uuid4()), agent=self.sidecar.agent, method="CONNECT", url=f"{host}:{port}",
                    started_at=time.time())
        flow.metadata[CALL] = call
        self.sidecar.track(call, flow)
        refuse(flow, refusal)
        self.sidecar.resolve(call, "refused", code=refusal.code)

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
                        self.sidecar.agent, sni, host, host)
        server.sni = host

    # Anything that is not HTTP has no capability to match: it does not exist for the agent.
    def tcp_start(self, flow: Any) -> None:
        log.warning("refusing a raw TCP stream to %s", flow.server_conn.address)
        flow.kill()

    def udp_start(self, flow: Any) -> None:
        flow.kill()

    # Decisions run synchronously (no coroutine per call); only a call that must wait for a person returns
    # an awaitable, which mitmproxy awaits for that flow alone.
    def requestheaders(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        call = call_of(flow)
        if flow.response is not None:
            return None
        if call is None:  # every request is tracked; one that is not cannot be decided on
            refuse(flow, Refusal(codes.CAPABILITY_ABSENT, "an untracked request is not forwarded"))
            return None
        if self._decide(flow, lambda: self._decide_headers(flow, call)):
            return self._guarded(flow, self._hold_then(flow, call, self._stream_large_upload))
        return self._pending(flow)

    def request(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        call = call_of(flow)
        if flow.response is not None or flow.request.stream:
            return None  # answered by tether already, or decided at the headers and streaming
        if call is None:
            refuse(flow, Refusal(codes.CAPABILITY_ABSENT, "an untracked request is not forwarded"))
            return None
        if self._decide(flow, lambda: self._decide_body(flow, call)):
            return self._guarded(flow, self._hold_then(flow, call, self._final_look))
        return self._pending(flow)

    def _pending(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        """A decision that let the call go but found no budget unit at hand: wait for a slice (or refuse)."""
        pending = flow.metadata.pop(PENDING, None)
        return None if pending is None else self._guarded(flow, pending)

    def _decide(self, flow: http.HTTPFlow, decision: Callable[[], bool]) -> bool:
        """Run a decision; True when the call must be held. A refusal answers the client, and so does any
        failure to decide (fail closed: an exception escaping a mitmproxy hook would let the call through)."""
        try:
            return decision()
        except Refusal as refusal:
            refuse(flow, refusal, outcome=flow.metadata.get(OUTCOME, "refused"))
        except Exception as exc:
            self._undecided(flow, exc)
        return False

    async def _guarded(self, flow: http.HTTPFlow, decision: Awaitable[None]) -> None:
        try:
            await decision
        except Refusal as refusal:
            refuse(flow, refusal, outcome=flow.metadata.get(OUTCOME, "refused"))
        except Exception as exc:
            self._undecided(flow, exc)

    @staticmethod
    def _undecided(flow: http.HTTPFlow, exc: Exception) -> None:
        log.error("could not decide on %s %s; refusing it", flow.request.method, flow.request.pretty_url,
                  exc_info=exc)
        refuse(flow, Refusal(codes.CAPABILITY_ABSENT, f"tether could not decide on this call ({exc!r}); refused"))

    async def _hold_then(self, flow: http.HTTPFlow, call: Call,
                         then: Callable[[http.HTTPFlow, Call], Awaitable[None] | None]) -> None:
        await self._hold(flow, call)
        waiting = then(flow, call)
        if waiting is not None:
            await waiting

    def _decide_headers(self, flow: http.HTTPFlow, call: Call) -> bool:
        req = flow.request
        sc = self.sidecar
        self._check_request_line(req)
        server = sc.catalog.mcp_server(call.url)
        if server is not None:
            flow.metadata[MCP_SERVER] = server
            if req.method == "POST":
                return False  # the JSON-RPC body decides, the state checks included; see request()
        names = sc.catalog.match_http(req.host, req.port, req.method, req.path)
        if names:
            call.capability, call.tier = self._best(names)  # known before any refusal, for the report
        self._check_state_and_headers(flow)
        if server is not None:
            if req.method not in ("GET", "DELETE"):
                raise Refusal(codes.CAPABILITY_ABSENT, f"{req.method} to an MCP endpoint is not in the catalog")
            self._mcp_plumbing(server, call, req.method)
            return False
        if not names:
            if not sc.catalog.knows_host(req.host, req.port):
                raise Refusal(codes.UNKNOWN_DESTINATION,
                              f"{req.host}:{req.port} is not a destination in the capability catalog")
            raise Refusal(codes.CAPABILITY_ABSENT, f"no capability covers {req.method} {req.path} on {req.host}")
        if call.tier == "absent":
            raise Refusal(codes.CAPABILITY_ABSENT, f"{call.capability} is not granted to {sc.agent}")
        if call.tier == "approval":
            if self._large_upload(req):
                return True  # held at the headers: its body will stream through, unseen by the approver
            flow.metadata[HOLD_WITH_BODY] = True  # held once the body is here: the approver sees what would leave
            return False
        flow.metadata[PENDING] = self._stream_large_upload(flow, call)
        return False

    @staticmethod
    def _large_upload(req: http.Request) -> bool:
        length = req.headers.get("content-length")
        return bool(length and length.isdigit() and int(length) > STREAM_THRESHOLD) or "chunked" in req.headers.get(
            "transfer-encoding", "")

    def _stream_large_upload(self, flow: http.HTTPFlow, call: Call) -> Awaitable[None] | None:
        req = flow.request
        if self._large_upload(req):
            req.stream = True  # large uploads pass through; the decision above is final
            return self._spend_then_forward(flow, call)
        return None

    def _decide_body(self, flow: http.HTTPFlow, call: Call) -> bool:
        if flow.metadata.pop(HOLD_WITH_BODY, False):
            return True
        server = flow.metadata.get(MCP_SERVER)
        if server is not None and flow.request.method == "POST" and MCP_PARSED not in flow.metadata:
            if self._decide_mcp(flow, call, server):
                return True
        flow.metadata[PENDING] = self._final_look(flow, call)
        return False

    def _final_look(self, flow: http.HTTPFlow, call: Call) -> Awaitable[None] | None:
        # The last look before anything leaves: a revocation or drain may have arrived meanwhile.
        self.sidecar.state.admit(time.time(), time.monotonic())
        return self._spend_then_forward(flow, call)

    def _spend_then_forward(self, flow: http.HTTPFlow, call: Call) -> Awaitable[None] | None:
        """Only a forwarded call counts against a budget: its unit is taken here, after every check and any
        approval, just before it leaves. None when it may leave now; an awaitable when it waits for a slice."""
        budgets = self.sidecar.budgets
        if budgets.active:
            tools = flow.metadata.get(MCP_TOOLS)
            waiting = budgets.spend(tools if tools is not None else [call.capability or ""], call.call_id)
            if waiting is not None:
                return self._forward_after(waiting, call)
        self._forward(call)
        return None

    async def _forward_after(self, waiting: Awaitable[None], call: Call) -> None:
        await waiting
        self.sidecar.state.admit(time.time(), time.monotonic())  # the wait may have outlasted a revocation
        self._forward(call)

    def _forward(self, call: Call) -> None:
        if not self.sidecar.reporter.start(call):  # write-ahead: spooled before the first byte leaves
            raise Refusal(codes.SPOOL_UNAVAILABLE, "the call's start cannot be written to the sidecar's spool "
                          "(is its disk full?); a call is never sent without a record that survives a crash")
        call.phase = "forwarding"

    @staticmethod
    def _check_request_line(req: http.Request) -> None:
        """The server must read the method and path tether matched, and nothing that rewrites them."""
        if not req.path.startswith("/"):
            raise Refusal(codes.CAPABILITY_ABSENT, f"the request target {req.path[:64]!r} is not a path (asterisk "
                          "or authority form); only requests for a path are forwarded", reason="request_target")
        if "#" in req.path:
            raise Refusal(codes.CAPABILITY_ABSENT, "a request target never carries a fragment ('#'); servers "
                          "disagree on what follows it, so it is not forwarded", reason="request_target")
        sent = req.data.method.decode("utf-8", "replace")  # as sent: ``req.method`` is upper-cased by mitmproxy
        if not _METHOD.fullmatch(sent):
            # Methods are case-sensitive (RFC 9110): "get" is not GET, though some servers treat it as GET, and
            # the catalog matched the upper-cased name.
            raise Refusal(codes.CAPABILITY_ABSENT, f"the method {sent[:32]!r} is not an upper-case HTTP "
                          "method; send it as the catalog names it", reason="method")
        for name in REWRITE_HEADERS:
            if name in req.headers:
                raise Refusal(codes.CAPABILITY_ABSENT, f"the header {name} asks the server to use another path, "
                              "method or host than the one tether matched; remove it", reason="rewrite_header")

    def _check_state_and_headers(self, flow: http.HTTPFlow) -> None:
        """May anything leave now, and do the headers say what the connection does?"""
        req = flow.request
        sc = self.sidecar
        sc.state.admit(time.time(), time.monotonic())
        if "upgrade" in req.headers or req.method == "CONNECT":
            # A websocket or other upgraded stream would outlive the call's decision (and a revocation,
            # drain or abort): tether does not let one start.
            raise Refusal(codes.CAPABILITY_ABSENT, "protocol upgrades (websockets, h2c, tunnels in tunnels) "
                          "are not forwarded")
        foreign = req.headers.get("Tether-Chain")
        if foreign is not None:
            if foreign.strip() != sc.wire:
                raise Refusal(codes.CHAIN_INVALID, "the request carries a Tether-Chain that is not this sidecar's; "
                              "an agent cannot borrow another chain", reason="foreign_chain")
            del req.headers["Tether-Chain"]
        host_header = req.host_header
        if host_header:
            name, port = host_header, None
            if not host_header.endswith("]") and ":" in host_header:
                name, _, port = host_header.rpartition(":")
            same_port = port is None or (port.isdigit() and int(port) == req.port)
            if name.strip("[]").lower().rstrip(".") != req.host.lower().rstrip(".") or not same_port:
                raise Refusal(codes.UNKNOWN_DESTINATION,
                              f"Host header {host_header!r} does not name the destination {req.host}:{req.port}")

    def _best(self, names: list[str]) -> tuple[str, str]:
        ranked = sorted(names, key=lambda n: {"direct": 0, "approval": 1}.get(self.sidecar.state.tier(n), 2))
        return ranked[0], self.sidecar.state.tier(ranked[0])

    def _holds_tool_on(self, server: str) -> bool:
        return any(self.sidecar.state.tier(c) != "absent"
                   for caps in self.sidecar.catalog.mcp_tools(server).values() for c in caps)

    def _mcp_plumbing(self, server: str, call: Call, what: str) -> None:
        if not self._holds_tool_on(server):
            raise Refusal(codes.CAPABILITY_ABSENT, f"no tool on {server} is granted to {self.sidecar.agent}")
        call.detail = f"mcp {what}"

    def _decide_mcp(self, flow: http.HTTPFlow, call: Call, server: str) -> bool:
        """Match a JSON-RPC POST; True when it must be held for approval."""
        try:
            # The server reads the bytes as sent: match those, and never a body we would have to decode.
            encoding = flow.request.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise mcp.NotJsonRpc(f"an encoded body (Content-Encoding: {encoding}) is not matched")
            parsed = mcp.parse(flow.request.raw_content or b"")
        except mcp.NotJsonRpc as exc:
            raise Refusal(codes.CAPABILITY_ABSENT, f"not a JSON-RPC message tether can match: {exc}") from None
        flow.metadata[MCP_PARSED] = parsed
        tools: list[tuple[str, str]] = []
        for message in parsed.messages:
            if message.method == "tools/call":
                names = self.sidecar.catalog.match_mcp(server, message.tool or "")
                capability, tier = self._best(names) if names else (f"mcp:{message.tool}", "absent")
                call.capability = capability
                if tier == "absent":
                    raise Refusal(codes.CAPABILITY_ABSENT, f"tool {message.tool!r} is not granted to "
                                  f"{self.sidecar.agent}", capability=capability)
                tools.append((capability, tier))
            elif message.is_plumbing:
                self._mcp_plumbing(server, call, message.method or "response")
            else:
                raise Refusal(codes.CAPABILITY_ABSENT, f"MCP method {message.method!r} is not in the catalog")
        self._check_mcp_headers(flow, parsed)
        self._check_state_and_headers(flow)
        # Every message's method, a batch with tools/call in it included: ToolsFilter reads the answer of any
        # request that lists tools, whatever else shares its batch.
        flow.metadata[MCP_METHODS] = [m.method for m in parsed.messages]
        if tools:
            flow.metadata[MCP_TOOLS] = [c for c, _ in tools]
            call.capability = tools[0][0] if len(tools) == 1 else ",".join(c for c, _ in tools)
            call.tier = "approval" if any(t == "approval" for _, t in tools) else "direct"
            call.detail = None
            return call.tier == "approval"
        call.detail = call.detail or "mcp"
        return False

    @staticmethod
    def _check_mcp_headers(flow: http.HTTPFlow, parsed: mcp.Parsed) -> None:
        """Servers may route on the mcp-method / mcp-name headers: they must say what the body says."""
        if parsed.batch:
            return
        message = parsed.messages[0]
        method_header = flow.request.headers.get("mcp-method")
        name_header = flow.request.headers.get("mcp-name")
        if method_header is not None and method_header != message.method:
            raise Refusal(codes.CAPABILITY_ABSENT, "the mcp-method header does not match the JSON-RPC body")
        if name_header is not None and message.method == "tools/call" and name_header != message.tool:
            raise Refusal(codes.CAPABILITY_ABSENT, "the mcp-name header does not match the tool in the body")

    async def _hold(self, flow: http.HTTPFlow, call: Call) -> None:
        """Wait for a person's decision on an ``approval`` call; other calls go on meanwhile."""
        call.phase = "held"
        decision = await self.sidecar.await_approval(call)
        call.phase = "arrived"
        if decision == APPROVED:
            self.sidecar.state.admit(time.time(), time.monotonic())
            return
        if decision == DENIED:
            raise Refusal(codes.APPROVAL_DENIED, f"a person denied {call.capability} for this call")
        if decision == CANCELLED:
            flow.metadata[OUTCOME] = "cancelled_not_sent"
            raise Refusal(codes.TERMINATED if self.sidecar.state.mode == "terminated" else codes.DRAINING,
                          "the held call was cancelled: this agent is being terminated")
        raise Refusal(codes.APPROVAL_TIMEOUT, f"no approval for {call.capability} arrived in time ({decision})")


class Resolver:
    """Closes every call with exactly one resolution, after the other addons have seen its final state."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    def response(self, flow: http.HTTPFlow) -> None:
        call = call_of(flow)
        if call is None:
            return
        if REFUSED in flow.metadata:
            self.sidecar.resolve(call, flow.metadata.get(OUTCOME, "refused"), code=flow.metadata[REFUSED])
        else:
            self.sidecar.resolve(call, "completed", status=flow.response.status_code if flow.response else None)

    def error(self, flow: http.HTTPFlow) -> None:
        call = call_of(flow)
        if call is None:
            return
        if REFUSED in flow.metadata:  # tether answered it (the client may have gone): nothing left
            self.sidecar.resolve(call, flow.metadata.get(OUTCOME, "refused"), code=flow.metadata[REFUSED],
                                 detail=flow.error.msg if flow.error else None)
            return
        sse = flow.metadata.get(MCP_SSE)
        parsed = flow.metadata.get(MCP_PARSED)
        if sse is not None and parsed is not None and flow.response is not None and not flow.metadata.get(ABORTED):
            wanted = {mcp.id_key(m.id) for m in parsed.messages if m.is_request}
            if wanted and wanted <= sse.answered:
                # Every request got its JSON-RPC answer; the client closed the stream after reading it.
                self.sidecar.resolve(call, "completed", status=flow.response.status_code)
                return
        conn = flow.server_conn
        # Before the final look nothing was sent, whatever state a reused upstream connection is in.
        connected = call.phase in ("forwarding", "forwarded") and conn.timestamp_tcp_setup is not None and (
            flow.request.scheme == "http" or conn.timestamp_tls_setup is not None)
        sent = flow.response is not None
        resolution = error_resolution(connected=connected, sent=sent, aborted=bool(flow.metadata.get(ABORTED)))
        detail = flow.error.msg if flow.error else None
        self.sidecar.resolve(call, resolution, detail=detail, code=flow.metadata.get(ABORTED))


class ToolsFilter:
    """Ungranted MCP tools do not exist: remove them from every tools/list result, JSON or SSE.

    Every answer from an MCP server is read before it reaches the agent: SSE streams event by event (any line
    ending, decoded when the server compressed them), JSON answers to a request that lists tools whole. An
    answer to a tools/list that cannot be read (an unknown or broken Content-Encoding, a body that is neither
    JSON nor SSE) is replaced by a JSON-RPC error; it never passes unfiltered."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    def _allowed(self, server: str) -> Any:
        tools = self.sidecar.catalog.mcp_tools(server)
        state = self.sidecar.state

        def allowed(name: str) -> bool:
            return any(state.tier(c) != "absent" for c in tools.get(name, []))

        return allowed

    @staticmethod
    def _lists_tools(flow: http.HTTPFlow) -> bool:
        return "tools/list" in (flow.metadata.get(MCP_METHODS) or [])

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        # Ask for answers tether reads without decompressing: servers that honour it answer in identity, and
        # the filter stays cheap. A server that compresses anyway is decoded below (or refused).
        if flow.metadata.get(MCP_SERVER) is not None and flow.response is None:
            flow.request.headers["accept-encoding"] = "identity"

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        server = flow.metadata.get(MCP_SERVER)
        resp = flow.response
        if server is None or resp is None or REFUSED in flow.metadata:
            return
        media = mcp.media_type(resp.headers.get("content-type", ""))
        if media != mcp.SSE:
            if self._lists_tools(flow) or is_listen(flow):
                flow.metadata[NO_STREAM] = True  # read whole and filtered in response()
            return
        # Server-to-client streams (and GET listen streams) may carry tools/list answers too.
        try:
            codings = mcp.content_codings(resp.headers.get("content-encoding", ""))
        except mcp.Unreadable as exc:
            self._refuse_streamed(flow, str(exc))
            return
        resp.stream = flow.metadata[MCP_SSE] = mcp.SseToolsFilter(
            self._allowed(server), mcp.Decoder(codings) if codings else None)
        # What reaches the agent is identity-coded and of a length no header can know in advance.
        resp.headers.pop("content-encoding", None)
        resp.headers.pop("content-length", None)
        if flow.request.http_version == "HTTP/1.1" and "transfer-encoding" not in resp.headers:
            resp.headers["transfer-encoding"] = "chunked"

    def response(self, flow: http.HTTPFlow) -> None:
        server = flow.metadata.get(MCP_SERVER)
        resp = flow.response
        if server is None or resp is None or REFUSED in flow.metadata:
            return
        if resp.stream:
            sse = flow.metadata.get(MCP_SSE)
            call = call_of(flow)
            if sse is not None and (sse.broken or sse.dropped) and call is not None:
                call.detail = f"tools/list filter: {sse.broken or f'{sse.dropped} unreadable events dropped'}"
            return
        # An answer to a request that lists tools (or to a listen GET) must be read when it is JSON or succeeded;
        # an error status with a body that is not JSON carries no tools list for any JSON-RPC client.
        asks = self._lists_tools(flow) or is_listen(flow)
        media = mcp.media_type(resp.headers.get("content-type", ""))
        if not asks and not mcp.is_json(media):
            return
        lists = asks and (mcp.is_json(media) or 200 <= resp.status_code < 300)
        try:
            codings = mcp.content_codings(resp.headers.get("content-encoding", ""))
            body = mcp.decode_body(resp.raw_content or b"", codings)
            if not body.strip():
                return  # nothing to filter (202 Accepted, 204)
            if not mcp.is_json(media):
                raise mcp.Unreadable(f"the answer is {media or 'untyped'}, neither JSON nor SSE")
            body, removed = mcp.filter_json_body(body, self._allowed(server))
        except mcp.Unreadable as exc:
            if lists:
                self._refuse_answer(flow, str(exc))
            return  # an unreadable answer to anything else holds no tools list for the client either
        if removed or "content-encoding" in resp.headers:
            resp.headers.pop("content-encoding", None)
            resp.content = body  # sets a matching Content-Length

    def _refusal(self, flow: http.HTTPFlow, reason: str) -> tuple[int, bytes, dict[str, str]]:
        call = call_of(flow)
        message = f"the MCP server's answer could not be read, so its tools could not be filtered: {reason}"
        if call is not None:
            call.detail = f"tools/list answer refused: {reason}"
        error = {"code": codes.CAPABILITY_ABSENT, "message": message, "call_id": call.call_id if call else None,
                 "capability": call.capability if call else None, "reason": "unfilterable_answer"}
        body = mcp.error_body(flow.metadata.get(MCP_PARSED), None, message, error)
        log.warning("refusing an MCP answer from %s: %s", flow.request.pretty_url, reason)
        return 502, body, {"Content-Type": "application/json", "Tether-Error": codes.CAPABILITY_ABSENT,
                           "Cache-Control": "no-store", "Content-Length": str(len(body))}

    def _refuse_answer(self, flow: http.HTTPFlow, reason: str) -> None:
        status, body, headers = self._refusal(flow, reason)
        flow.response = http.Response.make(status, body, headers)

    def _refuse_streamed(self, flow: http.HTTPFlow, reason: str) -> None:
        """The headers have not left yet: they become the refusal's, and no byte of the server's body follows."""
        status, body, headers = self._refusal(flow, reason)
        resp = flow.response
        assert resp is not None
        resp.status_code = status
        resp.reason = "Bad Gateway"
        resp.headers.clear()
        resp.headers.update(headers)
        resp.raw_content = body  # sent as is if the server's answer turns out to have no body at all
        sent = False

        def only_the_refusal(_chunk: bytes) -> list[bytes]:
            nonlocal sent
            if sent:
                return []
            sent = True
            return [body]

        resp.stream = only_the_refusal


def is_listen(flow: http.HTTPFlow) -> bool:
    """A GET on an MCP endpoint: the server's own stream to the client, which may carry tools/list answers."""
    return flow.request.method == "GET"


class Streamer:
    """SSE and large bodies flow through as they arrive; nothing is buffered whole."""

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        resp = flow.response
        if resp is None or resp.stream or flow.metadata.get(NO_STREAM) or REFUSED in flow.metadata:
            return
        ctype = mcp.media_type(resp.headers.get("content-type", ""))
        length = resp.headers.get("content-length")
        if ctype == mcp.SSE or (length is not None and length.isdigit() and int(length) > STREAM_THRESHOLD):
            resp.stream = True
        elif length is None and "chunked" in resp.headers.get("transfer-encoding", ""):
            resp.stream = True


class Capture:
    """Every call's flow, redacted, in mitmproxy's format. A capture that fails refuses that call only."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar

    def request(self, flow: http.HTTPFlow) -> None:
        call = call_of(flow)
        if call is None or flow.response is not None:
            return
        ok = self.sidecar.capture.write(flow)
        if ok:
            call.capture_ref = self.sidecar.capture.ref(flow)
        elif self.sidecar.allow_uncaptured:
            call.detail = "uncaptured: the capture could not be written"
        else:
            refuse(flow, Refusal(codes.CAPTURE_UNAVAILABLE,
                                 "the call could not be captured, so it was not forwarded "
                                 f"({self.sidecar.capture.last_error})"))

    def response(self, flow: http.HTTPFlow) -> None:
        self._final(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._final(flow)

    def _final(self, flow: http.HTTPFlow) -> None:
        call = call_of(flow)
        if call is None:
            return
        if call.capture_ref is not None:
            # Captured before it left: the final state is written once the answer is on its way to the agent
            # (mitmproxy sends it when this hook returns), not in front of it.
            asyncio.get_running_loop().call_soon(self.sidecar.capture.write, flow)
        elif self.sidecar.capture.write(flow):  # refused (or uncaptured) calls: the report names the capture
            call.capture_ref = self.sidecar.capture.ref(flow)
