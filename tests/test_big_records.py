"""Big records (issue 29, item 6): the record of an agent with tens of thousands of calls, written a page at a
time by a real control-plane process on SQLite and on Redis.

Each call is in the record exactly once with the resolution it was reported with, calls written ahead and
never ended are ``unknown``, ``tether records verify`` holds online and offline (``--file``), ``records show``
reads it, and ``/healthz`` answers while the record is written (requests sent after the termination entered
``reconciling`` and answered before it was ``terminated``, on the control plane's own timestamps). Records
stored whole, by a control plane from before records were stored apart from their calls, still read and
verify the same. Speed and memory are in ``bench/bench_records.py`` (bench/RESULTS.md), never asserted here.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tether.capability import keys
from tether.capability.chain import parse_chain_unverified
from tether.capability.jsonpieces import canonical_json
from tether.controlplane import termination as proto
from tether.controlplane.metrics import Metrics
from tether.controlplane.services.records import RecordService
from tether.controlplane.store import Store, open_store_url
from tether.controlplane.store import redis as redis_store

from .harness import ADMIN_TOKEN, PYTHON, ControlPlaneProcess, RedisServer, prepare_controlplane, wait_until

CALLS = 20_000
STARTS = 7  # written ahead, never ended: the record lists them unknown
RESOLUTIONS = ("completed", "completed", "refused", "failed_not_sent", "cancelled_not_sent", "unknown")


def report(agent: str, link: str, i: int, now: float) -> dict[str, Any]:
    resolution = RESOLUTIONS[i % len(RESOLUTIONS)]
    # Starts out of call-id order (i * 7919 mod CALLS), so the record's order (by start) is not the store's.
    started = now + ((i * 7919) % CALLS) * 1e-3
    return {"call_id": f"{agent}-{i:06d}", "agent": agent, "method": "GET",
            "url": f"http://127.0.0.1:9/issues/{i}", "started_at": started, "capability": "issues.read",
            "tier": "direct", "resolution": resolution, "status": 200 if resolution == "completed" else None,
            "code": None, "ended_at": started + 0.002, "capture_ref": None, "termination_id": None, "detail": None,
            "link": link, "run_id": "run-big", "received_at": started + 0.5}


async def fill(store_url: str, agent: str, link: str) -> None:
    store = open_store_url(store_url)
    await store.open()
    try:
        now = time.time() - 3600
        for start in range(0, CALLS, 5000):
            await store.put_reports([report(agent, link, i, now) for i in range(start, min(CALLS, start + 5000))])
        await store.put_starts([{**report(agent, link, CALLS + i, now), "resolution": None}
                                for i in range(STARTS)])
    finally:
        await store.close()


SEALING = ("--seal-after", "0", "--seal-min", "1000")  # sealed as soon as they are stored, 10,000 a segment


@pytest.fixture(params=["sqlite", "redis", "sqlite-sealed", "redis-sealed"])
def cp(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ControlPlaneProcess]:
    redis = RedisServer(tmp_path / "redis").start() if request.param.startswith("redis") else None
    sealed = request.param.endswith("sealed")
    proc = prepare_controlplane(tmp_path / "cp", 1, 2, 3, grace=0.2, store=redis.url(0) if redis else None,
                                options=SEALING if sealed else ("--seal-min", "0"))
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        if redis is not None:
            redis.stop()


async def chain_of(url: str, link: str) -> dict[str, Any]:
    store = open_store_url(url)
    await store.open()
    try:
        return (await store.chains([link])).get(link) or {}
    finally:
        await store.close()


def cli(cp: ControlPlaneProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "tether", *args, "--controlplane", cp.url], capture_output=True, text=True,
                          env={**cp.env(), "TETHER_ADMIN_TOKEN": ADMIN_TOKEN}, timeout=180)


class HealthProbe:
    """Asks /healthz back to back from a thread: (sent, answered, status) of each answer, wall clock."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.time()
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=60) as resp:
                    self.answers.append((sent, time.time(), resp.status))
            except OSError:
                self.answers.append((sent, time.time(), 0))
            time.sleep(0.005)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(70)


def test_a_big_record_holds_every_call_once_verifies_and_healthz_answers(cp: ControlPlaneProcess,
                                                                           tmp_path: Path) -> None:
    admin = cp.client()
    admin.timeout = 120
    ident = cp.issue("big", {"issues.read": "direct"})
    admin.request("POST", "/v1/chains/register", {"chain": ident.wire})
    link = parse_chain_unverified(ident.wire)[-1].hash
    url = cp.store or f"sqlite:///{cp.directory / 'tether.db'}"
    asyncio.run(fill(url, "big", link))
    sealed = cp.options == SEALING
    chain: dict[str, Any] = {}
    if sealed:  # record form 2: sealed into the link's chain before the termination, until the sealer is done
        # (a pass between two batches of the fill leaves the reports of later batches that sort before its last
        # call unsealed: the record lists those itself)
        seen: list[int] = []

        def settled() -> bool:
            chain.update(asyncio.run(chain_of(url, link)))
            seen.append(chain.get("count", 0))
            return len(seen) > 1 and seen[-1] == seen[-2] > 0

        wait_until(settled, 120, 3.0, "the sealer to seal what it can")

    with HealthProbe(cp.url) as probe:
        tid = admin.request("POST", "/v1/agents/big/terminate", {"mode": "abort", "window_s": 0,
                                                                 "reason": "big"})["termination_id"]
        doc = wait_until(lambda: (d := admin.request("GET", f"/v1/terminations/{tid}"))["state"] == "terminated"
                         and d, 120, 0.1, "the termination to end in a record")
    reconciling = next(step["at"] for step in doc["history"] if step["state"] == "reconciling")
    during = [a for a in probe.answers if a[0] >= reconciling and a[1] <= doc["completed_at"]]
    # (A record naming its sealed segments may be written in a few ms: no probe need fall inside it.)
    assert (during or sealed) and all(status == 200 for _, _, status in during), (
        reconciling, doc["completed_at"], during[:5])

    record = admin.request("GET", f"/v1/records/{tid}")
    reported = [c for c in record["calls"] if c.get("reported", True)]
    ids = [c["call_id"] for c in reported]
    assert len(ids) == len(set(ids)) == CALLS
    now = 0.0  # only the order matters
    want = {f"big-{i:06d}": RESOLUTIONS[i % len(RESOLUTIONS)] for i in range(CALLS)}
    assert {c["call_id"]: c["resolution"] for c in reported} == want
    assert [proto.in_order_key(c) for c in reported] == sorted(proto.in_order_key(c) for c in reported)
    unknown = [c for c in record["calls"] if c.get("reported", True) is False]
    assert sorted(c["call_id"] for c in unknown) == [f"big-{CALLS + i:06d}" for i in range(STARTS)]
    assert all(c["resolution"] == "unknown" for c in unknown) and now == 0.0
    assert [u["agent"] for u in record["agents_unaccounted"]] == ["big"]  # no sidecar ever answered for it

    if sealed:  # named by the record, not listed in it: its own calls are the rest, and the 7 unknown ones
        assert [(r["seq"], r["count"]) for r in record["segments"]] == [(chain["seq"], chain["count"])]
        own = sum(n for source, n in record["calls_from"] if source == -1)
        assert own == CALLS - chain["count"] + STARTS and record["calls_from"][-1][0] == -1
    else:
        assert "segments" not in record and "calls_from" not in record

    # The hash is over the whole record, its canonical JSON, as for any record: verify online, and offline.
    assert record["hash"] == proto.record_hash(record)
    online = cli(cp, "records", "verify")
    assert online.returncode == 0 and "ok: 1 record(s)" in online.stdout, online.stdout + online.stderr
    saved = tmp_path / "records.json"
    with urllib.request.urlopen(urllib.request.Request(cp.url + "/v1/records",
                                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}), timeout=120) as resp:
        saved.write_bytes(resp.read())
    assert json.loads(saved.read_bytes())[0] == record
    offline = cli(cp, "records", "verify", "--file", str(saved), "--trust", f"{cp.signing_key_path}.pub")
    assert offline.returncode == 0, offline.stdout + offline.stderr
    shown = cli(cp, "records", "show", record["record_id"])
    assert shown.returncode == 0 and f"calls: {CALLS + STARTS}" in shown.stdout, shown.stderr
    if sealed:  # one record alone, with only the public key: its segments checked too, an edited sealed call caught
        (tmp_path / "record.json").write_text(json.dumps(record))
        proved = cli(cp, "records", "prove", record["record_id"])
        assert proved.returncode == 0, proved.stderr
        (tmp_path / "proof.json").write_text(proved.stdout)
        note = wait_until(lambda: (out := cli(cp, "records", "checkpoint").stdout).split("\n")[1:2] == ["1"] and out,
                          60, 0.5, "the checkpoint of the one record")
        (tmp_path / "checkpoint").write_text(note)
        args = ["--proof", str(tmp_path / "proof.json"), "--checkpoint", str(tmp_path / "checkpoint"),
                "--trust", f"{cp.signing_key_path}.pub"]
        one = cli(cp, "records", "verify-one", str(tmp_path / "record.json"), *args)
        assert one.returncode == 0, one.stdout + one.stderr
        edited = json.loads(json.dumps(record))
        edited["calls"][0]["resolution"] = "refused"  # the first call is sealed (calls_from starts with a segment)
        assert record["calls_from"][0][0] == 0
        (tmp_path / "edited.json").write_text(json.dumps(edited))
        bad = cli(cp, "records", "verify-one", str(tmp_path / "edited.json"), *args)
        assert bad.returncode == 1 and "segment 1 of link" in bad.stdout, bad.stdout + bad.stderr


# -- records stored whole, by a control plane from before ----------------------------------------------------
def old_record(signing: Any) -> dict[str, Any]:
    term = proto.new_termination("term-old", "old", "abort", 0, "", "admin", 100.0, ["old"], 1.0)
    calls = [{"call_id": f"old-{i}", "agent": "old", "method": "GET", "url": "http://x/é", "started_at": 100.0 + i,
              "capability": "issues.read", "resolution": "completed", "status": 200, "capture_ref": None}
             for i in range(70)]
    starts = [{"call_id": "old-lost", "agent": "old", "started_at": 99.0, "method": "GET", "url": "http://x/"}]
    record = proto.build_record(term, record_id="rec-old", reports=calls, links=[], revocations={}, runs=[],
                                acks={}, prev_hash="", now=101.0, starts=starts)
    return proto.seal(record, signing)


async def read_back(url: str, public: Any) -> tuple[list[dict[str, Any]], dict[str, Any], bool]:
    store = open_store_url(url)
    await store.open()
    try:
        in_place = (await RecordService(store, Metrics(), time.time).verify(public)).ok  # a page at a time
        return await store.records(), await store.call_holders(["old-3", "old-lost", "nobody"]), in_place
    finally:
        await store.close()


def check_read_back(url: str, whole: dict[str, Any], public: Any) -> None:
    for _ in range(2):  # split once on the first open; the same on the next
        records, holders, in_place = asyncio.run(read_back(url, public))
        assert records == [whole]
        assert proto.verify_records(records, public).ok and in_place
        assert holders == {"old-3": ("rec-old", ()), "old-lost": (None, ("rec-old",))}


def test_a_record_stored_whole_by_an_older_sqlite_store_reads_and_verifies(tmp_path: Path) -> None:
    signing = keys.generate()
    whole = old_record(signing)
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE records (pos INTEGER PRIMARY KEY AUTOINCREMENT, hash TEXT UNIQUE NOT NULL, "
               "prev_hash TEXT UNIQUE NOT NULL, doc TEXT NOT NULL)")
    db.execute("INSERT INTO records (hash, prev_hash, doc) VALUES (?, ?, ?)",
               (whole["hash"], "", json.dumps(whole)))
    db.commit()
    db.close()
    check_read_back(f"sqlite:///{path}", whole, signing.public_key())


def test_a_record_stored_whole_by_an_older_redis_store_reads_and_verifies(tmp_path: Path) -> None:
    signing = keys.generate()
    whole = old_record(signing)
    redis = RedisServer(tmp_path / "redis").start()
    try:
        assert redis.command("RPUSH", "tether:0:records", json.dumps(whole)).startswith(b":1")
        assert redis.command("SET", "tether:0:records:head", whole["hash"]).startswith(b"+OK")
        check_read_back(redis.url(0), whole, signing.public_key())
    finally:
        redis.stop()


def test_record_pieces_are_the_canonical_json_of_the_whole_record() -> None:
    record = old_record(keys.generate())
    header = {k: v for k, v in record.items() if k != "calls"}
    entries = [proto.encode_entry(c) for c in record["calls"]]
    assert "".join(proto.record_pieces(header, entries)).encode() == canonical_json(record)
    assert "".join(proto.record_pieces(header, [])).encode() == canonical_json({**header, "calls": []})


# -- the order a record's calls come in, from both stores ------------------------------------------------------
async def paged(url: str, reports: list[dict[str, Any]], agents: list[str], page: int) -> list[str]:
    store = open_store_url(url)
    await store.open()
    try:
        await store.put_reports(reports)
        out: list[str] = []
        async for batch in store.report_pages(agents, page):
            assert 0 < len(batch) <= page
            out += [r["call_id"] for r in batch]
            if len(out) == 5:  # a report arriving mid-read, sorting after the point reached: read once
                await store.put_reports([{**reports[0], "call_id": "z-late", "agent": "a", "started_at": 1e12}])
        return out
    finally:
        await store.close()


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_report_pages_come_in_the_record_order_across_agents(kind: str, tmp_path: Path) -> None:
    now = 1000.0
    reports = []
    for i in range(60):  # three agents, starts interleaved, ties on the start (call id decides), one without
        agent = "abc"[i % 3]
        started = None if i == 17 else now + (i // 4)
        reports.append({**report(agent, "link", i, now), "call_id": f"{agent}-{(i * 37) % 101:03d}",
                        "started_at": started})
    want = [r["call_id"] for r in sorted(reports, key=proto.in_order_key)] + ["z-late"]
    assert len(set(want)) == len(want)
    redis = RedisServer(tmp_path / "redis").start() if kind == "redis" else None
    try:
        url = redis.url(0) if redis else f"sqlite:///{tmp_path / 'order.db'}"
        got = asyncio.run(paged(url, reports, ["a", "b", "c"], 7))
    finally:
        if redis is not None:
            redis.stop()
    assert [c for c in got if c != "z-late"] == want[:-1]
    assert got.count("z-late") <= 1 and (got[-1] == "z-late" or "z-late" not in got)


# -- staging a record from the entries kept beside the reports, on both stores ----------------------------------
async def staged_both_ways(url: str, held: dict[str, Any], agents: list[str], links: set[str], page: int,
                           name: str = "rec") -> tuple[list[Any], list[Any], list[str]]:
    """The store's own ``stage_reports`` and the generic one (every report decoded, its entry made afresh),
    each into a record of its own: (fast pages, generic pages, the fast record's entries read back)."""
    store = open_store_url(url)
    await store.open()
    try:
        await store.append_record(held)  # a record that already holds some of the calls as reported
        out: list[list[Any]] = [[], []]
        for n, stage in enumerate((store.stage_reports, partial(Store.stage_reports, store))):
            at = 0
            async for got in stage(f"{name}-{n}", 0, agents, links, page):
                assert len(got.entries) <= page
                out[n].append((got.entries, got.holders))
                at += len(got.entries)
        back: list[str] = []
        async for texts in store.record_calls(f"{name}-0", 3):
            back += texts
        return out[0], out[1], back
    finally:
        await store.close()


@pytest.mark.parametrize("agents", ["abc", "a"])
@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_stage_reports_copies_each_reports_kept_entry_in_the_record_order(kind: str, agents: str, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Several agents (merged) and one (Redis reads its ids inside the script): the same pages as the generic,
    a page staged in several scripts (parts of 3 calls here)."""
    monkeypatch.setattr(redis_store, "STAGE_PART", 3)
    now = 1000.0
    reports = [{**report(agents[i % len(agents)], "mine" if i % 4 else "other", i, now),
                "started_at": now + (i * 13) % 17} for i in range(40)]
    reports[5]["link"] = None  # stored before runs carried a link: goes by agent
    reports[9]["url"] = "http://127.0.0.1:9/é?q=\u2028"  # spelled as the canonical JSON spells it
    held_calls = [reports[i] for i in (1, 2, 3)]
    term = proto.new_termination("term-held", "a", "abort", 0, "", "admin", now, ["a", "b", "c"], 1.0)
    held = proto.seal(proto.build_record(term, record_id="rec-held", reports=held_calls, links=[], revocations={},
                                         runs=[], acks={}, prev_hash="", now=now), keys.generate())
    redis = RedisServer(tmp_path / "redis").start() if kind == "redis" else None
    try:
        url = redis.url(0) if redis else f"sqlite:///{tmp_path / 'stage.db'}"
        asyncio.run(put(url, reports))
        fast, generic, back = asyncio.run(staged_both_ways(url, held, list(agents), {"mine"}, 4))
    finally:
        if redis is not None:
            redis.stop()
    want = [r for r in sorted(reports, key=proto.in_order_key)
            if r["link"] in (None, "mine") and r["call_id"] not in {c["call_id"] for c in held_calls}]
    texts = [text for entries, _ in fast for _, text in entries]
    assert [cid for entries, _ in fast for cid, _ in entries] == [r["call_id"] for r in want]
    assert texts == [proto.encode_entry(proto.call_entry(r)) for r in want] == back
    holders = {cid: h for _, page in fast for cid, h in page.items()}
    assert holders == {c["call_id"]: ("rec-held", ()) for c in held_calls if c["link"] == "mine"}
    assert [e for entries, _ in fast for e in entries] == [e for entries, _ in generic for e in entries]
    assert [len(entries) for entries, _ in fast] == [len(entries) for entries, _ in generic]


async def staged_while_reports_arrive(url: str, reports: list[dict[str, Any]], early: dict[str, Any],
                                      late: dict[str, Any]) -> list[str]:
    """One agent's record staged 3 reports a page; after the first page, a report that sorts before the point
    reached and one that sorts after it are stored. The ids staged, in order."""
    store = open_store_url(url)
    await store.open()
    try:
        await store.put_reports(reports)
        out: list[str] = []
        async for got in store.stage_reports("rec-arrivals", 0, ["a"], {"mine"}, 3):
            if not out:
                await store.put_reports([early, late])
            out += [cid for cid, _ in got.entries]
        return out
    finally:
        await store.close()


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_a_report_stored_while_a_record_is_staged_is_staged_once_or_not_at_all(kind: str, tmp_path: Path) -> None:
    now = 1000.0
    reports = [{**report("a", "mine", i, now), "started_at": now + i} for i in range(10)]
    early = {**report("a", "mine", 50, now), "started_at": now - 5}
    late = {**report("a", "mine", 51, now), "started_at": now + 100}
    redis = RedisServer(tmp_path / "redis").start() if kind == "redis" else None
    try:
        url = redis.url(0) if redis else f"sqlite:///{tmp_path / 'arrivals.db'}"
        got = asyncio.run(staged_while_reports_arrive(url, reports, early, late))
    finally:
        if redis is not None:
            redis.stop()
    first = [r["call_id"] for r in reports]
    assert got[:10] == first  # the snapshot's (SQLite) or the index's as read (Redis): in order, none twice
    # SQLite reads one snapshot: nothing stored since; Redis reads on from the point reached: the one after it, once.
    assert got[10:] == ([] if kind == "sqlite" else [late["call_id"]])
    assert early["call_id"] not in got


async def put(url: str, reports: list[dict[str, Any]]) -> None:
    store = open_store_url(url)
    await store.open()
    try:
        await store.put_reports(reports)
    finally:
        await store.close()


def test_reports_stored_before_entries_were_kept_are_staged_from_the_report(tmp_path: Path) -> None:
    """A file (SQLite) and a Redis from before each report kept its record entry: the record lists the same."""
    now = 1000.0
    reports = [{**report("a", "mine", i, now), "started_at": now + (i * 7) % 11} for i in range(12)]
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE reports (call_id TEXT PRIMARY KEY, agent TEXT NOT NULL, doc TEXT NOT NULL)")
    db.executemany("INSERT INTO reports VALUES (?, ?, ?)", [(r["call_id"], r["agent"], json.dumps(r)) for r in reports])
    db.commit()
    db.close()
    redis = RedisServer(tmp_path / "redis").start()
    try:
        for r in reports:  # as the script before wrote them: the report and its indexes, no entry
            redis.command("HSET", "tether:0:reports", r["call_id"], json.dumps(r))
            redis.command("ZADD", "tether:0:reports:agent:a", "1", r["call_id"])
            redis.command("ZADD", "tether:0:reports:started:a", repr(r["started_at"]), r["call_id"])
        want = [proto.encode_entry(proto.call_entry(r)) for r in sorted(reports, key=proto.in_order_key)]
        for url in (f"sqlite:///{path}", redis.url(0)):
            fresh = {**report("a", "mine", 99, now), "started_at": now + 0.5}  # one stored with its entry
            asyncio.run(put(url, [fresh]))
            expected = sorted([*want, proto.encode_entry(proto.call_entry(fresh))],
                              key=lambda t: proto.in_order_key(json.loads(t)))
            for n in range(2):  # the old ones get their entries the first time; the same the next
                fast, _, back = asyncio.run(staged_both_ways(url, old_record(keys.generate()), ["a"], {"mine"}, 5,
                                                             f"rec-{n}"))
                assert [t for entries, _ in fast for _, t in entries] == expected == back
    finally:
        redis.stop()


# -- a record that takes longer to write than a termination's lease lasts ------------------------------------------
async def write_with_leases(directory: Path, url: str) -> dict[str, Any]:
    """A real ControlPlane (in this process, over the store at ``url``) whose clock reads 1 s later at every
    reading, so a record of several pages outlives the 5 s lease it started with. Two terminations of one agent's
    12 reports (3 a page): ``held``, whose lease another replica holds; ``mine``, whose lease this one holds."""
    from tether.capability.catalog import parse_catalog
    from tether.controlplane.app import ControlPlane
    from tether.controlplane.services import terminations as service

    proc = prepare_controlplane(directory, 1, 2, 3)
    ident = proc.issue("big", {"issues.read": "direct"})
    catalog = parse_catalog(proc.catalog_path.read_text(), str(proc.catalog_path))
    ticks = [time.time()]

    def clock() -> float:
        ticks[0] += 1.0
        return ticks[0]

    store = open_store_url(url)
    await store.open()
    try:
        plane = ControlPlane(store, keys.load_private(proc.signing_key_path.read_bytes()), catalog, ADMIN_TOKEN,
                             clock=clock, replica="me")
        await plane.grants.register_chain(ident.wire)
        link = parse_chain_unverified(ident.wire)[-1].hash
        await store.put_reports([report("big", link, i, ticks[0] - 100) for i in range(12)])
        out: dict[str, Any] = {}
        for name, holder in (("held", "other"), ("mine", "me")):
            doc = {**proto.new_termination(f"term-{name}", "big", "abort", 0, "", "admin", clock(), ["big"], 5.0),
                   "links": [link]}
            assert await store.try_lease(f"termination:{doc['id']}", holder, service.LEASE_S, clock())
            taken = ticks[0]
            try:
                out[name] = await plane.terminations.write_record(doc)
            except service.LeaseLost:
                out[name] = None
            # Who holds the lease now: another owner may take it only once it expired.
            out[f"{name}_renewed"] = not await store.try_lease(f"termination:{doc['id']}", "third",
                                                               service.LEASE_S, taken + service.LEASE_S + 0.5)
        out["heads"] = [h["termination_id"] for h in await store.record_heads()]
        return out
    finally:
        await store.close()


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_a_record_writer_renews_its_lease_page_by_page_and_stops_when_another_replica_holds_it(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.controlplane.services import terminations as service

    monkeypatch.setattr(service, "RECORD_PAGE", 3)
    redis = RedisServer(tmp_path / "redis").start() if kind == "redis" else None
    try:
        url = redis.url(0) if redis else f"sqlite:///{tmp_path / 'lease.db'}"
        out = asyncio.run(write_with_leases(tmp_path / "cp", url))
        if kind == "sqlite":
            db = sqlite3.connect(tmp_path / "lease.db")
            orphans = db.execute("SELECT COUNT(*) FROM record_calls WHERE record_id NOT IN "
                                 "(SELECT record_id FROM records)").fetchone()[0]
            assert orphans == 0  # what the writer that lost its lease had staged is dropped
    finally:
        if redis is not None:
            redis.stop()
    assert out["held"] is None  # another replica holds it: this one writes nothing
    assert out["mine"] is not None and out["mine_renewed"]  # renewed past the 5 s it started with
    assert out["heads"] == ["term-mine"]  # one record, of the termination whose lease it held
