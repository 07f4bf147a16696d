"""Termination end to end with real parts: a control plane process, real sidecar processes in front of
the real aiohttp tool server, calls in flight through them.

A tree ``root -> c1 -> g`` and ``root -> c2`` is terminated with drain and with abort while slow calls and
a call held for approval are in flight. What a user relies on: nothing is forwarded once a sidecar has
the revocation (the tool server's own hit list is the witness), every call ends in the record with the
resolution it really had, a sidecar that died is named as unaccounted with what it had in flight, a
middle node's termination leaves the rest of the tree alone, terminated sidecars stay up answering
``tether.terminated``, a control plane that dies mid-termination finishes it after restart with one
record, ``tether terminate --wait`` prints the record, ``tether records verify`` passes until someone
edits the log, and only an admin or an ancestor may terminate.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests

from tether.capability import keys
from tether.capability.chain import parse_chain_unverified
from tether.capability.errors import ApiError
from tether.controlplane.client import Signer
from tether.controlplane.termination import RESOLUTIONS, terminated_agents

from .conftest import World
from .harness import ADMIN_TOKEN, PYTHON, Identity, SidecarProcess, wait_until

ISSUES = "/repos/o/r/issues"
REFUSED_AFTER_REVOCATION = {"tether.draining", "tether.terminated", "tether.chain_revoked"}

LIVENESS_S = 10.0  # generous slack on top of the protocol's own bounds (window + grace)


def refused(probe: tuple) -> bool:
    """A tether refusal that follows the revocation: 403 chain_revoked when the revocation event arrives
    before the command (the subtree is revoked first), 503 draining or terminated once the command is in."""
    return probe[0] in (403, 503) and probe[1] in REFUSED_AFTER_REVOCATION


# -- helpers ---------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _stop_sidecars_together(world: World) -> Iterator[None]:
    """Stop the sidecars in parallel before the world's own (sequential) teardown: each says goodbye."""
    yield
    with ThreadPoolExecutor(max(1, len(world.sidecars))) as pool:
        list(pool.map(lambda s: s.stop(), world.sidecars))


def tree(world: World) -> dict[str, Identity]:
    """root -> c1 -> g, root -> c2. c2 holds issues.write only with approval."""
    cp = world.cp
    root = cp.issue("root", {"slow.read": "direct", "issues.read": "direct", "issues.write": "direct"})
    c1 = cp.delegate(root, "c1", {"slow.read": "direct", "issues.read": "direct"})
    c2 = cp.delegate(root, "c2", {"slow.read": "direct", "issues.read": "direct", "issues.write": "approval"})
    g = cp.delegate(c1, "g", {"slow.read": "direct", "issues.read": "direct"})
    return {"root": root, "c1": c1, "c2": c2, "g": g}


def start_sidecars(world: World, identities: list[Identity]) -> dict[str, SidecarProcess]:
    """Sidecar processes start in parallel: each spends seconds importing mitmproxy."""
    with ThreadPoolExecutor(len(identities)) as pool:
        started = list(pool.map(world.sidecar, identities))
    return {s.identity.agent: s for s in started}


def leaf_hash(identity: Identity) -> str:
    return parse_chain_unverified(identity.wire)[-1].hash


def signer(identity: Identity) -> Signer:
    return Signer(identity.agent, leaf_hash(identity), keys.load_private(identity.key_path.read_bytes()))


def get(world: World, sidecar: SidecarProcess, path: str = ISSUES, timeout: float = 10) -> requests.Response:
    return requests.get(f"{world.tools.base}{path}", proxies=sidecar.proxies(), timeout=timeout)


def hits(world: World, method: str, path: str) -> int:
    return sum(1 for m, p in list(world.tools.hits) if (m, p) == (method, path))


def error_code(resp: requests.Response) -> str | None:
    return resp.headers.get("Tether-Error")


@dataclass
class Background:
    """Calls running in threads while the test terminates their agents."""

    world: World
    results: dict[str, Any] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, name: str, sidecar: SidecarProcess, method: str, path: str, **kwargs: Any) -> None:
        def run() -> None:
            try:
                resp = requests.request(
                    method, f"{self.world.tools.base}{path}", proxies=sidecar.proxies(), timeout=90, **kwargs
                )
                self.results[name] = (resp.status_code, error_code(resp))
            except requests.RequestException as exc:
                self.results[name] = ("error", type(exc).__name__)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), f"calls still running: {self.results}"
        return self.results


def terminate(world: World, agent: str, mode: str, window: float, reason: str = "test") -> dict[str, Any]:
    doc = world.cp.client().request(
        "POST", f"/v1/agents/{agent}/terminate", {"mode": mode, "window_s": window, "reason": reason}
    )
    assert doc["state"] == "requested"
    return doc


def termination(world: World, tid: str) -> dict[str, Any]:
    return world.cp.client().request("GET", f"/v1/terminations/{tid}")


def wait_terminated(world: World, tid: str, window: float, extra: float = 0.0) -> dict[str, Any]:
    bound = window + world.cp.grace + extra + LIVENESS_S
    return wait_until(
        lambda: (doc := termination(world, tid))["state"] == "terminated" and doc,
        bound,
        interval=0.2,
        what=f"termination {tid} to reach terminated",
    )


def record_of(world: World, tid: str) -> dict[str, Any]:
    return world.cp.client().request("GET", f"/v1/records/{tid}")


def pending_approvals(world: World, agent: str) -> list[dict[str, Any]]:
    docs = world.cp.client().request("GET", "/v1/approvals?status=pending")
    return [d for d in docs if d["agent"] == agent]


def sidecar_view(world: World, agent: str) -> dict[str, Any] | None:
    for node in world.cp.client().request("GET", "/v1/agents")["agents"]:
        if node["agent"] == agent:
            return node
    return None


def probe_until_refused(world: World, sidecars: dict[str, SidecarProcess], timeout: float) -> dict[str, list]:
    """Probe every sidecar, one call at a time, until each refuses; then a few more times.

    Calls go one by one, so each probe's effect on the tool server's hit list is exactly its own. Returns
    (status or "error", Tether-Error, tool hits caused) per probe, for ``check_probes``.
    """
    log: dict[str, list] = {agent: [] for agent in sidecars}
    refused_at: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    while len(refused_at) < len(sidecars) or min(len(v) - refused_at[a] for a, v in log.items()) < 3:
        assert time.monotonic() < deadline, f"the revocation did not reach every sidecar: {log}"
        for agent, sidecar in sidecars.items():
            before = hits(world, "GET", ISSUES)
            try:
                resp = get(world, sidecar)
                outcome: tuple[Any, Any] = (resp.status_code, error_code(resp))
            except requests.RequestException as exc:  # a reset instead of a tether refusal: reported below
                outcome = ("error", type(exc).__name__)
            log[agent].append((*outcome, hits(world, "GET", ISSUES) - before))
            if refused(outcome) and agent not in refused_at:
                refused_at[agent] = len(log[agent]) - 1
        time.sleep(0.05)
    return log


def check_probes(log: dict[str, list], record: dict[str, Any]) -> None:
    """The revocation has reached a sidecar when it first refuses. Before that a probe may be forwarded
    (or, under abort, cut off in flight: an error whose outcome is unknown); from then on none reaches the
    tool server and each gets a tether error. The record says of every probe what its client saw."""
    for agent, probes in log.items():
        recorded = sorted(calls_by(record, agent, ISSUES), key=lambda c: c["started_at"])
        context = f"{agent}: probes {probes}; recorded {[(c['resolution'], c.get('code')) for c in recorded]}"
        first = next(i for i, p in enumerate(probes) if refused(p))
        assert all(p[0] in (200, "error") for p in probes[:first]), context
        for probe in probes[first:]:
            assert probe[2] == 0, f"forwarded after refusing: {context}"
            assert refused(probe), f"not a tether refusal: {context}"
        # A probe refused once the sidecar had acknowledged (tether.terminated) may be reported after the
        # record was written; every earlier one must be in it.
        # An abort may cut a probe off before it left (cancelled_not_sent) or after (unknown).
        must = 1 + max((i + 1 for i, p in enumerate(probes) if p[1] != "tether.terminated"), default=0)
        assert len(recorded) >= must and recorded[0]["resolution"] == "completed", context
        for (status, _, forwarded), call in zip(probes, recorded[1:], strict=False):
            if status == "error":
                allowed = {"unknown"} if forwarded else {"unknown", "cancelled_not_sent"}
            else:
                allowed = {"completed" if status == 200 else "refused"}
            assert call["resolution"] in allowed, context


def calls_by(record: dict[str, Any], agent: str, path: str, method: str = "GET") -> list[dict[str, Any]]:
    return [c for c in record["calls"] if c["agent"] == agent and c["method"] == method and c["url"].endswith(path)]


def assert_record_matches_reports(world: World, record: dict[str, Any], agents: list[str]) -> None:
    """Every call a sidecar reported before the record was written is in it, once, as reported."""
    in_record = {c["call_id"]: c for c in record["calls"]}
    assert len(in_record) == len(record["calls"]), "a call appears twice in the record"
    for agent in agents:
        for report in world.cp.client().request("GET", f"/v1/reports?agent={agent}"):
            if report["received_at"] > record["completed_at"]:
                continue
            call = in_record.get(report["call_id"])
            assert call is not None, f"reported call missing from the record: {report}"
            assert (call["agent"], call["resolution"], call["status"]) == (
                agent,
                report["resolution"],
                report["status"],
            )
    for call in record["calls"]:
        assert call["resolution"] in RESOLUTIONS
        assert call["agent"] in agents


def run_cli(world: World, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**world.cp.env(), "TETHER_ADMIN_TOKEN": ADMIN_TOKEN}
    return subprocess.run(
        [PYTHON, "-m", "tether", *args, "--controlplane", world.cp.url],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- drain and abort of a whole tree ---------------------------------------------------------------------------
def _terminate_tree_in_flight(world: World, mode: str, window: float, short_s: float) -> tuple[dict, dict, dict]:
    ids = tree(world)
    sidecars = start_sidecars(world, list(ids.values()))
    for sidecar in sidecars.values():
        assert get(world, sidecar).status_code == 200  # each sidecar holds a lease and forwards
    calls = Background(world)
    for agent, sidecar in sidecars.items():
        calls.start(f"{agent}/short", sidecar, "GET", f"/slow?s={short_s:g}")
        calls.start(f"{agent}/long", sidecar, "GET", "/slow?s=60")
    calls.start("c2/held", sidecars["c2"], "POST", ISSUES, json={"title": "needs a person"})
    wait_until(lambda: hits(world, "GET", "/slow") == 8, 15, what="eight slow calls to reach the tool server")
    wait_until(lambda: pending_approvals(world, "c2"), 15, what="c2's call held for approval")

    doc = terminate(world, "root", mode, window)
    tid = doc["termination_id"]
    assert doc["agents"] == ["c1", "c2", "g", "root"]
    probes = probe_until_refused(world, sidecars, timeout=LIVENESS_S)
    final = wait_terminated(world, tid, window)
    results = calls.join()
    record = record_of(world, tid)

    # (a) nothing after the revocation: each slow call reached the tool once, never retried; the held
    # call never left; the probes were checked one by one above.
    assert hits(world, "GET", "/slow") == 8
    assert hits(world, "POST", ISSUES) == 0
    assert [h["state"] for h in final["history"]] == [
        "requested",
        "draining" if mode == "drain" else "aborting",
        "reconciling",
        "terminated",
    ]
    assert final["record_id"] == record["record_id"]

    # (b) the record
    assert (record["termination_id"], record["subject"], record["mode"], record["requested_by"]) == (
        tid,
        "root",
        mode,
        "admin",
    )
    assert record["window_s"] == window
    assert terminated_agents(record) == ["c1", "c2", "g", "root"]
    assert record["agents_unaccounted"] == []
    assert {lease["jti"] for lease in record["leases"]} == {i.jti for i in ids.values()}
    assert all("revoked_at" in lease and "expired_at" not in lease for lease in record["leases"])
    assert_record_matches_reports(world, record, list(ids))
    check_probes(probes, record)
    return sidecars, results, record


def check_held_call(record: dict[str, Any], results: dict[str, Any]) -> None:
    """The call held for approval never left: the termination denied it, or the sidecar cancelled it,
    and its client got a tether error saying so."""
    held = calls_by(record, "c2", ISSUES, "POST")
    assert len(held) == 1, held
    assert (held[0]["resolution"], held[0].get("code")) in {
        ("refused", "tether.approval_denied"),
        ("cancelled_not_sent", "tether.draining"),
        ("cancelled_not_sent", "tether.terminated"),
    }, held
    assert results["c2/held"][0] in (403, 503), results["c2/held"]


def test_drain_tree_lets_short_calls_finish_and_leaves_long_ones_unknown(world: World) -> None:
    window = 5.0
    sidecars, results, record = _terminate_tree_in_flight(world, "drain", window, short_s=2)
    for agent in sidecars:
        slow = calls_by(record, agent, "/slow")
        assert sorted(c["resolution"] for c in slow) == ["completed", "unknown"], slow
        assert [c["status"] for c in slow if c["resolution"] == "completed"] == [200]
        assert results[f"{agent}/short"] == (200, None)
        assert results[f"{agent}/long"][0] != 200
    # the terminated sidecars stay up and answer for the control plane's decision
    for agent, sidecar in sidecars.items():
        resp = get(world, sidecar)
        assert (resp.status_code, error_code(resp)) == (503, "tether.terminated"), agent
        assert resp.json()["error"]["code"] == "tether.terminated"
        assert sidecar.proc is not None and sidecar.proc.poll() is None
    check_held_call(record, results)


def test_abort_tree_cancels_in_flight_calls_as_unknown(world: World) -> None:
    window = 30.0  # abort does not wait for it
    sidecars, results, record = _terminate_tree_in_flight(world, "abort", window, short_s=20)
    for agent in sidecars:
        slow = calls_by(record, agent, "/slow")
        assert [c["resolution"] for c in slow] == ["unknown", "unknown"], slow
        assert all(c["status"] is None for c in slow)
        assert results[f"{agent}/short"][0] != 200 and results[f"{agent}/long"][0] != 200
    for sidecar in sidecars.values():
        resp = get(world, sidecar)
        assert (resp.status_code, error_code(resp)) == (503, "tether.terminated")
    check_held_call(record, results)


# -- a sidecar that died ------------------------------------------------------------------------------------
def test_sigkilled_sidecar_is_unaccounted_with_its_last_known_calls(world: World) -> None:
    ids = tree(world)
    sidecars = start_sidecars(world, [ids["root"], ids["c1"]])
    calls = Background(world)
    calls.start("c1/long", sidecars["c1"], "GET", "/slow?s=60")
    wait_until(
        lambda: (sidecar_view(world, "c1") or {}).get("sidecar", {}).get("inflight") == 1,
        15,
        what="c1's heartbeat to report its call in flight",
    )
    sidecars["c1"].kill()
    window = 1.0
    doc = terminate(world, "root", "drain", window)
    final = wait_terminated(world, doc["termination_id"], window)
    calls.join()
    record = record_of(world, doc["termination_id"])

    reconciling = next(h["at"] for h in final["history"] if h["state"] == "reconciling")
    assert reconciling >= doc["requested_at"] + window + world.cp.grace  # it waited for c1 as long as promised
    assert terminated_agents(record) == ["root"]
    assert doc["agents"] == ["c1", "root"]  # c2 and g never registered a chain: the CP cannot know them
    assert [u["agent"] for u in record["agents_unaccounted"]] == ["c1"]
    c1 = record["agents_unaccounted"][0]
    assert c1["last_seen"] is not None and c1["last_seen"] <= doc["requested_at"]
    assert len(c1["calls_in_flight_last_known"]) == 1
    lost = c1["calls_in_flight_last_known"][0]
    assert lost["url"].endswith("/slow") and lost["method"] == "GET" and lost["capability"] == "slow.read"
    entry = [c for c in record["calls"] if c["call_id"] == lost["call_id"]]
    assert len(entry) == 1
    assert (entry[0]["agent"], entry[0]["resolution"], entry[0]["status"], entry[0]["reported"]) == (
        "c1",
        "unknown",
        None,
        False,
    )
    # c1's link is revoked all the same
    leases = {lease["agent"]: lease for lease in record["leases"]}
    assert "revoked_at" in leases["c1"]
    assert hits(world, "GET", "/slow") == 1


def test_a_frozen_sidecar_that_comes_back_is_written_in_an_addendum(world: World) -> None:
    """Frozen (SIGSTOP) through the window and the grace, c1 is unaccounted in the record; thawed, it gets
    its command on the event stream, cuts its call, reports and acknowledges: an addendum says so."""
    ids = tree(world)
    sidecars = start_sidecars(world, [ids["root"], ids["c1"]])
    calls = Background(world)
    calls.start("c1/long", sidecars["c1"], "GET", "/slow?s=60")
    wait_until(lambda: (sidecar_view(world, "c1") or {}).get("sidecar", {}).get("inflight") == 1, 15,
               what="c1's heartbeat to report its call in flight")
    assert sidecars["c1"].proc is not None
    sidecars["c1"].proc.send_signal(signal.SIGSTOP)
    try:
        doc = terminate(world, "root", "drain", 1.0)
        wait_terminated(world, doc["termination_id"], 1.0)
        record = record_of(world, doc["termination_id"])
        assert [u["agent"] for u in record["agents_unaccounted"]] == ["c1"]
    finally:
        sidecars["c1"].proc.send_signal(signal.SIGCONT)

    def addendum() -> dict[str, Any] | None:
        records = world.cp.client().request("GET", "/v1/records")
        return next((r for r in records if r.get("amends") == record["record_id"]), None)

    late = wait_until(addendum, 40, what="an addendum for c1")
    calls.join()
    assert late["termination_id"] == doc["termination_id"]
    assert terminated_agents(late) == ["c1"] and late["agents_unaccounted"] == []
    cut = [c for c in late["calls"] if c["agent"] == "c1" and c["url"].endswith("/slow")]
    assert len(cut) == 1 and cut[0]["resolution"] == "unknown"  # it had left; nobody knows what it did
    assert run_cli(world, "records", "verify").returncode == 0
    assert error_code(get(world, sidecars["c1"])) == "tether.terminated"


# -- a middle node ------------------------------------------------------------------------------------------
def test_terminating_a_middle_node_spares_parent_and_sibling(world: World) -> None:
    ids = tree(world)
    sidecars = start_sidecars(world, list(ids.values()))
    calls = Background(world)
    for agent in ("root", "c2"):
        calls.start(f"{agent}/slow", sidecars[agent], "GET", "/slow?s=3")
    calls.start("g/slow", sidecars["g"], "GET", "/slow?s=60")
    wait_until(lambda: hits(world, "GET", "/slow") == 3, 15, what="three slow calls to reach the tool server")
    doc = terminate(world, "c1", "abort", 2.0)
    assert doc["agents"] == ["c1", "g"]
    wait_terminated(world, doc["termination_id"], 2.0)
    results = calls.join()
    record = record_of(world, doc["termination_id"])

    assert results["root/slow"] == (200, None) and results["c2/slow"] == (200, None)
    assert results["g/slow"][0] != 200
    assert record["subject"] == "c1" and terminated_agents(record) == ["c1", "g"]
    assert {lease["jti"] for lease in record["leases"]} == {ids["c1"].jti, ids["g"].jti}
    assert {c["agent"] for c in record["calls"]} <= {"c1", "g"}
    assert [c["resolution"] for c in calls_by(record, "g", "/slow")] == ["unknown"]
    status = {n["agent"]: n["status"] for n in world.cp.client().request("GET", "/v1/agents")["agents"]}
    assert status == {"root": "active", "c2": "active", "c1": "revoked", "g": "revoked"}

    # past a whole lease TTL: the parent and the sibling keep renewing and forwarding; the terminated
    # sidecars stay up and keep answering tether.terminated
    time.sleep(world.cp.lease_ttl + 0.5)
    for agent in ("root", "c2"):

        def serving(a: str = agent) -> bool:
            resp = get(world, sidecars[a])  # a starved heartbeat may lapse a lease; termination must not touch it
            assert error_code(resp) not in REFUSED_AFTER_REVOCATION, f"{a}: {resp.status_code} {error_code(resp)}"
            return resp.status_code == 200

        wait_until(serving, LIVENESS_S, what=f"{agent} to forward")
    before = hits(world, "GET", ISSUES)
    for agent in ("c1", "g"):
        resp = get(world, sidecars[agent])
        assert (resp.status_code, error_code(resp)) == (503, "tether.terminated"), agent
    assert hits(world, "GET", ISSUES) == before
    assert all(s.proc is not None and s.proc.poll() is None for s in sidecars.values())


def test_terminating_the_parent_of_a_terminated_agent_accounts_for_it(world: World) -> None:
    """c1 was terminated earlier; its sidecar is up, heartbeating, refusing everything. Terminating root
    then covers c1 again: c1 is confirmed terminated, not an agent nobody can vouch for."""
    ids = tree(world)
    sidecars = start_sidecars(world, [ids["root"], ids["c1"]])
    first = terminate(world, "c1", "abort", 1.0)
    wait_terminated(world, first["termination_id"], 1.0)
    assert terminated_agents(record_of(world, first["termination_id"])) == ["c1"]
    window = 1.0
    second = terminate(world, "root", "abort", window)
    assert second["agents"] == ["c1", "root"]
    wait_terminated(world, second["termination_id"], window)
    record = record_of(world, second["termination_id"])
    assert [u["agent"] for u in record["agents_unaccounted"]] == [], record["agents_unaccounted"]
    assert terminated_agents(record) == ["c1", "root"]
    for sidecar in sidecars.values():
        assert error_code(get(world, sidecar)) == "tether.terminated"


# -- the control plane dies mid-termination ----------------------------------------------------------------------
def test_controlplane_restart_mid_termination_finishes_with_one_record(world: World) -> None:
    ids = tree(world)
    sidecars = start_sidecars(world, [ids["root"], ids["c1"]])
    calls = Background(world)
    for agent, sidecar in sidecars.items():
        calls.start(agent, sidecar, "GET", "/slow?s=60")
    wait_until(lambda: hits(world, "GET", "/slow") == 2, 15, what="two slow calls to reach the tool server")
    window = 6.0
    doc = terminate(world, "root", "drain", window)
    tid = doc["termination_id"]
    wait_until(lambda: termination(world, tid)["state"] == "draining", LIVENESS_S, what="draining")
    for sidecar in sidecars.values():  # the drain command reached both: new calls are refused
        wait_until(
            lambda s=sidecar: error_code(get(world, s)) == "tether.draining", LIVENESS_S, what="the sidecar to drain"
        )
    assert termination(world, tid)["state"] == "draining"
    killed_at = time.time()
    world.cp.kill()
    time.sleep(1.0)
    world.cp.start()

    final = wait_terminated(world, tid, window, extra=5.0)  # + the dead replica's driver lease
    calls.join()
    assert [h["state"] for h in final["history"]] == ["requested", "draining", "reconciling", "terminated"]
    assert final["history"][2]["at"] > killed_at  # finished by the restarted control plane
    terminations = world.cp.client().request("GET", "/v1/terminations")
    assert [t["id"] for t in terminations] == [tid]
    time.sleep(1.0)  # a second driver pass would have written a second record by now
    records = world.cp.client().request("GET", "/v1/records")
    assert [r["termination_id"] for r in records] == [tid]
    record = records[0]
    assert record["record_id"] == final["record_id"]
    assert terminated_agents(record) == ["c1", "root"]
    for agent in sidecars:
        assert [c["resolution"] for c in calls_by(record, agent, "/slow")] == ["unknown"]
    assert hits(world, "GET", "/slow") == 2  # unknown outcomes are never retried
    verify = run_cli(world, "records", "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr


# -- the record log and the CLI ------------------------------------------------------------------------------------
def test_cli_terminate_wait_then_records_verify_until_tampered(world: World) -> None:
    solo = world.cp.issue("solo", {"slow.read": "direct"})
    ghost = world.cp.issue("ghost", {"slow.read": "direct"})  # registered, but no sidecar ever runs
    world.cp.client().request("POST", "/v1/chains/register", {"chain": ghost.wire})
    sidecar = start_sidecars(world, [solo])["solo"]
    calls = Background(world)
    calls.start("short", sidecar, "GET", "/slow?s=1")
    wait_until(lambda: hits(world, "GET", "/slow") == 1, 15, what="the call to reach the tool server")

    # `tether terminate --wait` follows the termination and prints the record's summary
    out = run_cli(world, "terminate", "solo", "--mode", "drain", "--window", "5", "--wait", "--reason", "cli test")
    assert out.returncode == 0, out.stdout + out.stderr
    assert calls.join()["short"] == (200, None)
    first = world.cp.client().request("GET", "/v1/records")[-1]
    run = first["agents_terminated"][0]["run_id"]  # the run that acknowledged, named in the summary
    text, lines = out.stdout, out.stdout.splitlines()
    assert f"record {first['record_id']} for termination {first['termination_id']}" in text
    assert "drain of solo, requested by admin" in text
    assert any(line.split()[:3] == ["solo", "1", "completed"] for line in lines), text
    assert any(line.strip().startswith("agents terminated") and line.rstrip().endswith(f"solo (run {run})")
               for line in lines), text
    assert "UNACCOUNTED" not in text
    assert "leases: 1 revoked, 0 expired" in text
    assert f"hash {first['hash']}" in text
    # ... and exits 1 when an agent could not be accounted for
    cli = run_cli(world, "terminate", "ghost", "--mode", "abort", "--window", "0", "--wait")
    assert cli.returncode == 1, cli.stdout + cli.stderr
    assert "UNACCOUNTED" in cli.stdout and "ghost" in cli.stdout

    ok = run_cli(world, "records", "verify")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "2 record(s)" in ok.stdout

    world.cp.stop()
    db = sqlite3.connect(world.cp.directory / "tether.db")
    try:
        rid, raw = db.execute("SELECT record_id, doc FROM records ORDER BY pos LIMIT 1").fetchone()
        assert json.loads(raw)["termination_id"] == first["termination_id"]
        # A record's calls are stored apart from its other fields, one row each (docs/termination.md); a row
        # whose text is '' refers to the entry kept beside its report. The tamperer writes the row's own.
        entry = json.loads(db.execute(
            "SELECT CASE WHEN c.entry = '' THEN r.entry ELSE c.entry END FROM record_calls AS c "
            "LEFT JOIN reports AS r ON r.call_id = c.call_id WHERE c.record_id = ? AND c.seq = 0",
            (rid,)).fetchone()[0])
        entry["resolution"] = "refused"  # rewrite history: the call never happened
        db.execute("UPDATE record_calls SET entry = ? WHERE record_id = ? AND seq = 0", (json.dumps(entry), rid))
        db.commit()
    finally:
        db.close()
    world.cp.start()
    bad = run_cli(world, "records", "verify")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "record 0" in bad.stdout and "edited" in bad.stdout
    assert "record 1" not in bad.stdout  # the untouched record still links to the stored hash


# -- who may terminate ------------------------------------------------------------------------------------------
def test_terminate_allowed_to_admin_and_ancestors_only(world: World) -> None:
    ids = tree(world)
    admin = world.cp.client()
    for identity in ids.values():
        admin.request("POST", "/v1/chains/register", {"chain": identity.wire})
    anonymous = world.cp.client(admin=False)
    body = {"mode": "abort", "window_s": 0, "reason": "authz"}

    def refused(call: Callable[[], Any]) -> ApiError:
        with pytest.raises(ApiError) as info:
            call()
        return info.value

    for who in ("c1", "c2", "g"):  # the agent itself, its sibling, its own descendant
        err = refused(lambda w=who: anonymous.request("POST", "/v1/agents/c1/terminate", body, signer=signer(ids[w])))
        assert (err.http_status, err.code) == (403, "tether.forbidden"), who
    err = refused(lambda: anonymous.request("POST", "/v1/agents/c1/terminate", body))
    assert err.http_status == 401
    forged = Signer("root", leaf_hash(ids["root"]), keys.load_private(ids["c1"].key_path.read_bytes()))
    err = refused(lambda: anonymous.request("POST", "/v1/agents/c1/terminate", body, signer=forged))
    assert err.http_status == 401  # claims to be root, signed with c1's key
    assert admin.request("GET", "/v1/terminations") == []
    assert all(n["status"] == "active" for n in admin.request("GET", "/v1/agents")["agents"])

    by_parent = anonymous.request("POST", "/v1/agents/g/terminate", body, signer=signer(ids["c1"]))
    assert by_parent["requested_by"] == "principal:c1" and by_parent["agents"] == ["g"]
    by_root = anonymous.request("POST", "/v1/agents/c1/terminate", body, signer=signer(ids["root"]))
    assert by_root["requested_by"] == "principal:root" and by_root["agents"] == ["c1", "g"]
    by_admin = admin.request("POST", "/v1/agents/c2/terminate", body)
    assert by_admin["requested_by"] == "admin" and by_admin["agents"] == ["c2"]
    err = refused(lambda: admin.request("POST", "/v1/agents/nobody/terminate", body))
    assert err.http_status == 404
    err = refused(lambda: admin.request("POST", "/v1/agents/c2/terminate", {"mode": "kill", "window_s": 1}))
    assert err.http_status == 400
    ids_done = {t["id"] for t in admin.request("GET", "/v1/terminations")}
    assert ids_done == {by_root["termination_id"], by_parent["termination_id"], by_admin["termination_id"]}
