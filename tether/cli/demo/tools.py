"""The demo's tool servers: a ticket API over HTTP (aiohttp) and an MCP server (the official SDK).

Run as ``python -m tether.cli.demo.tools http PORT`` or ``... mcp PORT``. Both listen on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web


def ticket_app() -> web.Application:
    tickets = [{"id": 1, "title": "rotate the staging keys"}, {"id": 2, "title": "flaky login test"}]

    async def list_tickets(request: web.Request) -> web.Response:
        return web.json_response(tickets)

    async def create_ticket(request: web.Request) -> web.Response:
        body = await request.json()
        ticket = {"id": len(tickets) + 1, "title": str(body.get("title", ""))[:200]}
        tickets.append(ticket)
        return web.json_response(ticket, status=201)

    async def delete_ticket(request: web.Request) -> web.Response:
        return web.json_response({"deleted": request.match_info["id"]})

    async def research(request: web.Request) -> web.Response:
        seconds = min(float(request.query.get("s", "1")), 30.0)
        await asyncio.sleep(seconds)
        return web.json_response({"finding": f"looked for {seconds:g}s", "topic": request.query.get("q", "")})

    app = web.Application()
    app.router.add_get("/tickets", list_tickets)
    app.router.add_post("/tickets", create_ticket)
    app.router.add_delete("/tickets/{id}", delete_ticket)
    app.router.add_get("/research", research)
    return app


def serve_mcp(port: int) -> None:
    import uvicorn
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("demo-kb")

    @server.tool()
    def lookup(term: str) -> str:
        """Look a term up in the knowledge base."""
        return f"{term}: see runbook section 4"

    @server.tool()
    def send_email(to: str, body: str) -> str:
        """Send an email."""
        return f"sent to {to}"

    @server.tool()
    def drop_database(name: str) -> str:
        """Drop a database. No agent is granted this: it must never appear to one."""
        return f"dropped {name}"

    uvicorn.run(server.streamable_http_app(), host="127.0.0.1", port=port, log_level="warning")


def main() -> None:
    kind, port = sys.argv[1], int(sys.argv[2])
    if kind == "http":
        web.run_app(ticket_app(), host="127.0.0.1", port=port, print=None, access_log=None)
    elif kind == "mcp":
        serve_mcp(port)
    else:
        raise SystemExit(f"unknown tool server {kind}")


if __name__ == "__main__":
    main()
