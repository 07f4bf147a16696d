"""The control plane's side of termination: requests, acknowledgements, the driver loop, the records.

The pure protocol lives in ``tether/controlplane/termination.py``; this service performs its actions against the
store and the sidecars' event stream. One replica at a time drives a given termination (a store lease), and
a restarted control plane picks up every termination that is not ``terminated``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tether.capability.errors import CONFLICT, FORBIDDEN, NOT_FOUND, ApiError
from tether.capability.events import CANCELLED, COMMAND, PENDING, by_termination
from tether.capability.protocol import Command

from .. import runs, telemetry
from .. import termination as proto
from ..auth import Caller, Operator
from ..graph import Graph
from ..metrics import Metrics
from ..store import Doc, Store, StoreUnavailable
from . import kinds
from .approvals import ApprovalService
from .budgets import budget_use
from .clock import ClockService
from .events import EventService
from .grants import GrantService, principal_of
from .records import RecordService
from .sidecars import SidecarService

log = logging.getLogger("tether.termination")
DRIVE_INTERVAL_S = 0.25
LEASE_S = 5.0
RECORD_PAGE = 5000  # call entries per page: what a record's writer holds at once
ADDENDUM_HORIZON_S = 24 * 3600  # how long a record's unaccounted agents are watched for a late acknowledgement


class LeaseLost(Exception):
    """The replica writing a record no longer holds its termination's lease (another replica took it over, or
    the store would not renew it): it stops and drops what it staged, and the lease's holder writes it."""


class TerminationService:
    def __init__(self, store: Store, metrics: Metrics, clock: Callable[[], float], *, signing_key: Ed25519PrivateKey,
                 replica: str, lease_ttl_s: float, grace_s: float, events: EventService, grants: GrantService,
                 approvals: ApprovalService, records: RecordService, sidecars: SidecarService,
                 clock_watch: ClockService) -> None:
        self.store = store
        self.metrics = metrics
        self.clock = clock
        self.signing_key = signing_key
        self.replica = replica
        self.grace_s = grace_s
        self.events, self.grants, self.approvals = events, grants, approvals
        self.records, self.sidecars = records, sidecars
        self.clock_watch = clock_watch
        self._wake = asyncio.Event()
        self.started_at = clock()
        # After a restart, sidecars retry every half second; give them this long to come back and
        # acknowledge before an overdue termination is reconciled without them.
        self.reconnect_grace_s = max(5.0, lease_ttl_s / 3)

    # -- requests -------------------------------------------------------------------------------------
    async def terminate(self, agent: str, caller: Caller | None, mode: str, window_s: float, reason: str,
                        operator: Operator | None = None) -> Doc:
        """Start terminating ``agent`` and its subtree (an admin, or a principal above every link it holds).

        The deadline is fixed here, on this replica's clock, which must agree with the store's: a clock
        behind would date it already past (every drain an abort), one ahead would stretch it."""
        with contextlib.suppress(TimeoutError):  # a store too slow to answer leaves the last verdict standing
            await self.clock_watch.measure()  # afresh: a clock stepped since the last measurement shows now
        self.clock_watch.require_true("fix a termination's deadline")
        graph = await self.grants.graph()
        links = graph.links_of(agent)
        if not links:
            raise ApiError(404, NOT_FOUND, f"no registered link is held by {agent}")
        # An admin, or a principal above every link the agent holds (not just one of them): each check raises.
        verdicts = [self.grants.ancestor_of(caller, link) for link in links]
        requested_by = operator.name if operator is not None and caller is None else verdicts[0]
        # The subtree is fixed by link, not by id: a link registered later under the same id (a respawn, a
        # re-grant) is not part of this termination and starts clean.
        subtree = graph.subtree(agent)
        agents = sorted({link["sub"] for link in subtree})
        tid = "term-" + os.urandom(8).hex()
        doc = proto.new_termination(tid, agent, mode, window_s, reason, requested_by, self.clock(), agents,
                                    self.grace_s)
        doc["links"] = sorted(link["hash"] for link in subtree)
        doc["operator"] = operator.attribution() if operator is not None and caller is None else None
        if not await self.store.cas_doc(kinds.TERMINATION, tid, 0, doc):
            raise ApiError(409, CONFLICT, "termination id collision; retry")
        self.metrics.inc("tether_terminations_requested_total")
        self.metrics.termination_requested(mode)
        log.info("termination %s of %s (%s, window %ss) requested by %s: %s", tid, agent, mode, window_s,
                 requested_by, ", ".join(agents))
        self.wake()
        return {"termination_id": tid, **doc}

    @staticmethod
    def may_follow(caller: Caller | None, requested_by: str | None) -> None:
        """Admins read every termination and record; the principal who asked for one may follow it."""
        if caller is not None and requested_by != principal_of(caller):
            raise ApiError(403, FORBIDDEN, f"{caller.agent} did not request this termination")

    async def get(self, tid: str, caller: Caller | None) -> Doc:
        doc = await self.store.get_doc(kinds.TERMINATION, tid)
        self.may_follow(caller, doc["requested_by"] if doc else None)
        if doc is None:
            raise ApiError(404, NOT_FOUND, f"no termination {tid}")
        mine, acks = await self.facts(doc)
        acked = runs.accounted(doc["agents"], mine, acks)
        never_ran = set(doc["agents"]) - {r.get("agent") for r in mine}
        # What a follower shows while it waits: the calls the runs not yet accounted for last listed in flight,
        # and how long the window still runs on this replica's clock.
        in_flight = {c.get("call_id") for r in mine if r.get("agent") not in acked and r.get("run_id") not in acks
                     for c in r.get("inflight") or [] if isinstance(c, dict)}
        return {**doc, "acknowledged": sorted(acked), "waiting_for": sorted(set(doc["agents"]) - set(acked)),
                "never_ran": sorted(never_ran), "calls_in_flight": len(in_flight),
                "remaining_s": round(max(0.0, float(doc["deadline"]) - self.clock()), 3)}

    async def terminations(self) -> list[Doc]:
        return await self.store.list_docs(kinds.TERMINATION)

    async def in_flight(self) -> int:
        """Terminations not yet terminated (``/metrics``)."""
        return sum(1 for t in await self.terminations() if t["state"] != proto.TERMINATED)

    async def record(self, record_id: str, caller: Caller | None) -> Doc:
        """A record's header (every field but its calls: ``records.text`` streams it whole), to an admin or to
        the principal that requested its termination."""
        try:
            record = await self.records.head(record_id)
        except ApiError:
            self.may_follow(caller, None)  # an unknown id is nobody's business but an admin's
            raise
        self.may_follow(caller, record["requested_by"])
        return record

    async def quiesced(self, caller: Caller, tid: str, reports: list[Any], starts: list[Any], calls: Any) -> Doc:
        """A sidecar run acknowledges a termination of its link: its last reports (through the one way
        reports come in), and it never forwards again."""
        term = await self.store.get_doc(kinds.TERMINATION, tid)
        if term is None or caller.link_hash not in _links_of(term, await self.grants.graph()):
            raise ApiError(404, NOT_FOUND, f"{caller.agent}'s link is not part of termination {tid}")
        await self.records.ingest(caller, reports, starts)
        ack = {"agent": caller.agent, "link": caller.link_hash, "run_id": caller.run, "termination_id": tid,
               "at": self.clock(), "calls": calls, "state": runs.TERMINATED}
        await self.store.put_doc(kinds.ACK, f"{tid}:{caller.run}", ack)
        await self.sidecars.mark_final(caller, runs.TERMINATED)
        self.wake()
        return {"ok": True, "run_id": caller.run}

    # -- driver ---------------------------------------------------------------------------------------
    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            try:
                await self.drive_all()
            except (StoreUnavailable, ConnectionError, OSError) as exc:
                log.warning("termination driver: store unavailable (%s); retrying", exc)
            except Exception:  # the driver must outlive any one bad termination
                log.exception("termination driver step failed; retrying")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), DRIVE_INTERVAL_S)
            except TimeoutError:
                pass

    async def drive_all(self) -> None:
        now = self.clock()
        todo = [doc for doc in await self.store.list_docs(kinds.TERMINATION) if not (
            doc["state"] == proto.TERMINATED
            and (not doc.get("open_agents") or now - (doc.get("completed_at") or now) > ADDENDUM_HORIZON_S))]
        # A skewed clock takes no lease: ahead, it would judge every other replica's lease expired and every
        # window over at once (reconciling before the sidecars answered); behind, it would hold windows open
        # past their end. The store's clock is read afresh before each pass that may take a lease (one round
        # trip), so a clock stepped since the last measurement neither takes nor renews one on its new time.
        # A replica that stops renewing loses its leases to the others within LEASE_S.
        if not todo:
            return
        try:
            skewed = (await self.clock_watch.measure()).skewed
        except TimeoutError:
            skewed = True
        if skewed:
            return
        for doc in todo:
            if not await self.store.try_lease(f"termination:{doc['id']}", self.replica, LEASE_S, self.clock()):
                continue
            if doc["state"] == proto.TERMINATED:
                await self.amend(doc)
            else:
                await self.drive(doc)

    async def amend(self, doc: Doc) -> None:
        """Agents the record left unaccounted that acknowledge later get an addendum record."""
        mine, acks = await self.facts(doc)
        if not set(doc["open_agents"]) & set(runs.accounted(doc["open_agents"], mine, acks)):
            return
        store = self.store
        links = _links_of(doc, await self.grants.graph())
        while True:
            # What the log says of this termination and its agents (its index: never the whole log); the records
            # that hold its calls are read as the pages name them.
            view = await store.log_view(doc["id"], doc["agents"])
            self._check_key(view.head)
            earlier = [head for _, head in view.heads if head["termination_id"] == doc["id"]]
            late = proto.late_agents(doc, earlier, mine, acks)
            if not late:
                addendum = None
                break
            record_id = "rec-" + os.urandom(8).hex()
            builder = proto.RecordBuilder(doc, runs=mine, acks=acks, known=view.heads, agents=late, late=True)
            named, close = await self._chains(builder, links, view.at)
            try:
                staged = await self._stage_reports(builder, record_id, late, links, view.at, lease=doc["id"])
            except LeaseLost:
                log.warning("termination %s: lost its lease while writing an addendum; its holder writes it", doc["id"])
                return
            addendum = proto.addendum_header(builder, record_id=record_id,
                                             prev_hash=view.head["hash"] if view.head else "", now=self.clock())
            if named:
                addendum["segments"] = named
            if await self._append(addendum, record_id, staged, close):
                log.info("termination %s: addendum %s (late: %s)", doc["id"], record_id,
                         ", ".join(proto.terminated_agents(addendum)))
                break
        still = [u["agent"] for u in (addendum or earlier[-1])["agents_unaccounted"]]
        await self._save(doc, {**doc, "open_agents": still, "version": doc["version"] + 1})

    async def _trace_facts(self, doc: Doc) -> tuple[list[Doc], dict[str, Doc], dict[str, Doc]]:
        runs, acks = await self.facts(doc)
        return runs, acks, await self.store.revocations()

    async def facts(self, doc: Doc) -> tuple[list[Doc], dict[str, Doc]]:
        """Every run of the termination's links, and each run's acknowledgement of it (run id -> ack)."""
        links = _links_of(doc, await self.grants.graph())
        mine = [r for r in (await self.store.all_sidecars()).values() if r.get("link") in links and r.get("run_id")]
        acks: dict[str, Doc] = {}
        for run in mine:
            ack = await self.store.get_doc(kinds.ACK, f"{doc['id']}:{run['run_id']}")
            if ack is not None and ack.get("link") == run.get("link"):  # only the run's own link speaks for it
                acks[run["run_id"]] = ack
        return mine, acks

    async def _acks(self, doc: Doc) -> tuple[dict[str, Doc], set[str]]:
        """Agents all of whose runs acknowledged quiescence (or had already stopped or terminated), and the
        agents with no run at all (nothing to wait for: proto.advance)."""
        mine, acks = await self.facts(doc)
        return runs.accounted(doc["agents"], mine, acks), set(doc["agents"]) - {r.get("agent") for r in mine}

    async def drive(self, doc: Doc) -> None:
        """One step of the machine (``proto.advance``), its actions carried out in order from ``ACTIONS``. Each
        action takes the document as stored and as the step left it, and answers the document to go on with,
        or None when it saved what it had to itself (the record's writer); what is left is saved at the end."""
        acks, never_ran = await self._acks(doc)
        step = proto.advance(doc, acks, self.clock(), not_before=self.started_at + self.reconnect_grace_s,
                             never_ran=never_ran)
        new = step.doc
        for action in step.actions:
            went_on = await self.ACTIONS[action](self, doc, new)
            if went_on is None:
                return
            new = went_on
        if new is not doc:
            await self._save(doc, new)
            log.info("termination %s: %s", doc["id"], new["state"])

    async def _revoke(self, doc: Doc, new: Doc) -> Doc:
        """The subtree as it is now: a descendant registered since the request is revoked and included too."""
        agents, links = await self.revoke_subtree(new)
        return {**new, "agents": agents, "links": links}

    async def _write_record(self, doc: Doc, new: Doc) -> None:
        """Reconcile: say so (reconciling) before the slower record is written, write it once, and finish."""
        if doc["state"] != proto.RECONCILING:
            if not await self._save(doc, new):
                return
            doc = new
        try:
            record_id, unaccounted = await self.write_record(doc)
        except LeaseLost:
            log.warning("termination %s: lost its lease while writing the record; its holder writes it", doc["id"])
            return
        final = proto.finish(doc, record_id, self.clock(), unaccounted)
        if await self._save(doc, final):
            await telemetry.termination_finished(final, partial(self._trace_facts, final), self.clock())
        self.metrics.inc("tether_terminations_completed_total")
        log.info("termination %s: terminated, record %s", doc["id"], record_id)

    async def _save(self, old: Doc, new: Doc) -> bool:
        if not await self.store.cas_doc(kinds.TERMINATION, old["id"], old["version"], new):
            log.info("termination %s changed under us; re-reading", old["id"])
            return False
        return True

    async def revoke_subtree(self, doc: Doc) -> tuple[list[str], list[str]]:
        """Revoke the termination's links and every link registered below them since; returns the agents
        and the link hashes now in the termination."""
        graph = await self.grants.graph()
        hashes = _links_of(doc, graph)
        links = [graph.by_hash[h] for h in hashes if h in graph.by_hash]
        for link in links:
            await self.grants.revoke_link(link, by_termination(doc['id']), doc.get("reason", ""), doc["id"])
        return sorted({link["sub"] for link in links} | set(doc["agents"])), sorted(hashes)

    async def _cancel_approvals(self, doc: Doc, new: Doc) -> Doc:
        """Every pending approval of the termination's links is cancelled (its own status, not a denial)."""
        links = set(new.get("links") or ())
        for approval in await self.store.list_docs(kinds.APPROVAL):
            of_ours = approval.get("link") in links if approval.get("link") else approval["agent"] in new["agents"]
            if of_ours and approval["status"] == PENDING:
                try:
                    # Nobody denied it: the termination cancelled it before it left (its own status, so
                    # the sidecar resolves the call cancelled_not_sent, not as a person's denial).
                    await self.approvals.decide(approval["id"], CANCELLED, by_termination(new["id"]))
                except ApiError:
                    pass  # decided meanwhile: nothing to deny
        return new

    async def _send_commands(self, doc: Doc, new: Doc) -> Doc:
        """The drain or abort command to every link of the termination, stored and published."""
        command = Command(termination_id=new["id"], mode=new["mode"], window_s=new["window_s"],
                          deadline=new["deadline"], grace_s=new["grace_s"], issued_at=self.clock())
        # A command belongs to a link (every run of it obeys), never to a bare agent id: a later link for
        # the same id starts clean. The standing command is stored as fixed; the event carries the window
        # left as of now (``remaining_s``), as a heartbeat's answer or a resync do when they hand it out.
        graph = await self.grants.graph()
        for link_hash in sorted(_links_of(new, graph)):
            agent = graph.by_hash[link_hash]["sub"] if link_hash in graph.by_hash else None
            stored = replace(command, agent=agent, link=link_hash).as_given()
            await self.store.put_doc(kinds.COMMAND, link_hash, stored)
            sent = replace(command, link=link_hash, remaining_s=proto.remaining(stored, self.clock()))
            await self.events.publish(COMMAND, link_hash, sent.as_given())
        return new

    # The one table of what each action of the machine does (every action proto.advance can answer has its
    # entry: tests/test_termination_machine.py).
    ACTIONS: Mapping[str, Callable[[TerminationService, Doc, Doc], Awaitable[Doc | None]]] = {
        proto.REVOKE_SUBTREE: _revoke,
        proto.DENY_APPROVALS: _cancel_approvals,
        proto.SEND_COMMANDS: _send_commands,
        proto.WRITE_RECORD: _write_record,
    }

    def _check_key(self, head: Doc | None) -> None:
        """Write no record the log's readers would reject: this replica's key must be the one in force at the
        head (a replica still running on the old key after ``tether keys rotate`` writes nothing)."""
        from ..signing import check_head

        check_head(head, self.signing_key.public_key(), "this replica's signing key")

    async def _learn(self, builder: proto.RecordBuilder, holders: Mapping[str, proto.Holders], at: int) -> None:
        """The headers of the records these holders name that the builder does not know yet (as of ``at``)."""
        missing = builder.unknown_ids(holders)
        if missing:
            builder.learn(await self.store.heads_named(missing, at))

    async def _chains(self, builder: proto.RecordBuilder, links: Iterable[str],
                      at: int) -> tuple[list[Doc], dict[str, int]]:
        """The chains of sealed segments of these links that the record names, and those its append closes
        (``RecordBuilder.chains``), the records that closed chains before learned first: one row per link,
        whatever the number of calls sealed (docs/termination.md, "Sealed segments")."""
        chains = await self.store.chains(sorted(set(links)))
        closers = sorted({c["closed_by"] for c in chains.values() if c.get("closed_by")} - builder.known.keys())
        if closers:
            builder.learn(await self.store.heads_named(closers, at))
        return builder.chains(chains, links)

    async def write_record(self, doc: Doc) -> tuple[str, list[str]]:
        """Write the termination's record (once); returns its id and the agents it left unaccounted.

        A page of reports at a time (``RecordBuilder``): each page's call entries are encoded in a worker
        thread and staged in the store, so neither the control plane's memory nor its event loop ever holds
        more than a page; the record is then hashed over its staged entries, signed, and its header appended
        on the head of the chain (a compare-and-set: a writer that lost the race drops what it staged and
        builds again on the new head, which may hold some of its calls)."""
        store = self.store
        while True:
            # The log's index: the newest record, this termination's records and those that left its agents
            # unaccounted (what the record's rules read of other records: never the whole log).
            view = await store.log_view(doc["id"], doc["agents"])
            for _, head in view.heads:
                if head["termination_id"] == doc["id"]:  # written before a restart: never a second record
                    return head["record_id"], [u["agent"] for u in head["agents_unaccounted"]]
            self._check_key(view.head)
            graph = await self.grants.graph()
            hashes = _links_of(doc, graph)
            links = [graph.by_hash[h] for h in hashes if h in graph.by_hash]
            mine, acks = await self.facts(doc)
            record_id = "rec-" + os.urandom(8).hex()
            # A call belongs to the first record that holds it as reported (an overlapping termination's
            # record, or an earlier one of the same agents, re-granted): the store's index of the log says.
            builder = proto.RecordBuilder(doc, runs=mine, acks=acks, known=view.heads)
            ours = partial(_ours, set(doc["agents"]), hashes)
            # Everything but the pages first: calls written ahead or last listed in flight and never heard of
            # again (they end the record as unknown), and what it says of other records' unknown calls.
            starts = [s for s in await store.starts(doc["agents"]) if _reported_under(s, hashes)]
            candidates = sorted({s["call_id"] for s in starts} | proto.inflight_ids(doc["agents"], mine, acks))
            ended = {r["call_id"] for r in await store.reports_among(candidates) if ours(r)}
            held = {cid for cid, (owner, _) in (await store.call_holders(candidates)).items() if owner}
            elsewhere = [r for r in await store.reports_among(sorted(await store.unknown_calls())) if ours(r)]
            foreseen = await store.call_holders([r["call_id"] for r in elsewhere])
            await self._learn(builder, foreseen, view.at)
            builder.foresee(elsewhere, foreseen)
            named, close = await self._chains(builder, hashes, view.at)
            inputs = dict(record_id=record_id, seen=ended | held,
                          starts=[s for s in starts if s["call_id"] not in ended], links=links,
                          revocations=await store.revocations(), budgets=await budget_use(store, links, self.clock()),
                          prev_hash=view.head["hash"] if view.head else "")
            draft, unknown = builder.finish(**inputs, now=self.clock())
            opening = proto.record_frame(draft)[0]  # every field sorting before "calls" is known by now
            digest = hashlib.sha256(opening.encode())
            staged = await self._stage_reports(builder, record_id, doc["agents"], hashes, view.at, digest,
                                               lease=doc["id"])
            staged = await self._stage(record_id, staged, unknown, digest)
            header, _ = builder.finish(**inputs, now=self.clock())
            header = {**header, "key_id": proto.key_id_of(self.signing_key),  # sorts after "calls": closing
                      **({"segments": named} if named else {})}
            again, closing = proto.record_frame(header)
            if again != opening:  # cannot happen: the fields before the calls depend on nothing the pages said
                raise RuntimeError(f"termination {doc['id']}: the record's opening changed while it was written")
            digest.update(closing.encode())
            sealed = proto.sign_hash(header, "sha256:" + digest.hexdigest(), self.signing_key)
            if await store.append_record(sealed, staged=staged, close=close):
                return record_id, [u["agent"] for u in header["agents_unaccounted"]]
            await store.drop_staged(record_id)

    async def _stage_reports(self, builder: proto.RecordBuilder, record_id: str, agents: list[str],
                             links: set[str], at: int, digest: Any = None, *, lease: str | None = None) -> int:
        """Stage the call entries of these agents' reports under ``links``, a page at a time; returns how many.
        The store copies each entry's text, made when its report arrived, so nothing is decoded or encoded
        here. ``digest``: a hash the entries' canonical JSON is added to as they are staged. ``lease``: the
        termination whose lease this replica renews before each page (a record may take longer to write than
        the lease lasts, and another replica must not start writing it over again meanwhile); LeaseLost, with
        what was staged dropped, when it no longer holds it. ``at``: the position of the log's newest record the
        record is built on (the records a page's holders name are read as of it)."""
        staged = 0
        pages = _ahead(self.store.stage_reports(record_id, 0, sorted(agents), links, RECORD_PAGE))
        try:
            async for page in pages:
                if lease is not None:
                    await self._renew(lease)
                await self._learn(builder, page.holders, at)
                builder.count([cid for cid, _ in page.entries], page.holders)
                if digest is not None and page.entries:
                    await asyncio.to_thread(_digest, digest, [text for _, text in page.entries], staged == 0)
                staged += len(page.entries)
        except LeaseLost:
            await pages.aclose()  # the page read ahead is staged or cancelled before what was staged is dropped
            await self.store.drop_staged(record_id)
            raise
        return staged

    async def _renew(self, termination_id: str) -> None:
        """Renew this replica's lease on the termination; LeaseLost when another replica holds it."""
        if not await self.store.try_lease(f"termination:{termination_id}", self.replica, LEASE_S, self.clock()):
            raise LeaseLost(termination_id)

    async def _stage(self, record_id: str, start: int, entries: list[Doc], digest: Any = None) -> int:
        if entries:
            encoded = await asyncio.to_thread(_encoded, entries, digest, start == 0)
            await self.store.stage_calls(record_id, start, encoded)
        return start + len(entries)

    async def _append(self, header: Doc, record_id: str, staged: int, close: Mapping[str, int] | None = None) -> bool:
        """Hash the record over its staged entries, sign it and append its header (closing the chains of
        ``close``); False (what was staged dropped) when another record was appended first."""
        header = {**header, "key_id": proto.key_id_of(self.signing_key)}
        sealed = proto.sign_hash(header, await self.records.digest(header), self.signing_key)
        if await self.store.append_record(sealed, staged=staged, close=close):
            return True
        await self.store.drop_staged(record_id)
        return False


async def _ahead[T](pages: AsyncIterator[T]) -> AsyncIterator[T]:
    """``pages``, the next one read while the caller works on the current one (one page ahead, no more)."""
    nxt: asyncio.Task[T] = asyncio.ensure_future(anext(pages))
    try:
        while True:
            try:
                page = await nxt
            except StopAsyncIteration:
                return
            nxt = asyncio.ensure_future(anext(pages))
            yield page
    finally:
        if not nxt.done():
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await nxt
        await pages.aclose()  # type: ignore[attr-defined]


def _encoded(entries: list[Doc], digest: Any = None, first: bool = True) -> list[tuple[str, bool, str]]:
    """Each entry's (call id, reported, canonical JSON); added to ``digest`` (after a comma unless ``first``)."""
    out = [(e["call_id"], e.get("reported", True) is not False, proto.encode_entry(e)) for e in entries]
    if digest is not None:
        _digest(digest, [text for _, _, text in out], first)
    return out


def _digest(digest: Any, texts: list[str], first: bool) -> None:
    """Entries' texts added to a record's hash as they sit in its canonical JSON (after a comma unless first)."""
    digest.update((("" if first else ",") + ",".join(texts)).encode())


def _links_of(doc: Doc, graph: Graph) -> set[str]:
    """The termination's links and every link registered below them (a termination written before links
    were recorded falls back to its agents' links)."""
    roots = doc.get("links")
    if roots is None:
        roots = [link["hash"] for agent in doc["agents"] for link in graph.links_of(agent)]
    out = set(roots)
    for h in roots:
        out.update(d["hash"] for d in graph.descendants(h))
    return out


def _ours(agents: set[str], links: set[str], report: Doc) -> bool:
    """A report of one of the termination's agents, from a run of one of its links."""
    return report.get("agent") in agents and _reported_under(report, links)


def _reported_under(report: Doc, links: set[str]) -> bool:
    """A report belongs to a termination when it came from a run of one of its links (reports stored
    before runs carried no link: those go by agent id, as they did)."""
    link = report.get("link")
    return link is None or link in links
