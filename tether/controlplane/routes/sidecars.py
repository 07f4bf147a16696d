"""Routes a sidecar run calls: the event stream (long poll and streaming), heartbeats, call reports; and
the admin's read of the reports."""

from __future__ import annotations

import asyncio

from aiohttp import web

from tether.capability import protocol

from .. import schemas as sc
from ..body import query_int, query_number
from ..event_stream import KEEPALIVE_S, Subscriber, encode
from ..services.events import EventService
from ..services.grants import chain_jtis
from ..services.records import RecordService
from ..services.sidecars import SidecarService
from . import ADMIN, RUN, SIDECAR, Route, body, caller

MAX_WAIT_S = 30.0


class SidecarRoutes:
    def __init__(self, events: EventService, sidecars: SidecarService, records: RecordService) -> None:
        self.events = events
        self.sidecars = sidecars
        self.records = records

    async def h_events(self, request: web.Request) -> web.Response:
        who = caller(request)
        after = query_int(request, "after", -1)
        wait = max(0.0, min(query_number(request, "wait", 0.0), MAX_WAIT_S))
        return web.json_response((await self.events.poll(who.link_hash, set(chain_jtis(who.link)), after,
                                                         wait)).to_doc())

    async def h_events_stream(self, request: web.Request) -> web.StreamResponse:
        """The long poll's documents, one per line, on one response that stays open (see event_stream.py).
        The subscriber is registered before anything is read, so no event falls between the catch-up read
        from the store and the shared fan-out that follows it."""
        who = caller(request)
        after = query_int(request, "after", -1)
        jtis = frozenset(chain_jtis(who.link))
        hub = self.events.hub
        sub = await hub.subscribe(who.link_hash, jtis)
        try:
            position = hub.position
            low, high = await self.events.bounds()
            if self.events.out_of_range(after, low, high):
                opening, sent = (await self.events.resync(who.link_hash, set(jtis), high)).to_doc(), high
            else:
                caught, sent = await self.events.catch_up(who.link_hash, jtis, after, position)
                opening = {"events": caught, "next": sent}
            response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson",
                                                   "Cache-Control": "no-store", "X-Accel-Buffering": "no"})
            await response.prepare(request)
            self.events.metrics.inc("tether_event_streams_opened_total")
            try:
                await self._follow(request, response, sub, encode(opening), sent)
            except (ConnectionError, OSError):
                pass  # the sidecar went away; it resumes from its last sequence number
            return response
        finally:
            hub.unsubscribe(sub)

    async def _follow(self, request: web.Request, response: web.StreamResponse, sub: Subscriber, opening: bytes,
                      sent: int) -> None:
        await response.write(opening)  # with the headers: from here on, whole chunks only
        while sub.pending:  # what arrived while the opening was read and written
            lines = [line for seq, line in sub.pending if seq > sent]
            sent = max(sent, sub.pending[-1][0])
            sub.pending.clear()
            if lines:
                await response.write(b"".join(lines))
        if request.transport is None:
            return
        sub.attach(request.transport, sent)  # the fan-out writes to the socket directly from now on
        while sub.closed is None:
            sub.wake.clear()
            try:
                await asyncio.wait_for(sub.wake.wait(), KEEPALIVE_S)
            except TimeoutError:  # also moves the client's cursor past events it does not see
                sub.sent = max(sub.sent, self.events.hub.position)
                await response.write(encode({"events": [], "next": sub.sent}))

    async def h_heartbeat(self, request: web.Request) -> web.Response:
        who = caller(request)
        beat = protocol.Heartbeat.read((await body(request, "the heartbeat body")).doc)
        return web.json_response((await self.sidecars.heartbeat(who, beat)).to_doc())

    async def h_reports_in(self, request: web.Request) -> web.Response:
        batch = protocol.ReportBatch.read((await body(request, protocol.ReportBatch.WHAT)).doc)
        new, dup = await self.records.ingest(caller(request), batch.reports, batch.starts)
        return web.json_response(protocol.Accepted(new, dup).to_doc())

    async def h_reports_out(self, request: web.Request) -> web.Response:
        return web.json_response(await self.records.reports(request.query.get("agent")))

    def table(self) -> list[Route]:
        return [
            Route("GET", "/v1/events", self.h_events, "Sequence-numbered event stream for a sidecar (long poll)",
                  SIDECAR, "sidecar", ok=sc.EVENTS, query=(
                      ("after", sc.INT, "the last sequence number seen (-1 or absent: a full resync)"),
                      ("wait", sc.NUM, "seconds to wait for an event (at most 30)"))),
            Route("GET", "/v1/events/stream", self.h_events_stream, "The same events on one long-lived response: "
                  "JSON lines, each a long-poll answer; resume with after=SEQ", SIDECAR, "sidecar",
                  content="application/x-ndjson", ok={"type": "string"},
                  query=(("after", sc.INT, "the last sequence number seen (-1 or absent: a resync)"),)),
            Route("POST", protocol.HEARTBEAT, self.h_heartbeat, "Renew the sidecar run's lease", RUN,
                  "sidecar", body=sc.HEARTBEAT_REQUEST, ok=sc.LEASE),
            Route("POST", "/v1/reports", self.h_reports_in, "Ingest call reports (idempotent on call_id)", RUN,
                  "sidecar", body=sc.REPORTS_REQUEST, ok=sc.ACCEPTED),
            Route("GET", "/v1/reports", self.h_reports_out, "Call reports, optionally for one agent", ADMIN,
                  "sidecar", ok=sc.REPORTS, query=(("agent", sc.STR, "only this agent's calls"),)),
        ]
