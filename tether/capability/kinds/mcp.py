"""The ``mcp`` kind: one item (a tool, a resource, a prompt, or a server's plumbing) of one MCP server
(``catalog.McpMatch``). Its audit wire, how two wires compare and its line in ``tether audit surface`` are
``capability/mcpwire.py``'s; its route is always fixed (a server's URL names scheme, host and port).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .. import mcpwire
from ..catalog import (
    STDIO_SCHEME,
    check_keys,
    fail,
    host_key,
    normalize_url,
    resource_glob,
    safe_uri,
    stdio_name_ok,
    stdio_server_name,
    url_route,
)
from ..credentials import Route
from ..glob import MAX_GLOB, Budget, admits, included
from ..mcpwire import MCP_ITEMS, MCP_KINDS, MCP_PLUMBING

if TYPE_CHECKING:
    from ..catalog import Capability

NAME = "mcp"

Change = tuple[str, Any, Any, str]
_MCP_KEYS = {"url", *MCP_KINDS}


@dataclass(frozen=True)
class McpMatch:
    """One item of one MCP server: ``kind`` is one of ``MCP_KINDS``; ``name`` the tool's or prompt's name, the
    resource's URI glob or template, and empty for plumbing."""

    url: str
    kind: str = "tool"
    name: str = ""

    @property
    def server(self) -> str:
        return normalize_url(self.url)

    @property
    def tool(self) -> str | None:
        """The tool's name for a tool capability (the spelling every catalog had before the other kinds)."""
        return self.name if self.kind == "tool" else None

    @property
    def glob(self) -> str | None:
        """For a resource: the glob its URI pattern admits (see ``resource_glob``)."""
        return resource_glob(self.name) if self.kind == "resource" else None

    def to_dict(self) -> dict[str, Any]:
        # A tool keeps the shape (and so the catalog hash) it always had.
        return {"url": self.url, self.kind: self.name if self.kind in MCP_ITEMS else True}


def parse_mcp(source: str, where: str, raw: Any) -> McpMatch:
    """An ``mcp`` catalog entry checked and read as its match."""
    raw = check_keys(source, where, raw, _MCP_KEYS, {"url"})
    url = raw["url"]
    if not isinstance(url, str):
        raise fail(source, f"{where}.url", f"expected an http(s) URL, got {url!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError on a port that is not 0-65535
    except ValueError as exc:
        raise fail(source, f"{where}.url", f"not a valid URL ({exc}): {url!r}") from None
    if parts.scheme == STDIO_SCHEME:
        if not stdio_name_ok(parts.netloc) or parts.path not in ("", "/") or parts.query or parts.fragment:
            raise fail(source, f"{where}.url", f"a stdio server is named stdio://NAME, NAME one lower-case DNS "
                        f"label (letters, digits, '-'), with nothing after it; got {url!r}")
    elif parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        raise fail(source, f"{where}.url", f"expected an http(s) URL without a query, or stdio://NAME, got {url!r}")
    kinds = [k for k in MCP_KINDS if k in raw]
    if len(kinds) != 1:
        raise fail(source, where, f"needs exactly one item: one of {', '.join(MCP_KINDS)}"
                    + (f" (got {', '.join(kinds)})" if kinds else ""))
    kind = kinds[0]
    value = raw[kind]
    if kind in MCP_PLUMBING:
        if value is not True:
            raise fail(source, f"{where}.{kind}", f"expected true (the server's {kind}), got {value!r}")
        return McpMatch(url=url, kind=kind)
    if not isinstance(value, str) or not value:
        raise fail(source, f"{where}.{kind}", f"expected a {kind} name, got {value!r}")
    if kind == "resource":
        if len(value) > MAX_GLOB:
            raise fail(source, f"{where}.resource", f"a resource pattern of {len(value)} characters "
                        f"(at most {MAX_GLOB})")
        if not safe_uri(value):
            raise fail(source, f"{where}.resource", "expected a URI with a scheme (a glob with '*' or a URI "
                        "template with {expressions}), without dot segments, encoded slashes, backslashes, "
                        f"control characters, a fragment or unbalanced braces: {value!r}")
    return McpMatch(url=url, kind=kind, name=value)


class McpKind:
    name = NAME

    def parse(self, source: str, where: str, raw: Any) -> McpMatch:
        return parse_mcp(source, where, raw)

    def check(self, source: str, caps: Sequence[Capability]) -> None:
        """An MCP session is one stream of requests: every item of one server names the same credential, and a
        stdio server (reached only through its own bridge) names none."""
        servers: dict[str, str | None] = {}
        for cap in caps:
            match: McpMatch = cap.match
            seen = servers.setdefault(match.server, cap.credential)
            if cap.credential and stdio_server_name(urlsplit(match.server).hostname or ""):
                raise fail(source, f"capability {cap.name!r}.credential", f"the stdio server {match.url} is "
                           "reached only through its own bridge: it takes no credential (give the server its "
                           "secrets in its own environment)")
            if seen != cap.credential:
                raise fail(source, f"capability {cap.name!r}.credential", f"every item of the MCP server "
                           f"{match.url} must name the same credential ({seen!r} and {cap.credential!r})")

    def index(self, entries: Sequence[tuple[int, Capability]]) -> McpIndex:
        return McpIndex(entries)

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


MEMO_LIMIT = 8192  # remembered endpoint answers per catalog (cleared when full)


class McpIndex:
    """A catalog's MCP servers and their items, worked out once when the catalog is built: tools, prompts and
    plumbing by server, kind and name; resources by server, as URI globs in catalog order."""

    __slots__ = ("any_port_hosts", "caps", "credentials", "host_ports", "items", "memo", "resources", "servers")

    def __init__(self, entries: Sequence[tuple[int, Capability]]) -> None:
        # normalized server -> kind -> name -> capability names (tools, prompts; plumbing under the name "")
        items: dict[str, dict[str, dict[str, list[str]]]] = {}
        resources: dict[str, list[tuple[str, str]]] = {}  # normalized server -> (URI glob, name), in order
        caps: dict[str, list[str]] = {}  # normalized server -> every capability on it
        credentials: dict[str, str] = {}  # normalized server -> the first credential named for it
        host_ports: set[tuple[str, int]] = set()
        for _, cap in entries:
            m: McpMatch = cap.match
            server = m.server
            kinds = items.setdefault(server, {})
            if m.kind == "resource":
                resources.setdefault(server, []).append((resource_glob(m.name), cap.name))
            else:
                kinds.setdefault(m.kind, {}).setdefault(m.name, []).append(cap.name)
            caps.setdefault(server, []).append(cap.name)
            if cap.credential:
                credentials.setdefault(server, cap.credential)
            parts = urlsplit(server)
            host_ports.add((host_key(parts.hostname or ""), parts.port))  # normalized: port explicit
        self.any_port_hosts: frozenset[str] = frozenset()  # a server's URL always names its port
        self.host_ports = frozenset(host_ports)
        self.servers = frozenset(items)
        self.items = items
        self.resources = {server: tuple(found) for server, found in resources.items()}
        self.caps = {server: tuple(names) for server, names in caps.items()}
        self.credentials = credentials
        self.memo: dict[str, str | None] = {}

    def server(self, url: str) -> str | None:
        """The normalized endpoint when ``url`` is one of the catalog's MCP servers."""
        try:
            return self.memo[url]
        except KeyError:
            pass
        normalized = normalize_url(url)
        found = normalized if normalized in self.servers else None
        if len(self.memo) >= MEMO_LIMIT:
            self.memo.clear()
        self.memo[url] = found
        return found

    def named(self, server: str, kind: str) -> dict[str, list[str]]:
        """name -> capability names for one server's tools or prompts (plumbing: the name ``""``)."""
        return {name: list(found) for name, found in self.items.get(server, {}).get(kind, {}).items()}

    def item(self, server: str, kind: str, name: str = "") -> list[str]:
        """The capabilities naming this tool, prompt or piece of plumbing (``name`` empty) on that server."""
        return list(self.items.get(server, {}).get(kind, {}).get(name, ()))

    def resource(self, server: str, uri: str) -> list[str]:
        """The resource capabilities of that server whose URI glob admits ``uri`` (none for an unsafe URI)."""
        if not safe_uri(uri):
            return []
        return [name for glob, name in self.resources.get(server, ()) if admits(glob, uri)]

    def resource_template(self, server: str, template: str) -> list[str]:
        """The resource capabilities of that server that admit every URI the URI template can expand to."""
        if not safe_uri(template):
            return []
        wanted = resource_glob(template)
        if len(wanted) > MAX_GLOB:
            return []
        return [name for glob, name in self.resources.get(server, ()) if included(wanted, glob)]

    def capabilities(self, server: str) -> list[str]:
        """Every capability of one MCP server, whatever item it names."""
        return list(self.caps.get(server, ()))

    def credential(self, server: str) -> str | None:
        """The name of the credential an MCP server gets on every request (one per server: ``check``)."""
        return self.credentials.get(server)


KIND = McpKind()
