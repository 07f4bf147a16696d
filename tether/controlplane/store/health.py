"""Whether the store takes writes: the outcome of the last write it tried, and how often to probe. Pure.

A store can answer every read and refuse every write: a full disk or a read-only file system under SQLite,
a Redis past its ``maxmemory`` (``noeviction``), refusing writes after a failed background save, or short of
the replicas ``min-replicas-to-write`` asks for. Reads still answering, a ping-style health check says "ok"
while every write fails; ``/healthz`` must say what the API would do with a write.

The verdict is the newest outcome: a write the API tried (every write method reports how it went) or the
small write ``/healthz`` makes at most every ``PROBE_EVERY_S`` (a heartbeat row or key). The store is
unwritable from the first refused write until a later write succeeds. The caller passes the time (a
monotonic clock: a stepped wall clock must not stop or hurry the probes).
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE_EVERY_S = 2.0


@dataclass
class WriteHealth:
    probe_every_s: float = PROBE_EVERY_S
    failed_at: float | None = None
    reason: str = ""
    succeeded_at: float | None = None
    probed_at: float | None = None

    def failed(self, now: float, reason: str) -> bool:
        """A write was refused; True when that turns the store unwritable (the moment to log it)."""
        was = self.writable
        self.failed_at, self.reason = now, reason
        return was

    def succeeded(self, now: float) -> bool:
        """A write went through; True when that makes an unwritable store writable again."""
        was = self.writable
        self.succeeded_at = max(now, self.succeeded_at or now)
        return not was and self.writable

    @property
    def writable(self) -> bool:
        """True until a write is refused, then False until a later write succeeds."""
        if self.failed_at is None:
            return True
        return self.succeeded_at is not None and self.succeeded_at >= self.failed_at

    def probe_due(self, now: float) -> bool:
        return self.probed_at is None or now - self.probed_at >= self.probe_every_s

    def probing(self, now: float) -> None:
        self.probed_at = now
