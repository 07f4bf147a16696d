"""The ``http`` kind: calls matched by host, port, methods and a path glob (``HttpMatch``), and answered
(``decide``): a request one or more http capabilities fall under (by host, port, method and path, ``HttpIndex``)
is answered at the best tier they are granted at.

On the audit surface its wire is ``{host, port, methods, path}``; a new wire widens when its host differs, its
port is lifted or changed, it adds a method, or its path glob admits a path the old one refused (decided by
language inclusion, ``capability.glob``, with a shortest witness while the search budget lasts).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import errors as codes
from ..catalog import check_keys, fail, host_key, safe_path
from ..credentials import Route
from ..decision import METHOD, Allow, ChainState, Decision, Facts, Hold, Refusal, Refused, best, state_and_headers
from ..glob import MAX_GLOB, Budget, GlobTooLong, admits, compare

if TYPE_CHECKING:
    from ..catalog import Capability, Catalog

NAME = "http"
# What widened, as `tether audit diff --json` names it.
HOST, PORT, METHODS, PATH = "host_changed", "port_widened", "methods_added", "path_widened"

Change = tuple[str, Any, Any, str]
_METHOD = re.compile(r"^[A-Z]{1,16}$")
_HOST = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$|^\[[0-9a-f:.]+\]$")
_HTTP_KEYS = {"host", "port", "scheme", "methods", "path", "websocket"}
HTTP_SCHEMES = ("http", "https")


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


def parse_http(source: str, where: str, raw: Any) -> HttpMatch:
    """An ``http`` catalog entry checked and read as its match."""
    raw = check_keys(source, where, raw, _HTTP_KEYS, {"host", "methods", "path"})
    host = raw["host"]
    if not isinstance(host, str) or not _HOST.fullmatch(host.lower()) or (
            host.startswith("[") and not _is_ipv6(host[1:-1])):
        raise fail(source, f"{where}.host", f"not a host name: {host!r}")
    port = raw.get("port")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise fail(source, f"{where}.port", f"not a TCP port: {port!r}")
    methods = raw["methods"]
    if not isinstance(methods, list) or not methods:
        raise fail(source, f"{where}.methods", "expected a non-empty list of HTTP methods")
    for m in methods:
        if not isinstance(m, str) or not _METHOD.fullmatch(m):
            raise fail(source, f"{where}.methods", f"not an upper-case HTTP method: {m!r}")
    path = raw["path"]
    if not isinstance(path, str) or not path.startswith("/") or "?" in path:
        raise fail(source, f"{where}.path", f"expected a path glob starting with '/', got {path!r}")
    if len(path) > MAX_GLOB:
        raise fail(source, f"{where}.path", f"a path glob of {len(path)} characters (at most {MAX_GLOB})")
    scheme = raw.get("scheme")
    if scheme is not None and scheme not in HTTP_SCHEMES:
        raise fail(source, f"{where}.scheme", f"expected https or http, got {scheme!r}")
    websocket = raw.get("websocket", False)
    if not isinstance(websocket, bool):
        raise fail(source, f"{where}.websocket", f"expected true or false, got {websocket!r}")
    if websocket and "GET" not in methods:
        raise fail(source, f"{where}.websocket", "a websocket opens with a GET: add GET to methods")
    return HttpMatch(host=host_key(host), methods=tuple(methods), path=path, port=port, websocket=websocket,
                     scheme=scheme)


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


# -- the decision: what a request an http capability covers is answered ------------------------------------
def decide(catalog: Catalog, chain: ChainState, facts: Facts) -> Decision | None:
    """The answer for a request some http capability covers; None (not claimed) when none does."""
    names = catalog.indexes[NAME].match(facts.host, facts.port, facts.method, facts.path)
    if not names:
        return None
    capability, tier = best(chain, names)
    refusal = state_and_headers(chain, facts, websocket_ok=_websocket_capability(catalog, capability))
    if refusal is None and tier == "absent":
        refusal = Refusal(codes.CAPABILITY_ABSENT, f"{capability} is not granted to {chain.agent}")
    if refusal is not None:
        return Refused(refusal=refusal, capability=capability, tier=tier)
    return (Hold if tier == "approval" else Allow)(capability=capability, tier=tier)


def matched(catalog: Catalog, chain: ChainState, facts: Facts) -> tuple[str | None, str | None]:
    """The http capability a request falls under at its best tier, and that tier (None, None when none)."""
    names = catalog.indexes[NAME].match(facts.host, facts.port, facts.method, facts.path)
    return best(chain, names) if names else (None, None)


def override_refusal(catalog: Catalog, facts: Facts, capability: str | None,
                     override: tuple[str, str]) -> Refusal | None:
    """A body's method override passes only when the capability the call matched grants that method on that path
    too (then the server does what the capability allows, at its tier and budget); otherwise refused."""
    name, method = override
    if capability is not None and METHOD.fullmatch(method) and capability in catalog.indexes[NAME].match(
            facts.host, facts.port, method, facts.path):
        return None
    return Refusal(codes.CAPABILITY_ABSENT, f"the body field {name!r} asks the server to use the method "
                   f"{method[:16]!r}, which {capability or 'no capability'} does not grant on this path; remove it",
                   reason="method_override_body")


def _websocket_capability(catalog: Catalog, name: str) -> bool:
    cap = catalog.capabilities.get(name)
    return cap is not None and cap.kind == NAME and cap.match.websocket


class HttpKind:
    name = NAME

    def parse(self, source: str, where: str, raw: Any) -> HttpMatch:
        return parse_http(source, where, raw)

    def check(self, source: str, caps: Sequence[Capability]) -> None:
        """Nothing across capabilities: each http match stands alone."""

    def index(self, entries: Sequence[tuple[int, Capability]]) -> HttpIndex:
        return HttpIndex(entries)

    def to_dict(self, match: HttpMatch) -> dict[str, Any]:
        return match.to_dict()

    def route(self, match: HttpMatch) -> Route | None:
        """Fixed only when the catalog names both the scheme and the port."""
        return Route(match.scheme, match.host, match.port) if match.scheme is not None and match.port is not None \
            else None

    def wire(self, match: HttpMatch) -> dict[str, Any]:
        return {"host": match.host, "port": match.port, "methods": list(match.methods), "path": match.path}

    def wire_ok(self, value: Any) -> bool:
        if not isinstance(value, Mapping):
            return False
        port = value.get("port")
        return (isinstance(value.get("host"), str) and isinstance(value.get("path"), str)
                and isinstance(value.get("methods"), list) and all(isinstance(m, str) for m in value["methods"])
                and (port is None or (isinstance(port, int) and not isinstance(port, bool))))

    def widenings(self, old: Mapping[str, Any], new: Mapping[str, Any], budget: Budget) -> list[Change]:
        out: list[Change] = []
        if host_key(old["host"]) != host_key(new["host"]):
            out.append((HOST, old["host"], new["host"], ""))
        if old.get("port") is not None and new.get("port") != old.get("port"):
            out.append((PORT, old["port"], new.get("port"), ""))
        added = sorted(set(new["methods"]) - set(old["methods"]))
        if added:
            out.append((METHODS, list(old["methods"]), list(new["methods"]), f"adds {', '.join(added)}"))
        if new["path"] != old["path"]:
            out.extend(_path_widening(old["path"], new["path"], budget))
        return out

    def text(self, value: Mapping[str, Any]) -> str:
        port = f":{value['port']}" if value.get("port") is not None else ""
        return f"{','.join(value['methods'])} {value['host']}{port}{value['path']}"

    decide = staticmethod(decide)  # the function above, called as it is: once per request on the hot path


def _path_widening(old: str, new: str, budget: Budget) -> list[Change]:
    try:
        verdict = compare(new, old, budget)
    except GlobTooLong as exc:  # no catalog writes such a glob: fail closed rather than spend without bound
        return [(PATH, old, new, f"not compared, counted as widened: {exc}")]
    if verdict.included:
        return []
    shortest = "" if verdict.shortest else " (not a shortest one: the diff's search budget ran out)"
    return [(PATH, old, new, f"admits {verdict.example!r}{shortest}, which the old path refused")]


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


MEMO_LIMIT = 8192  # remembered answers per catalog (cleared when full)


class HttpIndex:
    """Where a catalog's http capabilities live, worked out once when the catalog is built.

    They are bucketed by (host, method, first path segment of the glob); a glob whose first segment holds a
    ``*`` goes in the host and method's ``None`` bucket, tried for every path. A request then tries only the
    globs of its own host and method whose literal start could fit its path, so the cost of matching does not
    grow with the capabilities of other hosts or other paths. Every entry keeps its place in the catalog so
    answers come back in catalog order, as the linear scan gave them. Matching is pure and the catalog never
    changes, so answers are remembered (bounded): a miss runs ``safe_path``, which costs more than the lookup.
    """

    __slots__ = ("any_port_hosts", "buckets", "host_ports", "memo")

    def __init__(self, entries: Sequence[tuple[int, Capability]]) -> None:
        # (host, method, segment or None) -> entries (catalog position, port or None, path glob, name)
        buckets: dict[tuple[str, str, str | None], list[tuple[int, int | None, str, str]]] = {}
        any_port_hosts: set[str] = set()  # a host any port of which some capability names
        host_ports: set[tuple[str, int]] = set()  # ... and the (host, port) pairs ports narrow to
        for position, cap in entries:
            h: HttpMatch = cap.match
            entry = (position, h.port, h.path, cap.name)
            segment = _glob_segment(h.path)
            for method in dict.fromkeys(h.methods):  # a method listed twice still matches once
                buckets.setdefault((h.host, method, segment), []).append(entry)
            if h.port is None:
                any_port_hosts.add(h.host)
            else:
                host_ports.add((h.host, h.port))
        self.buckets = {key: tuple(found) for key, found in buckets.items()}
        self.any_port_hosts = frozenset(any_port_hosts)
        self.host_ports = frozenset(host_ports)
        self.memo: dict[tuple[str, int, str, str], tuple[str, ...]] = {}

    def match(self, host: str, port: int, method: str, path: str) -> list[str]:
        """Every http capability this request falls under, in catalog order (often one)."""
        key = (host, port, method, path)
        cached = self.memo.get(key)
        if cached is None:
            clean = safe_path(path)
            cached = () if clean is None else self._match(host_key(host), port, method.upper(), clean)
            if len(self.memo) >= MEMO_LIMIT:
                self.memo.clear()
            self.memo[key] = cached
        return list(cached)

    def _match(self, host: str, port: int, method: str, path: str) -> tuple[str, ...]:
        """``host``, ``method`` and ``path`` as the catalog compares them (host_key, upper case, safe_path)."""
        literal = self.buckets.get((host, method, _first_segment(path)), ())
        starred = self.buckets.get((host, method, None), ())
        found = [(position, name) for bucket in (literal, starred)
                 for position, cap_port, glob, name in bucket
                 if (cap_port is None or cap_port == port) and admits(glob, path)]
        if literal and starred:
            found.sort()  # two buckets: back to catalog order
        return tuple(name for _, name in found)


KIND = HttpKind()
