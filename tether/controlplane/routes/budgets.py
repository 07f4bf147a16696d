"""Routes over budgets: a sidecar run leases and returns slices; an admin or an ancestor reads the trees."""

from __future__ import annotations

from aiohttp import web

from ..body import parse
from ..services.budgets import BudgetService
from . import ADMIN, ADMIN_OR_ANCESTOR, RUN, Route, body_bytes, caller, principal


class BudgetRoutes:
    def __init__(self, budgets: BudgetService) -> None:
        self.budgets = budgets

    async def h_take(self, request: web.Request) -> web.Response:
        doc = parse(await body_bytes(request)).doc  # the API's one JSON reader (depth, size, finite numbers)
        return web.json_response(await self.budgets.take(caller(request), doc.get("capability"), doc.get("want", 1),
                                                         doc.get("slice"), doc.get("settle"), doc.get("seq")))

    async def h_return(self, request: web.Request) -> web.Response:
        doc = parse(await body_bytes(request)).doc
        return web.json_response({"settled": await self.budgets.settle(caller(request), doc.get("slices"))})

    async def h_budget(self, request: web.Request) -> web.Response:
        return web.json_response(await self.budgets.link_view(request.match_info["jti"], principal(request)))

    async def h_budgets(self, request: web.Request) -> web.Response:
        return web.json_response(await self.budgets.fleet_view(request.query.get("agent")))

    def table(self) -> list[Route]:
        return [
            Route("POST", "/v1/budgets/slices", self.h_take, "Lease a slice of a capability's calls budget", RUN,
                  "budgets"),
            Route("POST", "/v1/budgets/slices/return", self.h_return, "Return what a slice did not use", RUN,
                  "budgets"),
            Route("GET", "/v1/budgets", self.h_budgets, "Budgets as a tree: every root, or ?agent=A's links",
                  ADMIN, "budgets"),
            Route("GET", "/v1/budgets/{jti}", self.h_budget,
                  "A link's subtree: granted, used, leased per capability", ADMIN_OR_ANCESTOR, "budgets"),
        ]
