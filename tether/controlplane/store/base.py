"""The store interface: everything the control plane must not lose, behind one async contract.

Two implementations run the same contract tests: SQLite (embedded default) and Redis (several replicas).
Entities are JSON documents with a few indexed fields, so both back ends stay simple and equal.
Every method is idempotent where the API is (links by hash, reports by call id, revocations by jti).
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tether.capability.errors import STORE_UNWRITABLE  # noqa: F401  (every code is in tether/capability/errors.py; kept importable here)

from ..termination import entry_text
from .health import WriteHealth

Doc = dict[str, Any]
log = logging.getLogger("tether.store")


@dataclass(frozen=True)
class Event:
    seq: int
    kind: str  # one of capability.events.KINDS
    target: str | None  # agent id, or None for everyone concerned
    payload: Doc
    at: float

    def to_dict(self) -> Doc:
        return {"seq": self.seq, "kind": self.kind, "target": self.target, "payload": self.payload, "at": self.at}


class Stored(tuple[int, int]):
    """What ``put_reports`` did: ``(new, duplicates)``, and which call ids were new (counted once each)."""

    new_ids: frozenset[str]

    def __new__(cls, new_ids: frozenset[str] | set[str], total: int) -> Stored:
        stored = super().__new__(cls, (len(new_ids), total - len(new_ids)))
        stored.new_ids = frozenset(new_ids)
        return stored


Holders = tuple[str | None, tuple[str, ...]]  # (record holding a call as reported, records listing it unknown)


@dataclass(frozen=True)
class StagedPage:
    """What ``stage_reports`` staged of one page of reports: ``entries``, (call id, entry text) in the record's
    order; ``holders``, what the log's index says of every call of the page it lists (a call some record holds
    as reported was left out)."""

    entries: list[tuple[str, str]]
    holders: dict[str, Holders]


@dataclass(frozen=True)
class LogView:
    """What a record's writer reads of the log (``Store.log_view``), all as of one newest record: ``head``, that
    record's header (None in an empty log), at position ``at`` (-1 in an empty log); ``heads``, the headers
    with their positions of the records of one termination and of the records that left one of some agents
    unaccounted, oldest first. Positions order the log; they need not be contiguous."""

    at: int
    head: Doc | None
    heads: list[tuple[int, Doc]]


def index_keys(header: Doc) -> list[str]:
    """What the log's index files a record's header under: its termination, and each agent it left
    unaccounted (``Store.log_view``)."""
    left = sorted({u["agent"] for u in header.get("agents_unaccounted") or () if isinstance(u, dict)
                   and isinstance(u.get("agent"), str)})
    return [f"term:{header.get('termination_id')}", *(f"left:{agent}" for agent in left)]


class StoreUnavailable(Exception):
    """The store cannot be reached; the API answers 503 tether.store_unavailable and accepts nothing."""


# The code of a refused write, in the API's answers and in /healthz. (The control plane's own; capability.errors
# holds the codes the sidecar shares.)


class StoreUnwritable(StoreUnavailable):
    """The store answers but refuses writes (a full disk, a read-only file system, Redis out of memory or
    refusing writes); the API answers 503 tether.store_unwritable with the reason, and ``/healthz`` too. A
    StoreUnavailable, so whoever retries while the store is away retries this as well."""


@dataclass(frozen=True)
class WriteStatus:
    writable: bool
    reason: str  # why not ("" when writable)


class LinkConflict(Exception):
    """A link's jti already names another registered link (a jti names one link only). Nothing of the
    batch was stored; the API answers 409 tether.conflict."""

    def __init__(self, jti: str, registered: str) -> None:
        super().__init__(f"jti {jti} already names link {registered}")
        self.jti = jti
        self.registered = registered


class RecordLog(abc.ABC):
    """The store's half that keeps the reconciliation records and their sealed segments: declared apart from
    `Store` (which takes it in) only so that no class of the store passes 300 lines; each backend implements both
    in its records modules."""

    # -- reconciliation records: one hash chain -------------------------------------------------------
    # A record is stored as its header (every field but ``calls``) and its call entries apart, each entry as
    # its canonical JSON text (``controlplane.termination.encode_entry``), so a record of any size is written a
    # page at a time and read a page at a time; ``records()`` still gives whole records. Each final report has
    # its entry text kept beside it when stored (``termination.entry_text``), and ``stage_reports`` stages a
    # record's calls from those texts (a store may keep a reference to the report's text instead of a copy).
    @abc.abstractmethod
    async def append_record(self, record: Doc, staged: int | None = None,
                            close: Mapping[str, int] | None = None) -> bool:
        """Append if ``record['prev_hash']`` is the hash of the current last record (or "" when empty).
        False when another writer got there first: the caller rebuilds on the new head. ``staged``: the record
        is a header whose ``staged`` call entries were stored with ``stage_calls`` under its record id;
        otherwise ``record`` holds its ``calls``. ``close``: link -> the seq of its chain of segments the writer
        read (0: none); in the same transaction (script) each must still be at that seq (else False), and each
        is closed by this record unless a record closed it before (no segment is sealed on it again)."""

    @abc.abstractmethod
    async def stage_calls(self, record_id: str, start: int, entries: list[tuple[str, bool, str]]) -> None:
        """Store call entries (call id, reported, canonical JSON text) of a record not appended yet, from
        position ``start``; nothing reads them until ``append_record(header, staged=n)`` appends it."""

    @abc.abstractmethod
    async def drop_staged(self, record_id: str) -> None:
        """Forget the staged entries of a record that was not appended (its append lost the race)."""

    @abc.abstractmethod
    async def record_heads(self, start: int = 0) -> list[Doc]:
        """Every record without its ``calls`` (its header), oldest first; from position ``start`` on (the
        checkpoints read only what is new)."""

    @abc.abstractmethod
    async def log_view(self, termination_id: str, agents: list[str]) -> LogView:
        """``LogView`` from the log's index (kept with each append; a log from before it is indexed first)."""

    @abc.abstractmethod
    async def heads_named(self, record_ids: list[str], at: int) -> list[tuple[int, Doc]]:
        """(position, header) of the records with these ids at or before position ``at``, oldest first."""

    @abc.abstractmethod
    async def heads_from(self, at: int) -> list[tuple[int, Doc]]:
        """(position, header) of the records at or after position ``at``, oldest first (0: the whole log)."""

    @abc.abstractmethod
    def record_calls(self, record_id: str, page: int = 2000) -> AsyncIterator[list[str]]:
        """A record's call entries (appended or staged), as their canonical JSON text, in order, a page at
        a time."""

    @abc.abstractmethod
    async def call_holders(self, call_ids: list[str]) -> dict[str, tuple[str | None, tuple[str, ...]]]:
        """For each of these calls that an appended record lists: the first record (oldest) that holds it as
        reported, or None, and every record that lists it ``unknown`` (``reported: false``), oldest first."""

    @abc.abstractmethod
    async def unknown_calls(self) -> dict[str, tuple[str, ...]]:
        """Every call an appended record lists ``unknown`` -> those records, oldest first (few: the calls of
        agents that went silent, never heard of again)."""

    async def records(self) -> list[Doc]:
        """Every record, whole (its calls decoded), oldest first: for small logs and tests; the API and the
        termination driver read headers and pages instead."""
        out: list[Doc] = []
        for head in await self.record_heads():
            texts = [text async for page in self.record_calls(head["record_id"]) for text in page]
            out.append({**head, "calls": await asyncio.to_thread(lambda texts=texts: [json.loads(t) for t in texts])})
        return out

    @abc.abstractmethod
    def report_pages(self, agents: list[str], page: int = 2000) -> AsyncIterator[list[Doc]]:
        """These agents' final reports in a record's order (``controlplane.termination.in_order_key``: by
        ``started_at``, missing as 0, then ``call_id``), a page at a time, as of when the first page is read."""

    async def stage_reports(self, record_id: str, start: int, agents: list[str], links: set[str],
                            page: int = 5000) -> AsyncIterator[StagedPage]:
        """Stage, from position ``start``, the call entries of these agents' final reports that came from a run
        of one of ``links`` (or carry no link) and that no appended record holds as reported, in the record's
        order, a page at a time; each page is staged before it is yielded. This one decodes every report;
        the stores override it with one that copies the entry text kept beside each report
        (``termination.entry_text``)."""
        async for reports in self.report_pages(agents, page):
            reports = [r for r in reports if r.get("link") is None or r.get("link") in links]
            holders = await self.call_holders([r["call_id"] for r in reports])
            entries = [(r["call_id"], entry_text(r)) for r in reports if holders.get(r["call_id"], (None,))[0] is None]
            await self.stage_calls(record_id, start, [(cid, True, text) for cid, text in entries])
            start += len(entries)
            yield StagedPage(entries, holders)

    @abc.abstractmethod
    async def reports_among(self, call_ids: list[str]) -> list[Doc]:
        """The final reports of these calls (those that have one)."""

    # -- sealed segments (record form 2: controlplane/segments.py) -------------------------------------------
    # One chain per link. ``stage_reports`` stages only reports no segment holds. A store without segments
    # (``seals`` False) answers no chains, and nothing is ever sealed in it.
    seals = False

    async def chains(self, links: list[str]) -> dict[str, Doc]:
        """link -> its chain: ``link``, ``agent``, ``seq`` (of its head; 0: none), ``head`` (its hash), ``count``
        (calls its segments hold), ``last`` ([started, call id] of the last, or None), ``closed_by`` (the
        record that closed it, or None), ``loose`` (the link's reports no segment holds, about)."""
        return {}

    async def sealable_links(self, min_calls: int) -> list[Doc]:
        """The open chains with at least ``min_calls`` reports no segment holds."""
        return []

    async def seal_candidates(self, chain: Doc, cut: float, limit: int) -> list[tuple[float, str, str]]:
        """(started, call id, entry text) of the chain's reports no segment holds that sort after its last
        call and started before ``cut``, in the record's order, at most ``limit``."""
        return []

    async def append_segment(self, segment: Doc, calls: list[tuple[float, str, str]]) -> bool:
        """Append a sealed segment holding these calls (``seal_candidates``' rows) to its link's chain, if its
        ``seq`` follows the chain's head, its ``prev`` is the head's hash and no record closed the chain."""
        return False

    async def segments_of(self, link: str) -> list[Doc]:
        """The headers of a chain's segments, oldest first."""
        return []

    async def segment_calls(self, link: str, page: int = 2000) -> AsyncIterator[list[tuple[float, str, int, str]]]:
        """A chain's calls, (started, call id, seq, entry text), segment after segment, a page at a time."""
        for _ in ():
            yield []


class AppendListeners:
    """Who is told of this process's appends to the record log (a store's part; see ``Store``)."""

    def on_append(self, listener: Callable[[Doc], None]) -> None:
        """Call ``listener(header)`` in this process after each record this store appends (its header: the
        record without ``calls``), on the event loop, before ``append_record`` returns: the checkpoints take
        the new leaf from here instead of reading it back. Records other processes append are not told."""
        self.__dict__.setdefault("_append_listeners", []).append(listener)

    def _appended(self, header: Doc) -> None:
        for listener in self.__dict__.get("_append_listeners", ()):
            listener(header)


class Store(RecordLog, AppendListeners, abc.ABC):
    url: str

    async def open(self) -> None:
        """Connect and create the schema."""

    async def close(self) -> None:
        pass

    @abc.abstractmethod
    async def healthy(self) -> bool: ...

    clock_name: str | None = None  # a store with a clock of its own names it ("redis")

    async def reference_time(self) -> float | None:
        """The store's own clock (seconds since the epoch), which every replica sharing it compares its own
        with (``tether/controlplane/clock.py``); None for a store that is part of this process (SQLite: one replica,
        whose clock is the reference)."""
        return None

    _write_health: WriteHealth | None = None
    _probe_lock: asyncio.Lock | None = None

    @property
    def write_health(self) -> WriteHealth:
        """How the store's writes went (every write method reports to it)."""
        if self._write_health is None:
            self._write_health = WriteHealth()
        return self._write_health

    def write_failed(self, reason: str) -> None:
        """A write was refused (the backends' write methods call this)."""
        if self.write_health.failed(time.monotonic(), reason):
            log.error("%s; the API answers 503 tether.store_unwritable and /healthz 503 until a write succeeds",
                      reason)

    def write_succeeded(self) -> None:
        if self.write_health.succeeded(time.monotonic()):
            log.warning("the store %s takes writes again", self.url)

    async def write_status(self) -> WriteStatus:
        """Whether the store takes writes now: the newest write outcome, after a probe write when one is due
        (at most every few seconds, one at a time: callers meanwhile get the verdict as it stands)."""
        health = self.write_health
        if self._probe_lock is None:
            self._probe_lock = asyncio.Lock()
        if health.probe_due(time.monotonic()) and not self._probe_lock.locked():
            async with self._probe_lock:
                health.probing(time.monotonic())
                try:
                    await self.probe_write()
                except StoreUnavailable:
                    pass  # a refusal is recorded by the write itself; an unreachable store is healthy()'s to say
        return WriteStatus(health.writable, "" if health.writable else health.reason)

    @abc.abstractmethod
    async def probe_write(self) -> None:
        """One small real write (a heartbeat row or key), reported to ``write_health`` like any other write;
        raises StoreUnwritable when refused, StoreUnavailable when the store cannot be reached."""

    # -- links: every registered grant link, the agent graph's edges -----------------------------------
    @abc.abstractmethod
    async def put_links(self, links: list[Doc]) -> int:
        """Store link docs (keys: hash, jti, iss, sub, prf, compact, claims, registered_at); returns how many
        were new. A link already present (same hash) is left as it was. All or nothing: a link whose jti
        names another registered link (or another link of the batch) raises LinkConflict, storing none."""

    @abc.abstractmethod
    async def get_link(self, link_hash: str) -> Doc | None: ...

    @abc.abstractmethod
    async def link_by_jti(self, jti: str) -> Doc | None: ...

    @abc.abstractmethod
    async def jtis_beginning(self, prefix: str, limit: int = 21) -> list[str]:
        """Up to ``limit`` registered jtis that begin with ``prefix`` (a link named by a prefix; served from the
        jti index, never a walk over the links' documents)."""

    async def link_named(self, text: str) -> Doc | None:
        """The link whose jti is ``text``, or the one whose jti a prefix of 8 or more hex characters begins
        (tether/capability/jti.py; several: ``tether.jti_ambiguous``). None when nothing matches."""
        from tether.capability import jti

        link = await self.link_by_jti(text)
        given = jti.normalize(text)
        if link is None and given != text and len(given) == jti.FULL:
            link = await self.link_by_jti(given)  # copied with an ellipsis or in capitals
        if link is None and jti.is_prefix(given):
            matches = await self.jtis_beginning(given)
            link = await self.link_by_jti(jti.resolve(given, matches)) if matches else None
        return link

    @abc.abstractmethod
    async def all_links(self) -> list[Doc]: ...

    @abc.abstractmethod
    async def links_held_by(self, agent: str) -> list[Doc]:
        """The links whose subject is ``agent``, in registration order (an index on ``sub``)."""

    @abc.abstractmethod
    async def descendants(self, link_hash: str) -> dict[str, str]:
        """Every link registered below ``link_hash`` (children by ``prf``, at any depth; not the link itself),
        as link hash -> agent id: who a revocation cuts off. Served from an index on ``prf`` that holds the
        agent too, so its cost grows with the subtree, never with the graph, and no link document is read."""

    # -- revocations --------------------------------------------------------------------------------
    @abc.abstractmethod
    async def revoke(self, jti: str, doc: Doc) -> bool:
        """Record a revocation (doc: jti, by, at, reason, termination_id?). False if already revoked."""

    @abc.abstractmethod
    async def revocations(self) -> dict[str, Doc]: ...

    @abc.abstractmethod
    async def revoked_among(self, jtis: list[str]) -> set[str]:
        """Which of these jtis are revoked (a chain's worth: cheap on every heartbeat)."""

    # -- one-time tokens shared by every replica --------------------------------------------------------
    @abc.abstractmethod
    async def first_use(self, key: str, ttl_s: float, now: float) -> bool:
        """True the first time ``key`` is seen within ``ttl_s`` (proof replay protection)."""

    # -- the event log sidecars follow ---------------------------------------------------------------
    @abc.abstractmethod
    async def append_event(self, kind: str, target: str | None, payload: Doc, at: float) -> int:
        """Append and return the new sequence number (strictly increasing, shared by all replicas)."""

    @abc.abstractmethod
    async def events_after(self, seq: int, limit: int = 500) -> list[Event]: ...

    @abc.abstractmethod
    async def event_bounds(self) -> tuple[int, int]:
        """(oldest retained seq, newest seq); (0, 0) when empty. Older events are trimmed."""

    async def wait_events(self, after: int, timeout: float) -> None:
        """Return when an event newer than ``after`` may exist, or after ``timeout``. Backends shared by
        several replicas override this to wake on other replicas' appends; a single process is woken by
        its own publisher, so the default just sleeps."""
        await asyncio.sleep(timeout)

    # -- sidecar runs and their leases -------------------------------------------------------------------
    # One document per sidecar run (keyed by run id; it names its agent and link): see tether/controlplane/runs.py.
    @abc.abstractmethod
    async def put_sidecar(self, run_id: str, doc: Doc) -> None: ...

    @abc.abstractmethod
    async def get_sidecar(self, run_id: str) -> Doc | None: ...

    @abc.abstractmethod
    async def all_sidecars(self) -> dict[str, Doc]:
        """Every run, by run id."""

    # -- call reports ----------------------------------------------------------------------------------
    @abc.abstractmethod
    async def put_reports(self, reports: list[Doc]) -> Stored:
        """Store final call reports, idempotent on call_id: returns (new, duplicates) and the new ids."""

    @abc.abstractmethod
    async def reports(self, agents: list[str] | None = None) -> list[Doc]: ...

    @abc.abstractmethod
    async def put_starts(self, starts: list[Doc]) -> None:
        """Store calls written ahead (a start before the call left), keeping the first of each call_id. A
        start never replaces anything; a final report for the same call makes it moot (``starts`` may still
        return it: callers skip starts whose call has a final report)."""

    @abc.abstractmethod
    async def starts(self, agents: list[str]) -> list[Doc]:
        """The starts of these agents' calls that have no final report yet (possibly a few that do)."""

    # -- approvals, terminations: small documents by id ----------------------------------------------
    @abc.abstractmethod
    async def put_doc(self, kind: str, doc_id: str, doc: Doc) -> None: ...

    @abc.abstractmethod
    async def get_doc(self, kind: str, doc_id: str) -> Doc | None: ...

    @abc.abstractmethod
    async def list_docs(self, kind: str) -> list[Doc]: ...

    @abc.abstractmethod
    async def cas_doc(self, kind: str, doc_id: str, expect_version: int, doc: Doc) -> bool:
        """Replace doc only if its ``version`` field still equals expect_version (0: must not exist)."""

    # -- leases on work that exactly one replica may drive ----------------------------------------------
    @abc.abstractmethod
    async def try_lease(self, name: str, owner: str, ttl_s: float, now: float) -> bool:
        """Take or renew the named lease for owner; False while another owner holds it."""

    # -- budgets: counters the control plane owns, slices of them leased to sidecars -------------------
    # A counter (``tether/capability/budget.py`` names it) holds ``used`` and ``leased``; what is left of it is its
    # limit minus both. A slice is a number of calls taken from several counters at once.
    @abc.abstractmethod
    async def take_slice(self, slice_doc: Doc, counters: list[tuple[str, int]], want: int, fraction: float,
                         ttl_s: float = 0) -> tuple[int, int | None]:
        """Atomically, all or nothing: grant ``slice_size(want, what is left of each counter, fraction)``
        calls, add them to every counter's ``leased``, and store ``slice_doc`` (its ``id`` is the key) open
        with ``n`` set. Returns (granted, None), or (0, index of a counter with nothing left). Idempotent
        on the slice id: a slice already stored answers its own ``n``. ``ttl_s`` > 0 lets the counters be
        forgotten that long after their last change (rate windows)."""

    @abc.abstractmethod
    async def settle_slice(self, slice_id: str, used: int, at: float) -> Doc | None:
        """Atomically close an open slice: ``used`` (at most its ``n``) moves from every counter's ``leased``
        to its ``used``, the rest is returned. The settled doc; None when unknown or settled already (a
        slice is settled once, so never spent twice)."""

    @abc.abstractmethod
    async def open_slices(self) -> list[Doc]: ...

    @abc.abstractmethod
    async def budget_counts(self, counters: list[str]) -> dict[str, tuple[int, int]]:
        """(used, leased) of each counter; (0, 0) for one never drawn on."""
