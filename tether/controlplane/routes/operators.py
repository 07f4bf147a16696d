"""Routes over operators: an admin adds, lists, rotates and revokes them; every operator may ask who they are."""

from __future__ import annotations

from aiohttp import web

from ..auth import ADMINISTER, ROLES, Operator
from ..body import Fields
from ..schemas import ANY_OBJ, NUM, STR, STRINGS, array, nullable, obj
from ..services.operators import MAX_EXPIRY_S, OperatorService
from . import ADMIN, Route, body, operator

OPERATOR_VIEW = obj({"name": STR, "roles": array({"type": "string", "enum": list(ROLES)}),
                     "status": {"type": "string", "enum": ["active", "expired", "revoked"]},
                     "created_at": NUM, "expires_at": nullable(NUM), "rotated_at": nullable(NUM),
                     "revoked_at": nullable(NUM), "history": array(ANY_OBJ)},
                    "name", "roles", "status", "history")
WITH_TOKEN = {**OPERATOR_VIEW, "properties": {**OPERATOR_VIEW["properties"], "token": STR},
              "required": [*OPERATOR_VIEW["required"], "token"]}
ADD_REQUEST = obj({"name": STR, "roles": STRINGS, "expires_in_s": nullable(NUM)}, "name", "roles")
ROTATE_REQUEST = obj({"expires_in_s": nullable(NUM)})
WHOAMI = obj({"operator": STR, "via": STR, "roles": STRINGS}, "operator", "via", "roles")


class OperatorRoutes:
    def __init__(self, operators: OperatorService) -> None:
        self.operators = operators

    async def h_add(self, request: web.Request) -> web.Response:
        fields = await body(request, "the operator")
        name = str(fields.string("name", required=True, nullable=False, max_len=64, non_empty=True))
        roles = fields.strings("roles", required=True, max_items=len(ROLES))
        added = await self.operators.add(name, list(roles), _expiry(fields), _by(request))
        return web.json_response(added, status=201)

    async def h_list(self, request: web.Request) -> web.Response:
        return web.json_response(await self.operators.list())

    async def h_rotate(self, request: web.Request) -> web.Response:
        fields = await body(request)
        return web.json_response(await self.operators.rotate(request.match_info["name"], _expiry(fields),
                                                             _by(request)))

    async def h_revoke(self, request: web.Request) -> web.Response:
        await body(request)
        return web.json_response(await self.operators.revoke(request.match_info["name"], _by(request)))

    async def h_whoami(self, request: web.Request) -> web.Response:
        who = _by(request)
        return web.json_response({"operator": who.name, "via": who.via, "roles": sorted(who.roles)})

    def table(self) -> list[Route]:
        return [
            Route("POST", "/v1/operators", self.h_add, "Add an operator (its token is in this answer only)", ADMIN,
                  "operators", body=ADD_REQUEST, ok=WITH_TOKEN, status=201, roles=ADMINISTER,
                  does="add operators"),
            Route("GET", "/v1/operators", self.h_list, "The operators, their roles and history (never a token)",
                  ADMIN, "operators", ok=array(OPERATOR_VIEW)),
            Route("POST", "/v1/operators/{name}/rotate", self.h_rotate, "A new token for an operator (the old one "
                  "stops working)", ADMIN, "operators", body=ROTATE_REQUEST, ok=WITH_TOKEN, roles=ADMINISTER,
                  does="rotate operators' tokens"),
            Route("POST", "/v1/operators/{name}/revoke", self.h_revoke, "Revoke an operator (its token and console "
                  "sessions stop working)", ADMIN, "operators", body=obj({}), ok=OPERATOR_VIEW, roles=ADMINISTER,
                  does="revoke operators"),
            Route("GET", "/v1/operators/me", self.h_whoami, "Who the caller is signed in as", ADMIN, "operators",
                  ok=WHOAMI),
        ]


def _by(request: web.Request) -> Operator:
    who = operator(request)
    if who is None:  # an ADMIN route: enforced() has proven an operator
        raise RuntimeError(f"{request.path}: no operator called this route")
    return who


def _expiry(fields: Fields) -> float | None:
    return fields.number("expires_in_s", None, nullable=True, minimum=1, maximum=MAX_EXPIRY_S)
