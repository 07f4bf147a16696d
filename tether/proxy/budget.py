"""The sidecar's slices of its chain's call budgets (docs/contract.md section 10).

The control plane owns every budget; this sidecar leases slices of it (``tether/controlplane/budgets.py``) and
spends them locally, one unit per forwarded call of a budgeted capability, with no round trip per call.
It asks for the next slice before the current one runs out (asking for more the faster it spends, see
``tether/capability/budget.next_want``), hands back what it did not use when it stops or drains, and refunds a
unit whose call never left (refused after the spend, failed before sending). A call that finds no unit
waits for the slice being fetched; when the control plane has none to give, the call is refused 429
``tether.budget_exhausted`` (or ``tether.rate_limited``), and that verdict is remembered for a moment so a
fast agent does not turn every refused call into a request to the control plane.

Every heartbeat names the slices the sidecar holds (:meth:`Budgets.held`): its slice requests are numbered, and a
beat says the number of the last one asked and the tags of every slice it holds, is still asking for, or has
not had its settlement acknowledged. The control plane returns to the budget an open slice of this run asked for
at or before that number and not named (a replica crashed with the answer: the sidecar gave up on it and never
spends it); one asked for later, whose answer may still be on its way, is left alone (docs/architecture.md,
"Budget slices a heartbeat holds").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tether.capability import errors as codes
from tether.capability import protocol
from tether.capability.budget import next_want
from tether.capability.errors import ApiError

from .state import Refusal

if TYPE_CHECKING:
    from tether.capability.chain import VerifiedChain

    from .channel import ControlChannel
    from .state import Call

log = logging.getLogger("tether.sidecar")

PREFETCH_FRACTION = 0.25  # ask for the next slice when this share of the last one is left
HORIZON_S = 1.0  # a slice should last about this long: slices grow while they last less
REFUSAL_MEMORY_S = 0.25  # how long "no slice" answers every call before the control plane is asked again
FLUSH_INTERVAL_S = 2.0
NOT_SENT = ("refused", "failed_not_sent", "cancelled_not_sent")


@dataclass(eq=False)
class Slice:
    id: str
    tag: str  # the sidecar's name for it (the id is the control plane's: the run, then the tag)
    n: int
    window_end: float | None  # monotonic; a rate-window slice is spendable only inside its window
    spent: int = 0
    settled: bool = False


@dataclass(eq=False)
class Pool:
    """One budgeted capability's slices, oldest first."""

    capability: str
    slices: deque[Slice] = field(default_factory=deque)
    want: int = 1
    last_size: int = 0
    started_at: float = 0.0  # when the current slice was taken (monotonic)
    fetching: asyncio.Task[None] | None = None
    refusal: Refusal | None = None
    refused_until: float = 0.0

    def units(self, now: float) -> int:
        return sum(s.n - s.spent for s in self.slices if s.window_end is None or now < s.window_end)


class Budgets:
    """Every budgeted capability of one chain, and the slices held for each."""

    def __init__(self, chain: VerifiedChain | None, channel: ControlChannel | None) -> None:
        names = {cap for link in chain.links for cap in link.budgets} if chain is not None else set()
        self.pools = {name: Pool(name) for name in names}
        self.active = bool(self.pools)
        self.channel = channel
        self.by_call: dict[str, list[Slice]] = {}
        self.to_settle: list[Slice] = []
        self.settling: dict[str, Slice] = {}  # settlements sent and not acknowledged: still held
        self.asked = 0  # slice requests made (each numbered in order: a heartbeat says the last one)
        self.asking: set[str] = set()  # tags of the slice requests whose answer has not come back yet
        self.closed = False
        self.requests = 0  # slice traffic to the control plane (takes and returns), for the benchmark

    # -- the hot path -----------------------------------------------------------------------------------
    def spend(self, capabilities: list[str], call_id: str) -> Awaitable[None] | None:
        """Take one unit of each budgeted capability for a call about to be forwarded. None when taken; else
        an awaitable that waits for slices and takes them, or raises the Refusal."""
        pools = [self.pools[c] for c in capabilities if c in self.pools]
        if not pools:
            return None
        if self.closed:
            raise Refusal(codes.DRAINING, "this sidecar has returned its budget slices; no call is forwarded")
        now = time.monotonic()
        if all(self._head(p, now) is not None for p in pools):
            self._take(pools, call_id, now)
            return None
        return self._wait_and_take(pools, call_id)

    def _head(self, pool: Pool, now: float) -> Slice | None:
        while pool.slices:
            head = pool.slices[0]
            if head.spent < head.n and (head.window_end is None or now < head.window_end):
                return head
            pool.slices.popleft()  # used up, or its rate window has passed: settle what it used
            self.to_settle.append(head)
        return None

    def _take(self, pools: list[Pool], call_id: str, now: float) -> None:
        taken = []
        for pool in pools:
            head = self._head(pool, now)
            assert head is not None
            head.spent += 1
            taken.append(head)
            if pool.fetching is None and pool.units(now) <= pool.last_size * PREFETCH_FRACTION:
                pool.fetching = asyncio.get_running_loop().create_task(self._fetch(pool))
        self.by_call[call_id] = taken

    async def _wait_and_take(self, pools: list[Pool], call_id: str) -> None:
        while True:
            now = time.monotonic()
            missing = [p for p in pools if self._head(p, now) is None]
            if not missing:
                self._take(pools, call_id, now)
                return
            for pool in missing:
                if pool.refusal is not None and now < pool.refused_until:
                    raise pool.refusal
            for pool in missing:
                if pool.fetching is None:
                    pool.fetching = asyncio.get_running_loop().create_task(self._fetch(pool))
            await asyncio.gather(*(asyncio.shield(p.fetching) for p in missing if p.fetching is not None))
            if self.closed:
                raise Refusal(codes.DRAINING, "this sidecar has returned its budget slices; no call is forwarded")

    # -- the control plane --------------------------------------------------------------------------------
    async def _fetch(self, pool: Pool) -> None:
        tag = os.urandom(8).hex()
        batch: list[Slice] = []
        accounted = False  # the batch of settlements acknowledged or put back
        try:
            now = time.monotonic()
            if pool.last_size:
                pool.want = next_want(pool.want, now - pool.started_at, HORIZON_S)
            self.asked += 1  # numbered and named as asked in one step: a beat built from here on lists it
            self.asking.add(tag)
            batch = self._settlements()
            ask = protocol.SliceRequest(pool.capability, pool.want, tag, self.asked, self._items(batch))
            sent = time.monotonic()  # a window's end is counted from here: never later than the control plane's
            try:
                self.requests += 1
                answer = read_answer(protocol.SliceLease, await self.channel.call(
                    "POST", protocol.SLICES, ask.to_doc(), timeout=5.0))
            except ApiError as exc:
                accounted = True
                self._unanswered(batch, exc)
                self._refused(pool, Refusal(codes.BUDGET_EXHAUSTED, f"no slice of {pool.capability}'s budget "
                                            f"could be leased: {exc.message}", reason="slice_unavailable"))
                return
            accounted = True
            self._acknowledged(batch)
            if not answer.calls or answer.slice is None:
                error = answer.error or protocol.SliceRefusal(codes.BUDGET_EXHAUSTED)
                code = error.code if error.code in (codes.RATE_LIMITED, codes.BUDGET_EXHAUSTED) \
                    else codes.BUDGET_EXHAUSTED
                refusal = Refusal(code, error.message or f"{pool.capability}: budget spent", jti=error.jti)
                wait = (error.retry_after_s or 0.0) if code == codes.RATE_LIMITED else 0.0
                self._refused(pool, refusal, max(REFUSAL_MEMORY_S, min(wait, 5.0)))
                return
            now = time.monotonic()
            ends = answer.window_ends_in
            pool.slices.append(Slice(answer.slice, tag, answer.calls, None if ends is None else sent + ends))
            pool.last_size, pool.started_at, pool.refusal = answer.calls, now, None
        finally:
            self.asking.discard(tag)  # held now, or given up on: an answer after this is never spent
            if not accounted:  # cancelled on its way: sent again with the next one
                self._unanswered(batch, None)
            pool.fetching = None

    def _refused(self, pool: Pool, refusal: Refusal, memory: float = REFUSAL_MEMORY_S) -> None:
        pool.refusal = refusal
        pool.refused_until = time.monotonic() + memory
        pool.want = 1  # what is left is little: come back small

    def _settlements(self) -> list[Slice]:
        """The slices to settle now. Their use is final from here (a unit refunded later stays spent), and
        each stays held (named in every heartbeat) until the control plane acknowledges its settlement: one
        the control plane thought unheld would be returned whole, its used calls with it."""
        batch = list(self.to_settle)
        self.to_settle.clear()
        for s in batch:
            s.settled = True
            self.settling[s.id] = s
        return batch

    @staticmethod
    def _items(batch: list[Slice]) -> list[protocol.Settlement]:
        return [protocol.Settlement(s.id, s.spent) for s in batch]

    def _acknowledged(self, batch: list[Slice]) -> None:
        for s in batch:
            self.settling.pop(s.id, None)

    def _unanswered(self, batch: list[Slice], exc: ApiError | None) -> None:
        """A settlement whose answer did not come: sent again with the next one (settling is idempotent, a
        slice is settled once). One the control plane refused (4xx) is not sent again; it stays held, so it
        is counted spent when the run stops (fail closed), never returned whole."""
        retry = exc is None or exc.http_status >= 500
        for s in batch:
            if s.id in self.settling and retry and s not in self.to_settle:
                self.to_settle.append(s)

    def held(self) -> dict[str, Any] | None:
        """What the next heartbeat says this sidecar holds (``Heartbeat.budget_slices``): the number of its
        last slice request and the tags of every slice it may still spend or settle. Built in one step of
        the event loop, so no slice is between two of these sets while it is read."""
        if not self.active:
            return None
        tags = set(self.asking)
        tags.update(s.tag for pool in self.pools.values() for s in pool.slices)
        tags.update(s.tag for s in self.to_settle)
        tags.update(s.tag for s in self.settling.values())
        return {"asked": self.asked, "held": sorted(tags)}

    def on_resolved(self, call: Call) -> None:
        """A unit whose call never left goes back to its slice (or, settled already, stays spent)."""
        taken = self.by_call.pop(call.call_id, None)
        if taken is not None and call.resolution in NOT_SENT:
            for s in taken:
                if not s.settled and s.spent > 0:
                    s.spent -= 1

    async def flush(self) -> None:
        """Settle used-up slices and those whose window passed (also piggybacked on the next take)."""
        now = time.monotonic()
        for pool in self.pools.values():
            self._head(pool, now)
        await self._settle(self._settlements())

    async def release(self) -> None:
        """Stop spending and hand every slice back with what it used (stop, drain, abort)."""
        if not self.active:
            return
        self.closed = True
        for pool in self.pools.values():
            if pool.fetching is not None:
                with contextlib.suppress(BaseException):
                    await pool.fetching
            self.to_settle.extend(pool.slices)
            pool.slices.clear()
        batch = self._settlements()
        answer = await self._settle(batch)
        if answer is not None:
            returned = sum(s.returned for s in answer.settled)
            log.info("returned %d unused call(s) of %d budget slice(s)", returned, len(batch))

    async def _settle(self, batch: list[Slice]) -> protocol.SlicesSettled | None:
        """Send a batch of settlements; the answer, or None when there was nothing to send."""
        if not batch:
            return None
        self.requests += 1
        try:
            answer = read_answer(protocol.SlicesSettled, await self.channel.call(
                "POST", protocol.SLICES_RETURN, protocol.SliceReturn(self._items(batch)).to_doc(), timeout=5.0))
        except ApiError as exc:
            self._unanswered(batch, exc)
            raise
        except BaseException:
            self._unanswered(batch, None)
            raise
        self._acknowledged(batch)
        return answer

    async def run(self) -> None:
        if not self.active:
            return
        while not self.closed:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            try:
                await self.flush()
            except ApiError as exc:
                log.info("could not settle budget slices yet: %s", exc.message)


def read_answer[M: protocol.Message](message: type[M], doc: Any) -> M:
    """The control plane's answer as its message. One that cannot be read counts as no answer (503, as an
    unreachable control plane): no slice is spent from it (its tag is given up on, so the sweep returns it), and
    the settlements it carried are sent again (settling is idempotent)."""
    try:
        return message.read(doc)
    except ApiError as exc:
        raise ApiError(503, codes.CONTROLPLANE_UNREACHABLE, f"{message.WHAT} from the control plane: {exc.message}") \
            from None
