"""The Redis store's grant links, revocations and one-time tokens.

A mixin of ``RedisStore`` (``tether/controlplane/store/redis.py``); moved out of it unchanged.
"""

from __future__ import annotations

import json

from .base import Doc, LinkConflict
from .redis_core import (
    RedisCore,
    _dump,
    _guarded,
    _writes,
)


class RedisLinks(RedisCore):
    """Grant links (the agent graph's edges) and their indexes, revocations, one-time tokens."""

    # -- links ---------------------------------------------------------------------------------------
    @_guarded
    @_writes
    async def put_links(self, links: list[Doc]) -> int:
        if not links:
            return 0
        await self._index_links()
        args: list[str] = []
        keys = [self._key("links"), self._key("links", "jti"), self._key("links", "order")]
        for link in links:
            args += [link["hash"], link["jti"], _dump(link), link["sub"]]
            keys += [self._children_key(link.get("prf")), self._key("links", "sub", link["sub"])]
        answer = await self._scripts["put_links"](keys=keys, args=args)
        if int(answer[0]) < 0:
            raise LinkConflict(str(answer[1]), str(answer[2]))
        return int(answer[0])

    def _children_key(self, parent: str | None) -> str:
        """One hash per parent link: its children's link hashes -> their agents (roots share one)."""
        return self._key("links", "children", parent) if parent else self._key("links", "roots")

    async def _index_links(self) -> None:
        """Links registered before the indexes by parent and by subject existed are indexed once, by the
        replica that takes the job (a marker set with NX). A link another replica registers meanwhile may be
        listed twice under its subject: readers drop repeats."""
        if self._links_indexed:
            return
        marker = self._key("links", "indexed")
        if await self.r.set(marker, "1", nx=True):
            links = await self._hmget(self._key("links"), await self.r.lrange(self._key("links", "order"), 0, -1))
            async with self.r.pipeline(transaction=False) as pipe:
                for link in links:
                    pipe.hset(self._children_key(link.get("prf")), link["hash"], link["sub"])
                    pipe.rpush(self._key("links", "sub", link["sub"]), link["hash"])
                await pipe.execute()
        self._links_indexed = True

    @_guarded
    async def links_held_by(self, agent: str) -> list[Doc]:
        await self._index_links()
        hashes = await self.r.lrange(self._key("links", "sub", agent), 0, -1)
        return await self._hmget(self._key("links"), list(dict.fromkeys(hashes)))

    @_guarded
    async def descendants(self, link_hash: str) -> dict[str, str]:
        await self._index_links()
        found: dict[str, str] = {}
        frontier = [link_hash]
        while frontier:  # one round trip per level of the subtree
            async with self.r.pipeline(transaction=False) as pipe:
                for parent in frontier:
                    pipe.hgetall(self._children_key(parent))
                levels = await pipe.execute()
            below = {h: sub for children in levels for h, sub in children.items() if h not in found}
            below.pop(link_hash, None)
            found.update(below)
            frontier = sorted(below)
        return found

    @_guarded
    async def get_link(self, link_hash: str) -> Doc | None:
        raw = await self.r.hget(self._key("links"), link_hash)
        return json.loads(raw) if raw else None

    @_guarded
    async def link_by_jti(self, jti: str) -> Doc | None:
        link_hash = await self.r.hget(self._key("links", "jti"), jti)
        return await self.get_link(link_hash) if link_hash else None

    @_guarded
    async def jtis_beginning(self, prefix: str, limit: int = 21) -> list[str]:
        # HSCAN over the jti index: field names only, matched server-side (a prefix holds only hex characters,
        # so nothing in it is a glob character)
        found: list[str] = []
        async for jti, _ in self.r.hscan_iter(self._key("links", "jti"), match=f"{prefix}*", count=1000):
            found.append(jti)
            if len(found) >= limit:
                break
        return sorted(found)

    @_guarded
    async def all_links(self) -> list[Doc]:
        hashes = await self.r.lrange(self._key("links", "order"), 0, -1)
        return await self._hmget(self._key("links"), hashes)

    # -- revocations -----------------------------------------------------------------------------------
    @_guarded
    @_writes
    async def revoke(self, jti: str, doc: Doc) -> bool:
        return bool(await self.r.hsetnx(self._key("revocations"), jti, _dump(doc)))

    @_guarded
    async def revocations(self) -> dict[str, Doc]:
        return {jti: json.loads(raw) for jti, raw in (await self.r.hgetall(self._key("revocations"))).items()}

    @_guarded
    async def revoked_among(self, jtis: list[str]) -> set[str]:
        if not jtis:
            return set()
        flags = await self.r.hmget(self._key("revocations"), jtis)
        return {jti for jti, raw in zip(jtis, flags, strict=True) if raw}

    @_guarded
    @_writes
    async def first_use(self, key: str, ttl_s: float, now: float) -> bool:
        return bool(await self.r.set(self._key("seen", key), "1", nx=True, px=max(1, int(ttl_s * 1000))))
