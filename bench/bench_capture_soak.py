"""A soak of 200,000 calls through one sidecar under a capture retention cap: disk use stays under the cap, and
nothing a termination's record names is lost.

Run: python bench/bench_capture_soak.py            (200,000 calls, 256 MiB cap: over an hour on a busy 2-core machine)
     python bench/bench_capture_soak.py --quick    (5,000 calls, 24 MiB cap: about two minutes)
     python bench/bench_capture_soak.py --calls 20000 --cap 64M --segment 4M   (the run in bench/RESULTS.md)

Real parts: a control plane subprocess, the harness's aiohttp tool server, two real sidecar subprocesses on one
state root. First agent ``held`` makes ``--held-calls`` calls (in 512 KiB segments, so several are sealed) and is
terminated (drain): its sidecar writes a hold.
Then agent ``soak`` makes ``--calls`` calls (4 client threads, keep-alive; bodies of 2 KiB, one call in 100 of
256 KiB, random so compression cannot shrink them away; the tool echoes each body back), with
``--capture-node-max-bytes CAP --capture-max-bytes CAP --capture-segment-bytes SEG``: every agent's captures under
the root stay within CAP, the soak's own segments pruned oldest first, the held agent's never. A thread samples the
bytes of every file under ``ROOT/*/captures/`` every 0.25 s. At the end ``held``'s record is exported
(``tether capture export --termination``): every call it names must be in the HAR. Then ``soak`` is terminated and
its record exported: the calls pruned before its termination are counted (retention let them go; the record names
them, and export says how many it could not find), and every one whose flow was on disk when the termination came
is in the HAR.

Baseline, same run: the bytes the sidecar appended to its capture (``tether_capture_written_bytes_total``), which
is what a capture without retention would hold on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import requests  # noqa: E402

from tests.harness import (  # noqa: E402
    PYTHON,
    SidecarProcess,
    ToolServer,
    free_port,
    prepare_controlplane,
    wait_until,
)
from tether.capture.retention import parse_size, size_text  # noqa: E402
from tether.capture.segments import sealed  # noqa: E402


def disk_use(root: Path) -> int:
    total = 0
    for captures in root.glob("*/captures"):
        for dirpath, _, names in os.walk(captures):
            for name in names:
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    pass
    return total


class Sampler(threading.Thread):
    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root, self.peak, self.samples, self.stop = root, 0, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, disk_use(self.root))
            self.samples += 1
            self.stop.wait(0.25)


def drive(sc: SidecarProcess, base: str, calls: int, threads: int, big_every: int, tag: str,
          progress: Callable[[int], None] | None = None) -> dict[str, int]:
    small = {"pad": secrets.token_hex(1024)}
    big = {"pad": secrets.token_hex(128 * 1024)}
    counts = {"ok": 0, "failed": 0}
    lock = threading.Lock()
    next_i = iter(range(calls))

    def worker() -> None:
        with requests.Session() as s:
            while True:
                with lock:
                    i = next(next_i, None)
                if i is None:
                    return
                body = big if i % big_every == big_every - 1 else small
                try:
                    r = s.post(f"{base}/repos/{tag}/r{i % 1000}/issues", json={"i": i, **body}, proxies=sc.proxies(),
                               timeout=30)
                    ok = r.status_code == 200
                except requests.RequestException:
                    ok = False
                with lock:
                    counts["ok" if ok else "failed"] += 1
                    done = counts["ok"] + counts["failed"]
                    if progress is not None and done % 10_000 == 0:
                        progress(done)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return counts


def cli(cp: Any, *args: str) -> str:
    out = subprocess.run([PYTHON, "-m", "tether", *args, "--controlplane", cp.url], capture_output=True, text=True,
                         timeout=1800, env=cp.env())
    if out.returncode != 0:
        raise SystemExit(f"tether {' '.join(args)} failed: {out.stdout}{out.stderr}")
    return out.stdout


def terminate(cp: Any, agent: str) -> dict[str, Any]:
    client = cp.client()
    doc = client.request("POST", f"/v1/agents/{agent}/terminate", {"mode": "drain", "window_s": 5, "reason": "bench"})
    tid = doc["termination_id"]
    wait_until(lambda: client.request("GET", f"/v1/terminations/{tid}")["state"] == "terminated", 600, interval=0.5,
               what=f"termination of {agent}")
    return client.request("GET", f"/v1/records/{tid}")


def export(cp: Any, root: Path, record: dict[str, Any], out: Path) -> dict[str, Any]:
    text = cli(cp, "capture", "export", "--termination", record["termination_id"], "--captures", str(root),
               "--har", str(out))
    har = json.loads(out.read_text())
    named = {c["capture_ref"] for c in record["calls"] if c.get("capture_ref")}
    found = {e["_tether"]["capture_ref"] for e in har["log"]["entries"]}
    lost = next((int(line.split()[1]) for line in text.splitlines() if line.startswith("warning:") and "flow(s)" in
                 line), 0)
    return {"named": len(named), "in_har": len(found & named), "lost": lost, "output": text.strip()}


def metric(path: Path, name: str) -> float:
    for line in path.read_text().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="5,000 calls under a 24 MiB cap")
    p.add_argument("--calls", type=int)
    p.add_argument("--held-calls", type=int, default=200)
    p.add_argument("--cap", help="the node's and the agent's cap (default 256M; 24M with --quick)")
    p.add_argument("--segment", help="segment size (default 16M; 2M with --quick)")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the state root (its path is printed) for a look")
    args = p.parse_args()
    calls = args.calls or (5000 if args.quick else 200_000)
    cap = args.cap or ("24M" if args.quick else "256M")
    segment = args.segment or ("2M" if args.quick else "16M")
    directory = Path(tempfile.mkdtemp(prefix="tether-soak-"))
    print(f"state root: {directory / 'cp' / 'sidecars'}", file=sys.stderr, flush=True)
    tools = ToolServer().start()
    cp = prepare_controlplane(directory / "cp", tools.port, free_port(), free_port(), lease_ttl=10.0, grace=5.0)
    cp.start()
    root = cp.directory / "sidecars"
    options = ["--capture-max-bytes", cap, "--capture-node-max-bytes", cap, "--capture-segment-bytes", segment]
    held_sc = soak_sc = None
    try:
        held = cp.issue("held", {"issues.write": "direct"})
        # Small segments for the held agent: several sealed ones, which the soak's pressure on the node's cap
        # would prune first (they are the oldest) were they not held.
        held_sc = SidecarProcess(cp, held, [*options, "--capture-segment-bytes", "512K"]).start()
        drive(held_sc, tools.base, args.held_calls, 2, 100, "held")
        held_record = terminate(cp, "held")
        soak = cp.issue("soak", {"issues.write": "direct"})
        soak_sc = SidecarProcess(cp, soak, options).start()
        sampler = Sampler(root)
        sampler.start()
        started = time.monotonic()

        held_segments = {f.path.name.removesuffix(".gz") for f in sealed(held_sc.state_dir / "captures" / "flows.mitm")}

        def progress(done: int) -> None:
            now_held = {f.path.name.removesuffix(".gz") for f in sealed(held_sc.state_dir / "captures" / "flows.mitm")}
            print(f"  {done} calls, {time.monotonic() - started:.0f} s, disk {size_text(disk_use(root))}, peak "
                  f"{size_text(sampler.peak)}, held agent's segments still there {len(now_held & held_segments)}/"
                  f"{len(held_segments)}", file=sys.stderr, flush=True)
        counts = drive(soak_sc, tools.base, calls, args.threads, 100, "soak", progress)
        elapsed = time.monotonic() - started
        metrics = soak_sc.state_dir / "captures" / "metrics.prom"
        wait_until(lambda: metrics.exists(), 30, what="the soak sidecar's capture gauges")
        time.sleep(1.0)  # a last maintenance round after the last rotation (sampled meanwhile)
        held_export = export(cp, root, held_record, directory / "held.har")
        soak_record = terminate(cp, "soak")
        soak_export = export(cp, root, soak_record, directory / "soak.har")
        sampler.stop.set()
        sampler.join()
        written = metric(soak_sc.state_dir / "captures" / "metrics.prom", "tether_capture_written_bytes_total")
        result = {
            "calls": calls, "ok": counts["ok"], "failed": counts["failed"], "seconds": round(elapsed, 1),
            "calls_per_s": round(calls / elapsed), "cap_bytes": parse_size(cap), "segment_bytes": parse_size(segment),
            "peak_disk_bytes": sampler.peak, "final_disk_bytes": disk_use(root), "samples": sampler.samples,
            "written_bytes": int(written), "held": held_export, "soak": soak_export,
            "under_cap": sampler.peak <= parse_size(cap),
            "held_intact": held_export["in_har"] == held_export["named"] == args.held_calls
            and held_export["lost"] == 0,
        }
    finally:
        for sc in (soak_sc, held_sc):
            if sc is not None:
                sc.stop()
        cp.stop()
        tools.stop()
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    r = result
    print(f"{r['calls']} calls ({r['ok']} answered 200, {r['failed']} not) in {r['seconds']} s "
          f"({r['calls_per_s']}/s), cap {size_text(r['cap_bytes'])}, segments {size_text(r['segment_bytes'])}")
    print(f"baseline (appended to the capture, no retention): {size_text(r['written_bytes'])}")
    peak = r["peak_disk_bytes"]
    print(f"peak disk use of every capture under the root: {size_text(peak)} ({peak / r['cap_bytes']:.2f}x the cap, "
          f"{peak / max(1, r['written_bytes']):.3f}x the baseline; {r['samples']} samples); at the end "
          f"{size_text(r['final_disk_bytes'])}")
    print(f"held agent's record: {r['held']['named']} calls named, {r['held']['in_har']} in the HAR, "
          f"{r['held']['lost']} lost")
    print(f"soak agent's record: {r['soak']['named']} calls named, {r['soak']['in_har']} in the HAR, "
          f"{r['soak']['lost']} pruned before its termination")
    print(f"under the cap: {r['under_cap']}; held record intact: {r['held_intact']}")
    if not (r["under_cap"] and r["held_intact"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
