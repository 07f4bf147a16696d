"""The shared store: one Redis that several control plane replicas use at once (``redis://HOST:PORT/DB``).

Every multi-key write is one Lua script, so it is atomic against every replica: a link and its jti index,
an event and its sequence number, a CAS on a document, a record and the chain head, a lease. Reads that
need two keys at once run in MULTI. Keys live under ``tether:<db>:`` (pub/sub channels are not per
database, so the database number is part of the names).

The event log is a sorted set scored by a sequence from INCR; the script that appends also trims it to the
last ``EVENT_RETENTION`` events and PUBLISHes the new sequence. The publication is only a wake-up for
long polls on every replica (pub/sub is not durable); what a sidecar receives is always read back from the
sorted set by sequence, and because sequence and entry are written in one script, no reader ever sees
seq N+1 without N.

A record is a header in the chain's list and a list of its call entries of its own, staged before the
header is appended; an index of the log (who holds each call) is filled oldest record first (see
"records" in ``redis_core.py``). No command's cost grows with a record: every read and write of one is a page.

Leases are decided on the ``now`` the caller passes, exactly like SQLite, so both stores agree under a
test clock; the Redis key also carries a real-time expiry one minute past the lease, only so that leases
of dead replicas do not pile up. Replicas must therefore have synchronised clocks (NTP): each compares its
clock with Redis ``TIME`` (``reference_time``) and takes no lease while it is off by more than the bound
(``tether/controlplane/clock.py``).

Availability: ``open()`` does not fail when Redis is unreachable. A replica may start before Redis
(compose, Kubernetes); until Redis answers, every store call raises ``StoreUnavailable`` (the API answers
503 ``tether.store_unavailable``), ``healthy()`` is False (``/healthz`` answers 503), and the wake-up
listener keeps reconnecting. A malformed URL still fails at once. A command is retried once after a
connection error (a pooled connection is stale after a Redis restart); a write whose reply was lost may
then run twice, which every caller tolerates: links, revocations and reports are idempotent, and a CAS or
record append that finds its own earlier write answers False, so the caller re-reads.

A Redis that answers but refuses writes (OOM under ``noeviction``, MISCONF after a failed save, NOREPLICAS,
a read-only replica) raises ``StoreUnwritable``: the API answers 503 ``tether.store_unwritable`` and
``/healthz`` says so (``tether/controlplane/store/health.py``). Redis refuses a script at its first write, so a
refused script has written nothing.
"""


from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from .base import Doc, Event, StagedPage
from .redis_budgets import RedisBudgets
from .redis_core import (
    _UNAVAILABLE,
    _dump,
    _guarded,
    _Staging,
    _writes,
    log,
)
from .redis_core import COMMAND_TIMEOUT_S as COMMAND_TIMEOUT_S
from .redis_core import CONNECT_TIMEOUT_S as CONNECT_TIMEOUT_S
from .redis_core import LEASE_GC_SLACK_MS as LEASE_GC_SLACK_MS
from .redis_core import POOL_SIZE as POOL_SIZE
from .redis_core import STAGED_TTL_MS as STAGED_TTL_MS
from .redis_core import _write_refusal as _write_refusal
from .redis_docs import RedisDocs
from .redis_links import RedisLinks
from .redis_records import RedisRecords
from .redis_reports import RedisReports
from .redis_segments import RedisSegments

EVENT_RETENTION = 10_000
STAGE_PART = 1000  # call ids per script: Redis, and every replica's requests, wait for 1,000 calls' staging at most


class RedisStore(RedisLinks, RedisReports, RedisRecords, RedisSegments, RedisDocs, RedisBudgets):
    """The shared store, composed of one mixin per concern. The event log and report staging stay here, beside
    ``EVENT_RETENTION`` and ``STAGE_PART`` (tests set them on this module)."""

    # -- events ----------------------------------------------------------------------------------------
    @_guarded
    @_writes
    async def append_event(self, kind: str, target: str | None, payload: Doc, at: float) -> int:
        entry = _dump({"kind": kind, "target": target, "payload": payload, "at": at})
        return await self._run(
            "append_event", [self._key("events"), self._key("events", "seq")], [entry, EVENT_RETENTION, self.channel]
        )

    @_guarded
    async def events_after(self, seq: int, limit: int = 500) -> list[Event]:
        members = await self.r.zrangebyscore(self._key("events"), f"({seq}", "+inf", start=0, num=limit)
        events: list[Event] = []
        for member in members:
            number, _, body = member.partition(":")
            doc = json.loads(body)
            events.append(Event(int(number), doc["kind"], doc["target"], doc["payload"], doc["at"]))
        return events

    @_guarded
    async def event_bounds(self) -> tuple[int, int]:
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.get(self._key("events", "seq"))
            pipe.zrange(self._key("events"), 0, 0, withscores=True)
            last_raw, oldest = await pipe.execute()
        last = int(last_raw or 0)
        if not oldest:
            return (last + 1, last)  # never used: (1, 0); trimmed to nothing: (last + 1, last), as in SQLite
        return (int(oldest[0][1]), last)

    async def wait_events(self, after: int, timeout: float) -> None:
        """Return at once if the log is already past ``after`` (closing the gap between the caller's read and
        its wait), else on the next append by any replica, or after ``timeout``."""
        waiter = self._wake
        if await self._head() > after:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiter.wait(), timeout)

    @_guarded
    async def _head(self) -> int:
        return int(await self.r.get(self._key("events", "seq")) or 0)

    def _wake_all(self) -> None:
        waiter, self._wake = self._wake, asyncio.Event()
        waiter.set()

    async def _listen(self) -> None:
        """Hold one subscription per replica and wake every local waiter on each append anywhere."""
        attempt = 0
        while True:
            pubsub = self.r.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                if attempt:
                    log.info("Redis at %s is reachable again; event wake-ups resume", self.url)
                attempt = 0
                self._wake_all()  # appends made while we were not subscribed: let waiters re-read
                while True:
                    if await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0) is not None:
                        self._wake_all()
            except _UNAVAILABLE as exc:
                attempt += 1
                if attempt == 1:
                    log.warning("event wake-ups from Redis at %s interrupted: %s", self.url, exc)
                self._wake_all()  # waiters re-read and find the store down
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(min(2.0, 0.05 * 2**attempt))

    async def stage_reports(self, record_id: str, start: int, agents: list[str], links: set[str],
                            page: int = 5000) -> AsyncIterator[StagedPage]:
        """Per part of a page, one script that stages the calls inside Redis (``_STAGE_BODY``: references to the
        entry texts kept beside the reports) and answers with those texts, to be hashed. One agent: the script
        reads the ids from the agent's index by start itself (``_STAGE_NEXT``), so only the texts cross the
        wire; several: ids in the record's order (``_ordered_ids``), merged here. Nothing is decoded or encoded
        here, but the entries of reports stored before entries were kept."""
        await self._index_records()
        keys = [self._key("reports", "link"), self._key("records", "owner"), self._key("records", "unknown"),
                self._calls_key(record_id), self._ids_key(record_id), self._key("reports", "entry")]
        head = [STAGED_TTL_MS, len(links), *sorted(links)]
        pages = (self._stage_one(agents[0], keys, head, page) if len(set(agents)) == 1
                 else self._stage_merged(agents, keys, head, page))
        async for staged in pages:
            yield staged

    async def _stage_one(self, agent: str, keys: list[str], head: list[Any], page: int) -> AsyncIterator[StagedPage]:
        """``stage_reports`` of one agent: pages of ``page`` reports read, each read and staged inside Redis
        ``STAGE_PART`` at a time from after the last id read."""
        await self._index_starts(agent)
        await self._loosen(agent)
        keys = [*keys, self._key("reports", "loose", agent), self._key("reports", "started", agent)]
        after = ""
        while True:
            out = _Staging()
            done = False
            while out.read < page and not done:
                want = min(STAGE_PART, page - out.read)
                reply = await self._staged("stage_next", keys, [*head, after, want])
                out.add(reply)
                read = int(reply[5])
                out.read += read
                after = reply[4] or after
                done = read < want
            if out.read:
                yield out.page()
            if done:
                return

    async def _stage_merged(self, agents: list[str], keys: list[str], head: list[Any],
                            page: int) -> AsyncIterator[StagedPage]:
        """``stage_reports`` of several agents: ids merged in the record's order here (``_ordered_ids``)."""
        for agent in agents:
            await self._loosen(agent)
        async for ids in self._ordered_ids(agents, page, "loose"):
            out = _Staging()
            for at in range(0, len(ids), STAGE_PART):
                out.add(await self._staged("stage_reports", keys, [*head, *ids[at:at + STAGE_PART]]))
            yield out.page()

    async def _staged(self, script: str, keys: list[str], args: list[Any]) -> list[Any]:
        """One staging script's reply; reports stored before entries were kept get theirs first (once)."""
        reply = await self._stage_part(script, keys, args)
        if int(reply[0]) == 0:
            await self._keep_entries(reply[1])
            reply = await self._stage_part(script, keys, args)
            if int(reply[0]) == 0:
                raise ValueError(f"no report for {len(reply[1])} calls of the index")
        return reply

    @_guarded
    @_writes
    async def _stage_part(self, script: str, keys: list[str], args: list[Any]) -> list[Any]:
        return list(await self._scripts[script](keys=keys, args=args))
