"""The sidecar's reporter and capture writer under the faults they exist for, against a real control plane.

The spool writes each call's start ahead of its first byte and cuts it once the call's final report is
delivered; a new reporter on an old spool turns every start without a final into an ``unknown`` report;
a flush delivers what was pending when it began, however fast reports keep arriving (over a link that
delays every chunk). A capture write that fails half way is cut back off the file, so every later flow
stays readable. End-to-end versions with real sidecar processes are in test_write_ahead.py.
"""

from __future__ import annotations

import asyncio
import errno
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from mitmproxy.test import tflow

from tether.capability import keys
from tether.capability.chain import parse_chain_unverified
from tether.capability.errors import TetherError
from tether.capture.har import to_har
from tether.capture.segments import read_flows
from tether.controlplane.client import Signer
from tether.proxy.capture import CaptureWriter
from tether.proxy.channel import ControlChannel
from tether.proxy.reporting import RESTARTED, STATE_DIR_LOCKED, Reporter, lock_state_dir
from tether.proxy.state import Call

from .conftest import World, build_world, teardown_world
from .harness import Identity, reports_for
from .test_redis_faults import Relay

if TYPE_CHECKING:
    from .harness import TestCA

LIVENESS_S = 60.0


class SlowRelay(Relay):
    """The fault tests' TCP relay, holding every chunk ``delay`` seconds in each direction: a slow link."""

    def __init__(self, target_port: int, delay: float) -> None:
        super().__init__(target_port)
        self.delay = delay

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if self.delay:
                    await asyncio.sleep(self.delay)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass


@pytest.fixture(scope="module")
def cpworld(tmp_path_factory: pytest.TempPathFactory, test_ca: TestCA) -> Iterator[World]:
    world = build_world(tmp_path_factory.mktemp("spool-world"), test_ca)
    world.cp.start()
    try:
        yield world
    finally:
        teardown_world(world)


def registered(world: World, agent: str) -> Identity:
    ident = world.cp.issue(agent, {"issues.read": "direct"})
    signer = Signer(agent, parse_chain_unverified(ident.wire)[-1].hash, keys.load_private(ident.key_path.read_bytes()))
    world.cp.client(admin=False).request("POST", "/v1/chains/register", {"chain": ident.wire}, signer=signer)
    return ident


def channel_for(ident: Identity, url: str) -> ControlChannel:
    link = parse_chain_unverified(ident.wire)[-1]
    return ControlChannel(url, ident.agent, link.hash, keys.load_private(ident.key_path.read_bytes()),
                          f"run-{ident.agent}")


def call(agent: str, n: int) -> Call:
    return Call(call_id=f"{agent}-{n}", agent=agent, method="GET", url=f"http://tool:80/c/{n}",
                started_at=time.time(), capability="issues.read", tier="direct", phase="forwarding")


def final(c: Call, resolution: str = "completed") -> dict[str, Any]:
    c.resolution, c.status, c.ended_at = resolution, 200, time.time()
    return c.report()


def spool_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# -- the write-ahead spool ----------------------------------------------------------------------------------
def test_starts_are_spooled_ahead_and_cut_when_their_calls_are_delivered(cpworld: World, tmp_path: Path) -> None:
    ident = registered(cpworld, "wal-unit")
    spool = tmp_path / "reports.spool"

    async def run() -> None:
        channel = channel_for(ident, cpworld.cp.url)
        reporter = Reporter(channel, spool)
        a, b, c = (call("wal-unit", n) for n in range(3))
        for each in (a, b, c):
            reporter.start(each)
        reporter.start(a)  # a second look at the same call writes nothing more
        lines = spool_lines(spool)
        assert [(d["event"], d["call_id"]) for d in lines] == [("start", a.call_id), ("start", b.call_id),
                                                               ("start", c.call_id)]
        assert {k: lines[0][k] for k in ("agent", "capability", "method", "url", "started_at")} == {
            "agent": "wal-unit", "capability": "issues.read", "method": "GET", "url": a.url,
            "started_at": a.started_at}
        reporter.add(final(a))
        assert [d.get("event", "final") for d in spool_lines(spool)] == ["start", "start", "start", "final"]
        assert await reporter.flush()
        # Delivered: a's start and final are gone; b and c are still in flight, their starts stay.
        assert [(d["event"], d["call_id"]) for d in spool_lines(spool)] == [("start", b.call_id),
                                                                            ("start", c.call_id)]
        assert reporter.inflight == 2
        reporter.add(final(b))
        reporter.add(final(c, "unknown"))
        assert await reporter.flush()
        assert spool.read_text() == ""  # nothing in flight, nothing undelivered
        await channel.close()

    asyncio.run(run())
    assert sorted((r["call_id"], r["resolution"]) for r in reports_for(cpworld.cp, "wal-unit")) == [
        ("wal-unit-0", "completed"), ("wal-unit-1", "completed"), ("wal-unit-2", "unknown")]


def test_a_new_reporter_reports_every_started_unfinished_call_as_unknown(cpworld: World, tmp_path: Path) -> None:
    ident = registered(cpworld, "wal-recover")
    spool = tmp_path / "reports.spool"
    done, lost, delivered_lost = call("wal-recover", 0), call("wal-recover", 1), call("wal-recover", 2)

    async def first_run() -> None:  # a sidecar run that dies with two calls in flight
        channel = channel_for(ident, "http://127.0.0.1:9")  # nothing listens: nothing is delivered
        reporter = Reporter(channel, spool)
        for c in (done, lost, delivered_lost):
            reporter.start(c)
        reporter.add(final(done))
        await channel.close()

    asyncio.run(first_run())
    with open(spool, "a") as f:
        f.write('{"event":"start","call_id":"torn')  # SIGKILL or a full disk in the middle of a line

    async def second_run() -> None:
        channel = channel_for(ident, cpworld.cp.url)
        reporter = Reporter(channel, spool)
        assert reporter.recovered == 2
        pending = {r["call_id"]: r for r in reporter.pending}
        assert set(pending) == {done.call_id, lost.call_id, delivered_lost.call_id}
        assert pending[done.call_id]["resolution"] == "completed"
        for c in (lost, delivered_lost):
            r = pending[c.call_id]
            assert (r["resolution"], r["status"], r["detail"]) == ("unknown", None, RESTARTED)
            assert (r["agent"], r["capability"], r["method"], r["url"], r["started_at"]) == (
                "wal-recover", "issues.read", "GET", c.url, c.started_at)
        # On disk before anything else: the recovered finals replace the starts (no torn line either)
        on_disk = spool_lines(spool)
        assert all("event" not in d for d in on_disk) and {d["call_id"] for d in on_disk} == set(pending)
        assert await reporter.flush()
        assert spool.read_text() == ""
        await channel.close()

    asyncio.run(second_run())
    got = {r["call_id"]: r["resolution"] for r in reports_for(cpworld.cp, "wal-recover")}
    assert got == {done.call_id: "completed", lost.call_id: "unknown", delivered_lost.call_id: "unknown"}
    # A third run finds nothing left to recover
    assert Reporter(channel_for(ident, "http://127.0.0.1:9"), spool).count == 0


def test_a_report_the_control_plane_refuses_never_holds_back_the_others(cpworld: World, tmp_path: Path) -> None:
    """A hostile or stale spool line (no call id, another agent's call, a field the control plane refuses) is
    kept aside in ``reports.spool.rejected`` and said so; every other report is delivered."""
    ident = registered(cpworld, "wal-bad")
    spool = tmp_path / "reports.spool"
    good = [final(call("wal-bad", n)) for n in range(3)]
    refused_by_server = {**final(call("wal-bad", 9)), "run_id": "r" * 100}  # the reader allows 64 characters
    lines = [json.dumps(good[0]), '{"call_id": 5}', json.dumps({**good[1], "agent": "someone-else"}),
             json.dumps(refused_by_server), json.dumps(good[2])]
    spool.write_text("\n".join(lines) + "\n")

    async def run() -> None:
        channel = channel_for(ident, cpworld.cp.url)
        reporter = Reporter(channel, spool)
        assert reporter.count == 3  # two lines could never be delivered: kept aside at once
        assert await reporter.flush()
        assert spool.read_text() == ""
        await channel.close()

    asyncio.run(run())
    got = sorted(r["call_id"] for r in reports_for(cpworld.cp, "wal-bad"))
    assert got == [good[0]["call_id"], good[2]["call_id"]]
    kept = [json.loads(line) for line in (tmp_path / "reports.spool.rejected").read_text().splitlines()]
    assert [k["call_id"] for k in kept] == [5, good[1]["call_id"], refused_by_server["call_id"]]


def test_when_the_control_plane_refuses_every_report_none_is_kept_aside(cpworld: World, tmp_path: Path) -> None:
    """A refusal of every line is no fault of the lines (here: requests that name no sidecar run): they stay
    queued and spooled for the next try, and nothing goes to ``reports.spool.rejected``."""
    ident = registered(cpworld, "wal-all-refused")
    spool = tmp_path / "reports.spool"

    async def run() -> None:
        link = parse_chain_unverified(ident.wire)[-1]
        no_run = ControlChannel(cpworld.cp.url, ident.agent, link.hash, keys.load_private(ident.key_path.read_bytes()))
        reporter = Reporter(no_run, spool)
        for n in range(3):
            reporter.add(final(call("wal-all-refused", n)))
        assert not await reporter.flush()
        assert reporter.count == 3 and len(spool_lines(spool)) == 3
        await no_run.close()

    asyncio.run(run())
    assert not (tmp_path / "reports.spool.rejected").exists()
    assert reports_for(cpworld.cp, "wal-all-refused") == []


def test_the_state_dir_admits_one_sidecar(tmp_path: Path) -> None:
    held = lock_state_dir(tmp_path)
    try:
        with pytest.raises(TetherError) as refused:
            lock_state_dir(tmp_path)
        assert refused.value.code == STATE_DIR_LOCKED
        assert str(tmp_path) in str(refused.value)
    finally:
        held.close()
    lock_state_dir(tmp_path).close()  # released with its holder


# -- a bounded flush -------------------------------------------------------------------------------------
def test_a_flush_delivers_what_was_pending_however_fast_reports_arrive(cpworld: World, tmp_path: Path) -> None:
    """Over a link that holds every chunk 0.3 s, a report is added every 10 ms: more than the link carries.
    A flush still returns, having delivered what was queued when it began; the rest follows."""
    ident = registered(cpworld, "wal-busy")
    relay = SlowRelay(cpworld.cp.port, 0.3).start()
    seen: dict[str, Any] = {}

    async def run() -> None:
        channel = channel_for(ident, f"http://127.0.0.1:{relay.port}")
        reporter = Reporter(channel, tmp_path / "reports.spool")
        for n in range(250):  # more than one batch
            reporter.add(final(call("wal-busy", n), "refused"))
        stop = asyncio.Event()

        async def hammer() -> None:
            n = 1000
            while not stop.is_set():
                reporter.add(final(call("wal-busy", n), "refused"))
                n += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(hammer())
        mark = reporter.mark()
        assert await asyncio.wait_for(reporter.flush(mark), LIVENESS_S)
        seen["left"] = reporter.count
        seen["undelivered_of_mark"] = reporter.pending_until(mark)
        stop.set()
        await task
        relay.delay = 0
        assert await asyncio.wait_for(reporter.flush(), LIVENESS_S)
        await channel.close()

    try:
        asyncio.run(run())
    finally:
        relay.stop()
    assert seen["undelivered_of_mark"] == []
    assert seen["left"] > 0  # the reports that came during the flush were left for the next one
    got = {r["call_id"] for r in reports_for(cpworld.cp, "wal-busy")}
    assert {f"wal-busy-{n}" for n in range(250)} <= got


# -- all-or-nothing capture writes -----------------------------------------------------------------------
class FailingFile:
    """A real capture file on a disk with room for ``keep`` more bytes: the write that passes them stores what
    fits and fails as a full disk does (the writes after it succeed: room was made). A record may be written in
    several pieces, so the room is counted across writes."""

    def __init__(self, real: Any, keep: int, truncate_fails: bool = False) -> None:
        self.real, self.keep, self.truncate_fails = real, keep, truncate_fails

    def write(self, data: Any) -> int:
        if self.keep is None:
            return self.real.write(data)
        fits = bytes(data[: self.keep])
        self.real.write(fits)
        self.keep -= len(fits)
        if len(fits) < len(data):
            self.keep = None  # type: ignore[assignment]
            raise OSError(errno.ENOSPC, "No space left on device")
        return len(fits)

    def truncate(self, size: int) -> int:
        if self.truncate_fails:
            raise OSError(errno.EIO, "Input/output error")
        return self.real.truncate(size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.mark.parametrize("truncate_fails", [False, True], ids=["cut-back", "cut-back-fails"])
def test_a_failed_capture_write_leaves_no_torn_bytes(tmp_path: Path, truncate_fails: bool) -> None:
    path = tmp_path / "captures" / "flows.mitm"
    writer = CaptureWriter(path)
    first, torn, later = (tflow.tflow(resp=True) for _ in range(3))
    assert writer.write(first)
    size = path.stat().st_size
    writer._file = FailingFile(writer._open(), keep=100, truncate_fails=truncate_fails)  # type: ignore[assignment]
    assert not writer.write(torn)
    assert "No space left" in (writer.last_error or "")
    if not truncate_fails:
        assert path.stat().st_size == size
    else:
        assert path.stat().st_size == size + 100  # torn bytes on disk until the next write cuts them
    assert writer.write(later)
    writer.close()
    flows = read_flows(path)
    assert [f.id for f in flows] == [first.id, later.id]
    assert len(to_har(flows)["log"]["entries"]) == 2
