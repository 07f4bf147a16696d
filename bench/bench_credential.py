"""What an injected credential costs a sidecar, measured closely: *tether* against *tether + credential* only.

Run: python bench/bench_credential.py [--reps 6] [--before DIR]   (~40 s per repetition with --before)

The same two sidecars as bench_sidecar.py's credential row (capture on, one control plane, the same tool and
URL; the second one's capability names the catalog credential ``bench`` and the sidecar alone holds its secret,
``--secret bench=file:PATH``), without the other setups in the rotation, so more calls are compared at 1 client,
where a per-call cost shows. With ``--before DIR`` (a checkout of earlier code: ``git archive COMMIT | tar -x -C
DIR``) both also run from DIR's code in the same rotation. Each repetition starts fresh sidecar processes (one
process's own speed differs from another's by a few per cent: hash seeds, address layout) in a shuffled order
(each setup runs after each other one), then 10 alternating rounds of 300 calls per setup; the figures are the
median and range of the repetitions' ratios (p50 latency, proxy CPU per call from /proc) against *tether* of
the same code.

Control: *tether, agent's own header* is the *tether* process again, its client sending an ``Authorization``
header of the injected one's length itself (forwarded as it is, redacted by name in the capture): what one more
credential header costs on the way through mitmproxy, the capture and the tool server, without injection.

Target (issue 13): *tether + credential* no slower than *tether* within noise (p50 <= 1.05x).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
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

OWN = "tether, agent's own header"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}x ({min(values):.3f}-{max(values):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=6)
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
            token = "bench-" + secrets.token_hex(16)
            secret.write_text(token + "\n")
            os.chmod(secret, 0o600)
            stack.enter_context(bs.stopping(cp.start()))
            plain = {"issues.read": "direct", "secure.issues": "direct"}
            cred = {"cred.issues": "direct", "cred.secure": "direct"}
            secret_args = ["--secret", f"bench=file:{secret}"]
            names = [bs.TETHER, bs.CRED] + ([bs.BEFORE, bs.CRED_BEFORE] if args.before else [])
            shuffle = random.Random(13)
            schemes = args.schemes.split(",")
            results = {scheme: {n: [] for n in [*names, OWN]} for scheme in schemes}
            here = os.getcwd()
            for rep in range(args.reps):
                order = shuffle.sample(names, len(names))
                with ExitStack() as running:  # fresh processes for every repetition
                    sidecars = {}
                    for name in order:
                        caps = cred if name in (bs.CRED, bs.CRED_BEFORE) else plain
                        sc = SidecarProcess(cp, cp.issue(f"cred-bench-{names.index(name)}-{rep}", caps),
                                            extra=secret_args if caps is cred else [])
                        running.enter_context(bs.stopping(sc))
                        if name in (bs.BEFORE, bs.CRED_BEFORE):  # `python -m tether` imports from its cwd
                            os.chdir(args.before)
                        try:
                            sidecars[name] = sc.start(upstream_ca=ca.ca_pem)
                        finally:
                            os.chdir(here)
                    setups = [bs.Setup(n, sc.proxy, bs.context(Path(sc.ca)), sc.proc.pid) for n, sc in sidecars.items()]
                    own = sidecars[bs.TETHER]
                    setups.insert(shuffle.randrange(len(setups) + 1), bs.Setup(
                        OWN, own.proxy, bs.context(Path(own.ca)), own.proc.pid,
                        headers={"Authorization": "Bearer " + "x" * len(token)}))
                    for scheme in schemes:
                        base = tools.http_base if scheme == "http" else tools.https_base
                        figures, _ = asyncio.run(bs.measure(setups, base + bs.ISSUES, 1, args.rounds, args.per_round,
                                                            warmup=20))
                        for n, f in figures.items():
                            results[scheme][n].append((f.pct(0.5), f.cpu_ms_per_call))
                        print(f"  repetition {rep + 1} {scheme} (order {', '.join(order)}): " + ", ".join(
                            f"{n} p50 {f.pct(0.5):.3f} ms CPU {f.cpu_ms_per_call:.3f} ms/call"
                            for n, f in figures.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    pairs = [(bs.CRED, bs.TETHER), (OWN, bs.TETHER)] + ([(bs.CRED_BEFORE, bs.BEFORE)] if args.before else [])
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
            code = "before" if on == bs.CRED_BEFORE else "this, control: agent's own header" if on == OWN else "this"
            print(f"| {code} | {scheme} | 1 | {args.reps * args.rounds * args.per_round} | {spread(p50)} | "
                  f"{spread(cpu)} | {statistics.median(x[1] for x in by[off]):.3f} -> "
                  f"{statistics.median(x[1] for x in by[on]):.3f} |")
    print()
    print(f"verdict, credential (median p50 ratio <= {bs.CRED_RATIO_TARGET:.2f}x): {'met' if met else 'MISSED'}")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
