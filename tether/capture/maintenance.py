"""Keeping captures within their policy: compress sealed segments, index what has no index, apply ``plan()``'s
deletions, write the capture gauges. The sidecar runs ``maintain`` in its own thread after each rotation and at
least every ``MAINTAIN_EVERY_S`` while it writes; ``tether capture prune`` runs it once over a state root.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .retention import Plan, Policy, plan, size_text
from .segments import (
    METRICS_FILE,
    Index,
    delete,
    drop_released_holds,
    free_bytes,
    index_path,
    node_usage,
    read_file,
    sealed,
)

log = logging.getLogger("tether.capture")
MAINTAIN_EVERY_S = 30.0
NODE_LOCK = ".capture-prune.lock"
TIDY_LOCK = ".tidy.lock"


def compress(path: Path) -> Path:
    """Compress one sealed segment: written aside, renamed into place, then the plain file removed, so a reader
    sees one complete file at every moment (``sealed`` prefers the plain file while both exist)."""
    target = path.with_name(path.name + ".gz")
    tmp = path.with_name(path.name + ".gz.tmp")
    with open(path, "rb") as src, open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6,
                                                                           mtime=0) as out:
        os.fchmod(raw.fileno(), 0o600)
        shutil.copyfileobj(src, out, 1 << 20)
    os.replace(tmp, target)
    path.unlink()
    return target


def build_index(path: Path, seq: int) -> Index:
    """The index of a segment sealed without one (left by a sidecar that crashed), read from its flows."""
    ids: dict[str, None] = {}
    first = last = None
    created = None
    for flow in read_file(path):
        ids[flow.id] = None
        at = flow.request.timestamp_start
        first = at if first is None else min(first, at)
        last = at if last is None else max(last, at)
        created = flow.timestamp_created if created is None else min(created, flow.timestamp_created)
    mtime = path.stat().st_mtime
    return Index(seq, created if created is not None else mtime, mtime, first, last, list(ids))


def tidy(active: Path, compress_sealed: bool) -> None:
    """Index and compress the capture's sealed segments that need it; remove compressions left half done. One
    tidier per capture at a time (the sidecar's thread, ``tether capture prune``): a ``.gz.tmp`` seen while holding
    the capture's lock is one a process that died left."""
    if not active.parent.is_dir():
        return
    with _locked(active.parent / TIDY_LOCK):
        _tidy(active, compress_sealed)


def _tidy(active: Path, compress_sealed: bool) -> None:
    for stale in active.parent.glob(f"{active.name.removesuffix('.mitm')}.*.gz.tmp"):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    for f in sealed(active):
        try:
            if f.index is None:
                build_index(f.path, f.seq).write(index_path(f.path))
            if compress_sealed and not f.compressed:
                compress(f.path)
        except FileNotFoundError:
            continue  # pruned meanwhile
        except OSError as exc:  # a full disk: compression waits for the next round, the plain segment stays
            log.warning("cannot compress capture segment %s: %s", f.path, exc)


def node_lock(root: Path) -> contextlib.AbstractContextManager[None]:
    """One pruner at a time over a state root (sidecars and ``tether capture prune`` alike)."""
    return _locked(root / NODE_LOCK)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield  # a root we cannot write: the pruner's own deletions still suffer no race worse than "gone already"
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass
class Outcome:
    """One maintenance round: what the plan said, and what was freed."""

    plan: Plan
    freed: int = 0
    agent_bytes: dict[str, int] = field(default_factory=dict)
    segments: dict[str, int] = field(default_factory=dict)


def prune(root: Path, policy: Policy, now: float, *, own: tuple[str, Path] | None = None,
          dry_run: bool = False) -> Outcome:
    """Apply the retention policy to every capture under ``root`` (and ``own``, a sidecar's capture)."""
    with node_lock(root) if root.is_dir() else contextlib.nullcontext():
        usages, holds = node_usage(root, own)
        free = free_bytes(own[1].parent if own else root)
        decided = plan(usages, holds, policy, now, own=own[0] if own else None, free_bytes=free)
        freed = 0 if dry_run else delete(s for s, _ in decided.delete)
        if not dry_run:
            places = {u.agent: root / u.agent / "captures" for u in usages}
            if own is not None:
                places[own[0]] = own[1].parent
            for captures in places.values():
                drop_released_holds(captures, now)
    gone = {(s.agent, s.seq) for s, _ in decided.delete}
    out = Outcome(decided, freed)
    for u in usages:
        kept = [s for s in u.sealed if (u.agent, s.seq) not in gone]
        out.agent_bytes[u.agent] = u.active_bytes + sum(s.bytes for s in kept)
        out.segments[u.agent] = len(kept) + (1 if u.active_bytes else 0)
    return out


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


GAUGES = {
    "tether_capture_bytes": "Bytes of this agent's capture on disk, every segment counted.",
    "tether_capture_segments": "Segments of this agent's capture (sealed and active).",
    "tether_capture_held_segments": "Segments under the state root kept by a termination's hold.",
    "tether_capture_node_bytes": "Bytes of every agent's capture under the state root.",
    "tether_capture_disk_free_bytes": "Free bytes on the capture's file system.",
    "tether_capture_disk_low": "1 while free space is under twice the floor (--capture-min-free): captures are "
                               "pruned harder, and calls are refused tether.capture_unavailable once the disk is full.",
    "tether_capture_pruned_bytes_total": "Bytes of sealed segments this sidecar deleted.",
    "tether_capture_written_bytes_total": "Bytes of flows this sidecar appended to its capture, every segment.",
    "tether_capture_failures_total": "Capture writes that failed (each refused its call unless --allow-uncaptured).",
}


def metrics_text(agent: str, values: dict[str, float]) -> str:
    lines: list[str] = []
    for name, text in GAUGES.items():
        if name not in values:
            continue
        kind = "counter" if name.endswith("_total") else "gauge"
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f'{name}{{agent="{_label(agent)}"}} '
                  f"{values[name]:.0f}"]
    return "\n".join(lines) + "\n"


def write_metrics(captures: Path, agent: str, values: dict[str, float]) -> None:
    path = captures / METRICS_FILE
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(OSError):  # a full disk: the gauges wait for room, the log line has said it
        tmp.write_text(metrics_text(agent, values))
        os.replace(tmp, path)


class Watch:
    """Whether the disk was low at the last round: a log line when that changes, not at every round."""

    def __init__(self) -> None:
        self.low = False
        self.over: tuple[str, ...] = ()

    def observe(self, outcome: Outcome, captures: Path, policy: Policy) -> None:
        decided = outcome.plan
        if decided.low and not self.low:
            log.warning("capture disk low: %s free on %s (floor %s, --capture-min-free); pruning unheld segments; "
                        "calls are refused tether.capture_unavailable if it fills",
                        size_text(decided.free_after or 0), captures, size_text(policy.min_free_bytes))
        elif self.low and not decided.low:
            log.info("capture disk no longer low: %s free on %s", size_text(decided.free_after or 0), captures)
        if tuple(decided.over) != self.over and decided.over:
            log.warning("capture retention: %s (held until exported with tether capture export --termination, "
                        "or until the hold ends)", "; ".join(decided.over))
        self.low, self.over = decided.low, tuple(decided.over)
        for s, why in decided.delete:
            log.info("capture segment %s deleted: %s", s.path, why)
