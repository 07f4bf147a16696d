"""``tether witness serve``: a small C2SP tlog-witness a second team runs, so the record log's checkpoints
are cosigned by someone who does not hold the control plane's key or disk."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import Any

from .process import listen_error, wait_for_signal


def add_witness(sub: Any) -> None:
    w = sub.add_parser("witness", help="run a witness that cosigns the record log's checkpoints").add_subparsers(
        dest="witness_command", required=True, metavar="ACTION")
    p = w.add_parser("serve", help="serve POST /add-checkpoint (C2SP tlog-witness)")
    p.add_argument("--name", required=True,
                   help="the witness's name, in its cosignature lines (e.g. witness.example.org)")
    p.add_argument("--key", required=True, metavar="F",
                   help="the witness's Ed25519 private key (tether keygen --out F)")
    p.add_argument("--log", action="append", required=True, metavar="VKEY",
                   help="a log it witnesses, as its verifier key NAME+KEYID+BASE64 (`tether records checkpoint --vkey` "
                        "prints a control plane's); repeat")
    p.add_argument("--state", default="witness-state", metavar="DIR", help="where it keeps the last checkpoint per log")
    p.add_argument("--listen", default="127.0.0.1:7300", metavar="H:P", help="its address")
    p.set_defaults(func=cmd_witness_serve)


def cmd_witness_serve(args: argparse.Namespace) -> int:
    from tether.capability import keys
    from tether.capability.errors import BAD_REQUEST, TetherError
    from tether.capability.shared import parse_listen, read_file
    from tether.controlplane.notes import COSIGNATURE_V1, ED25519, NoteError, Verifier, parse_vkey
    from tether.controlplane.witness import WitnessServer, WitnessState

    key = keys.load_private(read_file(args.key, "witness key"), args.key)
    logs: dict[str, Verifier] = {}
    for text in args.log:
        try:
            log = parse_vkey(text)
        except NoteError as exc:
            raise TetherError(f"--log {text}: {exc}", code=BAD_REQUEST) from None
        if log.kind != ED25519:
            raise TetherError(f"--log {text}: a log's key signs notes (type 0x01)", code=BAD_REQUEST)
        logs[log.name] = log
    host, port = parse_listen(args.listen, 7300)
    server = WitnessServer(args.name, key, logs, WitnessState(Path(args.state)), time.time)
    vkey = Verifier(args.name, key.public_key(), COSIGNATURE_V1).vkey()
    print(f"tether: witness {args.name}, cosignature key {vkey}", file=sys.stderr)
    return 130 if asyncio.run(_serve(server, host, port)) == signal.SIGINT else 0


async def _serve(server: Any, host: str, port: int) -> int:
    from aiohttp import web

    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        raise listen_error(f"the witness cannot listen on {host}:{port}", exc) from None
    print(f"tether: witness listening on http://{host}:{port} for {', '.join(sorted(server.logs))}", file=sys.stderr,
          flush=True)
    try:
        return await wait_for_signal()
    finally:
        await runner.cleanup()
