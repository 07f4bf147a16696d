"""Sealed segments (record form 2, docs/termination.md "Sealed segments"): while agents run, their finished
reports are sealed into chained, signed segments, and a record names the chains instead of listing their calls.

The histories are ``test_record_index``'s (overlapping terminations of p -> c -> g, calls reported, written
ahead, in flight, reported late, acknowledgements, goodbyes, records and addenda in any order) with sealing
passes among the steps: each record, read back through the record API's reader (its calls expanded, following
its segments), must be what the pure whole-log rule (``termination.build_record`` / ``build_addendum``, the
code before segments) gives, call for call and field for field, and the log must verify online and as served.
Then: a termination after N calls sealed and M more gives the same record the old code gives; a tampered
segment (an edited call, a re-signed segment, a dropped segment, a chain named twice) is caught.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st

from tether.capability.jsonpieces import canonical_json
from tether.controlplane import segments as seg
from tether.controlplane import termination as proto
from tether.controlplane.services import kinds
from tether.controlplane.services import terminations as service
from tether.controlplane.services.segments import SegmentService
from tether.controlplane.store import open_store_url

from .test_record_index import (  # noqa: F401  (fixtures)
    SUBJECTS,
    History,
    Identities,
    flushed,
    identities,
    redis_url,
)

Doc = dict[str, Any]


def event(what: str) -> None:
    """hypothesis's ``event`` inside a hypothesis test; nothing outside one."""
    from hypothesis.control import _current_build_context

    if _current_build_context.value is not None:
        hypothesis_event(what)


SERVED = ("sealed", "calls_from", "segments", "hash", "signature")


class SealingHistory(History):
    """``History`` with a sealer (every finished report sealed as soon as the clock passes its start) and
    records compared expanded."""

    def __init__(self, *args: Any, min_calls: int = 1) -> None:
        super().__init__(*args)
        self.sealer = SegmentService(self.store, self.key, lambda: self.now, settle_s=0.0, min_calls=min_calls,
                                     max_calls=2)
        self.named = 0

    async def expanded(self) -> list[Doc]:
        return [await self.plane.records.record(h["record_id"]) for h in await self.store.record_heads()]

    async def step(self, what: str, agent: str, which: int) -> None:
        if what == "seal":
            self.tick()
            if await self.sealer.seal_once():
                event("sealed calls")
            return
        await super().step(what, agent, which)

    async def write(self, tid: str) -> None:
        doc = await self.store.get_doc(kinds.TERMINATION, tid)
        assert doc is not None
        before = await self.expanded()
        self.tick()
        assert await self.store.try_lease(f"termination:{tid}", "me", service.LEASE_S, self.now)
        terms = self.plane.terminations
        if doc["state"] != proto.TERMINATED:
            record_id, unaccounted = await terms.write_record(doc)
            final = proto.finish(doc, record_id, self.now, unaccounted)
            assert await self.store.cas_doc(kinds.TERMINATION, tid, doc["version"], final)
        elif doc.get("open_agents"):
            await terms.amend(doc)
        after = await self.expanded()
        assert after[:len(before)] == before
        for record in after[len(before):]:
            assert record["termination_id"] == tid
            expected = await self.whole_log_rule(doc, record, before)
            strip = {k: v for k, v in record.items() if k not in SERVED}
            assert canonical_json(strip) == canonical_json({k: v for k, v in expected.items() if k not in SERVED})
            assert record["hash"] == proto.record_hash(record)
            if "segments" in record:
                self.named += 1
                event("a record naming segments")
                if any(s == seg.OWN for s in seg.sources_of(record["calls_from"])):
                    event("a record naming segments with calls of its own")
            self.written += 1


SEAL_STEP = st.tuples(st.sampled_from(["call", "call", "seal", "ahead", "inflight", "late", "ack", "bye", "write"]),
                      st.sampled_from(["p", "c", "g"]), st.integers(0, 2))


async def play(url: str, ids: Identities, subjects: list[str], steps: list[tuple[str, str, int]]) -> History:
    store = open_store_url(url)
    await store.open()
    try:
        history = SealingHistory(store, ids, subjects)
        await history.setup()
        for step in steps:
            await history.step(*step)
        for what in ("seal", "ack", "ack", "ack", "write", "write", "write"):
            for which in range(len(subjects)):
                for agent in ("p", "c", "g"):
                    if what == "ack":
                        await history.step("late", agent, which)
                        await history.step("ack", agent, which)
                if what in ("write", "seal"):
                    await history.step(what, "p", which)
        result = await history.plane.records.verify(history.key.public_key())
        assert result.ok, result.problems
        served = await history.expanded()
        checked = proto.verify_records(json.loads(json.dumps(served)), history.key.public_key())
        assert checked.ok, checked.problems
        return history
    finally:
        await store.close()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(subjects=SUBJECTS, steps=st.lists(SEAL_STEP, min_size=4, max_size=30))
def test_records_naming_sealed_segments_are_the_whole_log_rules_on_sqlite(
        identities: Identities, tmp_path_factory: pytest.TempPathFactory, subjects: list[str],  # noqa: F811
        steps: list[tuple[str, str, int]]) -> None:
    path = tmp_path_factory.mktemp("segments-sqlite") / "tether.db"
    history = asyncio.run(play(f"sqlite:///{path}", identities, subjects, steps))
    assert history.written >= len(subjects)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(subjects=SUBJECTS, steps=st.lists(SEAL_STEP, min_size=4, max_size=30))
def test_records_naming_sealed_segments_are_the_whole_log_rules_on_redis(
        identities: Identities, redis_url: str, subjects: list[str],  # noqa: F811
        steps: list[tuple[str, str, int]]) -> None:
    flushed(redis_url)
    history = asyncio.run(play(redis_url, identities, subjects, steps))
    assert history.written >= len(subjects)


# -- N calls sealed, then M more: the record the old code writes ---------------------------------------------------
async def sealed_then_more(url: str, ids: Identities, sealed: int, more: int) -> tuple[History, list[Doc]]:
    store = open_store_url(url)
    await store.open()
    try:
        history = SealingHistory(store, ids, ["p"], min_calls=1)
        history.sealer.max_calls = 7
        await history.setup()
        for _ in range(sealed):
            await history.step("call", "c", 0)
        await history.step("seal", "p", 0)
        for _ in range(more):
            await history.step("call", "c", 0)
        await history.step("inflight", "c", 0)
        await history.step("write", "p", 0)
        log = await history.expanded()
        # What the console searches when it looks for the records of a call: every call, its segments' too.
        head = (await store.record_heads())[0]
        found = {json.loads(t)["call_id"] async for page in history.plane.records.every_call(head) for t in page}
        assert found == {c["call_id"] for c in log[0]["calls"]}
        return history, log
    finally:
        await store.close()


def test_a_termination_after_calls_sealed_then_new_ones_lists_every_call_as_the_old_code_on_redis(
        identities: Identities, redis_url: str) -> None:  # noqa: F811
    flushed(redis_url)
    history, log = asyncio.run(sealed_then_more(redis_url, identities, 30, 5))
    (record,) = log
    assert history.sealer.sealed == 30 and history.written == 1  # compared with the old code's record in write()
    assert [s["count"] for s in record["sealed"]] == [7, 7, 7, 7, 2]
    assert record["calls_from"] == [[0, 7], [1, 7], [2, 7], [3, 7], [4, 2], [-1, 6]]
    import redis

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        assert client.llen(f"tether:0:records:calls:{record['record_id']}") == 6  # stored: only what was not sealed
        assert client.hget("tether:0:chains:closed", identities.links["c"]) == record["record_id"]
    finally:
        client.close()


def test_a_termination_after_calls_sealed_then_new_ones_lists_every_call_as_the_old_code(
        identities: Identities, tmp_path: Path) -> None:  # noqa: F811
    history, log = asyncio.run(sealed_then_more(f"sqlite:///{tmp_path / 't.db'}", identities, 30, 5))
    (record,) = log
    assert history.sealer.sealed == 30 and history.written == 1  # compared with the old code's record in write()
    assert record["segments"] == [{"link": identities.links["c"], "agent": "c", "seq": 5, "head": record["sealed"][-1]
                                   ["hash"], "count": 30}]
    assert [s["count"] for s in record["sealed"]] == [7, 7, 7, 7, 2]
    assert len(record["calls"]) == 36 and record["calls"][-1]["resolution"] == "unknown"
    assert record["calls_from"] == [[0, 7], [1, 7], [2, 7], [3, 7], [4, 2], [-1, 6]]
    db = sqlite3.connect(tmp_path / "t.db")
    assert db.execute("SELECT calls FROM records").fetchone()[0] == 6  # stored: only what was not sealed
    assert db.execute("SELECT closed_by FROM chains WHERE link = ?", (identities.links["c"],)).fetchone()[0] == \
        record["record_id"]


# -- tampering ----------------------------------------------------------------------------------------------------
def tamper_cases(record: Doc, key: Any) -> dict[str, Doc]:
    """The served record with one segment changed each way an attacker (with or without the key) could."""
    edited = json.loads(json.dumps(record))
    edited["calls"][3]["status"] = 500  # a sealed call edited
    resigned = json.loads(json.dumps(edited))  # ... and its segment's hash and signature made again with the key
    texts = [proto.encode_entry(c) for c, s in zip(resigned["calls"], seg.sources_of(resigned["calls_from"]),
                                                   strict=True) if s == 0]
    head = {k: v for k, v in resigned["sealed"][0].items() if k not in ("hash", "signature")}
    resigned["sealed"][0] = seg.sign_segment(head, texts, key)
    dropped = json.loads(json.dumps(record))  # the last segment and its calls gone
    n = dropped["calls_from"][4][1]
    del dropped["sealed"][4]
    dropped["calls"] = dropped["calls"][:28] + dropped["calls"][28 + n:]
    dropped["calls_from"] = [r for i, r in enumerate(dropped["calls_from"]) if i != 4]
    moved = json.loads(json.dumps(record))  # a call moved from a segment to the record's own
    moved["calls_from"] = [[0, 6], [-1, 1], *moved["calls_from"][1:]]
    return {"edited": edited, "resigned": resigned, "dropped": dropped, "moved": moved}


def test_a_tampered_segment_is_caught_by_verify_served_and_in_the_store(identities: Identities,  # noqa: F811
                                                                        tmp_path: Path) -> None:
    history, log = asyncio.run(sealed_then_more(f"sqlite:///{tmp_path / 't.db'}", identities, 30, 5))
    public = history.key.public_key()
    assert proto.verify_records(log, public).ok
    for name, bad in tamper_cases(log[0], history.key).items():
        problems = proto.verify_records([bad], public).problems
        assert problems, name
        if name == "resigned":  # the segment is whole again, but the next one no longer names it
            assert any("prev does not name segment 1" in p for p in problems), problems
    twice = {**log[0], "record_id": "rec-again", "prev_hash": log[0]["hash"]}
    assert any("named already" in p for p in proto.verify_records([log[0], twice], public).problems)
    # In the store: a sealed report's kept text edited is caught by the online verification.
    db = sqlite3.connect(tmp_path / "t.db")
    db.execute("UPDATE reports SET entry = replace(entry, '\"status\":200', '\"status\":201') "
               "WHERE seg = 2 AND call_id = (SELECT MIN(call_id) FROM reports WHERE seg = 2)")
    db.commit()
    db.close()

    async def online() -> tuple[bool, tuple[str, ...]]:
        store = open_store_url(f"sqlite:///{tmp_path / 't.db'}")
        await store.open()
        try:
            result = await History(store, identities, ["p"]).plane.records.verify(public)
            return result.ok, result.problems
        finally:
            await store.close()

    ok, problems = asyncio.run(online())
    assert not ok and any("segment 2 of link" in p and "edited" in p for p in problems), problems


def test_a_served_record_of_form_2_hashes_over_its_own_calls_only() -> None:
    own = [{"call_id": "b", "started_at": 2, "reported": True}]
    body = {"record_id": "r", "prev_hash": "", "segments": [{"link": "l"}], "calls": own}
    sealed_call = {"call_id": "a", "started_at": 1}
    served = {**body, "calls": [sealed_call, *own], "calls_from": [[0, 1], [-1, 1]], "sealed": [{}]}
    assert proto.record_hash(served) == proto.record_hash(body)
    assert seg.stored_form(served)["calls"] == own
    assert proto.record_hash({**served, "calls_from": [[-1, 1], [0, 1]]}) != proto.record_hash(body)


# -- a Redis store from before segments ----------------------------------------------------------------------------
async def staged_after_upgrade(url: str) -> tuple[list[str], bool]:
    """Reports stored as a control plane from before segments left them (no index of loose reports, no mark):
    the first record's staging builds the index from the index by start, and stages every report."""
    import redis.asyncio as aioredis

    store = open_store_url(url)
    await store.open()
    try:
        reports = [{"call_id": f"old-{i:03d}", "agent": "old", "method": "GET", "url": "http://t/", "link": "L",
                    "started_at": 1000.0 + (i * 37) % 50, "resolution": "completed", "status": 200}
                   for i in range(50)]
        await store.put_reports(reports)
        client = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            await client.delete("tether:0:reports:loose:old")
            await client.srem("tether:0:reports:loosed", "old")
        finally:
            await client.aclose()
        staged = [cid async for page in store.stage_reports("rec-x", 0, ["old"], {"L"}, 7) for cid, _ in page.entries]
        marked = bool(await store.r.sismember("tether:0:reports:loosed", "old"))  # type: ignore[attr-defined]
        return staged, marked
    finally:
        await store.close()


def test_a_redis_store_from_before_segments_stages_every_report(redis_url: str) -> None:  # noqa: F811
    flushed(redis_url)
    staged, marked = asyncio.run(staged_after_upgrade(redis_url))
    assert marked and len(staged) == 50
    assert staged == [f"old-{i:03d}" for i in sorted(range(50), key=lambda i: ((i * 37) % 50, i))]


# -- the order of a chain's calls when starts tie: Redis filters in a script, SQLite in SQL; both by bytes ---
TIED_IDS = ["b", "a", "B", "é", "Z", "aa", "a\u0301", "\U0001f600", "ß", "~", "a b"]


def tied_report(cid: str, link: str, started: float) -> Doc:
    return {"call_id": cid, "agent": "tie", "method": "GET", "url": "http://t/", "link": link,
            "started_at": started, "ended_at": started, "resolution": "completed", "status": 200,
            "capability": "x"}


async def sealed_in_order(url: str) -> tuple[list[list[str]], list[str]]:
    store = open_store_url(url)
    await store.open()
    try:
        reports = [tied_report(cid, "L", 100.0) for cid in TIED_IDS]
        reports += [tied_report(f"other-{cid}", "M", 100.0) for cid in TIED_IDS]  # another link, same agent
        reports += [tied_report("later", "L", 101.0), tied_report("too-new", "L", 1e9)]
        await store.put_reports(reports)
        sealer = SegmentService(store, Ed25519PrivateKey.generate(), lambda: 1000.0, settle_s=0.0, min_calls=1,
                                max_calls=3)
        await sealer.seal_once()
        # Late reports of the same start as the chain's last call: the one sorting before it is never sealed
        # (its record lists it), the one after is sealed by the next pass.
        last = (await store.chains(["L"]))["L"]["last"]
        await store.put_reports([tied_report(last[1] + "\x00", "L", last[0]),
                                 tied_report(last[1][:-1] if len(last[1]) > 1 else "", "L", last[0])])
        await sealer.seal_once()
        segments: list[list[str]] = []
        async for page in store.segment_calls("L"):
            for _, cid, n, _ in page:
                while len(segments) < n:
                    segments.append([])
                segments[n - 1].append(cid)
        return segments, [c for s in segments for c in s]
    finally:
        await store.close()


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_tied_starts_are_sealed_in_byte_order_on_both_stores(kind: str, redis_url: str,  # noqa: F811
                                                            tmp_path: Path) -> None:
    if kind == "redis":
        flushed(redis_url)
        url = redis_url
    else:
        url = f"sqlite:///{tmp_path / 'tether.db'}"
    segments, calls = asyncio.run(sealed_in_order(url))
    tied = sorted(TIED_IDS, key=lambda c: c.encode("utf-8"))
    assert tied == sorted(TIED_IDS)  # Python's str order is UTF-8's byte order
    assert calls[:len(tied) + 1] == [*tied, "later"]
    assert all(len(s) <= 3 for s in segments)
    # the late report sorting after the last sealed call was sealed; the one before it never is
    assert calls[len(tied) + 1:] == ["later\x00"]
    assert "too-new" not in calls and not any(c.startswith("other-") for c in calls)
