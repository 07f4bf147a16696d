"""A replica whose clock is stepped 30 s ahead in the middle of a drain it is driving (an NTP step, a VM
resumed): it must neither renew its lease nor close the window on its new time. It says it is skewed, stops
driving, a replica with a good clock takes the termination over when the lease runs out, and the call that
finishes inside the window is ``completed``. (Before, the stepped replica renewed its lease on the new time,
so nobody could take it over, and reconciled at once: the agent unaccounted, the call ``unknown``.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import requests

from tether.controlplane.termination import terminated_agents

from . import harness
from .conftest import World, build_world, teardown_world
from .harness import ControlPlaneProcess, RedisServer, SidecarProcess, wait_until
from .test_clock_skew import FAKETIME, SkewedControlPlane, health

WINDOW_S = 15.0
CALL_S = 8  # outlasts the step, the lease's run-out and the take-over; well inside the window
SETTLE_S = 30.0


@dataclass
class Stepped:
    world: World
    b: SkewedControlPlane  # drives the termination, then its clock is stepped

    @property
    def a(self) -> ControlPlaneProcess:
        return self.world.cp


@pytest.fixture
def stepped(tmp_path: Any, test_ca: harness.TestCA) -> Iterator[Stepped]:
    if FAKETIME is None:
        pytest.skip("faketime (libfaketime) is not installed")
    redis = RedisServer(tmp_path / "redis").start()
    world = build_world(tmp_path, test_ca, store=redis.url(0))
    b = world.cp.replica(tmp_path / "cp-b", SkewedControlPlane, offset="+0s", offset_file=tmp_path / "cp-b-offset")
    try:
        b.start()
        yield Stepped(world, b)
    finally:
        b.stop()
        teardown_world(world)
        redis.stop()


def test_a_replica_stepped_ahead_mid_drain_hands_the_termination_over(stepped: Stepped) -> None:
    a, b, tools = stepped.a, stepped.b, stepped.world.tools
    assert health(b)[0] == 200  # in step with Redis for now
    identity = a.issue("stepped", {"slow.read": "direct"})
    b.client().request("POST", "/v1/chains/register", {"chain": identity.wire})
    sidecar = SidecarProcess(b, identity)
    stepped.world.sidecars.append(sidecar)
    sidecar.start(stepped.world.ca.ca_pem)
    result: dict[str, requests.Response] = {}
    thread = threading.Thread(target=lambda: result.update(r=requests.get(
        f"{tools.base}/slow?s={CALL_S}", proxies=sidecar.proxies(), timeout=60)))
    thread.start()
    wait_until(lambda: tools.hits_for("/slow") >= 1, SETTLE_S, what="the call to be in flight")
    tid = b.client().request("POST", "/v1/agents/stepped/terminate",
                             {"mode": "drain", "window_s": WINDOW_S, "reason": "step test"})["termination_id"]
    # B is the only replica: it takes the lease and starts the drain.
    wait_until(lambda: b.client().request("GET", f"/v1/terminations/{tid}")["state"] == "draining", SETTLE_S,
               what="the drain to start")
    a.start()  # a replica with a good clock, while B holds the termination's lease
    assert b.offset_file is not None
    b.offset_file.write_text("+30s\n")  # B's wall clock jumps 30 s ahead; the window has ~10 s to run
    wait_until(lambda: health(b)[2] == "tether.clock_skewed", SETTLE_S, what="B to say it is skewed")
    thread.join(60)
    assert result["r"].status_code == 200  # the drain let it finish: not an abort

    def terminated() -> dict[str, Any] | None:
        view = a.client().request("GET", f"/v1/terminations/{tid}")
        return view if view["state"] == "terminated" else None

    view = wait_until(terminated, WINDOW_S + a.grace + SETTLE_S, interval=0.2, what=f"termination {tid}")
    (record,) = [r for r in a.client().request("GET", "/v1/records") if r["termination_id"] == tid]
    assert record["record_id"] == view["record_id"]
    assert terminated_agents(record) == ["stepped"] and record["agents_unaccounted"] == [], record
    slow = [c for c in record["calls"] if c["url"].split("?")[0].endswith("/slow")]
    assert [(c["resolution"], c["status"]) for c in slow] == [("completed", 200)], record["calls"]
    assert f"termination {tid}: terminated" in (a.directory / "controlplane.log").read_text()  # A took it over
    assert f"termination {tid}: terminated" not in b.log_text
    assert "clock skewed" in b.log_text and "ahead of the redis store's" in b.log_text
