"""What an injected credential costs a sidecar, measured closely: *tether* against *tether + credential* only.

Run: python bench/bench_credential.py [--reps 4] [--before DIR]   (~1.5 minutes per scheme and 4 repetitions)

The same two sidecars as bench_sidecar.py's credential row (capture on, one control plane, the same tool and
URL; the second one's capability names the catalog credential ``bench`` and the sidecar alone holds its secret,
``--secret bench=file:PATH``), without the other setups in the rotation, so more calls are compared at 1 client,
where a per-call cost shows. With ``--before DIR`` (a checkout of earlier code: ``git archive COMMIT | tar -x -C
DIR``) both also run from DIR's code in the same rotation. Each repetition is 10 alternating rounds of 300
calls per setup; the figures are the median and range of the repetitions' ratios (p50 latency, proxy CPU per
call from /proc) against *tether* of the same code.

Target (issue 13): *tether + credential* no slower than *tether* within noise (p50 <= 1.05x).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_sidecar as bs  # noqa: E402

from tests.harness import SidecarProcess, free_port, make_test_ca, prepare_controlplane  # noqa: E402


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}x ({min(values):.3f}-{max(values):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=300)
    parser.add_argument("--schemes", default="http,https")
    parser.add_argument("--before", metavar="DIR", help="also both sidecars from the checkout in DIR")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tether-bench-cred-"))
    print(f"tether credential benchmark  {time.strftime('%Y-%m-%d %H:%M')}  nproc {os.cpu_count()}  "
          f"python {platform.python_version()}  load average {os.getloadavg()[0]:.2f}", flush=True)
    results: dict[str, dict[str, list[tuple[float, float]]]] = {}
    try:
        with ExitStack() as stack:
            ca = make_test_ca(work / "toolca")
            tools = stack.enter_context(bs.stopping(bs.ToolServerProcess(ca).start()))
            cp = prepare_controlplane(work / "cp", tools.http_port, tools.https_port, free_port(), lease_ttl=15.0)
            extra = bs.CREDENTIAL_CAPS.format(http=tools.http_port, https=tools.https_port).lstrip("\n")
            cp.catalog_path.write_text(bs.CREDENTIAL_CATALOG.lstrip("\n") + cp.catalog_path.read_text().replace(
                "roles:", extra + "roles:"))
            secret = work / "bench.secret"
            secret.write_text("bench-" + secrets.token_hex(16) + "\n")
            os.chmod(secret, 0o600)
            stack.enter_context(bs.stopping(cp.start()))
            plain = {"issues.read": "direct", "secure.issues": "direct"}
            cred = {"cred.issues": "direct", "cred.secure": "direct"}
            secret_args = ["--secret", f"bench=file:{secret}"]
            sidecars = {bs.TETHER: SidecarProcess(cp, cp.issue("cred-bench-plain", plain)),
                        bs.CRED: SidecarProcess(cp, cp.issue("cred-bench-cred", cred), extra=secret_args)}
            if args.before:
                sidecars[bs.BEFORE] = SidecarProcess(cp, cp.issue("cred-bench-plain-before", plain))
                sidecars[bs.CRED_BEFORE] = SidecarProcess(cp, cp.issue("cred-bench-cred-before", cred),
                                                          extra=secret_args)
            here = os.getcwd()
            for name, sc in sidecars.items():
                stack.enter_context(bs.stopping(sc))
                if name in (bs.BEFORE, bs.CRED_BEFORE):  # `python -m controlplane.cli` imports from its cwd
                    os.chdir(args.before)
                try:
                    sc.start(upstream_ca=ca.ca_pem)
                finally:
                    os.chdir(here)
            for scheme in args.schemes.split(","):
                base = tools.http_base if scheme == "http" else tools.https_base
                setups = [bs.Setup(n, sc.proxy, bs.context(Path(sc.ca)), sc.proc.pid) for n, sc in sidecars.items()]
                results[scheme] = {n: [] for n in sidecars}
                for rep in range(args.reps):
                    figures, _ = asyncio.run(bs.measure(setups, base + bs.ISSUES, 1, args.rounds, args.per_round,
                                                        warmup=20))
                    for n, f in figures.items():
                        results[scheme][n].append((f.pct(0.5), f.cpu_ms_per_call))
                    print(f"  {scheme} repetition {rep + 1}: " + ", ".join(
                        f"{n} p50 {f.pct(0.5):.3f} ms CPU {f.cpu_ms_per_call:.3f} ms/call" for n, f in figures.items()),
                        flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    pairs = [(bs.CRED, bs.TETHER)] + ([(bs.CRED_BEFORE, bs.BEFORE)] if args.before else [])
    print()
    print("| code | scheme | clients | calls per setup | p50 ratio, median (range) | CPU/call ratio, median (range) "
          "| CPU/call without -> with, ms (medians) |")
    print("|---|---|---:|---:|---|---|---|")
    met = True
    for on, off in pairs:
        for scheme, by in results.items():
            p50 = [a[0] / b[0] for a, b in zip(by[on], by[off], strict=True)]
            cpu = [a[1] / b[1] for a, b in zip(by[on], by[off], strict=True)]
            if on == bs.CRED:
                met &= statistics.median(p50) <= bs.CRED_RATIO_TARGET
            code = "before" if on == bs.CRED_BEFORE else "this"
            print(f"| {code} | {scheme} | 1 | {args.reps * args.rounds * args.per_round} | {spread(p50)} | "
                  f"{spread(cpu)} | {statistics.median(x[1] for x in by[off]):.3f} -> "
                  f"{statistics.median(x[1] for x in by[on]):.3f} |")
    print()
    print(f"verdict, credential (median p50 ratio <= {bs.CRED_RATIO_TARGET:.2f}x): {'met' if met else 'MISSED'}")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
