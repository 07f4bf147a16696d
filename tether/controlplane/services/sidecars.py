"""Sidecar runs: each run's lease, renewed by heartbeat, with its state and calls in flight; and the final
states a run reaches by what it said itself (``runs.py`` says what they mean).
"""

from __future__ import annotations

from collections.abc import Callable

from tether.capability.protocol import SERVING, Heartbeat, Lease

from .. import runs
from ..auth import Caller
from ..metrics import Metrics, revocations_acknowledged
from ..store import Doc, Store
from . import kinds
from .grants import chain_jtis

MAX_INFLIGHT = 10_000  # calls in flight a run's document keeps


class SidecarService:
    def __init__(self, store: Store, metrics: Metrics, clock: Callable[[], float], lease_ttl_s: float,
                 replica: str, handed_out: Callable[[Doc | None], Doc | None] = lambda command: command) -> None:
        self.store = store
        self.metrics = metrics
        self.clock = clock
        self.lease_ttl_s = lease_ttl_s
        self.replica = replica
        self.handed_out = handed_out  # a stored command as handed to the sidecar now (its window left)

    async def heartbeat(self, caller: Caller, beat: Heartbeat) -> Lease:
        """Renew a run's lease. The in-flight list and state belong to this run alone: a second run (a
        restart, a respawn under a new link) has its own document and never overwrites this one."""
        now = self.clock()
        run = str(caller.run)
        previous = await self.store.get_sidecar(run) or {}  # bound to this link by run_of
        doc = {**previous, "run_id": run, "agent": caller.agent, "link": caller.link_hash, "last_seen": now,
               "lease_expires": now + self.lease_ttl_s, "state": beat.state or SERVING,
               "inflight": beat.inflight[:MAX_INFLIGHT], "seq": beat.seq, "proxy": beat.proxy or None,
               "pid": beat.pid, "started_at": beat.started_at, "spooled": beat.spooled,
               "replica": self.replica, "budget_slices": beat.budget_slices}  # the sweep reads it (budgets.py)
        doc["revocations_acknowledged"] = await revocations_acknowledged(self.store, self.metrics, doc,
                                                                         beat.revocations_held, now)
        if doc["state"] == runs.STOPPED and not previous.get("final"):
            doc.update(final=runs.STOPPED, final_at=now)  # the goodbye: its reports are in, nothing passes
        await self.store.put_sidecar(run, doc)
        supersedes = beat.supersedes
        if supersedes is not None and supersedes != run:
            await self._supersede(caller, supersedes, now)
        self.metrics.inc("tether_heartbeats_total")
        return Lease(
            lease_ttl_s=self.lease_ttl_s, lease_expires_at=doc["lease_expires"], now=now, run_id=run,
            command=self.handed_out(await self.store.get_doc(kinds.COMMAND, caller.link_hash)),
            # Belt and braces: a revocation whose event was lost still reaches the sidecar here.
            revoked=sorted(await self.store.revoked_among(chain_jtis(caller.link))))

    async def _supersede(self, caller: Caller, old_run: str, now: float) -> None:
        """A sidecar restarted on the same state dir (whose lock proves the old process is gone) took over
        its predecessor's spool: the old run answers through the new one from now on."""
        old = await self.store.get_sidecar(old_run)
        if old is None or old.get("link") != caller.link_hash or old.get("final"):
            return
        await self.store.put_sidecar(old_run, {**old, "final": runs.SUPERSEDED, "final_at": now,
                                               "superseded_by": caller.run})

    async def runs(self) -> dict[str, Doc]:
        """Every run's document, by run id (the fleet gauges of ``/metrics``)."""
        return await self.store.all_sidecars()

    async def mark_final(self, caller: Caller, state: str) -> None:
        run = str(caller.run)
        doc = await self.store.get_sidecar(run) or {"run_id": run, "agent": caller.agent, "link": caller.link_hash}
        if doc.get("final") != state:
            await self.store.put_sidecar(run, {**doc, "final": state, "final_at": self.clock(), "state": state})
