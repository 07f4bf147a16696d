"""The audit surface (version 2) and the release gate's diff: pure functions, no I/O.

A surface says, per agent and per catalog capability, the tier granted, what the capability means on
the wire (its catalog match) and its budget. ``diff`` decides whether a new surface lets any agent reach
more than the old one did, by containment rather than by text: a path glob is compared by the language
it admits (``capability.glob``), methods as sets, hosts and MCP URLs in the catalog's normal form. It also
reads version-1 surfaces (tiers only), comparing what they carry.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from tether.capability import mcpwire
from tether.capability.catalog import TIERS, Catalog
from tether.capability.glob import Budget
from tether.capability.kinds import KINDS, Change, match_of
from tether.capability.kinds.http import HOST as HOST
from tether.capability.kinds.http import METHODS as METHODS
from tether.capability.kinds.http import PATH as PATH
from tether.capability.kinds.http import PORT as PORT

VERSION = 2
_RANK = {"absent": 0, "approval": 1, "direct": 2}
_BUDGET_FIELDS = ("calls", "per_minute")

# Kinds of widening, as ``audit diff --json`` names them.
TIER, CAPABILITY_ADDED, AGENT_ADDED = "tier_raised", "capability_added", "agent_added"
# Each kind names its own (capability/kinds/http.py: host, port, methods, path; capability/mcpwire.py: MCP's).
WIRE, BUDGET = "wire_changed", "budget_widened"
MCP_URL, MCP_TOOL = mcpwire.MCP_URL, mcpwire.MCP_TOOL


class SurfaceError(ValueError):
    """A document that is not a surface this module can read; the message says where."""


# -- building a surface --------------------------------------------------------------------------------
def grant_entry(value: Any) -> tuple[str, dict[str, Any] | None]:
    """A link's ``caps`` value as (tier, budget): a tier string, or ``{"tier", "calls", "per_minute"}``."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, Mapping) and isinstance(value.get("tier"), str):
        budget = {f: value.get(f) for f in _BUDGET_FIELDS}
        return value["tier"], budget if any(v is not None for v in budget.values()) else None
    raise SurfaceError(f"a capability grant is a tier or an object with a 'tier', got {value!r}")


def wire(catalog: Catalog, name: str) -> dict[str, Any]:
    """What a capability means on the wire, under its kind's key (the kind says what: capability/kinds/)."""
    kind, match = match_of(catalog.capabilities[name])
    return {kind.name: kind.wire(match)}


def _join_budgets(budgets: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The widest of several budgets: no budget at all beats any, a missing field beats any number."""
    if not budgets or any(b is None for b in budgets):
        return None
    out = {}
    for f in _BUDGET_FIELDS:
        values = [b[f] for b in budgets if b is not None]
        out[f] = None if any(v is None for v in values) else max(values)
    return out if any(v is not None for v in out.values()) else None


def surface(catalog: Catalog, grants: Mapping[str, Iterable[Mapping[str, Any]]]) -> dict[str, Any]:
    """The version-2 surface from each agent's live grants (one ``caps`` mapping per link it holds).

    Every catalog capability is listed, ``absent`` included. An agent holding several links gets the
    strongest tier any of them grants, with the widest budget among the links granting that tier.
    Capabilities a grant names that this catalog lacks are left out (they reach nothing)."""
    agents: dict[str, Any] = {}
    for agent, links in sorted(grants.items()):
        best: dict[str, tuple[str, list[dict[str, Any] | None]]] = {}
        for caps in links:
            for cap, value in caps.items():
                if cap not in catalog.capabilities:
                    continue
                tier, budget = grant_entry(value)
                if tier not in _RANK:
                    raise SurfaceError(f"{agent}: {cap}: tier must be one of {', '.join(TIERS)}, got {tier!r}")
                held = best.get(cap)
                if held is None or _RANK[tier] > _RANK[held[0]]:
                    best[cap] = (tier, [budget])
                elif _RANK[tier] == _RANK[held[0]]:
                    held[1].append(budget)
        agents[agent] = {
            name: {
                "tier": best[name][0] if name in best else "absent",
                "wire": wire(catalog, name),
                "budget": _join_budgets(best[name][1]) if name in best and best[name][0] != "absent" else None,
            }
            for name in catalog.names()
        }
    return {"version": VERSION, "catalog": catalog.hash, "agents": agents}


# -- reading a surface -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    tier: str
    wire: Mapping[str, Any] | None  # None: unknown (a version-1 surface)
    budget: Mapping[str, Any] | None


def read(doc: Any, source: str = "surface") -> tuple[int, str | None, dict[str, dict[str, Entry]]]:
    """(version, catalog hash, agent -> capability -> Entry) from a version-1 or version-2 document."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("agents"), Mapping):
        raise SurfaceError(f"{source}: not a `tether audit surface --json` document (no 'agents' object)")
    version = doc.get("version", 1)
    if version not in (1, 2) or isinstance(version, bool):
        raise SurfaceError(f"{source}: surface version {version!r} is not one this tether reads (1 or 2)")
    agents: dict[str, dict[str, Entry]] = {}
    for agent, caps in doc["agents"].items():
        if not isinstance(caps, Mapping):
            raise SurfaceError(f"{source}: agent {agent!r}: expected an object of capabilities")
        agents[agent] = {cap: _entry(value, version, f"{source}: {agent}: {cap}") for cap, value in caps.items()}
    catalog = doc.get("catalog")
    return version, catalog if isinstance(catalog, str) else None, agents


def _entry(value: Any, version: int, where: str) -> Entry:
    if version == 1:
        if not isinstance(value, str) or value not in _RANK:
            raise SurfaceError(f"{where}: expected a tier ({', '.join(TIERS)}), got {value!r}")
        return Entry(value, None, None)
    if not isinstance(value, Mapping) or not isinstance(value.get("tier"), str) or value["tier"] not in _RANK:
        raise SurfaceError(f"{where}: expected {{tier, wire, budget}} with a tier of {', '.join(TIERS)}")
    return Entry(value["tier"], _check_wire(value.get("wire"), where), _check_budget(value.get("budget"), where))


def _check_wire(w: Any, where: str) -> Mapping[str, Any]:
    if isinstance(w, Mapping) and len(w) == 1:
        ((name, value),) = w.items()
        kind = KINDS.get(name)
        if kind is not None and kind.wire_ok(value):
            return w
    raise SurfaceError(f"{where}: wire must be {{http: {{host, port, methods, path}}}} or {{mcp: {{url, tool}}}} "
                       "(or resource, prompt, logging, completion, subscriptions in place of tool)")


def _check_budget(b: Any, where: str) -> Mapping[str, Any] | None:
    if b is None:
        return None
    if isinstance(b, Mapping) and all(
        b.get(f) is None or (isinstance(b.get(f), int | float) and not isinstance(b.get(f), bool))
        for f in _BUDGET_FIELDS
    ):
        return b if any(b.get(f) is not None for f in _BUDGET_FIELDS) else None
    raise SurfaceError(f"{where}: budget must be null or {{calls, per_minute}} with numbers or nulls")


# -- the diff -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Widening:
    agent: str
    capability: str
    kind: str
    old: Any
    new: Any
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        text = {
            TIER: f"{self.old} -> {self.new} (tier raised)",
            CAPABILITY_ADDED: f"added, granted {self.new}",
            AGENT_ADDED: f"new agent, granted {self.new}",
        }.get(self.kind, f"{self.kind.replace('_', ' ')}: {_show(self.old)} -> {_show(self.new)}")
        return f"{self.agent}: {self.capability} {text}" + (f"; {self.detail}" if self.detail else "")


def _show(value: Any) -> str:
    return "any" if value is None else json.dumps(value, sort_keys=True)  # a null port or budget: no limit


def diff(
    old_doc: Any, new_doc: Any, old_source: str = "old surface", new_source: str = "new surface",
    budget: Budget | None = None,
) -> tuple[list[Widening], list[str]]:
    """Every widening from ``old_doc`` to ``new_doc`` (surface documents), and notes for the reader.

    ``budget`` caps the search for shortest path witnesses over the whole diff (inclusion itself is always
    decided, in polynomial time): once spent, a widened path is shown with a longer, still real, witness."""
    budget = budget if budget is not None else Budget()
    old_version, old_catalog, old = read(old_doc, old_source)
    new_version, new_catalog, new = read(new_doc, new_source)
    notes: list[str] = []
    if old_catalog != new_catalog:
        notes.append(f"catalog changed {old_catalog} -> {new_catalog}")
    if 1 in (old_version, new_version):
        side = "old" if old_version == 1 else "new"
        notes.append(f"the {side} surface is version 1 (tiers only): tiers compared, wire and budgets not")
    found: list[Widening] = []
    for agent, caps in sorted(new.items()):
        before = old.get(agent)
        for cap, entry in sorted(caps.items()):
            if entry.tier == "absent":
                continue  # reaches nothing, whatever its wire says
            if before is None:
                found.append(Widening(agent, cap, AGENT_ADDED, None, entry.tier))
                continue
            was = before.get(cap)
            if was is None:
                found.append(Widening(agent, cap, CAPABILITY_ADDED, None, entry.tier))
                continue
            if _RANK[entry.tier] > _RANK[was.tier]:
                found.append(Widening(agent, cap, TIER, was.tier, entry.tier))
                continue  # it reached nothing before: its wire and budget were not granted then
            if was.wire is None or entry.wire is None:
                continue  # a version-1 side: no wire, no budget to compare
            changes = [*_wire_widenings(was.wire, entry.wire, budget), *_budget_widenings(was, entry)]
            found.extend(Widening(agent, cap, kind, o, n, d) for kind, o, n, d in changes)
    return found, notes


def _wire_widenings(old: Mapping[str, Any], new: Mapping[str, Any], budget: Budget) -> list[Change]:
    """Both wires were read by ``_check_wire``: one key each, a kind of the registry."""
    if set(old) != set(new):
        return [(WIRE, dict(old), dict(new), "the capability now matches a different kind of call")]
    ((name, now),) = new.items()
    return KINDS[name].widenings(old[name], now, budget)


def _budget_widenings(was: Entry, now: Entry) -> list[Change]:
    if was.budget is None:
        return []  # no limit before: any budget now narrows
    after = now.budget or {}
    raised = [f for f in _BUDGET_FIELDS if was.budget.get(f) is not None
              and (after.get(f) is None or after[f] > was.budget[f])]
    if not raised:
        return []
    detail = "; ".join(
        f"{f} {was.budget[f]} -> {'unlimited' if after.get(f) is None else after[f]}" for f in raised
    )
    return [(BUDGET, dict(was.budget), dict(now.budget) if now.budget is not None else None,
             ("budget removed: " if now.budget is None else "") + detail)]
