"""``tether sidecar``: run one agent's sidecar until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
from pathlib import Path

from capability import keys
from capability.chain import parse_chain_unverified
from capability.shared import load_catalog, parse_listen, read_chain, read_file

from .credentials import load_secrets
from .sidecar import Sidecar, SidecarConfig


def config_from_args(args: argparse.Namespace) -> SidecarConfig:
    wire = read_chain(args.chain)
    agent = parse_chain_unverified(wire)[-1].sub
    host, port = parse_listen(args.listen, 8080)
    return SidecarConfig(
        controlplane=args.controlplane or os.environ.get("TETHER_CONTROLPLANE") or "http://127.0.0.1:7000",
        chain=wire,
        key=keys.load_private(read_file(args.key, "key"), args.key),
        state_dir=Path(args.state_dir or Path(".tether") / agent),
        listen_host=host,
        listen_port=port,
        catalog=load_catalog(args.catalog) if getattr(args, "catalog", None) else None,
        upstream_ca=args.upstream_ca,
        redact_fields=list(getattr(args, "redact_field", []) or []),
        approval_timeout_s=args.approval_timeout,
        allow_uncaptured=bool(getattr(args, "allow_uncaptured", False)),
        capture_path=Path(args.capture_file) if getattr(args, "capture_file", None) else None,
        call_timeout_s=float(getattr(args, "call_timeout", 300.0)),
        capture=not getattr(args, "no_capture", False),
        secrets=load_secrets(getattr(args, "secret", None) or []),
        transparent_listen=parse_listen(args.transparent_listen, 15001) if getattr(args, "transparent_listen", None)
        else None,
        dns_listen=parse_listen(args.dns_listen, 53) if getattr(args, "dns_listen", None) else None,
        trust=keys.load_public(read_file(args.trust, "trust key"), args.trust) if getattr(args, "trust", None)
        else None,
    )


def setup_logging() -> None:
    logging.basicConfig(level=os.environ.get("TETHER_LOG", "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("mitmproxy").setLevel(logging.WARNING)


RETIRED = 3  # the exit status of a sidecar whose chain was revoked or expired before it could serve


async def serve_sidecar(config: SidecarConfig, ready_file: str | None) -> int:
    sidecar = Sidecar(config)
    try:
        await sidecar.prepare()
        if sidecar.retired:
            print(f"tether: {await sidecar.retire()}", file=sys.stderr, flush=True)
            return RETIRED
    except BaseException:
        await sidecar.channel.close()
        raise
    host, port = await sidecar.start_proxy()
    # Everything loaded so far (mitmproxy, tether, the chain, the catalog) lives as long as the process:
    # moved out of the collector's reach, a full collection no longer walks it (50 ms pauses -> 4 ms here).
    gc.freeze()
    info = {"agent": sidecar.agent, "proxy": f"http://{host}:{port}", "ca": str(sidecar.ca_cert), "pid": os.getpid(),
            "state_dir": str(config.state_dir)}
    print(f"tether: sidecar for {sidecar.agent} on http://{host}:{port} (CA {sidecar.ca_cert})", file=sys.stderr,
          flush=True)
    if ready_file:
        tmp = f"{ready_file}.tmp"
        Path(tmp).write_text(json.dumps(info))
        os.replace(tmp, ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await sidecar.stop()
    return 0


def cmd_sidecar(args: argparse.Namespace) -> int:
    setup_logging()
    return asyncio.run(serve_sidecar(config_from_args(args), args.ready_file))
