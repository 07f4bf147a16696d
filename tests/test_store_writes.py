"""A store that answers but cannot take writes: ``/healthz`` says so, and recovers once writes succeed again.

Real faults, no mocks: a SQLite store on a 2 MiB tmpfs that a filler file fills up (mounting needs root; the
tests skip saying why otherwise), and a ``redis-server`` of the test's own told ``maxmemory 1`` under
``noeviction`` (OOM) or ``min-replicas-to-write 1`` with no replica (NOREPLICAS). Meanwhile every write answers
503 ``tether.store_unwritable`` (never 500 ``tether.internal``), ``/healthz`` answers 503 with that code and
the reason, reads still work; afterwards ``/healthz`` is 200 again and nothing was lost: every call a sidecar
made (the tool server's log as ground truth, refusals included) is reported once, and nothing written before
the fault is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tether.capability.errors import ApiError
from tether.controlplane.store import STORE_UNWRITABLE, Store, StoreUnwritable, open_store_url
from tether.controlplane.store.health import WriteHealth

from . import harness
from .conftest import World, build_world, teardown_world
from .harness import RedisServer, reports_for, wait_until

ISSUES = "/repos/o/r/issues"
RECOVERY_S = 30.0  # the probe runs every 2 s; this is a bound, not a measurement


# -- a small disk we can fill --------------------------------------------------------------------------------
class SmallDisk:
    """A 2 MiB tmpfs at ``path``; ``fill()`` takes every free byte with a filler file, ``free()`` removes it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.filler = path / "filler"

    def fill(self) -> None:
        with open(self.filler, "ab") as out:
            with contextlib.suppress(OSError):  # ENOSPC: full
                while True:
                    out.write(b"\0" * 4096)
                    out.flush()
        fs = os.statvfs(self.path)
        assert fs.f_bavail == 0, f"{fs.f_bavail} blocks still free on {self.path}"

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    path = tmp_path / "disk"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        reason = f"cannot mount a tmpfs to fill up (needs root): {done.stderr.strip() or done.returncode}"
        print(reason)
        pytest.skip(reason)
    try:
        yield SmallDisk(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


def redis_config(server: RedisServer, name: str, value: str) -> None:
    assert server.command("CONFIG", "SET", name, value).startswith(b"+OK")


# -- the pure verdict ------------------------------------------------------------------------------------------
def test_write_health_is_the_newest_outcome_and_probes_are_spaced() -> None:
    health = WriteHealth(probe_every_s=2.0)
    assert health.writable and health.probe_due(0.0)
    health.probing(0.0)
    assert not health.probe_due(1.9) and health.probe_due(2.0)
    assert health.succeeded(1.0) is False  # already writable: nothing to announce
    assert health.failed(3.0, "disk full") is True  # turns unwritable: the moment to log
    assert not health.writable and health.reason == "disk full"
    assert health.failed(4.0, "disk full") is False
    assert health.succeeded(3.5) is False and not health.writable  # an older success does not clear it
    assert health.succeeded(5.0) is True and health.writable


def test_redis_write_refusals_are_told_from_other_errors() -> None:
    """What Redis answers when it refuses a write, as redis-py raises it (MISCONF needs a failing background
    save, which a test cannot cause without touching Redis's protected configs: its words are checked here)."""
    from redis import exceptions as rex

    from tether.controlplane.store.redis import _write_refusal

    refusals = [rex.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
                rex.ReadOnlyError("You can't write against a read only replica."),
                rex.ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to "
                                  "persist to disk."),
                rex.ResponseError("NOREPLICAS Not enough good replicas to write.")]
    assert all(_write_refusal(exc) for exc in refusals)
    others = [rex.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
              rex.ResponseError("ERR Error running script: user_script:3: attempt to compare nil with number"),
              rex.NoScriptError("No matching script.")]
    assert not any(_write_refusal(exc) for exc in others)


# -- the stores themselves ------------------------------------------------------------------------------------
def _report(n: int) -> dict[str, Any]:
    return {"call_id": f"c{n:04d}", "agent": "a", "capability": "issues.read", "method": "GET",
            "url": "http://x/", "started_at": float(n), "resolution": "completed", "status": 200}


async def _refused_then_recovered(store: Store, break_writes: Callable[[], None], fix_writes: Callable[[], None],
                                  expect_in_reason: str,
                                  meanwhile: Callable[[], Awaitable[None]] | None = None) -> None:
    assert (await store.put_reports([_report(n) for n in range(20)]))[0] == 20
    assert (await store.write_status()).writable
    break_writes()
    with pytest.raises(StoreUnwritable) as refused:
        await store.put_reports([_report(n) for n in range(20, 400)])
    assert expect_in_reason in str(refused.value)
    with pytest.raises(StoreUnwritable):  # a document write and a record append (a Lua script under Redis)
        await store.cas_doc("termination", "t1", 0, {"id": "t1", "version": 1})
    with pytest.raises(StoreUnwritable):
        await store.append_record({"record_id": "r1", "prev_hash": "", "hash": "sha256:1", "calls": []})
    status = await store.write_status()
    assert not status.writable and expect_in_reason in status.reason
    # Reads still answer, and a refused write left nothing half-written.
    assert [r["call_id"] for r in await store.reports(["a"])] == [f"c{n:04d}" for n in range(20)]
    assert await store.get_doc("termination", "t1") is None and await store.records() == []
    if meanwhile is not None:
        await meanwhile()
    fix_writes()
    deadline = time.monotonic() + RECOVERY_S
    while not (await store.write_status()).writable:  # the next probe, at most every 2 s, clears it
        assert time.monotonic() < deadline, "the store never turned writable again"
        await asyncio.sleep(0.2)
    assert (await store.put_reports([_report(n) for n in range(20, 400)]))[0] == 380
    assert await store.cas_doc("termination", "t1", 0, {"id": "t1", "version": 1})
    assert await store.append_record({"record_id": "r1", "prev_hash": "", "hash": "sha256:1", "calls": []})
    assert len(await store.reports(["a"])) == 400


async def test_sqlite_on_a_full_disk_refuses_writes_as_unwritable_and_recovers(small_disk: SmallDisk) -> None:
    url = f"sqlite:///{small_disk.path / 'tether.db'}"
    store = open_store_url(url)
    await store.open()

    async def restart_while_full() -> None:  # a replica restarted on the full disk opens and reads
        again = open_store_url(url)
        await again.open()
        try:
            assert len(await again.reports(["a"])) == 20
            assert not (await again.write_status()).writable
        finally:
            await again.close()

    try:
        await _refused_then_recovered(store, small_disk.fill, small_disk.free, "SQLITE_FULL", restart_while_full)
    finally:
        await store.close()


@pytest.mark.parametrize(("setting", "refused", "ok", "words"), [
    ("maxmemory", "1", "0", "OOM"),
    ("min-replicas-to-write", "1", "0", "NOREPLICAS"),
])
async def test_redis_refusing_writes_is_unwritable_and_recovers(redis_server: RedisServer, setting: str,
                                                                refused: str, ok: str, words: str) -> None:
    store = open_store_url(redis_server.url(0))
    await store.open()
    try:
        await _refused_then_recovered(store, lambda: redis_config(redis_server, setting, refused),
                                      lambda: redis_config(redis_server, setting, ok), words)
    finally:
        await store.close()


# -- a control plane and a sidecar through the fault --------------------------------------------------------
def healthz(world: World) -> tuple[int, dict[str, Any], str | None]:
    """/healthz's status, body and Tether-Error header."""
    try:
        with urllib.request.urlopen(world.cp.url + "/healthz", timeout=10) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get("Tether-Error")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers.get("Tether-Error")


def through_the_fault(world: World, break_writes: Callable[[], None], fix_writes: Callable[[], None],
                      words: str) -> None:
    cp = world.cp
    writer = cp.issue("writer", {"issues.read": "direct"})
    bystander = cp.issue("bystander", {"issues.read": "direct"})
    cp.client().request("POST", "/v1/chains/register", {"chain": bystander.wire})
    sidecar = world.sidecar(writer)
    answers: list[int] = []

    def call() -> None:
        answers.append(requests.get(f"{world.tools.base}{ISSUES}", proxies=sidecar.proxies(), timeout=30).status_code)

    for _ in range(3):
        call()
    wait_until(lambda: len(reports_for(cp, "writer")) == 3, 30, what="the first reports")
    assert healthz(world)[0] == 200

    break_writes()
    _, body, header = wait_until(lambda: (h := healthz(world))[0] == 503 and h, RECOVERY_S,
                                      what="/healthz turning 503")
    assert (body["status"], body["store"], body["code"], header) == ("unhealthy", "unwritable", STORE_UNWRITABLE,
                                                                     STORE_UNWRITABLE)
    assert words in body["reason"], body
    with pytest.raises(ApiError) as refused:  # a write: 503 with the code, not 500 tether.internal
        cp.client().request("POST", f"/v1/grants/{bystander.jti}/revoke", {"reason": "through the fault"})
    assert (refused.value.http_status, refused.value.code) == (503, STORE_UNWRITABLE), refused.value
    assert len(reports_for(cp, "writer")) == 3  # reads still answer
    for _ in range(3):  # forwarded while the lease lasts, refused after: either way reported once it is back
        call()
    assert healthz(world)[0] == 503

    fix_writes()
    wait_until(lambda: healthz(world)[0] == 200, RECOVERY_S, what="/healthz back to 200")
    assert healthz(world)[1]["store"] == "ok"
    revoked = cp.client().request("POST", f"/v1/grants/{bystander.jti}/revoke", {"reason": "after the fault"})
    assert revoked["jti"] == bystander.jti

    def forwarding() -> bool:  # the lease may have lapsed meanwhile: calls are refused until it renews
        call()
        return answers[-1] == 200

    wait_until(forwarding, 30, interval=0.5, what="the sidecar forwarding again")
    made = len(answers)

    def all_reported() -> list[dict[str, Any]] | None:
        got = reports_for(cp, "writer")
        return got if len(got) >= made else None

    reports = wait_until(all_reported, 60, what=f"all {made} calls reported")
    ids = [r["call_id"] for r in reports]
    assert len(ids) == len(set(ids)) == made, (len(ids), len(set(ids)), made)
    completed = [r for r in reports if r["resolution"] == "completed"]
    assert len(completed) == world.tools.hits_for(ISSUES) == answers.count(200)
    assert all(r["resolution"] == "refused" for r in reports if r not in completed)
    assert "tether.internal" not in (cp.directory / "controlplane.log").read_text()


def test_a_full_disk_under_sqlite_turns_healthz_503_then_200_and_loses_nothing(
        small_disk: SmallDisk, tmp_path: Path, test_ca: harness.TestCA) -> None:
    world = build_world(tmp_path, test_ca, store=f"sqlite:///{small_disk.path / 'tether.db'}")
    try:
        world.cp.start()
        through_the_fault(world, small_disk.fill, small_disk.free, "SQLITE_FULL")
    finally:
        teardown_world(world)


def test_redis_out_of_memory_turns_healthz_503_then_200_and_loses_nothing(
        redis_server: RedisServer, tmp_path: Path, test_ca: harness.TestCA) -> None:
    world = build_world(tmp_path, test_ca, store=redis_server.url(0))
    try:
        world.cp.start()
        through_the_fault(world, lambda: redis_config(redis_server, "maxmemory", "1"),
                          lambda: redis_config(redis_server, "maxmemory", "0"), "OOM")
    finally:
        teardown_world(world)


def test_closing_the_sqlite_store_waits_for_work_still_running_on_a_worker_thread(tmp_path: Path) -> None:
    """A task cancelled while its query runs in a worker thread leaves the thread running; closing the store then
    closed the connection under it (a control plane that failed to listen right after start-up died by SIGSEGV
    in CI). Closing now waits for that work, which finishes on an open connection."""
    from tether.controlplane.store.sqlite import SqliteStore

    outcome: list[object] = []

    def slow(db: Any) -> None:
        time.sleep(0.5)  # still running when the store is closed
        try:
            outcome.append(db.execute("SELECT count(*) FROM records").fetchone()[0])
        except Exception as exc:  # what the query met is the test's finding
            outcome.append(exc)

    async def scenario() -> float:
        store = SqliteStore(str(tmp_path / "cp.db"))
        await store.open()
        task = asyncio.create_task(store._off_loop(slow))
        await asyncio.sleep(0.1)  # the work is in its thread
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        began = time.monotonic()
        await store.close()
        return time.monotonic() - began

    waited = asyncio.run(scenario())
    assert outcome == [0], outcome
    assert waited >= 0.2
