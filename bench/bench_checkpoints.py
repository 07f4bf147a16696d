"""What a signed checkpoint and its proofs cost, against sealing the record they follow (the baseline, measured
in the same run): at 1, 1,000 and 100,000 records in the log.

Run: python bench/bench_checkpoints.py

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
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tether.capability import keys
from tether.controlplane.merkle import Tree, record_leaf, verify_inclusion
from tether.controlplane.notes import Checkpoint, signed_checkpoint
from tether.controlplane.termination import seal

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


def main() -> None:
    base = best(lambda: seal(RECORD, KEY))
    write = record_write_s()
    print(f"seal one record (CPU baseline): {base * 1e6:.0f} us; seal + append to SQLite (wall, median): "
          f"{write * 1e3:.2f} ms")
    print(f"{'records':>9} {'extend+checkpoint':>18} {'/ seal':>7} {'/ write':>8} {'rebuild':>10} "
          f"{'verify inclusion':>17}")
    for n in (1, 1_000, 100_000):
        measure(n, base, write)


if __name__ == "__main__":
    main()
