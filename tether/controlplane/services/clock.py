"""The replica's clock, watched: reads the store's clock every few seconds, takes the sidecars' proofs as
they are verified, logs each crossing of the bound, and refuses (``require_true``) what a skewed clock
must not decide. The rule and the arithmetic are in ``tether/controlplane/clock.py``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from tether.capability.errors import ApiError

from .. import termination as proto
from ..clock import CLOCK_SKEWED, MEASURE_INTERVAL_S, ClockWatch, Verdict
from ..metrics import gauge
from ..store import Doc, Store, StoreUnavailable

log = logging.getLogger("tether.clock")
MEASURE_TIMEOUT_S = 5.0


class ClockService:
    def __init__(self, store: Store, clock: Callable[[], float], replica: str,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store, self.clock, self.replica, self.monotonic = store, clock, replica, monotonic
        self.watch = ClockWatch(store.clock_name or "local")

    async def measure(self) -> Verdict:
        """One comparison with the store's clock (nothing to compare with on SQLite)."""
        if not self.watch.local:
            sent = self.clock()
            reference = await asyncio.wait_for(self.store.reference_time(), MEASURE_TIMEOUT_S)
            received = self.clock()
            if reference is not None:
                self.watch.measured(sent, reference, received, self.monotonic())
        return self._verdict()

    def _verdict(self) -> Verdict:
        at = self.monotonic()
        changed = self.watch.changed(at)
        if changed is not None and changed.skewed:
            log.warning("replica %s: clock skewed: %s; taking no termination lease and accepting no "
                        "termination until it is back within %gs (/healthz answers 503 %s)", self.replica,
                        changed.reason, self.watch.bound_s, CLOCK_SKEWED)
        elif changed is not None and self.watch.local:
            log.info("replica %s: the embedded store has no clock of its own; this replica's is the reference",
                     self.replica)
        elif changed is not None:
            log.info("replica %s: clock within %gs of the store's (offset %+.3fs +- %.3fs)", self.replica,
                     self.watch.bound_s, changed.offset_s or 0.0, changed.uncertainty_s or 0.0)
        return self.watch.verdict(at)

    async def run(self) -> None:
        while True:
            try:
                await self.measure()
            except (StoreUnavailable, ConnectionError, OSError, TimeoutError) as exc:
                log.debug("clock: the store's clock could not be read (%s)", exc)
                self._verdict()  # a measurement going stale is a crossing too
            except Exception:  # the watch must outlive any one bad reading
                log.exception("clock: measurement failed")
            await asyncio.sleep(MEASURE_INTERVAL_S)

    def verdict(self) -> Verdict:
        return self.watch.verdict(self.monotonic())

    def require_true(self, what: str) -> None:
        """Raise 503 ``tether.clock_skewed`` while this replica's clock may not ``what``."""
        verdict = self.verdict()
        if verdict.skewed:
            raise ApiError(503, CLOCK_SKEWED, f"{verdict.reason}; this replica cannot {what}: send it to another "
                           "replica", offset_s=None if verdict.offset_s is None else round(verdict.offset_s, 3))

    def handed_out(self, command: Doc | None) -> Doc | None:
        """A stored termination command as this replica hands it to a sidecar now: with ``remaining_s``, the
        window left as a duration, unless this clock is skewed (then the sidecar has only the deadline and
        the window, as before, rather than a duration measured on a bad clock)."""
        if command is None or self.verdict().skewed:
            return None if command is None else {k: v for k, v in command.items() if k != "remaining_s"}
        return proto.delivered(command, self.clock())

    def reference_now(self, now: float) -> float:
        """``now`` (this clock) on the store's clock, by the newest measurement: what a sidecar's proof is
        judged on, so a skewed replica (out of rotation, but still followed by the sidecars connected to it)
        neither refuses fresh proofs as signed ahead nor keeps stale ones fresh. Unmeasured: ``now``."""
        sample = self.watch.best(self.monotonic())
        return now if sample is None else now - sample.offset_s

    def skew_reason(self) -> str:
        return self.verdict().reason

    def proof_seen(self, run: str, now: float, iat: float) -> None:
        at = self.monotonic()
        if self.watch.proof_seen(run, now, iat, at):
            median, runs = self.watch.sidecar_offset(at)
            if median is not None and abs(median) > self.watch.bound_s:
                log.warning("replica %s: the proofs of %d sidecar runs say this clock is %+.1fs off theirs "
                            "(median; bound %gs): check this host's and the sidecars' time sync", self.replica,
                            runs, median, self.watch.bound_s)
            else:
                log.info("replica %s: the sidecars' proofs agree with this clock again", self.replica)

    def lines(self) -> list[str]:
        """Prometheus gauges (an unmeasured offset is NaN)."""
        at = self.monotonic()
        verdict = self.watch.verdict(at)
        median, runs = self.watch.sidecar_offset(at)
        lines = gauge("tether_clock_offset_seconds", "This replica's clock minus the store's (Redis TIME); 0 on "
                      "the embedded store; absent while unmeasured.", _one(verdict.offset_s))
        lines += gauge("tether_clock_skewed", "1 while the offset is past the bound (or unmeasured): no lease, no "
                       "deadline.", [("", int(verdict.skewed))])
        lines += gauge("tether_clock_skew_bound_seconds", "The bound on the offset.", [("", self.watch.bound_s)])
        lines += gauge("tether_clock_offset_sidecars_seconds", "Median over recent sidecar runs of this clock minus "
                       "their proofs' signing time (transit included).", _one(median))
        lines += gauge("tether_clock_sidecar_runs", "Sidecar runs in that median.", [("", runs)])
        return lines


def _one(value: float | None) -> list[tuple[str, float]]:
    return [] if value is None else [("", value)]
