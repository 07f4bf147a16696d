"""Catalog matching cost on paths not seen before: a 1,000-capability catalog against a 10-capability one.

Run: python bench/bench_catalog.py

Target (issue 17): on a path the catalog has not answered before (so its memo cannot help), matching a
call against 1,000 capabilities costs at most 1.10x matching it against 10.

What is timed is ``Catalog.match_http`` as the sidecar calls it, for one call: host, port, method and a
path whose last segment is new every call (a fresh id, as real traffic has), so each call misses the memo
and runs the path safety checks and the matcher. The memo is emptied between batches so it never fills
and clears inside a timed batch. The fresh paths are made before timing; one batch walks through them.

Two shapes of the large catalog, each with the request's own capability in it:
  - "many hosts": 1,000 capabilities over 100 hosts, 10 on each (a fleet's many SaaS APIs);
  - "one host": 1,000 capabilities on the request's host, each its own first path segment (one big API).
The small catalog is the request's host with 10 capabilities, laid out the same way.

Each figure is the fastest over many short timed batches of the mean time of one call, timed in CPU time
of this thread (time.thread_time_ns, as bench_chain.py does: single-threaded CPU-bound work, and on a
virtual machine wall time also counts time the hypervisor gave someone else). Batches of the catalogs
alternate so each ratio compares figures taken under the same conditions. The p50 over the batches is
printed beside the minimum. The run takes about 20 s.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time

from tether.capability.catalog import Catalog, parse_catalog

TARGET = 1.10
CALLS = 2_000  # per timed batch
BATCHES = 60
HOST, PORT, METHOD = "api.service0.example", 443, "GET"


def catalog_text(hosts: int, per_host: int) -> str:
    """``hosts`` hosts with ``per_host`` capabilities each, reads and writes alternating."""
    lines = ["capabilities:"]
    for h in range(hosts):
        for i in range(per_host):
            methods = "[GET]" if i % 2 == 0 else "[POST, PATCH]"
            lines.append(f"  svc{h}.res{i}: {{http: {{host: api.service{h}.example, methods: {methods}, "
                         f"path: '/v1/res{i}/*'}}}}")
    return "\n".join(lines) + "\n"


def one_host_text(n: int) -> str:
    """``n`` capabilities on the request's host, each under its own first segment, plus a broad one."""
    lines = ["capabilities:", f"  svc0.health: {{http: {{host: {HOST}, methods: [GET], path: '/*/health'}}}}"]
    lines += [f"  svc0.area{i}.read: {{http: {{host: {HOST}, methods: [GET], path: '/area{i}/items/*'}}}}"
              for i in range(n - 1)]
    return "\n".join(lines) + "\n"


def per_call_ns(cases: list[tuple[Catalog, list[str]]]) -> list[list[float]]:
    """For each (catalog, fresh paths), the mean ns of one match_http per batch, batches alternating."""
    out: list[list[float]] = [[] for _ in cases]
    for _ in range(BATCHES):
        for i, (cat, paths) in enumerate(cases):
            cat.index("http").memo.clear()  # every path is new to the catalog: the memo never answers
            match = cat.match_http
            t0 = time.thread_time_ns()
            for path in paths:
                match(HOST, PORT, METHOD, path)
            out[i].append((time.thread_time_ns() - t0) / len(paths))
    return out


def main() -> int:
    load_start, started = os.getloadavg()[0], time.strftime("%Y-%m-%d %H:%M")
    small = parse_catalog(catalog_text(1, 10))
    many_hosts = parse_catalog(catalog_text(100, 10))
    small_one_host = parse_catalog(one_host_text(10))
    one_host = parse_catalog(one_host_text(1000))
    assert len(small.capabilities) == 10 and len(many_hosts.capabilities) == 1000
    assert len(small_one_host.capabilities) == 10 and len(one_host.capabilities) == 1000

    # the request's path must match in every catalog, so the work is the same but for the catalog's size
    res = [f"/v1/res8/items/{os.urandom(8).hex()}" for _ in range(CALLS)]
    area = [f"/area8/items/{os.urandom(8).hex()}" for _ in range(CALLS)]
    for cat, paths, want in ((small, res, ["svc0.res8"]), (many_hosts, res, ["svc0.res8"]),
                             (small_one_host, area, ["svc0.area8.read"]), (one_host, area, ["svc0.area8.read"])):
        assert cat.match_http(HOST, PORT, METHOD, paths[0]) == want, (cat.match_http(HOST, PORT, METHOD, paths[0]))

    s10, m1000, o10, o1000 = per_call_ns([(small, res), (many_hosts, res), (small_one_host, area),
                                          (one_host, area)])
    print(f"python {platform.python_version()}, nproc {os.cpu_count()}, {started}, "
          f"load average {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print(f"{BATCHES} batches of {CALLS} calls on unseen paths, thread CPU time per call")
    print()
    print("| shape | 10 caps p50 (us) | 1,000 caps p50 (us) | p50 ratio | 10 caps min (us) | 1,000 caps min (us) "
          "| min ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for shape, a, b in (("many hosts (100 x 10)", s10, m1000), ("one host (1,000 first segments)", o10, o1000)):
        p50a, p50b = statistics.median(a), statistics.median(b)
        ratio = p50b / p50a
        worst = max(worst, ratio)
        print(f"| {shape} | {p50a / 1000:.2f} | {p50b / 1000:.2f} | {ratio:.2f}x | {min(a) / 1000:.2f} "
              f"| {min(b) / 1000:.2f} | {min(b) / min(a):.2f}x |")
    print()
    ok = worst <= TARGET
    print(f"unseen-path p50, 1,000 vs 10 capabilities: worst {worst:.2f}x (target <= {TARGET:.2f}x): "
          f"{'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
