"""The ``mcp`` kind: one item (a tool, a resource, a prompt, or a server's plumbing) of one MCP server
(``catalog.McpMatch``). Its audit wire, how two wires compare and its line in ``tether audit surface`` are
``capability/mcpwire.py``'s; its route is always fixed (a server's URL names scheme, host and port).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import mcpwire
from ..catalog import McpMatch, parse_mcp, url_route
from ..credentials import Route
from ..glob import Budget

NAME = "mcp"

Change = tuple[str, Any, Any, str]


class McpKind:
    name = NAME

    def parse(self, source: str, where: str, raw: Any) -> McpMatch:
        return parse_mcp(source, where, raw)

    def to_dict(self, match: McpMatch) -> dict[str, Any]:
        return match.to_dict()

    def route(self, match: McpMatch) -> Route | None:
        return url_route(match.server)

    def wire(self, match: McpMatch) -> dict[str, Any]:
        return match.to_dict()  # {url, tool} as before; or resource, prompt, logging, completion ...

    def wire_ok(self, value: Any) -> bool:
        return mcpwire.kind_of(value) is not None

    def widenings(self, old: Mapping[str, Any], new: Mapping[str, Any], budget: Budget) -> list[Change]:
        return mcpwire.widenings(old, new, budget)

    def text(self, value: Mapping[str, Any]) -> str:
        return mcpwire.text(value)


KIND = McpKind()
