"""A ``tether sidecar`` started as a child process (``tether mcp stdio``): its command line, its death with its
parent, waiting for its ready file while relaying its status lines, and its stop. (``tether run`` serves its
sidecar in its own process instead: tether/cli/run.py.)"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from tether.capability.errors import TetherError

from .remote import DEFAULT_CONTROLPLANE
from .run import SET_BY_RUN
from .sidecar import SIDECAR_OPTIONS


def sidecar_argv(args: argparse.Namespace, *, chain: str, key: str, state_dir: Path, ready: Path) -> list[str]:
    """The ``tether sidecar`` command line for this run: every sidecar option as given to run."""
    argv = [sys.executable, "-m", "tether", "sidecar", "--controlplane", args.controlplane or DEFAULT_CONTROLPLANE]
    resolved = {"chain": chain, "key": key, "state_dir": str(state_dir), "ready_file": str(ready)}
    for option in SIDECAR_OPTIONS:
        argv += option.argv(resolved[option.dest] if option.dest in SET_BY_RUN else getattr(args, option.dest))
    return argv


def die_with_parent() -> None:
    """In the sidecar child: if `tether run` dies (even by SIGKILL), the kernel sends us SIGTERM."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the sidecar outlives a killed parent; stop it by hand
        pass


def wait_ready(sidecar: subprocess.Popen, ready: Path, log_path: Path, timeout: float = 45.0) -> dict:
    """Wait for the sidecar's ready file, showing its status lines as they come: while it says it is still
    trying to reach the control plane, so does run (Ctrl-C gives up)."""
    deadline = time.monotonic() + timeout
    start = shown = log_path.stat().st_size if log_path.exists() else 0  # the log is appended to, run after run
    while time.monotonic() < deadline:
        if ready.exists():
            return json.loads(ready.read_text())
        shown, waiting = _relay_status(log_path, shown)
        if waiting:
            deadline = time.monotonic() + timeout
        if sidecar.poll() is not None:
            with open(log_path, "rb") as f:  # this start's lines only, never an earlier run's
                f.seek(start)
                tail = f.read().decode(errors="replace").strip().splitlines()[-5:]
            raise TetherError("the sidecar did not start:\n  " + "\n  ".join(tail), code="tether.sidecar_failed")
        time.sleep(0.05)
    raise TetherError(f"the sidecar did not become ready within {timeout:.0f}s (see {log_path})",
                      code="tether.sidecar_failed")


def _relay_status(log_path: Path, offset: int) -> tuple[int, bool]:
    """Print the sidecar's new ``tether: waiting ...`` lines; returns how far the log was read and whether
    there was one."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return offset, False
    complete = chunk[: chunk.rfind(b"\n") + 1]
    waiting = [line for line in complete.decode(errors="replace").splitlines() if line.startswith("tether: waiting")]
    for line in waiting:
        print(line, file=sys.stderr, flush=True)
    return offset + len(complete), bool(waiting)


def stop_sidecar(sidecar: subprocess.Popen, window_s: float) -> None:
    """SIGTERM, then time for the sidecar's own stop: its window, the cut calls' last events, its reports."""
    if sidecar.poll() is not None:
        return
    sidecar.send_signal(signal.SIGTERM)
    try:
        sidecar.wait(timeout=window_s + 15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            sidecar.kill()
        sidecar.wait()
