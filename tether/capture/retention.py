"""Which capture segments go: the retention policy as a pure function over what is on disk, the clock passed in.

A capture is a sequence of segments (tether/capture/segments.py): the active one being written and sealed ones,
each compressed once sealed. ``plan()`` answers which sealed segments to delete, in what order, and whether the
disk is low. The active segment is never a candidate, and neither is a *held* one (a termination's record may name
its flows: docs/captures.md). Rules, applied in order:

1. **Age.** A sealed segment whose last flow started more than ``keep_s`` ago goes.
2. **The agent's cap.** While an agent's segments, plus room for its active segment and one compression in
   progress, pass ``max_bytes``, its oldest unheld segment goes.
3. **The node's cap.** While all agents' segments under the state root, plus the same room, pass
   ``node_max_bytes``, the oldest unheld segment of any agent goes (oldest by its last flow).
4. **The disk's floor.** While the file system would have less than ``min_free_bytes`` free, the oldest unheld
   segment of any agent goes. Below twice the floor the disk is *low*: the sidecar logs it and says so in its
   metrics, before anything is refused.

What is held stays whatever the caps say: a cap that held segments alone exceed is reported (``over``), not met.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from tether.capability.errors import BAD_REQUEST, TetherError

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class Policy:
    """The retention settings (the sidecar's ``--capture-*`` options; ``tether capture prune`` takes the same)."""

    segment_bytes: int = 64 * MIB  # a segment is sealed (and compressed) at this size ...
    segment_age_s: float = 3600.0  # ... or this old, whichever first
    max_bytes: int = 1 * GIB  # one agent's captures, every segment counted as it lies on disk
    keep_s: float = 7 * 86400.0  # no flow is kept longer (unless held)
    node_max_bytes: int = 8 * GIB  # every agent's captures under one state root
    min_free_bytes: int = 2 * GIB  # the file system keeps this much free; twice this is "low"
    hold_s: float = 30 * 86400.0  # a termination's hold lasts this long unless exported first
    compress: bool = True

    def __post_init__(self) -> None:
        for name in ("segment_bytes", "max_bytes", "node_max_bytes"):
            if getattr(self, name) <= 0:
                raise TetherError(f"capture retention: {name} must be positive", code=BAD_REQUEST)
        if self.segment_bytes * 4 > self.max_bytes:  # room for a few sealed segments under the cap
            object.__setattr__(self, "segment_bytes", max(64 * KIB, self.max_bytes // 4))

    @property
    def reserve(self) -> int:
        """Room kept under the agent's cap for the active segment and one compression's output."""
        return 2 * self.segment_bytes


@dataclass(frozen=True)
class Segment:
    """One sealed segment as ``plan`` sees it."""

    agent: str
    seq: int
    bytes: int
    opened_at: float  # when the writer opened it: a hold covers segments opened before its end
    last_at: float  # the newest flow's start (or the file's time when it has no index)
    path: str = ""


@dataclass(frozen=True)
class Hold:
    """A termination's hold on an agent's segments: every segment opened up to ``covers_until`` stays until the
    record's calls are exported or ``expires_at`` passes."""

    termination_id: str
    agent: str
    held_at: float
    covers_until: float
    expires_at: float
    exported_at: float | None = None

    def in_force(self, now: float) -> bool:
        return self.exported_at is None and now < self.expires_at

    def covers(self, segment: Segment) -> bool:
        return segment.agent == self.agent and segment.opened_at <= self.covers_until


@dataclass(frozen=True)
class Usage:
    """What one agent's captures take: sealed segments and the active one."""

    agent: str
    sealed: tuple[Segment, ...]
    active_bytes: int = 0

    @property
    def bytes(self) -> int:
        return self.active_bytes + sum(s.bytes for s in self.sealed)


@dataclass
class Plan:
    """What ``plan`` decided: the segments to delete (each with why), and what the disk looks like after."""

    delete: list[tuple[Segment, str]] = field(default_factory=list)
    held: int = 0  # segments kept because a hold covers them
    low: bool = False  # free space under twice the floor, after the deletions
    over: list[str] = field(default_factory=list)  # caps that held segments alone keep from being met
    free_after: int | None = None
    node_bytes_after: int = 0


def plan(usages: Iterable[Usage], holds: Iterable[Hold], policy: Policy, now: float, *,
         own: str | None = None, free_bytes: int | None = None) -> Plan:
    """The deletions that bring the captures within ``policy``. ``own``: only that agent's age and cap are applied
    (a sidecar applies its own settings to its own capture; the node's cap and the floor reach every agent);
    ``free_bytes``: free space on the file system (None: unknown, no floor)."""
    usages = list(usages)
    force = [h for h in holds if h.in_force(now)]
    out = Plan()
    gone: set[tuple[str, int]] = set()

    def held(s: Segment) -> bool:
        return any(h.covers(s) for h in force)

    def drop(s: Segment, why: str) -> int:
        gone.add((s.agent, s.seq))
        out.delete.append((s, why))
        return s.bytes

    for usage in usages:
        if own is not None and usage.agent != own:
            continue
        mine = policy
        total = usage.bytes
        for s in sorted(usage.sealed, key=lambda s: s.seq):
            if not held(s) and s.last_at < now - mine.keep_s:
                total -= drop(s, f"older than {mine.keep_s:.0f}s")
        for s in sorted(usage.sealed, key=lambda s: s.seq):
            if total + mine.reserve - usage.active_bytes <= mine.max_bytes:
                break
            if (s.agent, s.seq) not in gone and not held(s):
                total -= drop(s, f"agent {usage.agent} over its {mine.max_bytes} bytes")
        if total + mine.reserve - usage.active_bytes > mine.max_bytes:
            out.over.append(f"agent {usage.agent}: {total} bytes, held segments keep it over {mine.max_bytes}")

    left = sorted((s for u in usages for s in u.sealed if (s.agent, s.seq) not in gone),
                  key=lambda s: (s.last_at, s.agent, s.seq))
    node = sum(u.bytes for u in usages) - sum(s.bytes for s, _ in out.delete)
    free = None if free_bytes is None else free_bytes + sum(s.bytes for s, _ in out.delete)
    for s in left:
        over_node = node + policy.reserve > policy.node_max_bytes  # room for the writer's next segment here too
        under_floor = free is not None and free < policy.min_free_bytes
        if not (over_node or under_floor):
            break
        if held(s):
            continue
        size = drop(s, "node over its cap" if over_node else "disk under its free-space floor")
        node -= size
        if free is not None:
            free += size
    out.held = sum(1 for s in left if (s.agent, s.seq) not in gone and held(s))
    if node + policy.reserve > policy.node_max_bytes:
        out.over.append(f"node: {node} bytes, held segments keep it over {policy.node_max_bytes}")
    out.free_after, out.node_bytes_after = free, node
    out.low = free is not None and free < 2 * policy.min_free_bytes
    return out


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": KIB, "m": MIB, "g": GIB, "t": GIB << 10}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
_SECONDS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_size(text: str) -> int:
    """``500M``, ``2G``, ``1.5GiB``, ``65536``: bytes (powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise TetherError(f"{text!r} is not a size (say 500M, 2G, or bytes)", code=BAD_REQUEST)
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_duration(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``45s``, ``2w`` or seconds."""
    match = _DURATION.match(text)
    if not match:
        raise TetherError(f"{text!r} is not a duration (say 7d, 12h, 30m, or seconds)", code=BAD_REQUEST)
    return float(match.group(1)) * _SECONDS[match.group(2).lower()]


def size_text(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
