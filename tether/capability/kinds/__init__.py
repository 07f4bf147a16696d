"""Capability kinds behind one protocol, in one registry: ``http`` (``http.py``) and ``mcp`` (``mcp.py``). A kind
is one module: its match, its catalog index and its decision.

A catalog capability names exactly one match, under its kind's key (``http:`` or ``mcp:``). Everything that
depends on which kind it is and is not the sidecar's per-request matching goes through the kind: how its catalog
entry is read (``parse``) and written back in the catalog's canonical form, which the catalog hash covers
(``to_dict``); the scheme, host and port its calls go to, when fixed (``route``); what the audit surface shows of
it (``wire``), how a surface's wire is read back (``wire_ok``), whether a new wire admits more than an old one
(``widenings``), and its one line in ``tether audit surface`` (``text``). The catalog's loader, the audit surface
and its diff ask the registry and name no kind themselves. The sidecar's per-request matching is the kind's too:
``decide`` answers a request the kind's capabilities could grant (in ``capability/decision.py``'s words) and None
for any other; the sidecar's ``decide`` asks the kinds in ``DECIDERS``'s order (a registered kind first, then
``mcp``, whose endpoints a request to one belongs to whatever http capability its request line falls under, then
``http``). docs/catalog.md ("Capability kinds") says what a new kind needs besides its module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from . import http, mcp

if TYPE_CHECKING:
    from ..catalog import Capability, Catalog
    from ..credentials import Route
    from ..decision import ChainState, Decider, Decision, Facts
    from ..glob import Budget

Change = tuple[str, Any, Any, str]  # (what widened, old, new, detail), as `tether audit diff --json` names it


@runtime_checkable
class KindIndex(Protocol):
    """A kind's index over one catalog's capabilities of that kind (its matching queries are its own)."""

    any_port_hosts: frozenset[str]  # hosts some capability reaches on any port
    host_ports: frozenset[tuple[str, int]]  # (host, port) pairs some capability reaches


@runtime_checkable
class CapabilityKind(Protocol):
    name: str  # the catalog key, the audit surface's wire key, and ``Capability.kind`` (an alias reads the match)

    def parse(self, source: str, where: str, raw: Any) -> Any:
        """The catalog entry under ``name`` checked and read as this kind's match (CatalogError naming
        ``source`` and ``where`` otherwise)."""
        ...

    def check(self, source: str, caps: Sequence[Capability]) -> None:
        """What must hold across this kind's capabilities of one catalog (CatalogError otherwise)."""
        ...

    def index(self, entries: Sequence[tuple[int, Capability]]) -> KindIndex:
        """The index of this kind's capabilities, each with its position in the catalog."""
        ...

    def to_dict(self, match: Any) -> dict[str, Any]: ...

    def route(self, match: Any) -> Route | None: ...

    def wire(self, match: Any) -> dict[str, Any]: ...

    def wire_ok(self, value: Any) -> bool: ...

    def widenings(self, old: Mapping[str, Any], new: Mapping[str, Any], budget: Budget) -> list[Change]: ...

    def text(self, value: Mapping[str, Any]) -> str: ...

    def decide(self, catalog: Catalog, chain: ChainState, facts: Facts) -> Decision | None:
        """The answer for a request this kind's capabilities could grant (it claims the request); None for any
        other. Pure, and on the sidecar's hot path: once per request, before any upstream byte."""
        ...


_REGISTRY: dict[str, CapabilityKind] = {kind.name: kind for kind in (http.KIND, mcp.KIND)}
KINDS: Mapping[str, CapabilityKind] = _REGISTRY  # read-only to its users; ``register`` adds to it
_ASKED: list[CapabilityKind] = [mcp.KIND, http.KIND]  # the order their deciders are asked in
# The kinds' deciders in that order, the one list the sidecar's ``decide`` walks (kept in step with _ASKED, changed
# in place: a reader holding it sees a registration).
DECIDERS: list[Decider] = [kind.decide for kind in _ASKED]


def register(kind: CapabilityKind) -> None:
    """Add a kind to the registry (a catalog read afterwards knows its key, the sidecar asks its decider). Its
    module calls this as it loads; the shipped kinds are listed above instead. Its decider is asked before the
    shipped ones: a kind claims its own requests before ``http`` claims whatever its capabilities' request lines
    match. A name already taken is refused."""
    if kind.name in _REGISTRY:
        raise ValueError(f"a capability kind named {kind.name!r} is already registered")
    _REGISTRY[kind.name] = kind
    _ASKED.insert(0, kind)
    DECIDERS[:] = [k.decide for k in _ASKED]


def unregister(name: str) -> None:
    """Take a kind out of the registry again (a test that registered one of its own)."""
    _REGISTRY.pop(name, None)
    _ASKED[:] = [k for k in _ASKED if k.name != name]
    DECIDERS[:] = [k.decide for k in _ASKED]


def asked() -> list[str]:
    """The kinds' names in the order their deciders are asked."""
    return [k.name for k in _ASKED]


def match_of(cap: Capability) -> tuple[CapabilityKind, Any]:
    """A capability's kind and its match (the catalog parser gives every capability exactly one)."""
    kind = _REGISTRY.get(cap.kind)
    if kind is None:
        raise ValueError(f"capability {cap.name!r} has no match of a known kind ({', '.join(KINDS)})")
    return kind, cap.match


__all__ = ["DECIDERS", "KINDS", "CapabilityKind", "Change", "KindIndex", "asked", "match_of", "register", "unregister"]
