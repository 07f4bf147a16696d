"""``tether example tools``: the tool servers the quickstart (docs/quickstart.md) governs, on loopback.

A ticket API over HTTP and an MCP server in one process, nothing outside this machine. The servers live in
``demo/tools.py`` (``tether demo`` runs the same ones); this module only builds the parser, so ``tether --help``
loads neither aiohttp nor the MCP SDK.
"""

from __future__ import annotations

import argparse
from typing import Any

HTTP_DEFAULT = "127.0.0.1:7101"
MCP_DEFAULT = "127.0.0.1:7102"


def add_example(sub: Any) -> None:
    example = sub.add_parser("example", help="example tool servers to try tether on (docs/quickstart.md)")
    actions = example.add_subparsers(dest="example_command", required=True, metavar="ACTION")
    p = actions.add_parser("tools", help="serve an example ticket API (HTTP) and MCP server on loopback",
                           description="Serve a ticket API (GET/POST /tickets, GET/DELETE /tickets/ID, "
                           "GET /research?s=SECONDS) and an MCP server at /mcp (tools lookup, send_email, "
                           "drop_database), each printing a line per request it serves, until Ctrl-C or SIGTERM.")
    p.add_argument("--http", default=HTTP_DEFAULT, metavar="H:P", help="the ticket API's address")
    p.add_argument("--mcp", default=MCP_DEFAULT, metavar="H:P", help="the MCP server's address")
    p.set_defaults(func=cmd_tools)


def cmd_tools(args: argparse.Namespace) -> int:
    from .demo.tools import run

    return run(args.http, args.mcp)
