"""This replica's clock against the deployment's reference clock, and the rule that follows from it.

Replicas over one Redis compare each other's times: a termination lease taken on one clock is judged
expired on another, a deadline fixed by one is reached by another. So each replica measures its offset
against the store's clock (Redis ``TIME``, read between two readings of its own clock: the store's time
fell inside that round trip, so the offset is known to within half of it) and, while the offset is past
``SKEW_BOUND_S`` (or unmeasured), refuses what would put its clock into another replica's decisions: it
takes no termination lease and fixes no deadline (``tether.clock_skewed``), and ``/healthz`` answers 503 so
a readiness probe takes it out of rotation. The embedded SQLite store has one replica: its clock is the
reference, its offset is 0 by definition and never refuses anything.

Sidecars' proofs are judged on the store's clock (this one corrected by the measured offset), so a skewed
replica neither refuses fresh proofs as signed ahead nor keeps stale ones fresh. They carry their signing
time (``iat``): the age of each accepted proof at arrival is this replica's clock against that sidecar's,
plus the transit. Their median over the sidecar runs heard from
lately is reported beside the store's figure (and logged when it crosses the bound) but decides nothing: a
node of sidecars with a bad clock must not stop the control plane from terminating anything.

Pure: the caller passes every time in (local wall-clock readings, and ``at``, a monotonic reading that
dates the samples so a stepped wall clock does not age them).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from tether.capability.errors import CLOCK_SKEWED  # noqa: F401  (every code is in tether/capability/errors.py; kept importable here)

SKEW_BOUND_S = 2.0  # past this offset from the store's clock a replica takes no lease and fixes no deadline
MEASURE_INTERVAL_S = 2.0  # how often a replica reads the store's clock
STALE_AFTER_S = 30.0  # a measurement older than this no longer vouches for the clock
SAMPLES_KEPT = 8  # the latest few measurements (the newest decides)
SIDECAR_RUNS_KEPT = 1024
SIDECAR_HORIZON_S = 300.0  # sidecar runs heard from within this long count in their median
SIDECAR_QUORUM = 3  # runs needed before the sidecars' median is logged as disagreeing


@dataclass(frozen=True)
class Sample:
    offset_s: float  # this replica's clock minus the reference's: positive when this one runs ahead
    uncertainty_s: float  # half the round trip: the reference's reading fell somewhere inside it
    at: float  # monotonic


@dataclass(frozen=True)
class Verdict:
    skewed: bool
    offset_s: float | None
    uncertainty_s: float | None
    reason: str  # empty when not skewed


class ClockWatch:
    """The latest measurements, the verdict on them, and whether the verdict just changed (to log it once)."""

    def __init__(self, reference: str, bound_s: float = SKEW_BOUND_S) -> None:
        self.reference = reference  # "redis" (a store with a clock of its own) or "local" (the store is this replica)
        self.bound_s = bound_s
        self._samples: deque[Sample] = deque(maxlen=SAMPLES_KEPT)
        self._sidecars: OrderedDict[str, tuple[float, float]] = OrderedDict()  # run -> (offset, at)
        self._was_skewed: bool | None = None
        self._sidecars_disagreed = False

    @property
    def local(self) -> bool:
        return self.reference == "local"

    def measured(self, sent: float, reference: float, received: float, at: float) -> Sample:
        """One round trip: this clock read ``sent`` before asking and ``received`` after the answer, which
        said ``reference``."""
        sample = Sample((sent + received) / 2 - reference, max(0.0, received - sent) / 2, at)
        self._samples.append(sample)
        return sample

    def best(self, at: float) -> Sample | None:
        """The newest measurement (so a stepped clock shows at the next one), unless it is stale."""
        return self._samples[-1] if self._samples and at - self._samples[-1].at <= STALE_AFTER_S else None

    def verdict(self, at: float) -> Verdict:
        """Skewed unless the newest measurement puts the offset within the bound, its uncertainty included:
        a round trip too slow to tell (or one the clock was stepped during) fails closed until the next."""
        if self.local:
            return Verdict(False, 0.0, 0.0, "")
        sample = self.best(at)
        if sample is None:
            return Verdict(True, None, None, f"this replica's clock has not been compared with the {self.reference} "
                           f"store's in the last {STALE_AFTER_S:.0f}s")
        offset, uncertainty = sample.offset_s, sample.uncertainty_s
        if abs(offset) - uncertainty > self.bound_s:
            ahead = "ahead of" if offset > 0 else "behind"
            return Verdict(True, offset, uncertainty,
                           f"this replica's clock is {abs(offset):.1f}s {ahead} the {self.reference} "
                           f"store's (bound {self.bound_s:g}s): fix its time sync (NTP)")
        if abs(offset) + uncertainty > self.bound_s:
            return Verdict(True, offset, uncertainty,
                           f"this replica's clock cannot be told within {self.bound_s:g}s of the {self.reference} "
                           f"store's (offset {offset:+.1f}s, round trip {2 * uncertainty:.1f}s)")
        return Verdict(False, offset, uncertainty, "")

    def changed(self, at: float) -> Verdict | None:
        """The verdict, when it differs from the one this was last asked about (None otherwise)."""
        verdict = self.verdict(at)
        if verdict.skewed == self._was_skewed:
            return None
        self._was_skewed = verdict.skewed
        return verdict

    # -- sidecars' proofs -------------------------------------------------------------------------------
    def proof_seen(self, run: str, now: float, iat: float, at: float) -> bool:
        """A verified proof signed at ``iat`` arrived at ``now``; True when the sidecars' median just crossed
        the bound (either way), so the caller logs it once."""
        self._sidecars[run] = (now - iat, at)
        self._sidecars.move_to_end(run)
        while len(self._sidecars) > SIDECAR_RUNS_KEPT:
            self._sidecars.popitem(last=False)
        median, runs = self.sidecar_offset(at)
        disagree = median is not None and runs >= SIDECAR_QUORUM and abs(median) > self.bound_s
        crossed, self._sidecars_disagreed = disagree != self._sidecars_disagreed, disagree
        return crossed

    def sidecar_offset(self, at: float) -> tuple[float | None, int]:
        """The median, over sidecar runs heard from lately, of this clock minus theirs (transit included),
        and how many runs it is over."""
        recent = [offset for offset, seen in self._sidecars.values() if at - seen <= SIDECAR_HORIZON_S]
        return (statistics.median(recent) if recent else None), len(recent)

    def to_dict(self, at: float) -> dict[str, Any]:
        verdict = self.verdict(at)
        median, runs = self.sidecar_offset(at)
        doc: dict[str, Any] = {
            "reference": self.reference, "bound_s": self.bound_s, "skewed": verdict.skewed,
            "offset_s": _round(verdict.offset_s), "uncertainty_s": _round(verdict.uncertainty_s),
            "sidecars": {"offset_s": _round(median), "runs": runs},
        }
        if verdict.reason:
            doc["reason"] = verdict.reason
        return doc


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
