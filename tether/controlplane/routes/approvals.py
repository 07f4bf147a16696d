"""Routes over approvals: a sidecar files a held call, an admin lists, approves or denies it."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tether.capability import protocol
from tether.capability.errors import APPROVAL_BODY_TOO_LARGE, ApiError
from tether.capability.events import APPROVAL_BODY_LIMIT, APPROVED, DENIED, FILED, HELD

from .. import schemas as sc
from ..body import Fields, bad, query_int
from ..openapi import refusal
from ..services.approvals import ApprovalService
from . import ADMIN, ADMIN_OR_SIDECAR, APPROVE, RUN, Route, body, caller, operator, principal


class ApprovalRoutes:
    def __init__(self, approvals: ApprovalService) -> None:
        self.approvals = approvals

    async def h_approval_new(self, request: web.Request) -> web.Response:
        who = caller(request)
        ask = protocol.ApprovalRequest.read((await body(request, protocol.ApprovalRequest.WHAT)).doc)
        call = {"call_id": ask.call_id, "capability": ask.capability, "method": ask.method, "url": ask.url,
                "summary": (ask.summary or "")[:500]}
        # A wait that is not a number is refused; a longer one than a day is shortened (the service).
        held = _held_request(ask.request)
        return web.json_response(await self.approvals.request(who, call, held, ask.timeout_s), status=201)

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
                  body=sc.APPROVAL_REQUEST, ok=sc.ref("Approval"), status=201, extra_responses={
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


MAX_HEADERS = 500
MAX_SHOWN_BODY = 4 * ((APPROVAL_BODY_LIMIT + 2) // 3)  # characters: the limit's bytes as base64 (text is fewer)


def _held_request(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """The held call as the sidecar sent it, kept whole: what the approver sees is all that would leave. A part
    the control plane cannot keep whole is refused, never cut (the sidecar then refuses the call)."""
    if value is None:
        return None
    held = Fields(value, "'request'")
    headers = held.raw("headers", [])
    if not isinstance(headers, list) or len(headers) > MAX_HEADERS or not all(
            isinstance(h, list) and len(h) == 2 and all(isinstance(x, str) and len(x) <= 64 * 1024 for x in h)
            for h in headers):
        raise bad(f"'request.headers' must be at most {MAX_HEADERS} [name, value] pairs of strings (64 KiB each)",
                  field="request.headers")
    size = held.integer("body_size", 0, nullable=True, minimum=-1)
    body = held.string("body", "", max_len=MAX_SHOWN_BODY + 1) or ""
    if (held.boolean("body_truncated", False, nullable=True) or held.boolean("body_streamed", False, nullable=True)
            or len(body) > MAX_SHOWN_BODY or size is None or size < 0 or size > APPROVAL_BODY_LIMIT):
        raise ApiError(413, APPROVAL_BODY_TOO_LARGE, "a held call is filed only with its whole body, at most "
                       f"{APPROVAL_BODY_LIMIT} bytes (this one: {size if size is not None and size >= 0 else 'unknown'}"
                       " bytes, or cut by the sender): the approver must see everything that would leave",
                       limit=APPROVAL_BODY_LIMIT)
    return {
        "method": held.string("method", "", max_len=32) or "",
        "url": held.string("url", "", max_len=64 * 1024) or "",
        "headers": headers,
        "body": body,
        "body_encoding": "base64" if held.raw("body_encoding") == "base64" else "text",
        "body_size": size,
        "body_truncated": False,  # kept for readers of the older shape: a held body is never cut now
        "body_streamed": False,
        "call_hash": held.string("call_hash", max_len=80) or None,
    }
