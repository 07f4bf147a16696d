"""The control plane assembled: its services over one store, their routes, and the aiohttp application.

``ControlPlane`` wires; it holds no logic of its own. The services (``tether/controlplane/services/``) own what
the control plane does; the route modules (``tether/controlplane/routes/``) answer HTTP over them, each route
declaring who may call it. The console adds its routes with ``route``/``add`` (see
``tether/cli/controlplane.build``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tether.capability.catalog import Catalog
from tether.capability.chain import Verifier

from .auth import Authenticator
from .body import MAX_BODY
from .metrics import LoopWatch, Metrics
from .routes import Handler, Route, enforced, error_middleware
from .routes.approvals import ApprovalRoutes
from .routes.budgets import BudgetRoutes
from .routes.checkpoints import CheckpointRoutes
from .routes.grants import GrantRoutes
from .routes.operators import OperatorRoutes
from .routes.ops import OpsRoutes
from .routes.sidecars import SidecarRoutes
from .routes.terminations import TerminationRoutes
from .services.approvals import ApprovalService
from .services.budgets import BudgetService
from .services.checkpoints import CheckpointService
from .services.clock import ClockService
from .services.events import EventService
from .services.grants import GrantService
from .services.health import HealthService
from .services.operators import OperatorService
from .services.records import RecordService
from .services.segments import SegmentService
from .services.sidecars import SidecarService
from .services.terminations import TerminationService
from .signing import check_head
from .store import Store, StoreUnavailable

log = logging.getLogger("tether.controlplane")

DEFAULT_LEASE_TTL_S = 15.0
DEFAULT_APPROVAL_TTL_S = 300.0


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
        budget_window_s: float | None = None,
        signing_key_source: str = "the signing key",
    ) -> None:
        self.store = store
        self.signing_key = signing_key
        self.signing_key_source = signing_key_source  # its file, named when it did not sign the record log
        self.catalog = catalog
        self.clock = clock
        self.lease_ttl_s = lease_ttl_s
        self.approval_ttl_s = approval_ttl_s
        self.grace_s = grace_s
        self.replica = replica or f"cp-{os.getpid()}-{os.urandom(3).hex()}"
        self.verifier = Verifier(signing_key.public_key(), catalog_hash=catalog.hash)
        self.auth = Authenticator(store, admin_token, clock)
        self.metrics = Metrics(catalog.names())
        self.loop_watch = LoopWatch()
        self.clock_watch = ClockService(store, clock, self.replica)
        self.auth.proof_clock = self.clock_watch
        self.health = HealthService(store, self.clock_watch, self.replica, catalog.hash)
        self._wire_services(budget_window_s)
        self.routes: list[Route] = []
        self.background: list[Callable[[], Awaitable[None]]] = [self.loop_watch.run, self.clock_watch.run,
                                                                 self.terminations.run, self.budgets.run,
                                                                 self.checkpoints.run, self.segments.run]
        ops = OpsRoutes(health=self.health, catalog=catalog, signing_key=signing_key, auth=self.auth,
                        metrics=self.metrics, loop_watch=self.loop_watch, events=self.events, sidecars=self.sidecars,
                        terminations=self.terminations, routes=self.routes, clock=clock, clock_watch=self.clock_watch)
        self.add(*ops.table(), *GrantRoutes(self.grants).table(),
                 *SidecarRoutes(self.events, self.sidecars, self.records).table(),
                 *ApprovalRoutes(self.approvals).table(),
                 *CheckpointRoutes(self.checkpoints).table(),  # before /v1/records/{id}
                 *TerminationRoutes(self.terminations, self.records).table(),
                 *BudgetRoutes(self.budgets).table(),
                 *OperatorRoutes(self.operators).table())

    def _wire_services(self, budget_window_s: float | None) -> None:
        store, metrics, clock = self.store, self.metrics, self.clock
        self.events = EventService(store, metrics, clock, self.clock_watch.handed_out)
        self.grants = GrantService(store, self.signing_key, self.catalog, self.verifier, metrics, self.events, clock)
        self.sidecars = SidecarService(store, metrics, clock, self.lease_ttl_s, self.replica,
                                       self.clock_watch.handed_out)
        self.approvals = ApprovalService(store, metrics, self.events, clock, self.approval_ttl_s)
        self.records = RecordService(store, metrics, clock)
        self.checkpoints = CheckpointService(store, self.signing_key, clock=clock)  # sinks: set by the CLI
        self.segments = SegmentService(store, self.signing_key, clock)  # settling time etc.: set by the CLI
        self.operators = OperatorService(store, metrics, clock)
        self.auth.operators = self.operators
        self.budgets = BudgetService(store, metrics, clock, self.grants, self.lease_ttl_s, budget_window_s)
        self.terminations = TerminationService(
            store, metrics, clock, signing_key=self.signing_key, replica=self.replica, lease_ttl_s=self.lease_ttl_s,
            grace_s=self.grace_s, events=self.events, grants=self.grants, approvals=self.approvals,
            records=self.records, sidecars=self.sidecars, clock_watch=self.clock_watch)

    # -- the route table ----------------------------------------------------------------------------------
    def add(self, *routes: Route) -> None:
        self.routes.extend(routes)

    def route(self, method: str, path: str, handler: Handler, summary: str, auth: str, tag: str = "control",
              **spec: Any) -> None:
        """Add a route; ``spec`` is what the OpenAPI document says of it (``Route``'s fields)."""
        self.add(Route(method, path, handler, summary, auth, tag, **spec))

    def app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY)
        for route in self.routes:
            app.router.add_route(route.method, route.path, enforced(route, self.auth))
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        app.on_cleanup.append(self._on_cleanup)
        app["controlplane"] = self
        return app

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def _on_startup(self, app: web.Application) -> None:
        await self.store.open()
        await self._check_signing_key()
        try:
            await self.grants.record_owners()
        except (StoreUnavailable, ConnectionError, OSError) as exc:  # the API answers 503 until the store is back
            log.warning("could not record agent-id owners at start-up: %s", exc)
        try:  # compared once before serving, so a skewed replica never joins the readiness rotation
            await self.clock_watch.measure()
        except (StoreUnavailable, ConnectionError, OSError, TimeoutError) as exc:
            log.warning("could not read the store's clock at start-up: %s", exc)
        self._tasks = [asyncio.create_task(job()) for job in self.background]

    async def _check_signing_key(self) -> None:
        """Serve only with the key that signed the record log's head (``tether.signing_key_mismatch``, raised
        out of start-up). A store that does not answer yet is no reason to stay down: every record written
        checks the head it extends again."""
        try:
            heads = await self.store.record_heads()  # headers only: a log of big records is not read whole
        except (StoreUnavailable, ConnectionError, OSError) as exc:
            log.warning("could not read the record log to check the signing key at start-up: %s", exc)
            return
        check_head(heads[-1] if heads else None, self.signing_key.public_key(), self.signing_key_source)

    async def _on_shutdown(self, app: web.Application) -> None:
        await self.events.hub.close()  # open streams end, so the server's wait for its handlers does not hang

    async def _on_cleanup(self, app: web.Application) -> None:
        for task in getattr(self, "_tasks", []):
            task.cancel()
        await asyncio.gather(*getattr(self, "_tasks", []), return_exceptions=True)
        await self.store.close()
