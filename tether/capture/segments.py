"""The capture on disk: segments, their indexes, holds, and reading flows back across all of them.

One agent's capture directory (``STATE_DIR/captures/``) holds:

- ``flows.mitm``: the active segment, mitmproxy's flow format, appended by the sidecar (``mitmproxy -r`` reads it);
- ``flows.000001.mitm.gz`` ... : sealed segments, in order, gzip-compressed once sealed (``flows.000001.mitm`` until
  then); each is a plain mitmproxy flow file inside the gzip;
- ``flows.000001.idx.json`` ... : a sealed segment's index: when it was opened and sealed, the first and last flow's
  start time, and the ids of the flows in it, so an export reads only the segments that hold what it wants;
- ``holds/TERMINATION_ID.json``: a termination's hold (tether/capture/retention.py's ``Hold``);
- ``metrics.prom``: the sidecar's capture gauges, in Prometheus' text format (a node exporter's textfile
  collector reads it).

A flow is written when its request is about to leave and again when it resolves, possibly into the next segment;
readers keep the last state per flow id, in segment order. ``capture_ref`` is ``flows.mitm#FLOW_ID``: the capture
(its name) and the flow, wherever in the capture's segments the flow now lies.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from .retention import Hold, Segment, Usage

if TYPE_CHECKING:
    from mitmproxy import http

log = logging.getLogger("tether.capture")
CAPTURE_FILE = "flows.mitm"
HOLDS = "holds"
METRICS_FILE = "metrics.prom"
_SEALED = re.compile(r"^(?P<stem>.+)\.(?P<seq>\d{6,})\.mitm(?P<gz>\.gz)?$")


def stem_of(active: Path) -> str:
    return active.name[:-len(".mitm")] if active.name.endswith(".mitm") else active.name


def sealed_name(active: Path, seq: int) -> Path:
    return active.with_name(f"{stem_of(active)}.{seq:06d}.mitm")


def index_path(segment: Path) -> Path:
    """``flows.000001.mitm[.gz]`` -> ``flows.000001.idx.json``."""
    name = segment.name.removesuffix(".gz").removesuffix(".mitm")
    return segment.with_name(f"{name}.idx.json")


@dataclass
class Index:
    """What a sealed segment holds, written when it is sealed."""

    seq: int
    opened_at: float
    sealed_at: float
    first_at: float | None  # the earliest flow start in it
    last_at: float | None  # the latest
    ids: list[str]

    def write(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> Index | None:
        try:
            doc = json.loads(path.read_text())
            return cls(int(doc["seq"]), float(doc["opened_at"]), float(doc["sealed_at"]), doc.get("first_at"),
                       doc.get("last_at"), list(doc.get("ids") or []))
        except (OSError, ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class SealedFile:
    path: Path
    seq: int
    compressed: bool
    index: Index | None

    @property
    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def segment(self, agent: str) -> Segment:
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            mtime = 0.0
        index = self.index
        opened = index.opened_at if index else mtime
        last = index.last_at if index and index.last_at is not None else (index.sealed_at if index else mtime)
        return Segment(agent, self.seq, self.size, opened, last, str(self.path))


def sealed(active: Path) -> list[SealedFile]:
    """The capture's sealed segments, oldest first (a segment both plain and compressed, mid-compression, is its
    plain file: the compressed one is not complete until the plain one is gone)."""
    stem = stem_of(active)
    found: dict[int, SealedFile] = {}
    try:
        names = os.listdir(active.parent)
    except OSError:
        return []
    for name in names:
        m = _SEALED.match(name)
        if not m or m.group("stem") != stem:
            continue
        seq, gz = int(m.group("seq")), bool(m.group("gz"))
        if seq in found and not found[seq].compressed:
            continue
        path = active.parent / name
        found[seq] = SealedFile(path, seq, gz, None)
    return [SealedFile(f.path, f.seq, f.compressed, Index.read(index_path(f.path))) for _, f in sorted(found.items())]


def next_seq(active: Path) -> int:
    files = sealed(active)
    return files[-1].seq + 1 if files else 1


def open_segment(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def read_file(path: Path) -> Iterator[http.HTTPFlow]:
    """Every HTTP flow state in one segment, in the order written; a torn tail (a crash mid-write, a compression
    cut short) ends it with a warning, keeping what came before."""
    from mitmproxy import http
    from mitmproxy import io as mio
    from mitmproxy.exceptions import FlowReadException

    try:
        f = open_segment(path)
    except FileNotFoundError:
        try:  # compressed since it was listed (the plain file goes once the compressed one is whole)
            f = open_segment(path.with_name(path.name + ".gz"))
        except FileNotFoundError:  # pruned while we looked: it held nothing a hold keeps
            return
    with f:
        try:
            for flow in mio.FlowReader(f).stream():
                if isinstance(flow, http.HTTPFlow):
                    yield flow
        except (FlowReadException, EOFError, OSError) as exc:
            log.warning("%s: %s (keeping the flows before it)", path, exc)


def read_flows(path: Path) -> list[http.HTTPFlow]:
    """The last state of every flow in one file, in first-seen order."""
    latest: dict[str, http.HTTPFlow] = {}
    for flow in read_file(path):
        latest[flow.id] = flow
    return list(latest.values())


def read_capture(active: Path, ids: set[str] | None = None, since: float | None = None,
                 until: float | None = None) -> list[http.HTTPFlow]:
    """The last state of every flow of a capture, across its sealed segments (compressed or not) and the active
    one: those named by ``ids`` (None: all), started within [since, until). A sealed segment whose index says it
    holds none of them is not opened."""
    latest: dict[str, http.HTTPFlow] = {}
    files = [(f.path, f.index) for f in sealed(active)] + [(active, None)]
    for path, index in files:
        if index is not None and not _may_hold(index, ids, since, until):
            continue
        for flow in read_file(path):
            if ids is not None and flow.id not in ids:
                continue
            at = flow.request.timestamp_start
            if (since is None or at >= since) and (until is None or at < until):
                latest[flow.id] = flow  # a later state replaces the earlier (its start time never changes)
    return sorted(latest.values(), key=lambda f: (f.request.timestamp_start, f.id))


def _may_hold(index: Index, ids: set[str] | None, since: float | None, until: float | None) -> bool:
    if ids is not None and ids.isdisjoint(index.ids):
        return False
    if index.first_at is None or index.last_at is None:
        return False  # an empty segment holds nothing
    if since is not None and index.last_at < since:
        return False
    return not (until is not None and index.first_at >= until)


def has_capture(captures: Path, name: str = CAPTURE_FILE) -> bool:
    active = captures / name
    return active.exists() or bool(sealed(active))


# -- holds ---------------------------------------------------------------------------------------------------------
def holds_dir(captures: Path) -> Path:
    return captures / HOLDS


def _hold_path(captures: Path, termination_id: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", termination_id)
    return holds_dir(captures) / f"{safe}.json"


def write_hold(captures: Path, hold: Hold) -> Path:
    """Write a termination's hold, once: a command seen again (every heartbeat while it stands) keeps the first
    hold as it was, so an agent that keeps calling after its termination cannot stretch what is held."""
    path = _hold_path(captures, hold.termination_id)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if read_hold(path) is not None:
        return path
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(hold)))
    os.replace(tmp, path)
    return path


def read_hold(path: Path) -> Hold | None:
    try:
        doc = json.loads(path.read_text())
        return Hold(str(doc["termination_id"]), str(doc["agent"]), float(doc["held_at"]),
                    float(doc["covers_until"]), float(doc["expires_at"]), doc.get("exported_at"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_holds(captures: Path) -> list[Hold]:
    try:
        names = sorted(os.listdir(holds_dir(captures)))
    except OSError:
        return []
    holds = [read_hold(holds_dir(captures) / n) for n in names if n.endswith(".json")]
    return [h for h in holds if h is not None]


def mark_exported(captures: Path, termination_id: str, at: float) -> bool:
    """The record's calls are exported: the hold no longer keeps them. False when there was no hold."""
    path = _hold_path(captures, termination_id)
    hold = read_hold(path)
    if hold is None:
        return False
    doc = {**asdict(hold), "exported_at": at}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
    return True


# -- a state root ------------------------------------------------------------------------------------------------
def agent_dirs(root: Path) -> list[Path]:
    """The state dirs under a state root that hold a capture."""
    try:
        children = sorted(root.iterdir())
    except OSError:
        return []
    return [d for d in children if d.is_dir() and has_capture(d / "captures")]


def usage(agent: str, active: Path) -> Usage:
    try:
        active_bytes = active.stat().st_size
    except OSError:
        active_bytes = 0
    return Usage(agent, tuple(f.segment(agent) for f in sealed(active)), active_bytes)


def node_usage(root: Path, own: tuple[str, Path] | None = None) -> tuple[list[Usage], list[Hold]]:
    """Every agent's captures under ``root`` (and ``own``: a sidecar's capture, wherever it is), with their holds."""
    usages: dict[str, Usage] = {}
    holds: list[Hold] = []
    places = [(d.name, d / "captures" / CAPTURE_FILE) for d in agent_dirs(root)]
    if own is not None:
        places = [p for p in places if p[0] != own[0]] + [own]
    for agent, active in places:
        usages[agent] = usage(agent, active)
        holds += [h for h in read_holds(active.parent) if h.agent == agent]
    return list(usages.values()), holds


def delete(segments: Iterable[Segment]) -> int:
    """Delete sealed segments and their indexes; returns the bytes freed. Gone already counts as done."""
    freed = 0
    for s in segments:
        path = Path(s.path)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            freed += s.bytes
        with contextlib.suppress(FileNotFoundError):
            index_path(path).unlink()
    return freed


def drop_released_holds(captures: Path, now: float) -> None:
    """Holds exported or expired keep nothing: their files go too."""
    for path in holds_dir(captures).glob("*.json") if holds_dir(captures).is_dir() else ():
        hold = read_hold(path)
        if hold is not None and not hold.in_force(now):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
