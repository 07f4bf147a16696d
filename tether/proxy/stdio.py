"""Where a stdio MCP server's reserved name leads: the sidecar half of ``tether mcp stdio``.

A stdio server has no address. Its bridge (tether/cli/mcp_stdio.py) serves the server's stdio as a streamable-HTTP
endpoint on a loopback port of its own and sends every message as a request for ``http://NAME.stdio.tether/mcp``
through this sidecar, so each one meets the same decision, filtering, approval, capture and reports as any MCP
call. Only the connection's address changes, once everything about the request was decided: ``server_connect``
points a connection for ``NAME.stdio.tether`` at the port the bridge named with ``--stdio-route NAME=H:P``. A name
under ``.stdio.tether`` with no route is never looked up in DNS: the connection fails before it opens.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from tether.capability.catalog import STDIO_DOMAIN, Catalog, stdio_name_ok, stdio_server_name
from tether.capability.errors import BAD_REQUEST, TetherError

log = logging.getLogger("tether.sidecar")


def parse_routes(texts: Iterable[str]) -> dict[str, tuple[str, int]]:
    """``NAME=HOST:PORT`` (repeatable) -> {NAME: (HOST, PORT)}; HOST a loopback address: a route leads only to
    a bridge on this machine, never anywhere the catalog did not name."""
    routes: dict[str, tuple[str, int]] = {}
    for text in texts:
        name, eq, address = text.partition("=")
        host, colon, port = address.rpartition(":")
        host = host.strip("[]")
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not (eq and colon and stdio_name_ok(name) and port.isdigit() and 0 < int(port) < 65536 and loopback):
            raise TetherError(f"--stdio-route takes NAME=HOST:PORT, NAME one lower-case DNS label and HOST a "
                              f"loopback address (not {text!r})", code=BAD_REQUEST)
        if name in routes:
            raise TetherError(f"--stdio-route names {name} twice", code=BAD_REQUEST)
        routes[name] = (host, int(port))
    return routes


def serves_stdio(catalog: Catalog) -> bool:
    """True when the catalog names a stdio server (``stdio://NAME``, or its reserved URL)."""
    return any(cap.mcp is not None and stdio_server_name(urlsplit(cap.mcp.server).hostname or "") is not None
               for cap in catalog.capabilities.values())


class StdioRoutes:
    """mitmproxy's ``server_connect``: a connection for ``NAME.stdio.tether`` goes to NAME's bridge."""

    def __init__(self, routes: Mapping[str, tuple[str, int]]) -> None:
        self.routes = dict(routes)

    def server_connect(self, data: Any) -> None:
        server = data.server
        if server.address is None:
            return
        host = str(server.address[0])
        if not host.lower().rstrip(".").endswith("." + STDIO_DOMAIN):
            return
        name = stdio_server_name(host)
        route = self.routes.get(name or "")
        if route is None:
            server.error = f"no stdio server named {host!r} is served by this sidecar (no --stdio-route for it)"
            log.warning("refusing a connection to %s: %s", host, server.error)
            return
        server.address = route
