"""The Redis store's small documents by id (with CAS), sidecar runs and leases.

A mixin of ``RedisStore`` (``tether/controlplane/store/redis.py``); moved out of it unchanged.
"""

from __future__ import annotations

import json

from .base import Doc
from .redis_core import (
    LEASE_GC_SLACK_MS,
    RedisCore,
    _dump,
    _guarded,
    _writes,
)


class RedisDocs(RedisCore):
    """Documents by id with compare-and-set, sidecar runs, leases."""

    # -- sidecars --------------------------------------------------------------------------------------
    @_guarded
    @_writes
    async def put_sidecar(self, run_id: str, doc: Doc) -> None:
        await self.r.hset(self._key("runs"), run_id, _dump(doc))

    @_guarded
    async def get_sidecar(self, run_id: str) -> Doc | None:
        raw = await self.r.hget(self._key("runs"), run_id)
        return json.loads(raw) if raw else None

    @_guarded
    async def all_sidecars(self) -> dict[str, Doc]:
        return {agent: json.loads(raw) for agent, raw in (await self.r.hgetall(self._key("runs"))).items()}

    # -- documents -----------------------------------------------------------------------------------
    def _doc_keys(self, kind: str) -> list[str]:
        return [
            self._key("docs", kind),
            self._key("docs", kind, "version"),
            self._key("docs", kind, "order"),
            self._key("docs", "n"),
        ]

    @_guarded
    @_writes
    async def put_doc(self, kind: str, doc_id: str, doc: Doc) -> None:
        await self._run("put_doc", self._doc_keys(kind), [doc_id, "", int(doc.get("version", 0)), _dump(doc)])

    @_guarded
    async def get_doc(self, kind: str, doc_id: str) -> Doc | None:
        raw = await self.r.hget(self._key("docs", kind), doc_id)
        return json.loads(raw) if raw else None

    @_guarded
    async def list_docs(self, kind: str) -> list[Doc]:
        ids = await self.r.zrange(self._key("docs", kind, "order"), 0, -1)
        return await self._hmget(self._key("docs", kind), ids)

    @_guarded
    @_writes
    async def cas_doc(self, kind: str, doc_id: str, expect_version: int, doc: Doc) -> bool:
        args = [doc_id, int(expect_version), int(doc["version"]), _dump(doc)]
        return bool(await self._run("put_doc", self._doc_keys(kind), args))

    # -- leases ---------------------------------------------------------------------------------------
    @_guarded
    @_writes
    async def try_lease(self, name: str, owner: str, ttl_s: float, now: float) -> bool:
        gc_ms = int(ttl_s * 1000) + LEASE_GC_SLACK_MS
        args = [owner, repr(float(now)), repr(float(now + ttl_s)), gc_ms]
        return bool(await self._run("try_lease", [self._key("lease", name)], args))
