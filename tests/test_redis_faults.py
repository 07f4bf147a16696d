"""Two control plane replicas over one Redis, under faults, with real processes (docs/contract.md section 8).

What a deployment relies on when something breaks:

- Redis crashes and comes back: while it is down every replica answers 503 (``/healthz`` and the API,
  ``tether.store_unavailable``); sidecars keep forwarding granted calls until their lease runs out, then
  refuse with ``tether.lease_expired``; once Redis is back (append-only file, ``appendfsync always``) the
  leases renew, calls flow, and every call the client made is reported exactly once.
- The replica driving a termination is SIGKILLed while draining: the other replica finishes the same
  termination, with exactly one record.
- A sidecar is cut off from every replica (a TCP relay we control turns into a black hole): it fails
  closed at lease expiry, and a termination lists it as unaccounted with the calls it last had in flight.
- Sidecars deliver reports at least once, to any replica, in any order: each is stored once and the
  record lists each call once.
- A fleet's burst (one revocation waking hundreds of long polls on one replica) is load, not an outage:
  every poll is answered with the revocation while Redis is healthy.

Everything listens on 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests

from tether.capability import keys
from tether.capability.chain import parse_chain_unverified
from tether.capability.errors import ApiError
from tether.capability.proof import make_proof
from tether.controlplane.client import Signer
from tether.controlplane.termination import terminated_agents

from .harness import (
    ControlPlaneProcess,
    Identity,
    RedisServer,
    SidecarProcess,
    ToolServer,
    close_loop,
    free_port,
    prepare_controlplane,
    reports_for,
    wait_until,
)
from .test_sidecar_http import assert_refused

GRACE_S = 4.0  # the replicas' reconciliation grace: room for a sidecar's late ack on a loaded machine


# -- real parts --------------------------------------------------------------------------------------------
class Relay:
    """A TCP relay on 127.0.0.1 in front of one port. ``cut()`` turns it into a black hole, as a network
    partition looks from both ends: open connections stop carrying bytes (the far side's sockets are
    dropped, the near side's are held open, unanswered) and new connections are accepted and ignored."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.cut_at: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._upstreams: set[asyncio.StreamWriter] = set()
        self._held: set[asyncio.StreamWriter] = set()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if self.cut_at is not None:
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._held.add(writer)
        if self.cut_at is not None:
            return  # accepted, never answered
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._upstreams.add(up_writer)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        if self.cut_at is None:  # an ordinary close on either side: close both
            writer.transport.abort()
            up_writer.transport.abort()
            self._held.discard(writer)
        self._upstreams.discard(up_writer)

    def start(self) -> Relay:
        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            self._server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
            self._ready.set()
            loop.run_forever()
            for w in (*self._upstreams, *self._held):
                w.transport.abort()
            self._server.close()
            close_loop(loop)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "relay did not start"
        return self

    def cut(self) -> None:
        def go() -> None:
            self.cut_at = time.time()
            for w in list(self._upstreams):
                w.transport.abort()

        assert self._loop is not None
        done = threading.Event()
        self._loop.call_soon_threadsafe(lambda: (go(), done.set()))
        assert done.wait(5)

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)


@dataclass
class Fleet:
    directory: Path
    redis: RedisServer
    tools: ToolServer
    a: ControlPlaneProcess
    b: ControlPlaneProcess
    sidecars: list[SidecarProcess] = field(default_factory=list)

    def ensure_up(self) -> None:
        """Each test starts from a running Redis and two healthy replicas, whatever the last one broke."""
        if not self.redis.running:
            self.redis.start()
        for cp in (self.a, self.b):
            if cp.proc is None or cp.proc.poll() is not None:
                cp.proc = None
                cp.start()
            wait_until(cp.healthy, 20, what=f"replica on {cp.port} healthy")

    def sidecar(self, follows: ControlPlaneProcess, identity: Identity) -> SidecarProcess:
        sidecar = SidecarProcess(follows, identity)
        self.sidecars.append(sidecar)
        return sidecar.start()

    def call(self, sidecar: SidecarProcess, path: str, timeout: float = 10) -> requests.Response:
        return requests.get(self.tools.base + path, proxies=sidecar.proxies(), timeout=timeout)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    directory = tmp_path_factory.mktemp("redis-faults")
    redis = RedisServer(directory / "redis", durable=True).start()
    tools = ToolServer().start()
    store = redis.url(0)
    a = prepare_controlplane(directory / "cp-a", tools.port, free_port(), free_port(), store=store, grace=GRACE_S)
    b = ControlPlaneProcess(directory / "cp-b", store=store, lease_ttl=a.lease_ttl, grace=GRACE_S)
    b.directory.mkdir(parents=True)
    for path in (a.catalog_path, a.signing_key_path):  # one deployment: same catalog, same signing key
        shutil.copy(path, b.directory / path.name)
    fleet = Fleet(directory, redis, tools, a, b)
    try:
        a.start()
        b.start()
        yield fleet
    finally:
        for sidecar in fleet.sidecars:
            sidecar.kill()
        for cp in (a, b):
            if cp.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(cp.proc.pid, signal.SIGCONT)  # a test that failed while B was stopped
            cp.stop()
        tools.stop()
        redis.stop()


def http_get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def replica_id(cp: ControlPlaneProcess) -> str:
    return cp.client().request("GET", "/healthz")["replica"]


def lease_owner(redis: RedisServer, name: str) -> str | None:
    raw = redis.command("HGET", f"tether:0:lease:{name}", "owner")  # RESP bulk string: $N\r\nVALUE\r\n
    return None if raw.startswith(b"$-1") else raw.split(b"\r\n")[1].decode()


def record_of(cp: ControlPlaneProcess, tid: str) -> dict[str, Any]:
    records = cp.client().request("GET", "/v1/records")
    mine = [r for r in records if r["termination_id"] == tid]
    assert len(mine) == 1, f"expected exactly one record for {tid}, found {len(mine)}"
    assert all(records[i]["prev_hash"] == records[i - 1]["hash"] for i in range(1, len(records)))
    return mine[0]


def wait_terminated(cp: ControlPlaneProcess, tid: str, timeout: float) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        try:
            view = cp.client().request("GET", f"/v1/terminations/{tid}")
        except ApiError:
            return None
        return view if view["state"] == "terminated" else None

    return wait_until(done, timeout, interval=0.2, what=f"termination {tid} to complete")


# -- (a) Redis crashes and comes back ------------------------------------------------------------------------
def test_redis_outage_fails_closed_at_the_lease_then_recovers_and_loses_no_report(fleet: Fleet) -> None:
    fleet.ensure_up()
    ident = fleet.a.issue("rds-out", {"issues.read": "direct"})
    sc = fleet.sidecar(fleet.a, ident)
    calls: list[tuple[str, requests.Response]] = []

    def call(tag: str) -> requests.Response:
        path = f"/repos/rds/{tag}/issues"
        resp = fleet.call(sc, path)
        calls.append((path, resp))
        return resp

    for i in range(3):
        assert call(f"before-{i}").status_code == 200
    wait_until(lambda: len(reports_for(fleet.a, "rds-out")) == 3, 10, what="the first reports to be accepted")

    fleet.redis.kill()  # a crash: whatever was acknowledged must be in the append-only file
    down_at = time.monotonic()
    # The lease (3 s, renewed every second) still runs: granted calls are forwarded...
    assert call("during-0").status_code == 200
    for cp in (fleet.a, fleet.b):
        status, body = http_get(cp.url + "/healthz")
        assert status == 503 and body["store"] == "unreachable", body
        for method, path in (("GET", "/v1/agents"), ("POST", f"/v1/grants/{ident.jti}/revoke")):
            with pytest.raises(ApiError) as refused:
                cp.client().request(method, path, {} if method == "POST" else None)
            assert (refused.value.http_status, refused.value.code) == (503, "tether.store_unavailable")
    n = 1
    while (resp := call(f"during-{n}")).status_code == 200:
        assert time.monotonic() - down_at < 20, "calls were still forwarded long after the lease TTL"
        n += 1
        time.sleep(0.1)
    # ...until it runs out: then every call is refused, and nothing leaves.
    assert_refused(resp, "tether.lease_expired", 503, capability="issues.read")
    for i in range(3):
        assert_refused(call(f"expired-{i}"), "tether.lease_expired", 503)
    for path, r in calls:
        assert fleet.tools.hits_for(path) == (1 if r.status_code == 200 else 0), path
    spooled = {json.loads(line)["url"] for line in (sc.state_dir / "reports.spool").read_text().splitlines()}
    assert {fleet.tools.base + p for p, _ in calls[3:]} <= spooled, "reports made during the outage are spooled"

    fleet.redis.start()  # same port, same directory: the append-only file is read back
    for cp in (fleet.a, fleet.b):
        wait_until(cp.healthy, 15, what=f"replica on {cp.port} to report the store healthy again")
    assert {n["agent"] for n in fleet.b.client().request("GET", "/v1/agents")["agents"]} >= {"rds-out"}
    m = 0

    def forwarded_again() -> bool:
        nonlocal m
        m += 1
        return call(f"after-{m}").status_code == 200

    wait_until(forwarded_again, 20, interval=0.2, what="calls to be forwarded once Redis is back")
    wait_until(lambda: len(reports_for(fleet.b, "rds-out")) >= len(calls), 20, what="every report delivered")
    time.sleep(1.0)  # a late duplicate delivery would land here
    reports = reports_for(fleet.b, "rds-out")
    ids = [r["call_id"] for r in reports]
    assert len(ids) == len(set(ids)), "a call was stored twice"
    assert len(reports) == len(calls)
    by_url: dict[str, list[dict[str, Any]]] = {}
    for report in reports:
        by_url.setdefault(report["url"], []).append(report)
    for path, r in calls:
        (report,) = by_url[fleet.tools.base + path]
        if r.status_code == 200:
            assert (report["resolution"], report["status"]) == ("completed", 200), report
        else:
            assert report["call_id"] == r.json()["error"]["call_id"]
            assert (report["resolution"], report["code"]) == ("refused", r.headers["Tether-Error"])
    wait_until(lambda: (sc.state_dir / "reports.spool").read_text() == "", 10, what="the spool to drain")


# -- (b) the replica driving a termination dies ------------------------------------------------------------
def test_a_replica_killed_while_draining_is_replaced_and_the_termination_ends_in_one_record(fleet: Fleet) -> None:
    fleet.ensure_up()
    a, b = fleet.a, fleet.b
    ident = a.issue("kill-t", {"slow.read": "direct", "issues.read": "direct"})
    sc = fleet.sidecar(b, ident)  # follows B: it must hear the command and acknowledge through B
    a_id = replica_id(a)
    plan = {"short-0": 2.0, "short-1": 2.0, "long-0": 30.0}  # the window lets the short ones finish
    with ThreadPoolExecutor(len(plan)) as pool:
        results = {tag: pool.submit(fleet.call, sc, f"/slow?s={s}&tag={tag}", 45) for tag, s in plan.items()}
        wait_until(lambda: fleet.tools.active >= len(plan), 10, what="the calls to reach the tool")
        assert b.proc is not None
        os.kill(b.proc.pid, signal.SIGSTOP)  # until A has taken the termination, B cannot drive it
        try:
            tid = a.client().request(
                "POST", "/v1/agents/kill-t/terminate", {"mode": "drain", "window_s": 6, "reason": "replica crash test"}
            )["termination_id"]
            wait_until(
                lambda: a.client().request("GET", f"/v1/terminations/{tid}")["state"] == "draining",
                10,
                interval=0.05,
                what="replica A to start draining",
            )
            assert lease_owner(fleet.redis, f"termination:{tid}") == a_id, "A drives the termination"
            a.kill()
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        view = wait_terminated(b, tid, 6 + GRACE_S + 20)
        outcomes: dict[str, Any] = {}
        for tag, future in results.items():
            try:
                outcomes[tag] = future.result(timeout=30).status_code
            except requests.RequestException as exc:
                outcomes[tag] = type(exc).__name__
    assert [h["state"] for h in view["history"]] == ["requested", "draining", "reconciling", "terminated"]
    assert view["acknowledged"] == ["kill-t"], view
    assert outcomes["short-0"] == outcomes["short-1"] == 200, outcomes
    assert outcomes["long-0"] != 200, outcomes  # cut at the end of the window

    record = record_of(b, tid)
    assert record["record_id"] == view["record_id"]
    assert terminated_agents(record) == ["kill-t"] and record["agents_unaccounted"] == []
    # A report keeps the path, not the query: the three calls differ by their outcome only.
    calls = record["calls"]
    assert [c["url"] for c in calls] == [f"{fleet.tools.base}/slow"] * len(plan), "every call in flight, once"
    assert len({c["call_id"] for c in calls}) == len(plan)
    assert sorted((c["resolution"], c["status"]) for c in calls) == [
        ("completed", 200),
        ("completed", 200),
        ("unknown", None),
    ], calls
    assert not [c for c in record["calls"] if c.get("agent") != "kill-t"]


# -- (c) a sidecar cut off from every replica ------------------------------------------------------------------
def test_a_partitioned_sidecar_fails_closed_and_the_termination_lists_it_unaccounted(fleet: Fleet) -> None:
    fleet.ensure_up()
    relay = Relay(fleet.a.port).start()
    via_relay = ControlPlaneProcess(fleet.a.directory, port=relay.port)  # A, as the sidecar reaches it
    pool = ThreadPoolExecutor(1)
    try:
        ident = fleet.a.issue("part-c", {"issues.read": "direct", "slow.read": "direct"})
        sc = fleet.sidecar(via_relay, ident)
        assert fleet.call(sc, "/repos/part/first/issues").status_code == 200
        inflight = pool.submit(fleet.call, sc, "/slow?s=60&tag=inflight", 90)

        def seen_in_flight() -> list[dict[str, Any]]:
            doc = fleet.b.client().request("GET", "/v1/agents")
            node = next(n for n in doc["agents"] if n["agent"] == "part-c")
            return [] if not node["sidecar"] or node["sidecar"]["inflight"] < 1 else [node]

        wait_until(seen_in_flight, 10, what="a heartbeat carrying the call in flight")
        relay.cut()
        cut = time.monotonic()
        tag = 0
        while (resp := fleet.call(sc, f"/repos/part/cut-{tag}/issues")).status_code == 200:
            assert time.monotonic() - cut < 15, "calls were still forwarded long after the lease TTL"
            tag += 1
            time.sleep(0.1)
        assert_refused(resp, "tether.lease_expired", 503, capability="issues.read")
        for i in range(3):
            refused = fleet.call(sc, f"/repos/part/late-{i}/issues")
            assert_refused(refused, "tether.lease_expired", 503)
            assert fleet.tools.hits_for(f"/repos/part/late-{i}/issues") == 0
        assert not inflight.done(), "the call in flight is the tool's business: the partition does not end it"

        tid = fleet.b.client().request(
            "POST", "/v1/agents/part-c/terminate", {"mode": "abort", "window_s": 0, "reason": "partition test"}
        )["termination_id"]
        view = wait_terminated(fleet.b, tid, GRACE_S + 15)
        assert view["acknowledged"] == []
        record = record_of(fleet.a, tid)
        assert terminated_agents(record) == []
        (lost,) = record["agents_unaccounted"]
        assert lost["agent"] == "part-c"
        assert relay.cut_at is not None and lost["last_seen"] <= relay.cut_at + 2.0
        assert lost["lease_expires_at"] <= record["completed_at"]
        (last_known,) = lost["calls_in_flight_last_known"]
        assert last_known["url"] == f"{fleet.tools.base}/slow" and last_known["capability"] == "slow.read"
        (entry,) = [c for c in record["calls"] if c["call_id"] == last_known["call_id"]]
        assert entry["resolution"] == "unknown" and entry["reported"] is False
        assert sc.proc is not None and sc.proc.poll() is None  # it never heard the command: still refusing
        assert_refused(fleet.call(sc, "/repos/part/after/issues"), "tether.lease_expired", 503)
    finally:
        for sidecar in [s for s in fleet.sidecars if s.identity.agent == "part-c"]:
            sidecar.kill()  # ends the client's call in flight too
        pool.shutdown(wait=True)
        relay.stop()


# -- (d) at-least-once report delivery, to any replica, in any order --------------------------------------------
def test_duplicate_and_reordered_reports_across_replicas_are_stored_once(fleet: Fleet) -> None:
    fleet.ensure_up()
    a, b = fleet.a, fleet.b
    ident = a.issue("dup-d", {"issues.read": "direct"})
    leaf = parse_chain_unverified(ident.wire)[-1]
    signer = Signer("dup-d", leaf.hash, keys.load_private(ident.key_path.read_bytes()), "run-dup-d")
    a.client().request("POST", "/v1/chains/register", {"chain": ident.wire}, signer=signer)
    t0 = time.time() - 60

    def report(i: int) -> dict[str, Any]:
        return {
            "call_id": f"dup-d-{i:03d}",
            "agent": "dup-d",
            "capability": "issues.read",
            "method": "GET",
            "url": f"{fleet.tools.base}/repos/dup/{i}/issues",
            "started_at": t0 + i,
            "ended_at": t0 + i + 0.5,
            "resolution": "completed",
            "status": 200,
        }

    def post(cp: ControlPlaneProcess, batch: list[dict[str, Any]]) -> tuple[int, int]:
        answer = cp.client().request("POST", "/v1/reports", {"reports": batch}, signer=signer)
        return answer["accepted"], answer["duplicates"]

    first = [report(i) for i in range(6)]
    assert post(b, first[3:][::-1]) == (3, 0)  # the newer half first, reversed, to B
    assert post(a, first[::-1]) == (3, 3)  # everything, reversed, to A
    assert post(b, first) == (0, 6)  # everything again, to B
    assert post(a, [{**first[0], "status": 500, "resolution": "unknown"}]) == (0, 1)  # a repeat never rewrites

    second = [report(i) for i in range(6, 12)]
    batches = []
    for n in range(8):  # the same reports, raced to both replicas at once, each copy in its own order
        shuffled = random.Random(n).sample(second, len(second))
        batches.append((a if n % 2 else b, shuffled))
    with ThreadPoolExecutor(len(batches)) as pool:
        answers = list(pool.map(lambda job: post(*job), batches))
    assert sum(accepted for accepted, _ in answers) == 6, answers
    assert sum(dup for _, dup in answers) == 6 * (len(batches) - 1), answers

    expected = {r["call_id"] for r in first + second}
    for cp in (a, b):
        stored = reports_for(cp, "dup-d")
        ids = [r["call_id"] for r in stored]
        assert len(ids) == len(set(ids)) == 12 and set(ids) == expected, ids
        assert next(r for r in stored if r["call_id"] == "dup-d-000")["status"] == 200

    tid = a.client().request(
        "POST", "/v1/agents/dup-d/terminate", {"mode": "abort", "window_s": 0, "reason": "report test"}
    )["termination_id"]
    wait_terminated(b, tid, GRACE_S + 15)
    record = record_of(b, tid)
    listed = [c["call_id"] for c in record["calls"]]
    assert listed == sorted(expected), "each call once, in the order the calls started"
    assert all(c["resolution"] == "completed" for c in record["calls"])


# -- (e) a fleet's burst is load, not an outage ----------------------------------------------------------------
BURST = 300  # long polls parked on one replica; a real fleet parks one per sidecar


def test_a_burst_of_long_polls_woken_at_once_is_served_not_refused(fleet: Fleet) -> None:
    """One revocation wakes every long poll parked on a replica, and each reads the store at the same moment.
    Redis is up and healthy throughout: every poll must get the revocation, none a 503."""
    fleet.ensure_up()
    ident = fleet.a.issue("burst-e", {"issues.read": "direct"})
    leaf = parse_chain_unverified(ident.wire)[-1]
    key = keys.load_private(ident.key_path.read_bytes())
    fleet.a.client().request("POST", "/v1/chains/register", {"chain": ident.wire})

    async def burst() -> list[tuple[int, str | None, Any]]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

            async def get(path: str) -> tuple[int, str | None, Any]:
                proof = make_proof(
                    key, agent="burst-e", method="GET", path=path, body=b"", now=time.time(), link=leaf.hash
                )
                async with session.get(
                    fleet.b.url + path, headers={"Tether-Proof": proof}, timeout=aiohttp.ClientTimeout(total=40)
                ) as resp:
                    return resp.status, resp.headers.get("Tether-Error"), await resp.json()

            status, _, resync = await get("/v1/events?after=-1&wait=0")
            assert status == 200 and resync["resync"], resync
            polls = [asyncio.create_task(get(f"/v1/events?after={resync['next']}&wait=25")) for _ in range(BURST)]
            await asyncio.sleep(3)  # let the replica park them
            # (a poll already answered here was refused on arrival: the assertion below reports it)
            await asyncio.to_thread(
                fleet.a.client().request, "POST", f"/v1/grants/{ident.jti}/revoke", {"reason": "burst test"}
            )
            return await asyncio.wait_for(asyncio.gather(*polls), 30)

    answers = asyncio.run(burst())
    outcomes = Counter((status, code) for status, code, _ in answers)
    assert outcomes == {(200, None): BURST}, f"a healthy Redis answered as if it were down: {dict(outcomes)}"
    for _, _, doc in answers:
        assert [(e["kind"], e["payload"]["jti"]) for e in doc["events"]] == [("revoke", ident.jti)]
    assert fleet.b.healthy()
