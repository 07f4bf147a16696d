"""Cutting a call off inside mitmproxy, and telling an MCP server its call was cancelled.

mitmproxy's ``flow.kill()`` only acts at the flow's next hook, and a forwarded call may have none coming for a long
time (a slow tool): the cut also cancels the agent connection's handler, which ends both sides now. Where the MCP
session has an id, the server is told explicitly too (``notifications/cancelled``), over a session of this module's
own, as closing the stream is cancellation to MCP but not every server watches for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import ssl
from collections.abc import Callable, Coroutine
from typing import Any

from mitmproxy import http

from . import http1
from .flowstate import state_of

log = logging.getLogger("tether.sidecar")

Spawn = Callable[[Coroutine[Any, Any, None]], None]  # runs a coroutine as a task the sidecar keeps


class Cutter:
    def __init__(self, proxyserver: Callable[[], Any], upstream_ca: str | None, spawn: Spawn) -> None:
        self.proxyserver, self.upstream_ca, self.spawn = proxyserver, upstream_ca, spawn

    def abort(self, flow: http.HTTPFlow) -> None:
        """Cut a forwarded call off now (mitmproxy's kill only acts at the next hook)."""
        state_of(flow).aborted = "tether.aborted"
        self._notify_mcp_cancel(flow)
        if flow.killable:
            flow.kill()
        server = self.proxyserver()
        handler = server.connections.get(flow.client_conn.id) if server is not None else None
        if handler is not None:
            with contextlib.suppress(Exception):
                handler.transports[handler.client].handler.cancel("tether: aborted by the control plane")

    def close_connections(self) -> int:
        """Close every agent connection still open once the proxy stopped listening: a request on one would be
        refused after the last report was delivered, and so be missing from the record. Returns how many."""
        server = self.proxyserver()
        handlers = list(getattr(server, "connections", {}).values())
        for handler in handlers:
            with contextlib.suppress(Exception):
                handler.transports[handler.client].handler.cancel("tether: the sidecar stopped")
        return len(handlers)

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
        self.spawn(self._send_cancelled(flow.request.url.split("?", 1)[0], headers, ids))

    async def _send_cancelled(self, url: str, headers: dict[str, str], ids: list[Any]) -> None:
        context = ssl.create_default_context(cafile=self.upstream_ca) if self.upstream_ca else None
        client = http1.Client(ssl_context=context, max_body=1024 * 1024)
        try:
            for request_id in ids:
                body = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                        "params": {"requestId": request_id, "reason": "tether: terminated"}}
                await client.request("POST", url, body=json.dumps(body).encode(), headers=headers, timeout=3.0)
        except (TimeoutError, OSError) as exc:  # http1.ClientError is an OSError
            log.info("could not send notifications/cancelled to %s: %s", url, exc or type(exc).__name__)
        finally:
            await client.close()
