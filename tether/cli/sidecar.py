"""``tether sidecar``: one agent's sidecar, run until SIGTERM or Ctrl-C.

Its options are declared once, in ``SIDECAR_OPTIONS``: the table builds this command's parser and ``tether run``'s,
``tether run`` forwards every one of them to the sidecar it starts, and ``config_from_args`` reads each into
``SidecarConfig`` (no second default anywhere). mitmproxy and the sidecar are imported only when it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tether.capability.errors import TetherError

from .process import wait_for_signal
from .remote import DEFAULT_CONTROLPLANE, add_controlplane

if TYPE_CHECKING:
    import logging

    from tether.capture.retention import Policy as CapturePolicy
    from tether.proxy.sidecar import SidecarConfig

RETIRED = 3  # the exit status of a sidecar whose chain was revoked or expired before it could serve
# While the control plane cannot be reached at start-up, a status line this often (the sidecar keeps trying).
STATUS_EVERY_S = 5.0


def default_state_root() -> Path:
    """Where sidecars keep their state dirs unless told: ``$XDG_STATE_HOME/tether``, else ``~/.local/state/tether``.
    Outside the working directory: the CA key, spool and captures are not the agent's files to read or ship."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "tether"


@dataclass(frozen=True)
class Option:
    """One sidecar option: its flag, where it lands, how it parses, its default and its help."""

    flag: str
    dest: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    action: str | None = None  # None (a value), "append" or "store_true"
    metavar: str | None = None
    required: bool = False

    def add_to(self, p: argparse.ArgumentParser, **override: Any) -> None:
        spec: dict[str, Any] = {"dest": self.dest, "help": self.help, "default": self.default,
                                "required": self.required}
        if self.action:
            spec["action"] = self.action
        if self.action != "store_true":
            spec.update(type=self.type, metavar=self.metavar)
        if self.action == "append":
            spec["default"] = None  # argparse appends to a given list; None reads as "none given"
        spec.update(override)
        p.add_argument(self.flag, **spec)

    def argv(self, value: Any) -> list[str]:
        """The option as ``tether sidecar`` reads it back: nothing when unset."""
        if self.action == "store_true":
            return [self.flag] if value else []
        if self.action == "append":
            return [part for v in value or [] for part in (self.flag, str(v))]
        return [] if value is None else [self.flag, str(value)]


SIDECAR_OPTIONS: tuple[Option, ...] = (
    Option("--chain", "chain", "the agent's chain file (root link first)", metavar="F", required=True),
    Option("--key", "key", "the private key of the chain's leaf", metavar="F", required=True),
    Option("--listen", "listen", "where the proxy listens", default="127.0.0.1:8080", metavar="H:P"),
    Option("--catalog", "catalog", "the catalog (default: fetched from the control plane)", metavar="F"),
    Option("--state-dir", "state_dir", "spool, captures and CA key, created 0700 (default: "
           "$XDG_STATE_HOME/tether/AGENT, else ~/.local/state/tether/AGENT)", metavar="DIR"),
    Option("--upstream-ca", "upstream_ca", "trust this CA bundle for upstream TLS (besides the system's)",
           metavar="F"),
    Option("--redact-field", "redact_field", "a JSON field, form field or query parameter to redact in captures "
           "and approvals, besides the names that say secret (repeat)", action="append", metavar="NAME"),
    Option("--no-default-redact-fields", "no_default_redact_fields", "do not redact the field names that say "
           "secret (password, token, api_key ...: see the README) unless --redact-field names them",
           action="store_true", default=False),
    Option("--approval-timeout", "approval_timeout", "seconds a held call waits for a decision", type=float,
           default=120.0, metavar="S"),
    Option("--allow-uncaptured", "allow_uncaptured", "forward calls whose capture fails", action="store_true",
           default=False),
    Option("--capture-file", "capture_file", "where captured flows go (default STATE_DIR/captures/flows.mitm)",
           metavar="F"),
    Option("--no-capture", "no_capture", "do not capture traffic (enforcement, tracking and reports only)",
           action="store_true", default=False),
    Option("--call-timeout", "call_timeout", "abort a forwarded call after this many seconds", type=float,
           default=300.0, metavar="S"),
    Option("--stop-window", "stop_window", "on SIGTERM, let calls that left finish this long before cutting them",
           type=float, default=10.0, metavar="S"),
    Option("--trust", "trust", "pin the control plane's public key instead of fetching it", metavar="F.pub"),
    Option("--ready-file", "ready_file", "write the proxy address here (JSON) once serving", metavar="F"),
    Option("--secret", "secret", "a catalog credential's secret (OAuth2: the client secret); only the sidecar "
           "reads it (repeat)", action="append", metavar="NAME=env:VAR|NAME=file:PATH"),
    Option("--transparent-listen", "transparent_listen",
           "also intercept transparently here (the egress lock's or --isolate's redirect target)", metavar="H:P"),
    Option("--stdio-route", "stdio_route", "reach the stdio MCP server NAME (catalog url stdio://NAME) at its "
           "bridge's loopback address (set by tether mcp stdio; repeat)", action="append", metavar="NAME=H:P"),
    Option("--dns-listen", "dns_listen", "answer DNS here: every name resolves to the transparent listener's "
           "address (used by tether run --isolate)", metavar="H:P"),
    # Capture retention (docs/captures.md); sizes in powers of 1024, durations as 7d/12h/30m/S.
    Option("--capture-max-bytes", "capture_max_bytes", "this agent's captures stay under this size on disk; the "
           "oldest segments go first, never one a termination holds", default="1G", metavar="SIZE"),
    Option("--capture-keep", "capture_keep", "delete captured flows older than this (unless a termination holds "
           "them)", default="7d", metavar="DURATION"),
    Option("--capture-node-max-bytes", "capture_node_max_bytes", "every agent's captures under the state root (the "
           "state dir's parent) stay under this size", default="8G", metavar="SIZE"),
    Option("--capture-min-free", "capture_min_free", "keep this much free on the capture's file system (pruning "
           "harder below it; warning below twice it)", default="2G", metavar="SIZE"),
    Option("--capture-segment-bytes", "capture_segment_bytes", "seal (and compress) the active capture segment at "
           "this size", default="64M", metavar="SIZE"),
    Option("--capture-segment-age", "capture_segment_age", "... or at this age", default="1h", metavar="DURATION"),
    Option("--capture-hold", "capture_hold", "how long a termination's hold keeps the flows its record names, "
           "unless exported first (tether capture export --termination)", default="30d", metavar="DURATION"),
    Option("--no-capture-compress", "no_capture_compress", "keep sealed capture segments uncompressed",
           action="store_true", default=False),
)


def add_sidecar(sub: Any) -> None:
    p = sub.add_parser("sidecar", help="run one agent's sidecar proxy (until SIGTERM or Ctrl-C)")
    add_controlplane(p)
    for option in SIDECAR_OPTIONS:
        option.add_to(p)
    p.add_argument("--enclosure-fds", dest="enclosure_fds", metavar="L,D", type=_fds,
                   help="serve the listener and resolver sockets (inherited descriptors) of tether run's enclosure")
    p.set_defaults(func=cmd_sidecar)


def _fds(text: str) -> tuple[int, int]:
    try:
        listener, resolver = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--enclosure-fds takes two descriptors, L,D (not {text!r})") from None
    return listener, resolver


def cmd_sidecar(args: argparse.Namespace) -> int:
    setup_logging()
    config = config_from_args(args)
    return asyncio.run(serve_sidecar(config, args.ready_file))


def config_from_args(args: argparse.Namespace) -> SidecarConfig:
    """Every option of the table, read once: what ``tether sidecar`` did not get is the table's default."""
    from tether.capability import keys
    from tether.capability.chain import parse_chain_unverified
    from tether.capability.shared import load_catalog, parse_listen, read_chain, read_file
    from tether.proxy.credentials import load_secrets
    from tether.proxy.sidecar import SidecarConfig
    from tether.proxy.stdio import parse_routes

    wire = read_chain(args.chain)
    agent = parse_chain_unverified(wire)[-1].sub
    host, port = parse_listen(args.listen, 8080)
    state_dir = Path(args.state_dir) if args.state_dir else default_state_root() / agent
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return SidecarConfig(
        controlplane=args.controlplane or DEFAULT_CONTROLPLANE,
        chain=wire,
        key=keys.load_private(read_file(args.key, "key"), args.key),
        state_dir=state_dir,
        listen_host=host,
        listen_port=port,
        catalog=load_catalog(args.catalog) if args.catalog else None,
        upstream_ca=args.upstream_ca,
        redact_fields=list(args.redact_field or []),
        redact_default_fields=not args.no_default_redact_fields,
        approval_timeout_s=args.approval_timeout,
        allow_uncaptured=args.allow_uncaptured,
        capture_path=Path(args.capture_file) if args.capture_file else None,
        call_timeout_s=args.call_timeout,
        stop_window_s=args.stop_window,
        capture=not args.no_capture,
        secrets=load_secrets(args.secret or []),
        transparent_listen=parse_listen(args.transparent_listen, 15001) if args.transparent_listen else None,
        dns_listen=parse_listen(args.dns_listen, 53) if args.dns_listen else None,
        enclosure_fds=getattr(args, "enclosure_fds", None),
        stdio_routes=parse_routes(args.stdio_route or []),
        trust=keys.load_public(read_file(args.trust, "trust key"), args.trust) if args.trust else None,
        # One start-up attempt gives up at its first unreachable answer: keep_trying says so at once (not after a
        # first attempt's own retries) and starts the next, with a status line every STATUS_EVERY_S (never gives up).
        startup_timeout_s=0.0,
        capture_policy=capture_policy(args),
    )


def capture_policy(args: argparse.Namespace) -> CapturePolicy:
    """The retention options, read into the policy (bad input: ``tether.bad_request`` naming the value)."""
    from tether.capture.retention import Policy, parse_duration, parse_size

    return Policy(segment_bytes=parse_size(args.capture_segment_bytes),
                  segment_age_s=parse_duration(args.capture_segment_age),
                  max_bytes=parse_size(args.capture_max_bytes), keep_s=parse_duration(args.capture_keep),
                  node_max_bytes=parse_size(args.capture_node_max_bytes),
                  min_free_bytes=parse_size(args.capture_min_free), hold_s=parse_duration(args.capture_hold),
                  compress=not args.no_capture_compress)


def setup_logging(stream: Any = None) -> None:
    """The sidecar's log lines to ``stream`` (standard error unless told: ``tether run`` gives its log file)."""
    import logging

    logging.basicConfig(level=os.environ.get("TETHER_LOG", "INFO").upper(), stream=stream or sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("mitmproxy").setLevel(logging.WARNING)
    logging.getLogger("tether.sidecar").addFilter(said_by_status)


def said_by_status(record: logging.LogRecord) -> bool:
    """Drop the sidecar's own log line for an unreachable control plane at start-up: ``keep_trying`` says it
    (``tether: waiting for the control plane at URL ...``), with the URL, how long and what to do, and a log
    line in another format before it only said the same thing less well."""
    return not str(record.msg).startswith("waiting for the control plane")


def status(text: str) -> None:
    print(f"tether: {text}", file=sys.stderr, flush=True)


async def keep_trying(step: Callable[[], Awaitable[None]], url: str, say: Callable[[str], None] = status) -> None:
    """A start-up step, retried for as long as the control plane cannot be reached (down, or too slow to
    answer), with a status line every few seconds; any other error is bad input, the caller's to report."""
    from tether.capability.errors import CONTROLPLANE_UNREACHABLE, ApiError
    from tether.proxy.channel import sleep_backoff

    started = said = time.monotonic()
    attempt = 0
    while True:
        try:
            await step()
            return
        except ApiError as exc:
            if exc.code != CONTROLPLANE_UNREACHABLE:
                raise
            attempt += 1
            if attempt == 1 or time.monotonic() - said >= STATUS_EVERY_S:
                said = time.monotonic()
                say(f"waiting for the control plane at {url}: unreachable for {said - started:.0f}s "
                       f"({exc.message}), still trying (Ctrl-C to give up)")
            await sleep_backoff(attempt)


async def serve_sidecar(config: SidecarConfig, ready_file: str | None, *,
                        serve: Callable[[dict[str, Any]], Awaitable[int]] | None = None,
                        say: Callable[[str], None] = status) -> int:
    """Serve until SIGTERM (exit 0) or SIGINT (exit 130); ``RETIRED`` when the chain may no longer serve.

    With ``serve`` (``tether run``: the sidecar supervises the command in its own process), serve while it runs,
    given what the ready file says, and stop once it returns: its result is the exit status. ``say`` takes the
    status lines (the ``tether:`` lines on standard error unless told)."""
    import gc

    from tether.proxy.sidecar import Sidecar

    check_listen(config.listen_host, config.listen_port)  # before registering a run that could never serve
    sidecar = Sidecar(config)
    try:
        await keep_trying(sidecar.prepare, config.controlplane, say)
        retired = await sidecar.retire() if sidecar.retired else None
    except BaseException:
        await sidecar.close_sessions()
        raise
    if retired is not None:
        await sidecar.close_sessions()  # before the one line: nothing may follow it on stderr
        say(retired)
        return RETIRED
    try:
        host, port = await sidecar.start_proxy()
        await keep_trying(sidecar.begin, config.controlplane, say)
    except BaseException:
        await sidecar.stop()  # registered and leased: say goodbye, so no run is left looking alive
        raise
    # Everything loaded so far (mitmproxy, tether, the chain, the catalog) lives as long as the process:
    # moved out of the collector's reach, a full collection no longer walks it (50 ms pauses -> 4 ms here).
    gc.freeze()
    await _ca_written(sidecar.ca_cert)
    info = {"agent": sidecar.agent, "proxy": f"http://{host}:{port}", "ca": str(sidecar.ca_cert), "pid": os.getpid(),
            "state_dir": str(config.state_dir)}
    say(f"sidecar for {sidecar.agent} on http://{host}:{port} (CA {sidecar.ca_cert})")
    if ready_file:
        tmp = f"{ready_file}.tmp"
        Path(tmp).write_text(json.dumps(info))
        os.replace(tmp, ready_file)
    if serve is None:
        stopped_by = await wait_for_signal()
        code = 130 if stopped_by == signal.SIGINT else 0
    else:
        try:
            code = await serve(info)
        except BaseException:
            await sidecar.stop()
            raise
    await sidecar.stop()
    return code


async def _ca_written(ca: Path, timeout_s: float = 10.0) -> None:
    """Ready means a client can trust us: the CA certificate is on disk before the ready file says where it is."""
    deadline = time.monotonic() + timeout_s
    while not ca.exists():
        if time.monotonic() > deadline:
            raise TetherError(f"the sidecar's CA certificate {ca} was not written within {timeout_s:.0f}s",
                              code="tether.sidecar_failed")
        await asyncio.sleep(0.02)


def check_listen(host: str, port: int) -> None:
    """Fail now, and plainly, when the proxy's address is taken (mitmproxy would say so after start-up, suggesting
    its own flags). A port freed or taken in between is still caught when the proxy starts."""
    import socket

    from .process import listen_error

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the proxy binds: TIME_WAIT is no conflict
            probe.bind(infos[0][4])
    except OSError as exc:
        raise listen_error(f"the sidecar cannot listen on {host}:{port}", exc) from None
