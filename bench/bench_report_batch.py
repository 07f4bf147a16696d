"""What reading a report batch as its typed message costs the control plane, in-process (no HTTP, no store).

Run: python bench/bench_report_batch.py [--rounds 8] [--batch 200] [--batches 200]

Both paths start from the same request bodies (batches of final reports and starts, JSON-encoded as the sidecar's
spool lines are joined by ``protocol.ReportBatch.encoded``) and end where the route hands the reports to the
record service: every report read by ``report.read_final`` / ``read_start`` into its stored document.

- before: the body read by the API's JSON reader, then its two lists taken with ``Fields.objects`` (the route as
  it was);
- after: the same reader, then ``protocol.ReportBatch.read`` (the route now), and the ``Accepted`` answer built.

The two alternate (A B, B A, ...) in one process, so load on the machine falls on both alike; the figure is the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from tether.capability import protocol
from tether.capability.report import read_final, read_start
from tether.controlplane.body import parse


def bodies(batch: int, batches: int) -> list[bytes]:
    now = time.time()
    out = []
    for n in range(batches):
        lines = [json.dumps({"call_id": f"c-{n}-{k}", "agent": "bench", "capability": "issues.read", "tier": "direct",
                             "method": "GET", "url": f"http://127.0.0.1:9/issues/{k}", "started_at": now,
                             "resolution": "completed", "status": 200, "code": None, "ended_at": now + 0.01,
                             "capture_ref": f"seg-1:{k}", "termination_id": None, "detail": None},
                            separators=(",", ":")) for k in range(batch)]
        starts = [json.dumps({"event": "start", "call_id": f"s-{n}-{k}", "agent": "bench", "method": "GET",
                              "url": "http://127.0.0.1:9/", "started_at": now}, separators=(",", ":"))
                  for k in range(batch // 10)]
        out.append(protocol.ReportBatch.encoded(lines, starts))
    return out


def before(raw: bytes) -> Any:
    fields = parse(raw, "the report batch")
    reports, starts = fields.objects("reports"), fields.objects("starts")
    clean = [read_final(r, f"reports[{i}]") for i, r in enumerate(reports)]
    early = [read_start(r, f"starts[{i}]") for i, r in enumerate(starts)]
    return {"accepted": len(clean), "duplicates": 0, "starts": len(early)}


def after(raw: bytes) -> Any:
    batch = protocol.ReportBatch.read(parse(raw, protocol.ReportBatch.WHAT).doc)
    clean = [read_final(r, f"reports[{i}]") for i, r in enumerate(batch.reports)]
    early = [read_start(r, f"starts[{i}]") for i, r in enumerate(batch.starts)]
    return {**protocol.Accepted(len(clean), 0).to_doc(), "starts": len(early)}


def rate(path: Callable[[bytes], Any], work: list[bytes], per_body: int) -> float:
    start = time.process_time()
    for raw in work:
        path(raw)
    return len(work) * per_body / (time.process_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    work = bodies(args.batch, args.batches)
    assert before(work[0]) == after(work[0])
    print(f"bench_report_batch: {args.batches} batches of {args.batch} reports (+{args.batch // 10} starts), "
          f"load average {os.getloadavg()[0]:.1f}")
    a: list[float] = []
    b: list[float] = []
    for n in range(args.rounds):  # A B, then B A: neither path always runs first
        if n % 2:
            b.append(rate(after, work, args.batch))
            a.append(rate(before, work, args.batch))
        else:
            a.append(rate(before, work, args.batch))
            b.append(rate(after, work, args.batch))
    ratios = [y / x for x, y in zip(a, b, strict=True)]
    print("| path | reports read per CPU second (median of rounds) |\n|---|---:|")
    print(f"| before: Fields.objects | {statistics.median(a):,.0f} |")
    print(f"| after: ReportBatch.read | {statistics.median(b):,.0f} |")
    print(f"after/before per round: {', '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f}; "
          f"load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
