"""The example tool servers (``tether example tools``, and ``tether demo``'s): a ticket API over HTTP (aiohttp)
and an MCP server (the official SDK), both on loopback, in one process.

Each prints one line per request it serves, so a reader sees that a refused call never reached it.
The MCP server offers ``lookup``, ``send_email`` and ``drop_database``; the quickstart's and the demo's
catalogs grant the first, hold the second for approval and leave the third absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import sys
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from tether.capability.errors import BAD_REQUEST, LISTEN_FAILED, TetherError

from ..process import listen_error, wait_for_signal


def say(text: str) -> None:
    print(text, flush=True)


def ticket_app() -> web.Application:
    tickets = [{"id": 1, "title": "rotate the staging keys"}, {"id": 2, "title": "flaky login test"}]

    @web.middleware
    async def log_requests(request: web.Request, handler: Any) -> web.StreamResponse:
        response = await handler(request)
        say(f"ticket API: {request.method} {request.path_qs} -> {response.status}")
        return response

    async def list_tickets(request: web.Request) -> web.Response:
        return web.json_response(tickets)

    async def get_ticket(request: web.Request) -> web.Response:
        found = [t for t in tickets if str(t["id"]) == request.match_info["id"]]
        return web.json_response(found[0]) if found else web.json_response({"error": "no such ticket"}, status=404)

    async def create_ticket(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = {}
        title = body.get("title", "") if isinstance(body, dict) else ""
        ticket = {"id": len(tickets) + 1, "title": str(title)[:200]}
        tickets.append(ticket)
        return web.json_response(ticket, status=201)

    async def delete_ticket(request: web.Request) -> web.Response:
        return web.json_response({"deleted": request.match_info["id"]})

    async def research(request: web.Request) -> web.Response:
        try:
            seconds = min(max(float(request.query.get("s", "1")), 0.0), 30.0)
        except ValueError:
            seconds = 1.0
        await asyncio.sleep(seconds)
        return web.json_response({"finding": f"looked for {seconds:g}s", "topic": request.query.get("q", "")})

    app = web.Application(middlewares=[log_requests])
    app.router.add_get("/tickets", list_tickets)
    app.router.add_get("/tickets/{id}", get_ticket)
    app.router.add_post("/tickets", create_ticket)
    app.router.add_delete("/tickets/{id}", delete_ticket)
    app.router.add_get("/research", research)
    return app


def mcp_app() -> Any:
    """The MCP server's ASGI app (streamable HTTP at ``/mcp``)."""
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("example-kb")
    logging.getLogger("mcp").setLevel(logging.WARNING)  # the SDK logs every session at INFO; our lines say enough

    @server.tool()
    def lookup(term: str) -> str:
        """Look a term up in the knowledge base."""
        say(f"MCP server: lookup {term!r}")
        return f"{term}: see runbook section 4"

    @server.tool()
    def send_email(to: str, body: str) -> str:
        """Send an email."""
        say(f"MCP server: send_email to {to!r}")
        return f"sent to {to}"

    @server.tool()
    def drop_database(name: str) -> str:
        """Drop a database. No agent is granted this: it must never appear to one."""
        say(f"MCP server: drop_database {name!r}")
        return f"dropped {name}"

    return server.streamable_http_app()


def parse_address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise TetherError(f"expected HOST:PORT, got {value!r}", code=BAD_REQUEST)
    return host or "127.0.0.1", int(port)


def bind(what: str, address: tuple[str, int], flag: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise TetherError(f"{what} on {address[0]}:{address[1]}: the address is in use (another process listens "
                              f"there; choose another with {flag})", code=LISTEN_FAILED) from None
        raise listen_error(f"{what} on {address[0]}:{address[1]}", exc) from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


class _McpServer:
    """uvicorn, without its own signal handling: this process stops both servers on one SIGTERM or Ctrl-C."""

    def __init__(self, sock: socket.socket) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:  # ours: see wait_for_signal below
                yield

        self.sock = sock
        self.server = Server(uvicorn.Config(mcp_app(), log_level="warning", lifespan="on"))

    async def serve(self) -> None:
        await self.server.serve(sockets=[self.sock])

    def stop(self) -> None:
        self.server.should_exit = True


async def serve(http: tuple[str, int] | None, mcp: tuple[str, int] | None) -> int:
    sockets = {}
    try:
        if http:
            sockets["http"] = bind("the ticket API", http, "--http")
        if mcp:
            sockets["mcp"] = bind("the MCP server", mcp, "--mcp")
    except TetherError:
        for sock in sockets.values():
            sock.close()
        raise
    runner = None
    mcp_server = None
    mcp_task = None
    try:
        if "http" in sockets:
            runner = web.AppRunner(ticket_app(), access_log=None)
            await runner.setup()
            await web.SockSite(runner, sockets["http"]).start()
            say(f"ticket API  http://{http[0]}:{http[1]}/tickets   (GET, POST /tickets; GET, DELETE /tickets/ID)")
        if "mcp" in sockets:
            mcp_server = _McpServer(sockets["mcp"])
            mcp_task = asyncio.create_task(mcp_server.serve())
            while not mcp_server.server.started:
                if mcp_task.done():
                    await mcp_task
                    raise TetherError("the MCP server stopped as it started", code=LISTEN_FAILED)
                await asyncio.sleep(0.02)
            say(f"MCP server  http://{mcp[0]}:{mcp[1]}/mcp   (tools: lookup, send_email, drop_database)")
        say("serving; Ctrl-C or SIGTERM stops")
        await wait_for_signal()
        return 0
    finally:
        if mcp_server is not None and mcp_task is not None:
            mcp_server.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(mcp_task, 5)
        if runner is not None:
            await runner.cleanup()
        for sock in sockets.values():
            sock.close()


def run(http: str | None, mcp: str | None) -> int:
    return asyncio.run(serve(parse_address(http) if http else None, parse_address(mcp) if mcp else None))


def main() -> None:
    """``python -m tether.cli.demo.tools HTTP_ADDRESS MCP_ADDRESS`` (kept for scripts; prefer ``tether example
    tools``)."""
    sys.exit(run(sys.argv[1], sys.argv[2]))


if __name__ == "__main__":
    main()
