"""One replica's clock 30 s off must not void drain windows (issue 29, item 4).

Three control plane replicas over one Redis started here: A with the machine's clock, F under libfaketime
30 s ahead, S 30 s behind. What a user relies on: F and S say they are skewed (``/healthz`` 503
``tether.clock_skewed`` with their offset against Redis ``TIME``, the ``tether_clock_*`` gauges, a log line),
refuse to fix a termination's deadline, take no termination lease, and judge sidecars' proofs on Redis's
clock (S no longer refuses every fresh one as signed ahead); A drives the terminations, and a drain holds
its window: calls that finish inside it are ``completed``, the agents confirmed, even for a sidecar that
follows the fast replica. (Before, F took every
lease and reconciled at once: agents unaccounted, calls ``unknown``; S dated deadlines 30 s in the past.)
"""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from tether.capability import keys
from tether.capability.chain import parse_chain_unverified
from tether.capability.errors import ApiError
from tether.capability.proof import MAX_AGE_S, make_proof
from tether.controlplane.termination import terminated_agents

from . import harness
from .conftest import World, build_world, teardown_world
from .harness import PYTHON, ControlPlaneProcess, Identity, RedisServer, SidecarProcess, wait_until

FAKETIME = shutil.which("faketime")
SKEW_S = 30.0
WINDOW_S = 10.0  # the drain window: far longer than the calls in flight (3 s)
CALL_S = 3
SETTLE_S = 30.0  # generous bounds for a busy machine; nothing below asserts on timing


def faketime_env(offset: str, offset_file: Path | None = None) -> dict[str, str]:
    """The environment that runs a process under libfaketime, its wall clock shifted by ``offset`` (with
    ``offset_file``: by what that file says at the moment; rewrite it to step the clock, its monotonic clock
    left alone, as an NTP step leaves it)."""
    (library,) = glob.glob("/usr/lib/*/faketime/libfaketime.so.1")[:1] or [None]
    if library is None:
        pytest.skip("libfaketime.so.1 is not installed (apt-get install faketime)")
    if offset_file is None:
        return {"LD_PRELOAD": library, "FAKETIME": offset}
    offset_file.write_text(offset + "\n")
    return {"LD_PRELOAD": library, "FAKETIME_TIMESTAMP_FILE": str(offset_file), "FAKETIME_CACHE_DURATION": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


@dataclass
class SkewedControlPlane(ControlPlaneProcess):
    """A replica run under libfaketime: its whole process sees the wall clock shifted by ``offset``, or, with
    ``offset_file``, by what that file says at the moment (rewrite it to step the clock; its monotonic
    clock is left alone, as an NTP step leaves it)."""

    offset: str = "+0s"
    offset_file: Path | None = None

    def start(self) -> SkewedControlPlane:
        log = open(self.directory / "controlplane.log", "ab")
        serve = [PYTHON, "-m", "tether", "controlplane", "serve", "--listen", f"127.0.0.1:{self.port}",
                 "--store", str(self.store), "--catalog", str(self.catalog_path),
                 "--signing-key", str(self.signing_key_path), "--lease-ttl", str(self.lease_ttl),
                 "--grace", str(self.grace)]
        # libfaketime preloaded into the replica itself, not through the faketime command: that one forks, and
        # stopping it would leave the replica running.
        env = {**self.env(), **faketime_env(self.offset, self.offset_file)}
        self.proc = subprocess.Popen(serve, stdout=log, stderr=log, env=env)
        wait_until(lambda: health(self)[0] in (200, 503), 20, what=f"replica {self.offset} on {self.port}")
        return self

    @property
    def log_text(self) -> str:
        return (self.directory / "controlplane.log").read_text(errors="replace")


def health(cp: ControlPlaneProcess) -> tuple[int, dict[str, Any], str | None]:
    """/healthz's status, body and Tether-Error header (0 while nothing answers)."""
    if cp.proc is not None and cp.proc.poll() is not None:
        raise AssertionError(f"control plane exited: {(cp.directory / 'controlplane.log').read_text()[-2000:]}")
    try:
        with urllib.request.urlopen(cp.url + "/healthz", timeout=5) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get("Tether-Error")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers.get("Tether-Error")
    except OSError:
        return 0, {}, None


def gauge(cp: ControlPlaneProcess, name: str) -> float | None:
    text = requests.get(cp.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


@dataclass
class Replicas:
    world: World
    fast: SkewedControlPlane
    slow: SkewedControlPlane
    root: Identity
    sidecars: dict[str, SidecarProcess]

    @property
    def a(self) -> ControlPlaneProcess:
        return self.world.cp


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, test_ca: harness.TestCA) -> Iterator[Replicas]:
    if FAKETIME is None:
        pytest.skip("faketime (libfaketime) is not installed")
    probe = subprocess.run([FAKETIME, "-f", f"+{SKEW_S:.0f}s", PYTHON, "-c", "import time; print(time.time())"],
                           capture_output=True, text=True, timeout=30, check=True)
    # libfaketime must reach this Python's clock (a statically linked interpreter would escape it).
    assert abs(float(probe.stdout) - time.time() - SKEW_S) < 5, "faketime does not shift this Python's clock"
    directory = tmp_path_factory.mktemp("skew")
    redis = RedisServer(directory / "redis").start()
    store = redis.url(0)
    world = build_world(directory, test_ca, store=store)
    skewed = {}
    for name, offset in (("fast", f"+{SKEW_S:.0f}s"), ("slow", f"-{SKEW_S:.0f}s")):
        skewed[name] = world.cp.replica(directory / f"cp-{name}", SkewedControlPlane, offset=offset)
    sidecars: list[SidecarProcess] = []
    try:
        world.cp.start()
        for cp in skewed.values():
            cp.start()
        root = world.cp.issue("root", {"issues.read": "direct", "slow.read": "direct"})
        on_a = world.cp.delegate(root, "worker-a", {"slow.read": "direct"})
        on_fast = world.cp.delegate(root, "worker-f", {"slow.read": "direct"})
        for identity in (on_a, on_fast):
            world.cp.client().request("POST", "/v1/chains/register", {"chain": identity.wire})
        # One sidecar follows the correct replica, one the fast one (out of rotation, but sidecars connected to
        # it before it left keep following it).
        sidecars = [SidecarProcess(world.cp, on_a), SidecarProcess(skewed["fast"], on_fast)]
        with ThreadPoolExecutor(len(sidecars)) as pool:
            list(pool.map(lambda s: s.start(test_ca.ca_pem), sidecars))
        yield Replicas(world, skewed["fast"], skewed["slow"], root, {s.identity.agent: s for s in sidecars})
    finally:
        for sidecar in sidecars:
            sidecar.stop()
        for cp in skewed.values():
            cp.stop()
        teardown_world(world)
        redis.stop()


def test_skewed_replicas_say_so_and_leave_the_readiness_rotation(replicas: Replicas) -> None:
    status, body, header = health(replicas.a)
    assert status == 200 and body["status"] == "ok"
    assert body["clock"]["reference"] == "redis" and body["clock"]["skewed"] is False
    assert abs(body["clock"]["offset_s"]) < body["clock"]["bound_s"] == 2.0
    assert gauge(replicas.a, "tether_clock_skewed") == 0
    for cp, sign, word in ((replicas.fast, 1, "ahead of"), (replicas.slow, -1, "behind")):
        status, body, header = health(cp)
        assert status == 503 and header == "tether.clock_skewed" and body["code"] == "tether.clock_skewed"
        assert body["store"] == "ok" and body["clock"]["skewed"] is True
        assert abs(body["clock"]["offset_s"] - sign * SKEW_S) < 5, body["clock"]
        assert f"{word} the redis store's" in body["reason"]
        assert abs(gauge(cp, "tether_clock_offset_seconds") - sign * SKEW_S) < 5  # type: ignore[operator]
        assert gauge(cp, "tether_clock_skewed") == 1
        assert "clock skewed" in cp.log_text and word in cp.log_text  # logged when it crossed the bound


def test_skewed_replicas_fix_no_deadline(replicas: Replicas) -> None:
    bystander = replicas.a.delegate(replicas.root, "bystander", {"slow.read": "direct"})
    replicas.a.client().request("POST", "/v1/chains/register", {"chain": bystander.wire})
    for cp in (replicas.fast, replicas.slow):
        with pytest.raises(ApiError) as refused:
            cp.client().request("POST", "/v1/agents/bystander/terminate", {"mode": "drain", "window_s": 5})
        assert refused.value.http_status == 503 and refused.value.code == "tether.clock_skewed"
        assert "send it to another replica" in refused.value.message
    assert [t for t in replicas.a.client().request("GET", "/v1/terminations")
            if t["subject"] == "bystander"] == []  # nothing was requested, nothing revoked
    agents = {n["agent"]: n for n in replicas.a.client().request("GET", "/v1/agents")["agents"]}
    assert agents["bystander"]["status"] != "revoked"


def test_proofs_are_judged_on_the_store_clock_and_measure_the_replica(replicas: Replicas) -> None:
    """The slow replica no longer refuses a fresh proof as signed 30 s ahead, nor does the fast one take a stale
    one as fresh: each judges proofs on Redis's clock, by its measured offset. The proofs it verified measure
    it too, as Redis TIME does."""
    identity = replicas.a.delegate(replicas.root, "prober", {"slow.read": "direct"})  # its runs: these probes
    replicas.a.client().request("POST", "/v1/chains/register", {"chain": identity.wire})
    key = keys.load_private(identity.key_path.read_bytes())
    link = parse_chain_unverified(identity.wire)[-1].hash
    body = json.dumps({"reports": [], "starts": []}).encode()

    def send(cp: ControlPlaneProcess, run: str, age: float = 0.0) -> requests.Response:
        proof = make_proof(key, agent=identity.agent, method="POST", path="/v1/reports", body=body,
                           now=time.time() - age, link=link, run=run)
        return requests.post(cp.url + "/v1/reports", data=body, timeout=10,
                             headers={"Tether-Proof": proof, "Content-Type": "application/json"})

    for cp, name in ((replicas.slow, "slow"), (replicas.fast, "fast"), (replicas.a, "a")):
        assert send(cp, f"probe-{name}").status_code == 200, name
        stale = send(cp, f"probe-{name}", age=MAX_AGE_S + 10)  # 70 s old: on the fast clock, 100 s
        assert stale.status_code == 401 and "older than" in stale.json()["error"]["message"], name
    for cp, sign in ((replicas.fast, 1), (replicas.slow, -1), (replicas.a, 0)):
        sidecars = health(cp)[1]["clock"]["sidecars"]
        assert sidecars["runs"] >= 1 and abs(sidecars["offset_s"] - sign * SKEW_S) < 5, sidecars


def test_the_correct_replica_drives_and_the_drain_window_holds(replicas: Replicas) -> None:
    tools = replicas.world.tools
    results: dict[str, requests.Response] = {}

    def call(agent: str) -> None:
        results[agent] = requests.get(f"{tools.base}/slow?s={CALL_S}", proxies=replicas.sidecars[agent].proxies(),
                                      timeout=60)

    before = tools.hits_for("/slow")
    threads = [threading.Thread(target=call, args=(agent,)) for agent in replicas.sidecars]
    for thread in threads:
        thread.start()
    wait_until(lambda: tools.hits_for("/slow") - before >= len(threads), SETTLE_S, what="both calls to be in flight")
    tids = {agent: replicas.a.client().request("POST", f"/v1/agents/{agent}/terminate",
                                                {"mode": "drain", "window_s": WINDOW_S, "reason": "skew test"})
            ["termination_id"] for agent in replicas.sidecars}
    for thread in threads:
        thread.join(60)
    assert {agent: r.status_code for agent, r in results.items()} == {agent: 200 for agent in replicas.sidecars}

    def terminated(tid: str) -> dict[str, Any] | None:
        view = replicas.a.client().request("GET", f"/v1/terminations/{tid}")
        return view if view["state"] == "terminated" else None

    for agent, tid in tids.items():
        wait_until(lambda tid=tid: terminated(tid), WINDOW_S + replicas.a.grace + SETTLE_S, interval=0.2,
                   what=f"termination {tid} of {agent}")
    records = replicas.a.client().request("GET", "/v1/records")
    for agent, tid in tids.items():
        (record,) = [r for r in records if r["termination_id"] == tid]
        assert terminated_agents(record) == [agent] and record["agents_unaccounted"] == [], record
        slow = [c for c in record["calls"] if c["url"].split("?")[0].endswith("/slow")]
        assert [(c["resolution"], c["status"]) for c in slow] == [("completed", 200)], record["calls"]
    # Only the correct replica drove them: the skewed ones took no termination lease.
    for tid in tids.values():
        assert f"termination {tid}: terminated" in (replicas.a.directory / "controlplane.log").read_text()
        for cp in (replicas.fast, replicas.slow):
            assert f"termination {tid}:" not in cp.log_text


def test_commands_are_handed_out_with_the_window_left_by_good_clocks_only(replicas: Replicas) -> None:
    """A standing drain command carries ``remaining_s``, the window left as a duration, from a replica whose
    clock agrees with the store's; the fast replica hands it out with the deadline only."""
    identity = replicas.a.delegate(replicas.root, "timed", {"slow.read": "direct"})
    replicas.a.client().request("POST", "/v1/chains/register", {"chain": identity.wire})
    key = keys.load_private(identity.key_path.read_bytes())
    link = parse_chain_unverified(identity.wire)[-1].hash
    body = json.dumps({"state": "serving"}).encode()

    def heartbeat(cp: ControlPlaneProcess) -> dict[str, Any]:
        proof = make_proof(key, agent="timed", method="POST", path="/v1/sidecars/heartbeat", body=body,
                           now=time.time(), link=link, run="probe-timed")
        resp = requests.post(cp.url + "/v1/sidecars/heartbeat", data=body, timeout=10,
                             headers={"Tether-Proof": proof, "Content-Type": "application/json"})
        assert resp.status_code == 200, resp.text
        return resp.json()

    window = 60.0
    tid = replicas.a.client().request("POST", "/v1/agents/timed/terminate",
                                      {"mode": "drain", "window_s": window})["termination_id"]
    command = wait_until(lambda: heartbeat(replicas.a)["command"], SETTLE_S, what="the standing command")
    assert command["termination_id"] == tid and 0 < command["remaining_s"] <= window
    assert abs(command["deadline"] - time.time() - command["remaining_s"]) < 5  # the same moment, as a duration
    on_fast = heartbeat(replicas.fast)["command"]
    assert on_fast["termination_id"] == tid and on_fast["deadline"] == command["deadline"]
    assert "remaining_s" not in on_fast  # not measured on a clock 30 s off
