"""The SQLite store's grant links, revocations and one-time tokens.

A mixin of ``SqliteStore`` (``tether/controlplane/store/sqlite.py``); moved out of it unchanged.
"""

from __future__ import annotations

import json

from .base import Doc, LinkConflict
from .sqlite_core import (
    SqliteCore,
    _dump,
    _writes,
)


class SqliteLinks(SqliteCore):
    """Grant links (the agent graph's edges), revocations, one-time tokens."""

    # -- links ---------------------------------------------------------------------------------------
    @_writes
    async def put_links(self, links: list[Doc]) -> int:
        with self._tx() as db:
            new = 0
            for link in links:
                row = db.execute("SELECT hash FROM links WHERE jti = ?", (link["jti"],)).fetchone()
                if row is not None and row[0] != link["hash"]:
                    raise LinkConflict(link["jti"], row[0])
                cur = db.execute(
                    "INSERT OR IGNORE INTO links (hash, jti, sub, prf, doc) VALUES (?, ?, ?, ?, ?)",
                    (link["hash"], link["jti"], link["sub"], link.get("prf"), _dump(link)),
                )
                new += cur.rowcount
            return new

    async def get_link(self, link_hash: str) -> Doc | None:
        row = self.db.execute("SELECT doc FROM links WHERE hash = ?", (link_hash,)).fetchone()
        return json.loads(row[0]) if row else None

    async def link_by_jti(self, jti: str) -> Doc | None:
        row = self.db.execute("SELECT doc FROM links WHERE jti = ?", (jti,)).fetchone()
        return json.loads(row[0]) if row else None

    async def jtis_beginning(self, prefix: str, limit: int = 21) -> list[str]:
        # A range over the unique jti index (jtis are lower-case hex: prefix + "g" sorts after every extension)
        return [r[0] for r in self.db.execute("SELECT jti FROM links WHERE jti >= ? AND jti < ? ORDER BY jti LIMIT ?",
                                              (prefix, prefix + "g", limit))]

    async def all_links(self) -> list[Doc]:
        return [json.loads(r[0]) for r in self.db.execute("SELECT doc FROM links ORDER BY rowid")]

    async def links_held_by(self, agent: str) -> list[Doc]:
        return [json.loads(r[0]) for r in self.db.execute("SELECT doc FROM links WHERE sub = ? ORDER BY rowid",
                                                          (agent,))]

    async def descendants(self, link_hash: str) -> dict[str, str]:
        rows = self.db.execute(
            "WITH RECURSIVE below(hash) AS (SELECT hash FROM links WHERE prf = ? "
            "UNION SELECT links.hash FROM links JOIN below ON links.prf = below.hash) "
            "SELECT links.hash, links.sub FROM links JOIN below ON links.hash = below.hash ORDER BY links.rowid",
            (link_hash,),
        )
        return {h: sub for h, sub in rows}

    # -- revocations -----------------------------------------------------------------------------------
    @_writes
    async def revoke(self, jti: str, doc: Doc) -> bool:
        cur = self.db.execute("INSERT OR IGNORE INTO revocations (jti, doc) VALUES (?, ?)", (jti, _dump(doc)))
        return cur.rowcount == 1

    async def revocations(self) -> dict[str, Doc]:
        return {r[0]: json.loads(r[1]) for r in self.db.execute("SELECT jti, doc FROM revocations")}

    async def revoked_among(self, jtis: list[str]) -> set[str]:
        if not jtis:
            return set()
        marks = ",".join("?" * len(jtis))
        return {r[0] for r in self.db.execute(f"SELECT jti FROM revocations WHERE jti IN ({marks})", jtis)}

    @_writes
    async def first_use(self, key: str, ttl_s: float, now: float) -> bool:
        with self._tx() as db:
            db.execute("DELETE FROM seen WHERE expires <= ?", (now,))
            cur = db.execute("INSERT OR IGNORE INTO seen (key, expires) VALUES (?, ?)", (key, now + ttl_s))
            return cur.rowcount == 1
