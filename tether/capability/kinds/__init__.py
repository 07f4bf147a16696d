"""Capability kinds behind one protocol, in one registry: ``http`` (``http.py``) and ``mcp`` (``mcp.py``).

A catalog capability names exactly one match, under its kind's key (``http:`` or ``mcp:``). Everything that
depends on which kind it is and is not the sidecar's per-request matching goes through the kind: how its catalog
entry is read (``parse``) and written back in the catalog's canonical form, which the catalog hash covers
(``to_dict``); the scheme, host and port its calls go to, when fixed (``route``); what the audit surface shows of
it (``wire``), how a surface's wire is read back (``wire_ok``), whether a new wire admits more than an old one
(``widenings``), and its one line in ``tether audit surface`` (``text``). The catalog's loader, the audit surface
and its diff ask the registry and name no kind themselves. docs/catalog.md ("Capability kinds") says what a new
kind needs besides its module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from . import http, mcp

if TYPE_CHECKING:
    from ..catalog import Capability
    from ..credentials import Route
    from ..glob import Budget

Change = tuple[str, Any, Any, str]  # (what widened, old, new, detail), as `tether audit diff --json` names it


@runtime_checkable
class CapabilityKind(Protocol):
    name: str  # the catalog key, the audit surface's wire key, and the Capability field holding the match

    def parse(self, source: str, where: str, raw: Any) -> Any:
        """The catalog entry under ``name`` checked and read as this kind's match (CatalogError naming
        ``source`` and ``where`` otherwise)."""
        ...

    def to_dict(self, match: Any) -> dict[str, Any]: ...

    def route(self, match: Any) -> Route | None: ...

    def wire(self, match: Any) -> dict[str, Any]: ...

    def wire_ok(self, value: Any) -> bool: ...

    def widenings(self, old: Mapping[str, Any], new: Mapping[str, Any], budget: Budget) -> list[Change]: ...

    def text(self, value: Mapping[str, Any]) -> str: ...


KINDS: Mapping[str, CapabilityKind] = {kind.name: kind for kind in (http.KIND, mcp.KIND)}


def match_of(cap: Capability) -> tuple[CapabilityKind, Any]:
    """A capability's kind and its match (the catalog parser gives every capability exactly one)."""
    for kind in KINDS.values():
        match = getattr(cap, kind.name, None)
        if match is not None:
            return kind, match
    raise ValueError(f"capability {cap.name!r} has no match of a known kind ({', '.join(KINDS)})")


__all__ = ["KINDS", "CapabilityKind", "Change", "match_of"]
