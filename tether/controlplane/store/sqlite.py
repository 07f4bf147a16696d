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

import asyncio
import contextlib
import functools
import heapq
import itertools
import json
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from tether.capability import jsonpieces
from tether.capability.budget import slice_size

from ..termination import encode_entry, entry_text
from .base import Doc, Event, Holders, LinkConflict, StagedPage, Store, Stored, StoreUnavailable, StoreUnwritable

EVENT_RETENTION = 10_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS links (hash TEXT PRIMARY KEY, jti TEXT UNIQUE NOT NULL, sub TEXT NOT NULL,
    prf TEXT, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS links_sub ON links(sub);
CREATE INDEX IF NOT EXISTS links_prf ON links(prf);
CREATE TABLE IF NOT EXISTS revocations (jti TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, target TEXT,
    payload TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS reports (call_id TEXT PRIMARY KEY, agent TEXT NOT NULL, doc TEXT NOT NULL,
    started REAL, link TEXT, entry TEXT);
CREATE TABLE IF NOT EXISTS starts (call_id TEXT PRIMARY KEY, agent TEXT NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS starts_agent ON starts(agent);
CREATE TABLE IF NOT EXISTS docs (kind TEXT NOT NULL, id TEXT NOT NULL, version INTEGER NOT NULL, doc TEXT NOT NULL,
    PRIMARY KEY (kind, id));
CREATE TABLE IF NOT EXISTS records (pos INTEGER PRIMARY KEY AUTOINCREMENT, hash TEXT UNIQUE NOT NULL,
    prev_hash TEXT UNIQUE NOT NULL, doc TEXT NOT NULL, record_id TEXT, calls INTEGER);
CREATE TABLE IF NOT EXISTS record_calls (record_id TEXT NOT NULL, seq INTEGER NOT NULL, call_id TEXT NOT NULL,
    reported INTEGER NOT NULL, entry TEXT NOT NULL, PRIMARY KEY (record_id, seq));
CREATE INDEX IF NOT EXISTS record_calls_call ON record_calls(call_id);
CREATE INDEX IF NOT EXISTS record_calls_unknown ON record_calls(reported) WHERE reported = 0;
CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, owner TEXT NOT NULL, expires REAL NOT NULL);
CREATE TABLE IF NOT EXISTS seen (key TEXT PRIMARY KEY, expires REAL NOT NULL);
CREATE TABLE IF NOT EXISTS budgets (key TEXT PRIMARY KEY, used INTEGER NOT NULL, leased INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS slices (id TEXT PRIMARY KEY, open INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS slices_open ON slices(open);
"""

# Primary result codes that mean "this file cannot take writes" (a full disk, a read-only file or file system,
# an I/O error writing it), as against a bug or a busy lock.
_UNWRITABLE = {13: "SQLITE_FULL", 8: "SQLITE_READONLY", 10: "SQLITE_IOERR", 14: "SQLITE_CANTOPEN"}


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` (one writer at a time, so a read-then-write inside sees no other writer), committed
    when the block ends, rolled back when it raises. A block that returns early having written nothing
    commits nothing."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:  # a failed COMMIT (a full disk) may have ended it: the first error is the one to tell
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
        raise


def _dump(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


_INSERT_ENTRY = "INSERT OR REPLACE INTO record_calls (record_id, seq, call_id, reported, entry) VALUES (?, ?, ?, ?, ?)"


# A call entry's text is its row's, or, when the row's is '' (staged by ``stage_reports``), the report's own.
_READ_ENTRIES = ("SELECT c.seq, CASE WHEN c.entry = '' THEN r.entry ELSE c.entry END FROM record_calls AS c "
                 "LEFT JOIN reports AS r ON c.entry = '' AND r.call_id = c.call_id "
                 "WHERE c.record_id = ? AND c.seq > ? ORDER BY c.seq LIMIT ?")


def _entry_rows(record_id: str, start: int, entries: list[tuple[str, bool, str]]) -> list[tuple[Any, ...]]:
    return [(record_id, start + i, cid, int(reported), text) for i, (cid, reported, text) in enumerate(entries)]


def _records_apart(db: sqlite3.Connection) -> None:
    """A file from before records were stored apart from their calls: each whole record becomes a header and
    its entries (the same bytes once reassembled: same hash, same signature); staged entries of records never
    appended (a control plane stopped mid-write) are dropped."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(records)")}
    whole = "record_id" not in columns or db.execute(
        "SELECT 1 FROM records WHERE record_id IS NULL LIMIT 1").fetchone() is not None
    orphans = not whole and db.execute("SELECT 1 FROM record_calls WHERE NOT EXISTS (SELECT 1 FROM records "
                         "WHERE records.record_id = record_calls.record_id) LIMIT 1").fetchone() is not None
    if not (whole or orphans or not _has_index(db, "records_id")):
        return  # nothing to write: a file on a full disk or a read-only file system still opens
    with _transaction(db):
        if "record_id" not in columns:
            db.execute("ALTER TABLE records ADD COLUMN record_id TEXT")
            db.execute("ALTER TABLE records ADD COLUMN calls INTEGER")
        for pos, raw in db.execute("SELECT pos, doc FROM records WHERE record_id IS NULL ORDER BY pos").fetchall():
            record = json.loads(raw)
            calls = record.pop("calls", [])
            db.executemany(_INSERT_ENTRY, _entry_rows(record["record_id"], 0, [
                (c["call_id"], c.get("reported", True) is not False, encode_entry(c)) for c in calls]))
            db.execute("UPDATE records SET doc = ?, record_id = ?, calls = ? WHERE pos = ?",
                       (jsonpieces.dumps(record), record["record_id"], len(calls), pos))
        db.execute("CREATE INDEX IF NOT EXISTS records_id ON records(record_id)")
        db.execute("DELETE FROM record_calls WHERE NOT EXISTS "
                   "(SELECT 1 FROM records WHERE records.record_id = record_calls.record_id)")


_ENTRIES_KEPT = 1  # the file's user_version once every report has the columns a record is written from


def _reports_entries(db: sqlite3.Connection) -> None:
    """A file from before each report kept its record entry: the columns a record is written from (``started``,
    ``link``, ``entry``) are added and ``started`` and ``link`` filled in; ``entry`` stays empty for those old
    reports and is made from the report when a record lists it."""
    if db.execute("PRAGMA user_version").fetchone()[0] >= _ENTRIES_KEPT:
        return  # nothing to write: a file on a full disk or a read-only file system still opens
    columns = {row[1] for row in db.execute("PRAGMA table_info(reports)")}
    missing = [c for c in ("started", "link", "entry") if c not in columns]
    with _transaction(db):
        for column, kind in (("started", "REAL"), ("link", "TEXT"), ("entry", "TEXT")):
            if column in missing:
                db.execute(f"ALTER TABLE reports ADD COLUMN {column} {kind}")
        db.execute("UPDATE reports SET started = COALESCE(json_extract(doc, '$.started_at'), 0), "
                   "link = json_extract(doc, '$.link') WHERE started IS NULL")
        db.execute("CREATE INDEX IF NOT EXISTS reports_order ON reports(agent, started, call_id)")
        db.execute("DROP INDEX IF EXISTS reports_agent")  # reports_order serves every lookup by agent
        db.execute(f"PRAGMA user_version = {_ENTRIES_KEPT}")


def _holders(db: sqlite3.Connection, call_ids: list[str]) -> dict[str, Holders]:
    """``Store.call_holders`` on this connection."""
    owner: dict[str, str] = {}
    unknown: dict[str, list[str]] = {}
    for part in range(0, len(call_ids), 500):
        ids = call_ids[part:part + 500]
        marks = ",".join("?" * len(ids))
        for cid, rid, reported in db.execute(
                "SELECT record_calls.call_id, record_calls.record_id, record_calls.reported FROM record_calls "
                f"JOIN records USING (record_id) WHERE record_calls.call_id IN ({marks}) "
                "ORDER BY records.pos, record_calls.seq", ids):
            if reported:
                owner.setdefault(cid, rid)
            elif rid not in unknown.setdefault(cid, []):
                unknown[cid].append(rid)
    return {cid: (owner.get(cid), tuple(unknown.get(cid, ()))) for cid in {*owner, *unknown}}


def _insert_entries(db: sqlite3.Connection, record_id: str, start: int, entries: list[tuple[str, bool, str]]) -> None:
    rows = _entry_rows(record_id, start, entries)
    for part in range(0, len(rows), 1000):  # the loop's writers wait for 1,000 rows' insert at most
        with _transaction(db):
            db.executemany(_INSERT_ENTRY, rows[part:part + 1000])


def _has_index(db: sqlite3.Connection, name: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = ?", (name,)).fetchone() is not None


def _writes[**P, R](method: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """A write method: its outcome goes to the store's write health, and a refusal by the file (a full disk,
    a read-only file system) raises StoreUnwritable with the reason instead of an internal error."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        store: SqliteStore = args[0]  # type: ignore[assignment]
        try:
            result = await method(*args, **kwargs)
        except sqlite3.Error as exc:
            name = _UNWRITABLE.get(getattr(exc, "sqlite_errorcode", -1) & 0xFF)
            if name is None:
                raise
            reason = store.refusal(exc, name)
            store.write_failed(reason)
            raise StoreUnwritable(reason) from exc
        store.write_succeeded()
        return result

    return wrapper


class SqliteStore(Store):
    def __init__(self, path: str) -> None:
        self.path = path
        self.url = f"sqlite:///{path}"
        self._db: sqlite3.Connection | None = None
        self._local = threading.local()
        self._thread_dbs: list[sqlite3.Connection] = []
        self._thread_lock = threading.Lock()

    async def open(self) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA busy_timeout=5000")
        db.executescript(_SCHEMA)
        _records_apart(db)
        _reports_entries(db)
        self._db = db

    async def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
        with self._thread_lock:
            for db in self._thread_dbs:
                db.close()
            self._thread_dbs.clear()
        self._local = threading.local()

    def _thread_db(self) -> sqlite3.Connection:
        """This worker thread's own connection to the file (made on its first use)."""
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            self.db  # noqa: B018 - raises StoreUnavailable when the store is closed
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA busy_timeout=5000")
            db.execute("PRAGMA synchronous=NORMAL")  # as the loop's connection: WAL, a sync at each checkpoint
            self._local.db = db
            with self._thread_lock:
                self._thread_dbs.append(db)
        return db

    async def _off_loop[R](self, work: Callable[[sqlite3.Connection], R]) -> R:
        return await asyncio.to_thread(lambda: work(self._thread_db()))

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreUnavailable("the SQLite store is not open")
        return self._db

    async def healthy(self) -> bool:
        try:
            self.db.execute("SELECT 1").fetchone()
            return True
        except (sqlite3.Error, StoreUnavailable):
            return False

    async def probe_write(self) -> None:
        try:
            await self._probe()
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", -1) & 0xFF not in (5, 6):  # busy or locked: no verdict either way
                raise

    @_writes
    async def _probe(self) -> None:
        # Off the loop: the probe waits its turn behind a record being appended without stalling the API.
        def probe(db: sqlite3.Connection) -> None:
            # Made here, not with the schema: a file from before it, on a full disk, must still open.
            db.execute("CREATE TABLE IF NOT EXISTS health (name TEXT PRIMARY KEY, at REAL NOT NULL)")
            db.execute("INSERT OR REPLACE INTO health (name, at) VALUES ('probe', ?)", (time.time(),))

        await self._off_loop(probe)

    def refusal(self, exc: sqlite3.Error, name: str) -> str:
        """Why the file refused a write, in words an operator acts on."""
        reason = f"the SQLite store {self.path} refuses writes: {exc} ({name})"
        with contextlib.suppress(OSError):
            fs = os.statvfs(os.path.dirname(os.path.abspath(self.path)))
            if fs.f_flag & os.ST_RDONLY:
                reason += "; its file system is mounted read-only"
            else:
                reason += f"; {fs.f_bavail * fs.f_frsize} bytes free on its file system"
        return reason

    def _tx(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """A write transaction on the loop's connection."""
        return _transaction(self.db)

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

    # -- sidecars --------------------------------------------------------------------------------------
    @_writes
    async def put_sidecar(self, run_id: str, doc: Doc) -> None:
        self.db.execute("INSERT OR REPLACE INTO runs (run_id, doc) VALUES (?, ?)", (run_id, _dump(doc)))

    async def get_sidecar(self, run_id: str) -> Doc | None:
        row = self.db.execute("SELECT doc FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return json.loads(row[0]) if row else None

    async def all_sidecars(self) -> dict[str, Doc]:
        return {r[0]: json.loads(r[1]) for r in self.db.execute("SELECT run_id, doc FROM runs")}

    # -- reports ---------------------------------------------------------------------------------------
    @_writes
    async def put_reports(self, reports: list[Doc]) -> Stored:
        with self._tx() as db:
            new: set[str] = set()
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

    # -- records ---------------------------------------------------------------------------------------
    # A record is a row of ``records`` (its header: every field but ``calls``) and one row of ``record_calls``
    # per call entry, keyed by record id and position and indexed by call id (who holds a call). Entries are
    # staged before the header is appended; until then no query sees them (every read joins on ``records``).
    @_writes
    async def append_record(self, record: Doc, staged: int | None = None) -> bool:
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
                if staged is None:
                    db.executemany(_INSERT_ENTRY, rows)
                else:
                    have = db.execute("SELECT COUNT(*) FROM record_calls WHERE record_id = ?", (rid,)).fetchone()[0]
                    if have != staged:
                        raise ValueError(f"record {rid}: {have} call entries staged, not {staged}")
                db.execute("INSERT INTO records (hash, prev_hash, doc, record_id, calls) VALUES (?, ?, ?, ?, ?)",
                           (record["hash"], record["prev_hash"], encoded, rid, len(rows) if staged is None else staged))
                return True

        return await self._off_loop(append)

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

    async def record_heads(self) -> list[Doc]:
        return await self._off_loop(
            lambda db: [json.loads(r[0]) for r in db.execute("SELECT doc FROM records ORDER BY pos")])

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
                "WHERE agent = ? ORDER BY started, call_id", (agent,)) for agent in sorted(set(agents))]
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
