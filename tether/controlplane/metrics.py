"""The control plane's Prometheus metrics: counters, the revocation-propagation histogram, process metrics,
and their text exposition (``GET /metrics``).

Label sets are bounded on purpose: a capability label is a catalog capability name (anything else a
sidecar reports is ``other``), a resolution one of the five of docs/contract.md section 5, a code one of tether's
codes. URLs and agent ids never become labels, so a fleet of ten thousand agents does not make ten
thousand series. No client library: the exposition format is a few lines of text.
"""

from __future__ import annotations

import os
import re
import resource
import time
from collections.abc import Iterable
from typing import Any

from tether.capability import errors as codes
from tether.capability.shared import RESOLUTIONS

from .termination import MODES

# HELP text and type of every family this module renders; a counter incremented under a name not listed
# here is still rendered (as an untyped family), so nothing counted is ever hidden.
FAMILIES: dict[str, tuple[str, str]] = {
    "tether_calls_total": ("counter", "Calls reported by sidecars, by catalog capability and resolution."),
    "tether_refusals_total": ("counter", "Calls refused by sidecars (nothing sent upstream), by tether code."),
    "tether_terminations_total": ("counter", "Terminations requested, by mode."),
    "tether_terminations_requested_total": ("counter", "Terminations requested (all modes)."),
    "tether_terminations_completed_total": ("counter", "Terminations that reached 'terminated'."),
    "tether_revocations_total": ("counter", "Links revoked (each link once)."),
    "tether_revocation_propagation_seconds": (
        "histogram", "Seconds from a revocation's publication to a sidecar run acknowledging that it holds it."),
    "tether_grants_issued_total": ("counter", "Root grants issued."),
    "tether_links_registered_total": ("counter", "Chain links registered for the first time."),
    "tether_events_published_total": ("counter", "Events published to the sidecar stream, by kind."),
    "tether_events_delivered_total": ("counter", "Events delivered to sidecars."),
    "tether_event_resyncs_total": ("counter", "Full resyncs sent to sidecars that fell behind the stream."),
    "tether_heartbeats_total": ("counter", "Sidecar heartbeats (lease renewals)."),
    "tether_reports_total": ("counter", "Call reports stored (new call ids)."),
    "tether_reports_duplicate_total": ("counter", "Call reports received again (at-least-once delivery)."),
    "tether_approvals_requested_total": ("counter", "Calls held for a person's approval."),
}

# Seconds: a revocation normally reaches a sidecar over the event stream in milliseconds and is
# acknowledged with its next heartbeat (a third of the lease TTL); the long tail is a sidecar that was
# cut off from the control plane for a while.
PROPAGATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

_KNOWN_CODES = frozenset(v for k, v in vars(codes).items() if k.isupper() and isinstance(v, str)
                         and v.startswith("tether."))
_NAME = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?$")


def label(value: str) -> str:
    """A Prometheus label value, escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Histogram:
    def __init__(self, buckets: Iterable[float]) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        value = max(0.0, value)
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{bound:g}"}} {n}' for bound, n in zip(self.bounds, self.counts, strict=True)]
        return [*out, f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:g}",
                f"{name}_count {self.count}"]


class Metrics:
    """Counters (by full series name, labels included: ``inc('x_total{kind="a"}')``) and histograms."""

    def __init__(self, capabilities: Iterable[str] = ()) -> None:
        self.counters: dict[str, float] = {}
        self.capabilities = frozenset(capabilities)
        self.propagation = Histogram(PROPAGATION_BUCKETS)
        # Zero series for the bounded label sets people alert on, so rate() works from the first scrape.
        self.counters["tether_revocations_total"] = 0.0
        for mode in MODES:
            self.counters[f'tether_terminations_total{{mode="{mode}"}}'] = 0.0

    def inc(self, name: str, by: float = 1.0) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + by

    # -- what reports and requests add ---------------------------------------------------------------
    def capability_label(self, capability: Any) -> str:
        if capability is None or capability == "":
            return "none"  # refused before any capability matched
        return capability if capability in self.capabilities else "other"

    def call_reported(self, report: dict[str, Any]) -> None:
        """One final call report, counted once (the caller passes only reports the store took as new)."""
        resolution = report.get("resolution")
        resolution = resolution if resolution in RESOLUTIONS else "other"
        self.inc(f'tether_calls_total{{capability="{label(self.capability_label(report.get("capability")))}",'
                 f'resolution="{resolution}"}}')
        code = report.get("code")
        if resolution in ("refused", "cancelled_not_sent") and isinstance(code, str) and code:
            self.inc(f'tether_refusals_total{{code="{code if code in _KNOWN_CODES else "other"}"}}')

    def termination_requested(self, mode: str) -> None:
        self.inc(f'tether_terminations_total{{mode="{mode if mode in MODES else "other"}"}}')

    # -- exposition ----------------------------------------------------------------------------------
    def render(self) -> list[str]:
        families: dict[str, list[str]] = {}
        for series in sorted(self.counters):
            match = _NAME.match(series)
            family = match.group(1) if match else series
            families.setdefault(family, []).append(f"{series} {self.counters[series]:g}")
        lines: list[str] = []
        for family, series in families.items():
            kind, text = FAMILIES.get(family, ("untyped", ""))
            if text:
                lines.append(f"# HELP {family} {text}")
            lines.append(f"# TYPE {family} {kind}")
            lines.extend(series)
        name = "tether_revocation_propagation_seconds"
        lines += [f"# HELP {name} {FAMILIES[name][1]}", f"# TYPE {name} histogram", *self.propagation.lines(name)]
        return lines + process_metrics()


def gauge(name: str, text: str, samples: Iterable[tuple[str, float]]) -> list[str]:
    """A gauge family: ``samples`` are (label set, value) pairs, ``""`` for none."""
    return [f"# HELP {name} {text}", f"# TYPE {name} gauge",
            *(f"{name}{labels} {value:g}" for labels, value in samples)]


_START_TIME: float | None = None


def _start_time() -> float:
    """The process's start, from /proc (as the Prometheus client libraries report it)."""
    global _START_TIME
    if _START_TIME is None:
        try:
            with open("/proc/self/stat") as f:
                ticks = float(f.read().rsplit(")", 1)[1].split()[19])
            with open("/proc/stat") as f:
                boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
            _START_TIME = boot + ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError, StopIteration):
            _START_TIME = time.time() - time.process_time()  # not Linux: the best estimate at hand
    return _START_TIME


def process_metrics() -> list[str]:
    """The standard ``process_*`` families of the Prometheus client libraries."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    lines = [
        "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.",
        "# TYPE process_cpu_seconds_total counter",
        f"process_cpu_seconds_total {usage.ru_utime + usage.ru_stime:g}",
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
        "# TYPE process_start_time_seconds gauge",
        f"process_start_time_seconds {_start_time():.3f}",
    ]
    try:
        with open("/proc/self/statm") as f:
            pages = f.read().split()
        page = os.sysconf("SC_PAGE_SIZE")
        lines += ["# HELP process_virtual_memory_bytes Virtual memory size in bytes.",
                  "# TYPE process_virtual_memory_bytes gauge", f"process_virtual_memory_bytes {int(pages[0]) * page}",
                  "# HELP process_resident_memory_bytes Resident memory size in bytes.",
                  "# TYPE process_resident_memory_bytes gauge",
                  f"process_resident_memory_bytes {int(pages[1]) * page}"]
    except (OSError, ValueError, IndexError):
        lines += ["# HELP process_resident_memory_bytes Resident memory size in bytes (peak, from getrusage).",
                  "# TYPE process_resident_memory_bytes gauge",
                  f"process_resident_memory_bytes {usage.ru_maxrss * 1024}"]
    try:
        fds = len(os.listdir("/proc/self/fd"))
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lines += ["# HELP process_open_fds Number of open file descriptors.", "# TYPE process_open_fds gauge",
                  f"process_open_fds {fds}",
                  "# HELP process_max_fds Maximum number of open file descriptors.", "# TYPE process_max_fds gauge",
                  f"process_max_fds {soft}"]
    except OSError:
        pass
    return lines


async def revocations_acknowledged(store: Any, metrics: Metrics, run: dict[str, Any], held: dict[str, Any] | None,
                                   now: float) -> list[str]:
    """Observe how long revocations took to reach a sidecar run; returns the jtis it has acknowledged so far
    (kept in the run's document so each is observed once).

    A heartbeat carries ``revocations_held`` (``held`` here): {jti: seconds since the sidecar learned it}, measured
    on the sidecar's monotonic clock. The moment it learned is then ``now - age`` on the control plane's own clock
    (no clock skew between hosts; the error is the heartbeat's one-way transit), and the propagation time is that
    moment minus the revocation's publication (``at``). A run that started after the revocation learned it at
    start-up, not by propagation: it is acknowledged but not observed."""
    done = [j for j in run.get("revocations_acknowledged") or [] if isinstance(j, str)]
    if not isinstance(held, dict):
        return done
    fresh = {jti: float(age) for jti, age in held.items() if isinstance(jti, str) and jti not in done
             and isinstance(age, int | float) and 0 <= age < 10 * 365 * 86400}
    if not fresh:
        return done
    revocations = await store.revocations()
    started = run.get("started_at")
    for jti, age in sorted(fresh.items()):
        revocation = revocations.get(jti)
        if revocation is None or not isinstance(revocation.get("at"), int | float):
            continue  # not (yet) a revocation this control plane knows of
        done.append(jti)
        if isinstance(started, int | float) and started > revocation["at"]:
            continue
        metrics.propagation.observe(now - age - revocation["at"])
    return done


class LoopWatch:
    """How long the control plane's event loop was kept busy by its own code: a task that asks to sleep
    ``interval_s`` and measures both how late it wakes and how much CPU this thread spent meanwhile. A late
    wake-up with the CPU spent here is a stall of ours (a big record built on the loop, say); a late wake-up
    with little CPU is the machine not giving us a core, which no code change here would fix."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.stall_max = 0.0  # seconds: min(lateness, CPU spent on this thread), the largest seen
        self.late_max = 0.0  # seconds: lateness whatever its cause

    async def run(self) -> None:
        import asyncio
        import time

        while True:
            wall, cpu = time.monotonic(), time.thread_time()
            await asyncio.sleep(self.interval_s)
            late = time.monotonic() - wall - self.interval_s
            busy = time.thread_time() - cpu
            self.late_max = max(self.late_max, late)
            self.stall_max = max(self.stall_max, min(late, busy))

    def lines(self) -> list[str]:
        return [*gauge("tether_event_loop_stall_seconds_max", "Longest time the event loop was busy with this "
                       "process's own work past a 20 ms tick, since start.", [("", round(self.stall_max, 4))]),
                *gauge("tether_event_loop_late_seconds_max", "Longest lateness of a 20 ms tick since start, "
                       "whatever its cause (CPU starvation included).", [("", round(self.late_max, 4))])]
