"""The embedded store: one SQLite file in WAL mode, durable across restarts.

Most statements are short and local, so they run on the event loop thread; every write is its own
transaction, committed before the API answers. The few whose size grows with a termination (its
reports, the records) run in worker threads, each with a connection of its own: WAL lets them read while
the loop writes. A record is stored as a header row and one row per call entry, staged a page at a time
(1,000 rows per transaction) before the header is appended, so the loop's writers never wait on the lock
for more than one such insert, whatever the record's size. A report keeps its entry text beside it (column
``entry``); a row staged from it refers to that text (an empty ``entry``) instead of copying it.

A file that cannot take a write (a full disk, a read-only file system) raises ``StoreUnwritable`` with the
reason, never an internal error, and ``/healthz`` says so until a write succeeds again
(``tether/controlplane/store/health.py``). A failed write is one rolled-back transaction: nothing half-written.
"""


from __future__ import annotations

import json

from .base import Doc, Event
from .sqlite_budgets import SqliteBudgets
from .sqlite_core import (
    _dump,
    _writes,
)
from .sqlite_docs import SqliteDocs
from .sqlite_links import SqliteLinks
from .sqlite_records import SqliteRecords
from .sqlite_reports import SqliteReports
from .sqlite_segments import SqliteSegments

EVENT_RETENTION = 10_000


class SqliteStore(SqliteLinks, SqliteReports, SqliteRecords, SqliteSegments, SqliteDocs, SqliteBudgets):
    """The embedded store, composed of one mixin per concern. The event log stays here, beside
    ``EVENT_RETENTION`` (tests set it on this module)."""

    # -- events ----------------------------------------------------------------------------------------
    @_writes
    async def append_event(self, kind: str, target: str | None, payload: Doc, at: float) -> int:
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO events (kind, target, payload, at) VALUES (?, ?, ?, ?)", (kind, target, _dump(payload), at)
            )
            seq = int(cur.lastrowid or 0)
            db.execute("DELETE FROM events WHERE seq <= ?", (seq - EVENT_RETENTION,))
            return seq

    async def events_after(self, seq: int, limit: int = 500) -> list[Event]:
        rows = self.db.execute(
            "SELECT seq, kind, target, payload, at FROM events WHERE seq > ? ORDER BY seq LIMIT ?", (seq, limit)
        )
        return [Event(r[0], r[1], r[2], json.loads(r[3]), r[4]) for r in rows]

    async def event_bounds(self) -> tuple[int, int]:
        low, high = self.db.execute("SELECT MIN(seq), MAX(seq) FROM events").fetchone()
        if high is None:
            row = self.db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'events'").fetchone()
            last = int(row[0]) if row else 0
            return (last + 1, last)
        return (int(low), int(high))
