"""Call reports: batched to the control plane, written ahead to a spool on disk.

The spool (``STATE_DIR/reports.spool``, one JSON object a line) holds two kinds of line. A **start**
(``"event": "start"``) is written when a call is about to leave, before its first byte does; a **final**
report is written when the call resolves. Delivered finals are cut from the spool, and so are the starts
of calls that finished: what remains is what the control plane has not heard yet and what is still in
flight. A sidecar restarted on the same state dir therefore knows every call its predecessor started and
never finished, and reports each as ``unknown`` (it may have reached the tool; nobody can say what it
did). Starts travel to the control plane with the finals, in the same request, so it knows a call is in
flight within about a second even if the sidecar dies next.

Delivery is at least once; the control plane is idempotent on ``call_id``, so a repeat is harmless. A
flush delivers what was pending when it began, never more: an agent that keeps calling (each refusal is
a report) cannot keep a flush, and so a termination's acknowledgement, from returning.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tether.capability import errors as codes
from tether.capability.errors import ApiError, TetherError

from .channel import ControlChannel

if TYPE_CHECKING:
    from .state import Call

log = logging.getLogger("tether.sidecar.reports")
BATCH = 200
START = "start"
START_FIELDS = ("call_id", "agent", "capability", "tier", "method", "url", "started_at", "termination_id")
RESTARTED = "the sidecar restarted while the call was in flight; it may have reached the tool"


def recovered_final(start: dict[str, Any]) -> dict[str, Any]:
    """The final report of a call a previous sidecar run started and never finished.

    The start was written just before the call's first byte left, so something may have reached the tool:
    ``unknown``, with no end time (nobody saw it end)."""
    report = {name: start.get(name) for name in START_FIELDS}
    report.update(resolution="unknown", status=None, code=None, ended_at=None, capture_ref=None,
                  detail=RESTARTED)
    return report


STATE_DIR_LOCKED = "tether.state_dir_locked"


def lock_state_dir(state_dir: Path) -> IO[str]:
    """Take ``STATE_DIR/lock`` for this process, or refuse: one sidecar per state dir.

    Two sidecars on one spool would each deliver, compact and recover the other's calls (reporting a call
    still in flight next door as ``unknown``). The lock is the kernel's (flock): it goes when the process
    does, SIGKILL included, so a restarted sidecar never finds a stale one. Keep the returned file open."""
    path = state_dir / "lock"
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise TetherError(f"another sidecar (pid {holder}) is using the state dir {state_dir}: one sidecar per "
                          "state dir; stop that one first, or give this one its own --state-dir",
                          code=STATE_DIR_LOCKED) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


class Reporter:
    # A delivery costs the event loop a few milliseconds of aiohttp work, whatever its size: once a second
    # (or per full batch) keeps that off all but a few calls' latency. Terminations flush at once.
    def __init__(self, channel: ControlChannel, spool_path: Path, interval_s: float = 1.0) -> None:
        self.channel = channel
        self.spool_path = spool_path
        self.interval_s = interval_s
        self._lines: list[str] = []  # undelivered final reports, JSON-encoded as spooled and as delivered
        self._added = 0  # finals ever queued; with _delivered, says where a flush that began earlier stops
        self._delivered = 0  # finals delivered (always the oldest: cut from the front of _lines)
        self._starts: dict[str, str] = {}  # call_id -> spooled start line, for every call still in flight
        self._unsent: dict[str, str] = {}  # the starts the control plane has not been sent yet
        self._wake = asyncio.Event()
        self._spool_broken = False
        self._spool: IO[str] | None = None
        self._flushing = asyncio.Lock()
        self._urgent = 0  # acknowledgements waiting to flush
        self.recovered = 0
        self._load()

    def _load(self) -> None:
        if not self.spool_path.exists():
            return
        finals: list[str] = []
        final_ids: set[str] = set()
        starts: dict[str, dict[str, Any]] = {}
        for line in self.spool_path.read_text().splitlines():
            try:
                doc = json.loads(line)
                call_id = doc["call_id"]
            except (ValueError, TypeError, KeyError):
                if line.strip():
                    log.warning("skipping a torn line in %s", self.spool_path)
                continue
            why = self._undeliverable(doc)
            if why:  # delivered it would be refused, and hold back every report behind it
                self._quarantine(line, why)
                continue
            if doc.get("event") == START:
                starts.setdefault(call_id, doc)
            elif call_id not in final_ids:
                final_ids.add(call_id)
                finals.append(line)
        lost = [start for call_id, start in starts.items() if call_id not in final_ids]
        for start in lost:
            finals.append(json.dumps(recovered_final(start), separators=(",", ":")))
            log.warning("call %s (%s %s) was in flight when the last sidecar run ended: reported as unknown",
                        start["call_id"], start.get("method"), start.get("url"))
        self._lines = finals
        self._added = len(finals)
        self.recovered = len(lost)
        if finals:
            log.info("%d report(s) from the spool will be delivered", len(finals))
        if lost or len(starts):
            self._rewrite_spool()  # the recovered finals replace their starts on disk before anything else

    def _undeliverable(self, doc: Any) -> str | None:
        """Why the control plane would refuse this spooled line (as its report reader does), or None."""
        if not isinstance(doc, dict):
            return "not an object"
        call_id = doc.get("call_id")
        if not isinstance(call_id, str) or not 0 < len(call_id) <= 200:
            return "no call_id of 1-200 characters"
        if doc.get("agent", self.channel.agent) != self.channel.agent:
            return f"a call of another agent ({str(doc.get('agent'))[:64]!r}: a state dir reused across agents?)"
        return None

    def _quarantine(self, line: str, why: str) -> None:
        """Keep a report the control plane refuses beside the spool (``reports.rejected``), never deliver it
        again, and say so: it must not hold back the reports behind it, and it is not silently lost."""
        log.error("a spooled report cannot be delivered (%s); kept in %s", why, self.rejected_path)
        try:
            with open(self.rejected_path, "a") as f:
                f.write(line + "\n")
        except OSError as exc:
            log.error("cannot keep the rejected report in %s: %s; it was: %s", self.rejected_path, exc, line[:2000])

    @property
    def rejected_path(self) -> Path:
        return self.spool_path.with_name(self.spool_path.name + ".rejected")

    @property
    def pending(self) -> list[dict[str, Any]]:
        """The undelivered reports (decoded: for a termination's acknowledgement, not the hot path)."""
        return [json.loads(line) for line in self._lines]

    def pending_until(self, mark: int) -> list[dict[str, Any]]:
        """The reports queued before ``mark`` (see ``mark``) that are not delivered yet."""
        return [json.loads(line) for line in self._lines[:max(0, mark - self._delivered)]]

    def mark(self) -> int:
        """A position in the stream of reports: ``flush(mark)`` delivers what was queued before it."""
        return self._added

    @property
    def count(self) -> int:
        return len(self._lines)

    @property
    def inflight(self) -> int:
        """Calls whose start is spooled and whose final is not."""
        return len(self._starts)

    def start(self, call: Call) -> bool:
        """Write ahead: spool a call's start before its first byte leaves, and queue it for the control plane.
        False when the spool cannot take it (a full disk): the caller refuses the call rather than send it
        with no trace that would survive a crash."""
        if call.call_id in self._starts:
            return True
        line = json.dumps({"event": START, **{name: getattr(call, name) for name in START_FIELDS}},
                          separators=(",", ":"))
        if not self._spool_line(line):
            return False
        self._starts[call.call_id] = self._unsent[call.call_id] = line
        return True

    def add(self, report: dict[str, Any]) -> None:
        """Spool a final report (before anything else) and queue it for the next batch."""
        line = json.dumps(report, separators=(",", ":"))
        self._lines.append(line)
        self._added += 1
        call_id = report.get("call_id")
        self._starts.pop(call_id, None)  # type: ignore[arg-type]
        self._unsent.pop(call_id, None)  # type: ignore[arg-type]  (a final supersedes its start: not sent)
        self._spool_line(line)
        if len(self._lines) >= BATCH:
            self._wake.set()  # a full batch goes now; smaller ones wait for the interval

    def _spool_line(self, line: str) -> bool:
        """Append a line; False when it could not be written (a final report is then kept in memory and
        delivered from there; a start refuses its call)."""
        try:
            if self._spool is None:
                self._spool = self._open_spool()
            self._spool.write(line + "\n")
            self._spool.flush()
            self._spool_broken = False
            return True
        except OSError as exc:  # a full disk affects the spool and the calls that need it, never the sidecar
            if not self._spool_broken:
                log.error("cannot spool reports to %s: %s (finals kept in memory; new calls refused with %s)",
                          self.spool_path, exc, codes.SPOOL_UNAVAILABLE)
            self._spool_broken = True
            self._close_spool()
            return False

    def _open_spool(self) -> IO[str]:
        spool = open(self.spool_path, "a")
        # A write cut short (a full disk) may have left a line without its newline: end it, so the next line
        # is a line of its own and only the torn one is lost.
        if spool.tell() > 0:
            with open(self.spool_path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    spool.write("\n")
        return spool

    def _close_spool(self) -> None:
        if self._spool is not None:
            try:
                self._spool.close()
            except OSError:
                pass
            self._spool = None

    def _rewrite_spool(self) -> None:
        """Compact the spool to what it must still hold: the starts of calls in flight and the undelivered
        finals. Emptied in place when that is nothing (the usual case under a reachable control plane
        between bursts), else replaced atomically."""
        try:
            if not self._lines and not self._starts and self._spool is not None:
                self._spool.truncate(0)
                return
            self._close_spool()
            tmp = self.spool_path.with_suffix(".tmp")
            with open(tmp, "w") as f:
                f.writelines(line + "\n" for line in (*self._starts.values(), *self._lines))
            os.replace(tmp, self.spool_path)
        except OSError as exc:
            log.error("cannot rewrite the spool %s: %s", self.spool_path, exc)
            self._close_spool()

    async def flush(self, mark: int | None = None, batch: int = BATCH, background: bool = False) -> bool:
        """Deliver the reports queued before ``mark`` (default: now) and the starts not sent yet; True when
        all of those are delivered. Reports queued meanwhile wait for the next flush. One delivery at a time:
        the loop, a termination's acknowledgement and the goodbye may all flush, and each removes what it
        sent. ``batch``: reports per request (a termination's acknowledgement sends bigger ones: on a slow
        link each request costs its round trips, whatever its size). ``background``: the periodic delivery,
        which stops between requests when an acknowledgement waits to flush (it returns True then: the rest
        goes on its next round)."""
        target = self._added if mark is None else mark
        urgent = mark is not None  # an acknowledgement: the background delivery yields to it between batches
        self._urgent += urgent
        try:
            async with self._flushing:
                return await self._flush(target, batch, background)
        finally:
            self._urgent -= urgent

    async def _flush(self, target: int, size: int = BATCH, background: bool = False) -> bool:
        while True:
            batch = self._lines[:max(0, min(size, target - self._delivered))]
            starts = list(self._unsent.items())
            if not batch and not starts:
                return True
            try:
                await self.channel.reports(batch, [line for _, line in starts])
            except ApiError as exc:
                if exc.http_status not in (400, 403):  # unreachable, unavailable, a proof out of time: retry
                    log.debug("report delivery failed: %s", exc)
                    return False
                # The control plane refuses the batch for something in it: deliver line by line, so one bad
                # line cannot hold back the rest forever; the ones it refuses are kept aside.
                if not await self._deliver_one_by_one(batch, starts):
                    return False
                if self._delivered >= target:
                    return True
                continue
            for call_id, _ in starts:
                self._unsent.pop(call_id, None)
            if batch:
                self._cut(len(batch))
            if self._delivered >= target:
                return True
            if background and self._urgent:  # an acknowledgement waits: let it go first, the rest follows
                return True

    def _cut(self, n: int) -> None:
        """The oldest ``n`` finals are delivered (or kept aside): off the queue and the spool."""
        del self._lines[:n]
        self._delivered += n
        self._rewrite_spool()

    async def _deliver_one_by_one(self, batch: list[str], starts: list[tuple[str, str]]) -> bool:
        """Deliver a refused batch line by line. A line is kept aside only when the control plane takes other
        lines of the same batch: if it refuses every one, the fault is not in the lines (a sidecar and a
        control plane of different versions, say) and they all stay queued, to be retried."""
        refused: list[tuple[str, ApiError]] = []
        delivered = 0
        for line in batch:
            try:
                await self.channel.reports([line], [])
                delivered += 1
            except ApiError as exc:
                if exc.http_status not in (400, 403):
                    return False
                refused.append((line, exc))
        if batch and not delivered:
            log.error("the control plane refuses every report (%s); they stay in the spool", refused[0][1].message)
            return False
        for line, exc in refused:
            self._quarantine(line, f"{exc.code}: {exc.message}")
        for call_id, line in starts:
            try:
                await self.channel.reports([], [line])
            except ApiError as exc:
                if exc.http_status not in (400, 403):
                    return False
                log.error("the control plane refuses the start of call %s: %s", call_id, exc.message)
            self._unsent.pop(call_id, None)
        self._cut(len(batch))
        return True

    async def run(self) -> None:
        attempt = 0
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=min(self.interval_s * (1 + attempt), 5.0))
            except TimeoutError:
                pass
            self._wake.clear()
            if self._lines or self._unsent:
                attempt = 0 if await self.flush(background=True) else attempt + 1
