"""The log's index (``Store.log_view``, ``Store.heads_named``): a record's writer reads what the log says of its
termination and its agents from the index, never every header, and the record is byte for byte the one the
whole-log rule gives (``termination.build_record`` / ``build_addendum`` fed every record so far).

The histories are hypothesis's: overlapping terminations of a parent, its child and grandchild (p -> c -> g),
calls reported, written ahead or left in flight, acknowledgements, goodbyes, calls reported late (after a record
listed them unknown), records and addenda written in any order. Each record is written by the real
``TerminationService`` over a real store (an SQLite file; a real ``redis-server``), and compared with what the
pure builder says given the whole log as it stood. Then: a log written before the index (the index dropped, as
an older control plane left it) is indexed on first use, and a Redis list changed under its index is caught.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tether.capability import keys
from tether.capability.catalog import parse_catalog
from tether.capability.chain import parse_chain_unverified
from tether.capability.jsonpieces import canonical_json
from tether.controlplane import termination as proto
from tether.controlplane.app import ControlPlane
from tether.controlplane.services import kinds
from tether.controlplane.services import terminations as service
from tether.controlplane.services.budgets import budget_use
from tether.controlplane.store import Store, open_store_url
from tether.controlplane.store.base import LogView, index_keys

from .harness import ADMIN_TOKEN, ControlPlaneProcess, RedisServer, prepare_controlplane

Doc = dict[str, Any]
SUBTREE = {"p": ("p", "c", "g"), "c": ("c", "g"), "g": ("g",)}


@dataclass
class Identities:
    proc: ControlPlaneProcess
    wires: dict[str, str] = field(default_factory=dict)  # agent -> its chain
    links: dict[str, str] = field(default_factory=dict)  # agent -> its link's hash
    minted: float = 0.0  # when the chains were minted: a history starts then (they are valid from then on)


@pytest.fixture(scope="module")
def identities(tmp_path_factory: pytest.TempPathFactory) -> Identities:
    proc = prepare_controlplane(tmp_path_factory.mktemp("index-cp"), 1, 2, 3)
    p = proc.issue("p", {"issues.read": "direct"})
    c = proc.delegate(p, "c", {"issues.read": "direct"})
    g = proc.delegate(c, "g", {"issues.read": "direct"})
    out = Identities(proc, minted=float(int(time.time())) + 1)
    for ident in (p, c, g):
        out.wires[ident.agent] = ident.wire
        out.links[ident.agent] = parse_chain_unverified(ident.wire)[-1].hash
    return out


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("index-redis")).start()
    try:
        yield server.url(0)
    finally:
        server.stop()


class History:
    """One history played on a real control plane's services over ``store``, each record checked as written."""

    def __init__(self, store: Store, ids: Identities, subjects: list[str]) -> None:
        self.store, self.ids = store, ids
        self.t0 = self.now = ids.minted
        key = keys.load_private(ids.proc.signing_key_path.read_bytes())
        catalog = parse_catalog(ids.proc.catalog_path.read_text(), str(ids.proc.catalog_path))
        self.plane = ControlPlane(store, key, catalog, ADMIN_TOKEN, clock=lambda: self.now, replica="me")
        self.key = key
        self.subjects = subjects
        self.calls = 0
        self.runs: dict[str, Doc] = {}
        self.written = 0  # records checked

    async def setup(self) -> None:
        for agent in ("p", "c", "g"):
            await self.plane.grants.register_chain(self.ids.wires[agent])
            self.runs[agent] = {"run_id": f"run-{agent}", "agent": agent, "link": self.ids.links[agent],
                                "inflight": [], "last_seen": self.t0, "lease_expires": self.t0 + 1, "final": None}
            await self.store.put_sidecar(f"run-{agent}", self.runs[agent])
        for subject in self.subjects:
            doc = {**proto.new_termination(f"term-{subject}", subject, "abort", 0, "overlap", "admin", self.t0,
                                           SUBTREE[subject], 0.0), "links": [self.ids.links[subject]],
                   "state": proto.RECONCILING}  # revoked, commanded, its window over: its record is next
            assert await self.store.cas_doc(kinds.TERMINATION, doc["id"], 0, doc)

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def _call(self, agent: str) -> Doc:
        self.calls += 1
        return {"call_id": f"c{self.calls:03d}-{agent}", "agent": agent, "capability": "issues.read",
                "method": "GET", "url": "http://t/", "started_at": self.tick()}

    def _report(self, call: Doc, agent: str) -> Doc:
        return {**{k: call[k] for k in ("call_id", "agent", "capability", "method", "url", "started_at")},
                "resolution": "completed", "status": 200, "link": self.ids.links[agent],
                "run_id": f"run-{agent}", "ended_at": self.tick()}

    async def step(self, what: str, agent: str, which: int) -> None:
        run = self.runs[agent]
        if what == "call":
            await self.store.put_reports([self._report(self._call(agent), agent)])
        elif what == "ahead":  # written ahead, its end never heard of (yet)
            await self.store.put_starts([{**self._call(agent), "link": self.ids.links[agent]}])
        elif what == "inflight":
            run["inflight"].append(self._call(agent))
            await self.store.put_sidecar(run["run_id"], run)
        elif what == "late":  # the oldest call it had in flight ends, reported now
            if run["inflight"]:
                await self.store.put_reports([self._report(run["inflight"].pop(0), agent)])
                await self.store.put_sidecar(run["run_id"], run)
        elif what == "ack":
            tid = f"term-{self.subjects[which % len(self.subjects)]}"
            if agent in SUBTREE[tid.removeprefix("term-")]:
                await self.store.put_doc(kinds.ACK, f"{tid}:{run['run_id']}", {
                    "agent": agent, "link": run["link"], "run_id": run["run_id"], "termination_id": tid,
                    "at": self.tick(), "calls": 0, "state": "terminated"})
        elif what == "bye":
            run.update(final="terminated", final_at=self.tick())
            await self.store.put_sidecar(run["run_id"], run)
        elif what == "write":
            await self.write(f"term-{self.subjects[which % len(self.subjects)]}")

    async def write(self, tid: str) -> None:
        """The driver's write of this termination's record (or addendum), then the whole-log rule's."""
        doc = await self.store.get_doc(kinds.TERMINATION, tid)
        assert doc is not None
        before = await self.store.records()
        self.tick()
        assert await self.store.try_lease(f"termination:{tid}", "me", service.LEASE_S, self.now)
        terms = self.plane.terminations
        if doc["state"] != proto.TERMINATED:
            record_id, unaccounted = await terms.write_record(doc)
            final = proto.finish(doc, record_id, self.now, unaccounted)
            assert await self.store.cas_doc(kinds.TERMINATION, tid, doc["version"], final)
        elif doc.get("open_agents"):
            await terms.amend(doc)
        after = await self.store.records()
        assert after[:len(before)] == before
        for record in after[len(before):]:
            assert record["termination_id"] == tid
            expected = await self.whole_log_rule(doc, record, before)
            assert canonical_json(record) == canonical_json(expected), (record, expected)
            self.written += 1
            for name in ("amends", "calls_held_by", "accounts_for"):
                if name in record:
                    event(f"a record with {name}")
            if any(not c.get("reported", True) for c in record["calls"]):
                event("a record with unknown calls")

    async def whole_log_rule(self, doc: Doc, record: Doc, log: list[Doc]) -> Doc:
        """What the pure builder writes for ``doc`` with every record so far (``log``) and the store's facts."""
        terms = self.plane.terminations
        mine, acks = await terms.facts(doc)
        graph = await self.plane.grants.graph()
        hashes = service._links_of(doc, graph)
        links = [graph.by_hash[h] for h in hashes if h in graph.by_hash]
        reports = [r for r in await self.store.reports(doc["agents"]) if r.get("link") in hashes]
        prev = log[-1]["hash"] if log else ""
        if "amends" in record:
            built = proto.build_addendum(doc, log, record_id=record["record_id"], reports=reports, runs=mine,
                                         acks=acks, prev_hash=prev, now=record["completed_at"])
            assert built is not None
        else:
            starts = [s for s in await self.store.starts(doc["agents"]) if s.get("link") in hashes]
            built = proto.build_record(doc, record_id=record["record_id"], reports=reports, links=links,
                                       revocations=await self.store.revocations(), runs=mine, acks=acks,
                                       prev_hash=prev, now=record["completed_at"], starts=starts,
                                       budgets=await budget_use(self.store, links, self.now), log=log)
        return proto.seal(built, self.key)


STEP = st.tuples(st.sampled_from(["call", "ahead", "inflight", "late", "ack", "bye", "write", "write"]),
                 st.sampled_from(["p", "c", "g"]), st.integers(0, 2))
HISTORY = st.lists(STEP, min_size=4, max_size=28)
SUBJECTS = st.lists(st.sampled_from(sorted(SUBTREE)), min_size=2, max_size=3, unique=True)


async def play(url: str, ids: Identities, subjects: list[str], steps: list[tuple[str, str, int]]) -> int:
    store = open_store_url(url)
    await store.open()
    try:
        history = History(store, ids, subjects)
        await history.setup()
        for step in steps:
            await history.step(*step)
        for what in ("ack", "ack", "ack", "write", "write", "write"):  # everyone answers; every driver writes
            for which in range(len(subjects)):
                for agent in ("p", "c", "g"):
                    if what == "ack":
                        await history.step("late", agent, which)
                        await history.step("ack", agent, which)
                if what == "write":
                    await history.step("write", "p", which)
        return history.written
    finally:
        await store.close()


def flushed(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(subjects=SUBJECTS, steps=HISTORY)
def test_records_written_with_the_index_are_the_whole_log_rules_on_sqlite(
        identities: Identities, tmp_path_factory: pytest.TempPathFactory, subjects: list[str],
        steps: list[tuple[str, str, int]]) -> None:
    path = tmp_path_factory.mktemp("index-sqlite") / "tether.db"
    assert asyncio.run(play(f"sqlite:///{path}", identities, subjects, steps)) >= len(subjects)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(subjects=SUBJECTS, steps=HISTORY)
def test_records_written_with_the_index_are_the_whole_log_rules_on_redis(
        identities: Identities, redis_url: str, subjects: list[str], steps: list[tuple[str, str, int]]) -> None:
    flushed(redis_url)
    assert asyncio.run(play(redis_url, identities, subjects, steps)) >= len(subjects)


# -- a log written before the index, and an index that disagrees with the log ------------------------------------
def header(i: int, prev: str, termination: str, left: list[str]) -> Doc:
    return {"record_id": f"rec-{i}", "termination_id": termination, "prev_hash": prev, "hash": f"hash-{i}",
            "agents_unaccounted": [{"agent": a, "runs": []} for a in left], "agents_terminated": [], "calls": []}


LOG = [("term-a", ["x"]), ("term-b", []), ("term-a", ["y"]), ("term-c", ["x", "y"]), ("term-d", ["z"])]


async def fill(store: Store) -> list[Doc]:
    heads: list[Doc] = []
    for i, (tid, left) in enumerate(LOG):
        record = header(i, heads[-1]["hash"] if heads else "", tid, left)
        assert await store.append_record(record)
        heads.append({k: v for k, v in record.items() if k != "calls"})
    return heads


def whole_log_view(heads: list[Doc], termination: str, agents: list[str]) -> list[str]:
    wanted = {f"term:{termination}", *(f"left:{a}" for a in agents)}
    return [h["record_id"] for h in heads if wanted & set(index_keys(h))]


async def views(store: Store) -> list[tuple[LogView, list[str]]]:
    heads = await store.record_heads()
    out = []
    for tid, agents in (("term-a", []), ("term-b", ["x"]), ("term-e", ["y", "z"]), ("term-d", ["q"])):
        out.append((await store.log_view(tid, agents), whole_log_view(heads, tid, agents)))
    return out


def check_views(found: list[tuple[LogView, list[str]]]) -> None:
    for view, expected in found:
        assert [h["record_id"] for _, h in view.heads] == expected
        assert view.head is not None and view.head["record_id"] == "rec-4"
        assert [at for at, _ in view.heads] == sorted(at for at, _ in view.heads)


def drop_sqlite_index(path: Path) -> None:
    """What a file written by a control plane from before the index looks like: no index rows."""
    db = sqlite3.connect(path)
    db.execute("DELETE FROM record_keys")
    db.execute("DELETE FROM record_index")
    db.commit()
    db.close()


def append_as_an_older_control_plane(path: Path, record: Doc) -> None:
    """A record appended the way a control plane from before the index appends one: the header's row only."""
    db = sqlite3.connect(path)
    db.execute("INSERT INTO records (hash, prev_hash, doc, record_id, calls) VALUES (?, ?, ?, ?, 0)",
               (record["hash"], record["prev_hash"], json.dumps(record), record["record_id"]))
    db.commit()
    db.close()


def test_an_sqlite_log_from_before_the_index_is_indexed_when_opened(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"

    async def run(fresh: bool) -> list[tuple[LogView, list[str]]]:
        store = open_store_url(url)
        await store.open()
        try:
            if fresh:
                heads = await fill(store)
                assert await store.heads_named(["rec-1", "rec-3", "rec-9"], 10**9) == [
                    (at, h) for at, h in await _positions(store, heads) if h["record_id"] in ("rec-1", "rec-3")]
            return await views(store)
        finally:
            await store.close()

    async def of_term_a() -> tuple[LogView, list[str]]:
        store = open_store_url(url)
        await store.open()
        try:
            return await store.log_view("term-a", []), [h["record_id"] for h in await store.record_heads()]
        finally:
            await store.close()

    def indexed() -> tuple[int, int]:
        db = sqlite3.connect(tmp_path / "old.db")
        try:
            return (db.execute("SELECT upto FROM record_index").fetchone()[0],
                    db.execute("SELECT COUNT(*) FROM record_keys").fetchone()[0])
        finally:
            db.close()

    check_views(asyncio.run(run(True)))
    drop_sqlite_index(tmp_path / "old.db")
    check_views(asyncio.run(run(False)))
    assert indexed() == (len(LOG), len(LOG) + sum(len(x) for _, x in LOG))
    # An older control plane appends to the upgraded file: its record is filed before the index answers.
    older = {k: v for k, v in header(5, "hash-4", "term-a", ["x"]).items() if k != "calls"}
    append_as_an_older_control_plane(tmp_path / "old.db", older)
    view, ids = asyncio.run(of_term_a())
    assert ids[-1] == "rec-5" and view.head is not None and view.head["record_id"] == "rec-5"
    assert [h["record_id"] for _, h in view.heads] == ["rec-0", "rec-2", "rec-5"]
    assert indexed() == (len(LOG) + 1, len(LOG) + sum(len(x) for _, x in LOG) + 2)


async def _positions(store: Store, heads: list[Doc]) -> list[tuple[int, Doc]]:
    view = await store.log_view("none", [])
    named = await store.heads_named([h["record_id"] for h in heads], view.at)
    assert [h for _, h in named] == heads
    assert await store.heads_from(0) == named and await store.heads_from(named[2][0]) == named[2:]
    assert await store.heads_from(named[-1][0] + 1) == []
    return named


def test_a_redis_log_from_before_the_index_is_indexed_on_first_use_and_a_list_changed_under_it_is_caught(
        redis_url: str) -> None:
    import redis

    flushed(redis_url)
    client = redis.Redis.from_url(redis_url, decode_responses=True)

    async def run(fill_it: bool) -> list[tuple[LogView, list[str]]]:
        store = open_store_url(redis_url)
        await store.open()
        try:
            if fill_it:
                heads = await fill(store)
                positions = await _positions(store, heads)
                assert [at for at, _ in positions] == list(range(len(LOG)))
                assert await store.heads_named(["rec-3"], 2) == []  # after the position asked about
            return await views(store)
        finally:
            await store.close()

    async def swapped_views() -> list[list[str]]:
        store = open_store_url(redis_url)
        await store.open()
        try:
            return [[h["record_id"] for _, h in (await store.log_view(tid, agents)).heads]
                    for tid, agents in (("term-b", ["x"]), ("term-a", []))]
        finally:
            await store.close()

    try:
        check_views(asyncio.run(run(True)))
        prefix = next(k for k in client.scan_iter("*records:keys")).removesuffix("records:keys")
        client.delete(f"{prefix}records:keys", f"{prefix}records:keyed")  # as a control plane from before left it
        check_views(asyncio.run(run(False)))
        assert int(client.get(f"{prefix}records:keyed")) == len(LOG)
        # The list changed under its index (record 1 swapped for another termination's): the index names a
        # record that no longer says so when it is read, and is built again from the log.
        swapped = json.loads(client.lindex(f"{prefix}records", 1))
        client.lset(f"{prefix}records", 1, json.dumps({**swapped, "termination_id": "term-a"}))
        found = asyncio.run(swapped_views())
        assert found == [["rec-0", "rec-3"], ["rec-0", "rec-1", "rec-2"]]
    finally:
        client.close()
