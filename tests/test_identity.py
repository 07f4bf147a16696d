"""One identity per agent and per sidecar run: the record cannot be made to lie (issue: record truth).

Real parts throughout: a control plane process, sidecar processes, the aiohttp tool server whose own hit
list is the ground truth. Each test is one finding from the outside trials:

- a respawn of a partitioned agent (same id, fresh key) never acknowledges for the original, inside the
  drain window or after the record, and starts clean itself;
- a link for an id signed by another principal than its owner is refused (``agent_id_taken``), in the same
  tree too; the owner may respawn it and an admin re-grant takes it over;
- an id re-granted after a termination serves (the old termination stays with the old links);
- a sidecar restarted after its agent was terminated delivers its spool, acknowledges late (an addendum)
  and exits, never forwarding;
- a control plane down past window + grace gives sidecars a reconnection grace: one record, no addenda;
- approving a held call of a revoked agent answers that it can no longer go;
- ``tether agents`` shows each run's real state.
"""

from __future__ import annotations

import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from tether.capability import keys
from tether.capability.chain import parse_chain_unverified
from tether.capability.errors import ApiError
from tether.controlplane.client import Signer
from tether.controlplane.termination import terminated_agents

from .conftest import World
from .harness import PYTHON, ControlPlaneProcess, Identity, SidecarProcess, wait_until
from .test_redis_faults import Relay

ISSUES = "/repos/o/r/issues"
CAPS = {"issues.read": "direct", "slow.read": "direct", "issues.write": "approval"}


def get(world: World, sidecar: SidecarProcess, path: str = ISSUES, timeout: float = 10) -> requests.Response:
    return requests.get(f"{world.tools.base}{path}", proxies=sidecar.proxies(), timeout=timeout)


def terminate(world: World, agent: str, mode: str = "drain", window: float = 0.0) -> str:
    return world.cp.client().request("POST", f"/v1/agents/{agent}/terminate",
                                     {"mode": mode, "window_s": window, "reason": "identity test"})["termination_id"]


def wait_terminated(world: World, tid: str, bound: float = 30.0) -> dict[str, Any]:
    return wait_until(lambda: (d := world.cp.client().request("GET", f"/v1/terminations/{tid}"))["state"]
                      == "terminated" and d, bound, interval=0.2, what=f"termination {tid}")


def records_of(world: World, tid: str) -> list[dict[str, Any]]:
    return [r for r in world.cp.client().request("GET", "/v1/records") if r["termination_id"] == tid]


def runs_of(world: World, agent: str) -> list[dict[str, Any]]:
    nodes = world.cp.client().request("GET", "/v1/agents")["agents"]
    return [run for node in nodes if node["agent"] == agent for run in node["runs"]]


def signer(identity: Identity) -> Signer:
    return Signer(identity.agent, parse_chain_unverified(identity.wire)[-1].hash,
                  keys.load_private(identity.key_path.read_bytes()))


def register(world: World, identity: Identity) -> dict[str, Any]:
    return world.cp.client(admin=False).request("POST", "/v1/chains/register", {"chain": identity.wire},
                                                signer=signer(identity))


def refused(call: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        call()
    return info.value


def test_a_respawn_never_answers_for_the_partitioned_original(world: World) -> None:
    """Partition child ``a`` from the control plane, terminate it, let root start a new ``a`` (same id, fresh
    key) inside the drain window and after the record: the record keeps the original unaccounted, no
    addendum claims it, and each new ``a`` serves, untouched by the old termination."""
    cp = world.cp
    root = cp.issue("root", CAPS)
    a1 = cp.delegate(root, "a", CAPS, name="a-first")
    relay = Relay(cp.port).start()
    via_relay = ControlPlaneProcess(cp.directory, port=relay.port)
    original = SidecarProcess(via_relay, a1)
    world.sidecars.append(original)
    original.start(world.ca.ca_pem)
    assert get(world, original).status_code == 200
    wait_until(lambda: any(r["state"] == "serving" for r in runs_of(world, "a")), 10, what="a's run serving")
    relay.cut()

    tid = terminate(world, "a", "drain", window=3.0)
    a2 = cp.delegate(root, "a", CAPS, name="a-second")  # the respawn, inside the drain window
    second = world.sidecar(a2)
    assert get(world, second, "/repos/o/second/issues").status_code == 200  # starts clean

    wait_terminated(world, tid)
    (record,) = records_of(world, tid)
    assert terminated_agents(record) == []
    (lost,) = record["agents_unaccounted"]
    assert lost["agent"] == "a" and len(lost["runs"]) == 1

    a3 = cp.delegate(root, "a", CAPS, name="a-third")  # and after the record
    third = world.sidecar(a3)
    assert get(world, third, "/repos/o/third/issues").status_code == 200
    assert get(world, second, "/repos/o/second-again/issues").status_code == 200
    time.sleep(2.0)  # the driver would write an addendum within a step if anyone answered for a
    assert len(records_of(world, tid)) == 1
    states = {r["run_id"]: r["state"] for r in runs_of(world, "a")}
    assert sorted(states.values()).count("serving") == 2, states
    # Ground truth: the original, cut off, stops forwarding once its lease runs out (it never heard the
    # command), and the tool server saw nothing from it after that.
    deadline = time.monotonic() + cp.lease_ttl + 5
    while get(world, original, "/repos/o/original/issues").status_code == 200:
        assert time.monotonic() < deadline, "the partitioned original forwarded past its lease"
        time.sleep(0.2)
    resp = get(world, original, "/repos/o/original-late/issues")
    assert resp.headers.get("Tether-Error") == "tether.lease_expired"
    assert world.tools.hits_for("/repos/o/original-late/issues") == 0


def test_an_id_belongs_to_the_principal_that_first_delegated_it(world: World) -> None:
    """A -> P -> B and A -> S: S cannot delegate a ``B`` of its own (not even to heartbeat or acknowledge
    for it); P may respawn B with a new key; an admin's root grant takes B over, after which P cannot."""
    cp = world.cp
    a = cp.issue("A", CAPS)
    p = cp.delegate(a, "P", CAPS)
    s = cp.delegate(a, "S", CAPS)
    b = cp.delegate(p, "B", CAPS)
    for ident in (a, p, s, b):
        register(world, ident)
    impostor = cp.delegate(s, "B", CAPS, name="B-impostor")
    err = refused(lambda: register(world, impostor))
    assert err.code == "tether.chain_invalid" and err.details.get("reason") == "agent_id_taken", err
    other_tree = cp.delegate(cp.issue("Z", CAPS), "B", CAPS, name="B-other-tree")
    assert refused(lambda: register(world, other_tree)).details.get("reason") == "agent_id_taken"

    respawn = cp.delegate(p, "B", CAPS, name="B-respawn")  # the owner, a new key: allowed
    assert register(world, respawn)["new"] == 1
    # P is an ancestor of every link B holds: it may terminate B
    links = {n["link"] for n in cp.client().request("GET", "/v1/agents")["agents"] if n["agent"] == "B"}
    assert len(links) == 2

    regrant = cp.issue("B", CAPS, name="B-admin")  # an admin re-grant takes the id over
    assert register(world, regrant)["new"] == 1
    late = cp.delegate(p, "B", CAPS, name="B-after-takeover")
    assert refused(lambda: register(world, late)).details.get("reason") == "agent_id_taken"


def test_an_id_regranted_after_a_termination_serves(world: World) -> None:
    cp = world.cp
    x1 = cp.issue("x", CAPS, name="x-first")
    first = world.sidecar(x1)
    assert get(world, first).status_code == 200
    tid = terminate(world, "x")
    record = wait_terminated(world, tid)
    assert record["state"] == "terminated"
    (entry,) = records_of(world, tid)[0]["agents_terminated"]
    assert entry["agent"] == "x" and entry["run_id"].startswith("run-")
    resp = get(world, first)
    assert resp.headers.get("Tether-Error") == "tether.terminated"

    x2 = cp.issue("x", CAPS, name="x-second")  # an admin re-grant: a new link, a new key, a clean start
    second = world.sidecar(x2)
    assert get(world, second, "/repos/o/regranted/issues").status_code == 200
    assert world.tools.hits_for("/repos/o/regranted/issues") == 1
    states = sorted(r["state"] for r in runs_of(world, "x"))
    assert states == ["serving", "terminated"], states
    assert get(world, first).headers.get("Tether-Error") == "tether.terminated"  # the old one stays stopped


def test_a_sidecar_restarted_after_its_termination_delivers_acknowledges_and_exits(world: World) -> None:
    """Its spool held a call that got a 200 while the control plane was away; it was killed, its agent
    terminated. Restarted, it never serves: it delivers the report, acknowledges late (an addendum lists the
    agent and the call as completed) and exits with a clear message."""
    cp = world.cp
    ident = cp.issue("spooler", CAPS)
    sidecar = world.sidecar(ident)
    assert get(world, sidecar, "/repos/o/before/issues").status_code == 200
    cp.stop()
    assert get(world, sidecar, "/repos/o/spooled/issues").status_code == 200  # the lease still holds
    assert world.tools.hits_for("/repos/o/spooled/issues") == 1
    sidecar.kill()
    cp.start()
    tid = terminate(world, "spooler", "abort")
    wait_terminated(world, tid, bound=cp.grace + 20)
    (record,) = records_of(world, tid)
    assert terminated_agents(record) == [] and [u["agent"] for u in record["agents_unaccounted"]] == ["spooler"]
    assert not [c for c in record["calls"] if c["url"].endswith("/repos/o/spooled/issues")
                and c["resolution"] == "completed"]

    restarted = SidecarProcess(cp, ident)
    args = [PYTHON, "-m", "tether", "sidecar", "--controlplane", cp.url, "--chain", str(ident.chain_path),
            "--key", str(ident.key_path), "--listen", "127.0.0.1:0", "--state-dir", str(restarted.state_dir)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, env=cp.env())
    assert done.returncode == 3, done.stderr[-2000:]
    assert "will not serve" in done.stderr and "acknowledged termination" in done.stderr, done.stderr[-2000:]
    addendum = wait_until(lambda: next((r for r in records_of(world, tid) if r.get("amends")), None), 10,
                          what="an addendum for the late acknowledgement")
    assert terminated_agents(addendum) == ["spooler"]
    (late,) = [c for c in addendum["calls"] if c["url"].endswith("/repos/o/spooled/issues")]
    assert late["resolution"] == "completed" and late["status"] == 200
    assert world.tools.hits_for("/repos/o/spooled/issues") == 1


def test_a_control_plane_down_past_the_window_gives_sidecars_time_to_come_back(world: World) -> None:
    cp = world.cp
    root = cp.issue("root", CAPS)
    kids = [cp.delegate(root, f"k{i}", CAPS) for i in range(3)]
    with ThreadPoolExecutor(4) as pool:
        sidecars = list(pool.map(world.sidecar, [root, *kids]))
        calls = [pool.submit(get, world, s, "/slow?s=30", 60) for s in sidecars]
        wait_until(lambda: world.tools.hits_for("/slow") == 4, 10, what="four slow calls at the tool")
        tid = terminate(world, "root", "drain", window=1.0)
        wait_until(lambda: world.cp.client().request("GET", f"/v1/terminations/{tid}")["state"] == "draining", 5,
                   what="draining")
        cp.stop(signal.SIGKILL)
        time.sleep(1.0 + cp.grace + 2.0)  # the window and the grace pass while it is down
        cp.start()
        wait_terminated(world, tid)
        for call in calls:  # each was cut when the window ended (the client sees its connection close)
            call.exception(timeout=60)
    records = records_of(world, tid)
    assert len(records) == 1, [r.get("amends") for r in records]
    assert sorted(terminated_agents(records[0])) == ["k0", "k1", "k2", "root"]
    assert records[0]["agents_unaccounted"] == []


def test_approving_a_call_that_can_no_longer_go_says_so(world: World) -> None:
    cp = world.cp
    ident = cp.issue("held", CAPS)
    sidecar = world.sidecar(ident)
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(lambda: requests.post(f"{world.tools.base}{ISSUES}", json={"t": 1},
                                                 proxies=sidecar.proxies(), timeout=60))
        pending = wait_until(lambda: cp.client().request("GET", "/v1/approvals?status=pending"), 10,
                             what="a held call")
        cp.client().request("POST", f"/v1/agents/{ident.agent}/revoke", {"reason": "test"})
        err = refused(lambda: cp.client().request("POST", f"/v1/approvals/{pending[0]['id']}/approve", {}))
        assert err.code == "tether.chain_revoked" and err.http_status == 409
        cp.client().request("POST", f"/v1/approvals/{pending[0]['id']}/deny", {})
        assert call.result(timeout=30).status_code in (403, 503)
    assert world.tools.hits_for(ISSUES) == 0


def test_agents_shows_each_runs_real_state(world: World) -> None:
    cp = world.cp
    root = cp.issue("root", CAPS)
    child = cp.delegate(root, "child", CAPS)
    rs, cs = world.sidecar(root), world.sidecar(child)
    assert get(world, rs).status_code == 200 and get(world, cs).status_code == 200
    cs.stop()  # its command exited: it says goodbye
    wait_until(lambda: [r["state"] for r in runs_of(world, "child")] == ["stopped"], 3, what="child stopped")
    tid = terminate(world, "root")
    wait_until(lambda: [r["state"] for r in runs_of(world, "root")] == ["terminated"], 3 + cp.grace,
               what="root's run terminated")
    wait_terminated(world, tid)
    out = subprocess.run([PYTHON, "-m", "tether", "agents", "--tree"], capture_output=True, text=True,
                         timeout=30, env=cp.env())
    assert out.returncode == 0, out.stderr
    assert "terminated" in out.stdout and "stopped" in out.stdout, out.stdout


def test_a_chain_with_an_unregistered_parent_cannot_borrow_registered_links(world: World) -> None:
    """Registering a chain whose links are all known answers without re-verifying; a chain stitched from
    registered links that are not parent and child is verified in full (and refused)."""
    cp = world.cp
    root = cp.issue("r1", CAPS)
    other = cp.issue("r2", CAPS)
    child = cp.delegate(root, "c", CAPS)
    for ident in (root, other, child):
        register(world, ident)
    leaf = parse_chain_unverified(child.wire)[-1]
    stitched = Identity("c", child.chain_path.with_name("stitched"), child.key_path)
    stitched.chain_path.write_text(f"{other.wire},{leaf.compact}")
    err = refused(lambda: register(world, stitched))
    assert err.code == "tether.chain_invalid", err


def test_a_run_belongs_to_the_link_that_first_spoke_for_it(world: World) -> None:
    """A run id shows in records, ``tether agents`` and traces; another link that names it can neither
    heartbeat, report nor acknowledge a termination in its name (the record would otherwise confirm an
    agent whose own sidecar never answered)."""
    cp = world.cp
    victim, other = cp.issue("victim", CAPS), cp.issue("other", CAPS)
    for ident in (victim, other):
        register(world, ident)
    run = "run-victims-own"
    as_victim = Signer(victim.agent, signer(victim).link, signer(victim).key, run)
    as_other = Signer(other.agent, signer(other).link, signer(other).key, run)
    client = cp.client(admin=False)
    client.request("POST", "/v1/sidecars/heartbeat", {"state": "serving", "inflight": []}, signer=as_victim)
    for path, body in (("/v1/sidecars/heartbeat", {"state": "stopped", "inflight": []}),
                       ("/v1/reports", {"reports": [{"call_id": "c-1"}]})):
        err = refused(lambda p=path, b=body: client.request("POST", p, b, signer=as_other))
        assert (err.http_status, err.code) == (403, "tether.forbidden"), err
    tid = terminate(world, "other")
    err = refused(lambda: client.request("POST", "/v1/sidecars/quiesced", {"termination_id": tid},
                                         signer=as_other))
    assert (err.http_status, err.code) == (403, "tether.forbidden")
    (node,) = [n for n in cp.client().request("GET", "/v1/agents")["agents"] if n["agent"] == "victim"]
    assert [(r["run_id"], r["state"]) for r in node["runs"]] == [(run, "serving")]


def test_ids_differing_only_in_case_belong_to_one_owner(world: World) -> None:
    cp = world.cp
    a = cp.issue("A", CAPS)
    honest = cp.delegate(a, "honest", CAPS)
    s = cp.issue("S", CAPS)
    for ident in (a, honest, s):
        register(world, ident)
    lookalike = cp.delegate(s, "Honest", CAPS, name="Honest-lookalike")
    assert refused(lambda: register(world, lookalike)).details.get("reason") == "agent_id_taken"
    same_owner = cp.delegate(a, "HONEST", CAPS, name="HONEST-same-owner")  # its owner may use either spelling
    assert register(world, same_owner)["new"] == 1
