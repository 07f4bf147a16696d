"""The SQLite store's small documents by id (with CAS), sidecar runs and leases.

A mixin of ``SqliteStore`` (``tether/controlplane/store/sqlite.py``); moved out of it unchanged.
"""

from __future__ import annotations

import json

from .base import Doc
from .sqlite_core import (
    SqliteCore,
    _dump,
    _writes,
)


class SqliteDocs(SqliteCore):
    """Documents by id with compare-and-set, sidecar runs, leases."""

    # -- sidecars --------------------------------------------------------------------------------------
    @_writes
    async def put_sidecar(self, run_id: str, doc: Doc) -> None:
        self.db.execute("INSERT OR REPLACE INTO runs (run_id, doc) VALUES (?, ?)", (run_id, _dump(doc)))

    async def get_sidecar(self, run_id: str) -> Doc | None:
        row = self.db.execute("SELECT doc FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return json.loads(row[0]) if row else None

    async def all_sidecars(self) -> dict[str, Doc]:
        return {r[0]: json.loads(r[1]) for r in self.db.execute("SELECT run_id, doc FROM runs")}

    # -- documents -----------------------------------------------------------------------------------
    @_writes
    async def put_doc(self, kind: str, doc_id: str, doc: Doc) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO docs (kind, id, version, doc) VALUES (?, ?, ?, ?)",
            (kind, doc_id, int(doc.get("version", 0)), _dump(doc)),
        )

    async def get_doc(self, kind: str, doc_id: str) -> Doc | None:
        row = self.db.execute("SELECT doc FROM docs WHERE kind = ? AND id = ?", (kind, doc_id)).fetchone()
        return json.loads(row[0]) if row else None

    async def list_docs(self, kind: str) -> list[Doc]:
        return [
            json.loads(r[0]) for r in self.db.execute("SELECT doc FROM docs WHERE kind = ? ORDER BY rowid", (kind,))
        ]

    @_writes
    async def cas_doc(self, kind: str, doc_id: str, expect_version: int, doc: Doc) -> bool:
        with self._tx() as db:
            row = db.execute("SELECT version FROM docs WHERE kind = ? AND id = ?", (kind, doc_id)).fetchone()
            current = int(row[0]) if row else 0
            if current != expect_version:
                return False
            db.execute(
                "INSERT OR REPLACE INTO docs (kind, id, version, doc) VALUES (?, ?, ?, ?)",
                (kind, doc_id, int(doc["version"]), _dump(doc)),
            )
            return True

    # -- leases ---------------------------------------------------------------------------------------
    @_writes
    async def try_lease(self, name: str, owner: str, ttl_s: float, now: float) -> bool:
        with self._tx() as db:
            row = db.execute("SELECT owner, expires FROM leases WHERE name = ?", (name,)).fetchone()
            if row and row[0] != owner and row[1] > now:
                return False
            db.execute(
                "INSERT OR REPLACE INTO leases (name, owner, expires) VALUES (?, ?, ?)", (name, owner, now + ttl_s)
            )
            return True
