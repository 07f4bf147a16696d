"""How long ``tether run -- true`` takes, start to finish, enforced (the default) and cooperative.

Run: python bench/bench_startup.py [--rounds 7]      (about a minute on 2 cores)

Real parts: a ``tether controlplane serve`` process (SQLite) and one agent identity; each round runs, in turn
(A B C D, A B C D ...: the machine's load falls on all alike), the command as a whole process from the shell's
point of view:

  - ``python -c pass``: the interpreter alone (the floor of any Python tool);
  - bare mitmdump: started, listening (its port accepts), then SIGTERMed and gone (the floor of a sidecar);
  - ``tether run --cooperative -- true``: a sidecar started, registered, serving, stopped, its goodbye sent;
  - ``tether run -- true``: the same inside the enforcing enclosure (user, network, mount and PID namespaces,
    the redirect rules, the trust-store and cover mounts).

Prints each one's median and best, and the ratios of the two ``tether run`` forms to bare mitmdump.
Target (issue 21): ``tether run -- true`` in under 1.5 s on this machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import PYTHON, free_port, prepare_controlplane


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{argv[:6]}... failed ({done.returncode}): {done.stderr.decode()[-800:]}")
    return took


def bare_mitmdump(env: dict[str, str]) -> float:
    port = free_port()
    mitmdump = str(Path(PYTHON).with_name("mitmdump"))
    started = time.perf_counter()
    proc = subprocess.Popen([mitmdump, "--listen-host", "127.0.0.1", "--listen-port", str(port), "-q"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None:
                raise SystemExit("mitmdump exited") from None
            time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tether-bench-startup-"))
    cp = prepare_controlplane(root / "cp", 1, 2, 3)
    cp.start()
    try:
        ident = cp.issue("startup", {"issues.read": "direct"})
        env = {k: v for k, v in os.environ.items() if k not in ("TETHER_ADMIN_TOKEN", "TETHER_TOKEN")}
        env["TETHER_CONTROLPLANE"] = cp.url
        run = [PYTHON, "-m", "tether", "run", "--chain", str(ident.chain_path), "--key", str(ident.key_path),
               "--state-dir", str(root / "state")]
        cases = {
            "python -c pass": lambda: timed([PYTHON, "-c", "pass"], env),
            "bare mitmdump (start, listen, stop)": lambda: bare_mitmdump(env),
            "tether run --cooperative -- true": lambda: timed([*run, "--cooperative", "--", "true"], env),
            "tether run -- true (enforced)": lambda: timed([*run, "--", "true"], env),
        }
        for case in cases.values():  # warm: the sidecar's CA is made once per state dir, caches filled
            case()
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, case in cases.items():
                times[name].append(case())
        print(f"# {platform.node()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, "
              f"{args.rounds} rounds (A B C D interleaved)")
        base = statistics.median(times["bare mitmdump (start, listen, stop)"])
        print(f"{'case':40} {'median':>8} {'best':>8} {'vs mitmdump':>12}")
        for name, values in times.items():
            med = statistics.median(values)
            print(f"{name:40} {med:7.3f}s {min(values):7.3f}s {med / base:11.2f}x")
    finally:
        cp.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
