"""The demo's agent: an ordinary script that knows nothing of tether's proxy.

It calls its tools with urllib and the MCP SDK (under ``tether run`` its only way out is its sidecar), and it
spawns its sub-agents the way an agent framework would: each under ``tether run`` with a narrower
grant delegated from its own chain (``TETHER_CHAIN``, set by ``tether run``; enforced, the enclosing ``tether
run`` delegates for it, cooperative it gives ``TETHER_KEY`` too).

``python -m tether.cli.demo.agent ROLE`` with ROLE in root, researcher, writer, summarizer.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

TICKETS = os.environ.get("DEMO_TICKETS", "http://127.0.0.1:7101")
MCP_URL = os.environ.get("DEMO_MCP", "http://127.0.0.1:7102/mcp")
STOP_CODES = ("tether.chain_revoked", "tether.draining", "tether.terminated", "tether.chain_expired")
ROLE = sys.argv[1] if len(sys.argv) > 1 else "root"


def say(text: str) -> None:
    print(f"[{ROLE}] {text}", flush=True)


def call(method: str, path: str, body: Any = None) -> tuple[int, str | None, Any]:
    """One HTTP call; returns (status, Tether-Error code or None, parsed body)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(TICKETS + path, data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer demo-tool-secret"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, None, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        payload = exc.read()
        try:
            parsed = json.loads(payload)
        except ValueError:
            parsed = payload.decode(errors="replace")
        return exc.code, exc.headers.get("Tether-Error"), parsed


def spawn(agent: str, caps: list[str], role: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "tether", "run", "--parent-chain", os.environ["TETHER_CHAIN"], "--agent", agent]
    if "TETHER_KEY" in os.environ:  # cooperative: this agent holds its key; enforced, its tether run delegates
        args += ["--parent-key", os.environ["TETHER_KEY"], "--state-dir", os.environ.get("TETHER_STATE_DIR", ".tether")]
    for cap in caps:
        args += ["--cap", cap]
    say(f"spawning {agent} with {', '.join(caps)}")
    return subprocess.Popen([*args, "--", sys.executable, "-m", "tether.cli.demo.agent", role])


def work_until_stopped(path: str, pause: float = 0.2) -> None:
    """Keep calling a tool until tether says this agent may not any more."""
    while True:
        try:
            status, code, body = call("GET", path)
        except (OSError, urllib.error.URLError) as exc:
            say(f"a call was cut off mid-flight ({exc.__class__.__name__}); trying again")
            time.sleep(pause)
            continue
        if code in STOP_CODES:
            say(f"refused with {code}: stopping")
            return
        if code:
            say(f"refused with {code}")
        else:
            say(f"{path} -> {status} {json.dumps(body)[:60]}")
        time.sleep(pause)


async def mcp_session() -> None:
    from mcp import Client

    async with Client(MCP_URL) as client:
        tools = [t.name for t in (await client.list_tools()).tools]
        say(f"MCP server offers me these tools: {', '.join(tools)}")
        result = await client.call_tool("lookup", {"term": "key rotation"})
        say(f"MCP lookup -> {result.content[0].text}")  # type: ignore[union-attr]


def root() -> None:
    status, code, body = call("GET", "/tickets")
    say(f"GET /tickets -> {status}, {len(body)} tickets")
    status, code, body = call("DELETE", "/tickets/1")
    say(f"DELETE /tickets/1 -> {status} {code} (not granted: it does not exist for me)")
    asyncio.run(mcp_session())
    say("POST /tickets needs a person's approval; waiting")
    status, code, body = call("POST", "/tickets", {"title": "summarize incident 4711"})
    say(f"POST /tickets -> {status} {code or json.dumps(body)}")
    children = [spawn("researcher", ["research.read=direct", "tickets.read=direct"], "researcher"),
                spawn("writer", ["tickets.read=direct"], "writer")]
    work_until_stopped("/research?s=0.5&q=root", pause=0.5)
    for child in children:
        child.wait()


def researcher() -> None:
    child = spawn("summarizer", ["research.read=direct"], "summarizer")
    work_until_stopped("/research?s=1.5&q=auth-logs")
    child.wait()


def main() -> None:
    role = {"root": root, "researcher": researcher,
            "writer": lambda: work_until_stopped("/tickets", pause=0.4),
            "summarizer": lambda: work_until_stopped("/research?s=8&q=long-summary")}[ROLE]
    role()
    say("exiting")


if __name__ == "__main__":
    main()
