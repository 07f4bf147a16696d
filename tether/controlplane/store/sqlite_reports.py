"""The SQLite store's call reports and call starts.

A mixin of ``SqliteStore`` (``tether/controlplane/store/sqlite.py``); moved out of it unchanged.
"""

from __future__ import annotations

import json
import sqlite3

from ..termination import entry_text
from .base import Doc, Stored
from .sqlite_core import (
    SqliteCore,
    _dump,
    _writes,
)


class SqliteReports(SqliteCore):
    """Call reports (with their entry text) and call starts."""

    # -- reports ---------------------------------------------------------------------------------------
    @_writes
    async def put_reports(self, reports: list[Doc]) -> Stored:
        with self._tx() as db:
            new: set[str] = set()
            loose: dict[str, tuple[str, int]] = {}
            for report in reports:
                # Beside the report, its entry in a record (so a record is written without encoding a call).
                cur = db.execute(
                    "INSERT OR IGNORE INTO reports (call_id, agent, doc, started, link, entry) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (report["call_id"], report["agent"], _dump(report), report.get("started_at") or 0,
                     report.get("link"), entry_text(report)),
                )
                if cur.rowcount:
                    new.add(report["call_id"])
                    if report.get("link"):
                        loose[report["link"]] = (report["agent"], loose.get(report["link"], ("", 0))[1] + 1)
            # How many reports of each link no segment holds yet (what the sealer looks for: services/segments.py).
            db.executemany("INSERT INTO chains (link, agent, seq, head, count, loose) VALUES (?, ?, 0, '', 0, ?) "
                           "ON CONFLICT (link) DO UPDATE SET loose = loose + excluded.loose",
                           [(link, agent, n) for link, (agent, n) in loose.items()])
            # Only the reporting agent's own start is moot (a call id named by another agent deletes nothing).
            db.executemany("DELETE FROM starts WHERE call_id = ? AND agent = ?",
                           [(r["call_id"], r["agent"]) for r in reports])
            return Stored(new, len(reports))

    async def reports(self, agents: list[str] | None = None) -> list[Doc]:
        def read(db: sqlite3.Connection) -> list[Doc]:
            if agents is None:
                rows = db.execute("SELECT doc FROM reports ORDER BY rowid")
            else:
                marks = ",".join("?" * len(agents))
                rows = db.execute(f"SELECT doc FROM reports WHERE agent IN ({marks}) ORDER BY rowid", agents)
            return [json.loads(r[0]) for r in rows]

        return await self._off_loop(read)

    @_writes
    async def put_starts(self, starts: list[Doc]) -> None:
        with self._tx() as db:
            for start in starts:
                # A start whose final report is already here is moot: never store it.
                if db.execute("SELECT 1 FROM reports WHERE call_id = ?", (start["call_id"],)).fetchone() is None:
                    db.execute("INSERT OR IGNORE INTO starts (call_id, agent, doc) VALUES (?, ?, ?)",
                               (start["call_id"], start["agent"], _dump(start)))

    async def starts(self, agents: list[str]) -> list[Doc]:
        marks = ",".join("?" * len(agents))

        def read(db: sqlite3.Connection) -> list[Doc]:
            rows = db.execute(f"SELECT doc FROM starts WHERE agent IN ({marks}) ORDER BY rowid", agents)
            return [json.loads(r[0]) for r in rows]

        return await self._off_loop(read)

    async def reports_among(self, call_ids: list[str]) -> list[Doc]:
        def read(db: sqlite3.Connection) -> list[Doc]:
            out: list[Doc] = []
            for part in range(0, len(call_ids), 500):
                ids = call_ids[part:part + 500]
                marks = ",".join("?" * len(ids))
                rows = db.execute(f"SELECT doc FROM reports WHERE call_id IN ({marks})", ids)
                out += [json.loads(r[0]) for r in rows]
            return out

        return await self._off_loop(read) if call_ids else []
