"""Each capability kind's decider for the sidecar (``tether/proxy/decision.py`` asks them in ``DECIDERS``'s order):
what a request to that kind's capabilities is answered. ``mcp`` comes first: a request to an MCP endpoint is the
endpoint's, whatever http capability its request line also falls under."""

from __future__ import annotations

from ..decision import Decider
from . import http, mcp

SHIPPED: tuple[tuple[str, Decider], ...] = ((mcp.NAME, mcp.decide), (http.NAME, http.decide))

__all__ = ["SHIPPED"]
