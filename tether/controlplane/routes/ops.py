"""Routes for operating the control plane: health, Prometheus metrics, the OpenAPI document, and the
trust anchor and catalog a sidecar or a verifier fetches."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tether.capability import keys, protocol
from tether.capability.catalog import Catalog

from .. import schemas as sc
from ..auth import Authenticator
from ..metrics import LoopWatch, Metrics, gauge
from ..services.clock import ClockService
from ..services.events import EventService
from ..services.health import HealthService
from ..services.sidecars import SidecarService
from ..services.terminations import TerminationService
from ..store import StoreUnavailable
from . import NONE, Route


class OpsRoutes:
    """These answer for the control plane as a whole: its store's health, its replica, its metrics, its route
    table. Every read of the store goes through a service (``tests/test_layers.py`` checks it)."""

    def __init__(self, *, health: HealthService, catalog: Catalog, signing_key: Ed25519PrivateKey,
                 auth: Authenticator, metrics: Metrics, loop_watch: LoopWatch, events: EventService,
                 sidecars: SidecarService, terminations: TerminationService, routes: list[Route],
                 clock: Callable[[], float], clock_watch: ClockService) -> None:
        self.health, self.catalog, self.signing_key = health, catalog, signing_key
        self.auth, self.metrics, self.loop_watch, self.events = auth, metrics, loop_watch, events
        self.sidecars, self.terminations = sidecars, terminations
        self.routes, self.clock, self.clock_watch = routes, clock, clock_watch

    async def h_healthz(self, request: web.Request) -> web.Response:
        """200 only while the store answers and takes writes and this replica's clock is within the bound of
        the store's: a replica whose every write would fail (a full disk, Redis out of memory) or whose clock
        would void drain windows must leave the readiness rotation, not answer every caller wrongly."""
        readiness = await self.health.readiness()
        if readiness.ready:
            return web.json_response(readiness.to_doc())
        return web.json_response(readiness.to_doc(), status=503, headers={protocol.ERROR_HEADER: str(readiness.code)})

    async def h_metrics(self, request: web.Request) -> web.Response:
        """Prometheus text. Series labelled by agent id name the fleet's agents, so they go to an admin only
        (a scraper sends the admin token as its bearer); anyone else gets the fleet-wide series."""
        lines = gauge("tether_up", "1 while the control plane serves.", [("", 1)])
        lines += self.loop_watch.lines()
        lines += self.clock_watch.lines()
        try:
            lines += await self._store_gauges(per_agent=await self.auth.operator(request) is not None)
            lines += gauge("tether_store_up", "1 while the store answers.", [("", 1)])
        except (StoreUnavailable, ConnectionError, OSError):
            lines += gauge("tether_store_up", "1 while the store answers.", [("", 0)])
        writable = self.health.writable()  # the verdict as it stands: /metrics does not probe
        lines += gauge("tether_store_writable", "1 unless the store's newest write was refused (a full disk...).",
                       [("", int(writable))])
        lines += self.metrics.render()
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _store_gauges(self, per_agent: bool) -> list[str]:
        now = self.clock()
        sidecars = await self.sidecars.runs()
        live = sum(1 for s in sidecars.values() if s.get("lease_expires", 0) > now and not s.get("final"))
        lines = gauge("tether_sidecars_leased", "Sidecar runs holding a live lease.", [("", live)])
        _low, high = await self.events.bounds()
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
        active = await self.terminations.in_flight()
        lines += gauge("tether_terminations_in_flight", "Terminations not yet terminated.", [("", active)])
        lines += gauge("tether_event_streams_open", "Sidecars following the event stream on this replica.",
                       [("", self.events.hub.open_streams)])
        return lines

    async def h_openapi(self, request: web.Request) -> web.Response:
        from ..openapi import document

        return web.json_response(document(self.routes))

    async def h_trust(self, request: web.Request) -> web.Response:
        public = self.signing_key.public_key()
        return web.json_response({"public_key": keys.public_pem(public).decode(), "jwk": keys.to_jwk(public),
                                  "catalog": self.catalog.hash})

    async def h_catalog(self, request: web.Request) -> web.Response:
        return web.json_response({"hash": self.catalog.hash, "catalog": self.catalog.to_dict()})

    def table(self) -> list[Route]:
        return [
            Route("GET", "/healthz", self.h_healthz, "Readiness: the store answers and takes writes, and this "
                  "replica's clock agrees with the store's", NONE, "ops",
                  ok=sc.HEALTH,
                  extra_responses={503: {"description": "The store is unreachable (code tether.store_unavailable) "
                                                        "or refuses writes (tether.store_unwritable: a full disk, "
                                                        "a read-only file system, Redis out of memory), or this "
                                                        "replica's clock is off the store's by more than the bound "
                                                        "or was not compared lately (tether.clock_skewed); the "
                                                        "reason says which",
                                         "headers": {"Tether-Error": {"schema": {"type": "string"},
                                                                      "description": "The code, as in the body"}},
                                         "content": {"application/json": {"schema": sc.HEALTH}}}}),
            Route("GET", "/metrics", self.h_metrics, "Prometheus metrics (per-agent series to an admin only)", NONE,
                  "ops", content="text/plain", ok={"type": "string"}),
            Route("GET", "/openapi.json", self.h_openapi, "This document", NONE, "ops", ok=sc.OPENAPI),
            Route("GET", "/v1/trust", self.h_trust, "The control plane's public key and catalog hash", NONE, "ops",
                  ok=sc.TRUST),
            Route("GET", "/v1/catalog", self.h_catalog, "The catalog this control plane enforces", NONE, "ops",
                  ok=sc.CATALOG),
        ]


def _label(value: str) -> str:
    """A Prometheus label value, escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
