"""Sealing: while agents run, their finished reports are sealed into chained, signed segments (record form 2).

A record then names each chain of its links instead of listing the calls the chain holds, so writing it costs
what the calls not sealed cost, whatever the number sealed (docs/termination.md, "Sealed segments"). A report
is sealed once it is ``settle_s`` old (by its start), so the calls of an agent still running settle first: a
report arriving later that sorts before the chain's last call is never sealed (its record lists it). A chain
is sealed only in pieces of at least ``min_calls`` (a small agent's record is small anyway), at most
``max_calls`` each. Every append is a compare-and-set on the chain's head, and refused once a record closed
the chain, so replicas sealing at once, or a record appended meanwhile, lose nothing and seal nothing twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from .. import segments as seg
from .. import termination as proto
from ..store import Doc, Store, StoreUnavailable

log = logging.getLogger("tether.segments")

SETTLE_S = 30.0
MIN_CALLS = 1000
MAX_CALLS = 10_000
INTERVAL_S = 2.0


class SegmentService:
    def __init__(self, store: Store, signing_key: Any, clock: Callable[[], float], *, settle_s: float = SETTLE_S,
                 min_calls: int = MIN_CALLS, max_calls: int = MAX_CALLS, interval_s: float = INTERVAL_S) -> None:
        self.store = store
        self.signing_key = signing_key
        self.clock = clock
        self.settle_s, self.min_calls, self.max_calls, self.interval_s = settle_s, min_calls, max_calls, interval_s
        self.sealed = 0  # calls sealed by this replica (a figure for tests and the log)

    async def run(self) -> None:
        if not self.store.seals or self.min_calls <= 0:
            return  # a store without segments, or sealing turned off (--seal-min 0): records as before
        while True:
            try:
                await self.seal_once()
            except (StoreUnavailable, ConnectionError, OSError) as exc:
                log.warning("sealing segments: %s", exc)
            await asyncio.sleep(self.interval_s)

    async def seal_once(self) -> int:
        """One pass over every open chain with enough reports waiting: returns how many calls it sealed."""
        from ..rotation import key_in_force

        chains = await self.store.sealable_links(self.min_calls)
        if not chains:
            return 0
        # As the record writer: a replica still on the old key after ``tether keys rotate`` signs nothing (a
        # segment under a retired key would be named by the next record and accepted as "a key of the log").
        if not key_in_force((await self.store.log_view("", [])).head, self.signing_key.public_key()):
            log.warning("sealing segments: this replica's key is not the one in force at the log's head; not sealing")
            return 0
        n = 0
        for chain in chains:
            n += await self.seal_chain(chain)
        return n

    async def seal_chain(self, chain: Doc) -> int:
        """Seal what the chain has ready, a segment at a time; stops at the first append refused (the chain
        moved, or a record closed it)."""
        n = 0
        key_id = proto.key_id_of(self.signing_key)
        while chain.get("closed_by") is None:
            calls = await self.store.seal_candidates(chain, self.clock() - self.settle_s, self.max_calls)
            if not calls or len(calls) < self.min_calls:
                break
            header = seg.segment_header(agent=chain["agent"], link=chain["link"], seq=chain["seq"] + 1,
                                        prev=chain["head"], keys_of_calls=[(s, c) for s, c, _ in calls],
                                        sealed_at=self.clock(), key_id=key_id)
            segment = await asyncio.to_thread(seg.sign_segment, header, [t for _, _, t in calls], self.signing_key)
            if not await self.store.append_segment(segment, calls):
                break
            n += len(calls)
            self.sealed += len(calls)
            chain = (await self.store.chains([chain["link"]]))[chain["link"]]
        if n:
            log.info("sealed %d call(s) of %s into its chain (head %d)", n, chain["agent"], chain["seq"])
        return n
