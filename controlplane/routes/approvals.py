"""Routes over approvals: a sidecar files a held call, an admin lists, approves or denies it."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from capability.events import APPROVED, DENIED

from .. import schemas as sc
from ..body import Fields
from ..services.approvals import ApprovalService
from . import ADMIN, ADMIN_OR_SIDECAR, APPROVE, RUN, Route, body, caller, operator, principal


class ApprovalRoutes:
    def __init__(self, approvals: ApprovalService) -> None:
        self.approvals = approvals

    async def h_approval_new(self, request: web.Request) -> web.Response:
        who = caller(request)
        fields = await body(request, "the approval request")
        call = {
            "call_id": fields.string("call_id", required=True, nullable=False, max_len=200, non_empty=True),
            "capability": fields.string("capability", max_len=200),
            "method": fields.string("method", max_len=32),
            "url": fields.string("url", max_len=8192),
            "summary": (fields.string("summary", "", max_len=64 * 1024) or "")[:500],
        }
        # A wait that is not a number is refused; a longer one than a day is shortened (the service).
        timeout = fields.number("timeout_s", None, minimum=0)
        held = _held_request(fields.obj("request"))
        return web.json_response(await self.approvals.request(who, call, held, timeout), status=201)

    async def h_approvals(self, request: web.Request) -> web.Response:
        return web.json_response(await self.approvals.find(request.query.get("status")))

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
                  body=sc.APPROVAL_REQUEST, ok=sc.ref("Approval"), status=201),
            Route("GET", "/v1/approvals", self.h_approvals, "List approvals", ADMIN, "approvals", ok=sc.APPROVALS,
                  query=(("status", sc.STR, "only approvals in this status (pending, approved, denied, expired)"),)),
            Route("GET", "/v1/approvals/{id}", self.h_approval_get, "One approval", ADMIN_OR_SIDECAR, "approvals",
                  ok=sc.ref("Approval")),
            Route("POST", "/v1/approvals/{id}/approve", self.h_approve, "Approve a held call", ADMIN, "approvals",
                  body=sc.APPROVE_REQUEST, ok=sc.ref("Approval"), roles=APPROVE),
            Route("POST", "/v1/approvals/{id}/deny", self.h_deny, "Deny a held call", ADMIN, "approvals",
                  body=sc.obj({}), ok=sc.ref("Approval"), roles=APPROVE),
        ]


def _held_request(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """The held call as the sidecar sent it, kept to the shape and sizes the console shows."""
    if value is None:
        return None
    held = Fields(value, "'request'")
    headers = held.raw("headers")
    return {
        "method": (held.string("method", "", max_len=1024) or "")[:32],
        "url": (held.string("url", "", max_len=64 * 1024) or "")[:8192],
        "headers": [[str(h[0])[:256], str(h[1])[:4096]] for h in headers[:200]
                    if isinstance(h, list) and len(h) == 2 and all(isinstance(x, str) for x in h)]
        if isinstance(headers, list) else [],
        "body": (held.string("body", "", max_len=1024 * 1024) or "")[:32 * 1024],
        "body_encoding": "base64" if held.raw("body_encoding") == "base64" else "text",
        "body_size": held.integer("body_size", 0, nullable=True, minimum=-1),  # -1: unknown (streamed)
        "body_truncated": bool(held.boolean("body_truncated", False, nullable=True)),
        # A large upload held at its headers: its body is not shown.
        "body_streamed": bool(held.boolean("body_streamed", False, nullable=True)),
        "call_hash": held.string("call_hash", max_len=80) or None,
    }
