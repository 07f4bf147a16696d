"""The Redis store's call reports and call starts.

A mixin of ``RedisStore`` (``tether/controlplane/store/redis.py``); moved out of it unchanged.
"""

from __future__ import annotations

import asyncio

from ..termination import entry_text
from .base import Doc, Stored
from .redis_core import (
    RedisCore,
    _Cursor,
    _dump,
    _guarded,
    _start_field,
    _writes,
)


class RedisReports(RedisCore):
    """Call reports, call starts and their per-agent indexes."""

    # -- reports ---------------------------------------------------------------------------------------
    @_guarded
    @_writes
    async def put_reports(self, reports: list[Doc]) -> Stored:
        if not reports:
            return Stored(set(), 0)
        keys = [self._key("reports"), self._key("reports", "order"), self._key("reports", "n"),
                self._key("reports", "entry"), self._key("reports", "link"), self._key("chains", "loose"),
                self._key("chains", "agent"), self._key("reports", "loosed"),
                self._key("chains", "closed")]
        args: list[str] = []
        for report in reports:
            keys += [self._key("reports", "agent", report["agent"]), self._key("reports", "started", report["agent"]),
                     self._key("reports", "loose", report["agent"])]
            args += [report["call_id"], _dump(report), repr(float(report.get("started_at") or 0)),
                     entry_text(report), report.get("link") or "-", report["agent"]]
        new = {str(i) for i in await self._scripts["put_reports"](keys=keys, args=args)}  # decoded: str
        by_agent: dict[str, list[str]] = {}
        for report in reports:
            by_agent.setdefault(report["agent"], []).append(_start_field(report))
        async with self.r.pipeline(transaction=False) as pipe:  # the reporting agents' own starts are moot now
            pipe.hdel(self._key("starts"), *[f for fields in by_agent.values() for f in fields])
            for agent, fields in by_agent.items():  # one command per agent, not one per report
                pipe.srem(self._key("starts", "agent", agent), *fields)
            await pipe.execute()
        return Stored(new, len(reports))

    @_guarded
    @_writes
    async def put_starts(self, starts: list[Doc]) -> None:
        if not starts:
            return
        async with self.r.pipeline(transaction=False) as pipe:
            for start in starts:
                pipe.hexists(self._key("reports"), start["call_id"])
            ended = await pipe.execute()
        async with self.r.pipeline(transaction=False) as pipe:
            for start, done in zip(starts, ended, strict=True):
                if not done:
                    pipe.hsetnx(self._key("starts"), _start_field(start), _dump(start))
                    pipe.sadd(self._key("starts", "agent", start["agent"]), _start_field(start))
            await pipe.execute()

    @_guarded
    async def starts(self, agents: list[str]) -> list[Doc]:
        async with self.r.pipeline(transaction=False) as pipe:
            for agent in agents:
                pipe.smembers(self._key("starts", "agent", agent))
            call_ids = sorted({c for members in await pipe.execute() for c in members})
        return await self._hmget(self._key("starts"), call_ids)

    @_guarded
    async def reports(self, agents: list[str] | None = None) -> list[Doc]:
        if agents is None:
            call_ids = [c for c, _ in await self._zpages(self._key("reports", "order"))]
        else:
            ranked: list[tuple[float, str]] = []
            for agent in agents:
                ranked += [(score, c) for c, score in await self._zpages(self._key("reports", "agent", agent))]
            call_ids = [call_id for _, call_id in sorted(ranked)]
        return await self._hmget(self._key("reports"), call_ids)

    @_guarded
    async def _texts(self, call_ids: list[str]) -> list[str]:
        """The entry texts kept beside these calls' reports, in order."""
        texts: list[str] = []
        for at in range(0, len(call_ids), 5000):
            part = await self.r.hmget(self._key("reports", "entry"), call_ids[at:at + 5000])
            if not all(part):
                raise ValueError("a staged call has no entry text kept beside its report")
            texts += part
        return texts

    @_guarded
    @_writes
    async def _keep_entries(self, call_ids: list[str]) -> None:
        """Entries and links for reports stored before they were kept beside them (once: then as any other)."""
        docs = await self._hmget(self._key("reports"), call_ids)
        entries = await asyncio.to_thread(lambda: {d["call_id"]: entry_text(d) for d in docs})
        links = {d["call_id"]: d.get("link") or "-" for d in docs}
        for at in range(0, len(docs), 1000):
            cids = [d["call_id"] for d in docs[at:at + 1000]]
            async with self.r.pipeline(transaction=False) as pipe:  # the entry first: a link means it is there
                pipe.hset(self._key("reports", "entry"), mapping={c: entries[c] for c in cids})
                pipe.hset(self._key("reports", "link"), mapping={c: links[c] for c in cids})
                await pipe.execute()

    @_guarded
    async def _fill(self, cursor: _Cursor, n: int) -> None:
        low = "-inf" if cursor.score is None else repr(cursor.score)
        # Through a script: its flat reply skips redis-py's per-member score conversion (the larger part of
        # reading a big termination's index on the loop); the scores are Redis's own spelling, read exactly.
        flat = await self._scripts["zslice"](keys=[cursor.key], args=[low, cursor.at_score, n])
        cursor.refill([(float(flat[i + 1]), flat[i]) for i in range(0, len(flat), 2)], n)

    @_guarded
    async def _index_starts(self, agent: str) -> None:
        """Reports stored before the index by start existed get into it (once: then both indexes agree)."""
        by_arrival, by_start = self._key("reports", "agent", agent), self._key("reports", "started", agent)
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.zcard(by_arrival)
            pipe.zcard(by_start)
            arrived, started = await pipe.execute()
        if int(arrived) == int(started):
            return
        for start in range(0, int(arrived), 1000):
            ids = await self.r.zrange(by_arrival, start, start + 999)
            docs = await self._hmget(self._key("reports"), ids)
            if docs:
                await self.r.zadd(by_start, {d["call_id"]: float(d.get("started_at") or 0) for d in docs})

    @_guarded
    async def reports_among(self, call_ids: list[str]) -> list[Doc]:
        return await self._hmget(self._key("reports"), list(call_ids))
