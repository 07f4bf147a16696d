"""Routes over budgets: a sidecar run leases and returns slices; an admin or an ancestor reads the trees."""

from __future__ import annotations

from aiohttp import web

from tether.capability import protocol

from .. import schemas as sc
from ..services.budgets import BudgetService
from . import ADMIN, ADMIN_OR_ANCESTOR, RUN, Route, body, caller, principal


class BudgetRoutes:
    def __init__(self, budgets: BudgetService) -> None:
        self.budgets = budgets

    async def h_take(self, request: web.Request) -> web.Response:
        ask = protocol.SliceRequest.read((await body(request, protocol.SliceRequest.WHAT)).doc)
        return web.json_response((await self.budgets.take(caller(request), ask)).to_doc())

    async def h_return(self, request: web.Request) -> web.Response:
        settle = protocol.SliceReturn.read((await body(request, protocol.SliceReturn.WHAT)).doc)
        return web.json_response(protocol.SlicesSettled(await self.budgets.settle(caller(request), settle.slices))
                                 .to_doc())

    async def h_budget(self, request: web.Request) -> web.Response:
        return web.json_response(await self.budgets.link_view(request.match_info["jti"], principal(request)))

    async def h_budgets(self, request: web.Request) -> web.Response:
        return web.json_response(await self.budgets.fleet_view(request.query.get("agent")))

    def table(self) -> list[Route]:
        return [
            Route("POST", protocol.SLICES, self.h_take, "Lease a slice of a capability's calls budget", RUN,
                  "budgets", body=sc.SLICE_REQUEST, ok=sc.SLICE_LEASE),
            Route("POST", protocol.SLICES_RETURN, self.h_return, "Return what a slice did not use", RUN,
                  "budgets", body=sc.SLICE_RETURN, ok=sc.SLICES_SETTLED),
            Route("GET", "/v1/budgets", self.h_budgets, "Budgets as a tree: every root, or ?agent=A's links",
                  ADMIN, "budgets"),
            Route("GET", "/v1/budgets/{jti}", self.h_budget,
                  "A link's subtree: granted, used, leased per capability", ADMIN_OR_ANCESTOR, "budgets"),
        ]
