"""Call reports: batched to the control plane, spooled to disk while it is unreachable.

Every final call report is appended to the spool file before anything else, so a control plane
outage (or a sidecar restart) loses nothing; delivered batches are cut from the spool. Delivery is
at least once; the control plane is idempotent on ``call_id``, so a repeat is harmless.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import IO, Any

from controlplane.capability.errors import ApiError

from .channel import ControlChannel

log = logging.getLogger("tether.sidecar.reports")
BATCH = 200


class Reporter:
    # A delivery costs the event loop a few milliseconds of aiohttp work, whatever its size: once a second
    # (or per full batch) keeps that off all but a few calls' latency. Terminations flush at once.
    def __init__(self, channel: ControlChannel, spool_path: Path, interval_s: float = 1.0) -> None:
        self.channel = channel
        self.spool_path = spool_path
        self.interval_s = interval_s
        self._lines: list[str] = []  # undelivered reports, JSON-encoded as spooled and as delivered
        self._wake = asyncio.Event()
        self._spool_broken = False
        self._spool: IO[str] | None = None
        self._flushing = asyncio.Lock()
        self._load()

    def _load(self) -> None:
        if not self.spool_path.exists():
            return
        for line in self.spool_path.read_text().splitlines():
            try:
                json.loads(line)
            except ValueError:
                log.warning("skipping a torn line in %s", self.spool_path)
                continue
            self._lines.append(line)
        if self._lines:
            log.info("%d report(s) from the spool will be delivered", len(self._lines))

    @property
    def pending(self) -> list[dict[str, Any]]:
        """The undelivered reports (decoded: for a termination's acknowledgement, not the hot path)."""
        return [json.loads(line) for line in self._lines]

    @property
    def count(self) -> int:
        return len(self._lines)

    def add(self, report: dict[str, Any]) -> None:
        """Spool a final report (before anything else) and queue it for the next batch."""
        line = json.dumps(report, separators=(",", ":"))
        self._lines.append(line)
        try:
            if self._spool is None:
                self._spool = open(self.spool_path, "a")
            self._spool.write(line + "\n")
            self._spool.flush()
            self._spool_broken = False
        except OSError as exc:  # a full disk affects the spool, never the calls
            if not self._spool_broken:
                log.error("cannot spool reports to %s: %s (kept in memory)", self.spool_path, exc)
            self._spool_broken = True
            self._close_spool()
        if len(self._lines) >= BATCH:
            self._wake.set()  # a full batch goes now; smaller ones wait for the interval

    def _close_spool(self) -> None:
        if self._spool is not None:
            try:
                self._spool.close()
            except OSError:
                pass
            self._spool = None

    def _rewrite_spool(self) -> None:
        """Cut delivered reports from the spool: emptied in place when nothing is left (the usual case under
        a reachable control plane), else replaced atomically by what is still pending."""
        try:
            if not self._lines and self._spool is not None:
                self._spool.truncate(0)
                return
            self._close_spool()
            tmp = self.spool_path.with_suffix(".tmp")
            with open(tmp, "w") as f:
                f.writelines(line + "\n" for line in self._lines)
            os.replace(tmp, self.spool_path)
        except OSError as exc:
            log.error("cannot rewrite the spool %s: %s", self.spool_path, exc)
            self._close_spool()

    async def flush(self) -> bool:
        """Deliver everything pending; True when nothing is left. One delivery at a time: the loop, a
        termination's acknowledgement and the goodbye may all flush, and each removes what it sent."""
        async with self._flushing:
            return await self._flush()

    async def _flush(self) -> bool:
        while self._lines:
            batch = self._lines[:BATCH]
            try:
                await self.channel.reports(batch)
            except ApiError as exc:
                log.debug("report delivery failed: %s", exc)
                return False
            del self._lines[: len(batch)]
            self._rewrite_spool()
        return True

    async def run(self) -> None:
        attempt = 0
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=min(self.interval_s * (1 + attempt), 5.0))
            except TimeoutError:
                pass
            self._wake.clear()
            if self._lines:
                attempt = 0 if await self.flush() else attempt + 1
