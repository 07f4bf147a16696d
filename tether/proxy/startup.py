"""A sidecar's start-up: its configuration, its run, what it learns before it may serve, and its proxy.

Start-up learns the trust key and the catalog (unless given), verifies the chain and registers it (``learn``);
a chain that is revoked or expired still registers, so the run can deliver its spool and acknowledge, but it never
serves (``Learned.retired``). ``open_proxy`` starts mitmproxy with the part of it a sidecar needs and tether's
pipeline, and waits until it listens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from mitmproxy import http, options

from tether.capability import errors as codes
from tether.capability import keys
from tether.capability.catalog import Catalog, catalog_from, empty_catalog
from tether.capability.chain import VerifiedChain, Verifier
from tether.capability.errors import ApiError, ChainError, TetherError
from tether.capture.retention import Policy as CapturePolicy

from .addons import Capture, McpFilter, Resolver, Streamer, Tracker, WebsocketBound
from .budget import Budgets
from .capture import CaptureWriter
from .channel import ControlChannel, sleep_backoff
from .credentials import CredentialRoutes, Credentials, Injector
from .enforce import Enforcer, Forwarder, Holds, Tunnels, own_destinations
from .framing import answer_early, bulk_transfers, discard_trailers
from .mcpcalls import McpCalls, McpLedger
from .mitmaddons import Master, block, core, disable_h2c, dns_resolver, next_layer, proxyserver, tlsconfig
from .relay import direct_relay
from .state import Call, SidecarState
from .stdio import StdioRoutes, serves_stdio
from .streamlayer import ListPieces, stream_lists
from .telemetry import call_tracing
from .transparent import Transparent, serve_dns, serve_enclosure

log = logging.getLogger("tether.sidecar")


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


async def retrying(attempt: Callable[[], Awaitable[None]], timeout_s: float) -> None:
    """Run one start-up attempt again while the control plane is unreachable, for up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    tries = 0
    while True:
        try:
            await attempt()
            return
        except ApiError as exc:
            if exc.code != "tether.controlplane_unreachable" or time.monotonic() > deadline:
                raise
            tries += 1
            if tries == 1:
                log.warning("waiting for the control plane: %s", exc.message)
            await sleep_backoff(tries)


@dataclass
class Learned:
    """What start-up learned: the catalog, the verifier, and the verified chain, unless the run is ``retired``
    (its chain is revoked or expired: it may still owe the control plane its spool and an acknowledgement)."""

    catalog: Catalog
    verifier: Verifier
    verified: VerifiedChain | None
    retired: str | None


async def learn(channel: ControlChannel, config: SidecarConfig, catalog: Catalog | None, wire: str) -> Learned:
    """Trust, catalog, chain, registration: one attempt (``tether.controlplane_unreachable`` is the caller's to
    retry)."""
    trust = config.trust
    if trust is None:
        trust = keys.from_jwk((await channel.public("/v1/trust"))["jwk"])
    if catalog is None:
        doc = await channel.public("/v1/catalog")
        source = f"{config.controlplane}/v1/catalog"
        catalog = (catalog_from(doc["catalog"], source) if doc["catalog"].get("capabilities")
                   else empty_catalog(source))
        if catalog.hash != doc["hash"]:
            raise TetherError("the catalog fetched from the control plane does not match its hash",
                              code="tether.catalog_invalid")
    verifier = Verifier(trust, catalog_hash=catalog.hash)
    verified: VerifiedChain | None = None
    retired: str | None = None
    try:
        verified = verifier.verify(wire, now=time.time())
    except ChainError as exc:
        if exc.code not in (codes.CHAIN_EXPIRED, codes.CHAIN_REVOKED):
            raise
        retired = exc.message
    registered = await channel.register(wire)
    if registered.revoked:
        retired = f"the chain is revoked ({', '.join(registered.revoked)})"
    return Learned(catalog, verifier, verified, retired)


def tether_addons(config: SidecarConfig, catalog: Catalog, state: SidecarState, budgets: Budgets,
                  capture: CaptureWriter, credentials: Credentials, start: Callable[[Call], bool],
                  await_approval: Callable[[Call], Awaitable[str]], track: Callable[[Call, http.HTTPFlow], None],
                  resolve: Callable[..., None], resolved: list[Callable[[Call], None]], run_id: str) -> list[Any]:
    """tether's addons in pipeline order, each given only what it uses (addons.py, enforce.py). Listeners told of
    every call's end (tracing, the MCP ledger) join ``resolved``."""
    discard_trailers()  # mitmproxy's HTTP/1 layer would raise on them (tether/proxy/framing.py)
    answer_early()  # refusals that must not wait for the request body (tether/proxy/framing.py)
    bulk_transfers()  # large bodies in pieces of 1 MiB, not 64 KiB (tether/proxy/framing.py)
    direct_relay()  # a body nobody inspects goes socket to socket (tether/proxy/relay.py)
    stream_lists()  # a large JSON list answer filtered as it arrives (tether/proxy/streamlayer.py)
    spend = budgets.spend if budgets.active else None
    tracing = call_tracing(state.agent, run_id, resolved)
    mcp_calls = McpCalls(state, McpLedger())  # after the decision, before the hold and the forwarder
    resolved.append(mcp_calls.on_resolved)
    ours: list[Any] = [Transparent(), Tracker(state.agent, track), *tracing, Tunnels(catalog, state, track, resolve),
                       Enforcer(catalog, state, own_destinations(config.controlplane)),
                       CredentialRoutes(catalog),  # before an approval, a budget unit, a spooled start
                       mcp_calls, Holds(state, await_approval), Forwarder(state, spend, start),
                       Injector(catalog, credentials, state), McpFilter(catalog, state.tier, mcp_calls),
                       ListPieces(),
                       Streamer(), WebsocketBound()]
    if config.capture:
        ours.append(Capture(capture, config.allow_uncaptured))
    return [*ours, Resolver(resolve)]


@dataclass
class Proxy:
    master: Master
    task: asyncio.Task[Any]
    address: tuple[str, int]
    dns: asyncio.DatagramTransport | None = None
    enclosure: tuple[asyncio.Server, asyncio.DatagramTransport] | None = None

    @property
    def server(self) -> Any:
        return self.master.addons.get("proxyserver")


async def open_proxy(config: SidecarConfig, catalog: Catalog, pipeline: Any) -> Proxy:
    """mitmproxy with its needed addons and tether's pipeline, listening (or ``tether.listen_failed``)."""
    opts = options.Options(listen_host=config.listen_host, listen_port=config.listen_port,
                           confdir=str(config.state_dir / "ca"))
    master = Master(opts)
    master.addons.add(*mitmproxy_addons())
    master.addons.add(pipeline)
    if config.stdio_routes or serves_stdio(catalog):
        # A connection's address, not a call's decision: outside the pipeline (and only where a stdio server can
        # be named, as every addon costs every hook). A reserved name without a route never reaches DNS.
        master.addons.add(StdioRoutes(config.stdio_routes))
    # rawtcp off: bytes mitmproxy cannot read as HTTP are never passed through as a raw stream.
    updates: dict[str, Any] = {"connection_strategy": "lazy", "http2": True, "tcp_timeout": 600, "rawtcp": False}
    if config.upstream_ca:
        updates["ssl_verify_upstream_trusted_ca"] = config.upstream_ca
    if config.transparent_listen:
        host, port = config.transparent_listen
        updates["mode"] = [f"regular@{config.listen_host}:{config.listen_port}", f"transparent@{host}:{port}"]
    dns = None
    if config.dns_listen:
        answer = (config.transparent_listen or (config.listen_host, 0))[0]
        dns = await serve_dns(*config.dns_listen, answer)
    master.options.update(**updates)
    task = asyncio.create_task(master.run())
    server = master.addons.get("proxyserver")
    for _ in range(500):
        await asyncio.sleep(0.01)
        if server.listen_addrs():
            break
    addrs = server.listen_addrs()
    if not addrs:
        errors = [str(s.last_exception) for s in server.servers if getattr(s, "last_exception", None)]
        master.shutdown()  # nothing is served: the caller's stop has no proxy to close
        if dns is not None:
            dns.close()
        raise TetherError(f"the proxy could not listen on {config.listen_host}:{config.listen_port}: "
                          f"{'; '.join(errors) or 'unknown error'}", code=codes.LISTEN_FAILED)
    host, port = addrs[0][:2]
    proxy = Proxy(master, task, (host, port), dns)
    if config.enclosure_fds is not None:
        from .rootless import DNS_ANSWER

        proxy.enclosure = await serve_enclosure(server, *config.enclosure_fds, DNS_ANSWER)
    return proxy
