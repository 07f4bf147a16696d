"""Routes over terminations and the records they end in: request one, follow it, a sidecar run's
acknowledgement, the record log."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from tether.capability import protocol

from .. import schemas as sc
from .. import termination as proto
from ..openapi import REFUSALS, refusal
from ..schemas import MAX_REASON
from ..services.records import RecordService
from ..services.terminations import TerminationService
from . import ADMIN, ADMIN_OR_ANCESTOR, RESPOND, RUN, Route, body, caller, operator, principal

MAX_WINDOW_S = 86400


class TerminationRoutes:
    def __init__(self, terminations: TerminationService, records: RecordService) -> None:
        self.terminations = terminations
        self.records = records

    async def h_terminate(self, request: web.Request) -> web.Response:
        fields = await body(request, "the termination request")
        mode = str(fields.choice("mode", proto.MODES, "drain"))
        window_s = float(fields.number("window_s", 30.0, nullable=True, minimum=0, maximum=MAX_WINDOW_S) or 0.0)
        reason = fields.string("reason", "", max_len=MAX_REASON) or ""
        started = await self.terminations.terminate(request.match_info["agent"], principal(request), mode, window_s,
                                                    reason, operator=operator(request))
        return web.json_response(started, status=202)

    async def h_list(self, request: web.Request) -> web.Response:
        return web.json_response(await self.terminations.terminations())

    async def h_get(self, request: web.Request) -> web.Response:
        return web.json_response(await self.terminations.get(request.match_info["id"], principal(request)))

    async def h_quiesced(self, request: web.Request) -> web.Response:
        ack = protocol.Quiesced.read((await body(request, "the acknowledgement")).doc)
        answer = await self.terminations.quiesced(caller(request), ack.termination_id, ack.reports, ack.starts,
                                                  ack.calls)
        return web.json_response(answer)

    async def h_records(self, request: web.Request) -> web.StreamResponse:
        return await _streamed(request, self.records.log_text())

    async def h_record(self, request: web.Request) -> web.StreamResponse:
        head = await self.terminations.record(request.match_info["id"], principal(request))
        return await _streamed(request, self.records.text(head))

    def table(self) -> list[Route]:
        return [
            Route("POST", "/v1/agents/{agent}/terminate", self.h_terminate, "Terminate an agent and its subtree",
                  ADMIN_OR_ANCESTOR, "termination", body=sc.TERMINATE_REQUEST, ok=sc.TERMINATION_STARTED,
                  roles=RESPOND, does="terminate an agent",
                  status=202, extra_responses={503: refusal(503, REFUSALS[503] + "; or this replica's clock is "
                                                            "off the store's by more than the bound "
                                                            "(tether.clock_skewed): it fixes no deadline, send the "
                                                            "request to another replica")}),
            Route("GET", "/v1/terminations", self.h_list, "List terminations", ADMIN, "termination",
                  ok=sc.TERMINATIONS),
            Route("GET", "/v1/terminations/{id}", self.h_get, "A termination's state", ADMIN_OR_ANCESTOR,
                  "termination", ok=sc.TERMINATION_VIEW),
            Route("POST", protocol.QUIESCED, self.h_quiesced, "A sidecar run acknowledges quiescence", RUN,
                  "termination", body=sc.QUIESCED_REQUEST, ok=sc.QUIESCED),
            Route("GET", "/v1/records", self.h_records, "Reconciliation records, oldest first", ADMIN, "records",
                  ok=sc.RECORDS),
            Route("GET", "/v1/records/{id}", self.h_record, "One record (by record or termination id)",
                  ADMIN_OR_ANCESTOR, "records", ok=sc.ref("Record")),
        ]


async def _streamed(request: web.Request, chunks: AsyncIterator[bytes]) -> web.StreamResponse:
    """A JSON answer written as it is read from the store (a record of any size, a page of calls at a time).
    The first chunk is read before the status is sent, so a store that cannot answer still gets its 503."""
    first = await anext(chunks)
    response = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
    await response.prepare(request)
    await response.write(first)
    async for chunk in chunks:
        await response.write(chunk)
    await response.write_eof()
    return response
