"""One agent's sidecar: the wiring of its parts (docs/architecture.md draws them).

Start-up (``proxy.startup``): learn the trust key and catalog, verify the chain, register it, take a lease, then
listen. While serving, ``proxy.loops`` heartbeats the lease, follows the event stream and cuts overdue calls;
``proxy.approvals`` holds calls for a person; ``proxy.stopping`` carries out the termination machine of
``proxy.quiesce`` and the sidecar's own stop. The sidecar never decides the agent's fate: it only carries out what
the control plane commands, and a tool's failure touches only that call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from mitmproxy import http

from tether.capability.catalog import Catalog
from tether.capability.chain import parse_chain_unverified

from .approvals import Approvals
from .budget import Budgets
from .capture import CAPTURE_FILE, CaptureWriter
from .channel import ControlChannel
from .credentials import Credentials
from .cutting import Cutter
from .flowstate import link_call
from .loops import ControlLoops
from .pipeline import Pipeline
from .quiesce import Drain, stop_plan
from .reporting import Reporter, lock_state_dir
from .startup import Proxy, SidecarConfig, learn, mitmproxy_addons, new_run, open_proxy, retrying, tether_addons
from .state import Call, CallTable, SidecarState
from .stopping import Edge, StopParts, Termination, finish, obeyed, retire

__all__ = ["Sidecar", "SidecarConfig", "mitmproxy_addons", "new_run"]

log = logging.getLogger("tether.sidecar")


class Sidecar:
    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.wire = config.chain
        links = parse_chain_unverified(self.wire)
        self.agent = links[-1].sub
        config.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # CA key, spool, captures: ours alone
        self._lock = lock_state_dir(config.state_dir)  # before the spool is read: it has one owner
        self.run_id, supersedes = new_run(config.state_dir, links[-1].hash)
        self.channel = ControlChannel(config.controlplane, self.agent, links[-1].hash, config.key, self.run_id)
        self.retired: str | None = None  # why this run may never serve (its chain is revoked or expired)
        self.reporter = Reporter(self.channel, config.state_dir / "reports.spool")
        self.capture = CaptureWriter(config.capture_path or config.state_dir / "captures" / CAPTURE_FILE,
                                     config.redact_fields, default_fields=config.redact_default_fields,
                                     policy=config.capture_policy, root=config.state_dir.parent, agent=self.agent)
        self.calls: CallTable[http.HTTPFlow] = CallTable(link_call)  # the calls in flight, which flow carries each
        self.credentials = Credentials(config.secrets, config.upstream_ca)
        self.resolved: list[Callable[[Call], None]] = []  # told of every call's end (tether/proxy/telemetry.py)
        self.catalog: Catalog = config.catalog  # type: ignore[assignment]
        self.state: SidecarState = None  # type: ignore[assignment]
        self.budgets = Budgets(None, None)  # the chain's budget slices (tether/proxy/budget.py), once it verified
        self.proxy: Proxy | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._looping = False
        self.stopped = asyncio.Event()
        self.desk = Approvals(self.channel, self.calls.flow_of, self.capture, config.approval_timeout_s)
        self.cutter = Cutter(lambda: self.proxy.server if self.proxy else None, config.upstream_ca, self.spawn)
        self.edge = Edge(self.calls, self.desk, self.cutter, self.resolve, lambda: self.state)
        self.resolved.append(self.edge.call_ended)
        self.termination = Termination(self.edge, self.channel, self.reporter, lambda: self.budgets.release(),
                                       self.spawn)
        self.loops = ControlLoops(self.channel, self.reporter, self.calls, on_command=self.on_command,
                                  on_approval=self.desk.on_approval, abort=self.cutter.abort,
                                  call_timeout_s=config.call_timeout_s, supersedes=supersedes,
                                  held_slices=lambda: self.budgets.held())

    def spawn(self, job: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.create_task(job))

    def on_command(self, doc: dict[str, Any]) -> None:
        command = obeyed(doc)  # one that cannot be read is obeyed as an abort
        tid = command.get("termination_id")
        if tid:  # its record will name this capture's flows: none of them is pruned until exported
            self.capture.hold(tid, command.get("window_s"))
        self.termination.on_command(command)

    # -- start-up ---------------------------------------------------------------------------------------
    async def prepare(self) -> None:
        """Trust, catalog, chain, registration, first lease. Raises TetherError when it cannot serve."""
        await retrying(self._prepare_once, self.config.startup_timeout_s)

    async def _prepare_once(self) -> None:
        learned = await learn(self.channel, self.config, self.catalog, self.wire)
        self.catalog, self.retired = learned.catalog, learned.retired
        if self.retired or learned.verified is None:
            return
        self.state = self.loops.state = SidecarState(learned.verified, learned.verifier, lease_ttl_s=15.0,
                                                     wire=self.wire)
        if self.budgets.on_resolved in self.resolved:  # an attempt before this one got this far
            self.resolved.remove(self.budgets.on_resolved)
        self.budgets = Budgets(learned.verified, self.channel)
        self.resolved.append(self.budgets.on_resolved)
        self.state.registered = True
        await self.loops.heartbeat_once()
        await self.loops.sync_events(wait=0)

    async def start_proxy(self) -> tuple[str, int]:
        self.credentials.bind(self.catalog)
        self.capture.protect(self.credentials.header_names(), self.credentials.values)
        self.proxy = await open_proxy(self.config, self.catalog, Pipeline(self.addons()))
        self.loops.address = self.proxy.address
        log.info("sidecar for %s listening on %s:%d", self.agent, *self.proxy.address)
        return self.proxy.address

    async def begin(self) -> None:
        """Serve on a fresh lease (starting may have been slow), then run the loops that keep it. Until the
        heartbeat is answered the lease taken at registration may lapse, and then every call is refused
        (``tether.lease_expired``): nothing is forwarded on a lease the control plane has not renewed. Raises
        ``tether.controlplane_unreachable`` like the start-up steps before it, for the caller to retry."""
        await self.loops.heartbeat_once()
        if not self._looping:
            self._looping = True
            for job in (self.loops.heartbeat_loop, self.loops.events_loop, self.reporter.run,
                        self.loops.watchdog_loop, self.budgets.run):
                self.spawn(job())

    def addons(self) -> list[Any]:
        """tether's addons in pipeline order, each given only what it uses (``proxy.startup.tether_addons``)."""
        return tether_addons(self.config, self.catalog, self.state, self.budgets, self.capture, self.credentials,
                             self.reporter.start, self.desk.await_approval, self.track, self.resolve,
                             self.resolved, self.run_id)

    @property
    def ca_cert(self) -> Path:
        return self.config.state_dir / "ca" / "mitmproxy-ca-cert.pem"

    # -- the in-flight table ------------------------------------------------------------------------------
    def track(self, call: Call, flow: http.HTTPFlow) -> None:
        self.calls.start(call, flow)
        if self.state.command:
            call.termination_id = self.state.command.get("termination_id")

    def resolve(self, call: Call, resolution: str, *, status: int | None = None, code: str | None = None,
                detail: str | None = None) -> None:
        done = self.calls.resolve(call.call_id, resolution, time.time(), status=status, code=code,
                                  detail=detail or call.detail)
        if done is not None:
            self.reporter.add(done.report())
            for listener in self.resolved:
                listener(done)

    # -- the end ------------------------------------------------------------------------------------------
    async def stop(self) -> None:
        """Stop serving: admit nothing more, let what left finish within the stop window, cut the rest, and
        only then shut the proxy, deliver every report and tell the control plane we are gone (docs/termination.md,
        "When the sidecar itself stops"): the drain is ``proxy.quiesce``'s ``Drain``, what follows it the steps of
        ``proxy.stoptail``, carried out by ``stopping.finish``.

        The order is what keeps the record true: a call not yet forwarded meets the stopping state at the
        Forwarder's last look and is refused by its own flow (it can never leave after that), so the only calls
        this method resolves itself are ones no hook will ever finish."""
        if self.state is not None:
            self.state.stopping()
        self.desk.cancel_held()
        proxy = self.proxy
        if proxy is not None:
            window = self.config.stop_window_s
            await self.edge.drain(*Drain.begin(stop_plan(window), time.monotonic()),
                                  f"stopping: cutting %d call(s) still in flight after the {window:.0f}s stop window")
        await finish(StopParts(proxy, self.cutter, self._tasks, self.edge, self.budgets, self.reporter, self.channel,
                               self.loops, self.state, self.close_sessions, self.capture, self._lock, self.stopped))

    async def close_sessions(self) -> None:
        """Close the HTTP client sessions (the control plane's, the OAuth2 token endpoints'): on every way out,
        or asyncio prints "Unclosed client session" dumps after the sidecar's last line."""
        await self.channel.close()
        await self.credentials.close()

    async def retire(self) -> str:
        """This run may never serve: see ``proxy.stopping.retire``; returns the reason to exit with."""
        done = await retire(self.reporter, self.channel, self.loops, self.capture, self.termination.acknowledge)
        return f"{self.agent} will not serve: {self.retired}; spooled reports delivered, {done}"
