"""One agent's sidecar: mitmproxy with tether's addons, and the loops that tie it to the control plane.

Start-up: learn the trust key and catalog, verify the chain, register it, take a lease, then listen.
While serving: heartbeat the lease, follow the event stream (revocations, drain/abort commands,
approval decisions), deliver reports. The sidecar never decides the agent's fate: it only carries out
what the control plane commands, and a tool's failure touches only that call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from mitmproxy import ctx, http, options

from tether.capability import errors as codes
from tether.capability import keys, protocol
from tether.capability.catalog import Catalog, catalog_from, empty_catalog
from tether.capability.chain import Verifier, parse_chain_unverified
from tether.capability.errors import ApiError, ChainError, TetherError
from tether.capability.events import APPROVAL, APPROVED, CANCELLED, COMMAND, DENIED, REVOKE
from tether.capture.retention import Policy as CapturePolicy

from .addons import Capture, McpFilter, Resolver, Streamer, Tracker, WebsocketBound
from .budget import Budgets
from .capture import CAPTURE_FILE, CaptureWriter, call_hash, held_call
from .channel import ControlChannel, sleep_backoff
from .credentials import CredentialRoutes, Credentials, Injector
from .enforce import APPROVAL_BODY_LIMIT, Enforcer, Forwarder, Holds, Tunnels, filing_refused, own_destinations
from .flowstate import state_of
from .framing import answer_early, bulk_transfers, discard_trailers
from .mcpcalls import McpCalls, McpLedger
from .mitmaddons import Master, block, core, disable_h2c, dns_resolver, next_layer, proxyserver, tlsconfig
from .pipeline import Pipeline
from .reporting import Reporter, lock_state_dir
from .state import DRAINING, TERMINATED, Call, CallTable, SidecarState
from .stdio import StdioRoutes, serves_stdio
from .telemetry import call_tracing
from .transparent import Transparent, serve_dns, serve_enclosure

log = logging.getLogger("tether.sidecar")
# Reports per request when an acknowledgement delivers what was pending (sent compressed): on a slow link each
# request costs its round trips whatever its size, and a drain's worth of refusals must not outlast the grace.
ACK_BATCH = 5000


@dataclass
class SidecarConfig:
    """Every field but the last comes from an option of ``tether sidecar`` (tether/cli/sidecar.py's table holds the
    defaults, so there is no second one here)."""

    controlplane: str
    chain: str
    key: Ed25519PrivateKey
    state_dir: Path
    listen_host: str
    listen_port: int
    catalog: Catalog | None
    trust: Any  # Ed25519PublicKey, else (None) fetched from the control plane
    upstream_ca: str | None
    redact_fields: list[str]
    approval_timeout_s: float
    allow_uncaptured: bool
    call_timeout_s: float
    stop_window_s: float  # on SIGTERM, how long calls that left may finish before they are cut
    capture_path: Path | None
    capture: bool
    secrets: dict[str, str]  # credential name -> secret (tether/proxy/credentials.py)
    transparent_listen: tuple[str, int] | None  # also intercept redirected connections here
    dns_listen: tuple[str, int] | None  # answer DNS here with the transparent address (--isolate)
    enclosure_fds: tuple[int, int] | None = None  # tether run's enclosure: its listener and resolver sockets
    # stdio MCP servers this sidecar reaches for their bridge: NAME -> the bridge's loopback address
    # (tether/proxy/stdio.py)
    stdio_routes: dict[str, tuple[str, int]] = field(default_factory=dict)
    startup_timeout_s: float = 30.0  # how long one start-up attempt waits for an unreachable control plane
    redact_default_fields: bool = True  # the field names that say secret (tether/proxy/capture.py), unless turned off
    capture_policy: CapturePolicy | None = None  # the --capture-* retention options (tether/capture/retention.py)


def mitmproxy_addons() -> list[Any]:
    """The part of mitmproxy a sidecar needs: proxying, TLS, DNS, protocol detection, and its guards.

    Not the rest of ``default_addons()`` (replay, scripts, map/modify rules, onboarding pages, sticky
    cookies ...): nothing configures them here, every one of them sees every hook of every call, and
    features that rewrite or answer requests have no place in front of an enforcement point."""
    return [core.Core(), block.Block(), disable_h2c.DisableH2C(), proxyserver.Proxyserver(),
            dns_resolver.DnsResolver(), next_layer.NextLayer(), tlsconfig.TlsConfig()]


def new_run(state_dir: Path, link: str) -> tuple[str, str | None]:
    """Start a run: a fresh id, written to the state dir; returns it and the run it supersedes (the previous
    run of the same link on this state dir, whose spool this one inherits)."""
    path = state_dir / "run.json"
    previous: str | None = None
    try:
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and doc.get("link") == link and isinstance(doc.get("run_id"), str):
            previous = doc["run_id"]
    except (OSError, ValueError):
        pass
    run_id = "run-" + os.urandom(8).hex()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"run_id": run_id, "link": link, "started_at": time.time(), "pid": os.getpid()}))
    os.replace(tmp, path)
    return run_id, previous


class Sidecar:
    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.wire = config.chain
        links = parse_chain_unverified(self.wire)
        self.agent = links[-1].sub
        config.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # CA key, spool, captures: ours alone
        self._lock = lock_state_dir(config.state_dir)  # before the spool is read: it has one owner
        self.run_id, self.supersedes = new_run(config.state_dir, links[-1].hash)
        self.channel = ControlChannel(config.controlplane, self.agent, links[-1].hash, config.key, self.run_id)
        self.retired: str | None = None  # why this run may never serve (its chain is revoked or expired)
        self.reporter = Reporter(self.channel, config.state_dir / "reports.spool")
        self.capture = CaptureWriter(config.capture_path or config.state_dir / "captures" / CAPTURE_FILE,
                                     config.redact_fields, default_fields=config.redact_default_fields,
                                     policy=config.capture_policy, root=config.state_dir.parent, agent=self.agent)
        self.allow_uncaptured = config.allow_uncaptured
        self.calls = CallTable()
        self.credentials = Credentials(config.secrets, config.upstream_ca)
        self.flows: dict[str, http.HTTPFlow] = {}
        self.resolved: list[Callable[[Call], None]] = []  # told of every call's end (tether/proxy/telemetry.py)
        self.catalog: Catalog = config.catalog  # type: ignore[assignment]
        self.state: SidecarState = None  # type: ignore[assignment]
        self.budgets = Budgets(None, None)  # the chain's budget slices (tether/proxy/budget.py), once it verified
        self.seq = -1
        self.started_at = time.time()
        self.approvals: dict[str, asyncio.Future[str]] = {}
        self.master: Master | None = None
        self.address: tuple[str, int] | None = None
        self._tasks: list[asyncio.Task] = []
        self._quiesce_task: asyncio.Task | None = None
        self._acked: set[str] = set()
        self._commanded_ids: set[str] = set()
        self._acking: set[str] = set()
        self.stopped = asyncio.Event()
        self._dns: asyncio.DatagramTransport | None = None
        self._enclosure: tuple[asyncio.Server, asyncio.DatagramTransport] | None = None

    # -- start-up ---------------------------------------------------------------------------------------
    async def prepare(self) -> None:
        """Trust, catalog, chain, registration, first lease. Raises TetherError when it cannot serve."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        attempt = 0
        while True:
            try:
                await self._prepare_once()
                return
            except ApiError as exc:
                if exc.code != "tether.controlplane_unreachable" or time.monotonic() > deadline:
                    raise
                attempt += 1
                if attempt == 1:
                    log.warning("waiting for the control plane: %s", exc.message)
                await sleep_backoff(attempt)

    async def _prepare_once(self) -> None:
        trust = self.config.trust
        if trust is None:
            trust = keys.from_jwk((await self.channel.public("/v1/trust"))["jwk"])
        if self.catalog is None:
            doc = await self.channel.public("/v1/catalog")
            source = f"{self.config.controlplane}/v1/catalog"
            self.catalog = (catalog_from(doc["catalog"], source) if doc["catalog"].get("capabilities")
                            else empty_catalog(source))
            if self.catalog.hash != doc["hash"]:
                raise TetherError("the catalog fetched from the control plane does not match its hash",
                                  code="tether.catalog_invalid")
        verifier = Verifier(trust, catalog_hash=self.catalog.hash)
        try:
            verified = verifier.verify(self.wire, now=time.time())
        except ChainError as exc:
            if exc.code not in (codes.CHAIN_EXPIRED, codes.CHAIN_REVOKED):
                raise
            self.retired = exc.message  # may still owe the control plane its spool and an acknowledgement
        answer = await self.channel.register(self.wire)
        if answer.get("revoked"):
            self.retired = f"the chain is revoked ({', '.join(answer['revoked'])})"
        if self.retired:
            return
        self.state = SidecarState(verified, verifier, lease_ttl_s=15.0, wire=self.wire)
        if self.budgets.on_resolved in self.resolved:  # an attempt before this one got this far
            self.resolved.remove(self.budgets.on_resolved)
        self.budgets = Budgets(verified, self.channel)
        self.resolved.append(self.budgets.on_resolved)
        self.state.registered = True
        await self.heartbeat_once()
        await self.sync_events(wait=0)

    async def start_proxy(self) -> tuple[str, int]:
        opts = options.Options(listen_host=self.config.listen_host, listen_port=self.config.listen_port,
                               confdir=str(self.config.state_dir / "ca"))
        master = Master(opts)
        master.addons.add(*mitmproxy_addons())
        self.credentials.bind(self.catalog)
        self.capture.protect(self.credentials.header_names(), self.credentials.values)
        master.addons.add(Pipeline(self.addons()))
        if self.config.stdio_routes or serves_stdio(self.catalog):
            # A connection's address, not a call's decision: outside the pipeline (and only where a stdio server can
            # be named, as every addon costs every hook). A reserved name without a route never reaches DNS.
            master.addons.add(StdioRoutes(self.config.stdio_routes))
        # rawtcp off: bytes mitmproxy cannot read as HTTP are never passed through as a raw stream.
        updates: dict[str, Any] = {"connection_strategy": "lazy", "http2": True, "tcp_timeout": 600,
                                   "rawtcp": False}
        if self.config.upstream_ca:
            updates["ssl_verify_upstream_trusted_ca"] = self.config.upstream_ca
        if self.config.transparent_listen:
            host, port = self.config.transparent_listen
            updates["mode"] = [f"regular@{self.config.listen_host}:{self.config.listen_port}",
                               f"transparent@{host}:{port}"]
        if self.config.dns_listen:
            answer = (self.config.transparent_listen or (self.config.listen_host, 0))[0]
            self._dns = await serve_dns(*self.config.dns_listen, answer)
        master.options.update(**updates)
        self.master = master
        self._tasks.append(asyncio.create_task(master.run()))
        proxyserver = master.addons.get("proxyserver")
        for _ in range(500):
            await asyncio.sleep(0.01)
            if proxyserver.listen_addrs():
                break
        addrs = proxyserver.listen_addrs()
        if not addrs:
            errors = [str(s.last_exception) for s in proxyserver.servers if getattr(s, "last_exception", None)]
            raise TetherError(f"the proxy could not listen on {self.config.listen_host}:{self.config.listen_port}: "
                              f"{'; '.join(errors) or 'unknown error'}", code=codes.LISTEN_FAILED)
        host, port = addrs[0][:2]
        self.address = (host, port)
        if self.config.enclosure_fds is not None:
            from .rootless import DNS_ANSWER

            self._enclosure = await serve_enclosure(proxyserver, *self.config.enclosure_fds, DNS_ANSWER)
        log.info("sidecar for %s listening on %s:%d", self.agent, host, port)
        return host, port

    async def begin(self) -> None:
        """Serve on a fresh lease (starting may have been slow), then run the loops that keep it. Until the
        heartbeat is answered the lease taken at registration may lapse, and then every call is refused
        (``tether.lease_expired``): nothing is forwarded on a lease the control plane has not renewed. Raises
        ``tether.controlplane_unreachable`` like the start-up steps before it, for the caller to retry."""
        await self.heartbeat_once()
        if len(self._tasks) == 1:
            for job in (self.heartbeat_loop, self.events_loop, self.reporter.run, self.watchdog_loop,
                        self.budgets.run):
                self._tasks.append(asyncio.create_task(job()))

    def addons(self) -> list[Any]:
        """tether's addons in pipeline order, each given only what it uses (addons.py, enforce.py)."""
        catalog, state = self.catalog, self.state
        discard_trailers()  # mitmproxy's HTTP/1 layer would raise on them (tether/proxy/framing.py)
        answer_early()  # refusals that must not wait for the request body (tether/proxy/framing.py)
        bulk_transfers()  # large bodies in pieces of 1 MiB, not 64 KiB (tether/proxy/framing.py)
        spend = self.budgets.spend if self.budgets.active else None
        tracing = call_tracing(self.agent, self.run_id, self.resolved)
        mcp_calls = McpCalls(state, McpLedger())  # after the decision, before the hold and the forwarder
        self.resolved.append(mcp_calls.on_resolved)
        ours: list[Any] = [Transparent(), Tracker(self.agent, self.track), *tracing,
                           Tunnels(catalog, state, self.track, self.resolve),
                           Enforcer(catalog, state, own_destinations(self.config.controlplane)),
                           CredentialRoutes(catalog),  # before an approval, a budget unit, a spooled start
                           mcp_calls,
                           Holds(state, self.await_approval), Forwarder(state, spend, self.reporter.start),
                           Injector(catalog, self.credentials, state), McpFilter(catalog, state.tier, mcp_calls),
                           Streamer(), WebsocketBound()]
        if self.config.capture:
            ours.append(Capture(self.capture, self.allow_uncaptured))
        return [*ours, Resolver(self.resolve)]

    @property
    def ca_cert(self) -> Path:
        return self.config.state_dir / "ca" / "mitmproxy-ca-cert.pem"

    async def stop(self) -> None:
        """Stop serving: admit nothing more, let what left finish within the stop window, cut the rest, and
        only then shut the proxy, deliver every report and tell the control plane we are gone.

        The order is what keeps the record true: a call not yet forwarded meets the stopping state at the
        Forwarder's last look and is refused by its own flow (it can never leave after that), so the only calls
        this method resolves itself are ones no hook will ever finish."""
        if self.state is not None:
            self.state.stopping()
        self._cancel_held()
        if self.master is not None:
            await self._drain_then_cut(self.config.stop_window_s, 5.0,
                                       f"stopping: cutting %d call(s) still in flight after the "
                                       f"{self.config.stop_window_s:.0f}s stop window")
            # Stop listening and close what is open while the addons still run: every call on a connection
            # meets its end (and its report) before the last delivery, none after it.
            proxyserver = self.master.addons.get("proxyserver")
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proxyserver.servers.update([]), 5.0)
            if self._enclosure is not None:
                self._enclosure[0].close()
            if self._close_connections():
                await asyncio.sleep(0.2)  # their last hooks resolve (and report) the calls they carried
        if self.master is not None:
            self.master.shutdown()
        for task in self._tasks[1:]:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for call in list(self.calls.inflight.values()):
            left = call.phase in ("forwarding", "forwarded")
            self.resolve(call, "unknown" if left else "cancelled_not_sent",
                         detail="the sidecar stopped while the call was in flight")
        with contextlib.suppress(Exception):  # unused budget goes back; what is not returned counts as spent
            await asyncio.wait_for(self.budgets.release(), 3.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.goodbye(), 3.0)
        await self.close_sessions()
        if self._dns is not None:
            self._dns.close()
        if self._enclosure is not None:
            self._enclosure[1].close()
        self.capture.close()
        self._lock.close()
        self.stopped.set()

    async def close_sessions(self) -> None:
        """Close the HTTP client sessions (the control plane's, the OAuth2 token endpoints'): on every way out,
        or asyncio prints "Unclosed client session" dumps after the sidecar's last line."""
        await self.channel.close()
        await self.credentials.close()

    def _close_connections(self) -> int:
        """Close every agent connection still open once the proxy stopped listening: a request on one would be
        refused after the last report was delivered, and so be missing from the record. Returns how many."""
        proxyserver = self.master.addons.get("proxyserver") if self.master is not None else None
        handlers = list(getattr(proxyserver, "connections", {}).values())
        for handler in handlers:
            with contextlib.suppress(Exception):
                handler.transports[handler.client].handler.cancel("tether: the sidecar stopped")
        return len(handlers)

    async def goodbye(self) -> None:
        """Final reports, then a last heartbeat saying the proxy is gone: nothing more can pass through it."""
        if not await self.reporter.flush():
            log.warning("reports could not be delivered; not telling the control plane we stopped "
                        "(they stay in %s)", self.reporter.spool_path)
            return
        if self.state is not None and self.state.registered and self.state.mode != TERMINATED:
            await self.channel.heartbeat(protocol.Heartbeat(
                state=protocol.STOPPED, seq=self.seq, pid=os.getpid(), started_at=self.started_at,
                spooled=self.reporter.count))

    async def retire(self) -> str:
        """This run may never serve (its chain was revoked or expired, or its agent terminated, before it
        started): deliver what the spool holds, acknowledge a standing termination of this link (late: the
        record gets an addendum) or say goodbye, and give the reason to exit with. Nothing is forwarded:
        the proxy never listens."""
        attempt = 0
        while not await self.reporter.flush():
            attempt += 1
            if attempt == 1:
                log.warning("retiring: waiting to deliver %d spooled report(s)", self.reporter.count)
            await sleep_backoff(attempt)
        lease = await self.channel.heartbeat(protocol.Heartbeat(
            state=protocol.RETIRING, pid=os.getpid(), started_at=self.started_at, supersedes=self.supersedes or None,
            spooled=self.reporter.count))
        command = lease.command
        if command and command.get("termination_id"):
            self.capture.hold(command["termination_id"], command.get("window_s"))
            await self.acknowledge(command)
            done = f"acknowledged termination {command['termination_id']}"
        else:
            await self.channel.heartbeat(protocol.Heartbeat(
                state=protocol.STOPPED, pid=os.getpid(), started_at=self.started_at, spooled=self.reporter.count))
            done = "told the control plane it stopped"
        return f"{self.agent} will not serve: {self.retired}; spooled reports delivered, {done}"

    # -- the in-flight table ------------------------------------------------------------------------------
    def track(self, call: Call, flow: http.HTTPFlow) -> None:
        self.calls.start(call)
        self.flows[call.call_id] = flow
        if self.state.command:
            call.termination_id = self.state.command.get("termination_id")

    def resolve(self, call: Call, resolution: str, *, status: int | None = None, code: str | None = None,
                detail: str | None = None) -> None:
        done = self.calls.resolve(call.call_id, resolution, time.time(), status=status, code=code,
                                  detail=detail or call.detail)
        self.flows.pop(call.call_id, None)
        if done is not None:
            self.reporter.add(done.report())
            for listener in self.resolved:
                listener(done)

    # -- control plane loops -------------------------------------------------------------------------------
    async def heartbeat_once(self) -> None:
        sent = time.monotonic()
        beat = protocol.Heartbeat(
            state=self.state.mode, inflight=self.calls.snapshot(), seq=self.seq, pid=os.getpid(),
            proxy=f"{self.address[0]}:{self.address[1]}" if self.address else None, started_at=self.started_at,
            spooled=self.reporter.count, supersedes=self.supersedes or None,
            revocations_held=self.state.revocations_held(time.monotonic()) if self.state.learned else None,
            budget_slices=self.budgets.held())
        lease = await self.channel.heartbeat(beat)
        self.supersedes = None
        self.state.renewed(sent, lease.lease_ttl_s)
        if lease.revoked and self.state.revoke(lease.revoked, time.monotonic()):
            log.warning("revoked (learned from the heartbeat): %s", ", ".join(lease.revoked))
        if lease.command:
            self.on_command(lease.command)

    async def heartbeat_loop(self) -> None:
        failures = 0
        while True:
            await asyncio.sleep(max(0.2, self.state.lease_ttl_s / 3) if failures == 0 else 0.5)
            try:
                await self.heartbeat_once()
                if failures:
                    log.info("control plane reachable again; lease renewed")
                failures = 0
            except ApiError as exc:
                failures += 1
                if failures == 1:
                    log.warning("heartbeat failed: %s (lease runs out in %.1fs)", exc.message,
                                self.state.lease_until - time.monotonic())

    async def sync_events(self, wait: float) -> None:
        self.apply_events(await self.channel.events(self.seq, wait))

    def apply_events(self, answer: dict[str, Any]) -> None:
        """One document of the event channel (a long poll's answer, or one line of the stream)."""
        if answer.get("resync"):
            self.state.revoke(answer.get("revoked", []), time.monotonic())  # revocations are never undone
            if answer.get("command"):
                self.on_command(answer["command"])
            for approval in answer.get("approvals", []):
                self.on_approval(approval)
        for event in answer.get("events", []):
            self.on_event(event)
        self.seq = int(answer.get("next", self.seq))

    async def events_loop(self) -> None:
        """Follow the event stream (one long-lived response); a control plane without it (404) is followed
        by long poll instead. Either way a broken connection resumes from the last sequence number."""
        attempt = 0
        streaming = True
        while True:
            try:
                if streaming:
                    async for answer in self.channel.stream_events(self.seq):
                        self.apply_events(answer)
                        attempt = 0
                    await sleep_backoff(0)  # the control plane ended it (a restart, or we fell behind): resume
                else:
                    await self.sync_events(wait=20)
                    attempt = 0
            except ApiError as exc:
                if streaming and exc.http_status in (404, 405):
                    log.info("the control plane has no event stream (HTTP %s); following it by long poll",
                             exc.http_status)
                    streaming = False
                    continue
                attempt += 1
                if attempt == 1:
                    log.warning("event stream interrupted: %s", exc.message)
                await sleep_backoff(attempt)

    def on_event(self, event: dict[str, Any]) -> None:
        kind, payload = event.get("kind"), event.get("payload", {})
        if kind == REVOKE:
            if self.state.revoke([payload["jti"]], time.monotonic()):
                log.warning("revoked: %s (%s); refusing every call from now on", payload["jti"], payload.get("agent"))
        elif kind == COMMAND:
            self.on_command(payload)
        elif kind == APPROVAL:
            self.on_approval(payload)

    # -- approvals ---------------------------------------------------------------------------------------
    async def await_approval(self, call: Call) -> str:
        flow = self.flows.get(call.call_id)
        # The body whole (Holds refused any past the limit): the approver sees everything that would leave.
        shown = held_call(flow, self.capture.fields, limit=APPROVAL_BODY_LIMIT) if flow is not None else {}
        try:
            doc = await self.channel.ask_approval({
                "call_id": call.call_id, "capability": call.capability, "method": call.method, "url": call.url,
                "timeout_s": self.config.approval_timeout_s, "request": shown, "call_hash": shown.get("call_hash")})
        except ApiError as exc:
            refused = filing_refused(exc.code, exc.message)
            if refused is not None:
                raise refused from None
            return f"approval could not be requested: {exc.message}"
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        future.call_hash = shown.get("call_hash")  # type: ignore[attr-defined]
        self.approvals[doc["id"]] = future
        log.info("call %s held for approval %s (%s)", call.call_id, doc["id"], call.capability)
        try:
            decision = await asyncio.wait_for(future, self.config.approval_timeout_s)
        except TimeoutError:
            return "timeout"
        finally:
            self.approvals.pop(doc["id"], None)
        if decision == APPROVED and (flow is None or call_hash(flow.request) != shown.get("call_hash")):
            # The request changed while it was held: the person approved another request than this one.
            log.error("call %s changed while held; approval %s does not apply to it", call.call_id, doc["id"])
            return DENIED
        return decision

    def on_approval(self, doc: dict[str, Any]) -> None:
        future = self.approvals.get(doc.get("id", ""))
        if future is not None and not future.done():
            status = doc.get("status", DENIED)  # approved | denied | cancelled (by a termination)
            if status == APPROVED and doc.get("call_hash") != getattr(future, "call_hash", None):
                # An approval binds to the exact call it showed; one for any other request is not ours.
                log.error("approval %s names call hash %s, not this call's; refusing the call",
                          doc.get("id"), doc.get("call_hash"))
                status = DENIED
            future.set_result(status)

    # -- termination ------------------------------------------------------------------------------------
    def on_command(self, command: dict[str, Any]) -> None:
        tid = command.get("termination_id")
        if tid:  # its record will name this capture's flows: none of them is pruned until exported
            self.capture.hold(tid, command.get("window_s"))
        if self.state.mode == TERMINATED:
            # Already quiesced (an earlier termination of this agent or an ancestor): nothing is in flight,
            # so a new termination is acknowledged at once.
            if tid and tid not in self._acked and tid not in self._acking:
                self._acking.add(tid)
                self._tasks.append(asyncio.create_task(self.acknowledge(command)))
            return
        if tid:
            self._commanded_ids.add(tid)
        before = self.state.mode
        mode = self.state.commanded(command)
        if mode == before:
            return
        log.warning("control plane commands %s (termination %s)", mode, tid)
        for call in self.calls.inflight.values():
            call.termination_id = tid
        if self._quiesce_task is not None:
            self._quiesce_task.cancel()
        self._quiesce_task = asyncio.create_task(self.quiesce(command))

    def _cancel_held(self) -> None:
        for future in self.approvals.values():
            if not future.done():
                future.set_result(CANCELLED)

    def abort_flow(self, flow: http.HTTPFlow) -> None:
        """Cut a forwarded call off now (mitmproxy's kill only acts at the next hook)."""
        state_of(flow).aborted = "tether.aborted"
        self._notify_mcp_cancel(flow)
        if flow.killable:
            flow.kill()
        proxyserver = ctx.master.addons.get("proxyserver") if self.master else None
        handler = proxyserver.connections.get(flow.client_conn.id) if proxyserver else None
        if handler is not None:
            with contextlib.suppress(Exception):
                handler.transports[handler.client].handler.cancel("tether: aborted by the control plane")

    def _notify_mcp_cancel(self, flow: http.HTTPFlow) -> None:
        """Closing the stream is cancellation to MCP; where the session has an id, say so explicitly too."""
        parsed = state_of(flow).mcp_parsed
        session = flow.request.headers.get("mcp-session-id")
        if parsed is None or session is None or (flow.response is not None and not flow.response.stream):
            return
        ids = [m.id for m in parsed.messages if m.method == "tools/call" and m.id is not None]
        if not ids:
            return
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
                   "mcp-session-id": session}
        version = flow.request.headers.get("mcp-protocol-version")
        if version:
            headers["mcp-protocol-version"] = version
        url = flow.request.url.split("?", 1)[0]

        async def send() -> None:
            import ssl

            context = ssl.create_default_context(cafile=self.config.upstream_ca) if self.config.upstream_ca else None
            try:
                async with aiohttp.ClientSession() as session_http:
                    for request_id in ids:
                        body = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                                "params": {"requestId": request_id, "reason": "tether: terminated"}}
                        async with session_http.post(url, json=body, headers=headers, ssl=context or True,
                                                     timeout=aiohttp.ClientTimeout(total=3)) as resp:
                            await resp.read()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                log.info("could not send notifications/cancelled to %s: %s", url, exc)

        self._tasks.append(asyncio.create_task(send()))

    async def quiesce(self, command: dict[str, Any]) -> None:
        """Drain (wait for in-flight calls until the window ends) or abort, then report and acknowledge."""
        # Only calls that left for the upstream are waited for: a call that arrives now is refused at once, and
        # an agent that keeps calling must not hold the drain (or the acknowledgement) to its full length.
        window_s = 0.0
        if self.state.mode == DRAINING and isinstance(command.get("remaining_s"), int | float):
            # The window left as the control plane's good clock saw it when it handed the command out: our own
            # clock (which may be off) plays no part, only the monotonic one from now on.
            window_s = max(0.0, min(float(command["remaining_s"]), float(command.get("window_s", 0))))
        elif self.state.mode == DRAINING:
            deadline = min(float(command.get("deadline", time.time())),
                           time.time() + float(command.get("window_s", 0)))
            window_s = max(0.0, deadline - time.time())
        # Wait for the cut calls' final events, but leave the control plane's grace for the reports.
        await self._drain_then_cut(window_s, min(5.0, float(command.get("grace_s", 10.0)) / 2),
                                   "aborting %d call(s) still in flight")
        await self._settle_arrivals(1.0)
        for call in list(self.calls.inflight.values()):  # no hook came back: say only what we know
            left = call.phase in ("forwarding", "forwarded")
            self.resolve(call, "unknown" if left else "cancelled_not_sent",
                         detail="aborted; no final event from the proxy")
        self.state.quiesced()
        with contextlib.suppress(Exception):  # nothing more is forwarded: hand unused budget back
            await asyncio.wait_for(self.budgets.release(), 5.0)
        # Every termination that reached us while we quiesced is answered, not only the last one.
        for tid in sorted(self._commanded_ids - self._acked):
            self._acking.add(tid)
            await self.acknowledge({**command, "termination_id": tid})

    async def _drain_then_cut(self, window_s: float, settle_s: float, message: str) -> None:
        """Cancel holds, wait up to ``window_s`` for the calls that left, then cut those still in flight and wait
        up to ``settle_s`` for their final events: their own hooks resolve them (``unknown``), not the caller.
        Shared by a termination's drain or abort and the sidecar's own stop. ``message`` logs the cut (%d)."""
        self._cancel_held()
        deadline = time.monotonic() + window_s
        while self._leaving() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._cancel_held()
        await asyncio.sleep(0.05)  # let cancelled holds and not-yet-forwarded calls meet their refusal
        cut = self._leaving()
        if cut:
            log.warning(message, len(cut))
        for call in cut:
            flow = self.flows.get(call.call_id)
            if flow is not None:
                self.abort_flow(flow)
        limit = time.monotonic() + settle_s
        ids = {call.call_id for call in cut}
        while ids & self.calls.inflight.keys() and time.monotonic() < limit:
            await asyncio.sleep(0.05)

    async def _settle_arrivals(self, limit_s: float) -> None:
        """Give calls that arrived but never left a moment to meet their refusal in their own flow (nothing is
        forwarded now), so the record says what their clients saw, not a guess; what is left after ``limit_s``
        is for the caller's sweep."""
        limit = time.monotonic() + limit_s
        while time.monotonic() < limit and any(
                c.phase not in ("forwarding", "forwarded") and c.call_id in self.flows
                for c in self.calls.inflight.values()):
            await asyncio.sleep(0.02)

    def _leaving(self) -> list[Call]:
        """Calls in flight that were forwarded (or are being): the ones a drain waits for and an abort cuts."""
        return [c for c in self.calls.inflight.values() if c.phase in ("forwarding", "forwarded")]

    async def acknowledge(self, command: dict[str, Any]) -> None:
        """Deliver every report, then tell the control plane this sidecar is quiescent (retrying).

        Every report: every one queued when the acknowledgement began. A call refused meanwhile (an agent
        that keeps calling) is reported after it, or an agent calling fast enough on a slow link would keep
        the acknowledgement from ever being sent."""
        tid = command.get("termination_id")
        mark = self.reporter.mark()
        attempt = 0
        while True:
            try:
                await self.reporter.flush(mark, batch=ACK_BATCH)
                await self.channel.quiesced(protocol.Quiesced(
                    termination_id=tid, reports=self.reporter.pending_until(mark), calls=dict(self.calls.counts),
                    state=TERMINATED))
                self._acked.add(tid)
                log.warning("quiesced and acknowledged termination %s; refusing everything from now on", tid)
                return
            except ApiError as exc:
                attempt += 1
                if attempt == 1:
                    log.warning("cannot acknowledge termination %s yet: %s", tid, exc.message)
                await sleep_backoff(attempt)

    # -- call timeouts -----------------------------------------------------------------------------------
    async def watchdog_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.time()
            for call in list(self.calls.inflight.values()):
                if call.phase != "held":
                    if now - call.started_at > self.config.call_timeout_s:
                        flow = self.flows.get(call.call_id)
                        if flow is not None and flow.websocket is None:  # a websocket is meant to last
                            log.warning("call %s exceeded %.0fs; aborting it (outcome unknown)", call.call_id,
                                        self.config.call_timeout_s)
                            self.abort_flow(flow)
