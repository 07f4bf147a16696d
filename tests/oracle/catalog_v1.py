from __future__ import annotations  # noqa
"""FROZEN ORACLE, not product code: tether/capability/catalog.py as it was before the sidecar's matching went
behind the capability-kind registry (issue 25), imports made absolute. tests/test_kind_matching.py checks the
registry's matching against it. Do not edit."""
# ruff: noqa
"""The capability catalog: what each capability name means on the wire, and matching calls to names.

A catalog is parsed from YAML text (reading the file is the caller's job), validated strictly (unknown
keys are refused, every error names the file, the capability and the field) and hashed over its
canonical JSON form so a grant can name the exact catalog it was issued against.
"""


import hashlib
import ipaddress
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_to_bytes, urlsplit

from tether.capability.budget import TIERS, GrantError, read_grant
from tether.capability.credentials import PLAIN_HTTP_LOOPBACK, Credential, Route, is_loopback, parse_credentials
from tether.capability.errors import CatalogError, UnknownCapability
from tether.capability.glob import MAX_GLOB, admits, included
from tether.capability.jsonpieces import canonical_json

if TYPE_CHECKING:
    from tether.capability.kinds import CapabilityKind

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
_METHOD = re.compile(r"^[A-Z]{1,16}$")
_HOST = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$|^\[[0-9a-f:.]+\]$")
_TOP_KEYS = {"capabilities", "roles", "version", "credentials"}
_CAP_FIELDS = {"description", "credential"}  # beside the one match, under its kind's key (capability/kinds/)
_HTTP_KEYS = {"host", "port", "scheme", "methods", "path", "websocket"}
HTTP_SCHEMES = ("http", "https")
# An ``mcp`` match names its server and exactly one item: a tool, a resource (a URI glob or URI template), a
# prompt, or one piece of plumbing a server offers beyond its items (``true``: the whole of it).
MCP_ITEMS = ("tool", "resource", "prompt")
MCP_PLUMBING = ("logging", "completion", "subscriptions")
MCP_KINDS = MCP_ITEMS + MCP_PLUMBING
_MCP_KEYS = {"url", *MCP_KINDS}
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_TEMPLATE_EXPR = re.compile(r"\{[^{}]*\}")
MAX_URI = 8192  # the longest resource URI matched; a longer one is refused
# A stdio MCP server (``tether mcp stdio``) has no address of its own: the catalog names it ``stdio://NAME``, and
# its bridge sends every message to the reserved endpoint ``http://NAME.stdio.tether/mcp`` through its sidecar,
# which alone knows where that name leads (``--stdio-route``). ``.tether`` is no public top-level domain.
STDIO_SCHEME = "stdio"
STDIO_DOMAIN = "stdio.tether"
_STDIO_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def stdio_name_ok(name: str) -> bool:
    """A stdio server's name is one DNS label in lower case: it becomes ``NAME.stdio.tether``."""
    return bool(_STDIO_NAME.fullmatch(name))


def stdio_endpoint(name: str) -> str:
    """The reserved URL a stdio server named ``name`` is reached at through its sidecar."""
    return f"http://{name}.{STDIO_DOMAIN}/mcp"


def stdio_server_name(host: str) -> str | None:
    """``NAME`` for a host ``NAME.stdio.tether`` (any case, a trailing dot allowed), else None."""
    host = host.lower().rstrip(".")
    name, dot, domain = host.partition(".")
    return name if dot and domain == STDIO_DOMAIN and stdio_name_ok(name) else None


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


def host_key(host: str) -> str:
    """A host as the catalog compares it: lower case, no trailing dot, an IPv6 literal as ``[compressed]``
    (mitmproxy gives it bare, a URL or a catalog bracketed)."""
    host = host.lower().rstrip(".")
    if ":" in host:
        try:
            return f"[{ipaddress.IPv6Address(host.strip('[]')).compressed}]"
        except ValueError:
            return host  # not an address: it matches no catalog host
    return host


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def normalize_url(url: str) -> str:
    """``scheme://host:port/path`` with the default port made explicit, no query, no trailing slash; a stdio
    server's ``stdio://NAME`` as its reserved endpoint (``stdio_endpoint``)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == STDIO_SCHEME:
        return normalize_url(stdio_endpoint((parts.hostname or "").lower()))
    host = host_key(parts.hostname or "")
    port = parts.port or _default_port(scheme)
    path = parts.path.rstrip("/") or "/"
    return f"{scheme}://{host}:{port}{path}"


_NOT_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")  # %u002e (IIS), a lone %: not percent-encoding
_IIS_PERCENT_U = re.compile(r"%u[0-9A-Fa-f]{4}")
_DECODE_ROUNDS = 4


def safe_path(path: str) -> str | None:
    """The path with its query removed, or None when it could mean something else to the server.

    Matching reads the path as sent; a server may read it after decoding, normalizing and cutting path
    parameters, so anything that could traverse or change segments after that is refused (fail closed):
    a fragment (never part of a request target); dot segments, in any percent-encoding, however often
    encoded (``%252e``), with a path parameter (``..;``, ``..;jsessionid=1`` on Java servers), overlong or
    otherwise invalid UTF-8 (``%c0%ae``), IIS's ``%u002e``, compatibility forms that normalize to a dot or
    slash (fullwidth ``U+FF0E``); encoded slashes; backslashes; NUL and control characters.
    """
    if "#" in path:
        return None
    path = path.split("?", 1)[0]
    if not path.startswith("/"):
        return None
    if _NOT_PERCENT.search(path):
        return None
    decoded = path
    for _ in range(_DECODE_ROUNDS):
        if _IIS_PERCENT_U.search(decoded):  # ``%25u002e`` decodes to IIS's dot
            return None
        try:
            deeper = unquote_to_bytes(decoded).decode("utf-8")  # strict: overlong forms are invalid UTF-8
        except UnicodeDecodeError:
            return None
        if deeper == decoded:
            break
        decoded = deeper
    else:
        return None  # still decoding after several rounds: no server reads it that way in good faith
    if decoded.count("/") != path.count("/") or "\\" in decoded:
        return None  # an encoded slash, or a backslash some servers read as one
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in decoded):
        return None
    folded = unicodedata.normalize("NFKC", decoded)
    if folded.count("/") != decoded.count("/") or "\\" in folded:
        return None  # a fullwidth or other compatibility slash
    for segment in folded.split("/"):
        name = segment.split(";", 1)[0]  # Tomcat and Jetty drop ;params before normalizing
        if name and "." in name and not name.strip(". "):
            return None  # ".", "..", "...", ". ." and the like
    return path


@dataclass(frozen=True)
class HttpMatch:
    host: str
    methods: tuple[str, ...]
    path: str
    port: int | None = None
    websocket: bool = False  # a GET here may upgrade to a websocket (the connection is then the call)
    scheme: str | None = None  # "https" or "http": required where a credential is injected (see Capability.route)

    def matches(self, host: str, port: int, method: str, path: str) -> bool:
        return (
            host == self.host
            and (self.port is None or port == self.port)
            and method in self.methods
            and admits(self.path, path)  # greedy, linear per segment: a regex backtracks exponentially
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"host": self.host, "methods": list(self.methods), "path": self.path}
        if self.port is not None:
            d["port"] = self.port
        if self.websocket:  # only when set: a catalog without websockets keeps its hash
            d["websocket"] = True
        if self.scheme is not None:  # likewise
            d["scheme"] = self.scheme
        return d


def resource_glob(pattern: str) -> str:
    """A resource pattern or a URI template as a glob: every ``{expression}`` (RFC 6570) becomes ``*``.

    A ``*`` admits any run of characters, ``/`` included, so the glob admits at least every URI the template
    can expand to: comparing globs can only err towards "not included" (hidden, refused), never the other way.
    """
    return _TEMPLATE_EXPR.sub("*", pattern)


def safe_uri(uri: str) -> bool:
    """True when a resource URI (or a URI template) says one thing to every server that could read it.

    A URI that could traverse after the server decodes or normalizes it is refused as ``safe_path`` refuses
    a path: dot segments in any encoding, encoded slashes, backslashes, control characters, a fragment. The
    query is matched as written (a resource's identity may live in it) but never traverses.
    """
    m = _SCHEME.match(uri)
    if m is None or len(uri) > MAX_URI:
        return False
    rest = _TEMPLATE_EXPR.sub("x", uri[m.end():])  # a template's expressions judged as one plain segment
    if "{" in rest or "}" in rest:
        return False
    return safe_path(rest[1:] if rest.startswith("//") else "/" + rest) is not None


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


@dataclass(frozen=True)
class Capability:
    name: str
    http: HttpMatch | None = None
    mcp: McpMatch | None = None
    description: str = ""
    credential: str | None = None  # what the sidecar injects for it (a name in the catalog's credentials)

    @cached_property
    def route(self) -> Route | None:
        """The one scheme, host and port this capability's requests go to, when the catalog names all three
        (an ``http`` match with ``scheme`` and ``port``; an ``mcp`` server's URL always does): its kind's
        answer (``capability/kinds/``), worked out once."""
        kind, match = _kind_of(self)
        return kind.route(match)


def url_route(url: str) -> Route:
    """A URL's scheme, host and port (the default port made explicit)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return Route(scheme, host_key(parts.hostname or ""), parts.port or _default_port(scheme))


def _first_segment(path: str) -> str:
    """The first segment of a path that starts with ``/``: ``"repos"`` for ``/repos/o/r``, ``""`` for ``/``."""
    end = path.find("/", 1)
    return path[1:] if end < 0 else path[1:end]


def _glob_segment(glob: str) -> str | None:
    """The first segment every path this glob matches must have, or None when a ``*`` reaches into it.

    A glob whose first segment is literal either goes on with ``/`` (so every match starts ``/seg/``) or
    ends there with no ``*`` at all (so the only match is ``/seg``): either way the match's first segment
    is ``seg``. That is what makes bucketing by first segment give the same answers as trying every glob.
    """
    segment = _first_segment(glob)
    return None if "*" in segment else segment


class _Index:
    """Where a catalog's capabilities live, worked out once when the catalog is built.

    HTTP capabilities are bucketed by (host, method, first path segment of the glob); a glob whose first
    segment holds a ``*`` goes in the host and method's ``None`` bucket, tried for every path. A request
    then tries only the globs of its own host and method whose literal start could fit its path, so the
    cost of matching does not grow with the capabilities of other hosts or other paths. Every entry keeps
    its place in the catalog so answers come back in catalog order, as the linear scan gave them.
    """

    __slots__ = ("any_port_hosts", "host_ports", "http", "mcp_caps", "mcp_credentials", "mcp_items",
                 "mcp_resources", "mcp_servers")

    def __init__(self, capabilities: Mapping[str, Capability]) -> None:
        # (host, method, segment or None) -> entries (catalog position, port or None, path glob, name)
        http: dict[tuple[str, str, str | None], list[tuple[int, int | None, str, str]]] = {}
        any_port_hosts: set[str] = set()  # knows_host: a host any port of which some capability names
        host_ports: set[tuple[str, int]] = set()  # ... and the (host, port) pairs ports narrow to
        # normalized server -> kind -> name -> capability names (tools, prompts; plumbing under the name "")
        mcp_items: dict[str, dict[str, dict[str, list[str]]]] = {}
        mcp_resources: dict[str, list[tuple[str, str]]] = {}  # normalized server -> (URI glob, name), in order
        mcp_caps: dict[str, list[str]] = {}  # normalized server -> every capability on it
        mcp_credentials: dict[str, str] = {}  # normalized server -> the first credential named for it
        for position, cap in enumerate(capabilities.values()):
            if cap.http is not None:
                h = cap.http
                entry = (position, h.port, h.path, cap.name)
                segment = _glob_segment(h.path)
                for method in dict.fromkeys(h.methods):  # a method listed twice still matches once
                    http.setdefault((h.host, method, segment), []).append(entry)
                if h.port is None:
                    any_port_hosts.add(h.host)
                else:
                    host_ports.add((h.host, h.port))
            if cap.mcp is not None:
                m = cap.mcp
                server = m.server
                kinds = mcp_items.setdefault(server, {})
                if m.kind == "resource":
                    mcp_resources.setdefault(server, []).append((resource_glob(m.name), cap.name))
                else:
                    kinds.setdefault(m.kind, {}).setdefault(m.name, []).append(cap.name)
                mcp_caps.setdefault(server, []).append(cap.name)
                if cap.credential:
                    mcp_credentials.setdefault(server, cap.credential)
                parts = urlsplit(server)
                host_ports.add((host_key(parts.hostname or ""), parts.port))  # normalized: port explicit
        self.http = {key: tuple(entries) for key, entries in http.items()}
        self.any_port_hosts = frozenset(any_port_hosts)
        self.host_ports = frozenset(host_ports)
        self.mcp_servers = frozenset(mcp_items)
        self.mcp_items = mcp_items
        self.mcp_resources = {server: tuple(entries) for server, entries in mcp_resources.items()}
        self.mcp_caps = {server: tuple(names) for server, names in mcp_caps.items()}
        self.mcp_credentials = mcp_credentials

    def match_http(self, host: str, port: int, method: str, path: str) -> tuple[str, ...]:
        """``host``, ``method`` and ``path`` as the catalog compares them (host_key, upper case, safe_path)."""
        literal = self.http.get((host, method, _first_segment(path)), ())
        starred = self.http.get((host, method, None), ())
        found = [(position, name) for entries in (literal, starred)
                 for position, cap_port, glob, name in entries
                 if (cap_port is None or cap_port == port) and admits(glob, path)]
        if literal and starred:
            found.sort()  # two buckets: back to catalog order
        return tuple(name for _, name in found)


@dataclass(frozen=True)
class Catalog:
    capabilities: Mapping[str, Capability]
    roles: Mapping[str, Mapping[str, Any]]  # capability -> tier or {tier, calls, per_minute}
    hash: str
    source: str = "<catalog>"
    credentials: Mapping[str, Credential] = field(default_factory=dict)
    # Matching is pure, and the catalog never changes: remember answers (bounded; cleared when full).
    # The memo still pays on top of the index: a miss runs safe_path, which costs more than the lookup.
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _index: _Index = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", _Index(self.capabilities))

    # -- queries ---------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.capabilities)

    def require(self, names: Iterable[str]) -> None:
        unknown = sorted(set(names) - set(self.capabilities))
        if unknown:
            raise UnknownCapability(
                f"capability {', '.join(unknown)} is not in the catalog {self.source} "
                f"(known: {', '.join(sorted(self.capabilities)) or 'none'})",
                capability=unknown[0],
            )

    def match_http(self, host: str, port: int, method: str, path: str) -> list[str]:
        """Every HTTP capability that this request falls under, in catalog order (often one)."""
        key = (host, port, method, path)
        cached = self._memo.get(key)
        if cached is None:
            cached = self._match_http(host, port, method, path)
            if len(self._memo) >= 8192:
                self._memo.clear()
            self._memo[key] = cached
        return list(cached)

    def _match_http(self, host: str, port: int, method: str, path: str) -> tuple[str, ...]:
        clean = safe_path(path)
        if clean is None:
            return ()
        return self._index.match_http(host_key(host), port, method.upper(), clean)

    def mcp_server(self, url: str) -> str | None:
        """The normalized endpoint when ``url`` is one of the catalog's MCP servers."""
        key = ("mcp", url)
        if key not in self._memo:
            if len(self._memo) >= 8192:
                self._memo.clear()
            self._memo[key] = self._mcp_server(url)
        return self._memo[key]

    def _mcp_server(self, url: str) -> str | None:
        normalized = normalize_url(url)
        return normalized if normalized in self._index.mcp_servers else None

    def match_mcp(self, server: str, tool: str) -> list[str]:
        return self.match_mcp_item(server, "tool", tool)

    def mcp_tools(self, server: str) -> dict[str, list[str]]:
        """tool name -> capability names, for one MCP server."""
        return self.mcp_named(server, "tool")

    def mcp_named(self, server: str, kind: str) -> dict[str, list[str]]:
        """name -> capability names for one server's tools or prompts (plumbing: the name ``""``)."""
        return {name: list(caps) for name, caps in self._index.mcp_items.get(server, {}).get(kind, {}).items()}

    def match_mcp_item(self, server: str, kind: str, name: str = "") -> list[str]:
        """The capabilities naming this tool, prompt or piece of plumbing (``name`` empty) on that server."""
        return list(self._index.mcp_items.get(server, {}).get(kind, {}).get(name, ()))

    def match_resource(self, server: str, uri: str) -> list[str]:
        """The resource capabilities of that server whose URI glob admits ``uri`` (none for an unsafe URI)."""
        if not safe_uri(uri):
            return []
        return [name for glob, name in self._index.mcp_resources.get(server, ()) if admits(glob, uri)]

    def match_resource_template(self, server: str, template: str) -> list[str]:
        """The resource capabilities of that server that admit every URI the URI template can expand to."""
        if not safe_uri(template):
            return []
        wanted = resource_glob(template)
        if len(wanted) > MAX_GLOB:
            return []
        return [name for glob, name in self._index.mcp_resources.get(server, ()) if included(wanted, glob)]

    def mcp_capabilities(self, server: str) -> list[str]:
        """Every capability of one MCP server, whatever item it names."""
        return list(self._index.mcp_caps.get(server, ()))

    def knows_host(self, host: str, port: int) -> bool:
        """True when some capability could be reached at host:port (used to refuse CONNECTs early)."""
        host = host_key(host)
        return host in self._index.any_port_hosts or (host, port) in self._index.host_ports

    def credential_of(self, capability: str) -> Credential | None:
        cap = self.capabilities.get(capability)
        return self.credentials.get(cap.credential) if cap is not None and cap.credential else None

    def route_of(self, capability: str) -> Route | None:
        cap = self.capabilities.get(capability)
        return cap.route if cap is not None else None

    def mcp_credential(self, server: str) -> Credential | None:
        """The credential an MCP server gets on every request (plumbing included); one per server (parsing
        refuses a catalog whose tools on one server name different ones)."""
        name = self._index.mcp_credentials.get(server)
        return self.credentials[name] if name is not None else None

    def role(self, name: str) -> dict[str, Any]:
        if name not in self.roles:
            raise UnknownCapability(
                f"role {name!r} is not in the catalog {self.source} "
                f"(known: {', '.join(sorted(self.roles)) or 'none'})",
                role=name,
            )
        return dict(self.roles[name])

    def to_dict(self) -> dict[str, Any]:
        caps: dict[str, Any] = {}
        for c in self.capabilities.values():
            kind, match = _kind_of(c)
            entry: dict[str, Any] = {kind.name: kind.to_dict(match)}
            if c.description:
                entry["description"] = c.description
            if c.credential:
                entry["credential"] = c.credential
            caps[c.name] = entry
        out = {"capabilities": caps, "roles": {k: dict(v) for k, v in self.roles.items()}}
        if self.credentials:  # absent when empty: catalogs without credentials keep the hash they had
            out["credentials"] = {name: cred.to_dict() for name, cred in self.credentials.items()}
        return out


# -- parsing ----------------------------------------------------------------------------------------
def _fail(source: str, where: str, message: str) -> CatalogError:
    return CatalogError(f"{source}: {where}: {message}", source=source, where=where)


def _check_keys(source: str, where: str, value: Any, allowed: set[str], required: set[str]) -> dict:
    if not isinstance(value, dict):
        raise _fail(source, where, f"expected a mapping, got {_kind(value)}")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise _fail(source, where, f"unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(value))
    if missing:
        raise _fail(source, where, f"missing required key {missing[0]!r}")
    return value


def parse_http(source: str, where: str, raw: Any) -> HttpMatch:
    """An ``http`` match (``capability/kinds/http.py`` reads a catalog entry with it)."""
    raw = _check_keys(source, where, raw, _HTTP_KEYS, {"host", "methods", "path"})
    host = raw["host"]
    if not isinstance(host, str) or not _HOST.fullmatch(host.lower()) or (
            host.startswith("[") and not _is_ipv6(host[1:-1])):
        raise _fail(source, f"{where}.host", f"not a host name: {host!r}")
    port = raw.get("port")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise _fail(source, f"{where}.port", f"not a TCP port: {port!r}")
    methods = raw["methods"]
    if not isinstance(methods, list) or not methods:
        raise _fail(source, f"{where}.methods", "expected a non-empty list of HTTP methods")
    for m in methods:
        if not isinstance(m, str) or not _METHOD.fullmatch(m):
            raise _fail(source, f"{where}.methods", f"not an upper-case HTTP method: {m!r}")
    path = raw["path"]
    if not isinstance(path, str) or not path.startswith("/") or "?" in path:
        raise _fail(source, f"{where}.path", f"expected a path glob starting with '/', got {path!r}")
    if len(path) > MAX_GLOB:
        raise _fail(source, f"{where}.path", f"a path glob of {len(path)} characters (at most {MAX_GLOB})")
    scheme = raw.get("scheme")
    if scheme is not None and scheme not in HTTP_SCHEMES:
        raise _fail(source, f"{where}.scheme", f"expected https or http, got {scheme!r}")
    websocket = raw.get("websocket", False)
    if not isinstance(websocket, bool):
        raise _fail(source, f"{where}.websocket", f"expected true or false, got {websocket!r}")
    if websocket and "GET" not in methods:
        raise _fail(source, f"{where}.websocket", "a websocket opens with a GET: add GET to methods")
    return HttpMatch(host=host_key(host), methods=tuple(methods), path=path, port=port, websocket=websocket,
                     scheme=scheme)


def parse_mcp(source: str, where: str, raw: Any) -> McpMatch:
    """An ``mcp`` match (``capability/kinds/mcp.py`` reads a catalog entry with it)."""
    raw = _check_keys(source, where, raw, _MCP_KEYS, {"url"})
    url = raw["url"]
    if not isinstance(url, str):
        raise _fail(source, f"{where}.url", f"expected an http(s) URL, got {url!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError on a port that is not 0-65535
    except ValueError as exc:
        raise _fail(source, f"{where}.url", f"not a valid URL ({exc}): {url!r}") from None
    if parts.scheme == STDIO_SCHEME:
        if not stdio_name_ok(parts.netloc) or parts.path not in ("", "/") or parts.query or parts.fragment:
            raise _fail(source, f"{where}.url", f"a stdio server is named stdio://NAME, NAME one lower-case DNS "
                        f"label (letters, digits, '-'), with nothing after it; got {url!r}")
    elif parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        raise _fail(source, f"{where}.url", f"expected an http(s) URL without a query, or stdio://NAME, got {url!r}")
    kinds = [k for k in MCP_KINDS if k in raw]
    if len(kinds) != 1:
        raise _fail(source, where, f"needs exactly one item: one of {', '.join(MCP_KINDS)}"
                    + (f" (got {', '.join(kinds)})" if kinds else ""))
    kind = kinds[0]
    value = raw[kind]
    if kind in MCP_PLUMBING:
        if value is not True:
            raise _fail(source, f"{where}.{kind}", f"expected true (the server's {kind}), got {value!r}")
        return McpMatch(url=url, kind=kind)
    if not isinstance(value, str) or not value:
        raise _fail(source, f"{where}.{kind}", f"expected a {kind} name, got {value!r}")
    if kind == "resource":
        if len(value) > MAX_GLOB:
            raise _fail(source, f"{where}.resource", f"a resource pattern of {len(value)} characters "
                        f"(at most {MAX_GLOB})")
        if not safe_uri(value):
            raise _fail(source, f"{where}.resource", "expected a URI with a scheme (a glob with '*' or a URI "
                        "template with {expressions}), without dot segments, encoded slashes, backslashes, "
                        f"control characters, a fragment or unbalanced braces: {value!r}")
    return McpMatch(url=url, kind=kind, name=value)


def _check_route(source: str, cap: Capability, credential: Credential) -> None:
    """A credential goes to one scheme, host and port, over TLS; plain HTTP only by the credential's explicit
    ``insecure_plain_http: loopback``, and only to a loopback upstream."""
    where = f"capability {cap.name!r}.{_kind_of(cap)[0].name}"
    route = cap.route
    if route is None:
        raise _fail(source, where, f"injects the credential {credential.name!r}: name the scheme and port it is "
                    "sent to (e.g. scheme: https, port: 443); a credential goes to one scheme, host and port only")
    if route.scheme == "https":
        return
    if credential.insecure_plain_http != PLAIN_HTTP_LOOPBACK:
        raise _fail(source, where, f"would send the credential {credential.name!r} over plain http: use https, or "
                    f"(for an upstream on this machine's loopback only) set insecure_plain_http: "
                    f"{PLAIN_HTTP_LOOPBACK} on the credential")
    if not is_loopback(route.host):
        raise _fail(source, where, f"the credential {credential.name!r} allows plain http to loopback only "
                    f"(127.0.0.0/8, ::1, localhost), not to {route.host}: use https")


def parse_catalog(text: str, source: str = "<catalog>") -> Catalog:
    """Parse and validate catalog YAML. Raises CatalogError naming the file, capability and field."""
    import yaml  # only a catalog read from a file needs it: a sidecar gets its catalog as JSON (catalog_from)

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise _fail(source, *_yaml_problem(exc)) from None
    if raw is None:
        raise _fail(source, "top level", "the catalog is empty: it needs at least 'capabilities:' (docs/catalog.md)")
    return catalog_from(raw, source)


def _yaml_problem(exc: Exception) -> tuple[str, str]:
    """Where a YAML error is (``line L, column C``) and what it is, in one line: PyYAML's own text names
    ``<unicode string>`` instead of the file and spreads over several lines with a caret."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "yaml"
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    return where, f"not valid YAML: {problem}" + (f" ({context})" if context else "")


def _kind(value: Any) -> str:
    """A YAML value's kind as a person reads it (for "expected a mapping, got nothing")."""
    if value is None:
        return "nothing"
    names = {list: "a list", str: "a string", bool: "true/false", int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


def catalog_from(raw: Any, source: str = "<catalog>") -> Catalog:
    """Validate a catalog already decoded (``/v1/catalog``'s JSON, or parsed YAML). Raises CatalogError naming
    the source, capability and field."""
    raw = _check_keys(source, "top level", raw, _TOP_KEYS, {"capabilities"})
    caps_raw = raw["capabilities"]
    if not isinstance(caps_raw, dict) or not caps_raw:
        raise _fail(source, "capabilities", "expected a non-empty mapping of capability names")
    credentials = parse_credentials(source, raw.get("credentials"))
    kinds_by_key = _kind_registry()
    caps: dict[str, Capability] = {}
    for name, spec in caps_raw.items():
        where = f"capability {name!r}"
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _fail(source, where, "capability names are letters, digits and . _ : -")
        spec = _check_keys(source, where, spec, _CAP_FIELDS | set(kinds_by_key), set())
        kinds = [k for k in kinds_by_key if k in spec]
        if len(kinds) != 1:
            raise _fail(source, where, f"needs exactly one match: {' or '.join(repr(k) for k in kinds_by_key)}")
        description = spec.get("description", "")
        if not isinstance(description, str):
            raise _fail(source, f"{where}.description", "expected a string")
        credential = spec.get("credential")
        if credential is not None and credential not in credentials:
            raise _fail(source, f"{where}.credential", f"names {credential!r}, which is not in credentials "
                        f"(known: {', '.join(sorted(credentials)) or 'none'})")
        kind = kinds_by_key[kinds[0]]
        match = kind.parse(source, f"{where}.{kind.name}", spec[kind.name])
        caps[name] = Capability(name, **{kind.name: match}, description=description, credential=credential)
    servers: dict[str, str | None] = {}
    for cap in caps.values():  # an MCP session is one stream of requests: one credential per server
        if cap.mcp is not None:
            seen = servers.setdefault(cap.mcp.server, cap.credential)
            if cap.credential and stdio_server_name(urlsplit(cap.mcp.server).hostname or ""):
                raise _fail(source, f"capability {cap.name!r}.credential", f"the stdio server {cap.mcp.url} is "
                            "reached only through its own bridge: it takes no credential (give the server its "
                            "secrets in its own environment)")
            if seen != cap.credential:
                raise _fail(source, f"capability {cap.name!r}.credential", f"every item of the MCP server "
                            f"{cap.mcp.url} must name the same credential ({seen!r} and {cap.credential!r})")
    for cap in caps.values():
        if cap.credential:
            _check_route(source, cap, credentials[cap.credential])
    roles_raw = raw.get("roles") or {}
    if not isinstance(roles_raw, dict):
        raise _fail(source, "roles", "expected a mapping of role name -> {capability: tier}")
    roles: dict[str, dict[str, Any]] = {}
    for role, grants in roles_raw.items():
        where = f"role {role!r}"
        if not isinstance(grants, dict):
            raise _fail(source, where, "expected a mapping of capability -> tier")
        for cap, tier in grants.items():
            if cap not in caps:
                raise _fail(source, f"{where}.{cap}", "names a capability that is not in the catalog")
            try:
                read_grant(tier, tiers=TIERS)  # a tier, or {tier, calls, per_minute}: roles may carry budgets
            except GrantError as exc:
                raise _fail(source, f"{where}.{cap}", str(exc)) from None
        roles[str(role)] = {str(k): v if isinstance(v, dict) else str(v) for k, v in grants.items()}
    catalog = Catalog(capabilities=caps, roles=roles, hash="", source=source, credentials=credentials)
    digest = hashlib.sha256(canonical_json(catalog.to_dict())).hexdigest()
    return Catalog(capabilities=caps, roles=roles, hash=f"sha256:{digest}", source=source, credentials=credentials)


# The registry of capability kinds (capability/kinds/) is imported when a catalog is read or written, not when
# this module loads: each kind's module builds on this one (its match class, its parser), so this module can
# reach them only once it is whole.
def _kind_registry() -> Mapping[str, CapabilityKind]:
    from tether.capability.kinds import KINDS

    return {name: KINDS[name] for name in ("http", "mcp")}  # the two kinds this matcher knew


def _kind_of(cap: Capability) -> tuple[CapabilityKind, Any]:
    from tether.capability.kinds import KINDS

    for kind in KINDS.values():
        match = getattr(cap, kind.name, None)
        if match is not None:
            return kind, match
    raise ValueError(cap.name)


def empty_catalog(source: str = "<empty catalog>") -> Catalog:
    """A catalog that describes nothing: every capability is absent, every call refused."""
    catalog = Catalog(capabilities={}, roles={}, hash="", source=source)
    digest = hashlib.sha256(canonical_json(catalog.to_dict())).hexdigest()
    return Catalog(capabilities={}, roles={}, hash=f"sha256:{digest}", source=source)
