"""The control plane's HTTP API (aiohttp): grants, chains, revocation, events, leases, reports, approvals.

Handlers are thin: they authenticate, validate, call the store and the pure model, and answer JSON.
Every refusal is ``{"error": {"code", "message", ...}}`` with a ``Tether-Error`` header.
Termination and records live in ``termination_service.py`` and register their routes here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from capability import keys
from capability.budget import GrantError, read_grant
from capability.catalog import TIERS, Catalog
from capability.chain import (
    MAX_LINKS,
    ChainInvalid,
    Verifier,
    mint_root,
    parse_chain_unverified,
    split_chain,
)
from capability.errors import (
    BAD_REQUEST,
    CONFLICT,
    FORBIDDEN,
    NOT_FOUND,
    STORE_UNAVAILABLE,
    UNAUTHORIZED,
    ApiError,
    ChainError,
    TetherError,
)

from . import runs, telemetry
from . import schemas as sc
from .auth import Authenticator, Caller
from .body import MAX_BODY, Fields, bad, parse, query_int, query_number, raw_body, read_json
from .event_stream import KEEPALIVE_S, EventHub, encode, visible
from .graph import Graph, surface
from .metrics import LoopWatch, Metrics, gauge, revocations_acknowledged
from .schemas import MAX_REASON, MAX_TTL_S, Schema
from .store import Doc, Event, LinkConflict, Store, StoreUnavailable

log = logging.getLogger("tether.controlplane")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
DEFAULT_LEASE_TTL_S = 15.0
DEFAULT_APPROVAL_TTL_S = 300.0
APPROVED, DENIED, CANCELLED = "approved", "denied", "cancelled"  # decisions on a held call (cancelled: by a
# termination, before the call left; never a person's denial)


@dataclass
class Route:
    """One API route and what ``/openapi.json`` says of it: who may call it, the body it reads, the status
    and body of its success, its query parameters (name, schema, description)."""

    method: str
    path: str
    handler: Handler
    summary: str
    auth: str  # "none" | "admin" | "sidecar" | "admin-or-ancestor" | "admin-or-sidecar"
    tag: str = "control"
    body: Schema | None = None
    ok: Schema | None = None
    status: int = 200
    query: tuple[tuple[str, Schema, str], ...] = ()
    content: str | None = "application/json"  # of the success answer; None: no body (a redirect)
    extra_responses: dict[int, Any] = field(default_factory=dict)


def json_error(status: int, code: str, message: str, **details: Any) -> web.Response:
    body = {"error": {"code": code, "message": message, **{k: v for k, v in details.items() if v is not None}}}
    return web.json_response(body, status=status, headers={"Tether-Error": code})


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


def _chain_wire(value: Any) -> str:
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return ",".join(value)
    if isinstance(value, str):
        return value
    raise bad("'chain' must be the comma-joined links or a list of links", field="chain")


class ControlPlane:
    def __init__(
        self,
        store: Store,
        signing_key: Ed25519PrivateKey,
        catalog: Catalog,
        admin_token: str,
        *,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        approval_ttl_s: float = DEFAULT_APPROVAL_TTL_S,
        grace_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        replica: str | None = None,
    ) -> None:
        self.store = store
        self.signing_key = signing_key
        self.catalog = catalog
        self.clock = clock
        self.lease_ttl_s = lease_ttl_s
        self.approval_ttl_s = approval_ttl_s
        self.grace_s = grace_s
        self.replica = replica or f"cp-{os.getpid()}-{os.urandom(3).hex()}"
        self.verifier = Verifier(signing_key.public_key(), catalog_hash=catalog.hash)
        self.auth = Authenticator(store, admin_token, clock)
        self.metrics = Metrics(catalog.names())
        self._event_signal = asyncio.Event()
        self._event_reads: dict[int, asyncio.Future[list[Event]]] = {}
        self.events = EventHub(store, lambda: self._event_signal, self.wait_event, self.metrics.inc)
        self.routes: list[Route] = []
        self.background: list[Callable[[], Awaitable[None]]] = []
        self.loop_watch = LoopWatch()
        self.background.append(self.loop_watch.run)
        self._add_core_routes()

    # -- events ---------------------------------------------------------------------------------------
    async def publish(self, kind: str, target: str | None, payload: Doc) -> int:
        seq = await self.store.append_event(kind, target, payload, self.clock())
        self.metrics.inc(f'tether_events_published_total{{kind="{kind}"}}')
        self.notify()
        return seq

    def notify(self) -> None:
        signal, self._event_signal = self._event_signal, asyncio.Event()
        signal.set()

    async def wait_event(self, after: int, timeout: float, signal: asyncio.Event | None = None) -> None:
        signal = signal or self._event_signal
        waiters = [asyncio.ensure_future(signal.wait()), asyncio.ensure_future(self.store.wait_events(after, timeout))]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    # -- shared operations ------------------------------------------------------------------------------
    async def revoked(self) -> set[str]:
        return set(await self.store.revocations())

    async def graph(self) -> Graph:
        return Graph(await self.store.all_links())

    async def register_chain(self, wire: str) -> tuple[list[Doc], int, list[str]]:
        """Verify a chain and store each of its links; returns (link docs, how many were new, revoked jtis).

        A chain whose every link is already registered is answered even when it has since been revoked or
        has expired: its sidecar, restarted after a termination, must still deliver its spool and
        acknowledge (it never forwards: the answer says which links are revoked). Anything new is verified
        in full, against the revocations, and must respect agent-id ownership."""
        links = parse_chain_unverified(split_chain(wire))
        known = [await self.store.get_link(link.hash) for link in links]
        leaf = known[-1]
        if leaf is not None and leaf.get("chain_hashes") == [link.hash for link in links]:
            revoked = await self.store.revoked_among(list(leaf["chain_jtis"]))
            return [doc for doc in known if doc is not None], 0, sorted(revoked)
        verified = self.verifier.verify(wire, now=self.clock(), revoked=await self.revoked())
        for link, doc in zip(verified.links, known, strict=True):
            other = None if doc is not None else await self.store.link_by_jti(link.jti)
            if other is not None:  # checked before any agent id is claimed (the store checks again, atomically)
                raise _jti_taken(link.jti, other["hash"])
        await self._claim_agent_ids(verified.links, known)
        now = self.clock()
        docs: list[Doc] = []
        jtis: list[str] = []
        hashes: list[str] = []
        for link in verified.links:
            jtis.append(link.jti)
            hashes.append(link.hash)
            docs.append(
                {
                    "hash": link.hash,
                    "jti": link.jti,
                    "iss": link.iss,
                    "sub": link.sub,
                    "prf": link.prf,
                    "compact": link.compact,
                    "claims": dict(link.claims),
                    "registered_at": now,
                    "chain_jtis": list(jtis),
                    "chain_hashes": list(hashes),
                }
            )
        try:
            new = await self.store.put_links(docs)
        except LinkConflict as exc:  # answered, never a 200 for a link that was not stored
            raise _jti_taken(exc.jti, exc.registered) from None
        if new:
            self.metrics.inc("tether_links_registered_total", new)
        return docs, new, []

    async def _claim_agent_ids(self, links: Any, known: list[Doc | None]) -> None:
        """An agent id belongs to the principal that first delegated it: the parent agent (the control plane
        for a root grant; see runs.owner_key for why the agent and not its key). A link for that id issued
        by anyone else is refused, in the same tree as in another; its owner may delegate it again (a
        respawn), and an admin's root grant takes it over. Ids are owned case-insensitively (``Honest`` is
        not free beside another principal's ``honest``: a lookalike in every list). Ownership is claimed
        atomically, so two principals racing for a new id cannot both win."""
        for index, link in enumerate(links):
            if known[index] is not None:
                continue
            issuer = runs.owner_key(None if index == 0 else links[index - 1].sub)
            while True:
                owner = await self.store.get_doc("owner", link.sub.lower())
                if owner is not None and owner["owner"] == issuer:
                    break
                if owner is not None and index > 0:
                    raise ChainInvalid(
                        "agent_id_taken",
                        f"link {index}: agent id {link.sub!r} belongs to another principal (the one that first "
                        "delegated it, or an id differing only in case); delegate under a different id", link=index)
                version = owner["version"] if owner is not None else 0
                claim = {"agent": link.sub, "owner": issuer, "since": self.clock(), "link": link.hash,
                         "version": version + 1}
                if await self.store.cas_doc("owner", link.sub.lower(), version, claim):
                    break

    async def _record_owners(self) -> None:
        """Ids registered before ownership was recorded (an upgrade): each belongs to the issuer of its first
        link. Once, at start-up; racing replicas agree through the store's compare-and-set."""
        if await self.store.list_docs("owner"):
            return
        graph = await self.graph()
        for link in sorted(graph.by_hash.values(), key=lambda d: (d.get("registered_at", 0), d["hash"])):
            parent = graph.by_hash.get(link.get("prf") or "")
            claim = {"agent": link["sub"], "owner": runs.owner_key(parent["sub"] if parent else None),
                     "since": link.get("registered_at", 0), "link": link["hash"], "version": 1}
            await self.store.cas_doc("owner", link["sub"].lower(), 0, claim)  # the first one wins

    async def revoke_link(self, link: Doc, by: str, reason: str, termination_id: str | None = None) -> Doc:
        now = self.clock()
        doc = {
            "jti": link["jti"],
            "agent": link["sub"],
            "by": by,
            "at": now,
            "reason": reason,
            "termination_id": termination_id,
        }
        if await self.store.revoke(link["jti"], doc):
            self.metrics.inc("tether_revocations_total")
            telemetry.revoked(doc, link)
            await self.publish("revoke", None, {"jti": link["jti"], "agent": link["sub"], "at": now})
            return doc
        return (await self.store.revocations()).get(link["jti"], doc)

    async def principal(self, request: web.Request, raw: bytes) -> Caller | None:
        """Who calls an admin-or-ancestor route, decided before anything it names is looked up: ``None`` for
        an admin, the chain holder its proof names otherwise, and 401 for anyone else, so an unauthenticated
        caller learns nothing of which jtis or agents exist."""
        if self.auth.is_admin(request):
            return None
        if self.auth.proof_of(request) is None:
            raise ApiError(401, UNAUTHORIZED,
                           "send the admin token, or a Tether-Proof signed by an ancestor principal's key")
        return await self.auth.sidecar(request, raw)

    @staticmethod
    def ancestor_of(caller: Caller | None, link: Doc) -> str:
        """Authorize an admin (``caller`` None), or a principal that issued ``link`` or any of its ancestors."""
        if caller is None:
            return "admin"
        if caller.link_hash in link.get("chain_hashes", [])[:-1]:
            return f"principal:{caller.agent}"
        raise ApiError(403, FORBIDDEN,
                       f"{caller.agent} is not an ancestor of {link['sub']}'s link; only an issuer above it may act")

    # -- route table ------------------------------------------------------------------------------------
    def route(self, method: str, path: str, handler: Handler, summary: str, auth: str, tag: str = "control",
              **spec: Any) -> None:
        """Add a route; ``spec`` is what the OpenAPI document says of it (``Route``'s fields)."""
        self.routes.append(Route(method, path, handler, summary, auth, tag, **spec))

    def _add_core_routes(self) -> None:
        r = self.route
        r("GET", "/healthz", self.h_healthz, "Liveness and store health", "none", "ops", ok=sc.HEALTH,
          extra_responses={503: {"description": "The store is unreachable",
                                 "content": {"application/json": {"schema": sc.HEALTH}}}})
        r("GET", "/metrics", self.h_metrics, "Prometheus metrics (per-agent series to an admin only)", "none", "ops",
          content="text/plain", ok={"type": "string"})
        r("GET", "/openapi.json", self.h_openapi, "This document", "none", "ops", ok=sc.OPENAPI)
        r("POST", "/v1/grants", self.h_issue, "Issue a root grant for an agent", "admin", "grants",
          body=sc.GRANT_REQUEST, ok=sc.GRANT, status=201)
        r("POST", "/v1/grants/{jti}/revoke", self.h_revoke, "Revoke a link and every chain containing it",
          "admin-or-ancestor", "grants", body=sc.REASON_REQUEST, ok=sc.REVOKED)
        r("POST", "/v1/chains/register", self.h_register, "Register a chain (every link before use)", "sidecar",
          "grants", body=sc.CHAIN_REQUEST, ok=sc.REGISTERED)
        r("POST", "/v1/chains/verify", self.h_verify, "Verify a chain against the keys and revocations", "none",
          "grants", body=sc.CHAIN_REQUEST, ok=sc.VERDICT)
        r("GET", "/v1/agents", self.h_agents, "The agent graph, as a list and a tree", "admin", "agents",
          ok=sc.AGENTS)
        r("POST", "/v1/agents/{agent}/revoke", self.h_revoke_agent, "Revoke every link an agent holds", "admin",
          "agents", body=sc.REASON_REQUEST, ok=sc.AGENT_REVOKED)
        r("GET", "/v1/events", self.h_events, "Sequence-numbered event stream for a sidecar (long poll)", "sidecar",
          "sidecar", ok=sc.EVENTS, query=(
              ("after", sc.INT, "the last sequence number seen (-1 or absent: a full resync)"),
              ("wait", sc.NUM, "seconds to wait for an event (at most 30)")))
        r("GET", "/v1/events/stream", self.h_events_stream, "The same events on one long-lived response: JSON lines, "
          "each a long-poll answer; resume with after=SEQ", "sidecar", "sidecar", content="application/x-ndjson",
          ok={"type": "string"}, query=(("after", sc.INT, "the last sequence number seen (-1 or absent: a resync)"),))
        r("POST", "/v1/sidecars/heartbeat", self.h_heartbeat, "Renew the sidecar run's lease", "sidecar", "sidecar",
          body=sc.HEARTBEAT_REQUEST, ok=sc.LEASE)
        r("POST", "/v1/reports", self.h_reports_in, "Ingest call reports (idempotent on call_id)", "sidecar",
          "sidecar", body=sc.REPORTS_REQUEST, ok=sc.ACCEPTED)
        r("GET", "/v1/reports", self.h_reports_out, "Call reports, optionally for one agent", "admin", "sidecar",
          ok=sc.REPORTS, query=(("agent", sc.STR, "only this agent's calls"),))
        r("POST", "/v1/approvals", self.h_approval_new, "Ask for approval of a held call", "sidecar", "approvals",
          body=sc.APPROVAL_REQUEST, ok=sc.ref("Approval"), status=201)
        r("GET", "/v1/approvals", self.h_approvals, "List approvals", "admin", "approvals", ok=sc.APPROVALS,
          query=(("status", sc.STR, "only approvals in this status (pending, approved, denied, expired)"),))
        r("GET", "/v1/approvals/{id}", self.h_approval_get, "One approval", "admin-or-sidecar", "approvals",
          ok=sc.ref("Approval"))
        r("POST", "/v1/approvals/{id}/approve", self.h_approve, "Approve a held call", "admin", "approvals",
          body=sc.APPROVE_REQUEST, ok=sc.ref("Approval"))
        r("POST", "/v1/approvals/{id}/deny", self.h_deny, "Deny a held call", "admin", "approvals",
          body=sc.obj({}), ok=sc.ref("Approval"))
        r("GET", "/v1/audit/surface", self.h_surface, "Effective capability list per agent", "admin", "audit",
          ok=sc.ref("Surface"), query=(("agent", sc.STR, "only this agent"),))

    def app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY)
        for route in self.routes:
            app.router.add_route(route.method, route.path, route.handler)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        app.on_cleanup.append(self._on_cleanup)
        app["controlplane"] = self
        return app

    async def _on_startup(self, app: web.Application) -> None:
        await self.store.open()
        try:
            await self._record_owners()
        except (StoreUnavailable, ConnectionError, OSError) as exc:  # the API answers 503 until the store is back
            log.warning("could not record agent-id owners at start-up: %s", exc)
        self._tasks = [asyncio.create_task(job()) for job in self.background]

    async def _on_shutdown(self, app: web.Application) -> None:
        await self.events.close()  # open streams end, so the server's wait for its handlers does not hang

    async def _on_cleanup(self, app: web.Application) -> None:
        for task in getattr(self, "_tasks", []):
            task.cancel()
        await asyncio.gather(*getattr(self, "_tasks", []), return_exceptions=True)
        await self.store.close()

    # -- ops ---------------------------------------------------------------------------------------------
    async def h_healthz(self, request: web.Request) -> web.Response:
        ok = await self.store.healthy()
        body = {
            "status": "ok" if ok else "unhealthy",
            "store": "ok" if ok else "unreachable",
            "replica": self.replica,
            "catalog": self.catalog.hash,
        }
        return web.json_response(body, status=200 if ok else 503)

    async def h_metrics(self, request: web.Request) -> web.Response:
        """Prometheus text. Series labelled by agent id name the fleet's agents, so they go to an admin only
        (a scraper sends the admin token as its bearer); anyone else gets the fleet-wide series."""
        per_agent = self.auth.is_admin(request)
        lines = gauge("tether_up", "1 while the control plane serves.", [("", 1)])
        lines += self.loop_watch.lines()
        now = self.clock()
        try:
            sidecars = await self.store.all_sidecars()
            live = sum(1 for s in sidecars.values() if s.get("lease_expires", 0) > now and not s.get("final"))
            lines += gauge("tether_sidecars_leased", "Sidecar runs holding a live lease.", [("", live)])
            _low, high = await self.store.event_bounds()
            lines += gauge("tether_event_seq", "Highest event sequence number.", [("", high)])
            lags: dict[str, int] = {}
            for doc in sidecars.values():
                seen = doc.get("seq")
                if doc.get("final") or doc.get("lease_expires", 0) <= now:
                    continue
                lag = max(0, high - int(seen)) if isinstance(seen, int) and seen >= 0 else 0
                agent = str(doc.get("agent"))
                lags[agent] = max(lag, lags.get(agent, 0))
            lines += gauge("tether_subscriber_lag_events_max", "Events the slowest live sidecar has not read yet.",
                           [("", max(lags.values(), default=0))])
            if per_agent:  # series labelled by agent id name the fleet's agents: an admin's only
                lines += gauge("tether_subscriber_lag_events", "Events a live sidecar has not read yet, per agent.",
                               [(f'{{agent="{_label(agent)}"}}', lag) for agent, lag in sorted(lags.items())])
            active = sum(1 for t in await self.store.list_docs("termination") if t["state"] != "terminated")
            lines += gauge("tether_terminations_in_flight", "Terminations not yet terminated.", [("", active)])
            lines += gauge("tether_event_streams_open", "Sidecars following the event stream on this replica.",
                           [("", self.events.open_streams)])
            lines += gauge("tether_store_up", "1 while the store answers.", [("", 1)])
        except (StoreUnavailable, ConnectionError, OSError):
            lines += gauge("tether_store_up", "1 while the store answers.", [("", 0)])
        lines += self.metrics.render()
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def h_openapi(self, request: web.Request) -> web.Response:
        from .openapi import document

        return web.json_response(document(self.routes))

    # -- grants ---------------------------------------------------------------------------------------
    def _caps_from(self, body: Fields) -> dict[str, Any]:
        caps: dict[str, Any] = {}
        role = body.string("role", max_len=200)
        if role:
            caps.update(self.catalog.role(role))
        raw = body.obj("caps") or {}
        for name, tier in raw.items():
            try:  # a tier, or {tier, calls, per_minute} (DESIGN.md section 10, Budgets)
                read_grant(tier, tiers=TIERS)
            except GrantError as exc:
                raise bad(f"capability {name}: {exc}", capability=name, field="caps") from None
            caps[name] = tier
        self.catalog.require(caps)
        return caps

    async def h_issue(self, request: web.Request) -> web.Response:
        self.auth.require_admin(request)
        body, _ = await read_json(request)
        agent = body.string("agent", required=True, max_len=128)
        key_raw = body.raw("subject_key")
        if isinstance(key_raw, dict):
            subject = keys.from_jwk(key_raw)
        elif isinstance(key_raw, str):
            subject = keys.load_public(key_raw.encode(), "subject_key")
        else:
            raise bad("'subject_key' must be a PEM public key or an Ed25519 JWK", field="subject_key")
        compact = mint_root(
            self.signing_key,
            agent=str(agent),
            subject_key=subject,
            caps=self._caps_from(body),
            now=self.clock(),
            ttl_s=float(body.number("ttl_s", 3600.0, minimum=1, maximum=MAX_TTL_S)),
            depth=int(body.integer("depth", 3, minimum=0, maximum=MAX_LINKS)),
            catalog=self.catalog,
        )
        docs, _, _ = await self.register_chain(compact)
        self.metrics.inc("tether_grants_issued_total")
        return web.json_response(
            {"agent": agent, "jti": docs[0]["jti"], "link": compact, "chain": [compact]}, status=201
        )

    async def h_register(self, request: web.Request) -> web.Response:
        body, raw = await read_json(request)
        wire = _chain_wire(body.raw("chain"))
        if not self.auth.is_admin(request):
            links = parse_chain_unverified(split_chain(wire))
            proof = self.auth.proof_of(request)
            if proof is None or proof.link != links[-1].hash or proof.agent != links[-1].sub:
                raise ApiError(
                    401,
                    UNAUTHORIZED,
                    "register with a Tether-Proof signed by the leaf link's key (or as admin)",
                )
            await self.auth.check(request, proof, links[-1].claims["cnf"]["jwk"], raw)
        docs, new, revoked = await self.register_chain(wire)
        leaf = docs[-1]
        return web.json_response({"agent": leaf["sub"], "link": leaf["hash"], "jtis": leaf["chain_jtis"], "new": new,
                                  "revoked": revoked})

    async def h_verify(self, request: web.Request) -> web.Response:
        body, _ = await read_json(request)
        wire = _chain_wire(body.raw("chain"))
        try:
            verified = self.verifier.verify(wire, now=self.clock(), revoked=await self.revoked())
        except ChainError as exc:
            return web.json_response({"valid": False, "error": exc.to_dict()})
        registered = await self.store.get_link(verified.leaf.hash) is not None
        return web.json_response(
            {
                "valid": True,
                "agent": verified.agent,
                "caps": dict(verified.leaf.claims["caps"]),
                "exp": verified.exp,
                "jtis": list(verified.jtis),
                "registered": registered,
            }
        )

    async def h_revoke(self, request: web.Request) -> web.Response:
        jti = request.match_info["jti"]
        raw = await raw_body(request)
        caller = await self.principal(request, raw)  # before the lookup: no existence oracle
        reason = parse(raw).string("reason", "", max_len=MAX_REASON) or ""
        link = await self.store.link_by_jti(jti)
        if link is None:
            raise ApiError(404, NOT_FOUND, f"no registered link has jti {jti}")
        by = self.ancestor_of(caller, link)
        # The revocation goes out first; who it cut off is read afterwards from the descendants index, at
        # a cost that grows with the subtree, never with the whole graph.
        doc = await self.revoke_link(link, by, reason)
        below = sorted(set((await self.store.descendants(link["hash"])).values()))
        return web.json_response({**doc, "agents_cut_off": [link["sub"], *below]})

    async def h_revoke_agent(self, request: web.Request) -> web.Response:
        self.auth.require_admin(request)
        agent = request.match_info["agent"]
        body, _ = await read_json(request)
        reason = body.string("reason", "", max_len=MAX_REASON) or ""
        links = (await self.graph()).links_of(agent)
        if not links:
            raise ApiError(404, NOT_FOUND, f"no registered link is held by {agent}")
        docs = [await self.revoke_link(link, "admin", reason) for link in links]
        return web.json_response({"agent": agent, "revoked": docs})

    # -- agents -----------------------------------------------------------------------------------------
    async def h_agents(self, request: web.Request) -> web.Response:
        self.auth.require_admin(request)
        graph = await self.graph()
        revocations = await self.store.revocations()
        runs_of: dict[str, list[Doc]] = {}
        for run in (await self.store.all_sidecars()).values():
            if run.get("link"):
                runs_of.setdefault(run["link"], []).append(run)
        now = self.clock()

        def node_doc(link: Doc) -> Doc:
            revoked_by = graph.revoked_in_chain(link["hash"], revocations)
            mine = sorted(runs_of.get(link["hash"], []), key=lambda r: (r.get("started_at") or 0, r["run_id"]))
            latest = max(mine, key=lambda r: r.get("last_seen") or 0) if mine else None
            claims = link["claims"]
            status = "revoked" if revoked_by else ("expired" if claims["exp"] <= now else "active")
            return {
                "agent": link["sub"],
                "jti": link["jti"],
                "link": link["hash"],
                "issuer": link["iss"],
                "parent_link": link.get("prf"),
                "caps": claims["caps"],
                "depth": claims["dpth"],
                "exp": claims["exp"],
                "status": status,
                "revoked": revocations.get(link["jti"]),
                "revoked_via": revoked_by,
                "sidecar": runs.run_view(latest, now) if latest else None,
                "runs": [runs.run_view(r, now) for r in mine],
            }

        def tree(node: Any) -> Doc:
            return {**node_doc(node.link), "children": [tree(c) for c in node.children]}

        return web.json_response(
            {
                "agents": [node_doc(link) for link in graph.by_hash.values()],
                "tree": [tree(root) for root in graph.forest()],
            }
        )

    # -- sidecar channel -----------------------------------------------------------------------------------
    async def h_events(self, request: web.Request) -> web.Response:
        caller = await self.auth.sidecar(request, await raw_body(request))
        after = query_int(request, "after", -1)
        wait = max(0.0, min(query_number(request, "wait", 0.0), 30.0))
        link = caller.link
        chain_jtis = set(link.get("chain_jtis", [link["jti"]]))
        low, high = await self.store.event_bounds()
        if after < 0 or after < low - 1 or after > high:
            return web.json_response(await self._resync(caller.link_hash, chain_jtis, high))
        deadline = self.clock() + wait
        while True:
            signal = self._event_signal  # taken before reading, so a publish meanwhile still wakes us
            events = await self.events_after(after)
            seen = [e.to_dict() for e in events if visible(e, caller.link_hash, chain_jtis)]
            if events:
                after = events[-1].seq
            remaining = deadline - self.clock()
            if seen or remaining <= 0 or len(events) == 500:
                self.metrics.inc("tether_events_delivered_total", len(seen))
                return web.json_response({"events": seen, "next": after})
            await self.wait_event(after, remaining, signal)

    async def h_events_stream(self, request: web.Request) -> web.StreamResponse:
        """The long poll's documents, one per line, on one response that stays open (see event_stream.py).
        The subscriber is registered before anything is read, so no event falls between the catch-up read
        from the store and the shared fan-out that follows it."""
        caller = await self.auth.sidecar(request, await raw_body(request))
        after = query_int(request, "after", -1)
        jtis = frozenset(_chain_jtis(caller.link))
        sub = await self.events.subscribe(caller.link_hash, jtis)
        try:
            position = self.events.position
            low, high = await self.store.event_bounds()
            if after < 0 or after < low - 1 or after > high:
                opening, sent = await self._resync(caller.link_hash, set(jtis), high), high
            else:
                caught: list[Doc] = []
                sent = after
                while sent < position:  # what this client missed, read for it alone
                    events = [e for e in await self.store.events_after(sent, 500) if e.seq <= position]
                    if not events:
                        break
                    caught += [e.to_dict() for e in events if visible(e, caller.link_hash, jtis)]
                    sent = events[-1].seq
                sent = max(sent, position, after)
                opening = {"events": caught, "next": sent}
                self.metrics.inc("tether_events_delivered_total", len(caught))
            response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson",
                                                   "Cache-Control": "no-store", "X-Accel-Buffering": "no"})
            await response.prepare(request)
            self.metrics.inc("tether_event_streams_opened_total")
            try:
                await response.write(encode(opening))  # with the headers: from here on, whole chunks only
                while sub.pending:  # what arrived while the opening was read and written
                    lines = [line for seq, line in sub.pending if seq > sent]
                    sent = max(sent, sub.pending[-1][0])
                    sub.pending.clear()
                    if lines:
                        await response.write(b"".join(lines))
                if request.transport is None:
                    return response
                sub.attach(request.transport, sent)  # the fan-out writes to the socket directly from now on
                while sub.closed is None:
                    sub.wake.clear()
                    try:
                        await asyncio.wait_for(sub.wake.wait(), KEEPALIVE_S)
                    except TimeoutError:  # also moves the client's cursor past events it does not see
                        sub.sent = max(sub.sent, self.events.position)
                        await response.write(encode({"events": [], "next": sub.sent}))
            except (ConnectionError, OSError):
                pass  # the sidecar went away; it resumes from its last sequence number
            return response
        finally:
            self.events.unsubscribe(sub)

    async def events_after(self, after: int) -> list[Event]:
        """One store read shared by every long poll waiting at the same sequence (a revocation wakes them
        all at once; without this each would read the same event again)."""
        shared = self._event_reads.get(after)
        if shared is None:
            shared = asyncio.ensure_future(self.store.events_after(after, 500))
            self._event_reads[after] = shared
            shared.add_done_callback(lambda _f, key=after: self._event_reads.pop(key, None))
        return await asyncio.shield(shared)

    async def _resync(self, link_hash: str, chain_jtis: set[str], high: int) -> Doc:
        revocations = await self.store.revocations()
        command = await self.store.get_doc("command", link_hash)
        approvals = [
            a for a in await self.store.list_docs("approval") if a.get("link") == link_hash and a["status"] != "pending"
        ]
        self.metrics.inc("tether_event_resyncs_total")
        return {
            "resync": True,
            "next": high,
            "revoked": sorted(chain_jtis & set(revocations)),
            "command": command,
            "approvals": approvals,
            "events": [],
        }

    async def h_heartbeat(self, request: web.Request) -> web.Response:
        """Renew a run's lease. The in-flight list and state belong to this run alone: a second run (a
        restart, a respawn under a new link) has its own document and never overwrites this one."""
        raw = await raw_body(request)
        caller = await self.auth.run_of(request, raw)
        body = parse(raw, "the heartbeat body")
        inflight = body.objects("inflight")
        state = body.string("state", "serving", max_len=32) or "serving"
        seq = body.integer("seq", nullable=True)
        proxy = body.string("proxy", max_len=200)
        pid = body.integer("pid", nullable=True)
        started_at = body.number("started_at", nullable=True)
        spooled = body.integer("spooled", 0, nullable=True, minimum=0)
        supersedes = body.string("supersedes", max_len=64)
        now = self.clock()
        run = str(caller.run)
        previous = await self.store.get_sidecar(run) or {}  # bound to this link by run_of
        doc = {
            **previous,
            "run_id": run,
            "agent": caller.agent,
            "link": caller.link_hash,
            "last_seen": now,
            "lease_expires": now + self.lease_ttl_s,
            "state": state,
            "inflight": inflight[:10_000],
            "seq": seq,
            "proxy": proxy or None,
            "pid": pid,
            "started_at": started_at,
            "spooled": spooled,
            "replica": self.replica,
        }
        doc["revocations_acknowledged"] = await revocations_acknowledged(self.store, self.metrics, doc, body.doc, now)
        if doc["state"] == runs.STOPPED and not previous.get("final"):
            doc.update(final=runs.STOPPED, final_at=now)  # the goodbye: its reports are in, nothing passes
        await self.store.put_sidecar(run, doc)
        if supersedes is not None and supersedes != run:
            await self._supersede(caller, supersedes, now)
        self.metrics.inc("tether_heartbeats_total")
        return web.json_response(
            {
                "lease_ttl_s": self.lease_ttl_s,
                "lease_expires_at": doc["lease_expires"],
                "now": now,
                "run_id": run,
                "command": await self.store.get_doc("command", caller.link_hash),
                # Belt and braces: a revocation whose event was lost still reaches the sidecar here.
                "revoked": sorted(await self.store.revoked_among(_chain_jtis(caller.link))),
            }
        )

    async def _supersede(self, caller: Caller, old_run: str, now: float) -> None:
        """A sidecar restarted on the same state dir (whose lock proves the old process is gone) took over
        its predecessor's spool: the old run answers through the new one from now on."""
        old = await self.store.get_sidecar(old_run)
        if old is None or old.get("link") != caller.link_hash or old.get("final"):
            return
        await self.store.put_sidecar(old_run, {**old, "final": runs.SUPERSEDED, "final_at": now,
                                               "superseded_by": caller.run})

    async def mark_run_final(self, caller: Caller, state: str) -> None:
        run = str(caller.run)
        doc = await self.store.get_sidecar(run) or {"run_id": run, "agent": caller.agent, "link": caller.link_hash}
        if doc.get("final") != state:
            await self.store.put_sidecar(run, {**doc, "final": state, "final_at": self.clock(), "state": state})

    async def ingest_reports(self, caller: Caller, reports: list[Doc], starts: list[Doc]) -> tuple[int, int]:
        """The one way call reports come in (batches and acknowledgements alike): each is checked, stamped
        with the agent, link and run that delivered it, and stored idempotently on ``call_id``. ``starts``
        are calls written ahead before they left; a final report always supersedes its start."""
        now = self.clock()

        def stamped(items: list[Doc], what: str) -> list[Doc]:
            out: list[Doc] = []
            for index, item in enumerate(items):
                fields = Fields(item, f"{what}[{index}]")
                fields.string("call_id", required=True, nullable=False, max_len=200, non_empty=True)
                if fields.raw("agent", caller.agent) != caller.agent:
                    raise ApiError(403, FORBIDDEN, f"{caller.agent} cannot report calls of {item.get('agent')}")
                fields.string("run_id", max_len=64)  # the run that delivers it is the one recorded
                out.append({**item, "agent": caller.agent, "link": caller.link_hash, "run_id": caller.run,
                            "received_at": now})
            return out

        clean, early = stamped(reports, "reports"), stamped(starts, "starts")
        if early:
            await self.store.put_starts(early)
        new, dup = stored = await self.store.put_reports(clean)
        for report in clean:
            if report["call_id"] in stored.new_ids:
                self.metrics.call_reported(report)
        self.metrics.inc("tether_reports_total", new)
        self.metrics.inc("tether_reports_duplicate_total", dup)
        return new, dup

    async def h_reports_in(self, request: web.Request) -> web.Response:
        raw = await raw_body(request)
        caller = await self.auth.run_of(request, raw)
        body = parse(raw, "the report batch")
        new, dup = await self.ingest_reports(caller, body.objects("reports"), body.objects("starts"))
        return web.json_response({"accepted": new, "duplicates": dup})

    async def h_reports_out(self, request: web.Request) -> web.Response:
        self.auth.require_admin(request)
        agent = request.query.get("agent")
        return web.json_response(await self.store.reports([agent] if agent else None))

    # -- approvals -------------------------------------------------------------------------------------
    async def h_approval_new(self, request: web.Request) -> web.Response:
        raw = await raw_body(request)
        caller = await self.auth.run_of(request, raw)
        agent, link = caller.agent, caller.link
        body = parse(raw, "the approval request")
        call_id = body.string("call_id", required=True, nullable=False, max_len=200, non_empty=True)
        capability = body.string("capability", max_len=200)
        method = body.string("method", max_len=32)
        url = body.string("url", max_len=8192)
        summary = (body.string("summary", "", max_len=64 * 1024) or "")[:500]
        # A longer wait than a day is shortened to a day, as it always was; a wait that is not a number is refused.
        ttl = min(float(body.number("timeout_s", self.approval_ttl_s, minimum=0) or 0.0), 24 * 3600)
        held = _held_request(body.obj("request"))
        now = self.clock()
        approval_id = "apr-" + os.urandom(6).hex()
        chain = [await self.store.get_link(h) for h in link.get("chain_hashes", [link["hash"]])]
        doc = {
            "id": approval_id,
            "agent": agent,
            "link": caller.link_hash,
            "run_id": caller.run,
            "call_id": call_id,
            "capability": capability,
            "method": method,
            "url": url,
            "summary": summary,
            # What the approver decides on: the exact request (redacted by the sidecar as captures are), its
            # hash, where the agent sits (agent ids from the root) and who may decide.
            "request": held,
            "call_hash": held.get("call_hash") if held else None,
            "chain": [c["sub"] if c else "?" for c in chain],
            "deciders": ["admin"],
            "status": "pending",
            "requested_at": now,
            "expires_at": now + ttl,
            "decided_at": None,
            "decided_by": None,
            "version": 1,
        }
        await self.store.put_doc("approval", approval_id, doc)
        self.metrics.inc("tether_approvals_requested_total")
        return web.json_response(doc, status=201)

    def _approval_view(self, doc: Doc) -> Doc:
        if doc["status"] == "pending" and doc["expires_at"] <= self.clock():
            return {**doc, "status": "expired"}
        return doc

    async def h_approvals(self, request: web.Request) -> web.Response:
        self.auth.require_admin(request)
        status = request.query.get("status")
        docs = [self._approval_view(d) for d in await self.store.list_docs("approval")]
        return web.json_response([d for d in docs if status in (None, d["status"])])

    async def h_approval_get(self, request: web.Request) -> web.Response:
        doc = await self.store.get_doc("approval", request.match_info["id"])
        if not self.auth.is_admin(request):
            caller = await self.auth.sidecar(request, await raw_body(request))
            if doc is not None and doc.get("link", caller.link_hash) != caller.link_hash:
                doc = None
        if doc is None:
            raise ApiError(404, NOT_FOUND, f"no approval {request.match_info['id']}")
        return web.json_response(self._approval_view(doc))

    async def decide(self, approval_id: str, decision: str, by: str, call_hash: str | None = None) -> Doc:
        doc = await self.store.get_doc("approval", approval_id)
        if doc is None:
            raise ApiError(404, NOT_FOUND, f"no approval {approval_id}")
        view = self._approval_view(doc)
        if view["status"] != "pending":
            raise ApiError(409, CONFLICT, f"approval {approval_id} is already {view['status']}")
        if decision == APPROVED:
            await self._still_possible(doc)
        if call_hash is not None and call_hash != doc.get("call_hash"):
            raise ApiError(409, CONFLICT, f"approval {approval_id} holds call {doc.get('call_hash')}, not {call_hash}: "
                           "look at the call again before deciding", call_hash=doc.get("call_hash"))
        new = {**doc, "status": decision, "decided_at": self.clock(), "decided_by": by, "version": doc["version"] + 1}
        if not await self.store.cas_doc("approval", approval_id, doc["version"], new):
            raise ApiError(409, CONFLICT, f"approval {approval_id} was decided concurrently")
        await self.publish(
            "approval",
            doc.get("link") or doc["agent"],
            {"id": approval_id, "call_id": doc["call_id"], "status": decision, "decided_by": by,
             "call_hash": doc.get("call_hash")},
        )
        return new

    async def _still_possible(self, approval: Doc) -> None:
        """Approving a call that can no longer go would say "approved" while the sidecar refuses it: say so."""
        link = await self.store.get_link(approval["link"]) if approval.get("link") else None
        if link is None:
            return
        revoked = await self.store.revoked_among(_chain_jtis(link))
        if revoked:
            raise ApiError(409, "tether.chain_revoked", f"{approval['agent']}'s chain is revoked "
                           f"({', '.join(sorted(revoked))}): the held call can no longer be forwarded")
        if link["claims"]["exp"] <= self.clock():
            raise ApiError(409, "tether.chain_expired", f"{approval['agent']}'s chain has expired: the held call "
                           "can no longer be forwarded")
        run = await self.store.get_sidecar(approval["run_id"]) if approval.get("run_id") else None
        if run is not None and run.get("final"):
            raise ApiError(409, "tether.terminated", f"the sidecar run that holds this call is {run['final']}")

    async def h_approve(self, request: web.Request) -> web.Response:
        self.auth.require_admin(request)
        body, _ = await read_json(request)
        call_hash = body.string("call_hash", max_len=200)
        return web.json_response(await self.decide(request.match_info["id"], APPROVED, "admin", call_hash))

    async def h_deny(self, request: web.Request) -> web.Response:
        self.auth.require_admin(request)
        await read_json(request)  # no fields, but a body that is not an object is refused as everywhere
        return web.json_response(await self.decide(request.match_info["id"], DENIED, "admin"))

    # -- audit ---------------------------------------------------------------------------------------------
    async def h_surface(self, request: web.Request) -> web.Response:
        self.auth.require_admin(request)
        agent = request.query.get("agent")
        graph = await self.graph()
        if agent is not None and not graph.links_of(agent):
            raise ApiError(404, NOT_FOUND, f"no registered link is held by {agent}")
        return web.json_response(surface(self.catalog, graph, await self.revoked(), self.clock(), agent))


def _held_request(value: Doc | None) -> Doc | None:
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


def _jti_taken(jti: str, registered: str) -> ApiError:
    return ApiError(409, CONFLICT, f"jti {jti} already names another registered link ({registered}); a jti names "
                    "one link only: mint the link again", jti=jti)



def _chain_jtis(link: Doc) -> list[str]:
    return list(link.get("chain_jtis", [link["jti"]]))


def _label(value: str) -> str:
    """A Prometheus label value, escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
