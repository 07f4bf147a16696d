"""Whether this replica may serve: its store answers and takes writes, and its clock agrees with the store's.

``/healthz`` is a readiness check: a replica whose every write would fail (a full disk, Redis out of memory)
or whose clock would void drain windows must leave the rotation rather than answer every caller wrongly. The
verdict is built here, over the store's write health (``tether/controlplane/store/health.py``) and the clock
watch (``services/clock.py``), so the route only renders it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.capability.errors import STORE_UNAVAILABLE

from ..clock import CLOCK_SKEWED
from ..store import STORE_UNWRITABLE, Doc, Store
from .clock import ClockService

STORE_OK, STORE_UNREACHABLE, STORE_REFUSES_WRITES = "ok", "unreachable", "unwritable"


@dataclass(frozen=True)
class Readiness:
    """What ``/healthz`` answers: ``code`` is None while ready; ``doc`` is the body without the verdict."""

    store: str  # STORE_OK, STORE_UNREACHABLE or STORE_REFUSES_WRITES
    code: str | None
    reason: str
    doc: Doc

    @property
    def ready(self) -> bool:
        return self.code is None

    def to_doc(self) -> Doc:
        if self.ready:
            return {"status": "ok", "store": self.store, **self.doc}
        return {"status": "unhealthy", "store": self.store, "code": self.code, "reason": self.reason, **self.doc}


class HealthService:
    def __init__(self, store: Store, clock_watch: ClockService, replica: str, catalog_hash: str) -> None:
        self.store, self.clock_watch, self.replica, self.catalog_hash = store, clock_watch, replica, catalog_hash

    async def readiness(self) -> Readiness:
        """The store is probed (``healthy``, then a small write when one is due); the clock's verdict is read
        as it stands (the clock watch measures on its own schedule)."""
        clock = self.clock_watch.watch.to_dict(self.clock_watch.monotonic())
        doc: Doc = {"replica": self.replica, "catalog": self.catalog_hash, "clock": clock}
        if not await self.store.healthy():
            return Readiness(STORE_UNREACHABLE, STORE_UNAVAILABLE, f"the store {self.store.url} does not answer", doc)
        status = await self.store.write_status()
        if not status.writable:
            return Readiness(STORE_REFUSES_WRITES, STORE_UNWRITABLE, status.reason, doc)
        if clock["skewed"]:
            return Readiness(STORE_OK, CLOCK_SKEWED, clock["reason"], doc)
        return Readiness(STORE_OK, None, "", doc)

    def writable(self) -> bool:
        """The store's write verdict as it stands, without probing (what ``/metrics`` shows)."""
        return self.store.write_health.writable
