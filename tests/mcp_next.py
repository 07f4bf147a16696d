"""The MCP server and world the tests of cancellation, sessions, tasks and multi-round-trip calls share.

``NextServer`` is the official SDK's ``MCPServer`` over streamable HTTP (SSE answers, the SDK default) with:
``add``, ``slow`` (sleeps), ``delete_everything`` (never granted), ``ask`` (samples the client's model offering
it the tools ``add`` and ``delete_everything``), ``confirm`` (a 2026-07-28 multi-round-trip tool: asks the client
to confirm with an ``input_required`` result, then acts), and the task methods (``tasks/get``, ``tasks/result``,
``tasks/cancel``, ``tasks/list``, and the 2026-07-28 ``tasks/update``) of a hand-written task store: the SDK 2.3
has the task types but no task runtime (and validates every ``tools/call`` result as a ``CallToolResult``), so a
2025-11-25 ``tools/call`` carrying ``params.task`` is answered with a task by a small ASGI layer in front of the
SDK app, a 2026-07-28 ``job`` call from a client that declares the tasks extension (SEP-2663) by an SDK
extension's ``intercept_tool_call`` (``resultType: "task"``), and the task methods are SDK extension methods.
The same ASGI layer answers JSON-RPC batches (which the SDK does not take) for task creation and ``tasks/get``.
``calls`` records every handler run.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import Context

from .harness import (
    ControlPlaneProcess,
    Identity,
    McpServer,
    SidecarProcess,
    free_port,
    prepare_controlplane,
    wait_until,
)
from .test_mcp import Wiretap, tap

MODERN = "2026-07-28"
LEGACY = "2025-11-25"
WAIT = 30.0
TOOLS = {"next.add": "add", "next.slow": "slow", "next.delete": "delete_everything", "next.ask": "ask",
         "next.confirm": "confirm", "next.job": "job"}
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


class NextServer(McpServer):
    def __init__(self) -> None:
        super().__init__()
        self.tasks: dict[str, dict[str, Any]] = {}

    def start(self) -> NextServer:
        import uvicorn
        from mcp.server.extension import Extension, MethodBinding
        from mcp.server.mcpserver import MCPServer
        from mcp.types import (
            CallToolResult,
            ElicitRequest,
            ElicitRequestFormParams,
            InputRequiredResult,
            RequestParams,
            SamplingMessage,
            TextContent,
            Tool,
        )

        calls, tasks = self.calls, self.tasks

        class TaskParams(RequestParams):
            task_id: str  # taskId on the wire

        class UpdateParams(TaskParams):
            input_responses: dict[str, Any] | None = None

        class ListParams(RequestParams):
            cursor: str | None = None

        def task_doc(task_id: str) -> dict[str, Any]:
            return {"taskId": task_id, "status": "completed", "createdAt": "2026-01-01T00:00:00Z",
                    "lastUpdatedAt": "2026-01-01T00:00:00Z", "ttl": None}

        def modern(ctx: Any) -> bool:
            return ctx.protocol_version == MODERN

        async def get(ctx: Any, params: TaskParams) -> dict[str, Any]:
            calls.append(f"tasks/get {params.task_id}")
            task = tasks.get(params.task_id)
            if not modern(ctx) or task is None:
                return task_doc(params.task_id)
            # 2026-07-28 (SEP-2663): a DetailedTask. Working on the first poll, then completed with the result.
            task["polls"] = task.get("polls", 0) + 1
            if task["polls"] < 2 or task.get("cancelled"):
                return {**modern_task(params.task_id), "status": "cancelled" if task.get("cancelled") else "working"}
            return {**modern_task(params.task_id), "status": "completed",
                    "result": {"content": [{"type": "text", "text": task["text"]}], "isError": False,
                               "structuredContent": {"result": task["text"]}}}

        async def update(ctx: Any, params: UpdateParams) -> dict[str, Any]:
            calls.append(f"tasks/update {params.task_id} {sorted(params.input_responses or {})}")
            return {}

        async def result(ctx: Any, params: TaskParams) -> dict[str, Any]:
            calls.append(f"tasks/result {params.task_id}")
            return {"content": [{"type": "text", "text": tasks[params.task_id]["text"]}], "isError": False}

        async def cancel(ctx: Any, params: TaskParams) -> dict[str, Any]:
            calls.append(f"tasks/cancel {params.task_id}")
            if modern(ctx):  # 2026-07-28: an empty acknowledgement
                tasks.get(params.task_id, {})["cancelled"] = True
                return {}
            return {**task_doc(params.task_id), "status": "cancelled"}

        async def listed(ctx: Any, params: ListParams) -> dict[str, Any]:
            calls.append("tasks/list")
            return {"tasks": [task_doc(t) for t in tasks]}

        class Tasks(Extension):
            identifier = "io.tether-test/tasks"

            def methods(self) -> list[MethodBinding]:
                return [MethodBinding("tasks/get", TaskParams, get), MethodBinding("tasks/result", TaskParams, result),
                        MethodBinding("tasks/cancel", TaskParams, cancel),
                        MethodBinding("tasks/list", ListParams, listed),
                        MethodBinding("tasks/update", UpdateParams, update)]

        def modern_task(task_id: str) -> dict[str, Any]:
            return {"taskId": task_id, "createdAt": "2026-01-01T00:00:00Z", "lastUpdatedAt": "2026-01-01T00:00:00Z",
                    "ttlMs": 60000, "pollIntervalMs": 50}

        class ModernTasks(Extension):
            """The 2026-07-28 tasks extension (SEP-2663): the server answers a ``job`` call with a task
            (``resultType: "task"``) when the request declares the extension in its capabilities."""

            identifier = TASKS_EXTENSION

            async def intercept_tool_call(self, params: Any, ctx: Any, call_next: Any) -> Any:
                declared = ctx.session.client_capabilities
                if (params.name != "job" or not modern(ctx) or declared is None
                        or TASKS_EXTENSION not in (declared.extensions or {})):
                    return await call_next(ctx)
                task_id = f"task-{uuid.uuid4().hex[:12]}"
                calls.append(f"task job {task_id}")
                tasks[task_id] = {"tool": "job", "text": f"job {(params.arguments or {}).get('n')} done"}
                return {"resultType": "task", **modern_task(task_id), "status": "working"}

        server = MCPServer("tether-test-next", extensions=[Tasks(), ModernTasks()])

        @server.tool()
        def add(a: int, b: int) -> int:
            """Add two numbers."""
            calls.append("add")
            return a + b

        @server.tool()
        async def slow(seconds: float) -> str:
            """Sleep, then answer."""
            calls.append(f"slow {seconds}")
            await asyncio.sleep(seconds)
            calls.append(f"slow done {seconds}")
            return f"slept {seconds}"

        @server.tool()
        def delete_everything() -> str:
            """A tool no agent should ever see."""
            calls.append("delete_everything")
            return "deleted"

        @server.tool()
        def job(n: int) -> str:
            """A job a client may run as a task."""
            calls.append(f"job {n}")
            return f"job {n} done"

        @server.tool()
        async def ask(question: str, ctx: Context) -> str:
            """Ask the client's model, offering it tools (sampling with tools, 2025-11-25)."""
            calls.append("ask")
            offered = [Tool(name=n, description=n, input_schema={"type": "object"})
                       for n in ("add", "delete_everything")]
            answer = await ctx.session.create_message(
                [SamplingMessage(role="user", content=TextContent(type="text", text=question))], max_tokens=16,
                tools=offered)
            content = answer.content[0] if isinstance(answer.content, list) else answer.content
            return f"the model said {content.text}"

        @server.tool()
        async def confirm(action: str, ctx: Context) -> Any:
            """A multi-round-trip tool (2026-07-28): asks the client to confirm, then acts."""
            responses = getattr(ctx, "input_responses", None) or {}
            if "ok" not in responses:
                calls.append(f"confirm asks {action}")
                return InputRequiredResult(
                    input_requests={"ok": ElicitRequest(params=ElicitRequestFormParams(
                        message=f"really {action}?", requested_schema={"type": "object", "properties": {}}))},
                    request_state=f"state-{uuid.uuid4().hex[:8]}")
            calls.append(f"confirm does {action}")
            return CallToolResult(content=[TextContent(type="text", text=f"did {action}")])

        app = self._task_creation(server.streamable_http_app(), task_doc)
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        wait_until(lambda: self._server.started, 15, what="MCP next server")
        return self

    def _task_creation(self, inner: Any, task_doc: Callable[[str], dict[str, Any]]) -> Any:
        """A ``tools/call`` carrying ``params.task`` is answered with a task (2025-11-25 ``CreateTaskResult``)
        in front of the SDK app, which validates every ``tools/call`` result as a ``CallToolResult``."""
        calls, tasks = self.calls, self.tasks

        def create(params: dict[str, Any]) -> dict[str, Any]:
            """A task for the call, as 2025-11-25 writes it, or (when the request names 2026-07-28) as the tasks
            extension does."""
            task_id = f"task-{uuid.uuid4().hex[:12]}"
            calls.append(f"task {params['name']} {task_id}")
            tasks[task_id] = {"tool": params["name"], "text": f"{params['name']} {params['arguments']['n']} done"}
            if (params.get("_meta") or {}).get("io.modelcontextprotocol/protocolVersion") == MODERN:
                return {"resultType": "task", **task_doc(task_id), "status": "working"}
            return {"task": {**task_doc(task_id), "status": "working"}}

        def batched(message: dict[str, Any]) -> dict[str, Any]:
            params = message.get("params") or {}
            if message.get("method") == "tools/call" and ("task" in params or "_meta" in params):
                return {"jsonrpc": "2.0", "id": message["id"], "result": create(params)}
            if message.get("method") == "tasks/get" and params.get("taskId") in tasks:
                calls.append(f"tasks/get {params['taskId']}")
                return {"jsonrpc": "2.0", "id": message["id"], "result": task_doc(params["taskId"])}
            return {"jsonrpc": "2.0", "id": message["id"], "error": {"code": -32601, "message": "not in a batch"}}

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["method"] != "POST":
                await inner(scope, receive, send)
                return
            messages, body, more = [], b"", True
            while more:
                message = await receive()
                messages.append(message)
                body += message.get("body", b"")
                more = message.get("more_body", False)
            try:
                doc = json.loads(body)
            except ValueError:
                doc = None
            params = doc.get("params") if isinstance(doc, dict) else None
            answer: Any = None
            if isinstance(doc, list):  # a JSON-RPC batch, which the SDK does not take: answered here
                answer = [batched(m) for m in doc if isinstance(m, dict) and "id" in m]
            elif isinstance(doc, dict) and doc.get("method") == "tools/call" and isinstance(params, dict) \
                    and "task" in params:
                answer = {"jsonrpc": "2.0", "id": doc["id"], "result": create(params)}
            if answer is not None:
                out = json.dumps(answer).encode()
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(out)).encode())]})
                await send({"type": "http.response.body", "body": out})
                return

            async def replay() -> dict[str, Any]:
                return messages.pop(0) if messages else await receive()

            await inner(scope, replay, send)

        return app


@dataclass
class NextWorld:
    cp: ControlPlaneProcess
    server: NextServer
    wiretap: Wiretap
    sidecars: list[SidecarProcess] = field(default_factory=list)

    def sidecar(self, agent: str, caps: dict[str, Any]) -> SidecarProcess:
        return self.sidecar_of(self.cp.issue(agent, caps))

    def sidecar_of(self, identity: Identity) -> SidecarProcess:
        sidecar = SidecarProcess(self.cp, identity)
        self.sidecars.append(sidecar)
        return sidecar.start()

    def session(self, sidecar: SidecarProcess, mode: str, body: Callable[[Client], Awaitable[Any]],
                **options: Any) -> Any:
        async def run() -> Any:
            async with httpx2.AsyncClient(proxy=sidecar.proxy, trust_env=False, timeout=30) as http_client, \
                    Client(streamable_http_client(self.server.url, http_client=http_client), mode=mode,
                           **options) as client:
                return await body(client)
        return asyncio.run(asyncio.wait_for(run(), WAIT * 3))

    def reports(self, agent: str) -> list[dict[str, Any]]:
        return sorted(self.cp.client().request("GET", f"/v1/reports?agent={agent}"), key=lambda r: r["started_at"])

    def tool_reports(self, agent: str, capability: str) -> list[dict[str, Any]]:
        return [r for r in self.reports(agent) if r.get("capability") == capability]


def next_world(directory: Path) -> Iterator[NextWorld]:
    server = NextServer().start()
    wiretap = tap(server)
    cp = prepare_controlplane(directory / "cp", free_port(), free_port(), server.port)
    caps = {name: {"mcp": {"url": server.url, "tool": tool}} for name, tool in TOOLS.items()}
    cp.catalog_path.write_text(json.dumps({"capabilities": caps}))  # JSON is YAML
    cp.start()
    world = NextWorld(cp, server, wiretap)
    try:
        yield world
    finally:
        for sidecar in world.sidecars:
            sidecar.stop()
        cp.stop()
        server.stop()
