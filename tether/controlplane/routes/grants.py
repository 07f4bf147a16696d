"""Routes over grants: issuing, registering, verifying and revoking links; the agent list and tree; the
audit surface."""

from __future__ import annotations

from aiohttp import web

from tether.capability import keys, protocol
from tether.capability.chain import MAX_LINKS

from .. import schemas as sc
from ..body import bad
from ..schemas import MAX_REASON, MAX_TTL_S
from ..services.grants import GrantService
from . import (
    ADMIN,
    ADMIN_OR_ANCESTOR,
    ADMIN_OR_HOLDER,
    ADMINISTER,
    NONE,
    RESPOND,
    Route,
    body,
    chain_wire,
    operator,
    principal,
)


class GrantRoutes:
    def __init__(self, grants: GrantService) -> None:
        self.grants = grants

    async def h_issue(self, request: web.Request) -> web.Response:
        fields = await body(request)
        agent = str(fields.string("agent", required=True, max_len=128))
        key_raw = fields.raw("subject_key")
        if isinstance(key_raw, dict):
            subject = keys.from_jwk(key_raw)
        elif isinstance(key_raw, str):
            subject = keys.load_public(key_raw.encode(), "subject_key")
        else:
            raise bad("'subject_key' must be a PEM public key or an Ed25519 JWK", field="subject_key")
        caps = self.grants.caps(fields.string("role", max_len=200), fields.obj("caps") or {})
        issued = await self.grants.issue(
            agent, subject, caps, ttl_s=float(fields.number("ttl_s", 3600.0, minimum=1, maximum=MAX_TTL_S)),
            depth=int(fields.integer("depth", 3, minimum=0, maximum=MAX_LINKS)), operator=operator(request))
        return web.json_response(issued, status=201)

    async def h_register(self, request: web.Request) -> web.Response:
        registration = protocol.Register.read((await body(request, "the registration")).doc)
        docs, new, revoked = await self.grants.register_chain(registration.chain, operator(request))
        leaf = docs[-1]
        return web.json_response(protocol.Registered(agent=leaf["sub"], link=leaf["hash"], jtis=leaf["chain_jtis"],
                                                     new=new, revoked=revoked).to_doc())

    async def h_verify(self, request: web.Request) -> web.Response:
        fields = await body(request)
        return web.json_response(await self.grants.verify(chain_wire(fields.raw("chain"))))

    async def h_revoke(self, request: web.Request) -> web.Response:
        reason = (await body(request)).string("reason", "", max_len=MAX_REASON) or ""
        return web.json_response(await self.grants.revoke(request.match_info["jti"], principal(request), reason,
                                                          operator(request)))

    async def h_revoke_agent(self, request: web.Request) -> web.Response:
        reason = (await body(request)).string("reason", "", max_len=MAX_REASON) or ""
        return web.json_response(await self.grants.revoke_agent(request.match_info["agent"], principal(request),
                                                                reason, operator(request)))

    async def h_agents(self, request: web.Request) -> web.Response:
        return web.json_response(await self.grants.agents())

    async def h_surface(self, request: web.Request) -> web.Response:
        return web.json_response(await self.grants.surface(request.query.get("agent")))

    def table(self) -> list[Route]:
        return [
            Route("POST", "/v1/grants", self.h_issue, "Issue a root grant for an agent", ADMIN, "grants",
                  body=sc.GRANT_REQUEST, ok=sc.GRANT, status=201, roles=ADMINISTER, does="issue grants"),
            Route("POST", "/v1/grants/{jti}/revoke", self.h_revoke, "Revoke a link and every chain containing it",
                  ADMIN_OR_ANCESTOR, "grants", body=sc.REASON_REQUEST, ok=sc.REVOKED, roles=RESPOND,
                  does="revoke a link"),
            Route("POST", "/v1/chains/register", self.h_register, "Register a chain (every link before use)",
                  ADMIN_OR_HOLDER, "grants", body=sc.REGISTER_REQUEST, ok=sc.REGISTERED, roles=ADMINISTER,
                  does="register chains"),
            Route("POST", "/v1/chains/verify", self.h_verify, "Verify a chain against the keys and revocations",
                  NONE, "grants", body=sc.CHAIN_REQUEST, ok=sc.VERDICT),
            Route("GET", "/v1/agents", self.h_agents, "The agent graph, as a list and a tree", ADMIN, "agents",
                  ok=sc.AGENTS),
            Route("POST", "/v1/agents/{agent}/revoke", self.h_revoke_agent,
                  "Revoke every link an agent holds (a principal: every one below it)", ADMIN_OR_ANCESTOR, "agents",
                  body=sc.REASON_REQUEST, ok=sc.AGENT_REVOKED, roles=RESPOND,
                  does="revoke an agent"),
            Route("GET", "/v1/audit/surface", self.h_surface, "Effective capability list per agent", ADMIN, "audit",
                  ok=sc.ref("Surface"), query=(("agent", sc.STR, "only this agent"),)),
        ]
