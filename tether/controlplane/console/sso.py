"""The single sign-on routes: the console's redirect and callback, and the CLI's discovery and ID-token exchange.

    GET  /ui/oidc/login       -> 303 to the provider (a signed cookie carries the sign-in in progress)
    GET  /ui/oidc/callback    -> the provider's redirect back: a console session for the operator, 303 to /ui/
    GET  /v1/auth/oidc        -> the provider and clients (``tether login`` reads it)
    POST /v1/auth/oidc/token  -> an ID token the CLI got, for a short-lived operator token
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from .. import schemas as sc
from ..body import read_json
from ..routes import NONE
from ..services.signin import SingleSignOn
from . import Console, _https

if TYPE_CHECKING:
    from ..app import ControlPlane

PENDING_COOKIE = "tether_oidc"
CALLBACK = "/ui/oidc/callback"
SSO = sc.obj({"issuer": sc.STR, "client_id": sc.STR, "cli_client_id": sc.nullable(sc.STR), "scope": sc.STR,
              "roles_claim": sc.STR, "name_claim": sc.STR}, "issuer", "client_id", "scope")
EXCHANGE = sc.obj({"id_token": sc.STR}, "id_token")
EXCHANGED = sc.obj({"token": sc.STR, "operator": sc.STR, "via": sc.STR, "roles": sc.STRINGS, "expires_in_s": sc.NUM},
                   "token", "operator", "via", "roles", "expires_in_s")


class SsoRoutes:
    def __init__(self, sso: SingleSignOn, console: Console, redirect_uri: str | None) -> None:
        self.sso = sso
        self.console = console
        self.redirect_uri = redirect_uri

    def _redirect_uri(self, request: web.Request) -> str:
        if self.redirect_uri:
            return self.redirect_uri
        scheme = "https" if self.console.sessions.tls or _https(request) else "http"
        return f"{scheme}://{request.host}{CALLBACK}"

    async def h_login(self, request: web.Request) -> web.Response:
        url, pending = await self.sso.begin(self._redirect_uri(request))
        response = web.Response(status=303, headers={"Location": url, "Cache-Control": "no-store"})
        # Lax, not Strict: the provider's redirect back is a cross-site navigation, which must carry it.
        response.set_cookie(PENDING_COOKIE, pending, path="/ui/oidc/", httponly=True, samesite="Lax",
                            secure=self.console.sessions.tls or _https(request), max_age=600)
        return response

    async def h_callback(self, request: web.Request) -> web.Response:
        query = {k: v for k, v in request.query.items()}
        who = await self.sso.finish(request.cookies.get(PENDING_COOKIE, ""), query)
        sessions = self.console.sessions
        session = sessions.create(self.console.cp.clock(), who)
        response = web.Response(status=303, headers={"Location": "/ui/", "Cache-Control": "no-store"})
        response.del_cookie(PENDING_COOKIE, path="/ui/oidc/")
        response.set_cookie(sessions.cookie, session.sid, path="/", httponly=True, samesite="Strict",
                            secure=sessions.tls or _https(request), max_age=int(sessions.ttl_s))
        self.console.cp.metrics.inc("tether_console_sign_in_total")
        return response

    async def h_describe(self, request: web.Request) -> web.Response:
        return web.json_response(self.sso.describe())

    async def h_exchange(self, request: web.Request) -> web.Response:
        body, _ = await read_json(request)
        id_token = str(body.string("id_token", required=True, nullable=False, max_len=16384, non_empty=True))
        return web.json_response(await self.sso.exchange(id_token))


def install(cp: ControlPlane, console: Console, sso: SingleSignOn, redirect_uri: str | None = None) -> SsoRoutes:
    routes = SsoRoutes(sso, console, redirect_uri)
    r = cp.route
    r("GET", "/ui/oidc/login", routes.h_login, "Sign in through the OpenID provider (redirects there)", NONE,
      "console", status=303, content=None)
    r("GET", CALLBACK, routes.h_callback, "The OpenID provider's redirect back: a console session", NONE,
      "console", status=303, content=None,
      query=(("code", sc.STR, "the authorization code"), ("state", sc.STR, "the sign-in's state"),
             ("iss", sc.STR, "the issuer (RFC 9207)")))
    r("GET", "/v1/auth/oidc", routes.h_describe, "The single sign-on provider and clients (tether login)", NONE,
      "operators", ok=SSO)
    r("POST", "/v1/auth/oidc/token", routes.h_exchange, "An ID token from the provider, for a short-lived "
      "operator token (tether login)", NONE, "operators", body=EXCHANGE, ok=EXCHANGED)
    return routes
