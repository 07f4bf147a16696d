"""Routes over approvals: a sidecar files a held call, an admin lists, approves or denies it."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tether.capability import protocol
from tether.capability.events import APPROVED, DENIED, FILED, HELD

from .. import schemas as sc
from ..body import bad, query_int
from ..openapi import refusal
from ..services.approvals import ApprovalService
from . import ADMIN, ADMIN_OR_SIDECAR, APPROVE, RUN, Route, body, caller, operator, principal


class ApprovalRoutes:
    def __init__(self, approvals: ApprovalService) -> None:
        self.approvals = approvals

    async def h_approval_new(self, request: web.Request) -> web.Response:
        who = caller(request)
        # The held call inside is read as its own message (protocol.HeldCall): a field that does not fit is
        # refused 400 naming it, a call that is not whole 413 (the service); nothing is stored either way.
        ask = protocol.ApprovalRequest.read((await body(request, protocol.ApprovalRequest.WHAT)).doc)
        filed = await self.approvals.request(who, ask)
        return web.json_response(filed.to_doc(), status=201)

    async def h_approvals(self, request: web.Request) -> web.Response:
        """A page of approvals (all of them without ``limit``); ``Tether-Total`` says how many match."""
        status, origin = request.query.get("status"), request.query.get("origin")
        if origin not in (None, HELD, FILED):
            raise bad(f"query parameter 'origin' must be {HELD} or {FILED}", field="origin")
        offset = query_int(request, "offset", 0)
        limit = query_int(request, "limit", -1)
        if offset < 0 or limit < -1:
            raise bad("'offset' and 'limit' must not be negative", field="offset" if offset < 0 else "limit")
        docs, total = await self.approvals.find(status, request.query.get("agent"), origin, offset,
                                                None if limit == -1 else limit)
        return web.json_response(docs, headers={"Tether-Total": str(total)})

    async def h_summary(self, request: web.Request) -> web.Response:
        return web.json_response(await self.approvals.summary())

    async def h_approval_get(self, request: web.Request) -> web.Response:
        return web.json_response(await self.approvals.get(request.match_info["id"], principal(request)))

    async def h_approve(self, request: web.Request) -> web.Response:
        call_hash = (await body(request)).string("call_hash", max_len=200)
        return web.json_response(await self._decide(request, APPROVED, call_hash))

    async def h_deny(self, request: web.Request) -> web.Response:
        await body(request)  # no fields, but a body that is not an object is refused as everywhere
        return web.json_response(await self._decide(request, DENIED, None))

    async def _decide(self, request: web.Request, decision: str, call_hash: str | None) -> dict[str, Any]:
        who = operator(request)
        assert who is not None  # an ADMIN route: enforced() proved an operator
        return await self.approvals.decide(request.match_info["id"], decision, who.name, call_hash,
                                           operator=who.attribution())

    def table(self) -> list[Route]:
        return [
            Route("POST", "/v1/approvals", self.h_approval_new, "Ask for approval of a held call", RUN, "approvals",
                  body=sc.APPROVAL_REQUEST, ok=sc.APPROVAL_FILED, status=201, extra_responses={
                      413: refusal(413, "The held call's body is cut, or past the limit (tether.approval_body_too_"
                                   "large; the error's limit says how many bytes), or the body is over 8 MiB"),
                      429: refusal(429, "The run (32) or the link (128) has its fill of pending approvals "
                                   "(tether.approval_queue_full)")}),
            Route("GET", "/v1/approvals", self.h_approvals, "List approvals: pending first, held calls before filed "
                  "requests, newest first; the Tether-Total header counts every match", ADMIN, "approvals",
                  ok=sc.APPROVALS, query=(
                      ("status", sc.STR, "only approvals in this status (pending, approved, denied, expired)"),
                      ("agent", sc.STR, "only this agent's approvals"),
                      ("origin", sc.STR, f"only pending approvals whose run reports them {HELD}, or only {FILED}"),
                      ("offset", sc.INT, "skip this many (paging)"),
                      ("limit", sc.INT, "at most this many (default: all)"))),
            Route("GET", "/v1/approvals/summary", self.h_summary, "How many approvals are pending, in all and per "
                  f"agent ({HELD} calls and {FILED} requests apart), and the queue limits", ADMIN, "approvals",
                  ok=sc.APPROVAL_SUMMARY),
            Route("GET", "/v1/approvals/{id}", self.h_approval_get, "One approval", ADMIN_OR_SIDECAR, "approvals",
                  ok=sc.ref("Approval")),
            Route("POST", "/v1/approvals/{id}/approve", self.h_approve, "Approve a held call", ADMIN, "approvals",
                  body=sc.APPROVE_REQUEST, ok=sc.ref("Approval"), roles=APPROVE),
            Route("POST", "/v1/approvals/{id}/deny", self.h_deny, "Deny a held call", ADMIN, "approvals",
                  body=sc.obj({}), ok=sc.ref("Approval"), roles=APPROVE),
        ]
