"""tether's behaviour inside mitmproxy, as addons with one concern each (docs/contract.md section 12).

Order matters and is fixed by ``proxy.sidecar``: Tracker (opens a call for every request), the enforcement
addons of ``proxy.enforce`` (decide, hold, forward), McpFilter (hides ungranted MCP items; a refused JSON-RPC
request is answered as a server would), Streamer (no buffering of SSE and large bodies), Capture (redacted
flows on disk), Resolver (closes each call with its resolution). They share one ``FlowState`` per flow
(``proxy.flowstate``); each takes only the collaborators it uses, and none imports the sidecar.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from mitmproxy import http

from tether.capability import errors as codes
from tether.capability.catalog import Catalog

from . import liststream, mcp, streamlayer
from .capture import CaptureWriter, ParsedBody
from .enforce import STREAM_THRESHOLD
from .flowstate import call_of, refuse, state_of
from .mcpcalls import ITEM_METHODS, McpCalls
from .phases import FORWARDED
from .state import Call, Refusal, error_resolution

log = logging.getLogger("tether.sidecar")

Resolve = Callable[..., None]  # Sidecar.resolve: (call, resolution, *, status, code, detail)


class Tracker:
    """The in-flight table's edge: opens a Call for every request as it arrives."""

    def __init__(self, agent: str, track: Callable[[Call, http.HTTPFlow], None]) -> None:
        self.agent, self.track = agent, track

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        host = f"[{req.host}]" if ":" in req.host else req.host  # an IPv6 literal, bracketed as in a URL
        call = Call(call_id=str(uuid.uuid4()), agent=self.agent, method=req.method,
                    url=f"{req.scheme}://{host}:{req.port}{req.path.split('?', 1)[0]}", started_at=time.time())
        self.track(call, flow)  # the in-flight table links the call and the flow, both ways

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        if state.call is not None and state.refused is None:
            state.call.enter(FORWARDED)


class Resolver:
    """Closes every call with exactly one resolution, after the other addons have seen its final state."""

    def __init__(self, resolve: Resolve) -> None:
        self.resolve = resolve

    def response(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        call = state.call
        if call is None:
            return
        if state.refused is not None:
            self.resolve(call, state.outcome, code=state.refused)
        elif state.mcp_cancelled:
            self.resolve(call, "cancelled", status=flow.response.status_code if flow.response else None,
                         detail=CANCELLED_BY_CLIENT)
        elif flow.websocket is not None:
            call.enter(FORWARDED)  # the upgrade is done; the call lasts as long as the websocket
        else:
            self.resolve(call, "completed", status=flow.response.status_code if flow.response else None)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        call = state.call
        if call is None:
            return
        ws = flow.websocket
        if state.aborted:  # cut by tether: what the server did with the last frames is not known
            self.resolve(call, "unknown", code=state.aborted, detail="the websocket was cut by tether")
            return
        who = "client" if ws is not None and ws.closed_by_client else "server"
        self.resolve(call, "completed", status=101,
                     detail=f"websocket closed by the {who} ({ws.close_code if ws is not None else '-'})")

    def error(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        call = state.call
        if call is None:
            return
        if state.refused is not None:  # tether answered it (the client may have gone): nothing left
            self.resolve(call, state.outcome, code=state.refused, detail=flow.error.msg if flow.error else None)
            return
        sse, parsed = state.mcp_sse, state.mcp_parsed
        if state.mcp_cancelled and not state.aborted:
            self.resolve(call, "cancelled", status=flow.response.status_code if flow.response else None,
                         detail=CANCELLED_BY_CLIENT)
            return
        if sse is not None and parsed is not None and flow.response is not None and not state.aborted:
            wanted = {mcp.id_key(m.id) for m in parsed.messages if m.is_request}
            if wanted and wanted <= sse.answered:
                # Every request got its JSON-RPC answer; the client closed the stream after reading it.
                self.resolve(call, "completed", status=flow.response.status_code)
                return
        if is_listen_closed(flow):
            # The server's stream to the client never ends by itself: a client that closes it (the SDKs do at the
            # end of every session) ended a call that had nothing left to answer. Nothing was lost.
            call.detail = "listen stream closed by the client"
            self.resolve(call, "completed", status=flow.response.status_code if flow.response else None,
                         detail=call.detail)
            return
        if is_mcp_disconnect(flow):
            # The client gave up on a call that had left (it closed the stream, which is cancellation from MCP
            # 2026-07-28 on): the server may have acted on it, the agent never read its answer.
            self.resolve(call, "cancelled", status=flow.response.status_code if flow.response else None,
                         detail=DISCONNECTED)
            return
        conn = flow.server_conn
        # Before the final look nothing was sent, whatever state a reused upstream connection is in.
        connected = call.left and conn.timestamp_tcp_setup is not None and (
            flow.request.scheme == "http" or conn.timestamp_tls_setup is not None)
        sent = flow.response is not None
        resolution = error_resolution(connected=connected, sent=sent, aborted=bool(state.aborted))
        detail = flow.error.msg if flow.error else None
        self.resolve(call, resolution, detail=detail, code=state.aborted)


OFFLOAD_BYTES = 64 * 1024  # MCP answers from this size on are parsed in a worker thread


class McpFilter:
    """What the agent does not hold does not exist: ungranted tools, resources, resource templates and prompts
    are removed from every list result, JSON or SSE; a resources/updated notification about an ungranted
    resource is dropped; and a refused JSON-RPC request is answered the way a server answers (HTTP 200).

    Every answer from an MCP server is read before it reaches the agent: SSE streams event by event (any line
    ending, decoded when the server compressed them), JSON answers to a request that lists items whole, but a
    large one to a POST of one list request, which is filtered item by item as it arrives (``liststream``). An
    answer to a list request that cannot be read (an unknown or broken Content-Encoding, a body that is neither
    JSON nor SSE) is replaced by a JSON-RPC error; it never passes unfiltered."""

    def __init__(self, catalog: Catalog, tier: Callable[[str], str], calls: McpCalls | None = None) -> None:
        self.catalog, self.tier = catalog, tier
        self.calls = calls  # proxy.mcpcalls: sessions issued, tasks created, answers that need more input

    def _allowed(self, server: str, flow: http.HTTPFlow | None = None) -> mcp.Visible:
        catalog, tier, calls = self.catalog, self.tier, self.calls

        def held(names: list[str]) -> bool:
            return any(tier(c) != "absent" for c in names)

        def observe(item: dict[str, Any]) -> None:
            if calls is not None and flow is not None:
                calls.answered(flow, item)

        # One look-up per name judged, not a copy of the catalog's names of that server for every answer (with
        # 20,000 tools in the catalog the copy cost each MCP answer about 8 ms of CPU).
        return mcp.Visible(
            tool=lambda name: held(catalog.match_mcp_item(server, "tool", name)),
            resource=lambda uri: held(catalog.match_resource(server, uri)),
            template=lambda template: held(catalog.match_resource_template(server, template)),
            prompt=lambda name: held(catalog.match_mcp_item(server, "prompt", name)),
            task=calls.visible_task(server) if calls is not None else mcp.Visible.task,
            observe=observe,
        )

    def _sessions(self, flow: http.HTTPFlow, server: str, resp: http.Response) -> None:
        """A session id the server issued is usable through this sidecar run; one it ended, no longer."""
        if self.calls is None or not 200 <= resp.status_code < 300:
            return
        issued, sent = resp.headers.get("mcp-session-id"), flow.request.headers.get("mcp-session-id")
        if issued:
            self.calls.ledger.issued(server, issued)
        if flow.request.method == "DELETE" and sent:
            self.calls.ledger.ended(server, sent)

    @staticmethod
    def _lists_items(flow: http.HTTPFlow) -> bool:
        return any(method in mcp.LISTS for method in state_of(flow).mcp_methods or [])

    @staticmethod
    def _only_lists(flow: http.HTTPFlow) -> bool:
        """A POST of one list request: its answer is the list (and what precedes it), with no other request's
        messages to wait for, so it is read whole and parsed away from the event loop, SSE or JSON."""
        methods = state_of(flow).mcp_methods or []
        parsed = state_of(flow).mcp_parsed
        return flow.request.method == "POST" and parsed is not None and not parsed.batch and len(methods) == 1 \
            and methods[0] in mcp.LISTS

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        # Ask for answers tether reads without decompressing: servers that honour it answer in identity, and
        # the filter stays cheap. A server that compresses anyway is decoded below (or refused).
        if state_of(flow).mcp_server is not None and flow.response is None:
            flow.request.headers["accept-encoding"] = "identity"

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        server = state.mcp_server
        resp = flow.response
        if server is not None and resp is not None and state.refused is not None:
            return  # tether's own answer (proxy.flowstate.refuse): nothing of the server's to filter
        if server is None or resp is None:
            return
        self._sessions(flow, server, resp)
        media = mcp.media_type(resp.headers.get("content-type", ""))
        if mcp.is_json(media) and self._only_lists(flow) and streamlayer.installed() and liststream.streamable(
                resp.status_code, resp.headers, flow.request.http_version):
            # a large JSON list filtered as it arrives, item by item (tether/proxy/liststream.py); its headers
            # wait for the first judged byte, and until then it may still be filtered whole (below)
            resp.stream = streamlayer.StreamedList(liststream.JsonListStream(self._allowed(server, flow)))
            return
        if media != mcp.SSE or self._only_lists(flow):
            if self._lists_items(flow) or is_listen(flow):
                state.no_stream = True  # read whole and filtered in response()
            return
        # Server-to-client streams (and GET listen streams) may carry list answers and notifications too.
        try:
            codings = mcp.content_codings(resp.headers.get("content-encoding", ""))
        except mcp.Unreadable as exc:
            self._refuse_streamed(flow, str(exc))
            return
        resp.stream = state.mcp_sse = mcp.SseListsFilter(
            self._allowed(server, flow), mcp.Decoder(codings) if codings else None)
        # What reaches the agent is identity-coded and of a length no header can know in advance.
        resp.headers.pop("content-encoding", None)
        resp.headers.pop("content-length", None)
        if flow.request.http_version == "HTTP/1.1" and "transfer-encoding" not in resp.headers:
            resp.headers["transfer-encoding"] = "chunked"

    def response(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        state = state_of(flow)
        server = state.mcp_server
        resp = flow.response
        if server is None or resp is None or state.refused is not None:
            return None
        if isinstance(resp.stream, streamlayer.StreamedList):
            if resp.stream.stream.finished:  # filtered as it passed; the body is what passed
                if resp.raw_content is not None:
                    state.answer_parse = ParsedBody(resp.raw_content, resp.stream.stream.value)
                return None
            resp.stream = False  # never streamed (its headers ended the answer): filtered whole below
        if resp.stream:
            sse = state.mcp_sse
            call = state.call
            if sse is not None and (sse.broken or sse.dropped) and call is not None:
                call.detail = f"list filter: {sse.broken or f'{sse.dropped} unreadable events dropped'}"
            return None
        # An answer to a request that lists items (or to a listen GET) must be read when it is JSON or succeeded;
        # an error status with a body that is not JSON carries no list for any JSON-RPC client.
        asks = self._lists_items(flow) or is_listen(flow)
        media = mcp.media_type(resp.headers.get("content-type", ""))
        sse = media == mcp.SSE and self._only_lists(flow)
        if not asks and not mcp.is_json(media):
            return None
        lists = asks and (mcp.is_json(media) or sse or 200 <= resp.status_code < 300)
        if not has_text(resp.raw_content):
            return None  # nothing to filter (202 Accepted, 204)
        if not mcp.is_json(media) and not sse:
            if lists:
                self._refuse_answer(flow, f"the answer is {media or 'untyped'}, neither JSON nor SSE")
            return None  # an unreadable answer to anything else holds no list for the client either
        return self._filter_whole(flow, server, sse, lists)

    async def _filter_whole(self, flow: http.HTTPFlow, server: str, sse: bool, lists: bool) -> None:
        """Decode and parse a whole answer in a worker thread, in pieces (``mcp.read_answer``: a 10 MB list parsed
        in one call would hold the event loop, and every other call of the sidecar, for its length), and filter it
        (``mcp.filter_answer``): there too when the body holds no item call (its filter only reads), here for
        any other (its observer binds tasks and rounds in the ledger, which lives on the loop)."""
        resp = flow.response
        assert resp is not None
        try:
            codings = mcp.content_codings(resp.headers.get("content-encoding", ""))
            raw, visible = resp.raw_content or b"", self._allowed(server, flow)
            # The filter's observer writes the ledger only for item calls' answers (tasks, rounds): without one
            # in the body, the whole filter may run in the thread too.
            reads_only = not any(m in ITEM_METHODS for m in state_of(flow).mcp_methods or [])

            def work() -> mcp.ReadAnswer | mcp.Filtered:
                read = mcp.read_answer(mcp.decode_body(raw, codings), sse)
                return mcp.filtered(read, visible) if reads_only and has_text(read.body) else read

            # A small answer parses in less time than a thread hop takes: here.
            done = work() if len(raw) < OFFLOAD_BYTES else await asyncio.to_thread(work)
            if isinstance(done, mcp.ReadAnswer):
                if not has_text(done.body):
                    return
                done = mcp.filtered(done, visible)
            body, removed, seen = done.body, done.removed, done.seen
        except mcp.Unreadable as exc:
            if lists:
                self._refuse_answer(flow, str(exc))
            return
        except Exception as exc:  # fail closed: an answer that cannot be filtered does not pass
            self._refuse_answer(flow, f"tether could not filter it ({exc!r})")
            return
        if sse:
            state_of(flow).mcp_sse = seen  # the ids it answered (the Resolver and cancellations read them)
            call = state_of(flow).call
            if seen.dropped and call is not None:
                call.detail = f"list filter: {seen.dropped} unreadable events dropped"
        if removed or "content-encoding" in resp.headers:
            resp.headers.pop("content-encoding", None)
            resp.content = body  # sets a matching Content-Length
        if done.value is not mcp.NO_VALUE and resp.raw_content is not None:
            # the capture reads the body's keys off this parse, not off 10 MB of bytes (capture.ParsedBody)
            state_of(flow).answer_parse = ParsedBody(resp.raw_content, done.value)

    def _refusal(self, flow: http.HTTPFlow, reason: str) -> tuple[int, bytes, dict[str, str]]:
        call = call_of(flow)
        message = f"the MCP server's answer could not be read, so its lists could not be filtered: {reason}"
        if call is not None:
            call.detail = f"list answer refused: {reason}"
        error = {"code": codes.CAPABILITY_ABSENT, "message": message, "call_id": call.call_id if call else None,
                 "capability": call.capability if call else None, "reason": "unfilterable_answer"}
        body = mcp.error_body(state_of(flow).mcp_parsed, None, message, error, tool_errors=False)
        log.warning("refusing an MCP answer from %s: %s", flow.request.pretty_url, reason)
        status = 200 if flow.request.method == "POST" and mcp.answers_requests(state_of(flow).mcp_parsed) else 502
        return status, body, {"Content-Type": "application/json", "Tether-Error": codes.CAPABILITY_ABSENT,
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
        resp.reason = "OK" if status == 200 else "Bad Gateway"
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


ToolsFilter = McpFilter  # the name tether/proxy/sidecar.py and older code know it by


def has_text(body: bytes | None) -> bool:
    """``bool(body.strip())`` without the copy (``strip`` copies a 10 MB body to say it is not empty)."""
    return bool(body) and not body.isspace()  # type: ignore[union-attr]


_CLIENT_CLOSED = ("Client disconnected.", "stream reset by client")  # mitmproxy's words, HTTP/1 and HTTP/2
CANCELLED_BY_CLIENT = "cancelled by the client (notifications/cancelled) before its answer reached it"
DISCONNECTED = "the client closed the request's stream before its answer reached it"


def is_mcp_disconnect(flow: http.HTTPFlow) -> bool:
    """An MCP POST carrying requests that had left, whose client closed the connection before every answer passed
    (the Resolver checked the answered case first), not cut by tether."""
    state = state_of(flow)
    parsed, call = state.mcp_parsed, state.call
    return (state.mcp_server is not None and flow.request.method == "POST" and not state.aborted
            and parsed is not None and any(m.is_request for m in parsed.messages)
            and call is not None and call.left
            and flow.error is not None and flow.error.msg.startswith(_CLIENT_CLOSED))


def is_listen_closed(flow: http.HTTPFlow) -> bool:
    """An MCP listen stream the server answered with SSE (a GET, or a 2026-07-28 ``subscriptions/listen``) that the
    client closed, not tether or the server."""
    state = state_of(flow)
    resp = flow.response
    parsed = state.mcp_parsed
    listen = flow.request.method == "GET" or (
        parsed is not None and [m.method for m in parsed.messages] == [mcp.LISTEN])
    return (state.mcp_server is not None and listen and not state.aborted
            and resp is not None and 200 <= resp.status_code < 300
            and mcp.media_type(resp.headers.get("content-type", "")) == mcp.SSE
            and flow.error is not None and flow.error.msg.startswith(_CLIENT_CLOSED))


def is_listen(flow: http.HTTPFlow) -> bool:
    """A GET on an MCP endpoint: the server's own stream to the client, which may carry tools/list answers."""
    return flow.request.method == "GET"


class Streamer:
    """SSE, large bodies and bodies of unknown length (chunked, or ended by EOF) flow through as they arrive.
    Only a flow marked ``no_stream`` (an MCP answer that lists items, filtered whole) is read before it passes."""

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        resp = flow.response
        state = state_of(flow)
        if resp is None or resp.stream or state.no_stream or state.refused is not None:
            return
        ctype = mcp.media_type(resp.headers.get("content-type", ""))
        length = resp.headers.get("content-length")
        if ctype == mcp.SSE or (length is not None and length.isdigit() and int(length) > STREAM_THRESHOLD):
            resp.stream = True
        elif length is None:
            # Chunked, or delimited only by the connection closing: either may never end, so neither is held.
            resp.stream = True


STREAM_CAPTURE_BYTES = 1 << 20  # per flow: how much of a streamed answer the capture keeps


class _Tee:
    """A streamed answer as it passes (``flow.response.stream``), its first ``limit`` bytes kept for the
    capture; what follows is only counted."""

    def __init__(self, inner: Any, limit: int) -> None:
        self.inner, self.limit = inner, limit
        self.kept: list[bytes] = []
        self.size = 0
        self.total = 0

    def __call__(self, chunk: bytes) -> Any:
        out = chunk if self.inner is True else self.inner(chunk)
        parts = [out] if isinstance(out, bytes) else list(out)
        for part in parts:
            self.total += len(part)
            room = self.limit - self.size
            if room > 0 and part:
                self.kept.append(part[:room])
                self.size += min(room, len(part))
        return parts if not isinstance(out, bytes) else out

    def relayable(self) -> bool:
        """The rest passes as it is and only needs counting (``tether/proxy/relay.py``): the stream under the tee
        changes nothing and the capture has kept all it keeps."""
        return self.inner is True and self.size >= self.limit

    def passed(self, count: int) -> None:
        """``count`` more bytes of the answer passed without being seen (relayed)."""
        self.total += count


class Capture:
    """Every call's flow, redacted, in mitmproxy's format. A capture that fails refuses that call only.

    A streamed answer (SSE, chunked, large) is captured as it passes, up to ``STREAM_CAPTURE_BYTES`` per flow;
    the flow's comment says when the capture holds only the first part of it."""

    def __init__(self, writer: CaptureWriter, allow_uncaptured: bool, stream_bytes: int = STREAM_CAPTURE_BYTES) -> None:
        self.writer, self.allow_uncaptured, self.stream_bytes = writer, allow_uncaptured, stream_bytes

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        resp = flow.response
        if resp is not None and resp.stream and not isinstance(resp.stream, (_Tee, streamlayer.StreamedList)) \
                and call_of(flow) is not None:
            resp.stream = _Tee(resp.stream, self.stream_bytes)  # lives and goes with the flow
        # (a StreamedList keeps what passed itself: the capture gets the whole final body, as when held)

    def request(self, flow: http.HTTPFlow) -> None:
        call = call_of(flow)
        if call is None or flow.response is not None:
            return
        ok = self.writer.write(flow)
        if ok:
            call.capture_ref = self.writer.ref(flow)
        elif self.allow_uncaptured:
            call.detail = "uncaptured: the capture could not be written"
        else:
            refuse(flow, Refusal(codes.CAPTURE_UNAVAILABLE,
                                 "the call could not be captured, so it was not forwarded "
                                 f"({self.writer.last_error})"))

    def response(self, flow: http.HTTPFlow) -> None:
        if flow.websocket is None:  # a websocket's final state is its end
            self._final(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._final(flow)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        self._final(flow)

    def _final(self, flow: http.HTTPFlow) -> None:
        call = call_of(flow)
        if call is None:
            return
        tee = flow.response.stream if flow.response is not None else None
        if isinstance(tee, _Tee) and flow.response is not None:  # sent already: this is the capture's copy only
            flow.response.raw_content = b"".join(tee.kept)
            if tee.total > tee.size:
                flow.comment = (f"tether: streamed answer, the capture holds its first {tee.size} of "
                                f"{tee.total} bytes")
        if call.capture_ref is not None:
            # Captured before it left: the final state is taken once the answer is on its way to the agent
            # (mitmproxy sends it when this hook returns), not in front of it, and encoded and written off the
            # event loop (the writer's encoder thread): a large answer's redaction stalls no other call.
            state = state_of(flow)
            parsed, state.answer_parse = state.answer_parse, None
            asyncio.get_running_loop().call_soon(self.writer.write_later, flow, parsed)
        elif self.writer.write(flow):  # refused (or uncaptured) calls: the report names the capture
            call.capture_ref = self.writer.ref(flow)


WEBSOCKET_KEPT_BYTES = 1 << 20  # per websocket: the messages kept (and captured) beyond this are only counted


class WebsocketBound:
    """A websocket's messages are kept on its flow (for the capture) up to ``WEBSOCKET_KEPT_BYTES``; past that each
    still passes but is dropped from the flow once it has been seen, so a long-lived connection's memory stays
    flat. What was dropped is counted in the flow's metadata (``tether.websocket_dropped``)."""

    def __init__(self, kept_bytes: int = WEBSOCKET_KEPT_BYTES) -> None:
        self.kept_bytes = kept_bytes

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        ws = flow.websocket
        if ws is None or not ws.messages:
            return
        kept = flow.metadata.get("tether.websocket_kept", 0) + len(ws.messages[-1].content)
        flow.metadata["tether.websocket_kept"] = kept
        if kept > self.kept_bytes:
            message = ws.messages.pop()  # mitmproxy sends its own reference to the message: it still passes
            dropped = flow.metadata.setdefault("tether.websocket_dropped", {"messages": 0, "bytes": 0})
            dropped["messages"] += 1
            dropped["bytes"] += len(message.content)
