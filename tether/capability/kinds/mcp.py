"""The ``mcp`` kind: one item (a tool, a resource, a prompt, or a server's plumbing) of one MCP server
(``McpMatch``). Its audit wire, how two wires compare, its line in ``tether audit surface`` and how a JSON-RPC
body is read are ``capability/mcpwire.py``'s; its route is always fixed (a server's URL names scheme, host and
port).

Its decision (``decide``) claims every request to one of the catalog's MCP endpoints (``McpIndex``). A JSON-RPC
POST is decided once its body is here, every message granted or none leaves; a GET (the server's stream) or
DELETE (the session's end) needs something on that server granted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .. import errors as codes
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
from ..decision import Allow, ChainState, Decision, Facts, Hold, ReadBody, Refusal, Refused, best, state_and_headers
from ..glob import MAX_GLOB, Budget, admits, included
from ..mcpwire import MCP_ITEMS, MCP_KINDS, MCP_PLUMBING
from . import http

if TYPE_CHECKING:
    from ..catalog import Capability, Catalog

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


# -- the decision: every request to one of the catalog's MCP endpoints ------------------------------------
def decide(catalog: Catalog, chain: ChainState, facts: Facts) -> Decision | None:
    """The answer for a request to an MCP endpoint of the catalog; None (not claimed) for any other URL."""
    server = catalog.indexes[NAME].server(facts.url)
    if server is None:
        return None
    if facts.method == "POST":
        if facts.body is None:
            return ReadBody(server=server)
        return _decide_rpc(catalog, chain, facts, server)
    capability, tier = http.matched(catalog, chain, facts)  # what the report names, as for any request line
    refusal = state_and_headers(chain, facts)
    if refusal is not None:
        return Refused(refusal=refusal, capability=capability, tier=tier, server=server)
    return _decide_stream(catalog, chain, facts, server, capability, tier)


def _plumbing(catalog: Catalog, chain: ChainState, server: str) -> Refusal | None:
    """Session plumbing needs some item (a tool, resource, prompt or piece of plumbing) granted on that server."""
    if any(chain.tier(c) != "absent" for c in catalog.indexes[NAME].capabilities(server)):
        return None
    return Refusal(codes.CAPABILITY_ABSENT, f"nothing on {server} is granted to {chain.agent}")


@dataclass(slots=True)
class _Need:
    """One item a message needs: the capabilities that could grant it, what to call it in a refusal, and
    whether the message uses it (held at approval tier, one unit of its budget) or only needs it to exist
    (the end of a subscription, the prompt or resource a completion is about)."""

    names: list[str]
    label: str
    uses: bool = True
    fallback: str | None = None  # the capability a report names when the catalog has none for it


def _needs(catalog: Catalog, server: str, message: mcpwire.Message) -> list[_Need] | None:
    """What one message needs granted, or None when it is not an item's method (plumbing, or unknown)."""
    method = message.method
    index = catalog.indexes[NAME]
    if method == "tools/call":
        return [_Need(index.item(server, "tool", message.tool or ""), f"tool {message.tool!r}",
                      fallback=f"mcp:{message.tool}")]
    if method == "prompts/get":
        return [_Need(index.item(server, "prompt", message.prompt or ""), f"prompt {message.prompt!r}")]
    if method == "resources/read":
        return [_Need(index.resource(server, message.uri or ""), f"resource {message.uri!r}")]
    if method in ("resources/subscribe", "resources/unsubscribe"):
        ending = method == "resources/unsubscribe"  # ending a subscription is never held, never counted
        return [_Need(index.resource(server, message.uri or ""), f"resource {message.uri!r}", uses=False),
                _Need(index.item(server, "subscriptions"), f"subscriptions on {server}", uses=not ending)]
    if method == mcpwire.LISTEN:
        if not message.uris:
            return None  # list-changed notifications only: plumbing, as the GET listen stream is
        return [*(_Need(index.resource(server, uri), f"resource {uri!r}", uses=False) for uri in message.uris),
                _Need(index.item(server, "subscriptions"), f"subscriptions on {server}")]
    if method == "logging/setLevel":
        return [_Need(index.item(server, "logging"), f"logging on {server}")]
    if method == "completion/complete":
        if message.prompt is not None:
            about = _Need(index.item(server, "prompt", message.prompt), f"prompt {message.prompt!r}",
                          uses=False)
        else:
            about = _Need(index.resource_template(server, message.uri or ""), f"resource {message.uri!r}",
                          uses=False)
        return [_Need(index.item(server, "completion"), f"completion on {server}"), about]
    return None


def _decide_stream(catalog: Catalog, chain: ChainState, facts: Facts, server: str, capability: str | None,
                   tier: str | None) -> Decision:
    """A GET (the server's stream to the client) or DELETE (the session's end) on an MCP endpoint."""
    if facts.method not in ("GET", "DELETE"):
        refusal: Refusal | None = Refusal(codes.CAPABILITY_ABSENT,
                                          f"{facts.method} to an MCP endpoint is not in the catalog")
    else:
        refusal = _plumbing(catalog, chain, server)
    if refusal is not None:
        return Refused(refusal=refusal, capability=capability, tier=tier, server=server)
    return Allow(capability=capability, tier=tier, server=server, detail=f"mcp {facts.method}")


def _read_rpc(facts: Facts) -> mcpwire.Parsed | Refusal:
    try:
        # The server reads the bytes as sent: match those, and never a body we would have to decode.
        encoding = (facts.content_encoding or "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise mcpwire.NotJsonRpc(f"an encoded body (Content-Encoding: {encoding}) is not matched")
        return mcpwire.parse(facts.body or b"")
    except mcpwire.NotJsonRpc as exc:
        return Refusal(codes.CAPABILITY_ABSENT, f"not a JSON-RPC message tether can match: {exc}")


def _decide_rpc(catalog: Catalog, chain: ChainState, facts: Facts, server: str) -> Decision:
    """A JSON-RPC POST (one message or a batch): every message must be granted, or none leaves."""
    parsed = _read_rpc(facts)
    if isinstance(parsed, Refusal):
        return Refused(refusal=parsed, server=server)
    capability: str | None = None
    detail: str | None = None
    used: list[tuple[str, str]] = []  # (capability, tier) of every item a message uses: held, counted
    callers: dict[str, str] = {}
    refusal: Refusal | None = None
    for message in parsed.messages:
        needs = _needs(catalog, server, message)
        if needs is not None:
            for need in needs:
                name, tier = best(chain, need.names) if need.names else (None, "absent")
                if tier == "absent":
                    capability = name or need.fallback
                    refusal = Refusal(codes.CAPABILITY_ABSENT, f"{need.label} is not granted to {chain.agent}",
                                      capability=capability)
                    break
                if need.uses:
                    used.append((name, tier))
                    if message.method == "tools/call" and message.id is not None and name is not None:
                        callers[mcpwire.id_key(message.id)] = name
            if refusal is not None:
                break
            if message.method != "tools/call":
                detail = f"mcp {message.method}"
        elif message.is_plumbing:
            refusal = _plumbing(catalog, chain, server)
            if refusal is not None:
                break
            detail = detail or f"mcp {message.method or 'response'}"
        else:
            refusal = Refusal(codes.CAPABILITY_ABSENT, f"MCP method {message.method!r} is not in the catalog")
            break
    refusal = refusal or _rpc_headers(facts, parsed) or state_and_headers(chain, facts)
    if refusal is not None:
        if capability is None and used:
            capability = ",".join(dict.fromkeys(c for c, _ in used))
        return Refused(refusal=refusal, capability=capability, server=server, detail=detail, parsed=parsed)
    if not used:
        return Allow(server=server, detail=detail or "mcp", parsed=parsed)
    names = tuple(c for c, _ in used)
    held = any(t == "approval" for _, t in used)
    return (Hold if held else Allow)(capability=",".join(dict.fromkeys(names)), tier="approval" if held else "direct",
                                     server=server, detail=detail, tools=names, parsed=parsed, callers=callers)


def _rpc_headers(facts: Facts, parsed: mcpwire.Parsed) -> Refusal | None:
    """Servers may route on the mcp-method / mcp-name headers: they must say what the body says."""
    if parsed.batch:
        return None
    message = parsed.messages[0]
    if facts.mcp_method is not None and facts.mcp_method != message.method:
        return Refusal(codes.CAPABILITY_ABSENT, "the mcp-method header does not match the JSON-RPC body")
    if facts.mcp_name is not None and message.method in mcpwire.MIRRORED:
        if mcpwire.header_value(facts.mcp_name) != message.name:
            return Refusal(codes.CAPABILITY_ABSENT, f"the mcp-name header does not match the "
                           f"{'tool' if message.method == 'tools/call' else 'item'} in the body")
    return None


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

    decide = staticmethod(decide)  # the function above, called as it is: once per request on the hot path


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
