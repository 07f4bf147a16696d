"""The SQLite store's shared part: schema, transactions, write-refusal handling and the connections (``SqliteCore``).

The store is ``SqliteStore`` in ``tether/controlplane/store/sqlite.py``, composed of this and one mixin per concern.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from tether.capability import jsonpieces

from ..termination import encode_entry
from .base import Doc, Holders, Store, StoreUnavailable, StoreUnwritable, index_keys

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
CREATE TABLE IF NOT EXISTS record_keys (key TEXT NOT NULL, pos INTEGER NOT NULL, record_id TEXT NOT NULL,
    PRIMARY KEY (key, pos));
CREATE TABLE IF NOT EXISTS record_index (id INTEGER PRIMARY KEY CHECK (id = 1), upto INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, owner TEXT NOT NULL, expires REAL NOT NULL);
CREATE TABLE IF NOT EXISTS seen (key TEXT PRIMARY KEY, expires REAL NOT NULL);
CREATE TABLE IF NOT EXISTS budgets (key TEXT PRIMARY KEY, used INTEGER NOT NULL, leased INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS slices (id TEXT PRIMARY KEY, open INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS slices_open ON slices(open);
CREATE TABLE IF NOT EXISTS chains (link TEXT PRIMARY KEY, agent TEXT NOT NULL, seq INTEGER NOT NULL,
    head TEXT NOT NULL, count INTEGER NOT NULL, last_started REAL, last_call TEXT, closed_by TEXT,
    loose INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS segments (link TEXT NOT NULL, seq INTEGER NOT NULL, hash TEXT NOT NULL,
    doc TEXT NOT NULL, PRIMARY KEY (link, seq));
"""

# Primary result codes that mean "this file cannot take writes" (a full disk, a read-only file or file system,
# an I/O error writing it), as against a bug or a busy lock.
CLOSE_WAIT_S = 30.0  # how long closing the store waits for work still running on a worker thread
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


def _reports_sealed(db: sqlite3.Connection) -> None:
    """Reports get the column saying which segment of their link's chain holds them (``seg``; NULL: none), and
    the two partial indexes the writer and the readers of records use: the reports no segment holds, in the
    record's order per agent (what a record still stages), and the sealed ones per chain (``segment_calls``).
    Additive: a file from before has no sealed report, and every record it holds reads as before."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(reports)")}
    if "seg" in columns and _has_index(db, "reports_loose") and _has_index(db, "reports_sealed"):
        return  # nothing to write: a file on a full disk or a read-only file system still opens
    with _transaction(db):
        if "seg" not in columns:
            db.execute("ALTER TABLE reports ADD COLUMN seg INTEGER")
        db.execute("CREATE INDEX IF NOT EXISTS reports_loose ON reports(agent, started, call_id) WHERE seg IS NULL")
        db.execute("CREATE INDEX IF NOT EXISTS reports_sealed ON reports(link, seg, started, call_id) "
                   "WHERE seg IS NOT NULL")


def _index_rows(pos: int, header: Doc) -> list[tuple[str, int, str]]:
    """A record's rows in ``record_keys``, the log's index (``base.index_keys``)."""
    return [(key, pos, header["record_id"]) for key in index_keys(header)]


def _indexed_upto(db: sqlite3.Connection) -> tuple[int, int]:
    """(the position up to which every record is in ``record_keys``, the newest record's position); 0 for none."""
    row = db.execute("SELECT upto FROM record_index WHERE id = 1").fetchone()
    newest = db.execute("SELECT MAX(pos) FROM records").fetchone()[0]
    return (row[0] if row else 0), (newest or 0)


def _file_records(db: sqlite3.Connection, upto: int, newest: dict[int, Doc] | None = None) -> None:
    """In the caller's transaction: file every record after position ``upto`` in ``record_keys``, and say so.
    ``newest``: headers the caller holds decoded (the one it appends), by position."""
    held = newest or {}
    for pos, raw in db.execute("SELECT pos, doc FROM records WHERE pos > ? ORDER BY pos", (upto,)).fetchall():
        header = held[pos] if pos in held else json.loads(raw)
        db.executemany("INSERT OR IGNORE INTO record_keys (key, pos, record_id) VALUES (?, ?, ?)",
                       _index_rows(pos, header))
        upto = pos
    db.execute("INSERT INTO record_index (id, upto) VALUES (1, ?) ON CONFLICT (id) DO UPDATE SET upto = ?",
               (upto, upto))


def _log_index(db: sqlite3.Connection) -> None:
    """Records the index does not hold yet (a file from before the index, or records an older control plane
    appended since): filed, oldest first, in one transaction. Nothing to write, nothing written: a file on a
    full disk or a read-only file system still opens."""
    upto, newest = _indexed_upto(db)
    if upto >= newest:
        return
    with _transaction(db):
        _file_records(db, _indexed_upto(db)[0])


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
        store: SqliteCore = args[0]  # type: ignore[assignment]
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


class SqliteCore(Store):
    """The file, its connections (the loop's and one per worker thread) and its write health: what every part
    of the SQLite store uses."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.url = f"sqlite:///{path}"
        self._db: sqlite3.Connection | None = None
        self._local = threading.local()
        self._thread_dbs: list[sqlite3.Connection] = []
        self._thread_lock = threading.Lock()
        # Work handed to worker threads and not finished there (counted up on the loop, down in the thread): a
        # task cancelled while it waits leaves its thread running, and closing a connection a thread is using
        # crashes the process, so ``close`` waits for this to reach 0 first.
        self._working = 0
        self._idle = threading.Condition(self._thread_lock)

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
        _reports_sealed(db)
        _log_index(db)
        self._db = db

    async def close(self) -> None:
        await asyncio.to_thread(self._wait_idle, CLOSE_WAIT_S)
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
        with self._thread_lock:
            self._working += 1

        def run() -> R:
            try:
                return work(self._thread_db())
            finally:
                with self._thread_lock:
                    self._working -= 1
                    self._idle.notify_all()

        return await asyncio.to_thread(run)

    def _wait_idle(self, timeout: float) -> bool:
        """Wait (in a worker thread) until no work runs on the threads' connections; False after ``timeout``."""
        with self._thread_lock:
            return self._idle.wait_for(lambda: self._working == 0, timeout)

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
