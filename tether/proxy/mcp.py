"""MCP over streamable HTTP, as far as enforcement needs it. Pure: bytes in, decisions and bytes out.

A POST to an MCP endpoint carries one JSON-RPC message or a batch. ``parse`` (the shared model's,
``capability/mcpwire.py``, named here too) reads each message and the item it names (a ``tools/call``'s tool, a
``prompts/get``'s prompt, a resource method's URI, a completion's prompt or URI template, a
``subscriptions/listen``'s resources); the mcp kind's decider (``capability/kinds/mcp.py``) says what each needs
granted. The session plumbing (``initialize``, ``server/discover``, ``ping``, the four list methods,
notifications, the client's answers to server requests) needs any item on that server; every other method is
absent.

Answers are rewritten so what the agent does not hold never reaches the model: every list result (tools,
resources, resource templates, prompts) is filtered and a ``resources/updated`` about an ungranted resource is
dropped, whether the server answers JSON or SSE, in any line ending, any ``Content-Type`` spelling and any
content coding mitmproxy can decode (gzip, deflate, br, zstd). An answer that cannot be read cannot be
filtered: the caller refuses it (see ``Unreadable``), it never passes. ``error_body`` writes the answer to a
refused body as a server would write it (a tool error for ``tools/call``, a JSON-RPC error for the rest).
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import brotli

from tether.capability import jsonpieces, mcpwire

try:  # mitmproxy decodes zstd with the same module
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:  # Python < 3.14
    from backports import zstd

# How a JSON-RPC request body is read (its messages and the items they name) is the shared model's
# (``capability/mcpwire.py``), so that the mcp kind's decider reads it there; its names stay importable here.
LISTS, TASK_METHODS, PLUMBING, NAMED = mcpwire.LISTS, mcpwire.TASK_METHODS, mcpwire.PLUMBING, mcpwire.NAMED
PROTOCOL_META, LISTEN, MIRRORED = mcpwire.PROTOCOL_META, mcpwire.LISTEN, mcpwire.MIRRORED
Message, Parsed, NotJsonRpc = mcpwire.Message, mcpwire.Parsed, mcpwire.NotJsonRpc
parse, header_value, id_key = mcpwire.parse, mcpwire.header_value, mcpwire.id_key
TASK_RESULT = "task"  # 2026-07-28 tasks extension: a tools/call answered with a task has this resultType
TASK_NOTIFICATION = "notifications/tasks"  # 2026-07-28: a task's status, pushed on a subscriptions/listen stream
JSONRPC_REFUSED = -32003  # implementation-defined server error range; -32001/-32020 mean other things to SDKs


def created_task(result: Any) -> str | None:
    """The task id a ``tools/call`` result creates, in either protocol's shape: 2025-11-25 ``CreateTaskResult``
    (``{"task": {"taskId": ...}}``) or the 2026-07-28 tasks extension's (``resultType: "task"`` and the task's
    fields, ``taskId`` among them, in the result itself); None for an ordinary result."""
    if not isinstance(result, dict):
        return None
    if result.get("resultType") == TASK_RESULT:
        task_id = result.get("taskId")
        return task_id if isinstance(task_id, str) else None
    task = result.get("task")
    task_id = task.get("taskId") if isinstance(task, dict) else None
    return task_id if isinstance(task_id, str) else None


def request_id(body: bytes) -> Any:
    """The id of a single JSON-RPC request, or None (best effort, for error bodies)."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return value.get("id") if isinstance(value, dict) else None


def error_body(parsed: Parsed | None, fallback_id: Any, message: str, data: dict[str, Any], *,
               tool_errors: bool = True) -> bytes:
    """The answer to a refused JSON-RPC body: one response per request in it (an array for a batch).

    Each request gets what a server would answer: a JSON-RPC error whose ``data`` is tether's error object
    (``data.code`` the tether code), and a ``tools/call`` the result every SDK surfaces as an ordinary tool
    error (``isError: true``, the reason in its text, tether's error object under ``_meta["tether/error"]``):
    the Python and TypeScript SDKs raise on a JSON-RPC error to ``tools/call`` and hand an ``isError`` result
    to the model, as they do for a tool the server does not know. ``tool_errors=False``: JSON-RPC errors only
    (an answer tether refused after the request left: the tool ran, it did not fail)."""

    def one(msg: Message | None, msg_id: Any) -> dict[str, Any]:
        if tool_errors and msg is not None and msg.method == "tools/call":
            text = f"tether refused this call ({data.get('code')}): {message}"
            result: dict[str, Any] = {"content": [{"type": "text", "text": text}], "isError": True,
                                      "_meta": {"tether/error": data}}
            if msg.stateless:
                result["resultType"] = "complete"  # required from 2026-07-28; older clients never see it
            return {"jsonrpc": "2.0", "id": msg_id, "result": result}
        return {"jsonrpc": "2.0", "id": msg_id, "error": {"code": JSONRPC_REFUSED, "message": message, "data": data}}

    if parsed is None:
        return json.dumps(one(None, fallback_id)).encode()
    if not parsed.batch:
        return json.dumps(one(parsed.messages[0], parsed.messages[0].id)).encode()
    return json.dumps([one(m, m.id) for m in parsed.messages if m.is_request]).encode()


def answers_requests(parsed: Parsed | None) -> bool:
    """True when a refusal of this body is answered as a server answers requests: HTTP 200, JSON-RPC in the body.

    A body with no request in it (notifications, the client's own answers) gets no JSON-RPC response, and one
    tether could not read names no request it could answer: both keep the HTTP status of the refusal, as the
    transport says a server that cannot accept a message does."""
    return parsed is not None and any(m.is_request for m in parsed.messages)


# -- reading answers: media types and content codings ------------------------------------------------
SSE = "text/event-stream"


def media_type(content_type: str) -> str:
    """``Text/Event-Stream; charset=utf-8`` -> ``text/event-stream``: media types are case-insensitive."""
    return content_type.split(";", 1)[0].strip().lower()


def is_json(media: str) -> bool:
    return media == "application/json" or media.endswith("+json")


class Unreadable(ValueError):
    """An answer tether cannot read, and so cannot filter: it is refused, never passed."""


_CODINGS = frozenset({"gzip", "x-gzip", "deflate", "br", "zstd"})


def content_codings(header: str) -> tuple[str, ...]:
    """The codings of a ``Content-Encoding`` header in the order they were applied (``identity`` dropped)."""
    codings = tuple(c for c in (part.strip().lower() for part in header.split(",")) if c and c != "identity")
    unknown = [c for c in codings if c not in _CODINGS]
    if unknown:
        raise Unreadable(f"the answer is encoded with {unknown[0]!r}, which tether cannot decode")
    return codings


class _Zlib:
    """gzip (possibly several members) or deflate (zlib-wrapped, or raw as some servers send it)."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self.fed = False
        self.head = b""  # deflate: the first two bytes say whether a zlib header is there
        self.d: Any = zlib.decompressobj(16 + zlib.MAX_WBITS) if coding != "deflate" else None

    def feed(self, data: bytes) -> bytes:
        self.fed = self.fed or bool(data)
        if self.d is None:
            self.head += data
            if len(self.head) < 2:
                return b""
            b0, b1 = self.head[0], self.head[1]
            wrapped = b0 & 0x0F == 8 and ((b0 << 8) | b1) % 31 == 0
            self.d = zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
            data, self.head = self.head, b""
        out = []
        while data:
            out.append(self.d.decompress(data))
            data = self.d.unused_data if self.d.eof else b""
            if data and self.coding != "deflate":  # the next gzip member
                self.d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            elif data:
                raise zlib.error("bytes after the end of a deflate stream")
        return b"".join(out)

    def finish(self) -> bytes:
        if self.d is None:
            if self.head:
                raise zlib.error("a deflate stream of one byte")
            return b""
        out = self.d.flush()
        if self.fed and not self.d.eof:
            raise zlib.error(f"the {self.coding} stream is truncated")
        return out


class _Brotli:
    def __init__(self) -> None:
        self.d = brotli.Decompressor()
        self.fed = False

    def feed(self, data: bytes) -> bytes:
        self.fed = self.fed or bool(data)
        return self.d.process(data) if data else b""

    def finish(self) -> bytes:
        if self.fed and not self.d.is_finished():
            raise brotli.error("the br stream is truncated")
        return b""


class _Zstd:
    def __init__(self) -> None:
        self.d = zstd.ZstdDecompressor()
        self.fed = False

    def feed(self, data: bytes) -> bytes:
        self.fed = self.fed or bool(data)
        out = []
        while data:
            out.append(self.d.decompress(data))
            data = self.d.unused_data if self.d.eof else b""
            if data:  # the next frame
                self.d = zstd.ZstdDecompressor()
        return b"".join(out)

    def finish(self) -> bytes:
        if self.fed and not self.d.eof:
            raise zstd.ZstdError("the zstd stream is truncated")
        return b""


class Decoder:
    """Undoes a Content-Encoding chunk by chunk (a listen stream never ends, so nothing waits for the whole).
    Every failure is ``Unreadable``."""

    def __init__(self, codings: tuple[str, ...]) -> None:
        self.stages = [_Brotli() if c == "br" else _Zstd() if c == "zstd" else _Zlib(c) for c in reversed(codings)]

    def feed(self, data: bytes) -> bytes:
        try:
            for stage in self.stages:
                data = stage.feed(data)
        except Exception as exc:  # zlib.error, brotli.error, ZstdError: all mean the same here
            raise Unreadable(f"the answer does not decode: {exc}") from None
        return data

    def finish(self) -> bytes:
        data = b""
        try:
            for stage in self.stages:
                data = stage.feed(data) + stage.finish()
        except Exception as exc:
            raise Unreadable(f"the answer does not decode: {exc}") from None
        return data


def decode_body(raw: bytes, codings: tuple[str, ...]) -> bytes:
    if not codings or not raw:  # an empty body is empty in every coding (a 202 that names one, say)
        return raw
    decoder = Decoder(codings)
    return decoder.feed(raw) + decoder.finish()


# -- list filtering ---------------------------------------------------------------------------------
def _nothing(_: str) -> bool:
    return False


@dataclass(frozen=True)
class Visible:
    """What of one server's items the agent may see, one predicate per kind of list (fail closed: a kind
    nobody said anything about shows nothing). ``observe``, when given, is shown every JSON-RPC response a
    filter reads (``proxy.mcpcalls`` learns task ids and multi-round-trip states from them)."""

    tool: Callable[[str], bool]
    resource: Callable[[str], bool] = _nothing  # a resource's URI
    template: Callable[[str], bool] = _nothing  # a resource template's URI template
    prompt: Callable[[str], bool] = _nothing
    task: Callable[[str], bool] = _nothing  # a task id (tasks/list): the agent's own tasks only
    observe: Callable[[dict[str, Any]], None] | None = None


# result key -> (the item's identifying field, which predicate of Visible judges it)
_LISTS = {"tools": ("name", "tool"), "resources": ("uri", "resource"),
          "resourceTemplates": ("uriTemplate", "template"), "prompts": ("name", "prompt"),
          "tasks": ("taskId", "task")}
UPDATED = "notifications/resources/updated"


def as_visible(allowed: Visible | Callable[[str], bool]) -> Visible:
    """A ``Visible``, or a predicate on tool names (every other kind then shows nothing)."""
    return allowed if isinstance(allowed, Visible) else Visible(tool=allowed)


def _hidden_notification(item: Any, visible: Visible) -> bool:
    """A server's resources/updated about a resource the agent does not hold (that resource does not exist), or
    a 2026-07-28 notifications/tasks about a task that is not the agent's own (its result is another's)."""
    method = item.get("method") if isinstance(item, dict) else None
    if method not in (UPDATED, TASK_NOTIFICATION):
        return False
    params = item.get("params")
    field, judge = ("uri", visible.resource) if method == UPDATED else ("taskId", visible.task)
    name = params.get(field) if isinstance(params, dict) else None
    return not (isinstance(name, str) and judge(name))


def _kept(listed: list[Any], field: str, judge: Callable[[str], bool]) -> list[Any]:
    """The items the agent may see. A list ``loads_pieces`` read (a ``Sourced``) keeps the text each kept item was
    read from (a ``jsonpieces.Verbatim``): it is written back as the server wrote it, not encoded again (a 10 MB
    list re-encoded cost the list's client more than its parse). Sound because no filter changes an item it
    keeps, only which items a list holds: the judged field is read from the same parse that produced the text,
    just as a whole answer with nothing removed passes as the server wrote it."""
    if not isinstance(listed, Sourced):
        return [e for e in listed if isinstance(e, dict) and isinstance(e.get(field), str) and judge(e[field])]
    kept = Spliced(listed)
    text, spans = listed.text, listed.spans
    for at, (e, (start, end)) in enumerate(zip(listed, spans, strict=True)):
        if isinstance(e, dict) and isinstance(e.get(field), str) and judge(e[field]):
            item = text[start:end]
            if names_field_twice(item, field):
                continue
            kept.append(e)
            kept.texts.append(item)
            kept.keep.append(at)
    return kept


def names_field_twice(item: str, field: str) -> bool:
    """Whether a kept item's text (an object, passed as the server wrote it) names its judged field twice: the
    parse judged the last, a client may read the first (a hidden name), so such an item is removed. A second
    name a client could read needs the key twice with a string value (``"name": "``) or a key spelled with a
    ``\\u`` escape (the last escape of such a key is followed by plain characters, its quote and a colon);
    else no second look (an inputSchema's ``"name": {`` properties are not one)."""
    named = _NAMED.get(field) or re.compile(f'"{re.escape(field)}"[ \\t\\n\\r]*:[ \\t\\n\\r]*"')
    if (item.count(f'"{field}"') < 2 or len(named.findall(item)) < 2) and (
            "\\u" not in item or not _KEY_ESCAPE.search(item)):
        return False
    twice: list[str] = []
    _piece(item, 0, 1, False, twice)
    return field in twice


_KEY_ESCAPE = re.compile(r'\\u[0-9a-fA-F]{4}[^"\\]*"[ \t\n\r]*:')  # a key with an escape in it
_NAMED = {field: re.compile(f'"{field}"[ \t\n\r]*:[ \t\n\r]*"') for field, _ in _LISTS.values()}


def _filter_tools_param(params: Any, visible: Visible) -> int:
    """A server's own message that offers tools (``sampling/createMessage`` params.tools): the hidden ones go."""
    if not isinstance(params, dict) or not isinstance(params.get("tools"), list):
        return 0
    listed = params["tools"]
    params["tools"] = _kept(listed, "name", visible.tool)
    return len(listed) - len(params["tools"])


def _filter_input_requests(result: dict[str, Any], visible: Visible) -> int:
    """A 2026-07-28 ``input_required`` result embeds the server's requests (sampling among them)."""
    requests = result.get("inputRequests")
    if not isinstance(requests, dict):
        return 0
    return sum(_filter_tools_param(r.get("params"), visible) for r in requests.values() if isinstance(r, dict))


def filter_lists_message(value: Any, allowed: Visible | Callable[[str], bool]) -> tuple[Any, int]:
    """Remove what the agent does not hold from every list result in a message or a batch: tools, resources,
    resource templates, prompts, tasks (by the result's shape, whatever request it answers) and the tools a
    server's own request offers (``sampling/createMessage``, standalone or inside an ``input_required``
    result), and drop a resources/updated notification about a resource it does not hold (``None`` when
    nothing is left). Returns (value, removed)."""
    visible = as_visible(allowed)
    removed = 0
    items = value if isinstance(value, list) else [value]
    for item in items:
        if not isinstance(item, dict):
            continue
        if "method" in item:
            removed += _filter_tools_param(item.get("params"), visible)
            if "result" not in item:  # a message with both is no request a client answers: its lists go too
                continue
        if visible.observe is not None and ("result" in item or "error" in item):
            visible.observe(item)
        result = item.get("result")
        if not isinstance(result, dict):
            continue
        for key, (field, kind) in _LISTS.items():
            listed = result.get(key)
            if isinstance(listed, list):
                result[key] = _kept(listed, field, getattr(visible, kind))
                removed += len(listed) - len(result[key])
        removed += _filter_input_requests(result, visible)
    hidden = [item for item in items if _hidden_notification(item, visible)]
    if hidden:
        removed += len(hidden)
        if not isinstance(value, list):
            return None, removed
        value = [item for item in value if not _hidden_notification(item, visible)]
        if not value:
            return None, removed
    return value, removed


def filter_tools_message(value: Any, allowed: Visible | Callable[[str], bool]) -> tuple[Any, int]:
    """The name every list filter had when it filtered only tools."""
    return filter_lists_message(value, allowed)


def filter_json_body(body: bytes, allowed: Visible | Callable[[str], bool]) -> tuple[bytes, int]:
    """Filter a JSON answer; ``Unreadable`` when it is not JSON (the caller decides whether that matters)."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise Unreadable("the answer is not JSON") from None
    value, removed = filter_lists_message(value, allowed)
    if not removed:
        return body, 0
    return (b"" if value is None else json.dumps(value).encode()), removed


def _line_ends(buf: bytes | bytearray, pos: int = 0) -> Iterator[tuple[int, int]]:
    """Where each line of ``buf`` from ``pos`` on ends, as (first byte of the line end, first byte after it).
    SSE lines end in CRLF, LF or a lone CR, all three equally; a CR last in ``buf`` ends its line (whatever
    follows later). Each byte is looked at once, by ``bytes.find`` (a regular expression's alternation reads
    about 70 MB/s here, ``find`` several GB/s)."""
    cr, lf = buf.find(b"\r", pos), buf.find(b"\n", pos)
    while cr >= 0 or lf >= 0:
        if lf < 0 or 0 <= cr < lf:
            at, end = cr, (cr + 2 if lf == cr + 1 else cr + 1)
        else:
            at, end = lf, lf + 1
        yield at, end
        if 0 <= cr < end:
            cr = buf.find(b"\r", end)
        if 0 <= lf < end:
            lf = buf.find(b"\n", end)


def _lines(event: bytes) -> list[memoryview]:
    """An event's lines without their line ends (the last one empty when the event ends in a line end), as views
    of ``event``: a 10 MB ``data:`` line is not copied to be looked at."""
    view, lines, start = memoryview(event), [], 0
    for at, end in _line_ends(event):
        lines.append(view[start:at])
        start = end
    lines.append(view[start:])
    return lines


_BOM = b"\xef\xbb\xbf"
DROPPED = b": tether dropped an event it could not read\n\n"


class SseListsFilter:
    """A streaming rewriter for an SSE response: decodes (when the server compressed), cuts the stream into
    events exactly as the SSE spec does (CRLF, LF or CR line endings), and filters each ``data:`` payload
    (``filter_lists_message``; an event left with nothing is dropped).

    Used as mitmproxy's ``flow.response.stream`` callable: it never yields an empty chunk (on a chunked
    answer that would end the body early) and flushes what is left on the final call. An event whose data
    is not JSON cannot be filtered and is dropped; a stream that stops decoding is cut from there on.

    Linear in the stream: each byte is appended once, scanned for line ends once (an unfinished line holds
    no line end, so the scan goes on from where the last one stopped), copied once into its event, and read
    once more by the event's rewrite. A 10 MB ``tools/list`` is one event of one ``data:`` line that arrives
    in hundreds of chunks; rescanning or recopying the unfinished part per chunk made that quadratic.
    """

    def __init__(self, allowed: Visible | Callable[[str], bool], decoder: Decoder | None = None) -> None:
        self.allowed = as_visible(allowed)
        self.decoder = decoder
        self.pending = bytearray()  # the unfinished event: its complete lines, then the unfinished line
        self.line_start = 0  # where the unfinished line begins in ``pending``
        self.after_cr = False  # the last byte scanned was a CR: an LF right after it belongs to it
        self.started = False
        self.broken: str | None = None
        self.removed = 0
        self.dropped = 0
        self.answered: set[str] = set()  # ids (id_key) of JSON-RPC responses that passed to the client

    def __call__(self, chunk: bytes) -> Iterable[bytes]:
        return [out for out in (self._rewrite(event) for event in self.cut(chunk)) if out]

    def cut(self, chunk: bytes) -> list[bytes]:
        """The events this chunk completes (all that is left, on the final call with ``b""``), unrewritten."""
        if self.broken:
            return []
        final = not chunk
        try:
            if self.decoder is not None:
                chunk = self.decoder.finish() if final else self.decoder.feed(chunk)
        except Unreadable as exc:
            self.broken = str(exc)
            return []
        if not chunk and not final:
            return []  # a coding's header, say: nothing to read yet (and a CR just read still waits for its LF)
        scan_from = len(self.pending)
        if self.after_cr and chunk.startswith(b"\n"):
            # The CR ended its line when it arrived (as a client does, so an idle stream is not held back);
            # this LF completes that CRLF. Still beside its CR (in the unfinished event) it stays, read already;
            # after a CR that has left (it ended an event), it is dropped. Either way the client reads exactly
            # the lines read here (an LF sent apart from its CR would be a blank line to it, and one sent
            # back beside it would swallow the blank line that follows).
            if self.pending:
                scan_from += 1
                self.line_start += 1
            else:
                chunk = chunk[1:]
        self.after_cr = False
        self.pending += chunk
        if not self.started:
            if len(self.pending) < len(_BOM) and not final:
                return []
            self.started = True
            scan_from = 0
            if self.pending.startswith(_BOM):  # the client skips one at the start; so does the parse here
                del self.pending[:len(_BOM)]
        return self._events(scan_from, final)

    def _events(self, scan_from: int, final: bool) -> list[bytes]:
        """The events completed by the bytes from ``scan_from`` on (and on the final call, what is left)."""
        events = []
        buf = self.pending
        line_start = self.line_start
        begin = 0  # where the first event not yet cut out begins
        for at, end in _line_ends(buf, scan_from):
            if at == line_start:  # a blank line ends the event
                events.append(bytes(buf[begin:end]))
                begin = end
            line_start = end
        self.after_cr = line_start == len(buf) and buf.endswith(b"\r")
        # Everything before ``begin`` is cut out; what stays arrived in this chunk (it follows a line end
        # found in it), so the deletion copies no more than the chunk.
        del buf[:begin]
        self.line_start = line_start - begin
        if final and buf:
            events.append(bytes(buf))
            buf.clear()
            self.line_start = 0
        return events

    def _rewrite(self, event: bytes) -> bytes:
        data = event_data(event)
        if data is None:
            return event
        payload = data[2]
        try:
            value, twice = loads_pieces_checked(payload if isinstance(payload, bytes) else bytes(payload))
        except (ValueError, UnicodeDecodeError, RecursionError):
            self.dropped += 1
            return DROPPED
        return self.rewrite_value(event, data, value, twice)[0]

    def rewrite_parsed(self, event: bytes, data: EventData, value: Any, twice: bool = False) -> bytes:
        """The event, its payload parsed already (``value``), with what the agent does not hold removed."""
        return self.rewrite_value(event, data, value, twice)[0]

    def rewrite_value(self, event: bytes, data: EventData, value: Any, twice: bool = False) -> tuple[bytes, Any]:
        """``rewrite_parsed``, and the value of the event's data as it passes (None: the event is dropped).
        ``twice``: the payload names a key twice where the parse walked it (``ReadAnswer.twice``)."""
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and "method" not in item and ("result" in item or "error" in item):
                self.answered.add(id_key(item.get("id")))
        value, removed = filter_lists_message(value, self.allowed)
        release(value)  # an SSE message is never spliced
        if not removed and not twice:
            return event, value
        self.removed += removed
        if value is None:
            return b"", None  # a notification about an item the agent does not hold: no event at all
        lines, data_idx, _ = data
        data_lines = set(data_idx)  # a set: an event may have as many data lines as it has bytes
        kept = [line for i, line in enumerate(lines) if line and i not in data_lines]
        kept.append(b"data: " + _encoded(value, one_line=True))
        return b"\n".join(kept) + b"\n\n", value


# an event's lines, which of them are data lines, the payload (a view of the event when it is one data line's)
EventData = tuple[list[memoryview], list[int], bytes | memoryview]
_NOT_SPACE = re.compile(rb"[^ \t\n\r\x0b\x0c]")  # what bytes.isspace() does not count as space


def event_data(event: bytes) -> EventData | None:
    """An SSE event's ``data:`` payload (its data lines joined as the SSE spec joins them), or None when it has
    none to read (no data line, or only empty ones: the SDK's priming event for resumption). The lines are views
    of the event, and so is the payload of an event with one data line (a 10 MB answer's): it is not copied to be
    parsed (``loads_pieces`` decodes the view); data lines joined are the one copy made."""
    lines = _lines(event)
    data_idx = [i for i, line in enumerate(lines) if line == b"data" or line[:5] == b"data:"]
    if not data_idx:
        return None
    values = [lines[i][5:] for i in data_idx]
    values = [v[1:] if v[:1] == b" " else v for v in values]
    payload: bytes | memoryview = values[0] if len(values) == 1 else b"\n".join(values)
    return (lines, data_idx, payload) if _NOT_SPACE.search(payload) else None  # (strip() would copy it)


# -- large answers: parsed away from the event loop --------------------------------------------------------
# One json.loads of a 10 MB list is a single C call that holds the GIL from its first byte to its last, so a
# worker thread running it stalls the sidecar's event loop (every other call) for all of it. ``loads_pieces``
# parses the same text to the same value with the long arrays read one element at a time: between elements
# the interpreter hands the GIL to the loop (every ``sys.getswitchinterval()``, 5 ms), so the parse can run in
# a thread while other calls go on. ``read_answer`` does that for a whole JSON or SSE answer, ``filter_answer``
# filters the values it read, and ``dumps_pieces`` writes what is kept in pieces too.
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
PIECES_DEPTH = 4  # how deep objects are walked (a batch answer's tools list is four levels down)


def loads_pieces(raw: bytes | memoryview | str) -> Any:
    """What ``json.loads(raw)`` returns (and raises), read in pieces: objects key by key down to
    ``PIECES_DEPTH``, every array element by element. A view is decoded as its bytes would be, without a copy
    of them first."""
    return loads_pieces_checked(raw)[0]


def loads_pieces_checked(raw: bytes | memoryview | str) -> tuple[Any, bool]:
    """``loads_pieces``, and whether an object it walked (down to ``PIECES_DEPTH``) names a key twice: JSON
    keeps the last, a client may keep the first, so such an answer is never spliced (``splice``)."""
    if isinstance(raw, memoryview):
        raw = str(raw, json.detect_encoding(bytes(raw[:4])), "surrogatepass")
    elif isinstance(raw, bytes):
        raw = raw.decode(json.detect_encoding(raw), "surrogatepass")
    if raw.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", raw, 0)
    twice: list[str] = []
    value, end = _piece(raw, _WS.match(raw, 0).end(), PIECES_DEPTH, True, twice)  # type: ignore[union-attr]
    end = _WS.match(raw, end).end()  # type: ignore[union-attr]
    if end != len(raw):
        raise json.JSONDecodeError("Extra data", raw, end)
    return value, bool(twice)


def names_a_key_twice(text: str, depth: int) -> bool:
    """Whether the JSON value ``text`` (read whole already) names a key twice in an object ``loads_pieces``
    would walk ``depth`` levels from it (``liststream`` asks of a message's members it reads whole)."""
    twice: list[str] = []
    _piece(text, 0, depth, False, twice)
    return bool(twice)


def _skip(text: str, i: int) -> int:
    return _WS.match(text, i).end()  # type: ignore[union-attr]


def _piece(text: str, i: int, depth: int, top: bool = False, twice: list[str] | None = None) -> tuple[Any, int]:
    if depth > 0 and text.startswith("{", i):
        return _object(text, i, depth, twice)
    if depth > 0 and text.startswith("[", i):
        return _array(text, i, depth, top, twice)
    return _DECODER.raw_decode(text, i)


def _object(text: str, i: int, depth: int, twice: list[str] | None = None) -> tuple[dict[str, Any], int]:
    obj: dict[str, Any] = {}
    i = _skip(text, i + 1)
    if text.startswith("}", i):
        return obj, i + 1
    while True:
        if not text.startswith('"', i):
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
        key, i = _DECODER.raw_decode(text, i)
        i = _skip(text, i)
        if not text.startswith(":", i):
            raise json.JSONDecodeError("Expecting ':' delimiter", text, i)
        if twice is not None and key in obj:
            twice.append(key)
        obj[key], i = _piece(text, _skip(text, i + 1), depth - 1, False, twice)
        i, done = _after_member(text, i, "}")
        if done:
            return obj, i


class Sourced(list):  # type: ignore[type-arg]
    """A list ``loads_pieces`` read element by element, with the text it read and where each element's text is in
    it (``_kept`` writes kept elements back from it). Equal to the plain list it holds."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.spans: list[tuple[int, int]] = []
        self.open = self.close = 0  # where its ``[`` and its ``]`` are in ``text``


class Spliced(jsonpieces.Verbatim):
    """What a filter kept of a ``Sourced`` list: the kept items' texts, and which of the list's items they are."""

    def __init__(self, source: Sourced) -> None:
        super().__init__()
        self.source: Sourced | None = source  # released once the answer is written (``release``)
        self.keep: list[int] = []


def _array(text: str, i: int, depth: int, top: bool, twice: list[str] | None = None) -> tuple[list[Any], int]:
    """Each element read whole (one C call each), but a batch's (the top-level array's) messages, which are
    walked in turn to reach their lists. Below the top, where each element's text is is kept (``Sourced``)."""
    items: list[Any] = [] if top else Sourced(text)
    if not top:
        items.open = i  # type: ignore[attr-defined]
    i = _skip(text, i + 1)
    if text.startswith("]", i):
        if not top:
            items.close = i  # type: ignore[attr-defined]
        return items, i + 1
    while True:
        if top:
            item, i = _piece(text, i, depth - 1, False, twice)
        else:
            start = i
            item, i = _DECODER.raw_decode(text, i)
            items.spans.append((start, i))  # type: ignore[attr-defined]
        items.append(item)
        i, done = _after_member(text, i, "]")
        if done:
            if not top:
                items.close = i - 1  # type: ignore[attr-defined]
            return items, i


def _after_member(text: str, i: int, close: str) -> tuple[int, bool]:
    """After an object's or array's member: past the comma (False), or past the closing bracket (True)."""
    i = _skip(text, i)
    if text.startswith(",", i):
        return _skip(text, i + 1), False
    if text.startswith(close, i):
        return i + 1, True
    raise json.JSONDecodeError("Expecting ',' delimiter", text, i)


UNREADABLE = object()  # an SSE event whose data is not JSON: it is dropped


@dataclass(frozen=True)
class ReadAnswer:
    """A whole answer, parsed (``read_answer``): a JSON body's value, or each SSE event with its data's value."""

    body: bytes
    sse: bool
    value: Any = None  # JSON: the body's value
    events: tuple[tuple[bytes, EventData | None, Any], ...] = ()  # SSE: (event, its data, value or UNREADABLE)
    # JSON: an object the parse walked (the envelope, down to the lists) names a key twice. Python's JSON keeps
    # the last, some clients the first, so a second ``tools`` list or ``result`` could show a client what was
    # judged hidden: such a message never passes as written, it is encoded from what was judged, its kept items
    # as the server wrote them (``_encoded``; an item naming its judged field twice is removed,
    # ``names_field_twice``, so what is left of an item reads one way).
    twice: bool = False
    twice_events: frozenset[int] = frozenset()  # SSE: the events whose data names a key twice so


def whole_events(body: bytes) -> list[bytes]:
    """The events of a whole SSE body, cut exactly as ``SseListsFilter`` cuts the same bytes streamed (a BOM at
    the start skipped, CRLF, LF or a lone CR ending a line, a blank line ending an event, what is left after the
    last one an event too), as slices of ``body``: an answer that is one event is ``body`` itself, not a copy
    (the streaming cutter copies each event out of its buffer, twice: 10 MB answers pay for every copy)."""
    if body.startswith(_BOM):
        body = body[len(_BOM):]
    events, begin, line_start = [], 0, 0
    for at, end in _line_ends(body):
        if at == line_start:  # a blank line ends the event
            events.append(body[begin:end])
            begin = end
        line_start = end
    if begin < len(body):
        events.append(body[begin:])
    return events


def read_answer(body: bytes, sse: bool) -> ReadAnswer:
    """Parse a whole answer (heavy: run it in a worker thread; pure). ``Unreadable`` for a JSON body that is not
    JSON."""
    if not sse:
        try:
            value, twice = loads_pieces_checked(body)
            return ReadAnswer(body, False, value=value, twice=twice)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise Unreadable("the answer is not JSON") from None
    events, twice_events = [], set()
    for n, event in enumerate(whole_events(body)):
        data = event_data(event)
        value: Any = None
        if data is not None:
            try:
                value, twice = loads_pieces_checked(data[2])
            except (ValueError, UnicodeDecodeError, RecursionError):
                value = UNREADABLE
            else:
                if twice:
                    twice_events.add(n)
        events.append((event, data, value))
    return ReadAnswer(body, True, events=tuple(events), twice_events=frozenset(twice_events))


def dumps_pieces(value: Any) -> str:
    """``json.dumps(value)``, byte for byte, with long lists encoded element by element (``jsonpieces``), but the
    items a filter kept of a list ``loads_pieces`` read, which are written as the server wrote them (``_kept``)."""
    return jsonpieces.dumps(value, sort_keys=False, separators=(", ", ": "))


def _encoded(value: Any, one_line: bool = False) -> bytes:
    """A filtered value's bytes: kept items written back from the server's text may hold any character it sent
    (a lone surrogate it escaped or encoded included), so they go back as they came. ``one_line``: for an SSE
    ``data:`` line, which a line end inside would cut (JSON may put CR or LF between its tokens, and a line
    that then begins with ``:`` is a comment to the client): such a value is encoded afresh instead."""
    out = dumps_pieces(value).encode("utf-8", "surrogatepass")
    if one_line and (b"\n" in out or b"\r" in out):
        out = jsonpieces.dumps(value, sort_keys=False, separators=(", ", ": "), verbatim=False).encode()
    return out


def filter_answer(answer: ReadAnswer, allowed: Visible | Callable[[str], bool]) -> tuple[bytes, int, SseListsFilter]:
    """Filter a parsed answer: the bytes for the client, how many items were removed, and the filter (for the
    ids it saw answered). Pure but for ``allowed``'s predicates and observer, so it may run beside ``read_answer``
    in a worker thread when those only read (a list answer's observer writes nothing: it binds tasks and rounds
    of item calls only)."""
    done = filtered(answer, allowed)
    return done.body, done.removed, done.seen


NO_VALUE = object()  # ``Filtered.value`` of an answer whose bytes are not one JSON value (SSE, or nothing left)


@dataclass(frozen=True)
class Filtered:
    """``filter_answer``'s outcome, with ``value``: the JSON value ``body`` encodes (a JSON answer's), or the list
    of the values of its events' data (an SSE answer's, an event without data or not JSON adding none), else
    ``NO_VALUE`` (nothing left). Its keys are the body's keys: the capture's redaction by field name reads them
    off it."""

    body: bytes
    removed: int
    seen: SseListsFilter
    value: Any = NO_VALUE


def filtered(answer: ReadAnswer, allowed: Visible | Callable[[str], bool]) -> Filtered:
    """``filter_answer``, and the value of what it passes (``Filtered``)."""
    sse = SseListsFilter(allowed)
    if not answer.sse:
        value, removed = filter_lists_message(answer.value, sse.allowed)
        if value is not None and answer.twice:  # read two ways: encoded from what was judged (``ReadAnswer``)
            body = _encoded(value)
            release(value)
            return Filtered(body, removed, sse, value)
        if not removed:
            release(answer.value)
            return Filtered(answer.body, 0, sse, answer.value)
        if value is None:
            return Filtered(b"", removed, sse)
        spliced = splice(value, removed)
        release(value)
        return Filtered(_encoded(value) if spliced is None else spliced, removed, sse, value)
    out, values = [], []
    for n, (event, data, value) in enumerate(answer.events):
        if data is None:
            out.append(event)
        elif value is UNREADABLE:
            sse.dropped += 1
            out.append(DROPPED)
        else:
            passed, value = sse.rewrite_value(event, data, value, n in answer.twice_events)
            out.append(passed)
            if passed:
                values.append(value)
    return Filtered(b"".join(out), sse.removed, sse, values)


SseToolsFilter = SseListsFilter  # the name it had when it filtered only tools/list answers


# -- a JSON answer with items removed: the server's text without them ---------------------------------------
def splice(value: Any, removed: int) -> bytes | None:
    """The answer's own text with the removed items cut out, when every item removed was removed from a list
    ``loads_pieces`` read (a ``Sourced``, its text the answer's): what was not removed passes as the server
    wrote it, the envelope included, so a filter that streams the answer (``liststream``) writes the same bytes
    as this one, item by item. A list with items removed keeps the text before its first item and, before each
    later kept item, the text that preceded that item (its comma and spacing), then the text after its last
    item: nothing removed, that is the list's own text. None when something else was removed (a notification,
    a list read whole): the answer is then encoded afresh (``_encoded``)."""
    lists: list[Spliced] = []
    _spliced_lists(value, PIECES_DEPTH, True, lists)
    sources = [k.source for k in lists]
    if not lists or None in sources or sum(len(s) - len(k) for k, s in zip(lists, sources, strict=True)) != removed:
        return None
    text = lists[0].source.text  # type: ignore[union-attr]
    if any(k.source.text is not text for k in lists):  # type: ignore[union-attr]
        return None
    out, cursor = [], 0
    for kept in sorted(lists, key=lambda k: k.source.open):  # type: ignore[union-attr]
        source = kept.source
        assert source is not None
        out.append(text[cursor:source.open + 1])
        out.extend(_list_pieces(kept))
        cursor = source.close
    out.append(text[cursor:])
    return "".join(out).encode("utf-8", "surrogatepass")


def release(value: Any) -> None:
    """Let go of the texts the ``Spliced`` lists of a filtered value were read from (a 10 MB answer's, decoded),
    once it is written: the value lives on for the capture, and so would they."""
    lists: list[Spliced] = []
    _spliced_lists(value, PIECES_DEPTH, True, lists)
    for kept in lists:
        kept.source = None


def _list_pieces(kept: Spliced) -> Iterator[str]:
    """A ``Spliced`` list's text from after its ``[`` to before its ``]`` (see ``splice``)."""
    source = kept.source
    assert source is not None
    text, spans = source.text, source.spans
    for n, (at, item_text) in enumerate(zip(kept.keep, kept.texts, strict=True)):
        # the first kept item: the text before the list's first item; a later one: the text before it
        yield text[source.open + 1:spans[0][0]] if n == 0 else text[spans[at - 1][1]:spans[at][0]]
        yield item_text
    yield text[spans[-1][1] if spans else source.open + 1:source.close]


def _spliced_lists(value: Any, depth: int, top: bool, into: list[Spliced]) -> None:
    """The ``Spliced`` lists in a filtered value, where ``loads_pieces`` may have read them (a short walk)."""
    if isinstance(value, Spliced):
        into.append(value)
    elif isinstance(value, dict) and depth > 0:
        for member in value.values():
            if isinstance(member, (dict, list)):
                _spliced_lists(member, depth - 1, False, into)
    elif isinstance(value, list) and top and depth > 0:
        for member in value:
            _spliced_lists(member, depth - 1, False, into)
