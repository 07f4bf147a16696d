"""The control plane's HTTP API (aiohttp): grants, chains, revocation, events, leases, reports, approvals.

Handlers are thin: they authenticate, validate, call the store and the pure model, and answer JSON.
Every refusal is ``{"error": {"code", "message", ...}}`` with a ``Tether-Error`` header.
Termination and records live in ``termination_service.py`` and register their routes here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from . import runs
from .auth import Authenticator, Caller
from .capability import keys
from .capability.catalog import TIERS, Catalog
from .capability.chain import (
    ChainInvalid,
    Verifier,
    mint_root,
    parse_chain_unverified,
    split_chain,
)
from .capability.errors import (
    BAD_REQUEST,
    CONFLICT,
    FORBIDDEN,
    NOT_FOUND,
    STORE_UNAVAILABLE,
    ApiError,
    ChainError,
    TetherError,
)
from .event_stream import KEEPALIVE_S, EventHub, encode, visible
from .graph import Graph, surface
from .store import Doc, Event, Store, StoreUnavailable

log = logging.getLogger("tether.controlplane")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
DEFAULT_LEASE_TTL_S = 15.0
DEFAULT_APPROVAL_TTL_S = 300.0
MAX_BODY = 8 * 1024 * 1024


@dataclass
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    auth: str  # "none" | "admin" | "sidecar" | "admin-or-ancestor"
    tag: str = "control"
    produces: str = "application/json"


@dataclass
class Metrics:
    counters: dict[str, float] = field(default_factory=dict)

    def inc(self, name: str, by: float = 1.0) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + by


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
    except web.HTTPException:
        raise
    except (ConnectionError, OSError) as exc:
        log.warning("store error on %s %s: %s", request.method, request.path, exc)
        return json_error(503, STORE_UNAVAILABLE, f"the store is unavailable: {exc}")
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return json_error(500, "tether.internal", "internal error; the control plane log has the details")


def _bad(message: str, **details: Any) -> ApiError:
    return ApiError(400, BAD_REQUEST, message, **details)


async def read_json(request: web.Request) -> tuple[Any, bytes]:
    body = await request.read()
    if not body:
        return {}, body
    try:
        return json.loads(body), body
    except ValueError:
        raise _bad("the request body is not valid JSON") from None


def _chain_wire(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    if isinstance(value, str):
        return value
    raise _bad("'chain' must be the comma-joined links or a list of links")


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
        self.metrics = Metrics()
        self._event_signal = asyncio.Event()
        self._event_reads: dict[int, asyncio.Future[list[Event]]] = {}
        self.events = EventHub(store, lambda: self._event_signal, self.wait_event, self.metrics.inc)
        self.routes: list[Route] = []
        self.background: list[Callable[[], Awaitable[None]]] = []
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
        new = await self.store.put_links(docs)
        if new:
            self.metrics.inc("tether_links_registered_total", new)
        return docs, new, []

    async def _claim_agent_ids(self, links: Any, known: list[Doc | None]) -> None:
        """An agent id belongs to the principal that first delegated it: the parent agent (the control plane
        for a root grant; see runs.owner_key for why the agent and not its key). A link for that id issued
        by anyone else is refused, in the same tree as in another; its owner may delegate it again (a
        respawn), and an admin's root grant takes it over. Ownership is claimed atomically, so two
        principals racing for a new id cannot both win."""
        for index, link in enumerate(links):
            if known[index] is not None:
                continue
            issuer = runs.owner_key(None if index == 0 else links[index - 1].sub)
            while True:
                owner = await self.store.get_doc("owner", link.sub)
                if owner is None:
                    owner = await self._owner_from_history(link.sub)
                if owner is not None and owner["owner"] == issuer:
                    break
                if owner is not None and index > 0:
                    raise ChainInvalid(
                        "agent_id_taken",
                        f"link {index}: agent id {link.sub!r} belongs to another principal (the one that first "
                        "delegated it); delegate under a different id", link=index)
                version = owner["version"] if owner is not None and "version" in owner else 0
                claim = {"agent": link.sub, "owner": issuer, "since": self.clock(), "link": link.hash,
                         "version": version + 1}
                if await self.store.cas_doc("owner", link.sub, version, claim):
                    break

    async def _owner_from_history(self, agent: str) -> Doc | None:
        """The owner of an id registered before ownership was recorded: the issuer of its first link (found
        by the store's index on the subject: registering a new agent id must not load every link)."""
        earliest = sorted(await self.store.links_held_by(agent), key=lambda d: (d.get("registered_at", 0), d["hash"]))
        if not earliest:
            return None
        first = earliest[0]
        parent = await self.store.get_link(first["prf"]) if first.get("prf") else None
        return {"agent": agent, "owner": runs.owner_key(parent["sub"] if parent else None), "link": first["hash"]}

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
            await self.publish("revoke", None, {"jti": link["jti"], "agent": link["sub"], "at": now})
            return doc
        return (await self.store.revocations()).get(link["jti"], doc)

    async def may_act_as_ancestor(self, request: web.Request, link: Doc, body: bytes,
                                  replay_checked: bool = False) -> str:
        """Authorize an admin, or a principal that issued ``link`` or any of its ancestors."""
        if self.auth.is_admin(request):
            return "admin"
        proof = self.auth.proof_of(request)
        if proof is None:
            raise ApiError(
                401,
                "tether.unauthorized",
                "send the admin token, or a Tether-Proof signed by an ancestor principal's key",
            )
        for ancestor_hash in reversed(link.get("chain_hashes", [])[:-1]):  # parent first; no graph load
            ancestor = await self.store.get_link(ancestor_hash)
            if ancestor is None:
                continue
            if ancestor["hash"] == proof.link and ancestor["sub"] == proof.agent:
                await self.auth.check(request, proof, ancestor["claims"]["cnf"]["jwk"], body,
                                      consume=not replay_checked)
                return f"principal:{proof.agent}"
        raise ApiError(
            403, FORBIDDEN, f"{proof.agent} is not an ancestor of {link['sub']}'s link; only an issuer above it may act"
        )

    # -- route table ------------------------------------------------------------------------------------
    def route(self, method: str, path: str, handler: Handler, summary: str, auth: str, tag: str = "control",
              produces: str = "application/json") -> None:
        self.routes.append(Route(method, path, handler, summary, auth, tag, produces))

    def _add_core_routes(self) -> None:
        r = self.route
        r("GET", "/healthz", self.h_healthz, "Liveness and store health", "none", "ops")
        r("GET", "/metrics", self.h_metrics, "Prometheus metrics", "none", "ops")
        r("GET", "/openapi.json", self.h_openapi, "This document", "none", "ops")
        r("POST", "/v1/grants", self.h_issue, "Issue a root grant for an agent", "admin", "grants")
        r(
            "POST",
            "/v1/grants/{jti}/revoke",
            self.h_revoke,
            "Revoke a link and every chain containing it",
            "admin-or-ancestor",
            "grants",
        )
        r(
            "POST",
            "/v1/chains/register",
            self.h_register,
            "Register a chain (every link before use)",
            "sidecar",
            "grants",
        )
        r(
            "POST",
            "/v1/chains/verify",
            self.h_verify,
            "Verify a chain against the keys and revocations",
            "none",
            "grants",
        )
        r("GET", "/v1/agents", self.h_agents, "The agent graph, as a list and a tree", "admin", "agents")
        r(
            "POST",
            "/v1/agents/{agent}/revoke",
            self.h_revoke_agent,
            "Revoke every link an agent holds",
            "admin",
            "agents",
        )
        r(
            "GET",
            "/v1/events",
            self.h_events,
            "Sequence-numbered event stream for a sidecar (long poll)",
            "sidecar",
            "sidecar",
        )
        r(
            "GET",
            "/v1/events/stream",
            self.h_events_stream,
            "The same events on one long-lived response: JSON lines, each a long-poll answer; resume with after=SEQ",
            "sidecar",
            "sidecar",
            produces="application/x-ndjson",
        )
        r("POST", "/v1/sidecars/heartbeat", self.h_heartbeat, "Renew the sidecar's lease", "sidecar", "sidecar")
        r("POST", "/v1/reports", self.h_reports_in, "Ingest call reports (idempotent on call_id)", "sidecar", "sidecar")
        r("GET", "/v1/reports", self.h_reports_out, "Call reports, optionally for one agent", "admin", "sidecar")
        r("POST", "/v1/approvals", self.h_approval_new, "Ask for approval of a held call", "sidecar", "approvals")
        r("GET", "/v1/approvals", self.h_approvals, "List approvals", "admin", "approvals")
        r("GET", "/v1/approvals/{id}", self.h_approval_get, "One approval", "admin-or-sidecar", "approvals")
        r("POST", "/v1/approvals/{id}/approve", self.h_approve, "Approve a held call", "admin", "approvals")
        r("POST", "/v1/approvals/{id}/deny", self.h_deny, "Deny a held call", "admin", "approvals")
        r("GET", "/v1/audit/surface", self.h_surface, "Effective capability list per agent", "admin", "audit")

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
        lines = [
            "# HELP tether_up 1 while the control plane serves.",
            "# TYPE tether_up gauge",
            "tether_up 1",
        ]
        now = self.clock()
        try:
            sidecars = await self.store.all_sidecars()
            live = sum(1 for s in sidecars.values() if s.get("lease_expires", 0) > now and not s.get("final"))
            lines += ["# TYPE tether_sidecars_leased gauge", f"tether_sidecars_leased {live}"]
            _low, high = await self.store.event_bounds()
            lines += ["# TYPE tether_event_seq gauge", f"tether_event_seq {high}"]
            lines.append("# TYPE tether_subscriber_lag_events gauge")
            lags: dict[str, int] = {}
            for doc in sidecars.values():
                seen = doc.get("seq")
                if doc.get("final") or doc.get("lease_expires", 0) <= now:
                    continue
                lag = max(0, high - int(seen)) if isinstance(seen, int) and seen >= 0 else 0
                agent = str(doc.get("agent"))
                lags[agent] = max(lag, lags.get(agent, 0))
            for agent, lag in sorted(lags.items()):
                lines.append(f'tether_subscriber_lag_events{{agent="{_label(agent)}"}} {lag}')
            active = sum(1 for t in await self.store.list_docs("termination") if t["state"] != "terminated")
            lines += ["# TYPE tether_terminations_in_flight gauge", f"tether_terminations_in_flight {active}"]
            lines += ["# TYPE tether_event_streams_open gauge", f"tether_event_streams_open {self.events.open_streams}"]
            lines += ["# TYPE tether_store_up gauge", "tether_store_up 1"]
        except (StoreUnavailable, ConnectionError, OSError):
            lines += ["# TYPE tether_store_up gauge", "tether_store_up 0"]
        names = sorted(self.metrics.counters)
        for name in names:
            lines.append(f"{name} {self.metrics.counters[name]:g}")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def h_openapi(self, request: web.Request) -> web.Response:
        from .openapi import document

        return web.json_response(document(self.routes))

    # -- grants ---------------------------------------------------------------------------------------
    def _caps_from(self, body: Doc) -> dict[str, str]:
        caps: dict[str, str] = {}
        if body.get("role"):
            caps.update(self.catalog.role(str(body["role"])))
        raw = body.get("caps") or {}
        if not isinstance(raw, dict):
            raise _bad("'caps' must map capability names to tiers")
        for name, tier in raw.items():
            if tier not in TIERS:
                raise _bad(f"capability {name}: tier must be one of {', '.join(TIERS)}", capability=name)
            caps[str(name)] = tier
        self.catalog.require(caps)
        return caps

    async def h_issue(self, request: web.Request) -> web.Response:
        self.auth.require_admin(request)
        body, _ = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("agent"), str):
            raise _bad("body needs 'agent', 'subject_key' (PEM or JWK) and 'caps' or 'role'")
        key_raw = body.get("subject_key")
        if isinstance(key_raw, dict):
            subject = keys.from_jwk(key_raw)
        elif isinstance(key_raw, str):
            subject = keys.load_public(key_raw.encode(), "subject_key")
        else:
            raise _bad("'subject_key' must be a PEM public key or an Ed25519 JWK")
        try:
            ttl = float(body.get("ttl_s", 3600))
            depth = int(body.get("depth", 3))
        except (TypeError, ValueError):
            raise _bad("'ttl_s' and 'depth' must be numbers") from None
        compact = mint_root(
            self.signing_key,
            agent=body["agent"],
            subject_key=subject,
            caps=self._caps_from(body),
            now=self.clock(),
            ttl_s=ttl,
            depth=depth,
            catalog=self.catalog,
        )
        docs, _, _ = await self.register_chain(compact)
        self.metrics.inc("tether_grants_issued_total")
        return web.json_response(
            {"agent": body["agent"], "jti": docs[0]["jti"], "link": compact, "chain": [compact]}, status=201
        )

    async def h_register(self, request: web.Request) -> web.Response:
        body, raw = await read_json(request)
        if not isinstance(body, dict) or "chain" not in body:
            raise _bad("body needs 'chain'")
        wire = _chain_wire(body["chain"])
        if not self.auth.is_admin(request):
            links = parse_chain_unverified(split_chain(wire))
            proof = self.auth.proof_of(request)
            if proof is None or proof.link != links[-1].hash or proof.agent != links[-1].sub:
                raise ApiError(
                    401,
                    "tether.unauthorized",
                    "register with a Tether-Proof signed by the leaf link's key (or as admin)",
                )
            await self.auth.check(request, proof, links[-1].claims["cnf"]["jwk"], raw)
        docs, new, revoked = await self.register_chain(wire)
        leaf = docs[-1]
        return web.json_response({"agent": leaf["sub"], "link": leaf["hash"], "jtis": leaf["chain_jtis"], "new": new,
                                  "revoked": revoked})

    async def h_verify(self, request: web.Request) -> web.Response:
        body, _ = await read_json(request)
        if not isinstance(body, dict) or "chain" not in body:
            raise _bad("body needs 'chain'")
        wire = _chain_wire(body["chain"])
        try:
            verified = self.verifier.verify(wire, now=self.clock(), revoked=await self.revoked())
        except ChainError as exc:
            return web.json_response({"valid": False, "error": exc.to_dict()})
        registered = await self.store.get_link(verified.leaf.hash) is not None
        return web.json_response(
            {
                "valid": True,
                "agent": verified.agent,
                "caps": dict(verified.caps),
                "exp": verified.exp,
                "jtis": list(verified.jtis),
                "registered": registered,
            }
        )

    async def h_revoke(self, request: web.Request) -> web.Response:
        jti = request.match_info["jti"]
        body, raw = await read_json(request)
        link = await self.store.link_by_jti(jti)
        if link is None:
            raise ApiError(404, NOT_FOUND, f"no registered link has jti {jti}")
        by = await self.may_act_as_ancestor(request, link, raw)
        reason = str(body.get("reason", "")) if isinstance(body, dict) else ""
        # The revocation goes out first; who it cut off is read afterwards from the descendants index, at
        # a cost that grows with the subtree, never with the whole graph.
        doc = await self.revoke_link(link, by, reason)
        below = sorted(set((await self.store.descendants(link["hash"])).values()))
        return web.json_response({**doc, "agents_cut_off": [link["sub"], *below]})

    async def h_revoke_agent(self, request: web.Request) -> web.Response:
        self.auth.require_admin(request)
        agent = request.match_info["agent"]
        graph = await self.graph()
        links = graph.links_of(agent)
        if not links:
            raise ApiError(404, NOT_FOUND, f"no registered link is held by {agent}")
        body, _ = await read_json(request)
        reason = str(body.get("reason", "")) if isinstance(body, dict) else ""
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
        caller = await self.auth.sidecar(request, await request.read())
        try:
            after = int(request.query.get("after", "-1"))
            wait = max(0.0, min(float(request.query.get("wait", "0")), 30.0))
        except ValueError:
            raise _bad("'after' must be an integer and 'wait' a number of seconds") from None
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
        caller = await self.auth.sidecar(request, await request.read())
        try:
            after = int(request.query.get("after", "-1"))
        except ValueError:
            raise _bad("'after' must be an integer") from None
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
        raw = await request.read()
        caller = await self.auth.run_of(request, raw)
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise _bad("the heartbeat body is not JSON") from None
        if not isinstance(body, dict):
            raise _bad("the heartbeat body must be an object")
        inflight = body.get("inflight", [])
        if not isinstance(inflight, list) or not all(isinstance(c, dict) for c in inflight):
            raise _bad("'inflight' must be a list of call objects")
        now = self.clock()
        run = str(caller.run)
        previous = await self.store.get_sidecar(run) or {}
        if previous and previous.get("link") != caller.link_hash:
            raise ApiError(403, FORBIDDEN, f"run {run} belongs to another link")
        doc = {
            **previous,
            "run_id": run,
            "agent": caller.agent,
            "link": caller.link_hash,
            "last_seen": now,
            "lease_expires": now + self.lease_ttl_s,
            "state": str(body.get("state", "serving"))[:32],
            "inflight": inflight[:10_000],
            "seq": body.get("seq") if isinstance(body.get("seq"), int) else None,
            "proxy": str(body["proxy"])[:200] if body.get("proxy") else None,
            "pid": body.get("pid") if isinstance(body.get("pid"), int) else None,
            "started_at": body.get("started_at") if isinstance(body.get("started_at"), int | float) else None,
            "spooled": body.get("spooled") if isinstance(body.get("spooled"), int) else 0,
            "replica": self.replica,
        }
        if doc["state"] == runs.STOPPED and not previous.get("final"):
            doc.update(final=runs.STOPPED, final_at=now)  # the goodbye: its reports are in, nothing passes
        await self.store.put_sidecar(run, doc)
        supersedes = body.get("supersedes")
        if isinstance(supersedes, str) and supersedes != run:
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

    async def ingest_reports(self, caller: Caller, reports: Any, starts: Any = ()) -> tuple[int, int]:
        """The one way call reports come in (batches and acknowledgements alike): each is checked, stamped
        with the agent, link and run that delivered it, and stored idempotently on ``call_id``. ``starts``
        are calls written ahead before they left; a final report always supersedes its start."""
        if not isinstance(reports, list) or not isinstance(starts, list):
            raise _bad("'reports' and 'starts' must be lists")
        now = self.clock()

        def stamped(items: list[Any]) -> list[Doc]:
            out: list[Doc] = []
            for item in items:
                if not isinstance(item, dict) or not isinstance(item.get("call_id"), str) or not item["call_id"]:
                    raise _bad("every report needs a 'call_id'")
                if item.get("agent", caller.agent) != caller.agent:
                    raise ApiError(403, FORBIDDEN, f"{caller.agent} cannot report calls of {item.get('agent')}")
                run = item.get("run_id") if isinstance(item.get("run_id"), str) else caller.run
                out.append({**item, "agent": caller.agent, "link": caller.link_hash, "run_id": run,
                            "received_at": now})
            return out

        clean, early = stamped(reports), stamped(starts)
        if early:
            await self.store.put_starts(early)
        new, dup = await self.store.put_reports(clean)
        self.metrics.inc("tether_reports_total", new)
        self.metrics.inc("tether_reports_duplicate_total", dup)
        return new, dup

    async def h_reports_in(self, request: web.Request) -> web.Response:
        raw = await request.read()
        caller = await self.auth.sidecar(request, raw)
        try:
            body = json.loads(raw)
        except ValueError:
            raise _bad("the report body is not JSON") from None
        if not isinstance(body, dict) or not isinstance(body.get("reports", []), list):
            raise _bad("body needs 'reports': a list")
        new, dup = await self.ingest_reports(caller, body.get("reports", []), body.get("starts") or [])
        return web.json_response({"accepted": new, "duplicates": dup})

    async def h_reports_out(self, request: web.Request) -> web.Response:
        self.auth.require_admin(request)
        agent = request.query.get("agent")
        return web.json_response(await self.store.reports([agent] if agent else None))

    # -- approvals -------------------------------------------------------------------------------------
    async def h_approval_new(self, request: web.Request) -> web.Response:
        raw = await request.read()
        caller = await self.auth.sidecar(request, raw)
        agent, link = caller.agent, caller.link
        body = json.loads(raw or b"{}")
        if not isinstance(body, dict) or not isinstance(body.get("call_id"), str):
            raise _bad("body needs 'call_id', 'capability', 'method', 'url'")
        now = self.clock()
        approval_id = "apr-" + os.urandom(6).hex()
        ttl = min(float(body.get("timeout_s", self.approval_ttl_s)), 24 * 3600)
        held = _held_request(body.get("request"))
        chain = [await self.store.get_link(h) for h in link.get("chain_hashes", [link["hash"]])]
        doc = {
            "id": approval_id,
            "agent": agent,
            "link": caller.link_hash,
            "run_id": caller.run,
            "call_id": body["call_id"],
            "capability": body.get("capability"),
            "method": body.get("method"),
            "url": body.get("url"),
            "summary": str(body.get("summary", ""))[:500],
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
            caller = await self.auth.sidecar(request, await request.read())
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
        if decision == "approved":
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
        call_hash = body.get("call_hash") if isinstance(body, dict) else None
        if call_hash is not None and not isinstance(call_hash, str):
            raise _bad("'call_hash' must be the string shown with the approval")
        return web.json_response(await self.decide(request.match_info["id"], "approved", "admin", call_hash))

    async def h_deny(self, request: web.Request) -> web.Response:
        self.auth.require_admin(request)
        return web.json_response(await self.decide(request.match_info["id"], "denied", "admin"))

    # -- audit ---------------------------------------------------------------------------------------------
    async def h_surface(self, request: web.Request) -> web.Response:
        self.auth.require_admin(request)
        agent = request.query.get("agent")
        graph = await self.graph()
        if agent is not None and not graph.links_of(agent):
            raise ApiError(404, NOT_FOUND, f"no registered link is held by {agent}")
        return web.json_response(surface(self.catalog, graph, await self.revoked(), self.clock(), agent))


def _held_request(value: Any) -> Doc | None:
    """The held call as the sidecar sent it, kept to the shape and sizes the console shows."""
    if not isinstance(value, dict):
        return None
    headers = value.get("headers")
    return {
        "method": str(value.get("method", ""))[:32],
        "url": str(value.get("url", ""))[:8192],
        "headers": [[str(h[0])[:256], str(h[1])[:4096]] for h in headers[:200] if isinstance(h, list) and len(h) == 2]
        if isinstance(headers, list) else [],
        "body": str(value.get("body", ""))[:32 * 1024],
        "body_encoding": "base64" if value.get("body_encoding") == "base64" else "text",
        "body_size": int(value.get("body_size") or 0),
        "body_truncated": bool(value.get("body_truncated")),
        "body_streamed": bool(value.get("body_streamed")),  # a large upload held at its headers: body not shown
        "call_hash": str(value["call_hash"])[:80] if value.get("call_hash") else None,
    }


def _chain_jtis(link: Doc) -> list[str]:
    return list(link.get("chain_jtis", [link["jti"]]))


def _label(value: str) -> str:
    """A Prometheus label value, escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
