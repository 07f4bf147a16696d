"""What a signed checkpoint and its proofs cost, against sealing the record they follow (the baseline, measured
in the same run): at 1, 1,000 and 100,000 records in the log.

Run: python bench/bench_checkpoints.py                  (~20 minutes on 2 loaded cores: it fills 100,000-record logs)
     python bench/bench_checkpoints.py --sizes 1,1000    (a couple of minutes)

For each log size N it times, in CPU time of this thread (the work is CPU-bound and single-threaded; the best
of several batches, the figure least disturbed on a shared machine):
  - seal: hashing and signing one record (canonical JSON, SHA-256, Ed25519), what a record write costs in CPU;
  - write: sealing a record and appending it to an SQLite store, wall time (the record write, I/O included);
  - extend+checkpoint: one record's leaf added to a tree of N that has already been computed, its new root, and
    the checkpoint signed (what the control plane does after each record);
  - rebuild: the tree of N built from nothing (a control plane's first checkpoint after a start);
  - verify inclusion: one record's proof checked against a checkpoint's root (what an auditor does).
Targets (issue 26): a checkpoint adds under 5 % to writing a record; a proof for 100,000 records verifies
in under 1 ms.

Then, against the record write a termination really does (``--store sqlite|redis|both``, both by default;
``none`` skips it): a control plane's services (``ControlPlane``, in this process) over a real store (a
SQLite file; a ``redis-server`` started here) whose log holds N records, its ``TerminationService.write_record``
writing one termination's record (an agent with ``--calls`` reported calls: the log's index read, the calls
staged, the record hashed, signed and appended) without a checkpoint sink (A), and the same followed by what
the control plane's checkpoint loop does for that record when a sink is configured
(``CheckpointService.publish_if_due`` with an append-only directory: the new leaf taken from the append, the
tree extended, the checkpoint signed and its line journaled; its file is the batch's) (B). A
and B alternate, ``--pairs`` of each; after each A the loop catches up untimed, so each B's checkpoint covers
one record, as after every record in the control plane. Printed per store and N: the medians of A and B (wall
time, and this process's CPU time, worker threads included), the checkpoint's own median, one durable file
as the sink wrote each checkpoint before its batches (``keep_checkpoint``, timed apart, into a scratch
directory), the batch that covers B's checkpoint and four more issued after it, untimed (one record a second,
the default ``--checkpoint-sync 5``: five checkpoints a batch; ``CheckpointService.sync_if_due``: their files
written, ``latest`` moved, one ``syncfs``, the mark), divided by five, and the shares: (B - A) / A of the
medians, the checkpoint's CPU over A's (the figure a loaded machine disturbs least), and the checkpoint's CPU
plus its fifth of the batch over A's. The log is filled by appending sealed records
through the same store (untimed; 100,000 takes minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tether.capability import keys  # noqa: E402
from tether.capability.catalog import Catalog  # noqa: E402
from tether.capability.shared import replace_file  # noqa: E402
from tether.controlplane.app import ControlPlane  # noqa: E402
from tether.controlplane.merkle import Tree, record_leaf, verify_inclusion  # noqa: E402
from tether.controlplane.notes import Checkpoint, signed_checkpoint  # noqa: E402
from tether.controlplane.services.checkpoint_dir import _create, keep_checkpoint  # noqa: E402
from tether.controlplane.store import Store, open_store_url  # noqa: E402
from tether.controlplane.termination import new_termination, seal  # noqa: E402

KEY = keys.generate()
RECORD = {"record_id": "rec-0", "termination_id": "term-0", "subject": "agent", "mode": "drain",
          "requested_by": "alice", "calls": [{"call_id": f"c{i}", "agent": "agent", "resolution": "completed",
                                              "status": 200} for i in range(20)], "leases": [], "prev_hash": ""}


def best(fn: Callable[[], object], rounds: int = 7, per: int = 20) -> float:
    """Seconds per call: the best of ``rounds`` batches of ``per`` calls, in thread CPU time."""
    out = []
    for _ in range(rounds):
        start = time.thread_time_ns()
        for _ in range(per):
            fn()
        out.append((time.thread_time_ns() - start) / per / 1e9)
    return min(out)


def measure(n: int, base: float, write: float) -> None:
    leaves = [record_leaf(f"sha256:{i:064x}") for i in range(n + 200)]
    tree = Tree(leaves[:n])
    tree.root()
    grown = iter(range(n, n + 200))

    def extend_and_sign() -> None:
        tree.extend([leaves[next(grown)]])
        signed_checkpoint(Checkpoint("tether/records", tree.size, tree.root()), "tether/records", KEY)

    step = best(extend_and_sign, rounds=5, per=20)
    rebuild = best(lambda: Tree(leaves[:n]).root(), rounds=3, per=1)
    index = n // 2
    proof, root = tree.inclusion_proof(index), tree.root()
    check = best(lambda: verify_inclusion(leaves[index], index, tree.size, proof, root), per=200)
    print(f"{n:>9} {step * 1e6:>15.0f} us {step / base:>6.2f}x {step / write:>8.1%} {rebuild * 1e3:>7.1f} ms "
          f"{check * 1e6:>14.1f} us")


def record_write_s(rounds: int = 40) -> float:
    """Wall seconds to seal a record and append it to an SQLite store (what a record write costs, I/O
    included): the median of ``rounds``."""
    import asyncio
    import statistics
    import tempfile

    from tether.controlplane.store.sqlite import SqliteStore

    async def run(path: str) -> list[float]:
        store = SqliteStore(path)
        await store.open()
        prev, out = "", []
        try:
            for i in range(rounds):
                start = time.perf_counter()
                sealed = seal({**RECORD, "record_id": f"rec-{i}", "prev_hash": prev}, KEY)
                assert await store.append_record(sealed)
                out.append(time.perf_counter() - start)
                prev = sealed["hash"]
        finally:
            await store.close()
        return out

    with tempfile.TemporaryDirectory() as d:
        return statistics.median(asyncio.run(run(f"{d}/bench.db")))


def sink_ab(rounds: int = 41) -> None:
    """The directory sink's disk, the ways it was and is, alternating in this process's CPU time: two durable
    file replacements (``checkpoint.SIZE`` and ``latest``, each a temporary file, fsync, rename: the sink as it
    was first), ``keep_checkpoint`` (one fsynced file, ``latest`` a link to it: before the batches), and the
    file as the batch creates it (``_create``: an unnamed file linked into place, not yet durable; ``latest``
    is moved once a batch)."""
    note = signed_checkpoint(Checkpoint("tether/records", 1, b"\0" * 32), "tether/records", KEY)
    with tempfile.TemporaryDirectory() as d:
        before, now, later = Path(d) / "before", Path(d) / "now", Path(d) / "later"
        before.mkdir()
        later.mkdir()
        two: list[float] = []
        one: list[float] = []
        lazy: list[float] = []
        for i in range(1, rounds + 1):
            start = time.process_time()
            replace_file(before / f"checkpoint.{i}", note.encode())
            replace_file(before / "latest", note.encode())
            two.append(time.process_time() - start)
            start = time.process_time()
            keep_checkpoint(now, i, note)
            one.append(time.process_time() - start)
            start = time.process_time()
            _create(str(later), f"checkpoint.{i}", note.encode())
            lazy.append(time.process_time() - start)
    a, b, c = statistics.median(two), statistics.median(one), statistics.median(lazy)
    print(f"the directory sink's disk per checkpoint (CPU, median of {rounds}, alternating): two replaced files "
          f"{a * 1e6:.0f} us, one durable file + latest linked {b * 1e6:.0f} us ({b / a:.2f}x), the file "
          f"created in the batch, not yet durable {c * 1e6:.0f} us ({c / a:.2f}x)")


# -- against a termination's record write ---------------------------------------------------------------------

BATCH = 5  # checkpoints a batch: one record a second, the default --checkpoint-sync 5
LINK = "sha256:" + "b" * 64  # the terminated agents' link (no grant graph: the termination names it)


def call_report(agent: str, i: int, now: float) -> dict[str, Any]:
    """A stored final report as ``RecordService.ingest`` leaves it."""
    return {"call_id": f"{agent}-{i:04d}", "agent": agent, "method": "GET", "url": f"http://127.0.0.1:9000/x/{i}",
            "started_at": now + i * 1e-3, "capability": "issues.read", "tier": "direct", "resolution": "completed",
            "status": 200, "code": None, "ended_at": now + i * 1e-3 + 0.004, "capture_ref": None,
            "termination_id": None, "detail": None, "link": LINK, "run_id": f"run-{agent}", "received_at": now}


class Writer:
    """One control plane's services over ``store``: termination records written, checkpoints published."""

    def __init__(self, store: Store, sink: Path, calls: int) -> None:
        catalog = Catalog(capabilities={}, roles={}, hash="sha256:bench")
        self.cp = ControlPlane(store, KEY, catalog, "admin-token-bench")
        self.cp.checkpoints.directory = sink  # a sink configured: the checkpoint loop publishes
        self.cp.checkpoints.idle_s = 1e9  # no idle re-read of the whole log inside the timed part
        self.store, self.calls, self.n = store, calls, 0
        self.kept = 0  # checkpoints the scratch sink kept (``disk``)

    async def termination(self) -> dict[str, Any]:
        """A termination of a fresh agent with ``calls`` reported calls, ready for its record."""
        self.n += 1
        agent, now = f"agent-{os.getpid()}-{self.n}", time.time()
        await self.store.put_reports([call_report(agent, i, now - 60) for i in range(self.calls)])
        doc = new_termination(f"term-{agent}", agent, "abort", 0, "bench", "admin", now, [agent], 5.0)
        return {**doc, "links": [LINK]}

    async def write(self) -> None:
        await self.cp.terminations.write_record(await self.termination())

    async def checkpoint(self) -> None:
        assert await self.cp.checkpoints.publish_if_due(), "the checkpoint loop published nothing"

    async def batch(self, files: int = 0) -> None:
        """The batch (as ``run`` does every ``sync_s``, in a worker thread): the files of the checkpoints issued
        since the last one written, if they were not already, made durable; ``files``: how many it must cover."""
        self.cp.checkpoints.sync_s = 0.0
        try:
            covered = await self.cp.checkpoints.sync_if_due()
            assert covered and (not files or covered == files), f"the batch covered {covered} checkpoints"
        finally:
            self.cp.checkpoints.sync_s = 5.0

    async def disk(self) -> None:
        """One checkpoint kept as the directory sink kept it before its batches (``keep_checkpoint``: one new
        durable file and ``latest`` linked to it), into a scratch directory."""
        sink = self.cp.checkpoints.directory
        assert sink is not None
        note = (sink / "latest").read_text()
        scratch = sink.with_name(sink.name + "-scratch")
        self.kept += 1
        await asyncio.to_thread(keep_checkpoint, scratch, self.kept, note)


async def fill(store: Store, size: int) -> None:
    """Append sealed records (no calls) until the log holds ``size``: untimed, linear."""
    heads = await store.record_heads()
    prev = heads[-1]["hash"] if heads else ""
    for i in range(len(heads), size):
        sealed = seal({**RECORD, "calls": [], "record_id": f"rec-fill-{i}", "termination_id": f"term-fill-{i}",
                       "prev_hash": prev, "agents_unaccounted": []}, KEY)
        assert await store.append_record(sealed), "the fill lost a race it cannot have"
        prev = sealed["hash"]


async def timed(fn: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds, worker threads included) of one awaited call."""
    wall, cpu = time.perf_counter(), time.process_time()
    await fn()
    return time.perf_counter() - wall, time.process_time() - cpu


async def against_writes(url: str, sizes: list[int], pairs: int, calls: int, sink: Path) -> list[str]:
    """Rows of the record-write table for one store: A (write) and B (write + checkpoint) alternating."""
    store = open_store_url(url)
    await store.open()
    rows = []
    try:
        writer = Writer(store, sink, calls)
        await writer.write()  # a real first record: the fill's copies follow it
        for size in sizes:
            await fill(store, max(size - 1, 1))
            await writer.checkpoint()  # the tree built (a start's first checkpoint): untimed
            a: list[tuple[float, float]] = []
            b: list[tuple[float, float]] = []
            own: list[tuple[float, float]] = []
            disk: list[tuple[float, float]] = []
            batch: list[tuple[float, float]] = []
            for _ in range(pairs):
                a.append(await timed(writer.write))
                await writer.checkpoint()  # the loop catches up: B's checkpoint covers its own record only
                await writer.batch()  # and writes and makes durable what is pending: B's batch starts empty
                wrote = await timed(writer.write)
                signed = await timed(writer.checkpoint)
                b.append((wrote[0] + signed[0], wrote[1] + signed[1]))
                own.append(signed)
                for _ in range(BATCH - 1):  # four checkpoints more (untimed): a batch of five, as at one a second
                    await writer.write()
                    await writer.checkpoint()
                whole = await timed(lambda: writer.batch(BATCH))
                batch.append((whole[0] / BATCH, whole[1] / BATCH))
                disk.append(await timed(writer.disk))
            rows.append(row(url.split(":")[0], size, a, b, own, disk, batch))
            print(rows[-1], flush=True)
    finally:
        await store.close()
    return rows


def row(kind: str, size: int, a: list[tuple[float, float]], b: list[tuple[float, float]],
        own: list[tuple[float, float]], disk: list[tuple[float, float]], batch: list[tuple[float, float]]) -> str:
    def med(xs: list[tuple[float, float]], i: int) -> float:
        return statistics.median(x[i] for x in xs)

    cells = [f"{med(xs, 0) * 1e3:.2f} / {med(xs, 1) * 1e3:.2f}" for xs in (a, b, own, disk, batch)]
    return (f"| {kind} | {size:,} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {cells[4]} | "
            f"{med(b, 0) / med(a, 0) - 1:+.1%} | {med(b, 1) / med(a, 1) - 1:+.1%} | "
            f"{med(own, 1) / med(a, 1):.1%} | {(med(own, 1) + med(batch, 1)) / med(a, 1):.1%} | {len(a)} |")


def termination_table(stores: list[str], sizes: list[int], pairs: int, calls: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="tether-bench-ckpt-"))
    redis = None
    try:
        print(f"\nAgainst a termination's record write ({calls} calls per record, {pairs} pairs A/B per row, "
              f"load average {os.getloadavg()[0]:.2f}):")
        print("| store | records in the log | A: write ms (wall / CPU) | B: write + checkpoint ms | checkpoint ms | "
              "one durable file (the sink before) ms | the batch of 5, per checkpoint ms | B vs A (wall) | (CPU) | "
              "checkpoint's CPU / A's CPU | + its share of the batch | pairs |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for kind in stores:
            if kind == "sqlite":
                url = f"sqlite:///{work}/bench.db"
            else:
                from tests.harness import RedisServer

                redis = RedisServer(work / "redis").start()
                url = redis.url()
            asyncio.run(against_writes(url, sizes, pairs, calls, work / f"checkpoints-{kind}"))
        print(f"load average at the end {os.getloadavg()[0]:.2f}")
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=("sqlite", "redis", "both", "none"), default="both",
                        help="the stores of the termination-record table (none: only the CPU table)")
    parser.add_argument("--sizes", default="1,1000,100000", help="records in the log, comma-separated")
    parser.add_argument("--pairs", type=int, default=9, help="A/B pairs per store and size")
    parser.add_argument("--calls", type=int, default=20, help="reported calls in each termination's record")
    args = parser.parse_args()
    print(f"checkpoint benchmark  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  nproc {os.cpu_count()}  "
          f"load average {os.getloadavg()[0]:.2f}")
    base = best(lambda: seal(RECORD, KEY))
    write = record_write_s()
    print(f"seal one record (CPU baseline): {base * 1e6:.0f} us; seal + append to SQLite (wall, median): "
          f"{write * 1e3:.2f} ms")
    print(f"{'records':>9} {'extend+checkpoint':>18} {'/ seal':>7} {'/ write':>8} {'rebuild':>10} "
          f"{'verify inclusion':>17}")
    sizes = [int(x) for x in args.sizes.split(",")]
    for n in sizes:
        measure(n, base, write)
    sink_ab()
    if args.store != "none":
        termination_table(["sqlite", "redis"] if args.store == "both" else [args.store], sizes, args.pairs,
                          args.calls)


if __name__ == "__main__":
    main()
