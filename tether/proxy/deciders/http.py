"""The ``http`` kind's decider: a request one or more http capabilities fall under (by host, port, method and
path; ``capability/kinds/http.py``'s index) is answered at the best tier they are granted at."""

from __future__ import annotations

from tether.capability import errors as codes
from tether.capability.catalog import Catalog
from tether.capability.kinds import http

from ..decision import METHOD, Allow, ChainState, Decision, Facts, Hold, Refusal, Refused, best, state_and_headers

NAME = http.NAME


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
