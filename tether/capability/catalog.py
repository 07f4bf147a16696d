"""The capability catalog: what each capability name means on the wire, and matching calls to names.

A catalog is parsed from YAML text (reading the file is the caller's job), validated strictly (unknown
keys are refused, every error names the file, the capability and the field) and hashed over its
canonical JSON form so a grant can name the exact catalog it was issued against.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_to_bytes, urlsplit

from .budget import TIERS, GrantError, read_grant
from .credentials import PLAIN_HTTP_LOOPBACK, Credential, Route, is_loopback, parse_credentials
from .errors import CatalogError, UnknownCapability
from .jsonpieces import canonical_json

if TYPE_CHECKING:
    from .kinds import CapabilityKind, KindIndex

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
_TOP_KEYS = {"capabilities", "roles", "version", "credentials"}
_CAP_FIELDS = {"description", "credential"}  # beside the one match, under its kind's key (capability/kinds/)
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
class Capability:
    """One catalog capability: its match (``match``) of one kind (``kind``, a name in ``capability/kinds/``'s
    registry). ``cap.http`` / ``cap.mcp`` (any registered kind's name) read the match when it is of that kind
    and None otherwise: the fields a capability had when each kind was a field of its own."""

    name: str
    kind: str
    match: Any
    description: str = ""
    credential: str | None = None  # what the sidecar injects for it (a name in the catalog's credentials)

    def __getattr__(self, attribute: str) -> Any:
        # Called only for what is not a field: a kind's name is the alias of the match of that kind.
        if attribute.startswith("_") or attribute not in _kind_registry():
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {attribute!r}")
        return self.match if self.kind == attribute else None

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


@dataclass(frozen=True)
class Catalog:
    capabilities: Mapping[str, Capability]
    roles: Mapping[str, Mapping[str, Any]]  # capability -> tier or {tier, calls, per_minute}
    hash: str
    source: str = "<catalog>"
    credentials: Mapping[str, Credential] = field(default_factory=dict)
    # Each registered kind's index over this catalog's capabilities of that kind (capability/kinds/), by the
    # kind's name, and the destinations all of them reach: worked out once, when the catalog is built.
    indexes: Mapping[str, KindIndex] = field(init=False, repr=False, compare=False)
    _any_port_hosts: frozenset[str] = field(init=False, repr=False, compare=False)
    _host_ports: frozenset[tuple[str, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        entries: dict[str, list[tuple[int, Capability]]] = {name: [] for name in _kind_registry()}
        for position, cap in enumerate(self.capabilities.values()):
            entries.setdefault(cap.kind, []).append((position, cap))
        indexes = {name: kind.index(entries[name]) for name, kind in _kind_registry().items()}
        object.__setattr__(self, "indexes", indexes)
        object.__setattr__(self, "_any_port_hosts", frozenset().union(*(i.any_port_hosts for i in indexes.values())))
        object.__setattr__(self, "_host_ports", frozenset().union(*(i.host_ports for i in indexes.values())))

    def index(self, kind: str) -> Any:
        """The index the kind named ``kind`` built over this catalog (its matching queries), or None for a kind
        registered after the catalog was built."""
        return self.indexes.get(kind)

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

    # -- aliases: the queries of the shipped kinds' indexes, under the names callers have used -------------
    def match_http(self, host: str, port: int, method: str, path: str) -> list[str]:
        """Every HTTP capability that this request falls under, in catalog order (often one)."""
        return self.indexes[_HTTP].match(host, port, method, path)

    def mcp_server(self, url: str) -> str | None:
        """The normalized endpoint when ``url`` is one of the catalog's MCP servers."""
        return self.indexes[_MCP].server(url)

    def match_mcp(self, server: str, tool: str) -> list[str]:
        return self.indexes[_MCP].item(server, "tool", tool)

    def mcp_tools(self, server: str) -> dict[str, list[str]]:
        """tool name -> capability names, for one MCP server."""
        return self.indexes[_MCP].named(server, "tool")

    def mcp_named(self, server: str, kind: str) -> dict[str, list[str]]:
        return self.indexes[_MCP].named(server, kind)

    def match_mcp_item(self, server: str, kind: str, name: str = "") -> list[str]:
        return self.indexes[_MCP].item(server, kind, name)

    def match_resource(self, server: str, uri: str) -> list[str]:
        return self.indexes[_MCP].resource(server, uri)

    def match_resource_template(self, server: str, template: str) -> list[str]:
        return self.indexes[_MCP].resource_template(server, template)

    def mcp_capabilities(self, server: str) -> list[str]:
        return self.indexes[_MCP].capabilities(server)

    def mcp_credential(self, server: str) -> Credential | None:
        """The credential an MCP server gets on every request (plumbing included); one per server (parsing
        refuses a catalog whose tools on one server name different ones)."""
        name = self.indexes[_MCP].credential(server)
        return self.credentials[name] if name is not None else None

    # -- every kind ----------------------------------------------------------------------------------------
    def knows_host(self, host: str, port: int) -> bool:
        """True when some capability could be reached at host:port (used to refuse CONNECTs early)."""
        host = host_key(host)
        return host in self._any_port_hosts or (host, port) in self._host_ports

    def credential_of(self, capability: str) -> Credential | None:
        cap = self.capabilities.get(capability)
        return self.credentials.get(cap.credential) if cap is not None and cap.credential else None

    def route_of(self, capability: str) -> Route | None:
        cap = self.capabilities.get(capability)
        return cap.route if cap is not None else None

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
def fail(source: str, where: str, message: str) -> CatalogError:
    """The error for a catalog entry that does not fit, naming the file, the capability and the field."""
    return CatalogError(f"{source}: {where}: {message}", source=source, where=where)


_fail = fail


def check_keys(source: str, where: str, value: Any, allowed: set[str], required: set[str]) -> dict:
    """``value`` as a mapping with only ``allowed`` keys and every ``required`` one (CatalogError otherwise)."""
    return _check_keys(source, where, value, allowed, required)


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
        caps[name] = Capability(name, kind.name, match, description=description, credential=credential)
    for kind in kinds_by_key.values():  # what must hold across a kind's capabilities (one credential per server)
        kind.check(source, [cap for cap in caps.values() if cap.kind == kind.name])
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
@cache
def _kind_registry() -> Mapping[str, CapabilityKind]:  # the registry itself, which ``kinds.register`` adds to
    from .kinds import KINDS

    return KINDS


_HTTP, _MCP = "http", "mcp"  # the shipped kinds whose queries the aliases above name (kinds/http.py, kinds/mcp.py)


def _kind_of(cap: Capability) -> tuple[CapabilityKind, Any]:
    from .kinds import match_of

    return match_of(cap)


def empty_catalog(source: str = "<empty catalog>") -> Catalog:
    """A catalog that describes nothing: every capability is absent, every call refused."""
    catalog = Catalog(capabilities={}, roles={}, hash="", source=source)
    digest = hashlib.sha256(canonical_json(catalog.to_dict())).hexdigest()
    return Catalog(capabilities={}, roles={}, hash=f"sha256:{digest}", source=source)
