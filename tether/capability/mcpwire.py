"""What an ``mcp`` capability means on the wire, as the audit surface shows it, and whether a change admits more.

A surface's ``wire`` for an MCP capability is its catalog match: ``{"url": U, KIND: VALUE}`` with ``KIND`` one of
``tool``, ``prompt`` (a name), ``resource`` (a URI glob or URI template) or the plumbing ``logging``,
``completion``, ``subscriptions`` (``true``). Surfaces written before the other kinds existed carry
``{"url", "tool"}``, which is the same spelling. ``widenings`` compares two such wires by what they admit: a
resource pattern by the language it admits (``capability.glob``, templates read as globs), names as names,
URLs in the catalog's normal form. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
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
