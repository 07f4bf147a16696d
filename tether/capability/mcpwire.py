"""MCP on the wire, pure: what an ``mcp`` capability means on the audit surface and whether a change admits more;
and how a JSON-RPC request body is read, as the mcp kind's decider (``capability/kinds/mcp.py``) matches it.

A surface's ``wire`` for an MCP capability is its catalog match: ``{"url": U, KIND: VALUE}`` with ``KIND`` one of
``tool``, ``prompt`` (a name), ``resource`` (a URI glob or URI template) or the plumbing ``logging``,
``completion``, ``subscriptions`` (``true``). Surfaces written before the other kinds existed carry
``{"url", "tool"}``, which is the same spelling. ``widenings`` compares two such wires by what they admit: a
resource pattern by the language it admits (``capability.glob``, templates read as globs), names as names,
URLs in the catalog's normal form.

A POST to an MCP endpoint carries one JSON-RPC message or a batch. ``parse`` reads each message and the item it
names (a ``tools/call``'s tool, a ``prompts/get``'s prompt, a resource method's URI, a completion's prompt or
URI template, a ``subscriptions/listen``'s resources and tasks), and refuses (``NotJsonRpc``) what a server might
read otherwise than tether does: repeated keys, a batch's shared ids, an item name that is not a string. The
sidecar's reading of answers (filtering lists, SSE) stays in ``tether/proxy/mcp.py``. Pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .catalog import normalize_url, resource_glob
from .glob import Budget, GlobTooLong, compare

# An ``mcp`` match names its server and exactly one item: a tool, a resource (a URI glob or URI template), a
# prompt, or one piece of plumbing a server offers beyond its items (``true``: the whole of it).
MCP_ITEMS = ("tool", "resource", "prompt")
MCP_PLUMBING = ("logging", "completion", "subscriptions")
MCP_KINDS = MCP_ITEMS + MCP_PLUMBING

# Kinds of widening, as ``audit diff --json`` names them (mcp_url_changed and mcp_tool_changed as before).
MCP_URL, MCP_TOOL = "mcp_url_changed", "mcp_tool_changed"
MCP_ITEM, MCP_PROMPT, MCP_RESOURCE = "mcp_item_changed", "mcp_prompt_changed", "mcp_resource_widened"

Change = tuple[str, Any, Any, str]  # (kind, old, new, detail)


def kind_of(wire: Mapping[str, Any]) -> str | None:
    """The item kind an ``mcp`` wire names, or None when it is not one this tether reads."""
    if not isinstance(wire, Mapping) or not isinstance(wire.get("url"), str):
        return None
    kinds = [k for k in MCP_KINDS if k in wire]
    if len(kinds) != 1 or set(wire) != {"url", kinds[0]}:
        return None
    value = wire[kinds[0]]
    if kinds[0] in MCP_PLUMBING:
        return kinds[0] if value is True else None
    return kinds[0] if isinstance(value, str) and value else None


def text(wire: Mapping[str, Any]) -> str:
    """One line for ``tether audit surface``: ``mcp URL tool NAME``, ``mcp URL resource GLOB``, ``mcp URL logging``."""
    kind = kind_of(wire)
    if kind is None:
        return f"mcp {wire.get('url')} (unreadable item)"
    return f"mcp {wire['url']} {kind}" + (f" {wire[kind]}" if kind in MCP_ITEMS else "")


def widenings(old: Mapping[str, Any], new: Mapping[str, Any], budget: Budget | None = None) -> list[Change]:
    """Every way ``new`` admits more than ``old`` (both wires ``kind_of`` reads)."""
    out: list[Change] = []
    if normalize_url(old["url"]) != normalize_url(new["url"]):
        out.append((MCP_URL, old["url"], new["url"], ""))
    was, now = kind_of(old), kind_of(new)
    if was != now:
        out.append((MCP_ITEM, dict(old), dict(new), f"the capability now names a {now}, not a {was}"))
        return out
    if now == "tool" and old["tool"] != new["tool"]:
        out.append((MCP_TOOL, old["tool"], new["tool"], ""))
    elif now == "prompt" and old["prompt"] != new["prompt"]:
        out.append((MCP_PROMPT, old["prompt"], new["prompt"], ""))
    elif now == "resource" and old["resource"] != new["resource"]:
        out.extend(_resource_widening(old["resource"], new["resource"], budget or Budget()))
    return out


def _resource_widening(old: str, new: str, budget: Budget) -> list[Change]:
    try:
        verdict = compare(resource_glob(new), resource_glob(old), budget)
    except GlobTooLong as exc:  # no catalog writes such a pattern: fail closed
        return [(MCP_RESOURCE, old, new, f"not compared, counted as widened: {exc}")]
    if verdict.included:
        return []
    shortest = "" if verdict.shortest else " (not a shortest one: the diff's search budget ran out)"
    return [(MCP_RESOURCE, old, new, f"admits {verdict.example!r}{shortest}, which the old pattern refused")]


# -- JSON-RPC request bodies ---------------------------------------------------------------------------------
# Methods that need only some granted item on the server: the session, discovery, and the lists (filtered
# on the way back, so each shows only what the agent holds).
LISTS = frozenset({"tools/list", "resources/list", "resources/templates/list", "prompts/list", "tasks/list"})
# Task methods (2025-11-25 tasks: get, result, cancel; the 2026-07-28 tasks extension: get, update, cancel) name
# a task, not an item: the decision lets them through as plumbing and ``proxy.mcpcalls`` governs each as the
# capability of the call that created it.
TASK_METHODS = frozenset({"tasks/get", "tasks/result", "tasks/cancel", "tasks/update"})
# subscriptions/listen is plumbing only while it asks for list-changed notifications (kinds/mcp.py decides).
PLUMBING = frozenset({"initialize", "ping", "server/discover", "subscriptions/listen", *LISTS, *TASK_METHODS})
# Methods that carry an item, and where its name is: the field the Mcp-Name header mirrors, when one does.
NAMED = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri", "resources/subscribe": "uri",
         "resources/unsubscribe": "uri"}
PROTOCOL_META = "io.modelcontextprotocol/protocolVersion"  # a stateless (2026-07-28) request's version
LISTEN = "subscriptions/listen"  # 2026-07-28: the client's stream of the notifications it opts in to
# What clients mirror into Mcp-Name (the task methods their task id, SEP-2663).
MIRRORED = frozenset({"tools/call", "prompts/get", "resources/read", *TASK_METHODS})


@dataclass(frozen=True)
class Message:
    method: str | None  # None for a JSON-RPC response sent by the client
    id: Any
    tool: str | None = None  # tools/call: the tool
    prompt: str | None = None  # prompts/get, or a completion/complete for a prompt's argument: the prompt
    uri: str | None = None  # resources/read, subscribe, unsubscribe: the URI; a completion's ref: a URI template
    uris: tuple[str, ...] = ()  # subscriptions/listen: the resources whose updates it asks for
    stateless: bool = False  # it names its protocol version in _meta (2026-07-28 on): results carry resultType
    task: str | None = None  # tasks/get, result, update, cancel: the task id
    tasks: tuple[str, ...] = ()  # subscriptions/listen: the tasks whose status notifications it asks for

    @property
    def is_request(self) -> bool:
        return self.method is not None and self.id is not None

    @property
    def is_plumbing(self) -> bool:
        if self.method is None:
            return True  # the client answering a server request (sampling, elicitation, roots)
        return self.method in PLUMBING or self.method.startswith("notifications/")

    @property
    def name(self) -> str | None:
        """The item the message names (what an ``Mcp-Name`` header must repeat)."""
        if self.method in TASK_METHODS:
            return self.task
        return self.tool if self.method == "tools/call" else self.prompt if self.method == "prompts/get" else self.uri


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
    ids: set[str] = set()
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
        message = _request(method, item)
        if message.id is not None:
            # A batch's answers are told apart by id alone: two requests under one id would leave the server
            # (and tether, which binds a task to the call that created it) to guess which answer is whose.
            if id_key(message.id) in ids:
                raise NotJsonRpc(f"two requests in one batch share the id {message.id!r}")
            ids.add(id_key(message.id))
        messages.append(message)
    return Parsed(tuple(messages), batch)


def _request(method: str, item: dict[str, Any]) -> Message:
    """One request or notification, with the item it names read from its params (refused when missing)."""
    msg_id = item.get("id")
    params = item.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    stateless = isinstance(meta, dict) and PROTOCOL_META in meta
    field = NAMED.get(method)
    if field is not None:
        value = params.get(field) if isinstance(params, dict) else None
        if not isinstance(value, str):
            raise NotJsonRpc(f"{method} without a string params.{field}")
        if method == "tools/call":
            return Message(method, msg_id, tool=value, stateless=stateless)
        if method == "prompts/get":
            return Message(method, msg_id, prompt=value)
        return Message(method, msg_id, uri=value)
    if method in TASK_METHODS:
        task = params.get("taskId") if isinstance(params, dict) else None
        if not isinstance(task, str):
            raise NotJsonRpc(f"{method} without a string params.taskId")
        return Message(method, msg_id, task=task)
    if method == LISTEN:
        notifications = params.get("notifications") if isinstance(params, dict) else None
        uris = _strings(notifications, "resourceSubscriptions", "URIs")
        tasks = _strings(notifications, "taskIds", "task ids")
        return Message(method, msg_id, uris=uris, tasks=tasks)
    if method == "completion/complete":
        ref = params.get("ref") if isinstance(params, dict) else None
        kind = ref.get("type") if isinstance(ref, dict) else None
        if kind == "ref/prompt" and isinstance(ref.get("name"), str):
            return Message(method, msg_id, prompt=ref["name"])
        if kind == "ref/resource" and isinstance(ref.get("uri"), str):
            return Message(method, msg_id, uri=ref["uri"])
        raise NotJsonRpc("completion/complete without a ref/prompt name or a ref/resource uri")
    return Message(method, msg_id)


def _strings(notifications: Any, field: str, what: str) -> tuple[str, ...]:
    """A ``subscriptions/listen`` list of names (``resourceSubscriptions``, ``taskIds``); refused unless strings."""
    values = notifications.get(field) if isinstance(notifications, dict) else None
    if values is None:
        return ()
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise NotJsonRpc(f"subscriptions/listen with {field} that are not a list of {what}")
    return tuple(values)


_B64 = re.compile(r"^=\?base64\?(?P<payload>.*)\?=$")


def header_value(value: str) -> str | None:
    """An ``Mcp-Name`` header as the name it carries: verbatim, or the UTF-8 inside ``=?base64?...?=``; None
    for a malformed or non-canonical base64 form (it then matches no name)."""
    m = _B64.fullmatch(value)
    if m is None:
        return value
    try:
        raw = base64.b64decode(m.group("payload"), validate=True)
        if base64.b64encode(raw).decode("ascii") != m.group("payload"):
            return None
        return raw.decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None


def id_key(value: Any) -> str:
    """A JSON-RPC id as a comparable key (ids may be numbers or strings, and 1 is not "1")."""
    return json.dumps(value)
