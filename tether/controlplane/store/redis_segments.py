"""The Redis store's sealed segments (record form 2: ``tether/controlplane/segments.py``).

Per link, hashes keyed by the link hold its chain (``chains:seq``, ``chains:head``, ``chains:count``,
``chains:last``, ``chains:closed``, ``chains:loose``, ``chains:agent``); ``segments:LINK`` lists its segments'
headers and ``segment:LINK:SEQ`` the call ids of one segment, whose texts are the ones kept beside the reports
(``reports:entry``). ``reports:loose:AGENT`` indexes, by start, the agent's reports no segment holds: what a
record still stages, and what the sealer takes from (a report leaves it when a segment takes it).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from tether.capability import jsonpieces

from .base import Doc
from .redis_core import RedisCore, _guarded, _writes

_CHAIN_FIELDS = ("seq", "head", "count", "last", "closed", "loose", "agent")


def _triples(flat: list[str]) -> list[tuple[float, str, str]]:
    """A seal page's reply (after its count) as (start, call id, entry text)."""
    return [(float(flat[i]), flat[i + 1], flat[i + 2]) for i in range(1, len(flat), 3)]


class RedisSegments(RedisCore):
    """Chains of sealed segments, one per link."""

    seals = True

    def _chain_keys(self) -> list[str]:
        return [self._key("chains", f) for f in _CHAIN_FIELDS]

    @_guarded
    async def _loosen(self, agent: str) -> None:
        """An agent whose reports were stored before the index of loose reports existed gets every report in it
        (once; nothing of such an agent was ever sealed). A new agent's first report marks it whole."""
        if await self.r.sismember(self._key("reports", "loosed"), agent):
            return
        await self._index_starts(agent)  # type: ignore[attr-defined]
        loose, started = self._key("reports", "loose", agent), self._key("reports", "started", agent)
        await self.r.zunionstore(loose, [loose, started], aggregate="MIN")
        await self.r.sadd(self._key("reports", "loosed"), agent)

    @_guarded
    async def chains(self, links: list[str]) -> dict[str, Doc]:
        if not links:
            return {}
        async with self.r.pipeline(transaction=False) as pipe:
            for key in self._chain_keys():
                pipe.hmget(key, links)
            rows = await pipe.execute()
        out: dict[str, Doc] = {}
        for i, link in enumerate(links):
            seq, head, count, last, closed, loose, agent = (rows[f][i] for f in range(len(_CHAIN_FIELDS)))
            if seq is None and closed is None and agent is None:
                continue
            started, _, cid = (last or "").partition(" ")
            out[link] = {"link": link, "agent": agent or "", "seq": int(seq or 0), "head": head or "",
                         "count": int(count or 0), "last": [float(started), cid] if last else None,
                         "closed_by": closed, "loose": int(loose or 0)}
        return out

    @_guarded
    async def sealable_links(self, min_calls: int) -> list[Doc]:
        loose = await self.r.hgetall(self._key("chains", "loose"))
        links = sorted(link for link, n in loose.items() if int(n) >= min_calls)
        chains = await self.chains(links)
        return [chains[link] for link in links if link in chains and chains[link]["closed_by"] is None]

    @_guarded
    async def seal_candidates(self, chain: Doc, cut: float, limit: int) -> list[tuple[float, str, str]]:
        await self._loosen(chain["agent"])
        keys = [self._key("reports", "loose", chain["agent"]), self._key("reports", "link"),
                self._key("reports", "entry")]
        last = chain.get("last")
        low = "-inf" if last is None else repr(float(last[0]))
        last_args = ["", ""] if last is None else [repr(float(last[0])), last[1]]
        # Filtered in Redis, a bounded page per script: a handful of arguments and one flat reply, where reading
        # the index, the links and the texts by hand encoded ~40,000 arguments a segment in the event loop.
        out: list[tuple[float, str, str]] = []
        offset, page = 0, 2 * limit
        while len(out) < limit:
            flat = await self._scripts["seal_page"](
                keys=keys, args=[chain["link"], low, repr(cut), *last_args, offset, page, limit - len(out)])
            out += await asyncio.to_thread(_triples, flat) if len(flat) > 3000 else _triples(flat)
            read = int(flat[0])
            if read < page:
                break
            offset += read
        out = out[:limit]
        missing = [cid for _, cid, text in out if not text]
        if missing:  # reports stored before their entries were kept beside them
            await self._keep_entries(missing)  # type: ignore[attr-defined]
            texts = dict(zip(missing, await self.r.hmget(self._key("reports", "entry"), missing), strict=True))
            out = [(score, cid, text or texts[cid]) for score, cid, text in out]
        return out

    @_guarded
    @_writes
    async def append_segment(self, segment: Doc, calls: list[tuple[float, str, str]]) -> bool:
        link, seq = segment["link"], segment["seq"]
        last = f"{float(segment['last'][0])!r} {segment['last'][1]}"
        keys = [*self._chain_keys()[:6], self._key("segments", link), self._key("segment", link, str(seq)),
                self._key("reports", "loose", segment["agent"])]
        ids = json.dumps([cid for _, cid, _ in calls], ensure_ascii=False)
        done = await self._run("append_segment", keys, [link, seq, segment["prev"], jsonpieces.dumps(segment),
                                                        segment["hash"], last, ids])
        if done < 0:
            raise ValueError(f"segment {seq} of {link}: its calls changed under it")
        return bool(done)

    @_guarded
    async def segments_of(self, link: str) -> list[Doc]:
        return [json.loads(raw) for raw in await self.r.lrange(self._key("segments", link), 0, -1)]

    async def segment_calls(self, link: str, page: int = 2000) -> AsyncIterator[list[tuple[float, str, int, str]]]:
        n = int(await self.r.llen(self._key("segments", link)))
        agent = await self.r.hget(self._key("chains", "agent"), link) or ""
        for seq in range(1, n + 1):
            key = self._key("segment", link, str(seq))
            at = 0
            while True:
                ids = await self.r.lrange(key, at, at + page - 1)
                if not ids:
                    break
                at += len(ids)
                async with self.r.pipeline(transaction=False) as pipe:
                    pipe.hmget(self._key("reports", "entry"), ids)
                    pipe.zmscore(self._key("reports", "started", agent), ids)
                    texts, scores = await pipe.execute()
                started = [float(score or 0) for score in scores]
                yield [(s, cid, seq, text or "") for s, cid, text in zip(started, ids, texts, strict=True)]
                if len(ids) < page:
                    break
