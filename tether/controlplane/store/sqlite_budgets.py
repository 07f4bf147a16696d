"""The SQLite store's budget slices and counters.

A mixin of ``SqliteStore`` (``tether/controlplane/store/sqlite.py``); moved out of it unchanged.
"""

from __future__ import annotations

import json

from tether.capability.budget import slice_size

from .base import Doc
from .sqlite_core import (
    SqliteCore,
    _dump,
    _writes,
)


class SqliteBudgets(SqliteCore):
    """Budget slices and the counters they are taken from."""

    # -- budgets ----------------------------------------------------------------------------------------
    @_writes
    async def take_slice(self, slice_doc: Doc, counters: list[tuple[str, int]], want: int, fraction: float,
                         ttl_s: float = 0) -> tuple[int, int | None]:
        with self._tx() as db:  # BEGIN IMMEDIATE: one writer at a time, so no two slices see the same remainder
            row = db.execute("SELECT doc FROM slices WHERE id = ?", (slice_doc["id"],)).fetchone()
            if row is not None:
                return int(json.loads(row[0])["n"]), None
            left: list[int] = []
            for key, limit in counters:
                got = db.execute("SELECT used, leased FROM budgets WHERE key = ?", (key,)).fetchone()
                left.append(limit - (got[0] + got[1] if got else 0))
            granted = slice_size(want, left, fraction)
            if granted <= 0:
                return 0, min(range(len(left)), key=lambda i: left[i])
            for key, _limit in counters:
                db.execute("INSERT INTO budgets (key, used, leased) VALUES (?, 0, ?) "
                           "ON CONFLICT(key) DO UPDATE SET leased = leased + excluded.leased", (key, granted))
            doc = {**slice_doc, "n": granted, "state": "open", "keys": [k for k, _ in counters]}
            db.execute("INSERT INTO slices (id, open, doc) VALUES (?, 1, ?)", (doc["id"], _dump(doc)))
            return granted, None

    @_writes
    async def settle_slice(self, slice_id: str, used: int, at: float) -> Doc | None:
        with self._tx() as db:
            row = db.execute("SELECT doc FROM slices WHERE id = ? AND open = 1", (slice_id,)).fetchone()
            if row is None:
                return None
            doc = json.loads(row[0])
            spent = max(0, min(int(used), int(doc["n"])))
            for key in doc["keys"]:
                db.execute("UPDATE budgets SET leased = leased - ?, used = used + ? WHERE key = ?",
                           (doc["n"], spent, key))
            doc.update(state="settled", used=spent, settled_at=at)
            db.execute("UPDATE slices SET open = 0, doc = ? WHERE id = ?", (_dump(doc), slice_id))
            return doc

    async def open_slices(self) -> list[Doc]:
        return [json.loads(r[0]) for r in self.db.execute("SELECT doc FROM slices WHERE open = 1 ORDER BY rowid")]

    async def budget_counts(self, counters: list[str]) -> dict[str, tuple[int, int]]:
        out = dict.fromkeys(counters, (0, 0))
        for start in range(0, len(counters), 500):
            part = counters[start:start + 500]
            marks = ",".join("?" * len(part))
            for key, used, leased in self.db.execute(
                    f"SELECT key, used, leased FROM budgets WHERE key IN ({marks})", part):
                out[key] = (int(used), int(leased))
        return out
