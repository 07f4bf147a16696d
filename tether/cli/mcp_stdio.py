"""``tether mcp stdio``: a stdio MCP server under a sidecar, for hosts that start their servers over stdio.

A desktop agent starts ``tether mcp stdio --chain F --key K --name NAME -- CMD ARGS...`` where it started
``CMD ARGS...``: its MCP config changes only its command line. The bridge starts CMD as its child and speaks
stdio to its own parent (the host), and no message passes between the two except through a real ``tether
sidecar`` subprocess, so each one meets the decision, list filtering, approval, capture, reports and termination
of any MCP call over HTTP. Nothing of the sidecar is re-implemented: this file starts the parts and ends
them; tether/proxy/stdio_bridge.py holds the two halves of the bridge (the child's stdio as a loopback MCP
endpoint, the host's stdio as requests through the sidecar); tether/proxy/stdio.py the sidecar's
``--stdio-route NAME=127.0.0.1:PORT``, which alone knows where the reserved ``http://NAME.stdio.tether/mcp`` (the
catalog's ``stdio://NAME``) leads.

With ``--enforce-server`` the server runs under ``tether run`` (enforced) instead, whose sidecar gets the route:
one sidecar carries the host's messages and the server's own outbound traffic.

The bridge's stdout carries MCP only: its own messages go to stderr, the sidecar's to its log. When the host
closes stdin (or stops the bridge), the child's stdin is closed, the child is given a moment to exit, and the
sidecar stops as it always does (in-flight calls finish in its stop window, reports delivered).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tether.capability.errors import BAD_REQUEST, TetherError

from .remote import add_controlplane
from .sidecar import SIDECAR_OPTIONS, default_state_root
from .spawn import die_with_parent

if TYPE_CHECKING:
    from tether.proxy.stdio_bridge import Endpoint, HostRelay

# Sidecar options whose meaning the bridge sets itself, or that make no sense in front of one stdio server.
NOT_HERE = ("listen", "ready_file", "transparent_listen", "dns_listen", "stdio_route")
OVERRIDES: dict[str, dict[str, Any]] = {
    "state_dir": {"help": "the sidecar's state dir (default: $XDG_STATE_HOME/tether/AGENT/stdio/NAME, else "
                          "~/.local/state/tether/AGENT/stdio/NAME)"},
}


def add_mcp(sub: Any) -> None:
    p = sub.add_parser("mcp", help="MCP servers under tether (stdio servers: tether mcp stdio)")
    group = p.add_subparsers(dest="mcp_command", required=True, metavar="COMMAND")
    s = group.add_parser("stdio", help="run a stdio MCP server under a sidecar, speaking stdio to the host",
                         description="Start CMD (a stdio MCP server) as a child and speak MCP over stdio to the "
                         "host; every message in both directions passes through a tether sidecar, as it would "
                         "to an HTTP MCP server. Every sidecar option is accepted and forwarded to it.")
    add_controlplane(s)
    for option in SIDECAR_OPTIONS:
        if option.dest not in NOT_HERE:
            option.add_to(s, **OVERRIDES.get(option.dest, {}))
    s.add_argument("--name", metavar="NAME",
                   help="the server's name in the catalog: its capabilities name url stdio://NAME (default: the "
                   "one stdio server the chain holds anything on)")
    s.add_argument("--enforce-server", action="store_true",
                   help="run the server under tether run, enforced: its own outbound traffic has no way out but "
                   "the same sidecar (the catalog must grant what it calls; Linux namespaces)")
    s.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...", help="the stdio server and its arguments")
    s.set_defaults(func=cmd_mcp_stdio)


def cmd_mcp_stdio(args: argparse.Namespace) -> int:
    from tether.capability.catalog import stdio_name_ok

    from .sidecar import setup_logging

    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise TetherError("give the stdio server's command after --, e.g. tether mcp stdio --chain c --key k "
                          "--name files -- npx -y @modelcontextprotocol/server-filesystem /data", code=BAD_REQUEST)
    if args.name is None:
        args.name = default_name(args)
    if not stdio_name_ok(args.name):
        raise TetherError(f"--name is one lower-case DNS label (letters, digits, '-'), as in the catalog's "
                          f"stdio://NAME (not {args.name!r})", code=BAD_REQUEST)
    setup_logging()
    return asyncio.run(Bridge(args, command).run())


def default_name(args: argparse.Namespace) -> str:
    """The one stdio server on which the chain holds anything, per the catalog (``--catalog``, else the control
    plane's): a host config then needs no ``--name`` when its grant covers a single stdio server."""
    from urllib.parse import urlsplit

    from tether.capability.catalog import catalog_from, empty_catalog, stdio_server_name
    from tether.capability.chain import parse_chain_unverified
    from tether.capability.shared import load_catalog, read_chain

    from .remote import client

    if args.catalog:
        catalog = load_catalog(args.catalog)
    else:
        doc = client(args).request("GET", "/v1/catalog", admin=False)
        catalog = catalog_from(doc["catalog"]) if doc["catalog"].get("capabilities") else empty_catalog()
    held = parse_chain_unverified(read_chain(args.chain))[-1].caps
    names = set()
    for name in held:
        cap = catalog.capabilities.get(name)
        if cap is not None and cap.mcp is not None and held[name] != "absent":
            server = stdio_server_name(urlsplit(cap.mcp.server).hostname or "")
            if server is not None:
                names.add(server)
    if len(names) != 1:
        raise TetherError("give --name: the chain holds capabilities on " + (
            f"the stdio servers {', '.join(sorted(names))}" if names else "no stdio server (stdio://NAME) of the "
            "catalog"), code=BAD_REQUEST)
    return names.pop()


# -- the whole bridge ------------------------------------------------------------------------------------
class Bridge:
    def __init__(self, args: argparse.Namespace, command: list[str]) -> None:
        self.args, self.command = args, command
        self.sidecar: subprocess.Popen | None = None

    async def run(self) -> int:
        from aiohttp import web

        from tether.capability.catalog import stdio_endpoint
        from tether.proxy.stdio_bridge import LINE_LIMIT, Endpoint, HostRelay, host_pipes, say

        from .spawn import wait_ready

        args = self.args
        token = secrets.token_urlsafe(32)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))  # bound before the sidecar starts: its route names this port
        port = listener.getsockname()[1]
        state_dir = self._state_dir()
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        ready = state_dir / "sidecar.ready"
        ready.unlink(missing_ok=True)
        route = f"{args.name}=127.0.0.1:{port}"
        child: Any = None
        try:
            if args.enforce_server:
                # tether run starts the sidecar (with our route) and the server enclosed: one sidecar for both.
                child = await asyncio.create_subprocess_exec(
                    *self._run_argv(state_dir, ready, route), stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, limit=LINE_LIMIT, env=child_env(), preexec_fn=die_with_parent)
                agent_dir = state_dir / self._agent()
                log_path = agent_dir / "sidecar.log"
                info = await asyncio.to_thread(wait_ready, _Polled(child), ready, log_path)
            else:
                log_path = state_dir / "sidecar.log"
                self.sidecar = self._start_sidecar(state_dir, ready, log_path, route)
                info = await asyncio.to_thread(wait_ready, self.sidecar, ready, log_path)
            say(f"stdio server {args.name} behind the sidecar for {info['agent']} at {info['proxy']} "
                f"(log {log_path})")
            if not args.enforce_server:
                say("every MCP message passes the sidecar; the server's own outbound traffic does not (give "
                    "--enforce-server to enforce it too)")
            if child is None:
                child = await asyncio.create_subprocess_exec(
                    *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=LINE_LIMIT,
                    env=child_env(), preexec_fn=die_with_parent)
            endpoint = Endpoint(child, token)
            # The sidecar points each connection for the reserved name at this port anew (mitmproxy reuses a
            # connection only for the address it asked for), so idle ones are closed soon rather than kept.
            runner = web.AppRunner(endpoint.app(), handler_cancellation=True, access_log=None, keepalive_timeout=2.0)
            await runner.setup()
            await web.SockSite(runner, listener).start()
            reading = asyncio.create_task(endpoint.read_child())
            stdin, out = await host_pipes()
            relay = HostRelay(stdio_endpoint(args.name), info["proxy"], token, out)
            hosting = asyncio.create_task(relay.relay(stdin))
            # Enforced, the sidecar is tether run's: it ends with the server, and so does the bridge.
            watching = asyncio.create_task(asyncio.to_thread(self.sidecar.wait) if self.sidecar is not None
                                           else asyncio.Event().wait())
            stopping = asyncio.get_running_loop().create_future()
            for sig in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(sig, lambda s=sig: stopping.done() or
                                                              stopping.set_result(s))
            done, _ = await asyncio.wait({hosting, reading, watching, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if watching in done and self.sidecar is not None:
                say(f"the sidecar exited ({self.sidecar.returncode}); nothing more reaches the stdio server "
                    f"(see {log_path})")
            # tether run stops its sidecar after the server: its stop window and reports come first.
            patience = args.stop_window + 20 if args.enforce_server else 5.0
            code = await self._finish(child, endpoint, hosting, reading, patience, relay)
            watching.cancel()
            await runner.cleanup()
            if watching in done and self.sidecar is not None:
                died = self.sidecar.returncode
                return 128 - died if died < 0 else died or 1
            if stopping.done():
                return 128 + int(stopping.result())
            return code
        finally:
            listener.close()
            self._stop_sidecar()
            if child is not None and child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                await child.wait()

    async def _finish(self, child: Any, endpoint: Endpoint, hosting: asyncio.Task, reading: asyncio.Task,
                      patience: float, relay: HostRelay) -> int:
        """Close the child's stdin, give it ``patience`` seconds to exit (then SIGTERM, then SIGKILL); the host
        relay ends."""
        if child.stdin is not None:
            with contextlib.suppress(OSError):
                child.stdin.close()
        for step, wait_s in ((lambda: None, patience), (child.terminate, patience), (child.kill, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                step()
            try:
                await asyncio.wait_for(asyncio.shield(reading), wait_s)
                break
            except TimeoutError:
                continue
        if relay.tasks:  # a server that exited answered its waiting requests with an error: the host gets them
            await asyncio.wait(set(relay.tasks), timeout=3)
        hosting.cancel()
        await asyncio.gather(hosting, reading, return_exceptions=True)
        code = endpoint.exited if endpoint.exited is not None else child.returncode or 0
        return 128 - code if code < 0 else code

    def _agent(self) -> str:
        from tether.capability.chain import parse_chain_unverified
        from tether.capability.shared import read_chain

        return parse_chain_unverified(read_chain(self.args.chain))[-1].sub

    def _state_dir(self) -> Path:
        """The sidecar's state dir (enforced: the root of tether run's, which keeps the agent's inside it)."""
        if self.args.state_dir:
            return Path(self.args.state_dir)
        # Per server: a host that starts several stdio servers under one chain runs one sidecar for each.
        return default_state_root() / self._agent() / "stdio" / self.args.name

    def _sidecar_args(self, route: str) -> argparse.Namespace:
        return argparse.Namespace(**{**vars(self.args), "listen": "127.0.0.1:0", "transparent_listen": None,
                                     "dns_listen": None, "stdio_route": [route]})

    def _run_argv(self, state_dir: Path, ready: Path, route: str) -> list[str]:
        """``tether run`` for the server, enforced, with every sidecar option (and our route) forwarded."""
        from .remote import DEFAULT_CONTROLPLANE
        from .run import SET_BY_RUN

        args = self._sidecar_args(route)
        resolved = {"chain": args.chain, "key": args.key, "state_dir": str(state_dir), "ready_file": str(ready)}
        argv = [sys.executable, "-m", "tether", "run", "--controlplane", args.controlplane or DEFAULT_CONTROLPLANE]
        for option in SIDECAR_OPTIONS:
            argv += option.argv(resolved[option.dest] if option.dest in SET_BY_RUN else getattr(args, option.dest))
        return [*argv, "--", *self.command]

    def _start_sidecar(self, state_dir: Path, ready: Path, log_path: Path, route: str) -> subprocess.Popen:
        from .run import without_authority
        from .spawn import sidecar_argv

        args = self._sidecar_args(route)
        argv = sidecar_argv(args, chain=args.chain, key=args.key, state_dir=state_dir, ready=ready)
        with open(log_path, "ab") as log_file:
            # Never the host's stdin or stdout: those carry the MCP session.
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                    start_new_session=True, env=without_authority(os.environ),
                                    preexec_fn=die_with_parent)

    def _stop_sidecar(self) -> None:
        from .spawn import stop_sidecar

        if self.sidecar is not None:
            stop_sidecar(self.sidecar, self.args.stop_window)


class _Polled:
    """An asyncio child as ``wait_ready`` polls a sidecar: ``poll()`` is its exit status, or None while it runs."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    def poll(self) -> int | None:
        return self.process.returncode


def child_env() -> dict[str, str]:
    """The stdio server's environment: the host's, without tether's tokens."""
    from .run import without_authority

    return without_authority(os.environ)
