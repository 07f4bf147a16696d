"""MCP over streamable HTTP, as far as enforcement needs it. Pure: bytes in, decisions and bytes out.

A POST to an MCP endpoint carries one JSON-RPC message or a batch. ``tools/call`` needs the capability
naming that server and tool; session plumbing (``initialize``, ``server/discover``, ``ping``, ``tools/list``,
notifications, and the client's answers to server requests) needs any tool on that server; everything else the catalog
does not describe (``resources/*``, ``prompts/*`` ...) is absent. ``tools/list`` results are rewritten so
ungranted tools never reach the model, whether the server answers JSON or SSE.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

PLUMBING = frozenset({"initialize", "ping", "tools/list", "server/discover"})
JSONRPC_REFUSED = -32003  # implementation-defined server error range; -32001/-32020 mean other things to SDKs


@dataclass(frozen=True)
class Message:
    method: str | None  # None for a JSON-RPC response sent by the client
    id: Any
    tool: str | None = None

    @property
    def is_request(self) -> bool:
        return self.method is not None and self.id is not None

    @property
    def is_plumbing(self) -> bool:
        if self.method is None:
            return True  # the client answering a server request (sampling, elicitation, roots)
        return self.method in PLUMBING or self.method.startswith("notifications/")


@dataclass(frozen=True)
class Parsed:
    messages: tuple[Message, ...]
    batch: bool


class NotJsonRpc(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Refuse objects with repeated keys (or keys equal but for case): parsers disagree on which one wins,
    and the server must read exactly what tether matched."""
    seen: set[str] = set()
    for key, _ in pairs:
        folded = key.lower()
        if folded in seen:
            raise NotJsonRpc(f"the key {key!r} appears twice in one object")
        seen.add(folded)
    return dict(pairs)


def parse(body: bytes) -> Parsed:
    try:
        value = json.loads(body, object_pairs_hook=_unique_keys)
    except NotJsonRpc:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise NotJsonRpc("the body is not JSON") from None
    batch = isinstance(value, list)
    items = value if batch else [value]
    if not items:
        raise NotJsonRpc("an empty batch")
    messages = []
    for item in items:
        if not isinstance(item, dict) or item.get("jsonrpc") != "2.0":
            raise NotJsonRpc("not a JSON-RPC 2.0 message")
        method = item.get("method")
        if method is None:
            if "result" not in item and "error" not in item:
                raise NotJsonRpc("a message with neither method nor result")
            messages.append(Message(None, item.get("id")))
            continue
        if not isinstance(method, str):
            raise NotJsonRpc("method must be a string")
        tool = None
        if method == "tools/call":
            params = item.get("params")
            if not isinstance(params, dict) or not isinstance(params.get("name"), str):
                raise NotJsonRpc("tools/call without params.name")
            tool = params["name"]
        messages.append(Message(method, item.get("id"), tool))
    return Parsed(tuple(messages), batch)


def id_key(value: Any) -> str:
    """A JSON-RPC id as a comparable key (ids may be numbers or strings, and 1 is not "1")."""
    return json.dumps(value)


def request_id(body: bytes) -> Any:
    """The id of a single JSON-RPC request, or None (best effort, for error bodies)."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return value.get("id") if isinstance(value, dict) else None


def error_body(parsed: Parsed | None, fallback_id: Any, message: str, data: dict[str, Any]) -> bytes:
    """A JSON-RPC error for every request in the message (an array for a batch)."""

    def one(msg_id: Any) -> dict[str, Any]:
        return {"jsonrpc": "2.0", "id": msg_id, "error": {"code": JSONRPC_REFUSED, "message": message, "data": data}}

    if parsed is None or not parsed.batch:
        msg_id = parsed.messages[0].id if parsed is not None else fallback_id
        return json.dumps(one(msg_id)).encode()
    return json.dumps([one(m.id) for m in parsed.messages if m.is_request]).encode()


# -- tools/list filtering ---------------------------------------------------------------------------
def filter_tools_message(value: Any, allowed: Callable[[str], bool]) -> tuple[Any, int]:
    """Remove ungranted tools from a tools/list result (a message or a batch). Returns (value, removed)."""
    removed = 0
    items = value if isinstance(value, list) else [value]
    for item in items:
        if not isinstance(item, dict):
            continue
        result = item.get("result")
        if isinstance(result, dict) and isinstance(result.get("tools"), list):
            kept = [t for t in result["tools"] if isinstance(t, dict) and allowed(str(t.get("name")))]
            removed += len(result["tools"]) - len(kept)
            result["tools"] = kept
    return value, removed


def filter_json_body(body: bytes, allowed: Callable[[str], bool]) -> tuple[bytes, int]:
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body, 0
    value, removed = filter_tools_message(value, allowed)
    return (json.dumps(value).encode(), removed) if removed else (body, 0)


class SseToolsFilter:
    """A streaming rewriter for an SSE response: buffers to event boundaries and filters ``data:`` JSON.

    Used as (part of) mitmproxy's ``flow.response.stream`` callable: it never returns ``b""`` for a
    non-final chunk (that would end a chunked body early) and flushes what is left on the final call.
    """

    def __init__(self, allowed: Callable[[str], bool]) -> None:
        self.allowed = allowed
        self.buffer = b""
        self.removed = 0
        self.answered: set[str] = set()  # ids (id_key) of JSON-RPC responses that passed to the client

    def __call__(self, chunk: bytes) -> Iterable[bytes]:
        if not chunk:
            rest, self.buffer = self.buffer, b""
            return [self._rewrite(rest)] if rest else []
        self.buffer += chunk
        out: list[bytes] = []
        while True:
            cut = _event_end(self.buffer)
            if cut < 0:
                break
            event, self.buffer = self.buffer[:cut], self.buffer[cut:]
            out.append(self._rewrite(event))
        return out

    def _rewrite(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        data_idx = [i for i, line in enumerate(lines) if line.startswith(b"data:")]
        if not data_idx:
            return event
        payload = b"\n".join(lines[i][5:].lstrip(b" ").rstrip(b"\r") for i in data_idx)
        try:
            value = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            return event
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and "method" not in item and ("result" in item or "error" in item):
                self.answered.add(id_key(item.get("id")))
        value, removed = filter_tools_message(value, self.allowed)
        if not removed:
            return event
        self.removed += removed
        first = data_idx[0]
        ending = b"\r" if lines[first].endswith(b"\r") else b""
        kept = [line for i, line in enumerate(lines) if i not in data_idx[1:]]
        kept[first] = b"data: " + json.dumps(value).encode() + ending
        return b"\n".join(kept)


def _event_end(buffer: bytes) -> int:
    """Index just past the first complete SSE event (blank line), or -1."""
    best = -1
    for sep in (b"\n\n", b"\r\n\r\n"):
        i = buffer.find(sep)
        if i >= 0 and (best < 0 or i + len(sep) < best):
            best = i + len(sep)
    return best
