"""A single sidecar's idle memory, read several times against bare mitmdump in the same run (issue 28: idle RSS
<= 60 MiB).

Run: python bench/bench_idle_rss.py [--rounds 5] [--idle 3] [--before DIR ...] [--env NAME=VALUE ...]   (~1-5 minutes)

One control plane. Each round starts every setup in turn (the order rotating between rounds: A B C, B C A, ...),
one process at a time, waits until it is ready (a sidecar's ready file; mitmdump's listening line), lets it sit
idle ``--idle`` seconds, reads ``/proc/PID/status`` (VmRSS) and ``/proc/PID/smaps_rollup`` (Pss; USS = its
Private_Clean + Private_Dirty), then stops it. Setups: ``tether sidecar`` (this checkout, capture on, as
``tether sidecar`` runs); ``before (DIR)`` for each ``--before DIR`` (a checkout of older code: ``git archive
COMMIT | tar -x -C DIR``); ``bare mitmdump`` (``--set connection_strategy=lazy``, as bench_sidecar.py); and for
each ``--env NAME=VALUE`` this checkout's sidecar with that variable set (to try allocator settings). Printed:
median, min and max of each figure, the sidecar's ratio to mitmdump, and the load average at the start and the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_sidecar as bs  # noqa: E402

from tests.harness import SidecarProcess, make_test_ca, prepare_controlplane  # noqa: E402

IDLE_TARGET_MIB = 60.0
MITMDUMP = "bare mitmdump"
SIDECAR = "tether sidecar"


def memory(pid: int) -> dict[str, float]:
    """RSS, PSS and USS of a process, MiB."""
    out = {"rss": bs.rss_mib(pid)}
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            fields[name] = int(rest.split()[0])
    out["pss"] = fields["Pss"] / 1024
    out["uss"] = (fields["Private_Clean"] + fields["Private_Dirty"]) / 1024
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--idle", type=float, default=3.0, help="seconds idle after ready before reading")
    parser.add_argument("--before", metavar="DIR", action="append", default=[],
                        help="also a sidecar running the code of the checkout in DIR (repeatable: one setup each, "
                        "named by DIR's last part)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="also this checkout's sidecar with NAME=VALUE in its environment")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tether-bench-idle-"))
    load_start = os.getloadavg()
    print(f"tether sidecar idle memory  {time.strftime('%Y-%m-%d %H:%M')}  rounds {args.rounds}  idle {args.idle:g}s"
          f"  load average {load_start[0]:.2f}", flush=True)
    readings: dict[str, list[dict[str, float]]] = {}
    try:
        with ExitStack() as stack:
            ca = make_test_ca(work / "toolca")
            cp = prepare_controlplane(work / "cp", 1, 2, 3, lease_ttl=15.0)
            stack.enter_context(bs.stopping(cp.start()))
            caps = {"issues.read": "direct", "secure.issues": "direct"}
            starts: dict[str, Callable[[int], int]] = {}
            stopper: dict[str, Callable[[], None]] = {}

            def sidecar_setup(name: str, cwd: str | None, env: dict[str, str]) -> None:
                def start(n: int) -> int:
                    sc = SidecarProcess(cp, cp.issue(f"idle-{len(starts)}-{n}-{time.time_ns()}", caps))
                    here, saved = os.getcwd(), dict(os.environ)
                    os.environ.update(env)  # cp.env() copies os.environ into the sidecar's environment
                    if cwd:
                        os.chdir(cwd)  # the command imports from its working directory
                    try:
                        sc.start(upstream_ca=ca.ca_pem)
                    finally:
                        os.chdir(here)
                        os.environ.clear()
                        os.environ.update(saved)
                    stopper[name] = sc.stop
                    assert sc.proc is not None
                    return sc.proc.pid
                starts[name] = start

            sidecar_setup(SIDECAR, None, {})
            for before in args.before:
                sidecar_setup(f"before ({Path(before).name})", before, {})
            for spec in args.env:
                key, _, value = spec.partition("=")
                sidecar_setup(f"{SIDECAR}, {key}={value}", None, {key: value})

            def mitmdump(n: int) -> int:
                proc = bs.MitmdumpProcess(work / f"mitmdump-{n}", ca.ca_pem).start()
                stopper[MITMDUMP] = proc.stop
                return proc.pid
            starts[MITMDUMP] = mitmdump

            names = list(starts)
            for n in range(args.rounds):
                order = names[n % len(names):] + names[:n % len(names)]
                for name in order:
                    pid = starts[name](n)
                    try:
                        time.sleep(args.idle)
                        readings.setdefault(name, []).append(memory(pid))
                    finally:
                        stopper[name]()
                print(f"  round {n + 1}: " + ", ".join(f"{k} {v[-1]['rss']:.1f}" for k, v in readings.items()),
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_end = os.getloadavg()

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in readings[name])

    print()
    print("| process | RSS MiB median (min-max) | PSS MiB median | USS MiB median | RSS vs bare mitmdump |")
    print("|---|---:|---:|---:|---:|")
    base = med(MITMDUMP, "rss")
    for name, rows in readings.items():
        rss = [r["rss"] for r in rows]
        print(f"| {name} | {med(name, 'rss'):.1f} ({min(rss):.1f}-{max(rss):.1f}) | {med(name, 'pss'):.1f} | "
              f"{med(name, 'uss'):.1f} | {med(name, 'rss') / base:.2f}x |")
    idle = med(SIDECAR, "rss")
    print()
    print(f"load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end")
    print(f"verdict: idle RSS {idle:.1f} MiB (median of {args.rounds}), target <= {IDLE_TARGET_MIB:.0f}: "
          f"{'met' if idle <= IDLE_TARGET_MIB else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
