"""The HTTP edge: the route table, authentication enforced where a route is declared, and errors.

Every route names who may call it (``Route.auth``, one of ``AUTH_KINDS``) and, where operators may, which of
their roles (``Route.roles``: a route that reads allows every role; one that changes something names its
roles); ``enforced`` wraps its handler so the caller is authenticated and their roles checked before the
handler runs, and before anything the request names is looked up or its body parsed (no existence oracle,
no work for an anonymous caller). The handler finds who called in ``caller(request)`` (a chain holder) or
``operator(request)`` (a person, whose name and sign-in its decision records). Handlers parse with
``tether/controlplane/body.py``, call a service, and answer JSON; every refusal is ``{"error": {"code", "message",
...}}`` with a ``Tether-Error`` header (``error_middleware``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tether.capability import protocol
from tether.capability.chain import parse_chain_unverified, split_chain
from tether.capability.errors import (
    BAD_REQUEST,
    FORBIDDEN,
    NOT_FOUND,
    STORE_UNAVAILABLE,
    UNAUTHORIZED,
    ApiError,
    ChainError,
    TetherError,
)

from ..auth import ADMINISTER as ADMINISTER  # the roles a route allows (``Route.roles``), for the route modules
from ..auth import APPROVE as APPROVE
from ..auth import READ, SAFE_METHODS, Authenticator, Caller, Operator
from ..auth import RESPOND as RESPOND
from ..body import Fields, bad, parse, raw_body
from ..schemas import Schema
from ..store import STORE_UNWRITABLE, StoreUnavailable, StoreUnwritable

log = logging.getLogger("tether.controlplane")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Who may call a route.
NONE = "none"  # anyone (health, metrics' fleet-wide series, the trust anchor, the console's pages)
ADMIN = "admin"  # an operator whose roles the route allows: a token, or a console session (with its CSRF token)
SIDECAR = "sidecar"  # a chain holder: a Tether-Proof signed with its registered leaf link's key
RUN = "run"  # a sidecar run: a chain holder's proof that names its run
ADMIN_OR_SIDECAR = "admin-or-sidecar"
ADMIN_OR_ANCESTOR = "admin-or-ancestor"  # an admin, or a principal's proof (the service checks it is above)
ADMIN_OR_HOLDER = "admin-or-holder"  # an admin, or a proof by the leaf of the chain in the body (registering)
AUTH_KINDS = (NONE, ADMIN, SIDECAR, RUN, ADMIN_OR_SIDECAR, ADMIN_OR_ANCESTOR, ADMIN_OR_HOLDER)


_CALLER = "tether.caller"
_OPERATOR = "tether.operator"
_KIND = "tether.auth"
_ADMIN_LETS_IN = (ADMIN, ADMIN_OR_SIDECAR, ADMIN_OR_ANCESTOR, ADMIN_OR_HOLDER)
_RAW = "tether.raw"


@dataclass
class Route:
    """One API route and what ``/openapi.json`` says of it: who may call it (and, for an operator, with
    which roles), the body it reads, the status and body of its success, its query parameters (name,
    schema, description)."""

    method: str
    path: str
    handler: Handler
    summary: str
    auth: str
    tag: str = "control"
    body: Schema | None = None
    ok: Schema | None = None
    status: int = 200
    query: tuple[tuple[str, Schema, str], ...] = ()
    content: str | None = "application/json"  # of the success answer; None: no body (a redirect)
    extra_responses: dict[int, Any] = field(default_factory=dict)
    roles: frozenset[str] | None = None  # the operator roles it allows; a read defaults to every role
    does: str = ""  # what a refusal says the operator may not do ("approve a held call"); default: the summary

    def __post_init__(self) -> None:
        if self.auth not in AUTH_KINDS:
            raise ValueError(f"route {self.method} {self.path}: auth {self.auth!r} is not one of {AUTH_KINDS}")
        if self.auth not in _ADMIN_LETS_IN:
            if self.roles is not None:
                raise ValueError(f"route {self.method} {self.path}: roles given, but no operator may call it")
            return
        if self.roles is None:
            if self.method not in SAFE_METHODS:  # a change says who may make it: never every role by default
                raise ValueError(f"route {self.method} {self.path}: a change an operator may make names its roles")
            self.roles = READ
        if not self.roles or not self.roles <= READ:
            raise ValueError(f"route {self.method} {self.path}: roles {sorted(self.roles)} not among {sorted(READ)}")
        self.does = self.does or self.summary[:1].lower() + self.summary[1:]


# -- what a handler reads ----------------------------------------------------------------------------------
async def body_bytes(request: web.Request) -> bytes:
    """The body's bytes, read once (a proof signs them; the handler parses them)."""
    if _RAW not in request:
        request[_RAW] = await raw_body(request)
    return request[_RAW]


async def body(request: web.Request, what: str = "the request body") -> Fields:
    return parse(await body_bytes(request), what)


def caller(request: web.Request) -> Caller:
    """The chain holder a ``sidecar`` or ``run`` route was called by."""
    who = request[_CALLER]
    if who is None:  # a route whose auth also lets an admin in reads principal() instead
        raise RuntimeError(f"{request.path}: no chain holder called this route")
    return who


def operator(request: web.Request) -> Operator | None:
    """The operator who called (None when a chain holder did, on a route that lets both in)."""
    return request.get(_OPERATOR)


def principal(request: web.Request) -> Caller | None:
    """Who called an admin-or-... route: None for an admin, the chain holder otherwise. Only on such a route:
    on a public one, None would read as an admin."""
    if request.get(_KIND) not in _ADMIN_LETS_IN:
        raise RuntimeError(f"{request.path}: principal() on a route that does not let an admin in")
    return request[_CALLER]


def chain_wire(value: Any) -> str:
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return ",".join(value)
    if isinstance(value, str):
        return value
    raise bad("'chain' must be the comma-joined links or a list of links", field="chain")


# -- the one place authentication happens -------------------------------------------------------------------
async def _nobody(auth: Authenticator, request: web.Request, route: Route) -> None:
    return None


async def _admin(auth: Authenticator, request: web.Request, route: Route) -> None:
    request[_OPERATOR] = await auth.require(request, route.roles or frozenset(), route.does)


async def _sidecar(auth: Authenticator, request: web.Request, route: Route | None = None) -> Caller:
    return await auth.sidecar(request, await body_bytes(request))


async def _run(auth: Authenticator, request: web.Request, route: Route) -> Caller:
    return await auth.run_of(request, await body_bytes(request))


async def _as_operator(auth: Authenticator, request: web.Request, route: Route) -> bool:
    """On a route that lets an operator or a chain holder in: whether an operator called (roles checked)."""
    who = await auth.operator(request)
    if who is None:
        return False
    request[_OPERATOR] = auth.allow(who, route.roles or frozenset(), route.does)
    return True


async def _admin_or_sidecar(auth: Authenticator, request: web.Request, route: Route) -> Caller | None:
    return None if await _as_operator(auth, request, route) else await _sidecar(auth, request)


async def _admin_or_ancestor(auth: Authenticator, request: web.Request, route: Route) -> Caller | None:
    if await _as_operator(auth, request, route):
        return None
    if auth.proof_of(request) is None:
        if "Authorization" in request.headers:
            raise ApiError(403, FORBIDDEN, "the bearer token is not an operator's (TETHER_TOKEN) nor the admin "
                           "token, or it was revoked")
        raise ApiError(401, UNAUTHORIZED, "send an operator's token, or a Tether-Proof signed by an ancestor "
                       "principal's key")
    return await _sidecar(auth, request)


async def _admin_or_holder(auth: Authenticator, request: web.Request, route: Route) -> None:
    """Registering: an operator allowed to, or the holder of the chain's leaf link (not registered yet: the
    proof is checked against the key the leaf itself names)."""
    if await _as_operator(auth, request, route):
        return
    raw = await body_bytes(request)
    links = parse_chain_unverified(split_chain(chain_wire(parse(raw).raw("chain"))))
    proof = auth.proof_of(request)
    if proof is None or proof.link != links[-1].hash or proof.agent != links[-1].sub:
        raise ApiError(401, UNAUTHORIZED, "register with a Tether-Proof signed by the leaf link's key (or as an "
                       "admin)")
    await auth.check(request, proof, links[-1].claims["cnf"]["jwk"], raw)


_CHECKS: dict[str, Callable[[Authenticator, web.Request, Route], Awaitable[Caller | None]]] = {
    NONE: _nobody, ADMIN: _admin, SIDECAR: _sidecar, RUN: _run, ADMIN_OR_SIDECAR: _admin_or_sidecar,
    ADMIN_OR_ANCESTOR: _admin_or_ancestor, ADMIN_OR_HOLDER: _admin_or_holder,
}


def enforced(route: Route, auth: Authenticator) -> Handler:
    """The route's handler behind its declared authentication."""
    check = _CHECKS[route.auth]

    async def handler(request: web.Request) -> web.StreamResponse:
        request[_KIND] = route.auth
        request[_OPERATOR] = None
        request[_CALLER] = await check(auth, request, route)
        return await route.handler(request)

    handler.__name__ = route.handler.__name__
    return handler


# -- errors ------------------------------------------------------------------------------------------------
def json_error(status: int, code: str, message: str, **details: Any) -> web.Response:
    body = {"error": {"code": code, "message": message, **{k: v for k, v in details.items() if v is not None}}}
    return web.json_response(body, status=status, headers={protocol.ERROR_HEADER: code})


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ChainError as exc:
        return json_error(403, exc.code, exc.message, reason=exc.reason, link=exc.link)
    except ApiError as exc:
        return json_error(exc.http_status, exc.code, exc.message, **exc.details)
    except TetherError as exc:
        return json_error(400, exc.code, exc.message, **exc.details)
    except StoreUnwritable as exc:
        return json_error(503, STORE_UNWRITABLE, f"the store cannot take writes: {exc}")
    except StoreUnavailable as exc:
        return json_error(503, STORE_UNAVAILABLE, f"the store is unavailable: {exc}")
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        response = json_error(405, BAD_REQUEST, f"{request.method} is not allowed on {request.path}; use {allowed}")
        response.headers["Allow"] = exc.headers.get("Allow", allowed)
        return response
    except web.HTTPNotFound:
        return json_error(404, NOT_FOUND, f"no route {request.path}; /openapi.json lists them")
    except web.HTTPException:  # redirects, and aiohttp's own refusals below the API
        raise
    except (ConnectionError, OSError) as exc:
        log.warning("store error on %s %s: %s", request.method, request.path, exc)
        return json_error(503, STORE_UNAVAILABLE, f"the store is unavailable: {exc}")
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return json_error(500, "tether.internal", "internal error; the control plane log has the details")
