"""Two control plane replicas over one Redis, as a deployment runs them: a chain registered through
replica A, its sidecar following replica B. What the user relies on: a revocation made on A stops the
sidecar on B (well inside the sidecar's 20 s long poll, so B's long poll was woken by A's append), and a
termination requested on A while the sidecar follows B completes with exactly one record, the same on
both replicas.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import requests

from tether.capability.errors import ApiError
from tether.controlplane.termination import terminated_agents

from . import harness
from .conftest import World, build_world, teardown_world
from .harness import ControlPlaneProcess, Identity, RedisServer, SidecarProcess, wait_until

ISSUES = "/repos/o/r/issues"
LIVENESS_S = 10.0  # below the sidecar's 20 s long poll: only a cross-replica wake-up delivers in time


@dataclass
class Replicas:
    world: World  # tool servers, MCP server and replica A (world.cp)
    b: ControlPlaneProcess
    sidecars: dict[str, SidecarProcess]
    identities: dict[str, Identity]

    @property
    def a(self) -> ControlPlaneProcess:
        return self.world.cp

    def get(self, agent: str) -> requests.Response:
        proxies = self.sidecars[agent].proxies()
        return requests.get(f"{self.world.tools.base}{ISSUES}", proxies=proxies, timeout=10)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, test_ca: harness.TestCA) -> Iterator[Replicas]:
    directory = tmp_path_factory.mktemp("replicas")
    redis = RedisServer(directory / "redis").start()
    store = redis.url(0)
    world = build_world(directory, test_ca, store=store)
    b = ControlPlaneProcess(directory / "cp-b", store=store, lease_ttl=world.cp.lease_ttl, grace=world.cp.grace)
    b.directory.mkdir(parents=True)
    for path in (world.cp.catalog_path, world.cp.signing_key_path):  # one deployment: same catalog, same key
        shutil.copy(path, b.directory / path.name)
    sidecars: list[SidecarProcess] = []
    try:
        world.cp.start()
        b.start()
        root = world.cp.issue("root", {"issues.read": "direct", "slow.read": "direct"})
        identities = {
            "revokee": world.cp.delegate(root, "revokee", {"issues.read": "direct"}),
            "worker": world.cp.delegate(root, "worker", {"issues.read": "direct"}),
        }
        for identity in identities.values():
            world.cp.client().request("POST", "/v1/chains/register", {"chain": identity.wire})
        sidecars = [SidecarProcess(b, identity) for identity in identities.values()]
        with ThreadPoolExecutor(len(sidecars)) as pool:  # each sidecar spends seconds importing mitmproxy
            list(pool.map(lambda s: s.start(test_ca.ca_pem), sidecars))
        yield Replicas(world, b, {s.identity.agent: s for s in sidecars}, identities)
    finally:
        for sidecar in sidecars:
            sidecar.stop()
        b.stop()
        teardown_world(world)
        redis.stop()


def agents_of(cp: ControlPlaneProcess) -> dict[str, Any]:
    return {node["agent"]: node for node in cp.client().request("GET", "/v1/agents")["agents"]}


def test_both_replicas_share_one_view(replicas: Replicas) -> None:
    a_health, b_health = (cp.client().request("GET", "/healthz") for cp in (replicas.a, replicas.b))
    assert a_health["replica"] != b_health["replica"]
    assert replicas.get("revokee").status_code == 200
    on_a, on_b = agents_of(replicas.a), agents_of(replicas.b)
    assert set(on_a) == set(on_b) == {"root", "revokee", "worker"}  # registered through A, seen by B
    assert on_a["revokee"]["sidecar"] is not None  # the sidecar heartbeats to B, A sees it


def test_revocation_on_a_stops_the_sidecar_following_b(replicas: Replicas) -> None:
    assert replicas.get("revokee").status_code == 200
    jti = replicas.identities["revokee"].jti
    replicas.a.client().request("POST", f"/v1/grants/{jti}/revoke", {"reason": "replica test"})

    def refused() -> str | None:
        resp = replicas.get("revokee")
        return resp.headers.get("Tether-Error") if resp.status_code != 200 else None

    assert wait_until(refused, LIVENESS_S, interval=0.1, what="the sidecar on B to refuse") == "tether.chain_revoked"
    assert agents_of(replicas.b)["revokee"]["status"] == "revoked"
    assert replicas.get("worker").status_code == 200  # a sibling is untouched


def test_termination_on_a_completes_with_one_record_on_both(replicas: Replicas) -> None:
    assert replicas.get("worker").status_code == 200
    doc = replicas.a.client().request(
        "POST", "/v1/agents/worker/terminate", {"mode": "drain", "window_s": 1, "reason": "replica test"}
    )
    tid = doc["termination_id"]
    bound = 1 + replicas.a.grace + LIVENESS_S

    def terminated() -> dict[str, Any] | None:
        view = replicas.b.client().request("GET", f"/v1/terminations/{tid}")
        return view if view["state"] == "terminated" else None

    view = wait_until(terminated, bound, interval=0.2, what=f"termination {tid} to complete")
    assert view["acknowledged"] == ["worker"]  # the sidecar on B acknowledged; the driver saw it
    records_a = replicas.a.client().request("GET", "/v1/records")
    records_b = replicas.b.client().request("GET", "/v1/records")
    assert records_a == records_b
    mine = [r for r in records_a if r["termination_id"] == tid]
    assert len(mine) == 1
    assert mine[0]["record_id"] == view["record_id"]
    assert terminated_agents(mine[0]) == ["worker"] and mine[0]["agents_unaccounted"] == []
    assert all(records_a[i]["prev_hash"] == records_a[i - 1]["hash"] for i in range(1, len(records_a)))
    assert replicas.get("worker").headers.get("Tether-Error") in {"tether.terminated", "tether.chain_revoked"}


def test_chains_sharing_a_new_link_register_at_once_on_both_replicas(replicas: Replicas) -> None:
    """Sixteen sidecars whose chains share a link nobody registered yet start together, half through each
    replica: each registration stores the shared link or finds it stored by the other, and none is refused
    as a jti clash (the same link is not another link)."""
    cp = replicas.a
    root = cp.issue("fan-root", {"issues.read": "direct"})
    hop = cp.delegate(root, "fan-hop", {"issues.read": "direct"})
    leaves = [cp.delegate(hop, f"fan-leaf-{i}", {"issues.read": "direct"}) for i in range(16)]
    start = threading.Barrier(len(leaves))

    def register(i: int) -> object:
        client = (replicas.a if i % 2 else replicas.b).client()
        start.wait(10)
        try:
            return client.request("POST", "/v1/chains/register", {"chain": leaves[i].wire})
        except ApiError as exc:
            return exc

    with ThreadPoolExecutor(len(leaves)) as pool:
        answers = list(pool.map(register, range(len(leaves))))
    assert [a for a in answers if isinstance(a, ApiError)] == []
    assert {"fan-hop", *(f"fan-leaf-{i}" for i in range(16))} <= set(agents_of(replicas.b))
