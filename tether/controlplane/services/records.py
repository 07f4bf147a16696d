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
from ..segments import OWN, check_chains, merged, runs_of
from ..store import Doc, Store
from ..termination import VerifyResult, in_order_key, record_frame, segment_problems, verify_digests


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
        """Every record, whole, as served (a record of form 2 with its segments' calls expanded)."""
        return [await self.record(head["record_id"]) for head in await self.store.record_heads()]

    async def reports_among(self, call_ids: list[str]) -> list[Doc]:
        """The final reports of these calls (those that have one)."""
        return await self.store.reports_among(call_ids)

    async def heads(self) -> list[Doc]:
        """Every record's header (all but its calls), oldest first."""
        return await self.store.record_heads()

    def calls(self, record_id: str) -> AsyncIterator[list[str]]:
        """A record's own call entries (as stored and hashed: a record of form 2 without its segments' calls)
        as their canonical JSON text, a page at a time."""
        return self.store.record_calls(record_id)

    async def every_call(self, head: Doc) -> AsyncIterator[list[str]]:
        """Every call entry of a record as text, a page at a time: its own, then those of each segment it
        names (record form 2), not merged (for a search through a record's calls)."""
        async for page in self.store.record_calls(head["record_id"]):
            yield page
        for ref in head.get("segments") or ():
            async for rows in self.store.segment_calls(ref["link"], 2000):
                yield [text for _, _, _, text in rows]

    async def head(self, record_id: str) -> Doc:
        """A record's header (all but its calls) by its record id or its termination's id."""
        for record in await self.store.record_heads():
            if record_id in (record["record_id"], record["termination_id"]):
                return record
        raise ApiError(404, NOT_FOUND, f"no record {record_id}")

    async def record(self, record_id: str) -> Doc:
        """A record, whole (its calls decoded; a record of form 2 as served: its segments' calls expanded)."""
        head = await self.head(record_id)
        if "segments" in head:
            text = b"".join([chunk async for chunk in self.text(head)])
            return await asyncio.to_thread(json.loads, text)
        calls: list[Doc] = []
        async for page in self.store.record_calls(head["record_id"]):
            calls += await asyncio.to_thread(lambda texts=page: [json.loads(t) for t in texts])
        return {**head, "calls": calls}

    async def text(self, head: Doc) -> AsyncIterator[bytes]:
        """A record as JSON (its canonical spelling), a page of calls at a time: a record of any size is
        served without being held whole. A record of form 2 is served with every call, its own and its
        segments' merged in the record's order (``segments.served``)."""
        if "segments" in head:
            async for chunk in self._expanded(head):
                yield chunk
            return
        async for chunk in self.own_text(head):
            yield chunk

    async def own_text(self, head: Doc) -> AsyncIterator[bytes]:
        """The record as stored and hashed: its header and its own calls."""
        opening, closing = record_frame(head)
        yield opening.encode()
        first = True
        async for page in self.store.record_calls(head["record_id"], 2000):
            yield (("" if first else ",") + ",".join(page)).encode()
            first = False
        yield closing.encode()

    async def sealed(self, head: Doc) -> list[Doc]:
        """The headers of the segments a record of form 2 names, chain by chain (as named), oldest first."""
        out: list[Doc] = []
        for ref in head.get("segments") or ():
            out += await self.store.segments_of(ref["link"])
        return out

    async def _expanded(self, head: Doc) -> AsyncIterator[bytes]:
        """A record of form 2 served: ``calls`` its own and its segments' merged in the record's order (its
        ``unknown`` ones last, as stored), then ``calls_from`` and ``sealed``."""
        sealed = await self.sealed(head)
        index = {(s["link"], s["seq"]): i for i, s in enumerate(sealed)}
        unknown: list[str] = []

        async def own() -> AsyncIterator[list[tuple[Any, int, str]]]:
            async for page in self.store.record_calls(head["record_id"], 2000):
                docs = await asyncio.to_thread(lambda texts=page: [json.loads(t) for t in texts])
                rows = []
                for doc, text in zip(docs, page, strict=True):
                    if doc.get("reported", True) is False:
                        unknown.append(text)
                    else:
                        rows.append((in_order_key(doc), OWN, text))
                yield rows

        async def chain(link: str) -> AsyncIterator[list[tuple[Any, int, str]]]:
            async for page in self.store.segment_calls(link, 2000):
                yield [((started, cid), index.get((link, seq), OWN), text) for started, cid, seq, text in page]

        frame = {**head, "sealed": sealed, "calls_from": []}
        opening = record_frame(frame)[0]
        yield opening.encode()
        sources: list[int] = []
        first = True
        async for page in merged(own(), [chain(ref["link"]) for ref in head["segments"]]):
            sources += [source for source, _ in page]
            yield (("" if first else ",") + ",".join(text for _, text in page)).encode()
            first = False
        if unknown:
            sources += [OWN] * len(unknown)
            yield (("" if first else ",") + ",".join(unknown)).encode()
        yield record_frame({**frame, "calls_from": runs_of(sources)})[1].encode()

    async def digest(self, head: Doc) -> str:
        """The hash of a record's content (``termination.record_hash``), over its stored entries a page at a
        time: what its ``hash`` must be."""
        body = {k: v for k, v in head.items() if k not in ("hash", "signature")}
        digest = hashlib.sha256()
        async for chunk in self.own_text(body):
            await asyncio.to_thread(digest.update, chunk)
        return "sha256:" + digest.hexdigest()

    async def chain_digests(self, link: str) -> tuple[list[tuple[Doc, str]], int]:
        """A chain's segments, each with the hash of its content recomputed from the calls stored; and how many
        stored calls claim a segment the chain does not have (a reader serves them as the record's own, so a
        record served with them fails its hash: the online check must say so too)."""
        segments = await self.store.segments_of(link)
        strays = 0
        digests = {s["seq"]: hashlib.sha256() for s in segments}
        opened: set[int] = set()
        for segment in segments:
            header = {k: v for k, v in segment.items() if k not in ("hash", "signature")}
            digests[segment["seq"]].update(record_frame(header)[0].encode())
        async for page in self.store.segment_calls(link, 5000):
            for _, _, seq, text in page:
                if seq not in digests:
                    strays += 1
                    continue
                digests[seq].update((b"," if seq in opened else b"") + text.encode())
                opened.add(seq)
        out = []
        for segment in segments:
            header = {k: v for k, v in segment.items() if k not in ("hash", "signature")}
            digests[segment["seq"]].update(record_frame(header)[1].encode())
            out.append((segment, "sha256:" + digests[segment["seq"]].hexdigest()))
        return out, strays

    async def verify(self, public_key: Any, heads: list[Doc] | None = None) -> VerifyResult:
        """``tether records verify`` in the control plane, without holding a record whole. ``heads``: the
        record headers when the caller has read them already. The segments a record of form 2 names are
        checked from the store (``segments.check_chains``)."""
        heads = await self.store.record_heads() if heads is None else heads
        result = verify_digests([(head, await self.digest(head)) for head in heads], public_key)
        chains: dict[int, dict[str, list[tuple[Doc, str]]]] = {}
        planted: list[str] = []
        for index, head in enumerate(heads):
            if "segments" in head:
                chains[index] = {}
                for ref in head["segments"]:
                    chains[index][ref["link"]], strays = await self.chain_digests(ref["link"])
                    if strays:
                        planted.append(f"record {index} ({head.get('record_id')}): {strays} stored call(s) of link "
                                       f"{str(ref['link'])[:16]} claim a segment its chain does not have (planted)")
        problems = list(result.problems) + planted + segment_problems(
            heads, lambda index, head, signers: check_chains(head["segments"], chains[index], signers), public_key)
        return VerifyResult(not problems, result.count, tuple(problems))

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
