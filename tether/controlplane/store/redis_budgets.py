"""The Redis store's budget slices and counters.

A mixin of ``RedisStore`` (``tether/controlplane/store/redis.py``); moved out of it unchanged.
"""

from __future__ import annotations

import json
from typing import Any

from tether.capability.budget import MAX_SLICE

from .base import Doc
from .redis_core import (
    RedisCore,
    _dump,
    _guarded,
    _writes,
)


class RedisBudgets(RedisCore):
    """Budget slices and the counters they are taken from."""

    # -- budgets ----------------------------------------------------------------------------------------
    @_guarded
    @_writes
    async def take_slice(self, slice_doc: Doc, counters: list[tuple[str, int]], want: int, fraction: float,
                         ttl_s: float = 0) -> tuple[int, int | None]:
        doc = {**slice_doc, "state": "open", "keys": [k for k, _ in counters]}
        keys = [self._key("slice", doc["id"]), self._key("slices", "open")]
        keys += [self._key("budget", k) for k, _ in counters]
        args: list[Any] = [int(want), repr(float(fraction)), MAX_SLICE, int(ttl_s * 1000), doc["id"], _dump(doc)]
        args += [int(limit) for _, limit in counters]
        granted, worst = await self._scripts["take_slice"](keys=keys, args=args)
        return int(granted), None if int(worst) < 0 else int(worst)

    @_guarded
    @_writes
    async def settle_slice(self, slice_id: str, used: int, at: float) -> Doc | None:
        raw = await self.r.get(self._key("slice", slice_id))
        if not raw:
            return None
        keys = [self._key("slice", slice_id), self._key("slices", "open")]
        keys += [self._key("budget", k) for k in json.loads(raw)["keys"]]  # fixed when the slice was taken
        out = await self._scripts["settle_slice"](keys=keys, args=[int(used), repr(float(at)), slice_id])
        return json.loads(out) if out else None

    @_guarded
    async def open_slices(self) -> list[Doc]:
        ids = sorted(await self.r.smembers(self._key("slices", "open")))
        raws = await self.r.mget([self._key("slice", i) for i in ids]) if ids else []
        return [json.loads(raw) for raw in raws if raw]

    @_guarded
    async def budget_counts(self, counters: list[str]) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        async with self.r.pipeline(transaction=False) as pipe:
            for key in counters:
                pipe.hmget(self._key("budget", key), ["used", "leased"])
            rows = await pipe.execute()
        for key, (used, leased) in zip(counters, rows, strict=True):
            out[key] = (int(used or 0), int(leased or 0))
        return out
