"""Call reports in, and the reconciliation records out.

``ingest`` is the one way reports come in: report batches (``POST /v1/reports``) and a termination's
acknowledgement (``POST /v1/sidecars/quiesced``) alike. Each report is read as a
``capability.report.CallReport`` (the one shape a report has; ``read_doc`` checks it), must be the
delivering agent's own, is stamped with the agent, link and run that delivered it, and is stored
idempotently on ``call_id``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from tether.capability.errors import FORBIDDEN, NOT_FOUND, ApiError
from tether.capability.report import read_final, read_start

from ..auth import Caller
from ..metrics import Metrics
from ..store import Doc, Store
from ..termination import VerifyResult, record_frame, verify_digests


class RecordService:
    def __init__(self, store: Store, metrics: Metrics, clock: Callable[[], float]) -> None:
        self.store = store
        self.metrics = metrics
        self.clock = clock

    def read(self, caller: Caller, items: list[Any], what: str,
             reader: Callable[[Any, str], Doc] = read_final) -> list[Doc]:
        """Every report of a batch checked (the whole batch is refused for one bad report, before anything
        is stored) and stamped with who delivered it. A final report names a resolution from the documented
        list; a start names none."""
        now = self.clock()
        out: list[Doc] = []
        for index, item in enumerate(items):
            report = reader(item, f"{what}[{index}]")
            if report["agent"] not in (None, caller.agent):
                raise ApiError(403, FORBIDDEN, f"{caller.agent} cannot report calls of {report['agent']}")
            # The run that delivers it is the one recorded.
            report.update(agent=caller.agent, link=caller.link_hash, run_id=caller.run, received_at=now)
            out.append(report)
        return out

    async def ingest(self, caller: Caller, reports: list[Any], starts: list[Any]) -> tuple[int, int]:
        """Store final reports and write-ahead starts (calls that began and may not have ended); a final
        report always supersedes its start. Returns (new, duplicates)."""
        clean, early = self.read(caller, reports, "reports"), self.read(caller, starts, "starts", read_start)
        if early:
            await self.store.put_starts(early)
        new, dup = stored = await self.store.put_reports(clean)
        for report in clean:
            if report["call_id"] in stored.new_ids:
                self.metrics.call_reported(report)
        self.metrics.inc("tether_reports_total", new)
        self.metrics.inc("tether_reports_duplicate_total", dup)
        return new, dup

    async def reports(self, agent: str | None) -> list[Doc]:
        return await self.store.reports([agent] if agent else None)

    async def records(self) -> list[Doc]:
        return await self.store.records()

    async def reports_among(self, call_ids: list[str]) -> list[Doc]:
        """The final reports of these calls (those that have one)."""
        return await self.store.reports_among(call_ids)

    async def heads(self) -> list[Doc]:
        """Every record's header (all but its calls), oldest first."""
        return await self.store.record_heads()

    def calls(self, record_id: str) -> AsyncIterator[list[str]]:
        """A record's call entries as their canonical JSON text, a page at a time."""
        return self.store.record_calls(record_id)

    async def head(self, record_id: str) -> Doc:
        """A record's header (all but its calls) by its record id or its termination's id."""
        for record in await self.store.record_heads():
            if record_id in (record["record_id"], record["termination_id"]):
                return record
        raise ApiError(404, NOT_FOUND, f"no record {record_id}")

    async def record(self, record_id: str) -> Doc:
        """A record, whole (its calls decoded)."""
        head = await self.head(record_id)
        calls: list[Doc] = []
        async for page in self.store.record_calls(head["record_id"]):
            calls += await asyncio.to_thread(lambda texts=page: [json.loads(t) for t in texts])
        return {**head, "calls": calls}

    async def text(self, head: Doc) -> AsyncIterator[bytes]:
        """A record as JSON (its canonical spelling), a page of calls at a time: a record of any size is
        served without being held whole."""
        opening, closing = record_frame(head)
        yield opening.encode()
        first = True
        async for page in self.store.record_calls(head["record_id"], 2000):
            yield (("" if first else ",") + ",".join(page)).encode()
            first = False
        yield closing.encode()

    async def digest(self, head: Doc) -> str:
        """The hash of a record's content (``termination.record_hash``), over its stored entries a page at a
        time: what its ``hash`` must be."""
        body = {k: v for k, v in head.items() if k not in ("hash", "signature")}
        digest = hashlib.sha256()
        async for chunk in self.text(body):
            await asyncio.to_thread(digest.update, chunk)
        return "sha256:" + digest.hexdigest()

    async def verify(self, public_key: Any, heads: list[Doc] | None = None) -> VerifyResult:
        """``tether records verify`` in the control plane, without holding a record whole. ``heads``: the
        record headers when the caller has read them already."""
        heads = await self.store.record_heads() if heads is None else heads
        return verify_digests([(head, await self.digest(head)) for head in heads], public_key)

    async def log_text(self) -> AsyncIterator[bytes]:
        """Every record, oldest first, as one JSON list (``GET /v1/records``), streamed like ``text``."""
        heads = await self.store.record_heads()  # before the first byte: a store that cannot answer gets a 503
        yield b"["
        for n, head in enumerate(heads):
            if n:
                yield b","
            async for chunk in self.text(head):
                yield chunk
        yield b"]"
