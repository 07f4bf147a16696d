"""The clock rule without processes (``tether/controlplane/clock.py``, the commands' ``remaining_s``), and the
embedded store's case as a real control plane answers it: one replica, its own clock the reference."""

from __future__ import annotations

import json
import urllib.request

import requests
from hypothesis import given
from hypothesis import strategies as st

from tether.controlplane.clock import SIDECAR_QUORUM, SKEW_BOUND_S, STALE_AFTER_S, ClockWatch
from tether.controlplane.termination import delivered, remaining

from .conftest import World
from .harness import SidecarProcess, wait_until


@given(true_offset=st.floats(-3600, 3600), sent=st.floats(1e9, 2e9), rtt=st.floats(0, 10),
       where=st.floats(0, 1))
def test_the_measured_offset_is_within_its_uncertainty_of_the_true_one(true_offset: float, sent: float, rtt: float,
                                                                        where: float) -> None:
    """Whenever in the round trip the store read its clock, the offset is known to within half the trip."""
    watch = ClockWatch("redis")
    received = sent + rtt
    reference = sent + where * rtt - true_offset  # the store's clock when it answered
    sample = watch.measured(sent, reference, received, at=0.0)
    assert abs(sample.offset_s - true_offset) <= sample.uncertainty_s + 1e-5
    assert abs(sample.uncertainty_s - rtt / 2) < 1e-5


def test_the_newest_measurement_decides_and_lapses() -> None:
    watch = ClockWatch("redis")
    watch.measured(100.0, 70.0, 100.0, at=0.0)  # 30 s ahead
    verdict = watch.verdict(at=1.0)
    assert verdict.skewed and verdict.offset_s == 30.0 and "30.0s ahead of the redis store's" in verdict.reason
    watch.measured(130.0, 130.0, 130.001, at=1.0)  # fixed
    assert not watch.verdict(at=1.0).skewed
    later = watch.verdict(at=1.0 + STALE_AFTER_S + 0.5)
    assert later.skewed and later.offset_s is None and "has not been compared" in later.reason  # fail closed


def test_a_round_trip_too_slow_to_tell_fails_closed() -> None:
    watch = ClockWatch("redis")
    watch.measured(100.0, 101.0, 104.0, at=0.0)  # "+1 s, give or take 2": it may be 3 s off
    verdict = watch.verdict(at=0.0)
    assert verdict.skewed and verdict.uncertainty_s == 2.0 and "cannot be told within 2s" in verdict.reason
    watch.measured(100.0, 70.0, 160.0, at=1.0)  # stepped 60 s during the round trip: +0 give or take 30
    assert watch.verdict(at=1.0).skewed
    watch.measured(160.0, 160.0, 160.01, at=2.0)
    assert not watch.verdict(at=2.0).skewed


def test_a_stepped_clock_shows_at_the_next_measurement() -> None:
    watch = ClockWatch("redis")
    for i in range(5):
        watch.measured(100.0 + i, 100.0 + i, 100.0 + i + 0.0001, at=float(i))  # in sync, clean round trips
    assert not watch.verdict(at=5.0).skewed
    watch.measured(135.0, 105.0, 135.01, at=5.0)  # stepped 30 s ahead; a round trip less clean than before
    assert watch.verdict(at=5.0).skewed and abs(watch.verdict(at=5.0).offset_s - 30.005) < 1e-9  # type: ignore


def test_the_bound_and_each_crossing_reported_once() -> None:
    watch = ClockWatch("redis")
    assert watch.changed(at=0.0) is not None  # unmeasured: skewed, and said once
    assert watch.changed(at=0.0) is None
    watch.measured(10.0, 10.0 - SKEW_BOUND_S + 0.1, 10.0, at=1.0)
    back = watch.changed(at=1.0)
    assert back is not None and not back.skewed
    watch.measured(10.0, 13.0, 10.0, at=2.0)  # 3 s behind: the newest decides
    assert watch.verdict(at=2.0).offset_s == -3.0
    crossed = watch.changed(at=2.0)
    assert crossed is not None and crossed.skewed and "behind" in crossed.reason
    assert watch.changed(at=2.5) is None


def test_the_embedded_store_is_its_own_reference() -> None:
    watch = ClockWatch("local")
    verdict = watch.verdict(at=1e6)
    assert not verdict.skewed and verdict.offset_s == 0.0
    assert watch.to_dict(at=1e6)["reference"] == "local"


def test_sidecars_proofs_are_a_median_over_runs_that_decides_nothing() -> None:
    watch = ClockWatch("local")
    crossings = [watch.proof_seen(f"run-{i}", now=1000.0, iat=1000.0 - 30 - i / 10, at=float(i))
                 for i in range(SIDECAR_QUORUM + 1)]
    assert crossings == [False] * (SIDECAR_QUORUM - 1) + [True, False]  # logged once, at the quorum
    median, runs = watch.sidecar_offset(at=float(SIDECAR_QUORUM))
    assert runs == SIDECAR_QUORUM + 1 and 30 < median < 31  # type: ignore[operator]
    assert not watch.verdict(at=0.0).skewed  # a witness only
    for i in range(SIDECAR_QUORUM + 1):  # the same runs, agreeing again: crossed back, once
        watch.proof_seen(f"run-{i}", now=1000.0, iat=1000.0, at=10.0)
    assert watch.sidecar_offset(at=10.0)[0] == 0.0
    assert watch.sidecar_offset(at=10.0 + 301.0) == (None, 0)  # runs not heard from lately drop out


def test_a_command_carries_the_window_left_as_a_duration() -> None:
    command = {"deadline": 1010.0, "window_s": 10.0, "mode": "drain"}
    assert remaining(command, 1000.0) == 10.0
    assert remaining(command, 1004.5) == 5.5
    assert remaining(command, 1020.0) == 0.0
    assert remaining(command, 900.0) == 10.0  # never more than the window, whatever clock reads it
    assert delivered(command, 1007.0) == {**command, "remaining_s": 3.0}
    assert delivered(None, 1.0) is None and delivered({"mode": "abort"}, 1.0) == {"mode": "abort"}


def test_the_embedded_store_reports_its_clock_and_the_sidecars_proofs(world: World) -> None:
    with urllib.request.urlopen(world.cp.url + "/healthz", timeout=10) as resp:
        clock = json.loads(resp.read())["clock"]
    assert clock["reference"] == "local" and clock["skewed"] is False and clock["offset_s"] == 0.0
    root = world.cp.issue("clocked", {"issues.read": "direct"})
    sidecar = SidecarProcess(world.cp, root)
    world.sidecars.append(sidecar)
    sidecar.start()

    def sidecars() -> dict | None:
        with urllib.request.urlopen(world.cp.url + "/healthz", timeout=10) as resp:
            seen = json.loads(resp.read())["clock"]["sidecars"]
        return seen if seen["runs"] >= 1 else None

    seen = wait_until(sidecars, 30, what="a sidecar's proof to be measured")
    assert abs(seen["offset_s"]) < SKEW_BOUND_S  # one machine, one clock: transit only
    metrics = requests.get(world.cp.url + "/metrics", timeout=10).text
    assert "tether_clock_offset_seconds 0\n" in metrics and "tether_clock_skewed 0\n" in metrics
