"""A parent and its child terminated at the same moment, through two control plane replicas over one Redis.

Real processes: two replicas, a sidecar for the parent following replica A and one for the child following
replica B, a tool server whose log is the ground truth. The child has slow calls in flight; it is terminated
(drain, 10 s) through B and its parent (drain, 2 s) through A at once. Whatever order the replicas and the
child's acknowledgements take (the parent's record may list the child unaccounted, its calls ``unknown``,
and then an addendum or the child's record reports them):

- no call is held as reported by two records; every call either sidecar reported is held by exactly one;
- a record reporting calls another termination's record listed as ``unknown`` names it in ``accounts_for``;
- every request the tool server received is in a record as ``completed`` or ``unknown``, never as refused
  or not sent; both terminations end with every agent confirmed, and the hash chain is whole.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests

from tether.controlplane.termination import held_as_reported, terminated_agents

from . import harness
from .conftest import World, build_world, teardown_world
from .harness import ControlPlaneProcess, RedisServer, SidecarProcess, reports_for, wait_until
from .test_termination_overlap import check_one_owner

LIVENESS_S = 20.0  # bounds, not measurements
SLOW_S = 7  # the child's calls outlast the parent's window plus grace (2 + 2 s), inside the child's (10 s)


@dataclass
class Pair:
    world: World
    b: ControlPlaneProcess
    parent: SidecarProcess
    child: SidecarProcess


@pytest.fixture
def pair(tmp_path_factory: pytest.TempPathFactory, test_ca: harness.TestCA) -> Iterator[Pair]:
    directory = tmp_path_factory.mktemp("overlap")
    redis = RedisServer(directory / "redis").start()
    world = build_world(directory, test_ca, store=redis.url(0))
    b = world.cp.replica(directory / "cp-b")  # one deployment: same store, catalog and key
    sidecars: list[SidecarProcess] = []
    try:
        world.cp.start()
        b.start()
        caps = {"issues.read": "direct", "slow.read": "direct"}
        parent = world.cp.issue("p", caps)
        child = world.cp.delegate(parent, "c", caps)
        sidecars = [SidecarProcess(world.cp, parent), SidecarProcess(b, child)]
        with ThreadPoolExecutor(2) as pool:  # each sidecar spends seconds importing mitmproxy
            list(pool.map(lambda s: s.start(test_ca.ca_pem), sidecars))
        yield Pair(world, b, *sidecars)
    finally:
        for sidecar in sidecars:
            sidecar.stop()
        b.stop()
        teardown_world(world)
        redis.stop()


def test_parent_and_child_terminated_at_once_through_two_replicas_give_each_call_one_record(pair: Pair) -> None:
    world, tools = pair.world, pair.world.tools

    def get(sidecar: SidecarProcess, path: str) -> int:
        return requests.get(f"{tools.base}{path}", proxies=sidecar.proxies(), timeout=60).status_code

    assert [get(pair.parent, "/repos/p/r/issues") for _ in range(3)] == [200] * 3
    assert [get(pair.child, "/repos/c/r/issues") for _ in range(3)] == [200] * 3
    answers: list[int] = []
    slow = [threading.Thread(target=lambda: answers.append(get(pair.child, f"/slow?s={SLOW_S}")), daemon=True)
            for _ in range(3)]
    for thread in slow:
        thread.start()
    wait_until(lambda: tools.hits_for("/slow") == 3, 30, what="the child's slow calls to reach the tool server")

    body = {"mode": "drain", "reason": "overlap"}
    child_term = pair.b.client().request("POST", "/v1/agents/c/terminate", {**body, "window_s": 10})
    parent_term = world.cp.client().request("POST", "/v1/agents/p/terminate", {**body, "window_s": 2})
    tids = {child_term["termination_id"]: 10, parent_term["termination_id"]: 2}
    probes: list[int] = []  # until the command reaches the child's sidecar its calls still go out

    def refusing() -> bool:
        probes.append(get(pair.child, "/repos/c/r/issues"))
        return probes[-1] >= 400

    wait_until(refusing, 20, interval=0.1, what="the child's sidecar to refuse while draining")
    probes.append(get(pair.child, "/repos/c/r/issues"))
    assert probes[-1] >= 400

    def settled() -> list[dict[str, Any]] | None:
        """The log once each termination's last record confirms all its agents."""
        records = world.cp.client().request("GET", "/v1/records")
        for tid in tids:
            mine = [r for r in records if r["termination_id"] == tid]
            if not mine or mine[-1]["agents_unaccounted"]:
                return None
        return records

    records = wait_until(settled, 10 + world.cp.grace + LIVENESS_S, interval=0.3, what="both terminations settled")
    for thread in slow:
        thread.join(SLOW_S + LIVENESS_S)
    assert pair.b.client().request("GET", "/v1/records") == records  # one log, the same through both replicas

    check_one_owner(records)  # one owner per call; accounts_for says which record it accounts for
    owners = held_as_reported(records)
    reported = {r["call_id"] for agent in ("p", "c") for r in reports_for(world.cp, agent)}
    assert len(reported) == 3 + 3 + 3 + len(probes)
    assert reported == set(owners), (sorted(reported - set(owners)), sorted(set(owners) - reported))
    for tid in tids:
        confirmed = {a for r in records if r["termination_id"] == tid for a in terminated_agents(r)}
        expected = {"p", "c"} if tid == parent_term["termination_id"] else {"c"}
        assert confirmed == expected, (tid, confirmed)

    # The tool server's log is the ground truth: what reached it is recorded as having left, exactly once.
    held = [c for r in records for c in r["calls"] if c.get("reported", True)]
    for path in ("/repos/p/r/issues", "/repos/c/r/issues", "/slow"):
        left = [c for c in held if urlsplit(c["url"]).path == path and c["resolution"] in ("completed", "unknown")]
        assert len(left) == tools.hits_for(path), (path, len(left), tools.hits_for(path))
    assert sum(1 for c in held if c["resolution"] == "refused") == sum(1 for status in probes if status >= 400)
    assert all(records[i]["prev_hash"] == records[i - 1]["hash"] for i in range(1, len(records)))
