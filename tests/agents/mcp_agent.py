"""An unmodified MCP agent: the official SDK client, configured by nothing but the environment.

It knows nothing about tether. HTTP goes wherever ``HTTP_PROXY``/``HTTPS_PROXY`` send it (the SDK's
httpx2 client honours them). Two ways to drive it:

  mcp_agent.py URL --mode auto|legacy --steps '[{"op": "list"}, {"op": "call", "name": "add", "args": {...}}]'
      runs the steps in one session and prints one JSON document: {"protocol": ..., "results": [...]}
  mcp_agent.py URL --mode auto|legacy
      reads one JSON step per stdin line and answers each with one JSON line on stdout (a live session
      the test can pause between calls: approve, revoke, send raw traffic, then go on).

Each result is {"ok": true, "tools": [...]} for list, {"ok": true, "text": ..., "is_error": ...} for a
call, or {"ok": false, "error": {"type", "code", "message", "data"}} when the SDK raised.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from mcp import Client, MCPError


async def step(client: Client, doc: dict[str, Any]) -> dict[str, Any]:
    try:
        if doc["op"] == "list":
            tools = (await client.list_tools(cache_mode="bypass")).tools
            return {"ok": True, "tools": sorted(t.name for t in tools)}
        if doc["op"] == "call":
            result = await client.call_tool(doc["name"], doc.get("args") or {})
            text = "".join(getattr(c, "text", "") for c in result.content)
            return {"ok": True, "text": text, "is_error": bool(result.is_error),
                    "structured": result.structured_content}
        if doc["op"] == "ping":
            await client.send_ping()
            return {"ok": True}
        return {"ok": False, "error": {"type": "usage", "message": f"unknown op {doc['op']!r}"}}
    except MCPError as exc:
        return {"ok": False, "error": {"type": "MCPError", "code": exc.code, "message": exc.message,
                                       "data": exc.data}}


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--mode", default="auto", choices=["auto", "legacy"])
    parser.add_argument("--steps", default=None, help="a JSON list of steps; without it, steps come on stdin")
    args = parser.parse_args()
    async with Client(args.url, mode=args.mode) as client:
        if args.steps is not None:
            results = [await step(client, doc) for doc in json.loads(args.steps)]
            print(json.dumps({"protocol": client.protocol_version, "results": results}), flush=True)
            return 0
        print(json.dumps({"ready": True, "protocol": client.protocol_version}), flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line or not line.strip():
                return 0
            doc = json.loads(line)
            if doc.get("op") == "quit":
                return 0
            print(json.dumps(await step(client, doc)), flush=True)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
