"""One contract, both stores: SQLite in a temporary file and Redis in a real ``redis-server`` this module
starts on a free port. Every test runs on both; a second store instance over the same file or the same
Redis plays a second control plane replica. Redis-only tests cover what only a shared store promises:
waking another replica's long polls, and answering StoreUnavailable while Redis is down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tether.capability.errors import TetherError
from tether.controlplane.store import LinkConflict, Store, StoreUnavailable, open_store_url
from tether.controlplane.store import redis as redis_store
from tether.controlplane.store import sqlite as sqlite_store
from tether.controlplane.store.redis import RedisStore

from .harness import RedisServer

LIVENESS_S = 5.0  # an early wake-up must come well inside the 10 s timeout; this is not a benchmark


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


# -- the two back ends ----------------------------------------------------------------------------------
@dataclass
class Backend:
    name: str
    url: str
    opened: list[Store] = field(default_factory=list)

    async def replica(self) -> Store:
        """A new store instance over the same data: another control plane replica (or a restart)."""
        store = open_store_url(self.url)
        await store.open()
        self.opened.append(store)
        return store


@pytest.fixture(params=["sqlite", "redis"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    if request.param == "sqlite":
        b = Backend("sqlite", f"sqlite:///{tmp_path / 'tether.db'}")
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        server.flush()
        b = Backend("redis", server.url(0))
    try:
        yield b
    finally:
        for store in b.opened:
            await store.close()


@pytest.fixture
async def store(backend: Backend) -> Store:
    return await backend.replica()


def link(n: int, jti: str | None = None, sub: str = "agent") -> dict:
    return {
        "hash": f"h{n}",
        "jti": jti or f"j{n}",
        "iss": "cp",
        "sub": sub,
        "prf": None,
        "compact": f"c{n}",
        "claims": {"caps": {"issues.read": "direct"}, "n": n},
        "registered_at": 1000.0 + n,
    }


def report(call_id: str, agent: str, **extra: object) -> dict:
    return {"call_id": call_id, "agent": agent, "resolution": "completed", "status": 200, **extra}


def record(n: int, prev_hash: str, writer: str = "a") -> dict:
    return {
        "record_id": f"rec-{n}-{writer}",
        "termination_id": f"term-{n}",
        "prev_hash": prev_hash,
        "hash": f"hash-{n}-{writer}",
        "calls": [],
    }


# -- links ------------------------------------------------------------------------------------------------
async def test_links_are_stored_once_and_found_by_hash_and_jti(store: Store) -> None:
    assert await store.put_links([link(1), link(2)]) == 2
    assert await store.put_links([link(1), link(2), link(3)]) == 1
    changed = {**link(1), "compact": "something else"}
    assert await store.put_links([changed]) == 0
    # A jti names one link only: a batch with a link whose jti names another link stores nothing.
    with pytest.raises(LinkConflict) as info:
        await store.put_links([link(5), link(4, jti="j1")])
    assert (info.value.jti, info.value.registered) == ("j1", "h1")
    with pytest.raises(LinkConflict):
        await store.put_links([link(6, jti="j6"), link(7, jti="j6")])
    assert [await store.get_link(h) for h in ("h4", "h5", "h6", "h7")] == [None] * 4

    assert await store.get_link("h1") == link(1)
    assert await store.link_by_jti("j2") == link(2)
    assert await store.get_link("h4") is None
    assert await store.get_link("nope") is None
    assert await store.link_by_jti("nope") is None
    assert [d["hash"] for d in await store.all_links()] == ["h1", "h2", "h3"]
    assert await store.put_links([]) == 0


async def test_a_jti_prefix_names_the_one_link_it_begins(store: Store) -> None:
    from tether.capability.errors import ApiError

    a, b, c = "abcd1234" + "0" * 24, "abcd1234" + "f" * 24, "abcd9999" + "0" * 24
    await store.put_links([link(1, jti=a), link(2, jti=b), link(3, jti=c)])
    assert await store.jtis_beginning("abcd1234") == [a, b]
    assert await store.jtis_beginning("abcd9") == [c]
    assert await store.jtis_beginning("ffff") == []
    assert len(await store.jtis_beginning("abcd", limit=2)) == 2
    for name in (c, c[:10], c[:12] + "…", c.upper()):  # whole, a prefix, copied with an ellipsis, in capitals
        found = await store.link_named(name)
        assert found is not None and found["hash"] == "h3", name
    with pytest.raises(ApiError) as info:
        await store.link_named("abcd1234")
    assert (info.value.code, info.value.http_status) == ("tether.jti_ambiguous", 409)
    assert info.value.details["matches"] == [a, b]
    assert await store.link_named("abcd123") is None  # shorter than 8: never a prefix lookup
    assert await store.link_named("0123456789") is None


async def test_links_registered_through_one_replica_are_seen_by_another(backend: Backend) -> None:
    a, b = await backend.replica(), await backend.replica()
    assert await a.put_links([link(1)]) == 1
    assert await b.put_links([link(1)]) == 0
    assert await b.link_by_jti("j1") == link(1)


def child(n: int, parent: int, sub: str | None = None) -> dict:
    return {**link(n, sub=sub or f"agent-{n}"), "prf": f"h{parent}"}


async def test_descendants_are_the_subtree_by_prf_at_any_depth(backend: Backend) -> None:
    a, b = await backend.replica(), await backend.replica()
    #  h1 -> h2 -> h4 -> h6        h1 -> h3 -> h5        h7 (another root) -> h8
    await a.put_links([link(1), child(2, 1), child(4, 2)])
    await b.put_links([child(3, 1), child(5, 3), child(6, 4), link(7), child(8, 7)])
    await a.put_links([child(4, 2)])  # registered again: still one descendant
    for store in (a, b):
        assert await store.descendants("h1") == {"h2": "agent-2", "h3": "agent-3", "h4": "agent-4",
                                                 "h5": "agent-5", "h6": "agent-6"}
        assert await store.descendants("h2") == {"h4": "agent-4", "h6": "agent-6"}
        assert await store.descendants("h6") == {}
        assert await store.descendants("h7") == {"h8": "agent-8"}
        assert await store.descendants("unknown") == {}


async def test_links_held_by_an_agent_in_registration_order(backend: Backend) -> None:
    a, b = await backend.replica(), await backend.replica()
    await a.put_links([link(1, sub="x"), link(2, sub="y")])
    await b.put_links([link(3, sub="x"), link(1, sub="x")])  # h1 again: not a second entry
    for store in (a, b):
        assert [d["hash"] for d in await store.links_held_by("x")] == ["h1", "h3"]
        assert await store.links_held_by("y") == [link(2, sub="y")]
        assert await store.links_held_by("nobody") == []


async def test_redis_descendants_index_covers_links_stored_before_it_existed(redis_server: RedisServer) -> None:
    """A deployment upgraded in place: links written without the per-parent sets are indexed on first use."""
    redis_server.flush()
    store = await _opened(redis_server.url(0))
    try:
        await store.put_links([link(1), child(2, 1), child(3, 2)])
        await store.r.delete(store._key("links", "children", "h1"), store._key("links", "children", "h2"),
                             store._key("links", "sub", "agent-2"), store._key("links", "indexed"))
        fresh = await _opened(redis_server.url(0))
        try:
            assert await fresh.descendants("h1") == {"h2": "agent-2", "h3": "agent-3"}
            assert [d["hash"] for d in await fresh.links_held_by("agent-2")] == ["h2"]
        finally:
            await fresh.close()
    finally:
        await store.close()


async def _opened(url: str) -> RedisStore:
    store = RedisStore(url)
    await store.open()
    return store


# -- revocations ------------------------------------------------------------------------------------------
async def test_revoke_is_recorded_once(backend: Backend) -> None:
    a, b = await backend.replica(), await backend.replica()
    first = {"jti": "j1", "by": "admin", "at": 1.5, "reason": "first"}
    assert await a.revoke("j1", first) is True
    assert await b.revoke("j1", {**first, "reason": "second"}) is False
    assert await a.revoke("j2", {"jti": "j2", "by": "root", "at": 2.0, "reason": ""}) is True
    revocations = await b.revocations()
    assert revocations["j1"] == first
    assert set(revocations) == {"j1", "j2"}
    assert await b.revoked_among(["j0", "j1", "j2", "j3"]) == {"j1", "j2"}
    assert await b.revoked_among([]) == set()


async def test_first_use_is_shared_and_expires(backend: Backend) -> None:
    a, b = await backend.replica(), await backend.replica()
    assert await a.first_use("proof:abc", 60, now=1000.0) is True
    assert await b.first_use("proof:abc", 60, now=1001.0) is False  # replayed to another replica
    assert await a.first_use("proof:other", 60, now=1001.0) is True


# -- events -------------------------------------------------------------------------------------------------
async def test_event_sequence_is_shared_and_strictly_increasing(backend: Backend) -> None:
    a, b = await backend.replica(), await backend.replica()
    assert await a.event_bounds() == (1, 0)  # never used
    seqs = []
    for i in range(6):
        writer = a if i % 2 == 0 else b
        seqs.append(await writer.append_event("revoke", None if i % 3 else f"agent-{i}", {"i": i, "n": [1]}, i + 0.5))
    assert seqs == [1, 2, 3, 4, 5, 6]
    events = await b.events_after(0)
    assert [e.seq for e in events] == seqs
    assert events[0].kind == "revoke" and events[0].target == "agent-0" and events[1].target is None
    assert events[3].payload == {"i": 3, "n": [1]} and events[3].at == 3.5
    assert [e.seq for e in await a.events_after(2, limit=2)] == [3, 4]
    assert await a.events_after(6) == []
    assert await b.event_bounds() == (1, 6)


async def test_concurrent_appends_from_two_replicas_get_distinct_sequence_numbers(backend: Backend) -> None:
    a, b = await backend.replica(), await backend.replica()
    seqs = await asyncio.gather(*(s.append_event("command", "x", {"k": k}, 0.0) for k in range(40) for s in (a, b)))
    assert sorted(seqs) == list(range(1, 81))
    events = await a.events_after(0, limit=1000)
    assert [e.seq for e in events] == list(range(1, 81))
    assert sorted(e.payload["k"] for e in events) == sorted(list(range(40)) * 2)


async def test_old_events_are_trimmed_and_bounds_say_so(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    # The retention is a module constant (10,000 in production) shrunk here so the test stays fast.
    monkeypatch.setattr(sqlite_store, "EVENT_RETENTION", 5)
    monkeypatch.setattr(redis_store, "EVENT_RETENTION", 5)
    store = await backend.replica()
    for i in range(12):
        await store.append_event("revoke", None, {"i": i}, float(i))
    assert await store.event_bounds() == (8, 12)
    assert [e.seq for e in await store.events_after(0)] == [8, 9, 10, 11, 12]
    assert [e.payload["i"] for e in await store.events_after(9)] == [9, 10, 11]


async def test_wait_events_returns_by_its_timeout(store: Store) -> None:
    started = time.monotonic()
    await store.wait_events(0, 0.2)
    assert time.monotonic() - started < LIVENESS_S


# -- sidecars -----------------------------------------------------------------------------------------------
async def test_sidecars_last_write_wins(backend: Backend) -> None:
    a, b = await backend.replica(), await backend.replica()
    assert await a.get_sidecar("x") is None
    await a.put_sidecar("x", {"agent": "x", "seq": 1, "inflight": []})
    await b.put_sidecar("x", {"agent": "x", "seq": 2, "inflight": ["c1"]})
    await b.put_sidecar("y", {"agent": "y", "seq": 0})
    assert await a.get_sidecar("x") == {"agent": "x", "seq": 2, "inflight": ["c1"]}
    assert await a.all_sidecars() == {"x": {"agent": "x", "seq": 2, "inflight": ["c1"]}, "y": {"agent": "y", "seq": 0}}


# -- reports ------------------------------------------------------------------------------------------------
async def test_reports_are_idempotent_on_call_id_and_filtered_by_agent(backend: Backend) -> None:
    a, b = await backend.replica(), await backend.replica()
    assert await a.put_reports([report("c1", "x"), report("c2", "y"), report("c3", "x")]) == (3, 0)
    stored = await b.put_reports([report("c1", "x", status=500), report("c4", "y")])
    assert stored == (1, 1) and stored.new_ids == {"c4"}  # at least once; the metrics count c4 only
    assert await b.put_reports([]) == (0, 0)
    everything = await a.reports()
    assert [r["call_id"] for r in everything] == ["c1", "c2", "c3", "c4"]
    assert everything[0]["status"] == 200  # the first delivery stands
    assert [r["call_id"] for r in await b.reports(["x"])] == ["c1", "c3"]
    assert [r["call_id"] for r in await b.reports(["y", "x"])] == ["c1", "c2", "c3", "c4"]
    assert await a.reports(["nobody"]) == []
    assert await a.reports([]) == []


async def test_starts_keep_the_first_and_end_with_their_agents_own_report(backend: Backend) -> None:
    """Write-ahead starts: the first of each call id is kept; a final report of the same agent makes it moot
    (it no longer comes back), another agent's report of the same call id does not."""
    a, b = await backend.replica(), await backend.replica()
    await a.put_starts([{**report("s1", "x"), "resolution": None}, {**report("s2", "x"), "resolution": None},
                        {**report("s3", "y"), "resolution": None}])
    await b.put_starts([{**report("s1", "x"), "resolution": None, "url": "second"}])  # a repeat changes nothing
    assert sorted((s["call_id"], s.get("url") == "second") for s in await b.starts(["x"])) == [
        ("s1", False), ("s2", False)]
    await b.put_reports([report("s1", "x"), report("s3", "z")])  # s3 named by another agent: not y's report
    assert [s["call_id"] for s in await a.starts(["x", "y"]) if s["call_id"] != "s2"] == ["s3"]
    assert [s["call_id"] for s in await a.starts(["x"])] == ["s2"]
    await a.put_starts([{**report("s1", "x"), "resolution": None}])  # its final is in: a late start is moot
    assert [s["call_id"] for s in await a.starts(["x"])] == ["s2"]
    assert await a.starts([]) == []


# -- documents ----------------------------------------------------------------------------------------------
async def test_docs_put_get_list(store: Store) -> None:
    assert await store.get_doc("approval", "a1") is None
    await store.put_doc("approval", "a1", {"id": "a1", "version": 1, "status": "pending"})
    await store.put_doc("approval", "a2", {"id": "a2", "version": 1, "status": "pending"})
    await store.put_doc("command", "a1", {"agent": "a1", "mode": "drain"})
    await store.put_doc("approval", "a1", {"id": "a1", "version": 2, "status": "approved"})
    assert await store.get_doc("approval", "a1") == {"id": "a1", "version": 2, "status": "approved"}
    assert await store.get_doc("command", "a1") == {"agent": "a1", "mode": "drain"}
    assert [d["id"] for d in await store.list_docs("approval")] == ["a2", "a1"]  # in order of last write
    assert await store.list_docs("termination") == []


async def test_cas_doc_replaces_only_the_expected_version(backend: Backend) -> None:
    a, b = await backend.replica(), await backend.replica()
    assert await a.cas_doc("termination", "t1", 0, {"id": "t1", "version": 1, "state": "requested"}) is True
    assert await b.cas_doc("termination", "t1", 0, {"id": "t1", "version": 1, "state": "other"}) is False
    assert await b.cas_doc("termination", "t1", 2, {"id": "t1", "version": 3, "state": "draining"}) is False
    assert await b.cas_doc("termination", "t1", 1, {"id": "t1", "version": 2, "state": "draining"}) is True
    assert await a.get_doc("termination", "t1") == {"id": "t1", "version": 2, "state": "draining"}
    assert [d["state"] for d in await a.list_docs("termination")] == ["draining"]


async def test_concurrent_cas_from_two_replicas_has_exactly_one_winner(backend: Backend) -> None:
    a, b = await backend.replica(), await backend.replica()
    await a.cas_doc("termination", "t1", 0, {"id": "t1", "version": 1, "by": None})
    attempts = [(s, who) for who in range(10) for s in (a, b)]
    won = await asyncio.gather(
        *(s.cas_doc("termination", "t1", 1, {"id": "t1", "version": 2, "by": who}) for s, who in attempts)
    )
    assert sum(won) == 1
    winner = attempts[won.index(True)][1]
    assert await b.get_doc("termination", "t1") == {"id": "t1", "version": 2, "by": winner}

    created = await asyncio.gather(
        *(s.cas_doc("termination", "t2", 0, {"id": "t2", "version": 1, "by": who}) for s, who in attempts)
    )
    assert sum(created) == 1


# -- records ------------------------------------------------------------------------------------------------
async def test_records_form_one_chain(store: Store) -> None:
    assert await store.records() == []
    assert await store.append_record(record(1, "")) is True
    assert await store.append_record(record(1, "", writer="b")) is False  # "" is no longer the head
    assert await store.append_record(record(2, "wrong")) is False
    assert await store.append_record(record(2, "hash-1-a")) is True
    assert [r["hash"] for r in await store.records()] == ["hash-1-a", "hash-2-a"]


async def test_two_replicas_racing_on_the_same_head_do_not_fork_the_chain(backend: Backend) -> None:
    a, b = await backend.replica(), await backend.replica()
    assert await a.append_record(record(1, ""))
    won = await asyncio.gather(a.append_record(record(2, "hash-1-a", "a")), b.append_record(record(2, "hash-1-a", "b")))
    assert sorted(won) == [False, True]
    loser, winner = ("a", "b") if won[1] else ("b", "a")
    assert await (a if loser == "a" else b).append_record(record(3, f"hash-2-{winner}", loser)) is True
    chain = await b.records()
    assert [r["prev_hash"] for r in chain] == ["", "hash-1-a", f"hash-2-{winner}"]
    assert all(chain[i]["prev_hash"] == chain[i - 1]["hash"] for i in range(1, len(chain)))


# -- leases -------------------------------------------------------------------------------------------------
async def test_lease_is_exclusive_until_expiry_renewable_and_taken_over(backend: Backend) -> None:
    # Both stores decide on the ``now`` they are given, so a test clock works the same on both.
    a, b = await backend.replica(), await backend.replica()
    assert await a.try_lease("termination:t1", "cp-a", 5.0, now=100.0) is True
    assert await b.try_lease("termination:t1", "cp-b", 5.0, now=101.0) is False
    assert await a.try_lease("termination:t1", "cp-a", 5.0, now=103.0) is True  # renewed: until 108
    assert await b.try_lease("termination:t1", "cp-b", 5.0, now=107.5) is False
    assert await b.try_lease("termination:t1", "cp-b", 5.0, now=108.5) is True  # expired: taken over
    assert await a.try_lease("termination:t1", "cp-a", 5.0, now=109.0) is False
    assert await a.try_lease("termination:t2", "cp-a", 5.0, now=109.0) is True  # leases are independent


async def test_lease_race_has_one_winner(backend: Backend) -> None:
    a, b = await backend.replica(), await backend.replica()
    now = time.time()
    won = await asyncio.gather(
        *(s.try_lease("job", f"owner-{i}-{n}", 5.0, now) for i in range(10) for n, s in enumerate((a, b)))
    )
    assert sum(won) == 1


# -- durability ------------------------------------------------------------------------------------------------
async def test_a_new_instance_sees_everything(backend: Backend) -> None:
    first = await backend.replica()
    await first.put_links([link(1)])
    await first.revoke("j1", {"jti": "j1", "by": "admin", "at": 1.0, "reason": ""})
    seq = await first.append_event("revoke", None, {"jti": "j1"}, 1.0)
    await first.put_sidecar("x", {"agent": "x"})
    await first.put_reports([report("c1", "x")])
    await first.cas_doc("termination", "t1", 0, {"id": "t1", "version": 1})
    await first.append_record(record(1, ""))
    await first.try_lease("job", "cp-a", 30.0, now=time.time())
    await first.close()
    backend.opened.remove(first)

    again = await backend.replica()
    assert await again.get_link("h1") == link(1)
    assert set(await again.revocations()) == {"j1"}
    assert [e.payload for e in await again.events_after(0)] == [{"jti": "j1"}]
    assert await again.append_event("revoke", None, {}, 2.0) == seq + 1
    assert await again.get_sidecar("x") == {"agent": "x"}
    assert await again.put_reports([report("c1", "x")]) == (0, 1)
    assert (await again.get_doc("termination", "t1"))["version"] == 1
    assert [r["hash"] for r in await again.records()] == ["hash-1-a"]
    assert await again.try_lease("job", "cp-b", 30.0, now=time.time()) is False
    assert await again.healthy() is True


# -- Redis only: a shared store's promises ---------------------------------------------------------------------
@pytest.fixture
async def redis_pair(redis_server: RedisServer) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    redis_server.flush()
    a, b = RedisStore(redis_server.url()), RedisStore(redis_server.url())
    await a.open()
    await b.open()
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_redis_wait_events_wakes_when_another_replica_appends(redis_pair: tuple[RedisStore, RedisStore]) -> None:
    a, b = redis_pair
    await asyncio.sleep(0.2)  # let both wake-up listeners subscribe
    waiting = asyncio.create_task(a.wait_events(0, 10.0))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # nothing appended yet: still waiting
    await b.append_event("revoke", None, {"jti": "j1"}, 1.0)
    await asyncio.wait_for(waiting, LIVENESS_S)

    # A caller whose position is already behind the head does not wait at all.
    seq = await b.append_event("revoke", None, {"jti": "j2"}, 2.0)
    started = time.monotonic()
    await a.wait_events(seq - 1, 10.0)
    assert time.monotonic() - started < LIVENESS_S


async def test_redis_database_number_separates_deployments(redis_server: RedisServer) -> None:
    redis_server.flush()
    zero, one = RedisStore(redis_server.url(0)), RedisStore(redis_server.url(1))
    await zero.open()
    await one.open()
    try:
        await asyncio.sleep(0.2)
        assert await zero.append_event("revoke", None, {}, 0.0) == 1
        assert await one.event_bounds() == (1, 0)
        started = time.monotonic()
        await asyncio.gather(one.wait_events(0, 0.5), zero.append_event("revoke", None, {}, 0.0))
        assert time.monotonic() - started >= 0.4  # database 0's appends do not wake database 1's long polls
    finally:
        await zero.close()
        await one.close()


def test_redis_url_is_checked_and_its_password_not_shown() -> None:
    with pytest.raises(TetherError) as err:
        open_store_url("redis://127.0.0.1:6379/tether")
    assert err.value.code == "tether.bad_request"
    store = open_store_url("redis://user:s3cret@127.0.0.1:6379/2")
    assert isinstance(store, RedisStore)
    assert "s3cret" not in store.url and store.url.endswith("127.0.0.1:6379/2")


async def test_redis_down_means_store_unavailable_and_back_means_working(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    down = RedisStore(server.url())
    await down.open()  # Redis is not running yet: the replica starts anyway and says it is unhealthy
    other = RedisStore(server.url())
    try:
        assert await down.healthy() is False
        with pytest.raises(StoreUnavailable):
            await down.revocations()
        server.start()
        assert await down.healthy() is True
        await other.open()
        assert await down.put_links([link(1)]) == 1

        server.stop()
        assert await down.healthy() is False
        calls = [
            lambda: down.put_links([link(2)]),
            lambda: down.get_link("h1"),
            lambda: down.link_by_jti("j1"),
            down.all_links,
            lambda: down.revoke("j1", {}),
            down.revocations,
            lambda: down.append_event("revoke", None, {}, 0.0),
            lambda: down.events_after(0),
            down.event_bounds,
            lambda: down.wait_events(1, 1.0),
            lambda: down.put_sidecar("x", {}),
            lambda: down.get_sidecar("x"),
            down.all_sidecars,
            lambda: down.put_reports([report("c1", "x")]),
            down.reports,
            lambda: down.reports(["x"]),
            lambda: down.put_doc("k", "i", {}),
            lambda: down.get_doc("k", "i"),
            lambda: down.list_docs("k"),
            lambda: down.cas_doc("k", "i", 0, {"version": 1}),
            lambda: down.append_record(record(1, "")),
            down.records,
            lambda: down.try_lease("job", "me", 5.0, time.time()),
        ]
        for call in calls:
            with pytest.raises(StoreUnavailable):
                await call()

        server.start()  # same port; --save "" so it comes back empty
        assert await down.healthy() is True
        assert await down.put_links([link(1)]) == 1
        assert await down.append_event("revoke", None, {}, 0.0) == 1

        # The wake-up listener resubscribed by itself: another replica's append wakes this one again.
        woke = asyncio.Event()

        async def wait_then_flag() -> None:
            _, head = await down.event_bounds()
            await down.wait_events(head, 10.0)
            woke.set()

        started = time.monotonic()
        waiter = asyncio.create_task(wait_then_flag())
        while not woke.is_set() and time.monotonic() - started < 10:
            await other.append_event("revoke", None, {}, 0.0)
            await asyncio.sleep(0.2)
        await waiter
        assert time.monotonic() - started < LIVENESS_S
    finally:
        await down.close()
        await other.close()
        server.stop()
