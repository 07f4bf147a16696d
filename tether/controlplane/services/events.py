"""The event log a replica publishes to and its sidecars read: revocations, commands, approval decisions.

Publishing appends to the store and wakes this replica's waiters (other replicas are woken by the store:
Redis pub/sub). Readers are the long poll (``poll``), the resync document a sidecar gets when its
sequence number is out of the log's range (``resync``), and the streaming fan-out (``hub``:
``event_stream.EventHub``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tether.capability import protocol
from tether.capability.events import PENDING

from ..event_stream import EventHub, visible
from ..metrics import Metrics
from ..store import Doc, Event, Store
from . import kinds

BATCH = 500  # events read from the store at a time


class EventService:
    def __init__(self, store: Store, metrics: Metrics, clock: Callable[[], float],
                 handed_out: Callable[[Doc | None], Doc | None] = lambda command: command) -> None:
        self.store = store
        self.handed_out = handed_out  # a stored command as handed to the sidecar now (its window left)
        self.metrics = metrics
        self.clock = clock
        self._signal = asyncio.Event()
        self._reads: dict[int, asyncio.Future[list[Event]]] = {}
        self.hub = EventHub(store, lambda: self._signal, self.wait, metrics.inc)

    async def publish(self, kind: str, target: str | None, payload: Doc) -> int:
        seq = await self.store.append_event(kind, target, payload, self.clock())
        self.metrics.inc(f'tether_events_published_total{{kind="{kind}"}}')
        self.notify()
        return seq

    def notify(self) -> None:
        signal, self._signal = self._signal, asyncio.Event()
        signal.set()

    async def wait(self, after: int, timeout: float, signal: asyncio.Event | None = None) -> None:
        """Until a publish here, an append anywhere (the store's own wait), or the timeout."""
        signal = signal or self._signal
        waiters = [asyncio.ensure_future(signal.wait()), asyncio.ensure_future(self.store.wait_events(after, timeout))]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    async def after(self, after: int) -> list[Event]:
        """One store read shared by every long poll waiting at the same sequence (a revocation wakes them
        all at once; without this each would read the same event again)."""
        shared = self._reads.get(after)
        if shared is None:
            shared = asyncio.ensure_future(self.store.events_after(after, BATCH))
            self._reads[after] = shared
            shared.add_done_callback(lambda _f, key=after: self._reads.pop(key, None))
        return await asyncio.shield(shared)

    async def bounds(self) -> tuple[int, int]:
        """The lowest and highest sequence numbers the log holds (a stream's opening, ``/metrics``)."""
        return await self.store.event_bounds()

    def out_of_range(self, after: int, low: int, high: int) -> bool:
        """A sequence the log cannot resume from (none yet, pruned, or from the future): resync in full."""
        return after < 0 or after < low - 1 or after > high

    async def poll(self, link_hash: str, chain_jtis: set[str], after: int, wait: float) -> protocol.Events:
        """The long poll: the events this link may see after ``after``, waiting up to ``wait`` seconds for one."""
        low, high = await self.bounds()
        if self.out_of_range(after, low, high):
            return await self.resync(link_hash, chain_jtis, high)
        deadline = self.clock() + wait
        while True:
            signal = self._signal  # taken before reading, so a publish meanwhile still wakes us
            events = await self.after(after)
            seen = [e.to_dict() for e in events if visible(e, link_hash, chain_jtis)]
            if events:
                after = events[-1].seq
            remaining = deadline - self.clock()
            if seen or remaining <= 0 or len(events) == BATCH:
                self.metrics.inc("tether_events_delivered_total", len(seen))
                return protocol.Events(events=seen, next=after)
            await self.wait(after, remaining, signal)

    async def catch_up(self, link_hash: str, jtis: frozenset[str], after: int, position: int) -> tuple[list[Doc], int]:
        """What a stream's client missed between ``after`` and the fan-out's ``position``, read for it alone."""
        caught: list[Doc] = []
        sent = after
        while sent < position:
            events = [e for e in await self.store.events_after(sent, BATCH) if e.seq <= position]
            if not events:
                break
            caught += [e.to_dict() for e in events if visible(e, link_hash, jtis)]
            sent = events[-1].seq
        self.metrics.inc("tether_events_delivered_total", len(caught))
        return caught, max(sent, position, after)

    async def resync(self, link_hash: str, chain_jtis: set[str], high: int) -> protocol.Events:
        """Everything a sidecar must know when it cannot resume: its chain's revocations, its link's
        command, its link's decided approvals."""
        revocations = await self.store.revocations()
        command = self.handed_out(await self.store.get_doc(kinds.COMMAND, link_hash))
        approvals = [a for a in await self.store.list_docs(kinds.APPROVAL)
                     if a.get("link") == link_hash and a["status"] != PENDING]
        self.metrics.inc("tether_event_resyncs_total")
        return protocol.Events(events=[], next=high, resync=True, revoked=sorted(chain_jtis & set(revocations)),
                               command=command, approvals=approvals)
