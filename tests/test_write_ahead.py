"""Nothing a sidecar started is lost, whatever happens to it (docs/contract.md section 10, Write-ahead).

Real parts throughout: a control plane process, sidecar processes, the aiohttp tool server whose own log
of requests is the ground truth. A sidecar SIGKILLed with calls at the tool and restarted on its state
dir reports them as ``unknown``, and the next termination's record lists them; a second sidecar on a
state dir in use refuses to start. An agent that keeps calling while it is drained, over a link to the
control plane that delays every chunk, cannot keep its sidecar from acknowledging. A capture disk that
fills up and is freed again leaves every later flow readable and in the HAR export.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import requests

from tether.capture.segments import read_flows
from tether.controlplane.termination import terminated_agents
from tether.proxy.reporting import RESTARTED

from .conftest import World, build_world, teardown_world
from .harness import PYTHON, SidecarProcess, reports_for, wait_until
from .test_spool import SlowRelay, spool_lines
from .test_termination import record_of, run_cli, terminate, termination

if TYPE_CHECKING:
    from .harness import TestCA

ISSUES = "/repos/o/r/issues"


def get(world: World, sc: SidecarProcess, path: str, timeout: float = 10, **kwargs: Any) -> requests.Response:
    return requests.get(world.tools.base + path, proxies=sc.proxies(), timeout=timeout, **kwargs)


def in_background(world: World, sc: SidecarProcess, path: str, n: int) -> list[threading.Thread]:
    def run() -> None:
        try:
            get(world, sc, path, timeout=90)
        except requests.RequestException:
            pass  # the sidecar dies under it: the test looks at the tool server and the reports instead

    threads = [threading.Thread(target=run, daemon=True) for _ in range(n)]
    for thread in threads:
        thread.start()
    return threads


# -- SIGKILL, restart ------------------------------------------------------------------------------------
def test_a_sigkilled_sidecar_restarted_on_its_state_dir_reports_its_calls_in_flight(world: World) -> None:
    ident = world.cp.issue("wal-kill", {"slow.read": "direct", "issues.read": "direct"})
    sc = world.sidecar(ident)
    assert get(world, sc, ISSUES).status_code == 200
    threads = in_background(world, sc, "/slow?s=60", 3)
    wait_until(lambda: world.tools.hits_for("/slow") == 3, 15, what="three slow calls at the tool")
    # Each start was on disk before its first byte left, so before the tool saw it.
    spooled = spool_lines(sc.state_dir / "reports.spool")
    finished = {d["call_id"] for d in spooled if "event" not in d}  # the first call, if not delivered yet
    starts = [d for d in spooled if d.get("event") == "start" and d["call_id"] not in finished]
    assert len(starts) == 3 and all(d["url"].endswith("/slow") for d in starts), starts
    lost = {d["call_id"] for d in starts}
    sc.kill()
    for thread in threads:
        thread.join(30)

    again = world.sidecar(ident)  # same identity, same state dir
    assert again.state_dir == sc.state_dir

    # A second sidecar on a state dir in use refuses to start, and says why.
    second = subprocess.run(
        [PYTHON, "-m", "tether", "sidecar", "--controlplane", world.cp.url, "--chain",
         str(ident.chain_path), "--key", str(ident.key_path), "--listen", "127.0.0.1:0", "--state-dir",
         str(sc.state_dir)], env=world.cp.env(), capture_output=True, text=True, timeout=60)
    assert second.returncode == 2, second.stderr
    assert "tether.state_dir_locked" in second.stderr and str(again.proc.pid) in second.stderr  # type: ignore[union-attr]

    def recovered() -> dict[str, dict[str, Any]]:
        got = {r["call_id"]: r for r in reports_for(world.cp, "wal-kill") if r["call_id"] in lost}
        return got if len(got) == 3 else {}

    got = wait_until(recovered, 20, what="the restarted sidecar's reports of the lost calls")
    for report in got.values():
        assert (report["resolution"], report["status"], report["detail"]) == ("unknown", None, RESTARTED)
        assert (report["method"], report["capability"]) == ("GET", "slow.read")
        assert report["url"].endswith("/slow")
    assert world.tools.hits_for("/slow") == 3  # never retried
    wait_until(lambda: not [d for d in spool_lines(sc.state_dir / "reports.spool") if d["call_id"] in lost], 10,
               what="the delivered reports to be cut from the spool")

    out = run_cli(world, "terminate", "wal-kill", "--mode", "drain", "--window", "1", "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    record = world.cp.client().request("GET", "/v1/records")[-1]
    assert terminated_agents(record) == ["wal-kill"] and record["agents_unaccounted"] == []
    listed = {c["call_id"]: c for c in record["calls"] if c["call_id"] in lost}
    assert set(listed) == lost
    assert all((c["agent"], c["resolution"]) == ("wal-kill", "unknown") for c in listed.values())
    assert sum(1 for c in record["calls"] if c["url"].endswith(ISSUES) and c["resolution"] == "completed") == 1


def test_a_streamed_upload_is_written_ahead_before_its_headers_leave(world: World) -> None:
    """A chunked upload leaves as it arrives (the decision is made on its headers): its start is in the
    spool while its body is still on the way, and once it finishes the start is cut again."""
    ident = world.cp.issue("wal-stream", {"echo.any": "direct"})
    sc = world.sidecar(ident)
    spool = sc.state_dir / "reports.spool"
    seen: dict[str, Any] = {}
    go_on = threading.Event()

    def body() -> Iterator[bytes]:
        yield b"first part;"
        seen["starts"] = wait_until(lambda: [d for d in spool_lines(spool) if d.get("event") == "start"], 10,
                                    what="the upload's start in the spool")
        go_on.wait(10)
        yield b"second part"

    def upload() -> None:
        seen["resp"] = requests.post(world.tools.base + "/echo", data=body(), proxies=sc.proxies(), timeout=30)

    thread = threading.Thread(target=upload, daemon=True)
    thread.start()
    wait_until(lambda: "starts" in seen, 15, what="the start seen while the body streams")
    go_on.set()
    thread.join(30)
    (start,) = seen["starts"]
    assert (start["method"], start["capability"]) == ("POST", "echo.any") and start["url"].endswith("/echo")
    assert seen["resp"].status_code == 200 and seen["resp"].json()["body"] == "first part;second part"
    report = wait_until(lambda: reports_for(world.cp, "wal-stream"), 10, what="the upload's report")
    assert [(r["call_id"], r["resolution"]) for r in report] == [(start["call_id"], "completed")]
    wait_until(lambda: not spool_lines(spool), 10, what="the spool to be cut once delivered")


# -- acknowledgement under a hammering agent on a slow link ---------------------------------------------------
@pytest.fixture
def slow_world(tmp_path: Path, test_ca: TestCA) -> Iterator[World]:
    """A control plane whose grace leaves room for a link that holds every chunk a second."""
    w = build_world(tmp_path, test_ca, grace=20.0, lease_ttl=15.0)
    w.cp.start()
    try:
        yield w
    finally:
        teardown_world(w)


def test_an_agent_calling_through_a_drain_cannot_starve_the_acknowledgement(slow_world: World) -> None:
    world = slow_world
    ident = world.cp.issue("wal-busy", {"issues.read": "direct"})
    relay = SlowRelay(world.cp.port, 0).start()
    sc = world.sidecar(ident, "--controlplane", f"http://127.0.0.1:{relay.port}")
    stop = threading.Event()
    answers: list[tuple[int, str | None]] = []

    def hammer() -> None:  # /admin is granted to nobody: every call is refused, and each refusal is a report
        with requests.Session() as session:
            session.proxies.update(sc.proxies())
            while not stop.is_set():
                try:
                    resp = session.get(world.tools.base + "/admin", timeout=10)
                    answers.append((resp.status_code, resp.headers.get("Tether-Error")))
                except requests.RequestException:
                    answers.append((0, None))

    workers = [threading.Thread(target=hammer, daemon=True) for _ in range(6)]
    try:
        relay.delay = 1.0  # from now on the sidecar's reports carry far fewer calls a second than the agent makes
        for worker in workers:
            worker.start()
        wait_until(lambda: len(answers) > 300, 30, what="the agent's refused calls piling up")
        window = 2.0
        doc = terminate(world, "wal-busy", "drain", window)
        bound = window + world.cp.grace + 15
        final = wait_until(lambda: (t := termination(world, doc["termination_id"]))["state"] == "terminated" and t,
                           bound, interval=0.5, what="the termination's record")
    finally:
        stop.set()
        for worker in workers:
            worker.join(20)
    record = record_of(world, doc["termination_id"])
    assert terminated_agents(record) == ["wal-busy"], record["agents_unaccounted"]
    assert record["agents_unaccounted"] == []
    assert final["record_id"] == record["record_id"]
    assert world.tools.hits_for("/admin") == 0  # ground truth: not one of them reached the tool
    codes = {code for _, code in answers}
    assert {"tether.capability_absent", "tether.terminated"} <= codes, codes
    # Every answer is a tether refusal: absent before, then (the subtree is revoked before the drain command
    # goes out) chain_revoked, draining or terminated.
    refusals = {"tether.capability_absent", "tether.chain_revoked", "tether.draining", "tether.terminated"}
    assert all(code in refusals for _, code in answers), set(answers)

    # Reports that came during the acknowledgement travel after it: every refusal is reported in the end.
    relay.delay = 0
    wait_until(lambda: len(reports_for(world.cp, "wal-busy")) == len(answers), 60, interval=0.5,
               what=f"all {len(answers)} refusals reported")
    sc.stop()
    relay.stop()


# -- a capture disk that fills up ---------------------------------------------------------------------------
def mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    try:
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                             text=True, timeout=30)
    except OSError as exc:
        pytest.skip(f"cannot mount a tmpfs for the capture directory: {exc}")
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for the capture directory (needs root or CAP_SYS_ADMIN): "
                    f"{out.stderr.strip() or out.stdout.strip()}")


def fill(path: Path) -> int:
    """Write until the disk is full; returns the bytes written."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return path.stat().st_size


def test_a_capture_disk_that_fills_up_leaves_every_later_flow_readable(world: World, tmp_path: Path) -> None:
    ident = world.cp.issue("wal-cap", {"echo.any": "direct", "issues.read": "direct"})
    state_dir = world.cp.directory / "sidecars" / "wal-cap"
    captures = state_dir / "captures"
    mount_tmpfs(captures, "2m")
    sc: SidecarProcess | None = None
    try:
        sc = world.sidecar(ident)
        capture = captures / "flows.mitm"
        for n in range(2):
            assert get(world, sc, f"/repos/before/{n}/issues").status_code == 200
        wait_until(lambda: sum(f.response is not None for f in read_flows(capture)) == 2, 10,
                   what="the first two flows captured whole")
        size = capture.stat().st_size

        # The disk fills up, but for a few pages: the next flow's write starts and cannot finish.
        filler = captures / "filler"
        os.truncate(filler, fill(filler) - 16384)
        body = b"x" * (512 * 1024)
        resp = requests.post(world.tools.base + "/echo", data=body, proxies=sc.proxies(), timeout=15,
                             headers={"Content-Type": "application/octet-stream"})
        assert (resp.status_code, resp.headers.get("Tether-Error")) == (503, "tether.capture_unavailable")
        assert world.tools.hits_for("/echo") == 0  # not captured, so not forwarded
        assert capture.stat().st_size == size  # the torn write was cut back off

        filler.unlink()  # space again
        for n in range(3):
            assert get(world, sc, f"/repos/after/{n}/issues").status_code == 200
        expected = {f"/repos/{w}/{n}/issues" for w, k in (("before", 2), ("after", 3)) for n in range(k)}
        wait_until(lambda: {f.request.path for f in read_flows(capture) if f.response is not None} >= expected, 10,
                   what="every later flow readable in the capture")
        har = tmp_path / "out.har"
        out = subprocess.run([PYTHON, "-m", "tether", "capture", "export", "--agent", "wal-cap", "--har",
                              str(har), "--captures", str(state_dir.parent)], env=world.cp.env(),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        urls = {e["request"]["url"] for e in json.loads(har.read_text())["log"]["entries"]}
        assert {world.tools.base + p for p in expected} <= urls
        # The reports say the same: five completed calls, each pointing at its flow; the refused one too
        reports = wait_until(lambda: (r := reports_for(world.cp, "wal-cap")) and len(r) == 6 and r, 10,
                             what="six reports")
        assert sorted(r["resolution"] for r in reports) == ["completed"] * 5 + ["refused"]
    finally:
        if sc is not None:
            sc.stop()
        time.sleep(0.2)
        subprocess.run(["umount", "-l", str(captures)], capture_output=True, timeout=30)


def test_a_start_reaches_the_control_plane_long_before_the_next_heartbeat(tmp_path: Path, test_ca: TestCA) -> None:
    """Heartbeats come every lease TTL / 3 (20 s here); the written-ahead start of a call reaches the control
    plane within about a second. The sidecar is SIGKILLed two seconds after the call left and never comes
    back: the record still lists the call, as ``unknown``, from its start alone."""
    world = build_world(tmp_path, test_ca, lease_ttl=60.0)
    world.cp.start()
    try:
        ident = world.cp.issue("early", {"slow.read": "direct"})
        sc = world.sidecar(ident)
        threads = in_background(world, sc, "/slow?s=60", 1)
        wait_until(lambda: world.tools.hits_for("/slow") == 1, 15, what="the slow call at the tool")
        time.sleep(2.0)
        node = next(n for n in world.cp.client().request("GET", "/v1/agents")["agents"] if n["agent"] == "early")
        assert node["sidecar"]["inflight"] == 0  # no heartbeat has carried the call: only its start can
        sc.kill()
        for thread in threads:
            thread.join(30)
        tid = terminate(world, "early", "abort", 0)["termination_id"]
        wait_until(lambda: termination(world, tid)["state"] == "terminated", 30, what="the termination")
        record = record_of(world, tid)
        (call,) = [c for c in record["calls"] if c["url"].endswith("/slow")]
        assert (call["resolution"], call["reported"], call["capability"]) == ("unknown", False, "slow.read")
        (lost,) = record["agents_unaccounted"]
        assert [c["call_id"] for c in lost["calls_in_flight_last_known"]] == [call["call_id"]]
    finally:
        teardown_world(world)


def test_a_spool_disk_that_is_full_refuses_calls_rather_than_send_them_unrecorded(world: World) -> None:
    """The write-ahead is what lets a record account for a call its sidecar died with: a call whose start
    cannot be spooled is refused (``tether.spool_unavailable``) and never reaches the tool; with space back,
    calls flow again and every refusal is reported."""
    ident = world.cp.issue("wal-full", {"issues.read": "direct"})
    state_dir = world.cp.directory / "sidecars" / "wal-full"
    mount_tmpfs(state_dir, "4m")
    sc: SidecarProcess | None = None
    try:
        sc = world.sidecar(ident, "--no-capture")
        assert get(world, sc, "/repos/full/before/issues").status_code == 200
        filler = state_dir / "filler"
        fill(filler)
        # The spool's last page may still have room for a few lines; once it has none, every call is refused.
        outcomes: list[tuple[int, str | None, int]] = []
        for n in range(200):
            path = f"/repos/full/during-{n}/issues"
            resp = get(world, sc, path)
            outcomes.append((resp.status_code, resp.headers.get("Tether-Error"), world.tools.hits_for(path)))
            if len([o for o in outcomes if o[0] == 503]) >= 3:
                break
        refused = [o for o in outcomes if o[0] != 200]
        assert len(refused) == 3, outcomes
        assert all(o == (503, "tether.spool_unavailable", 0) for o in refused), outcomes  # none reached the tool
        filler.unlink()
        assert get(world, sc, "/repos/full/after/issues").status_code == 200
        total = len(outcomes) + 2
        reports = wait_until(lambda: (r := reports_for(world.cp, "wal-full")) and len(r) == total and r, 15,
                             what=f"{total} reports (the refusals kept in memory meanwhile)")
        assert sorted((r["resolution"], r.get("code")) for r in reports) == sorted(
            [("completed", None)] * (total - 3) + [("refused", "tether.spool_unavailable")] * 3)
    finally:
        if sc is not None:
            sc.stop()
        time.sleep(0.2)
        subprocess.run(["umount", "-l", str(state_dir)], capture_output=True, timeout=30)
