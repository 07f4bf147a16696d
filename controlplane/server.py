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

from .auth import Authenticator
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

    async def register_chain(self, wire: str) -> tuple[list[Doc], int]:
        """Verify a chain and store each of its links; returns (link docs, how many were new)."""
        verified = self.verifier.verify(wire, now=self.clock(), revoked=await self.revoked())
        await self._check_agent_ids(verified.links)
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
        return docs, new

    async def _check_agent_ids(self, links: Any) -> None:
        """An agent id belongs to the delegation tree that registered it first: a link delegated elsewhere
        may not take it (it would inherit the other agent's commands, records and surface). Root links
        are minted with the control plane's key, so an admin may re-issue an id."""
        root = links[0].hash
        graph = await self.graph()
        for index, link in enumerate(links[1:], start=1):
            if link.hash in graph.by_hash:
                continue
            for other in graph.links_of(link.sub):
                if other.get("chain_hashes", [other["hash"]])[0] != root:
                    raise ChainInvalid("agent_id_taken", f"link {index}: agent id {link.sub!r} is already held "
                                       "under another root grant; delegate under a different id", link=index)

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
    def route(self, method: str, path: str, handler: Handler, summary: str, auth: str, tag: str = "control") -> None:
        self.routes.append(Route(method, path, handler, summary, auth, tag))

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
        app.on_cleanup.append(self._on_cleanup)
        app["controlplane"] = self
        return app

    async def _on_startup(self, app: web.Application) -> None:
        await self.store.open()
        self._tasks = [asyncio.create_task(job()) for job in self.background]

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
            live = sum(1 for s in sidecars.values() if s.get("lease_expires", 0) > now)
            lines += ["# TYPE tether_sidecars_leased gauge", f"tether_sidecars_leased {live}"]
            _low, high = await self.store.event_bounds()
            lines += ["# TYPE tether_event_seq gauge", f"tether_event_seq {high}"]
            lines.append("# TYPE tether_subscriber_lag_events gauge")
            for agent, doc in sorted(sidecars.items()):
                seen = doc.get("seq")
                lag = max(0, high - int(seen)) if isinstance(seen, int) and seen >= 0 else 0
                lines.append(f'tether_subscriber_lag_events{{agent="{_label(agent)}"}} {lag}')
            active = sum(1 for t in await self.store.list_docs("termination") if t["state"] != "terminated")
            lines += ["# TYPE tether_terminations_in_flight gauge", f"tether_terminations_in_flight {active}"]
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
        docs, _ = await self.register_chain(compact)
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
        docs, new = await self.register_chain(wire)
        leaf = docs[-1]
        return web.json_response({"agent": leaf["sub"], "link": leaf["hash"], "jtis": leaf["chain_jtis"], "new": new})

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
        # Who is cut off is worked out before the revocation goes out, so this replica's CPU is free for
        # the fan-out that follows it.
        below = sorted({d["sub"] for d in (await self.graph()).descendants(link["hash"])})
        doc = await self.revoke_link(link, by, reason)
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
        sidecars = await self.store.all_sidecars()
        now = self.clock()

        def node_doc(link: Doc) -> Doc:
            revoked_by = graph.revoked_in_chain(link["hash"], revocations)
            sidecar = sidecars.get(link["sub"])
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
                "sidecar": _sidecar_view(sidecar, now) if sidecar else None,
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
        agent, link = await self.auth.sidecar(request, await request.read())
        try:
            after = int(request.query.get("after", "-1"))
            wait = max(0.0, min(float(request.query.get("wait", "0")), 30.0))
        except ValueError:
            raise _bad("'after' must be an integer and 'wait' a number of seconds") from None
        chain_jtis = set(link.get("chain_jtis", [link["jti"]]))
        low, high = await self.store.event_bounds()
        if after < 0 or after < low - 1 or after > high:
            return web.json_response(await self._resync(agent, chain_jtis, high))
        deadline = self.clock() + wait
        while True:
            signal = self._event_signal  # taken before reading, so a publish meanwhile still wakes us
            events = await self.events_after(after)
            visible = [e.to_dict() for e in events if _visible(e.kind, e.target, e.payload, agent, chain_jtis)]
            if events:
                after = events[-1].seq
            remaining = deadline - self.clock()
            if visible or remaining <= 0 or len(events) == 500:
                self.metrics.inc("tether_events_delivered_total", len(visible))
                return web.json_response({"events": visible, "next": after})
            await self.wait_event(after, remaining, signal)

    async def events_after(self, after: int) -> list[Event]:
        """One store read shared by every long poll waiting at the same sequence (a revocation wakes them
        all at once; without this each would read the same event again)."""
        shared = self._event_reads.get(after)
        if shared is None:
            shared = asyncio.ensure_future(self.store.events_after(after, 500))
            self._event_reads[after] = shared
            shared.add_done_callback(lambda _f, key=after: self._event_reads.pop(key, None))
        return await asyncio.shield(shared)

    async def _resync(self, agent: str, chain_jtis: set[str], high: int) -> Doc:
        revocations = await self.store.revocations()
        command = await self.store.get_doc("command", agent)
        approvals = [
            a for a in await self.store.list_docs("approval") if a["agent"] == agent and a["status"] != "pending"
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
        raw = await request.read()
        agent, link = await self.auth.sidecar(request, raw)
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise _bad("the heartbeat body is not JSON") from None
        now = self.clock()
        previous = await self.store.get_sidecar(agent) or {}
        doc = {
            **previous,
            "agent": agent,
            "link": link["hash"],
            "last_seen": now,
            "lease_expires": now + self.lease_ttl_s,
            "state": str(body.get("state", "serving")),
            "inflight": list(body.get("inflight", []))[:10_000],
            "seq": body.get("seq"),
            "proxy": body.get("proxy"),
            "pid": body.get("pid"),
            "started_at": body.get("started_at"),
            "spooled": body.get("spooled", 0),
            "replica": self.replica,
        }
        await self.store.put_sidecar(agent, doc)
        self.metrics.inc("tether_heartbeats_total")
        return web.json_response(
            {
                "lease_ttl_s": self.lease_ttl_s,
                "lease_expires_at": doc["lease_expires"],
                "now": now,
                "command": await self.store.get_doc("command", agent),
                # Belt and braces: a revocation whose event was lost still reaches the sidecar here.
                "revoked": sorted(await self.store.revoked_among(list(link.get("chain_jtis", [link["jti"]])))),
            }
        )

    async def h_reports_in(self, request: web.Request) -> web.Response:
        raw = await request.read()
        agent, _ = await self.auth.sidecar(request, raw)
        try:
            body = json.loads(raw)
        except ValueError:
            raise _bad("the report body is not JSON") from None
        reports = body.get("reports") if isinstance(body, dict) else None
        if not isinstance(reports, list):
            raise _bad("body needs 'reports': a list")
        clean: list[Doc] = []
        for report in reports:
            if not isinstance(report, dict) or not isinstance(report.get("call_id"), str):
                raise _bad("every report needs a 'call_id'")
            if report.get("agent", agent) != agent:
                raise ApiError(403, FORBIDDEN, f"{agent} cannot report calls of {report.get('agent')}")
            clean.append({**report, "agent": agent, "received_at": self.clock()})
        new, dup = await self.store.put_reports(clean)
        self.metrics.inc("tether_reports_total", new)
        self.metrics.inc("tether_reports_duplicate_total", dup)
        return web.json_response({"accepted": new, "duplicates": dup})

    async def h_reports_out(self, request: web.Request) -> web.Response:
        self.auth.require_admin(request)
        agent = request.query.get("agent")
        return web.json_response(await self.store.reports([agent] if agent else None))

    # -- approvals -------------------------------------------------------------------------------------
    async def h_approval_new(self, request: web.Request) -> web.Response:
        raw = await request.read()
        agent, _ = await self.auth.sidecar(request, raw)
        body = json.loads(raw or b"{}")
        if not isinstance(body, dict) or not isinstance(body.get("call_id"), str):
            raise _bad("body needs 'call_id', 'capability', 'method', 'url'")
        now = self.clock()
        approval_id = "apr-" + os.urandom(6).hex()
        ttl = min(float(body.get("timeout_s", self.approval_ttl_s)), 24 * 3600)
        doc = {
            "id": approval_id,
            "agent": agent,
            "call_id": body["call_id"],
            "capability": body.get("capability"),
            "method": body.get("method"),
            "url": body.get("url"),
            "summary": str(body.get("summary", ""))[:500],
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
            agent, _ = await self.auth.sidecar(request, await request.read())
            if doc is not None and doc["agent"] != agent:
                doc = None
        if doc is None:
            raise ApiError(404, NOT_FOUND, f"no approval {request.match_info['id']}")
        return web.json_response(self._approval_view(doc))

    async def decide(self, approval_id: str, decision: str, by: str) -> Doc:
        doc = await self.store.get_doc("approval", approval_id)
        if doc is None:
            raise ApiError(404, NOT_FOUND, f"no approval {approval_id}")
        view = self._approval_view(doc)
        if view["status"] != "pending":
            raise ApiError(409, CONFLICT, f"approval {approval_id} is already {view['status']}")
        new = {**doc, "status": decision, "decided_at": self.clock(), "decided_by": by, "version": doc["version"] + 1}
        if not await self.store.cas_doc("approval", approval_id, doc["version"], new):
            raise ApiError(409, CONFLICT, f"approval {approval_id} was decided concurrently")
        await self.publish(
            "approval",
            doc["agent"],
            {"id": approval_id, "call_id": doc["call_id"], "status": decision, "decided_by": by},
        )
        return new

    async def h_approve(self, request: web.Request) -> web.Response:
        self.auth.require_admin(request)
        return web.json_response(await self.decide(request.match_info["id"], "approved", "admin"))

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


def _visible(kind: str, target: str | None, payload: Doc, agent: str, chain_jtis: set[str]) -> bool:
    """A sidecar sees revocations of its own chain's links and events addressed to its agent only."""
    if kind == "revoke":
        return payload.get("jti") in chain_jtis
    return target == agent


def _sidecar_view(doc: Doc, now: float) -> Doc:
    return {
        "state": doc.get("state"),
        "last_seen": doc.get("last_seen"),
        "lease_expires": doc.get("lease_expires"),
        "lease": "live" if doc.get("lease_expires", 0) > now else "expired",
        "inflight": len(doc.get("inflight", [])),
        "proxy": doc.get("proxy"),
    }


def _label(value: str) -> str:
    """A Prometheus label value, escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
