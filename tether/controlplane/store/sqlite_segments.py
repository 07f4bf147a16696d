"""The SQLite store's sealed segments (record form 2: ``tether/controlplane/segments.py``).

A chain is a row of ``chains`` per link (its head, how many calls it holds, the last call it holds in the
record's order, the record that closed it, and how many of the link's reports no segment holds); a segment
is a row of ``segments`` (its signed header) and the reports it holds carry its ``seq`` (column ``seg``), so
a segment's calls are the texts kept beside those reports, never copied.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ..termination import entry_text
from .base import Doc
from .sqlite_core import SqliteCore, _transaction, _writes

_CHAIN_COLUMNS = "link, agent, seq, head, count, last_started, last_call, closed_by, loose"


def _chain(row: tuple[Any, ...]) -> Doc:
    link, agent, seq, head, count, last_started, last_call, closed_by, loose = row
    return {"link": link, "agent": agent, "seq": seq, "head": head, "count": count,
            "last": None if last_call is None else [last_started, last_call], "closed_by": closed_by,
            "loose": loose}


def close_chains(db: sqlite3.Connection, record_id: str, close: Mapping[str, int]) -> bool:
    """In a record's append transaction: every chain of ``close`` (link -> the seq its writer read) still at
    that seq, and closed by this record if no record closed it before; False (nothing written) otherwise."""
    rows = {}
    for link in close:
        row = db.execute("SELECT seq, closed_by FROM chains WHERE link = ?", (link,)).fetchone()
        rows[link] = row
        if (row[0] if row else 0) != close[link]:
            return False
    for link, row in rows.items():
        if row is None:
            db.execute("INSERT INTO chains (link, agent, seq, head, count, closed_by) VALUES (?, '', 0, '', 0, ?)",
                       (link, record_id))
        elif row[1] is None:
            db.execute("UPDATE chains SET closed_by = ? WHERE link = ?", (record_id, link))
    return True


class SqliteSegments(SqliteCore):
    """Chains of sealed segments, one per link."""

    seals = True

    async def chains(self, links: list[str]) -> dict[str, Doc]:
        def read(db: sqlite3.Connection) -> dict[str, Doc]:
            out: dict[str, Doc] = {}
            for at in range(0, len(links), 500):
                part = links[at:at + 500]
                for row in db.execute(f"SELECT {_CHAIN_COLUMNS} FROM chains WHERE link IN "
                                      f"({','.join('?' * len(part))})", part):
                    out[row[0]] = _chain(row)
            return out

        return await self._off_loop(read) if links else {}

    async def sealable_links(self, min_calls: int) -> list[Doc]:
        return await self._off_loop(lambda db: [_chain(r) for r in db.execute(
            f"SELECT {_CHAIN_COLUMNS} FROM chains WHERE closed_by IS NULL AND loose >= ? ORDER BY link",
            (min_calls,))])

    async def seal_candidates(self, chain: Doc, cut: float, limit: int) -> list[tuple[float, str, str]]:
        """(started, call id, entry text) of the chain's reports no segment holds that sort after its last
        call and started before ``cut``, in the record's order, at most ``limit``."""
        last = chain.get("last") or [float("-inf"), ""]

        def read(db: sqlite3.Connection) -> list[tuple[float, str, str]]:
            rows = db.execute(
                "SELECT started, call_id, entry, CASE WHEN entry IS NULL THEN doc END FROM reports "
                "WHERE agent = ? AND seg IS NULL AND (started, call_id) > (?, ?) AND started < ? AND link = ? "
                "ORDER BY started, call_id LIMIT ?",
                (chain["agent"], last[0], last[1], cut, chain["link"], limit)).fetchall()
            return [(started, cid, entry if entry is not None else entry_text(json.loads(doc)))
                    for started, cid, entry, doc in rows]

        return await self._off_loop(read)

    @_writes
    async def append_segment(self, segment: Doc, calls: list[tuple[float, str, str]]) -> bool:
        encoded = json.dumps(segment, sort_keys=True, separators=(",", ":"))

        def append(db: sqlite3.Connection) -> bool:
            with _transaction(db):
                row = db.execute("SELECT seq, head, closed_by FROM chains WHERE link = ?",
                                 (segment["link"],)).fetchone()
                if row is None or row[0] != segment["seq"] - 1 or row[1] != segment["prev"] or row[2] is not None:
                    return False  # sealed by another writer meanwhile, or closed by a record
                cur = db.executemany("UPDATE reports SET seg = ?, entry = COALESCE(entry, ?) "
                                     "WHERE call_id = ? AND seg IS NULL AND link = ?",
                                     [(segment["seq"], text, cid, segment["link"]) for _, cid, text in calls])
                if cur.rowcount != len(calls):
                    raise ValueError(f"segment {segment['seq']} of {segment['link']}: its calls changed under it")
                db.execute("INSERT INTO segments (link, seq, hash, doc) VALUES (?, ?, ?, ?)",
                           (segment["link"], segment["seq"], segment["hash"], encoded))
                db.execute("UPDATE chains SET seq = ?, head = ?, count = count + ?, last_started = ?, last_call = ?, "
                           "loose = MAX(0, loose - ?) WHERE link = ?",
                           (segment["seq"], segment["hash"], len(calls), segment["last"][0], segment["last"][1],
                            len(calls), segment["link"]))
                return True

        return await self._off_loop(append)

    async def segments_of(self, link: str) -> list[Doc]:
        return await self._off_loop(lambda db: [json.loads(r[0]) for r in db.execute(
            "SELECT doc FROM segments WHERE link = ? ORDER BY seq", (link,))])

    async def segment_calls(self, link: str, page: int = 2000) -> AsyncIterator[list[tuple[float, str, int, str]]]:
        """The calls of a chain's segments, (started, call id, seq, entry text), segment after segment, each
        in the record's order, a page at a time."""
        after: tuple[Any, ...] = (0, float("-inf"), "")
        while True:
            rows = await self._off_loop(lambda db, after=after: db.execute(
                "SELECT seg, started, call_id, entry FROM reports WHERE link = ? AND seg IS NOT NULL "
                "AND (seg, started, call_id) > (?, ?, ?) ORDER BY seg, started, call_id LIMIT ?",
                (link, *after, page)).fetchall())
            if not rows:
                return
            after = rows[-1][:3]
            yield [(started, cid, seg, entry) for seg, started, cid, entry in rows]
