"""Budgets on capabilities (docs/contract.md section 10): the grant value, the narrowing rules, slice arithmetic.

A capability in a link's ``caps`` is a tier (``"direct"``) or ``{"tier": T, "calls": N, "per_minute": M}``.
``calls`` bounds the calls forwarded under the link by its holder and every descendant, across all their
sidecars; ``per_minute`` bounds how many of them may be forwarded in one rate window (60 s unless the
control plane is told otherwise). A child may only narrow: its numbers at most its parent's, and a budget
its parent carries may never be dropped.

The control plane owns every budget: a sidecar leases *slices* (a number of calls of one capability, taken
at once from every budgeted link of its chain) and spends them locally. This module computes the keys a
slice is taken from and how large a slice may be; the stores do the taking atomically. Pure: no I/O, no
clock of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

TIERS = ("direct", "approval", "absent")  # what a catalog role or a grant may name
GRANTED_TIERS = ("direct", "approval")  # what a chain link may carry

BUDGET_FIELDS = ("calls", "per_minute")
MAX_BUDGET = 10**12  # a bound a JSON number, a Redis integer and an SQLite integer all hold exactly
DEFAULT_WINDOW_S = 60.0
SLICE_FRACTION = 0.25  # a slice never takes more than this share of what is left of any budget it draws on
MAX_SLICE = 1024
_RANK = {"approval": 1, "direct": 2}


class GrantError(ValueError):
    """A capability grant that is neither a tier nor a well-formed budgeted tier; the message says why."""


@dataclass(frozen=True)
class Grant:
    """One capability as a link grants it."""

    tier: str
    calls: int | None = None
    per_minute: int | None = None

    @property
    def budgeted(self) -> bool:
        return self.calls is not None or self.per_minute is not None

    def claim(self) -> str | dict[str, Any]:
        """The value written in a link's ``caps``: the bare tier when there is no budget (older readers
        understand it, and it is what every link without budgets has always carried)."""
        if not self.budgeted:
            return self.tier
        out: dict[str, Any] = {"tier": self.tier}
        for name in BUDGET_FIELDS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def text(self) -> str:
        """``direct,calls=20,per_minute=5``: the CLI spelling."""
        extra = "".join(f",{n}={getattr(self, n)}" for n in BUDGET_FIELDS if getattr(self, n) is not None)
        return self.tier + extra


def _count(value: Any, name: str, minimum: int) -> int:
    if type(value) is not int or not minimum <= value <= MAX_BUDGET:
        raise GrantError(f"'{name}' must be a whole number from {minimum} to {MAX_BUDGET}, got {value!r}")
    return value


def read_grant(value: Any, *, tiers: tuple[str, ...] = GRANTED_TIERS) -> Grant:
    """A ``caps`` value (tier string or budget object) as a Grant. Raises GrantError."""
    if isinstance(value, Grant):
        value = value.claim()
    if isinstance(value, str):
        if value not in tiers:
            raise GrantError(f"tier must be one of {', '.join(tiers)}, got {value!r}")
        return Grant(value)
    if not isinstance(value, Mapping):
        raise GrantError(f"tier must be one of {', '.join(tiers)} (or an object {{tier, calls, per_minute}}), "
                         f"got {value!r}")
    unknown = sorted(str(k) for k in value if k not in ("tier", *BUDGET_FIELDS))
    if unknown:
        raise GrantError(f"unknown field {unknown[0]!r} (allowed: tier, calls, per_minute)")
    tier = value.get("tier")
    if tier not in tiers:
        raise GrantError(f"tier must be one of {', '.join(tiers)}, got {tier!r}")
    calls = value.get("calls")
    per_minute = value.get("per_minute")
    return Grant(tier, None if calls is None else _count(calls, "calls", 0),
                 None if per_minute is None else _count(per_minute, "per_minute", 1))


def split_caps(caps: Any) -> tuple[dict[str, str], dict[str, Grant]]:
    """A link's ``caps`` claim as (capability -> tier, capability -> Grant for the budgeted ones).
    Raises GrantError naming the capability."""
    if not isinstance(caps, dict):
        raise GrantError("'caps' must be an object of capability -> tier or {tier, calls, per_minute}")
    tiers: dict[str, str] = {}
    budgets: dict[str, Grant] = {}
    for name, value in caps.items():
        if type(name) is not str:
            raise GrantError("capability names must be strings")
        if type(value) is str and value in GRANTED_TIERS:  # the common case, no object built
            tiers[name] = value
            continue
        try:
            grant = read_grant(value)
        except GrantError as exc:
            raise GrantError(f"capability {name}: {exc}") from None
        tiers[name] = grant.tier
        if grant.budgeted:
            budgets[name] = grant
    return tiers, budgets


def normalize(caps: Mapping[str, Any]) -> dict[str, str | dict[str, Any]]:
    """Caps as given to minting (tiers, objects, Grants; ``absent`` allowed and dropped) in claim form."""
    out: dict[str, str | dict[str, Any]] = {}
    for name, value in caps.items():
        try:
            grant = read_grant(value, tiers=TIERS)
        except GrantError as exc:
            raise GrantError(f"capability {name}: {exc}") from None
        if grant.tier == "absent":
            if grant.budgeted:
                raise GrantError(f"capability {name}: an absent capability carries no budget")
            continue
        out[name] = grant.claim()
    return out


def parse_cap_spec(spec: str) -> tuple[str, Grant | str]:
    """``NAME=TIER[,calls=N][,per_minute=M]`` as (name, tier or Grant). Raises GrantError."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise GrantError(f"--cap {spec!r}: expected NAME=TIER[,calls=N][,per_minute=M]")
    tier, *fields = rest.split(",")
    if not fields:
        if tier not in TIERS:
            raise GrantError(f"--cap {spec!r}: tier must be one of {', '.join(TIERS)}")
        return name, tier
    doc: dict[str, Any] = {"tier": tier}
    for item in fields:
        key, sep, number = item.partition("=")
        if not sep or key not in BUDGET_FIELDS or key in doc:
            raise GrantError(f"--cap {spec!r}: after the tier come calls=N and per_minute=M, each at most once")
        if not number.isdigit():
            raise GrantError(f"--cap {spec!r}: {key} must be a whole number")
        doc[key] = int(number)
    try:
        return name, read_grant(doc, tiers=TIERS)
    except GrantError as exc:
        raise GrantError(f"--cap {spec!r}: {exc}") from None


# -- narrowing ----------------------------------------------------------------------------------------
def widening(parent: Grant | None, child: Grant) -> tuple[str, str] | None:
    """Why ``child`` is not a narrowing of ``parent`` as (reason, explanation), or None when it is."""
    if parent is None:
        return "widened_capability", "it is not granted to the parent"
    if _RANK.get(child.tier, 0) > _RANK.get(parent.tier, 0):
        return "tier_weakened", f"it is '{parent.tier}' for the parent; a delegate cannot hold it '{child.tier}'"
    for name in BUDGET_FIELDS:
        mine, theirs = getattr(child, name), getattr(parent, name)
        if theirs is None:
            continue
        if mine is None:
            return "budget_widened", f"the parent's {name}={theirs} budget cannot be removed"
        if mine > theirs:
            return "budget_widened", f"{name}={mine} is more than the parent's {name}={theirs}"
    return None


# -- slices -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BudgetKey:
    """One counter a slice draws on: a link's ``calls`` budget, or its ``per_minute`` budget in one window."""

    key: str  # "{jti}/{capability}" or "{jti}/{capability}/w{window}"
    limit: int
    kind: str  # "calls" | "per_minute"
    jti: str


def calls_key(jti: str, capability: str) -> str:
    return f"{jti}/{capability}"


def window_of(now: float, window_s: float) -> tuple[int, float]:
    """The fixed rate window holding ``now``: (its index, when it ends)."""
    index = math.floor(now / window_s)
    return index, (index + 1) * window_s


def slice_keys(chain: Iterable[tuple[str, Mapping[str, Any]]], capability: str, now: float,
               window_s: float = DEFAULT_WINDOW_S) -> list[BudgetKey]:
    """Every counter a call of ``capability`` under this chain draws on. ``chain``: (jti, caps claim) per link,
    root first. Empty when no link budgets the capability (the call is not counted)."""
    index, _ = window_of(now, window_s)
    out: list[BudgetKey] = []
    for jti, caps in chain:
        value = caps.get(capability)
        if value is None or isinstance(value, str):
            continue
        grant = read_grant(value)
        if grant.calls is not None:
            out.append(BudgetKey(calls_key(jti, capability), grant.calls, "calls", jti))
        if grant.per_minute is not None:
            out.append(BudgetKey(f"{calls_key(jti, capability)}/w{index}", grant.per_minute, "per_minute", jti))
    return out


def slice_size(want: int, remaining: Iterable[int], fraction: float = SLICE_FRACTION) -> int:
    """How many calls a slice gets: what was asked, but never more than ``fraction`` of what is left of the
    tightest counter (at least one while anything is left), so sidecars sharing a budget are not starved
    by one that asked early; 0 when a counter has nothing left."""
    left = min(remaining, default=0)
    if left <= 0:
        return 0
    return max(1, min(want, MAX_SLICE, math.floor(left * fraction)))


def next_want(previous: int, spent_in_s: float, horizon_s: float) -> int:
    """The size of the next slice a sidecar asks for: doubles while a slice lasts less than ``horizon_s``
    (start small, grow with use), halves when one lasted much longer (shrink when calls are rare)."""
    if spent_in_s < horizon_s:
        return min(MAX_SLICE, max(1, previous * 2))
    if spent_in_s > 4 * horizon_s:
        return max(1, previous // 2)
    return max(1, previous)
