"""The Redis store's reconciliation records: the hash chain, its call entries and the index of who holds each call.

A mixin of ``RedisStore`` (``tether/controlplane/store/redis.py``); moved out of it unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping

from tether.capability import jsonpieces

from ..termination import encode_entry
from .base import Doc, LogView, StoreUnavailable, StoreUnwritable, index_keys
from .redis_core import (
    STAGED_TTL_MS,
    RedisCore,
    _Cursor,
    _guarded,
    _holder_args,
    _writes,
)

log = logging.getLogger("tether.store.redis")


def _filed_under(header: Doc) -> list[str]:
    """The index keys a record is filed under in Redis: ``base.index_keys``, and its id (``heads_named``)."""
    return [*index_keys(header), f"id:{header['record_id']}"]


def _filing_args(raws: list[str]) -> list[str | int]:
    """``_INDEX_HEADS``'s arguments for these stored headers, oldest first: per record, how many keys, and its keys."""
    args: list[str | int] = []
    for raw in raws:
        keys = _filed_under(json.loads(raw))
        args += [len(keys), *keys]
    return args


class RedisRecords(RedisCore):
    """The record chain, its call entries, the call index."""

    @_guarded
    @_writes
    async def append_record(self, record: Doc, staged: int | None = None,
                            close: Mapping[str, int] | None = None) -> bool:
        header = {k: v for k, v in record.items() if k != "calls"}
        rid = header["record_id"]
        if staged is None:
            await self.r.delete(self._calls_key(rid), self._ids_key(rid))
            entries = await asyncio.to_thread(lambda: [
                (c["call_id"], c.get("reported", True) is not False, encode_entry(c)) for c in record["calls"]])
            for start in range(0, len(entries), 1000):
                await self.stage_calls(rid, start, entries[start:start + 1000])
            staged = len(entries)
        encoded = await asyncio.to_thread(jsonpieces.dumps, header)
        keys = [self._key("records"), self._key("records", "head"), self._calls_key(rid), self._ids_key(rid),
                self._key("records", "keyed"), self._key("records", "keys")]
        if close:
            pairs = [x for link, seq in sorted(close.items()) for x in (link, seq)]
            done = await self._run("append_closing", [*keys, self._key("chains", "seq"), self._key("chains", "closed"),
                                                     self._key("chains", "loose")],
                                   [record["prev_hash"], record["hash"], encoded, staged, rid, len(close), *pairs,
                                    *_filed_under(header)])
            if done == 2:
                return False  # a segment sealed since the writer read its chains: it builds again
        else:
            done = await self._run("append_record", keys,
                                   [record["prev_hash"], record["hash"], encoded, staged, *_filed_under(header)])
        if done < 0:
            raise ValueError(f"record {rid}: the staged call entries are not the {staged} expected")
        if not done:
            return False
        self._appended(header)
        await self._index_records()
        return True

    @_guarded
    @_writes
    async def stage_calls(self, record_id: str, start: int, entries: list[tuple[str, bool, str]]) -> None:
        if not entries:
            return
        async with self.r.pipeline(transaction=False) as pipe:  # a part written is caught by append's count
            pipe.rpush(self._calls_key(record_id), *[text for _, _, text in entries])
            pipe.rpush(self._ids_key(record_id), *[("1 " if reported else "0 ") + cid for cid, reported, _ in entries])
            pipe.pexpire(self._calls_key(record_id), STAGED_TTL_MS)
            pipe.pexpire(self._ids_key(record_id), STAGED_TTL_MS)
            await pipe.execute()

    @_guarded
    @_writes
    async def drop_staged(self, record_id: str) -> None:
        await self.r.delete(self._calls_key(record_id), self._ids_key(record_id))

    @_guarded
    async def record_heads(self, start: int = 0) -> list[Doc]:
        try:
            await self._index_records()
        except StoreUnwritable:
            refused = True  # reads still answer while Redis refuses writes (the index waits for the next reader)
        else:
            refused = False
        raws = await self.r.lrange(self._key("records"), max(0, start), -1)
        heads = await asyncio.to_thread(lambda: [json.loads(raw) for raw in raws])
        if refused and any("calls" in head for head in heads):
            raise StoreUnwritable(f"Redis at {self.url} refuses writes: a record stored whole cannot be split yet")
        return heads

    @_guarded
    async def heads_from(self, at: int) -> list[tuple[int, Doc]]:
        at = max(0, at)
        return list(enumerate(await self.record_heads(at), start=at))  # a position is the list's index

    @_guarded
    async def log_view(self, termination_id: str, agents: list[str]) -> LogView:
        keys = [f"term:{termination_id}", *(f"left:{agent}" for agent in sorted(set(agents)))]
        for attempt in range(2):
            at, head = await self._newest()
            if head is None:
                return LogView(-1, None, [])
            heads = await self._filed(keys, at, attempt)
            if heads is not None:
                return LogView(at, head, heads)
        raise StoreUnavailable(f"Redis at {self.url}: the log's index disagrees with the log, even rebuilt")

    @_guarded
    async def heads_named(self, record_ids: list[str], at: int) -> list[tuple[int, Doc]]:
        keys = [f"id:{rid}" for rid in sorted(set(record_ids))]
        for attempt in range(2):
            heads = await self._filed(keys, at, attempt)
            if heads is not None:
                return heads
        raise StoreUnavailable(f"Redis at {self.url}: the log's index disagrees with the log, even rebuilt")

    async def _newest(self) -> tuple[int, Doc | None]:
        at = int(await self.r.llen(self._key("records"))) - 1
        raw = await self.r.lindex(self._key("records"), at) if at >= 0 else None
        return (at, json.loads(raw)) if raw else (-1, None)

    async def _filed(self, keys: list[str], at: int, attempt: int) -> list[tuple[int, Doc]] | None:
        """The records filed under these index keys, at or before ``at``, oldest first; None when one of them
        is not what the index says (the list was changed under it): the index is then built again from the
        log (``attempt`` 0; the caller asks once more)."""
        await self._index_heads()
        if not keys:
            return []
        filed = await self.r.hmget(self._key("records", "keys"), keys)
        positions = sorted({int(p) for listed in filed if listed for p in listed.split() if int(p) <= at})
        raws: list[str | None] = []
        for start in range(0, len(positions), 1000):
            async with self.r.pipeline(transaction=False) as pipe:
                for pos in positions[start:start + 1000]:
                    pipe.lindex(self._key("records"), pos)
                raws += await pipe.execute()
        heads = await asyncio.to_thread(lambda: [json.loads(raw) if raw else None for raw in raws])
        wanted = set(keys)
        if all(head is not None and wanted & set(_filed_under(head)) for head in heads):
            return list(zip(positions, heads, strict=True))  # type: ignore[arg-type]
        if attempt == 0:
            log.warning("Redis at %s: the log's index names a record the log does not hold there; rebuilding it",
                        self.url)
            await self.r.delete(self._key("records", "keyed"), self._key("records", "keys"))
        return None

    @_guarded
    async def _index_heads(self) -> None:
        """File every record appended and not yet in the log's index, oldest first (usually none: two small
        reads; a log written before the index: once, a thousand headers per script)."""
        while True:
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.get(self._key("records", "keyed"))
                pipe.llen(self._key("records"))
                done_raw, total = await pipe.execute()
            done = int(done_raw or 0)
            if done >= int(total):
                return
            raws = await self.r.lrange(self._key("records"), done, done + 999)
            args = await asyncio.to_thread(_filing_args, raws)
            await self._run("index_heads", [self._key("records", "keyed"), self._key("records", "keys")],
                            [done, *args])

    async def record_calls(self, record_id: str, page: int = 2000) -> AsyncIterator[list[str]]:
        """A page of the record's calls; an entry staged from a report ('') is the text kept beside it."""
        at = 0
        async for texts in self._pages(self._calls_key(record_id), page):
            if "" in texts:
                marks = await self._lrange(self._ids_key(record_id), at, at + len(texts) - 1)
                refs = [i for i, text in enumerate(texts) if text == ""]
                kept = await self._texts([marks[i][2:] for i in refs])
                for i, text in zip(refs, kept, strict=True):
                    texts[i] = text
            at += len(texts)
            yield texts

    @_guarded
    async def call_holders(self, call_ids: list[str]) -> dict[str, tuple[str | None, tuple[str, ...]]]:
        await self._index_records()
        out: dict[str, tuple[str | None, tuple[str, ...]]] = {}
        for start in range(0, len(call_ids), 1000):
            ids = call_ids[start:start + 1000]
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.hmget(self._key("records", "owner"), ids)
                pipe.hmget(self._key("records", "unknown"), ids)
                owners, unknowns = await pipe.execute()
            for cid, owner, unknown in zip(ids, owners, unknowns, strict=True):
                if owner or unknown:
                    out[cid] = (owner or None, tuple((unknown or "").split()))
        return out

    @_guarded
    async def unknown_calls(self) -> dict[str, tuple[str, ...]]:
        await self._index_records()
        listed = await self.r.hgetall(self._key("records", "unknown"))
        return {cid: tuple(rids.split()) for cid, rids in listed.items()}

    @_guarded
    async def _index_records(self) -> None:
        """Index every record appended and not yet indexed, oldest first (usually none: two small reads)."""
        counter = self._key("records", "indexed")
        while True:
            async with self.r.pipeline(transaction=False) as pipe:  # not MULTI: Redis refuses it when out of memory
                pipe.get(counter)
                pipe.llen(self._key("records"))
                done_raw, total = await pipe.execute()
            done = int(done_raw or 0)
            if done >= int(total):
                return
            raw = await self.r.lindex(self._key("records"), done)
            head = await asyncio.to_thread(json.loads, raw)
            if "calls" in head:  # stored whole, by a control plane from before: split it once
                calls = head.pop("calls")
                texts = await asyncio.to_thread(lambda c=calls: [encode_entry(e) for e in c])
                await self._run("split_record", [self._key("records"), self._calls_key(head["record_id"])],
                                [done, raw, jsonpieces.dumps(head), *texts])
            rid = head["record_id"]
            indexes = [self._key("records", "owner"), self._key("records", "unknown")]
            if await self.r.exists(self._ids_key(rid)):  # the ids beside its calls, read inside Redis
                at = 0
                while await self._run("index_listed", [*indexes, self._ids_key(rid)], [rid, at, at + 4999]) == 5000:
                    at += 5000
            else:  # split from a whole record: decode its entries
                async for page in self.record_calls(rid, 1000):
                    await self._run("index_calls", indexes, [rid, *await asyncio.to_thread(_holder_args, page)])
            await self._run("advance", [counter], [done, done + 1])

    async def report_pages(self, agents: list[str], page: int = 2000) -> AsyncIterator[list[Doc]]:
        async for ids in self._ordered_ids(agents, page):
            yield await self._hmget(self._key("reports"), ids)

    async def _ordered_ids(self, agents: list[str], page: int, index: str = "started") -> AsyncIterator[list[str]]:
        """The agents' indexes by start, merged: each read a slice at a time from where it stopped (by score,
        then by member), so no command's cost grows with the termination (a ZUNIONSTORE of 200,000 members
        holds Redis, and every replica's requests, for most of a second). A report stored meanwhile is
        included when it sorts after the point reached, and never twice."""
        if not agents:
            return
        for agent in agents:
            await self._index_starts(agent)
        slice_n = max(100, page // len(agents))
        cursors = [_Cursor(self._key("reports", index, a)) for a in agents]
        while True:
            ids: list[str] = []
            while len(ids) < page:
                for cursor in cursors:
                    while not cursor.buffer and not cursor.done:
                        await self._fill(cursor, slice_n)
                heads = [c for c in cursors if c.buffer]
                if not heads:
                    break
                if len(heads) == 1:  # one agent left: its slice as it is
                    ids += heads[0].take(page - len(ids))
                    continue
                # Several: take from the lowest while it stays at most every other's first (its slice is sorted).
                heads.sort(key=lambda c: c.buffer[0])
                bound = heads[1].buffer[0]
                lowest = heads[0]
                n = 0
                while n < len(lowest.buffer) and lowest.buffer[n] <= bound and len(ids) + n < page:
                    n += 1
                ids += lowest.take(max(1, n))
            if ids:
                yield ids
            if len(ids) < page:
                return
