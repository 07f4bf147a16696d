"""Capture retention: segments rotate by size and age, are compressed and indexed, and are pruned by the policy
(an agent's age and cap, the state root's cap, the disk's floor) except what a termination holds; every reader
(``read_capture``, ``tether capture export``) reads across the segments. The policy's rules as a pure function,
the writer over real files, and real sidecars with ``tether capture prune`` and ``export``."""

from __future__ import annotations

import gzip
import json
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy.test import tflow

from tether.capability.errors import TetherError
from tether.capture.maintenance import prune, tidy
from tether.capture.retention import GIB, KIB, MIB, Hold, Policy, Segment, Usage, parse_duration, parse_size, plan
from tether.capture.segments import (
    Index,
    index_path,
    mark_exported,
    read_capture,
    read_holds,
    sealed,
    write_hold,
)
from tether.proxy.capture import CaptureWriter

from . import harness
from .conftest import World, build_world, teardown_world
from .harness import PYTHON, wait_until
from .test_termination import record_of, run_cli, terminate, wait_terminated

NOW = 1_800_000_000.0


def seg(agent: str, seq: int, size: int, at: float) -> Segment:
    return Segment(agent, seq, size, at - 60, at, f"/x/{agent}/{seq}")


# -- the policy, pure -----------------------------------------------------------------------------------------
def test_age_removes_old_sealed_segments_only() -> None:
    policy = Policy(keep_s=3600)
    usage = Usage("a", (seg("a", 1, 10, NOW - 7200), seg("a", 2, 10, NOW - 1800)), active_bytes=5)
    out = plan([usage], [], policy, NOW)
    assert [(s.seq, why.startswith("older")) for s, why in out.delete] == [(1, True)]


def test_the_agent_cap_removes_the_oldest_first_and_keeps_room_for_the_active_segment() -> None:
    policy = Policy(segment_bytes=MIB, max_bytes=10 * MIB)
    usage = Usage("a", tuple(seg("a", i, 2 * MIB, NOW - 100 + i) for i in range(1, 6)), active_bytes=MIB)
    out = plan([usage], [], policy, NOW)
    # 10 MiB sealed + 2 MiB reserve (the active segment's and a compression's room) must fit in 10 MiB: the
    # oldest goes, leaving 8 + 2.
    assert [s.seq for s, _ in out.delete] == [1]
    assert out.over == []


def test_a_held_segment_stays_whatever_the_caps_and_the_cap_is_reported_unmet() -> None:
    policy = Policy(segment_bytes=MIB, max_bytes=4 * MIB, keep_s=10, node_max_bytes=4 * MIB)
    usage = Usage("a", tuple(seg("a", i, 2 * MIB, NOW - 1000 + i) for i in range(1, 5)))
    hold = Hold("term-1", "a", NOW - 500, covers_until=NOW - 1058, expires_at=NOW + 100)  # segments 1, 2 opened by then
    out = plan([usage], [hold], policy, NOW)
    assert sorted(s.seq for s, _ in out.delete) == [3, 4]  # 1 and 2 were opened before the hold's end
    assert out.held == 2 and out.over  # 4 MiB held + reserve > 4 MiB: said, not met


@pytest.mark.parametrize("hold", [Hold("t", "a", NOW - 50, NOW, NOW - 1), Hold("t", "a", NOW - 50, NOW, NOW + 99,
                                                                                 exported_at=NOW - 5)],
                         ids=["expired", "exported"])
def test_an_expired_or_exported_hold_keeps_nothing(hold: Hold) -> None:
    usage = Usage("a", (seg("a", 1, 10, NOW - 7200),))
    assert [s.seq for s, _ in plan([usage], [hold], Policy(keep_s=60), NOW).delete] == [1]


def test_a_hold_keeps_only_its_own_agents_segments() -> None:
    usages = [Usage("a", (seg("a", 1, 10, NOW - 7200),)), Usage("b", (seg("b", 1, 10, NOW - 7200),))]
    out = plan(usages, [Hold("t", "a", NOW - 50, NOW, NOW + 99)], Policy(keep_s=60), NOW)
    assert [(s.agent, s.seq) for s, _ in out.delete] == [("b", 1)]


def test_the_node_cap_takes_the_oldest_across_agents() -> None:
    policy = Policy(segment_bytes=MIB, max_bytes=GIB, node_max_bytes=12 * MIB)
    usages = [Usage("a", (seg("a", 1, 4 * MIB, NOW - 300), seg("a", 2, 4 * MIB, NOW - 100))),
              Usage("b", (seg("b", 1, 4 * MIB, NOW - 200),), active_bytes=MIB)]
    out = plan(usages, [], policy, NOW)
    assert [(s.agent, s.seq) for s, _ in out.delete] == [("a", 1)]  # 13 MiB + 2 MiB of room > 12: a's oldest goes
    assert out.node_bytes_after == 9 * MIB


def test_own_applies_one_agents_cap_but_the_node_cap_to_all() -> None:
    policy = Policy(segment_bytes=64 * KIB, max_bytes=MIB, keep_s=1e9, node_max_bytes=GIB)
    usages = [Usage("a", tuple(seg("a", i, MIB, NOW - 10 + i) for i in range(1, 3))),
              Usage("b", tuple(seg("b", i, MIB, NOW - 10 + i) for i in range(1, 3)))]
    assert {s.agent for s, _ in plan(usages, [], policy, NOW, own="a").delete} == {"a"}
    assert {s.agent for s, _ in plan(usages, [], policy, NOW).delete} == {"a", "b"}


def test_the_disk_floor_prunes_and_says_low_before_the_disk_is_full() -> None:
    policy = Policy(min_free_bytes=10 * MIB, node_max_bytes=GIB, max_bytes=GIB)
    usage = Usage("a", tuple(seg("a", i, 3 * MIB, NOW - 100 + i) for i in range(1, 5)))
    out = plan([usage], [], policy, NOW, free_bytes=5 * MIB)
    assert [s.seq for s, _ in out.delete] == [1, 2]  # 5 + 6 = 11 MiB free
    assert out.free_after == 11 * MIB and out.low  # under twice the floor: warned
    assert not plan([usage], [], policy, NOW, free_bytes=100 * MIB).low


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 8 * MIB), st.floats(0, 30 * 86400)), max_size=30),
       st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 30 * 86400), st.booleans()), max_size=3),
       st.integers(MIB, 64 * MIB), st.integers(MIB, 128 * MIB), st.one_of(st.none(), st.integers(0, 64 * MIB)))
def test_plan_deletes_nothing_held_and_meets_every_cap_it_does_not_report(
        segments: list[tuple[str, int, float]], holds: list[tuple[str, float, bool]], max_bytes: int,
        node_max: int, free: int | None) -> None:
    policy = Policy(segment_bytes=256 * KIB, max_bytes=max_bytes, node_max_bytes=node_max, keep_s=7 * 86400,
                    min_free_bytes=8 * MIB)
    by_agent: dict[str, list[Segment]] = {}
    for i, (agent, size, age) in enumerate(segments):
        by_agent.setdefault(agent, []).append(Segment(agent, i, size, NOW - age - 10, NOW - age))
    usages = [Usage(a, tuple(ss)) for a, ss in by_agent.items()]
    hs = [Hold(f"t{i}", a, NOW - 1, NOW - age, NOW + (1 if live else -1)) for i, (a, age, live) in enumerate(holds)]
    out = plan(usages, hs, policy, NOW, free_bytes=free)
    live = [h for h in hs if h.in_force(NOW)]
    deleted = {(s.agent, s.seq) for s, _ in out.delete}
    assert len(deleted) == len(out.delete)  # each once
    assert not any(h.covers(s) for s, _ in out.delete for h in live)
    kept = [s for u in usages for s in u.sealed if (s.agent, s.seq) not in deleted]
    node = sum(s.bytes for s in kept)
    assert node == out.node_bytes_after
    if node + policy.reserve > node_max:
        assert any(line.startswith("node") for line in out.over)
    for u in usages:
        mine = sum(s.bytes for s in kept if s.agent == u.agent)
        if mine + policy.reserve > max_bytes:
            assert any(line.startswith(f"agent {u.agent}") for line in out.over)
        assert all(s.last_at >= NOW - policy.keep_s or any(h.covers(s) for h in live) for s in kept if s.agent ==
                   u.agent)


def test_sizes_and_durations_read_as_people_write_them() -> None:
    assert parse_size("64K") == 64 * KIB and parse_size("1.5GiB") == 3 * GIB // 2 and parse_size("100") == 100
    assert parse_duration("7d") == 7 * 86400 and parse_duration("90") == 90 and parse_duration("2w") == 14 * 86400
    for bad in ("lots", "-1G", "7 years"):
        with pytest.raises(TetherError) as err:
            parse_size(bad) if "G" in bad or bad == "lots" else parse_duration(bad)
        assert err.value.code == "tether.bad_request"


# -- the writer, over real files -------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def flows_of(n: int, size: int = 0, start: float = NOW) -> list:
    out = []
    for i in range(n):
        f = tflow.tflow(resp=True)
        f.request.timestamp_start = start + i
        f.request.content = bytes(f"{i:08d}" * (size // 8 + 1), "ascii")[:size] if size else f.request.content
        out.append(f)
    return out


def test_the_writer_rotates_by_size_and_indexes_each_segment(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "a" / "captures" / "flows.mitm"
    w = CaptureWriter(path, policy=Policy(segment_bytes=64 * KIB, max_bytes=GIB), clock=clock)
    flows = flows_of(40, size=8 * KIB)
    for f in flows:
        assert w.write(f)
    w.close()
    files = sealed(path)
    assert len(files) >= 3 and all(f.index is not None for f in files)
    ids = [i for f in files for i in f.index.ids]  # type: ignore[union-attr]
    assert ids == [f.id for f in flows][:len(ids)]  # in order, each once
    assert [f.id for f in read_capture(path)] == [f.id for f in flows]  # sealed + active


def test_the_writer_rotates_by_age(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "a" / "captures" / "flows.mitm"
    w = CaptureWriter(path, policy=Policy(segment_age_s=60), clock=clock)
    first, second = flows_of(2)
    w.write(first)
    clock.now += 61
    w.write(second)  # the segment is 61 s old after this write: sealed
    w.close()
    [one] = sealed(path)
    assert one.index is not None and one.index.ids == [first.id, second.id]
    assert not path.exists()  # the next segment begins with the next write


def test_a_flow_whose_answer_lands_in_the_next_segment_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "a" / "captures" / "flows.mitm"
    w = CaptureWriter(path, policy=Policy(segment_bytes=64 * KIB, max_bytes=GIB))
    call = tflow.tflow()  # its request, before it leaves
    w.write(call)
    w.rotate()
    call.response = tflow.tresp()
    w.write(call)  # its final state, in the next segment
    w.close()
    [got] = read_capture(path, ids={call.id})
    assert got.response is not None and got.response.status_code == 200


def test_compression_keeps_every_flow_readable_and_readers_skip_by_index(tmp_path: Path) -> None:
    path = tmp_path / "a" / "captures" / "flows.mitm"
    w = CaptureWriter(path, policy=Policy(segment_bytes=64 * KIB, max_bytes=GIB, compress=False))
    flows = flows_of(30, size=8 * KIB)
    for f in flows:
        w.write(f)
    w.close()
    plain = sum(f.size for f in sealed(path))
    tidy(path, compress_sealed=True)
    files = sealed(path)
    assert files and all(f.compressed for f in files) and sum(f.size for f in files) < plain / 3
    with gzip.open(files[0].path) as g:
        assert g.read(4)  # a plain gzip of a mitmproxy flow file
    assert [f.id for f in read_capture(path)] == [f.id for f in flows]
    late = flows[-3:]
    assert [f.id for f in read_capture(path, since=late[0].request.timestamp_start)] == [f.id for f in late]
    first = files[0].index
    assert first is not None
    assert [f.id for f in read_capture(path, ids={first.ids[0]})] == [first.ids[0]]


def test_a_capture_left_by_an_earlier_run_is_sealed_and_indexed(tmp_path: Path) -> None:
    path = tmp_path / "a" / "captures" / "flows.mitm"
    before = CaptureWriter(path)
    old = flows_of(3)
    for f in old:
        before.write(f)
    before.close()
    after = CaptureWriter(path)  # the next run
    new = flows_of(1, start=NOW + 100)
    after.write(new[0])
    after.close()
    [left] = sealed(path)
    tidy(path, compress_sealed=False)
    [left] = sealed(path)
    assert left.index is not None and left.index.ids == [f.id for f in old]
    assert [f.id for f in read_capture(path)] == [f.id for f in old + new]


def test_prune_keeps_held_segments_until_exported(tmp_path: Path) -> None:
    root = tmp_path / "states"
    path = root / "a" / "captures" / "flows.mitm"
    clock = Clock()
    w = CaptureWriter(path, policy=Policy(segment_bytes=64 * KIB, max_bytes=GIB), clock=clock)
    for f in flows_of(20, size=8 * KIB):
        w.write(f)
    w.hold("term-9", window_s=10)
    w.close()
    n = len(sealed(path))
    assert n >= 2 and [h.termination_id for h in read_holds(path.parent)] == ["term-9"]
    strict = Policy(segment_bytes=64 * KIB, max_bytes=256 * KIB, keep_s=0, min_free_bytes=1)
    kept = prune(root, strict, NOW + 60)
    assert kept.plan.delete == [] and kept.plan.held == n
    assert mark_exported(path.parent, "term-9", NOW + 30)
    gone = prune(root, strict, NOW + 60)
    assert len(gone.plan.delete) == n and sealed(path) == [] and path.exists()  # the active segment stays
    assert read_holds(path.parent) == []  # a released hold's file goes too


def test_a_hold_written_again_keeps_its_first_cover(tmp_path: Path) -> None:
    """A standing command comes with every heartbeat: it must not stretch the hold (an agent calling on after its
    termination would keep everything it writes)."""
    write_hold(tmp_path, Hold("t", "a", 100.0, 200.0, 300.0))
    write_hold(tmp_path, Hold("t", "a", 150.0, 400.0, 350.0))
    assert read_holds(tmp_path) == [Hold("t", "a", 100.0, 200.0, 300.0)]


def test_an_index_is_what_its_file_says(tmp_path: Path) -> None:
    index = Index(3, 1.0, 2.0, 1.5, 1.9, ["x", "y"])
    index.write(index_path(tmp_path / "flows.000003.mitm.gz"))
    assert Index.read(tmp_path / "flows.000003.idx.json") == index


# -- real sidecars ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, test_ca: harness.TestCA) -> Iterator[World]:
    w = build_world(tmp_path_factory.mktemp("retention"), test_ca)
    w.cp.start()
    try:
        yield w
    finally:
        teardown_world(w)


def capture_bytes(captures: Path) -> int:
    return sum(p.stat().st_size for p in captures.iterdir() if p.is_file() and ".mitm" in p.name)


def export(world: World, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(world, "capture", "export", "--captures", str(world.cp.directory / "sidecars"), *args)


def test_a_sidecar_keeps_its_capture_under_its_cap_and_export_reads_every_segment(world: World,
                                                                                    tmp_path: Path) -> None:
    ident = world.cp.issue("ret-cap", {"issues.write": "direct"})
    cap = 512 * KIB
    sc = world.sidecar(ident, "--capture-max-bytes", "512K", "--capture-segment-bytes", "64K")
    captures = sc.state_dir / "captures"
    calls = 120
    with requests.Session() as s:
        for i in range(calls):  # about 24 KiB of flow per call (the body both ways), 12 KiB compressed: 3x the cap
            body = {"i": i, "pad": secrets.token_hex(4000)}  # (random: compression cannot make it small)
            r = s.post(f"{world.tools.base}/repos/ret/r{i}/issues", json=body, proxies=sc.proxies(), timeout=10)
            assert r.status_code == 200
    metrics = captures / "metrics.prom"

    def settled() -> bool:  # the last round compressed and pruned after the last rotation
        files = sealed(captures / "flows.mitm")
        return bool(files) and all(f.compressed for f in files) and metrics.exists() and \
            capture_bytes(captures) <= cap
    wait_until(settled, 30, what="the capture compressed and pruned under its cap")
    text = metrics.read_text()
    assert 'tether_capture_bytes{agent="ret-cap"}' in text and "tether_capture_disk_low" in text
    out = export(world, "--agent", "ret-cap", "--har", str(tmp_path / "a.har"))
    assert out.returncode == 0, out.stdout + out.stderr
    entries = json.loads((tmp_path / "a.har").read_text())["log"]["entries"]
    urls = [e["request"]["url"] for e in entries]
    assert 0 < len(entries) < calls  # the oldest went
    assert urls[-1].endswith(f"/repos/ret/r{calls - 1}/issues")  # the newest are all there, in order
    assert urls == [f"{world.tools.base}/repos/ret/r{i}/issues" for i in range(calls - len(entries), calls)]
    sc.stop()


def test_a_termination_holds_what_its_record_names_until_it_is_exported(world: World, tmp_path: Path) -> None:
    ident = world.cp.issue("ret-hold", {"issues.write": "direct"})
    sc = world.sidecar(ident, "--capture-segment-bytes", "64K")
    with requests.Session() as s:
        for i in range(30):
            r = s.post(f"{world.tools.base}/repos/hold/r{i}/issues", json={"pad": "x" * 6000, "i": i},
                       proxies=sc.proxies(), timeout=10)
            assert r.status_code == 200
    doc = terminate(world, "ret-hold", "drain", 5)
    wait_terminated(world, doc["termination_id"], 5)
    captures = sc.state_dir / "captures"
    [hold] = read_holds(captures)
    assert hold.termination_id == doc["termination_id"] and hold.agent == "ret-hold"
    root = str(world.cp.directory / "sidecars")
    strict = ["--max-bytes", "128K", "--keep", "0", "--agent", "ret-hold", "--json"]
    kept = subprocess.run([PYTHON, "-m", "tether", "capture", "prune", "--captures", root, *strict],
                          capture_output=True, text=True, timeout=60)
    assert kept.returncode == 0, kept.stderr
    assert json.loads(kept.stdout)["deleted"] == [] and json.loads(kept.stdout)["held_segments"] >= 2
    record = record_of(world, doc["termination_id"])
    named = {c["capture_ref"] for c in record["calls"] if c["agent"] == "ret-hold" and c.get("capture_ref")}
    assert len(named) == 30
    out = export(world, "--termination", doc["termination_id"], "--har", str(tmp_path / "t.har"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "released the hold" in out.stdout and "warning" not in out.stdout
    entries = json.loads((tmp_path / "t.har").read_text())["log"]["entries"]
    assert {e["_tether"]["capture_ref"] for e in entries} == named
    gone = subprocess.run([PYTHON, "-m", "tether", "capture", "prune", "--captures", root, *strict],
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 0, gone.stderr
    assert len(json.loads(gone.stdout)["deleted"]) >= 2 and sealed(captures / "flows.mitm") == []
    sc.stop()


def test_export_since_counts_the_agents_whose_calls_it_wrote(world: World, tmp_path: Path) -> None:
    ident = world.cp.issue("ret-since", {"issues.read": "direct"})
    sc = world.sidecar(ident)
    before = time.time()
    r = requests.get(f"{world.tools.base}/repos/since/r/issues", proxies=sc.proxies(), timeout=10)
    assert r.status_code == 200
    wait_until(lambda: read_capture(sc.state_dir / "captures" / "flows.mitm", since=before), 10,
               what="the call captured")
    out = export(world, "--since", str(before), "--har", str(tmp_path / "s.har"))
    assert out.returncode == 0, out.stderr
    assert "1 call(s) from 1 agent(s)" in out.stdout, out.stdout  # other state dirs hold captures, none in range
    later = export(world, "--since", str(time.time() + 60), "--har", str(tmp_path / "none.har"))
    assert "0 call(s) from 0 agent(s)" in later.stdout, later.stdout
    sc.stop()


def test_bad_retention_options_are_refused_with_a_code(world: World) -> None:
    ident = world.cp.issue("ret-bad", {"issues.read": "direct"})
    out = subprocess.run([PYTHON, "-m", "tether", "sidecar", "--controlplane", world.cp.url, "--chain",
                          str(ident.chain_path), "--key", str(ident.key_path), "--capture-max-bytes", "lots"],
                         capture_output=True, text=True, timeout=60, env=world.cp.env())
    assert out.returncode == 2 and "tether.bad_request" in out.stderr and "'lots'" in out.stderr, out.stderr


@pytest.mark.parametrize("flag", ["--capture-keep=0", "--capture-max-bytes=1K", "--capture-hold=0",
                                  "--no-capture-compress"])
def test_a_delegated_child_may_set_no_retention_option(flag: str) -> None:
    """A command under enforcement could otherwise shorten how long its own traffic is kept."""
    from tether.cli.delegation import requested
    from tether.cli.main import build_parser

    base = ["run", "--chain", "c", "--key", "k"]
    defaults = build_parser().parse_args([*base, "--", "true"])
    with pytest.raises(TetherError) as err:
        requested(build_parser().parse_args([*base, flag, "--", "true"]), defaults)
    assert err.value.code == "tether.bad_request" and flag.split("=")[0] in str(err.value)


def test_a_disk_under_the_floor_is_said_and_pruned_and_calls_go_on(world: World) -> None:
    """A floor no disk here meets (1000 TiB free): the sidecar says the disk is low in its log and its gauges,
    prunes every unheld sealed segment, and keeps forwarding (and capturing) calls. Last in this module: the floor
    reaches every agent's captures under the state root."""
    ident = world.cp.issue("ret-low", {"issues.write": "direct"})
    sc = world.sidecar(ident, "--capture-min-free", "1000T", "--capture-segment-bytes", "64K")
    captures = sc.state_dir / "captures"
    with requests.Session() as s:
        for i in range(20):
            r = s.post(f"{world.tools.base}/repos/low/r{i}/issues", json={"pad": secrets.token_hex(8000)},
                       proxies=sc.proxies(), timeout=10)
            assert r.status_code == 200
    wait_until(lambda: "capture disk low" in sc.log_text, 30, what="the low-disk log line")
    metrics = captures / "metrics.prom"
    wait_until(lambda: metrics.exists() and 'tether_capture_disk_low{agent="ret-low"} 1' in metrics.read_text(),
               30, what="the low-disk gauge")
    wait_until(lambda: sealed(captures / "flows.mitm") == [], 30, what="every sealed segment pruned")
    assert read_capture(captures / "flows.mitm")  # the active segment is never pruned
    pruned = next(line for line in metrics.read_text().splitlines()
                  if line.startswith("tether_capture_pruned_bytes_total"))
    assert float(pruned.rsplit(" ", 1)[1]) > 0
    sc.stop()
