"""The budget part of the store contract, on both stores (SQLite file, real redis-server): slices are taken all
or nothing from every counter, sized by ``tether/capability/budget.slice_size``, settled exactly once, and two
replicas racing for the last calls of a budget never take more than it holds."""

from __future__ import annotations

import asyncio

from tether.capability.budget import slice_size
from tether.capability.protocol import HeldSlices
from tether.controlplane.services.budgets import MAX_SEQ, given_up
from tether.controlplane.store import Store

from . import test_store_contract as contract
from .test_store_contract import Backend

# The contract's fixtures (both stores, a real redis-server), shared rather than copied.
backend, store, redis_server = contract.backend, contract.store, contract.redis_server


def doc(slice_id: str) -> dict:
    return {"id": slice_id, "run": "run-1", "agent": "a", "capability": "svc.call", "taken_at": 1.5}


async def test_take_is_sized_by_the_tightest_counter_and_leases_from_every_one(store: Store) -> None:
    counters = [("root/svc.call", 100), ("child/svc.call", 8)]
    granted, worst = await store.take_slice(doc("s1"), counters, want=50, fraction=0.25)
    assert (granted, worst) == (slice_size(50, [100, 8], 0.25), None) == (2, None)
    assert await store.budget_counts(["root/svc.call", "child/svc.call", "never"]) == {
        "root/svc.call": (0, 2), "child/svc.call": (0, 2), "never": (0, 0)}
    (open_doc,) = await store.open_slices()
    assert open_doc["id"] == "s1" and open_doc["n"] == 2 and open_doc["state"] == "open"
    assert open_doc["keys"] == ["root/svc.call", "child/svc.call"]


async def test_take_is_idempotent_on_the_slice_id(store: Store) -> None:
    counters = [("k", 100)]
    first = await store.take_slice(doc("s1"), counters, want=4, fraction=1.0)
    again = await store.take_slice(doc("s1"), counters, want=40, fraction=1.0)
    assert first == again == (4, None)
    assert await store.budget_counts(["k"]) == {"k": (0, 4)}


async def test_nothing_left_takes_nothing_and_names_the_counter(store: Store) -> None:
    counters = [("big", 100), ("small", 1)]
    assert await store.take_slice(doc("s1"), counters, want=10, fraction=1.0) == (1, None)
    assert await store.take_slice(doc("s2"), counters, want=10, fraction=1.0) == (0, 1)
    # All or nothing: the refused take left the roomy counter untouched.
    assert await store.budget_counts(["big", "small"]) == {"big": (0, 1), "small": (0, 1)}
    assert [d["id"] for d in await store.open_slices()] == ["s1"]


async def test_settle_moves_used_and_returns_the_rest_once(store: Store) -> None:
    counters = [("a", 10), ("b", 20)]
    await store.take_slice(doc("s1"), counters, want=6, fraction=1.0)
    settled = await store.settle_slice("s1", 4, at=9.0)
    assert settled is not None and settled["used"] == 4 and settled["state"] == "settled"
    assert await store.budget_counts(["a", "b"]) == {"a": (4, 0), "b": (4, 0)}
    assert await store.settle_slice("s1", 0, at=10.0) is None  # never settled twice
    assert await store.settle_slice("unknown", 1, at=10.0) is None
    assert await store.open_slices() == []
    # What was returned can be taken again; what was used cannot.
    assert await store.take_slice(doc("s2"), counters, want=100, fraction=1.0) == (6, None)
    # A settle never moves more than the slice held.
    assert (await store.settle_slice("s2", 99, at=11.0))["used"] == 6
    assert await store.budget_counts(["a"]) == {"a": (10, 0)}


async def test_the_counts_survive_a_restart(backend: Backend) -> None:
    one = await backend.replica()
    await one.take_slice(doc("s1"), [("k", 10)], want=3, fraction=1.0)
    await one.settle_slice("s1", 2, at=1.0)
    await one.take_slice(doc("s2"), [("k", 10)], want=5, fraction=1.0)
    again = await backend.replica()
    assert await again.budget_counts(["k"]) == {"k": (2, 5)}
    assert [d["id"] for d in await again.open_slices()] == ["s2"]


async def test_two_replicas_racing_never_take_more_than_the_budget(backend: Backend) -> None:
    a, b = await backend.replica(), await backend.replica()
    budget = 37

    async def drain(replica: Store, tag: str) -> int:
        total = 0
        for i in range(200):
            granted, _ = await replica.take_slice(doc(f"{tag}{i}"), [("shared", budget)], want=3, fraction=0.5)
            total += granted
        return total

    got = await asyncio.gather(drain(a, "a"), drain(b, "b"))
    assert sum(got) == budget
    assert await a.budget_counts(["shared"]) == {"shared": (0, budget)}


async def test_a_slice_keeps_its_request_number_and_one_given_up_returns_whole_once(store: Store) -> None:
    """The sweep's rule for a live run's slices (``services/budgets.given_up``) reads the request number the
    slice was stored with: it must come back exactly, on both stores (Redis passes it through Lua's JSON)."""
    counters = [("root/svc.call", 50), ("child/svc.call", 20)]
    kept, lost = "run-1/kept", "run-1/lost"  # as the control plane names a run's slices
    await store.take_slice({**doc(kept), "seq": MAX_SEQ}, counters, want=4, fraction=1.0)
    await store.take_slice({**doc(lost), "seq": 7}, counters, want=5, fraction=1.0)
    opened = {d["id"]: d for d in await store.open_slices()}
    assert opened[kept]["seq"] == MAX_SEQ and type(opened[kept]["seq"]) is int
    assert opened[lost]["seq"] == 7
    beat = HeldSlices(asked=7, held=frozenset())  # built after "lost" was asked, before "kept"
    assert [i for i, d in opened.items() if given_up(d, beat)] == [lost]
    returned = await store.settle_slice(lost, 0, at=5.0)
    assert returned is not None and returned["used"] == 0 and returned["n"] == 5
    assert await store.budget_counts(["root/svc.call", "child/svc.call"]) == {
        "root/svc.call": (0, 4), "child/svc.call": (0, 4)}  # all five back on every counter
    # Once returned it is closed: a late settlement (or sweep) of it moves nothing.
    assert await store.settle_slice(lost, 5, at=6.0) is None
    assert await store.budget_counts(["root/svc.call"]) == {"root/svc.call": (0, 4)}
    assert [d["id"] for d in await store.open_slices()] == [kept]


async def test_two_replicas_returning_and_sweeping_one_slice_settle_it_once(backend: Backend) -> None:
    """One replica returns a slice as given up while another settles it as spent (its run's lease lapsed):
    whichever comes first counts, once."""
    a, b = await backend.replica(), await backend.replica()
    for i in range(20):
        await a.take_slice({**doc(f"s{i}"), "seq": i + 1}, [("k", 1000)], want=3, fraction=1.0)
    outcomes = await asyncio.gather(*(replica.settle_slice(f"s{i}", used, at=1.0)
                                      for i in range(20) for replica, used in ((a, 0), (b, 3))))
    winners = [o for o in outcomes if o is not None]
    assert len(winners) == 20 and sorted(o["id"] for o in winners) == sorted(f"s{i}" for i in range(20))
    used = sum(o["used"] for o in winners)
    assert await b.budget_counts(["k"]) == {"k": (used, 0)}
    assert await a.open_slices() == []
