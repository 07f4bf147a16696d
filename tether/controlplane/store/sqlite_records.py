"""The SQLite store's reconciliation records: the hash chain, its call entries and their staging.

A mixin of ``SqliteStore`` (``tether/controlplane/store/sqlite.py``); moved out of it unchanged.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

from tether.capability import jsonpieces

from ..termination import encode_entry, entry_text
from .base import Doc, Holders, LogView, StagedPage
from .sqlite_core import (
    _INSERT_ENTRY,
    _READ_ENTRIES,
    SqliteCore,
    _entry_rows,
    _file_records,
    _holders,
    _indexed_upto,
    _insert_entries,
    _log_index,
    _transaction,
    _writes,
)
from .sqlite_segments import close_chains


class SqliteRecords(SqliteCore):
    """The record chain, its call entries, staging a record's calls a page at a time."""

    # -- records ---------------------------------------------------------------------------------------
    # A record is a row of ``records`` (its header: every field but ``calls``) and one row of ``record_calls``
    # per call entry, keyed by record id and position and indexed by call id (who holds a call). Entries are
    # staged before the header is appended; until then no query sees them (every read joins on ``records``).
    @_writes
    async def append_record(self, record: Doc, staged: int | None = None,
                            close: Mapping[str, int] | None = None) -> bool:
        header = {k: v for k, v in record.items() if k != "calls"}
        rid = header["record_id"]

        def append(db: sqlite3.Connection) -> bool:
            encoded = jsonpieces.dumps(header)  # before the transaction: the lock is held for the insert only
            rows = [] if staged is not None else _entry_rows(rid, 0, [
                (c["call_id"], c.get("reported", True) is not False, encode_entry(c)) for c in record["calls"]])
            with _transaction(db):
                row = db.execute("SELECT hash FROM records ORDER BY pos DESC LIMIT 1").fetchone()
                head = row[0] if row else ""
                if record["prev_hash"] != head:
                    return False
                if close and not close_chains(db, rid, close):
                    return False  # a segment sealed since the writer read its chains: it builds again
                if staged is None:
                    db.executemany(_INSERT_ENTRY, rows)
                else:
                    have = db.execute("SELECT COUNT(*) FROM record_calls WHERE record_id = ?", (rid,)).fetchone()[0]
                    if have != staged:
                        raise ValueError(f"record {rid}: {have} call entries staged, not {staged}")
                upto = _indexed_upto(db)[0]
                pos = db.execute(
                    "INSERT INTO records (hash, prev_hash, doc, record_id, calls) VALUES (?, ?, ?, ?, ?)",
                    (record["hash"], record["prev_hash"], encoded, rid, len(rows) if staged is None else staged),
                ).lastrowid
                assert pos is not None
                _file_records(db, upto, {pos: header})  # the log's index, in the append's transaction
                return True

        done = await self._off_loop(append)
        if done:
            self._appended(header)
        return done

    @_writes
    async def stage_calls(self, record_id: str, start: int, entries: list[tuple[str, bool, str]]) -> None:
        await self._off_loop(lambda db: _insert_entries(db, record_id, start, entries))

    @_writes
    async def drop_staged(self, record_id: str) -> None:
        def drop(db: sqlite3.Connection) -> None:
            with _transaction(db):
                db.execute("DELETE FROM record_calls WHERE record_id = ? AND NOT EXISTS "
                           "(SELECT 1 FROM records WHERE records.record_id = ?)", (record_id, record_id))

        await self._off_loop(drop)

    async def record_heads(self, start: int = 0) -> list[Doc]:
        return await self._off_loop(lambda db: [json.loads(r[0]) for r in db.execute(
            "SELECT doc FROM records ORDER BY pos LIMIT -1 OFFSET ?", (max(0, start),))])

    async def heads_from(self, at: int) -> list[tuple[int, Doc]]:
        return await self._off_loop(lambda db: [(pos, json.loads(raw)) for pos, raw in db.execute(
            "SELECT pos, doc FROM records WHERE pos >= ? ORDER BY pos", (at,))])

    async def log_view(self, termination_id: str, agents: list[str]) -> LogView:
        keys = [f"term:{termination_id}", *(f"left:{agent}" for agent in sorted(set(agents)))]

        def read(db: sqlite3.Connection) -> LogView:
            _log_index(db)  # records appended by an older control plane since: filed first (usually nothing)
            newest = db.execute("SELECT pos, doc FROM records ORDER BY pos DESC LIMIT 1").fetchone()
            if newest is None:
                return LogView(-1, None, [])
            at = newest[0]
            marks = ",".join("?" * len(keys))
            # A row joins its record by position and id: one whose record is gone (or was replaced) is no answer.
            rows = db.execute(
                "SELECT DISTINCT r.pos, r.doc FROM record_keys AS k JOIN records AS r "
                f"ON r.pos = k.pos AND r.record_id = k.record_id WHERE k.key IN ({marks}) AND k.pos <= ? "
                "ORDER BY r.pos", (*keys, at)).fetchall()
            return LogView(at, json.loads(newest[1]), [(pos, json.loads(raw)) for pos, raw in rows])

        return await self._off_loop(read)

    async def heads_named(self, record_ids: list[str], at: int) -> list[tuple[int, Doc]]:
        if not record_ids:
            return []

        def read(db: sqlite3.Connection) -> list[tuple[int, Doc]]:
            out: list[tuple[int, Doc]] = []
            ids = sorted(set(record_ids))
            for start in range(0, len(ids), 500):
                part = ids[start:start + 500]
                out += [(pos, json.loads(raw)) for pos, raw in db.execute(
                    f"SELECT pos, doc FROM records WHERE record_id IN ({','.join('?' * len(part))}) AND pos <= ?",
                    (*part, at))]
            return sorted(out, key=lambda item: item[0])

        return await self._off_loop(read)

    async def record_calls(self, record_id: str, page: int = 2000) -> AsyncIterator[list[str]]:
        after = -1
        while True:
            rows = await self._off_loop(
                lambda db, after=after: db.execute(_READ_ENTRIES, (record_id, after, page)).fetchall())
            if not rows:
                return
            after = rows[-1][0]
            yield [r[1] for r in rows]

    async def call_holders(self, call_ids: list[str]) -> dict[str, Holders]:
        return await self._off_loop(lambda db: _holders(db, call_ids)) if call_ids else {}

    async def unknown_calls(self) -> dict[str, tuple[str, ...]]:
        def read(db: sqlite3.Connection) -> dict[str, tuple[str, ...]]:
            out: dict[str, list[str]] = {}
            for cid, rid in db.execute(
                    "SELECT record_calls.call_id, record_calls.record_id FROM record_calls JOIN records "
                    "USING (record_id) WHERE record_calls.reported = 0 ORDER BY records.pos, record_calls.seq"):
                if rid not in out.setdefault(cid, []):
                    out[cid].append(rid)
            return {cid: tuple(rids) for cid, rids in out.items()}

        return await self._off_loop(read)

    async def report_pages(self, agents: list[str], page: int = 2000) -> AsyncIterator[list[Doc]]:
        """One query in a connection of its own (a read transaction: a snapshot), sorted by SQLite and
        fetched a page at a time in a worker thread."""
        if not agents:
            return
        marks = ",".join("?" * len(agents))
        db = await asyncio.to_thread(sqlite3.connect, self.path, check_same_thread=False)
        try:
            cursor = await asyncio.to_thread(
                db.execute, f"SELECT doc FROM reports WHERE agent IN ({marks}) "
                "ORDER BY started, call_id", agents)
            while True:
                docs = await asyncio.to_thread(lambda: [json.loads(r[0]) for r in cursor.fetchmany(page)])
                if not docs:
                    return
                yield docs
        finally:
            await asyncio.to_thread(db.close)

    async def stage_reports(self, record_id: str, start: int, agents: list[str], links: set[str],
                            page: int = 5000) -> AsyncIterator[StagedPage]:
        """One query in a connection of its own (a snapshot), in the record's order from the index on (agent,
        started, call_id), and per page, in one worker thread: the log's holders of its calls, and an insert of
        the entry texts kept beside the reports (made from the report only for one stored before they were)."""
        if not agents:
            return
        reader = await asyncio.to_thread(sqlite3.connect, self.path, isolation_level=None, check_same_thread=False)

        def stage(rows_in: Iterator[tuple[Any, ...]], at: int) -> StagedPage | None:
            fetched = list(itertools.islice(rows_in, page))
            if not fetched:
                return None
            rows = [r for r in fetched if r[2] is None or r[2] in links]
            db = self._thread_db()
            holders = _holders(db, [r[1] for r in rows])
            entries = [(cid, entry if entry is not None else entry_text(json.loads(doc)), entry is not None)
                       for _, cid, _, entry, doc in rows if holders.get(cid, (None,))[0] is None]
            # A row whose text is the report's own refers to it ('': reports are never changed or deleted).
            _insert_entries(db, record_id, at, [(cid, True, "" if kept else text) for cid, text, kept in entries])
            return StagedPage([(cid, text) for cid, text, _ in entries], holders)

        def open_rows() -> Iterator[tuple[Any, ...]]:
            """One read transaction (a snapshot) and a cursor per agent, each in the record's order from the index
            on (agent, started, call_id), merged: no sort of the reports, whatever their number."""
            reader.execute("BEGIN")
            cursors = [reader.execute(
                "SELECT started, call_id, link, entry, CASE WHEN entry IS NULL THEN doc END FROM reports "
                "WHERE agent = ? AND seg IS NULL ORDER BY started, call_id", (agent,)) for agent in sorted(set(agents))]
            return cursors[0] if len(cursors) == 1 else heapq.merge(*cursors, key=lambda row: (row[0], row[1]))

        try:
            rows_in = await asyncio.to_thread(open_rows)
            while True:
                staged = await self._stage_page(stage, rows_in, start)
                if staged is None:
                    return
                start += len(staged.entries)
                yield staged
        finally:
            await asyncio.to_thread(reader.close)

    @_writes
    async def _stage_page(self, stage: Callable[[Iterator[tuple[Any, ...]], int], StagedPage | None],
                          rows: Iterator[tuple[Any, ...]], at: int) -> StagedPage | None:
        """One page of ``stage_reports`` (a write: its refusal goes to the store's write health); None at the end."""
        return await asyncio.to_thread(stage, rows, at)
