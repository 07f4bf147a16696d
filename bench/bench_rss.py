"""A sidecar's memory: idle RSS after start and RSS after each batch of 10,000 calls, against bare mitmdump and
against mitmproxy with the sidecar's own addon set, all started the same way and driven alike.

Run: python bench/bench_rss.py [--batches 3] [--calls 10000] [--before DIR]   (~1-2 minutes)

One control plane, one real ``tether sidecar`` (capture on), bare ``mitmdump`` and ``bench/minimal_mitmproxy.py``;
with ``--before DIR`` a second sidecar runs the code of the checkout in DIR (``git archive COMMIT | tar -x -C
DIR``), so before and after are read in the same run. Each batch sends the same calls through every proxy
(half plain HTTP, half HTTPS, 8 keep-alive clients, setups alternating as in bench_sidecar.py); RSS is read
from /proc 2 s after each batch. Also printed: the modules the sidecar process has loaded (``sys.modules`` of
a fresh interpreter importing ``proxy.sidecar`` the way ``tether sidecar`` does) and the largest mappings of
its address space (anonymous memory is Python's objects; file mappings are shared libraries).

Targets (issue 17): idle RSS <= 60 MiB; growth per 10,000 calls ~0 once warm.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_sidecar as bs  # noqa: E402

from tests.harness import PYTHON, SidecarProcess, free_port, make_test_ca, prepare_controlplane  # noqa: E402

IDLE_TARGET_MIB = 60.0


def mappings(pid: int, top: int = 8) -> list[tuple[str, float]]:
    """The largest resident mappings of a process, by file (anonymous memory and the heap together)."""
    by: collections.Counter[str] = collections.Counter()
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if parts and parts[0] == "Rss:":
            by[name] += int(parts[1])
        elif parts and "-" in parts[0] and not parts[0].endswith(":"):
            name = os.path.basename(parts[5]) if len(parts) > 5 and parts[5] != "[heap]" else "[anon]"
    return [(k, v / 1024) for k, v in by.most_common(top)]


def sidecar_modules(root: Path) -> list[str]:
    # The command layer as it is in ``root``: tether/cli/ since the namespace step, cli/ since the architecture step,
    # tether/controlplane/cli.py before it.
    code = ("import sys, json\ntry:\n    import tether.cli.main as c, tether.cli.sidecar, tether.cli.run\n"
            "    import tether.proxy.sidecar\nexcept ImportError:\n  try:\n"
            "    import cli.main as c, cli.sidecar, cli.run\n  except ImportError:\n"
            "    import controlplane.cli as c, proxy.runner\n  import proxy.sidecar\nc.build_parser()\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--calls", type=int, default=10_000, help="calls per batch through each proxy")
    parser.add_argument("--before", metavar="DIR", help="also a sidecar running the code of the checkout in DIR")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tether-bench-rss-"))
    print(f"tether sidecar memory  {time.strftime('%Y-%m-%d %H:%M')}  python {platform.python_version()}  "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    try:
        with ExitStack() as stack:
            ca = make_test_ca(work / "toolca")
            tools = stack.enter_context(bs.stopping(bs.ToolServerProcess(ca).start()))
            cp = prepare_controlplane(work / "cp", tools.http_port, tools.https_port, free_port(), lease_ttl=15.0)
            stack.enter_context(bs.stopping(cp.start()))
            caps = {"issues.read": "direct", "secure.issues": "direct"}
            sidecars = {"tether sidecar": SidecarProcess(cp, cp.issue("rss-agent", caps))}
            if args.before:
                sidecars["tether sidecar (before)"] = SidecarProcess(cp, cp.issue("rss-agent-before", caps))
            here = os.getcwd()
            for name, sc in sidecars.items():
                stack.enter_context(bs.stopping(sc))
                if name.endswith("(before)"):  # the command imports from its working directory
                    os.chdir(args.before)
                try:
                    sc.start(upstream_ca=ca.ca_pem)
                finally:
                    os.chdir(here)
            mitm = stack.enter_context(bs.stopping(bs.MitmdumpProcess(work / "mitmdump", ca.ca_pem).start()))
            core = stack.enter_context(bs.stopping(bs.MinimalMitmproxyProcess(work / "core", ca.ca_pem).start()))
            pids = {**{n: sc.proc.pid for n, sc in sidecars.items()}, bs.CORE: core.pid, "bare mitmdump": mitm.pid}
            proxies = {**{n: (sc.proxy, Path(sc.ca)) for n, sc in sidecars.items()}, bs.CORE: (core.proxy, core.ca),
                       "bare mitmdump": (mitm.proxy, mitm.ca)}
            time.sleep(2.0)
            readings = {n: [bs.rss_mib(p)] for n, p in pids.items()}
            top = {n: mappings(p) for n, p in pids.items()}
            for batch in range(args.batches):
                for base in (tools.http_base, tools.https_base):
                    setups = [bs.Setup(n, proxy, bs.context(cafile), pids[n]) for n, (proxy, cafile) in proxies.items()]
                    per_client = args.calls // 2 // (8 * 5)
                    asyncio.run(bs.measure(setups, base + bs.ISSUES, 8, 5, per_client, warmup=5))
                time.sleep(2.0)
                for n, p in pids.items():
                    readings[n].append(bs.rss_mib(p))
                print(f"  batch {batch + 1}: " + ", ".join(f"{n} {r[-1]:.1f}" for n, r in readings.items()), flush=True)
        mods = sidecar_modules(ROOT)
        before_mods = sidecar_modules(Path(args.before)) if args.before else None
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print()
    cols = " | ".join(f"after {(b + 1) * args.calls:,} calls" for b in range(args.batches))
    print(f"| process | idle after start MiB | {cols} | growth per {args.calls:,} calls once warm (MiB) |")
    print("|---|---:|" + "---:|" * args.batches + "---:|")
    mitm_idle = readings["bare mitmdump"][0]
    for n, r in readings.items():
        warm = (r[-1] - r[1]) / (len(r) - 2) if len(r) > 2 else float("nan")
        print(f"| {n} | {r[0]:.1f} ({r[0] / mitm_idle:.2f}x mitmdump) | " + " | ".join(f"{x:.1f}" for x in r[1:])
              + f" | {warm:+.2f} |")
    print()
    print(f"modules loaded by a sidecar process: {len(mods)}"
          + (f" (before: {len(before_mods)})" if before_mods else ""))
    if before_mods:
        gone = collections.Counter(m.split(".")[0] for m in set(before_mods) - set(mods))
        print("  no longer loaded: " + ", ".join(f"{k} ({v})" for k, v in gone.most_common(15)))
    print("  by top-level package: " + ", ".join(
        f"{k} {v}" for k, v in collections.Counter(m.split(".")[0] for m in mods).most_common(15)))
    print()
    for n, t in top.items():
        print(f"largest resident mappings, {n} (MiB): " + ", ".join(f"{k} {v:.1f}" for k, v in t))
    idle = readings["tether sidecar"][0]
    print()
    print(f"verdict: idle RSS {idle:.1f} MiB, target <= {IDLE_TARGET_MIB:.0f}: "
          f"{'met' if idle <= IDLE_TARGET_MIB else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
