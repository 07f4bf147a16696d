"""``tether mcp stdio``: a stdio MCP server under a sidecar, for hosts that start their servers over stdio.

A desktop agent starts ``tether mcp stdio --chain F --key K --name NAME -- CMD ARGS...`` where it started
``CMD ARGS...``: its MCP config changes only its command line. The bridge starts CMD as its child and speaks
stdio to its own parent (the host), and no message passes between the two except through a real ``tether
sidecar`` subprocess, so each one meets the decision, list filtering, approval, capture, reports and termination
of any MCP call over HTTP. Nothing of the sidecar is re-implemented here:

* The child's side is a streamable-HTTP MCP endpoint on a loopback port (``Endpoint``): a POST writes its
  JSON-RPC message to the child's stdin and answers with the child's response for each of its request ids
  (``application/json``); whatever else the child writes (notifications, its own requests to the host) is held
  for the GET listen stream. A POST whose connection goes away before its answer (the sidecar cut it: an abort, a
  drain past its window, the call timeout) is cancelled at the child with ``notifications/cancelled``.
* The host's side (``HostRelay``) sends each line the host writes as a POST for the reserved URL
  ``http://NAME.stdio.tether/mcp`` (the catalog's ``stdio://NAME``) through the sidecar, and writes each answer
  back as one line; it keeps a GET listen stream open through the sidecar for the child's own messages. A request
  the sidecar cut gets a JSON-RPC error (its outcome is unknown: the tool may have run).
* The sidecar is started with ``--stdio-route NAME=127.0.0.1:PORT`` (proxy/stdio.py): only it knows where the
  reserved name leads. The endpoint accepts only requests bearing a token that only this bridge holds, so a local
  process that finds the port cannot go around the sidecar.

The bridge's stdout carries MCP only: its own messages and the sidecar's go to stderr and the sidecar's log.
When the host closes stdin (or stops the bridge), the child's stdin is closed, the child is given a moment to
exit, and the sidecar stops as it always does (in-flight calls finish in its stop window, reports delivered).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

from capability.errors import BAD_REQUEST, TetherError

from .remote import add_controlplane
from .sidecar import SIDECAR_OPTIONS, default_state_root

LINE_LIMIT = 64 << 20  # the longest JSON-RPC line read from the host or the child (a large resource, say)
LISTEN_S = 60.0  # a listen stream is ended by the endpoint this often (the bridge reopens it at once): each stays
# well inside the sidecar's call timeout, so none of them ends in the record as a call cut off
CUT = -32003  # the JSON-RPC error code of tether's refusals (proxy/mcp.py JSONRPC_REFUSED)
CHILD_EXITED = -32000
REQUEST_CANCELLED = -32800  # the answer the endpoint gives a request the host cancelled (the server gives none)
ABORTED = "tether.aborted"
SIDECAR_GONE = "tether.sidecar_failed"
# Sidecar options whose meaning the bridge sets itself, or that make no sense in front of one stdio server.
NOT_HERE = ("listen", "ready_file", "transparent_listen", "dns_listen", "stdio_route")
OVERRIDES: dict[str, dict[str, Any]] = {
    "state_dir": {"help": "the sidecar's state dir (default: $XDG_STATE_HOME/tether/AGENT/stdio/NAME, else "
                          "~/.local/state/tether/AGENT/stdio/NAME)"},
}


def add_mcp(sub: Any) -> None:
    p = sub.add_parser("mcp", help="MCP servers under tether (stdio servers: tether mcp stdio)")
    group = p.add_subparsers(dest="mcp_command", required=True, metavar="COMMAND")
    s = group.add_parser("stdio", help="run a stdio MCP server under a sidecar, speaking stdio to the host",
                         description="Start CMD (a stdio MCP server) as a child and speak MCP over stdio to the "
                         "host; every message in both directions passes through a tether sidecar, as it would "
                         "to an HTTP MCP server. Every sidecar option is accepted and forwarded to it.")
    add_controlplane(s)
    for option in SIDECAR_OPTIONS:
        if option.dest not in NOT_HERE:
            option.add_to(s, **OVERRIDES.get(option.dest, {}))
    s.add_argument("--name", metavar="NAME",
                   help="the server's name in the catalog: its capabilities name url stdio://NAME (default: the "
                   "one stdio server the chain holds anything on)")
    s.add_argument("--enforce-server", action="store_true",
                   help="run the server under tether run, enforced: its own outbound traffic has no way out but "
                   "the same sidecar (the catalog must grant what it calls; Linux namespaces)")
    s.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...", help="the stdio server and its arguments")
    s.set_defaults(func=cmd_mcp_stdio)


def cmd_mcp_stdio(args: argparse.Namespace) -> int:
    from capability.catalog import stdio_name_ok

    from .sidecar import setup_logging

    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise TetherError("give the stdio server's command after --, e.g. tether mcp stdio --chain c --key k "
                          "--name files -- npx -y @modelcontextprotocol/server-filesystem /data", code=BAD_REQUEST)
    if args.name is None:
        args.name = default_name(args)
    if not stdio_name_ok(args.name):
        raise TetherError(f"--name is one lower-case DNS label (letters, digits, '-'), as in the catalog's "
                          f"stdio://NAME (not {args.name!r})", code=BAD_REQUEST)
    setup_logging()
    return asyncio.run(Bridge(args, command).run())


def default_name(args: argparse.Namespace) -> str:
    """The one stdio server on which the chain holds anything, per the catalog (``--catalog``, else the control
    plane's): a host config then needs no ``--name`` when its grant covers a single stdio server."""
    from urllib.parse import urlsplit

    from capability.catalog import catalog_from, empty_catalog, stdio_server_name
    from capability.chain import parse_chain_unverified
    from capability.shared import load_catalog, read_chain

    from .remote import client

    if args.catalog:
        catalog = load_catalog(args.catalog)
    else:
        doc = client(args).request("GET", "/v1/catalog", admin=False)
        catalog = catalog_from(doc["catalog"]) if doc["catalog"].get("capabilities") else empty_catalog()
    held = parse_chain_unverified(read_chain(args.chain))[-1].caps
    names = set()
    for name in held:
        cap = catalog.capabilities.get(name)
        if cap is not None and cap.mcp is not None and held[name] != "absent":
            server = stdio_server_name(urlsplit(cap.mcp.server).hostname or "")
            if server is not None:
                names.add(server)
    if len(names) != 1:
        raise TetherError("give --name: the chain holds capabilities on " + (
            f"the stdio servers {', '.join(sorted(names))}" if names else "no stdio server (stdio://NAME) of the "
            "catalog"), code=BAD_REQUEST)
    return names.pop()


def jsonrpc_error(msg_id: Any, code: int, message: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": msg_id, "error": error}


def requests_in(value: Any) -> list[Any]:
    """The ids of the JSON-RPC requests in one message or batch (notifications and responses have none)."""
    items = value if isinstance(value, list) else [value]
    return [m["id"] for m in items if isinstance(m, dict) and isinstance(m.get("method"), str) and "id" in m]


def id_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def line_of(value: Any) -> bytes:
    """One JSON-RPC message as stdio carries it: compact JSON on one line (JSON escapes every newline)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def say(text: str) -> None:
    print(f"tether: {text}", file=sys.stderr, flush=True)


# -- the child's side: its stdio as a streamable-HTTP endpoint ----------------------------------------------
class Endpoint:
    """The stdio server as an MCP endpoint on 127.0.0.1, for the sidecar alone (the bearer token)."""

    def __init__(self, child: asyncio.subprocess.Process, token: str) -> None:
        self.child, self.token = child, token
        self.pending: dict[str, asyncio.Future[Any]] = {}
        self.held: deque[Any] = deque(maxlen=10_000)  # the child's own messages, until a listen stream takes them
        self.arrived = asyncio.Event()
        self.exited: int | None = None
        self._write = asyncio.Lock()

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=LINE_LIMIT)
        app.router.add_post("/mcp", self.post)
        app.router.add_get("/mcp", self.listen)
        app.router.add_delete("/mcp", self.end_session)
        return app

    def _authorized(self, request: Any) -> bool:
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    async def to_child(self, value: Any) -> None:
        stdin = self.child.stdin
        if stdin is None or self.exited is not None:
            raise ConnectionResetError("the stdio server has exited")
        async with self._write:
            stdin.write(line_of(value))
            await stdin.drain()

    async def post(self, request: Any) -> Any:
        from aiohttp import web

        if not self._authorized(request):
            return web.json_response({"error": "this endpoint is its sidecar's alone"}, status=401)
        try:
            value = json.loads(await request.read())
        except ValueError:
            return web.json_response(jsonrpc_error(None, -32700, "not JSON"), status=400)
        ids = requests_in(value)
        if len({id_key(i) for i in ids}) < len(ids) or any(id_key(i) in self.pending for i in ids):
            # Two requests under one id could not be told apart in the server's answers: neither is sent.
            answers = [jsonrpc_error(i, -32600, f"a request with id {i!r} is already in flight") for i in ids]
            return web.Response(body=line_of(answers if isinstance(value, list) else answers[0]),
                                content_type="application/json")
        loop = asyncio.get_running_loop()
        waiting = {id_key(i): (i, loop.create_future()) for i in ids}
        for key, (_, future) in waiting.items():
            self.pending[key] = future
        try:
            try:
                await self.to_child(value)
            except OSError as exc:
                return web.json_response(jsonrpc_error(ids[0] if ids else None, CHILD_EXITED, str(exc)), status=502)
            self._cancelled_by_client(value)
            if not ids:
                return web.Response(status=202)
            answers = [await future for _, future in waiting.values()]
        except asyncio.CancelledError:
            # The sidecar's connection went away before every answer came: the call was cut. MCP's cancellation
            # tells the server to stop the work (a stdio server has no stream to notice closing).
            for i, future in waiting.values():
                if not future.done():
                    with contextlib.suppress(OSError):
                        await asyncio.shield(self.to_child({
                            "jsonrpc": "2.0", "method": "notifications/cancelled",
                            "params": {"requestId": i, "reason": "tether: the call was cut"}}))
            raise
        finally:
            for key, (_, future) in waiting.items():
                if self.pending.get(key) is future:
                    del self.pending[key]
        body = answers if isinstance(value, list) else answers[0]
        return web.Response(body=line_of(body), content_type="application/json")

    def _cancelled_by_client(self, value: Any) -> None:
        """A host's ``notifications/cancelled`` (now at the server) ends the POST still waiting for that request: a
        server that honours it never answers, and the call must not stay in flight until the sidecar's timeout.
        The host, which forgot the id, never sees this answer (``HostRelay`` drops it)."""
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and item.get("method") == "notifications/cancelled":
                params = item.get("params")
                request_id = params.get("requestId") if isinstance(params, dict) else None
                future = self.pending.get(id_key(request_id))
                if future is not None and not future.done():
                    future.set_result(jsonrpc_error(request_id, REQUEST_CANCELLED, "cancelled by the client"))

    async def listen(self, request: Any) -> Any:
        """The GET listen stream: the child's notifications and requests, as SSE, for ``LISTEN_S`` at most."""
        from aiohttp import web

        if not self._authorized(request):
            return web.json_response({"error": "this endpoint is its sidecar's alone"}, status=401)
        if "text/event-stream" not in request.headers.get("Accept", ""):
            return web.Response(status=405, text="GET asks for text/event-stream")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LISTEN_S
        while self.exited is None:
            while self.held:
                message = self.held.popleft()
                try:
                    await resp.write(b"data: " + line_of(message).rstrip(b"\n") + b"\n\n")
                except (ConnectionError, RuntimeError):
                    self.held.appendleft(message)  # not delivered: the next listen stream takes it
                    return resp
            self.arrived.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.arrived.wait(), remaining)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write_eof()
        return resp

    async def end_session(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(status=401 if not self._authorized(request) else 405)

    async def read_child(self) -> None:
        """Route each line the child writes: a response to its waiting POST, anything else to the listen stream."""
        stdout = self.child.stdout
        assert stdout is not None
        while True:
            try:
                line = await stdout.readline()
            except ValueError:  # longer than LINE_LIMIT: not a message anyone could read
                say(f"the stdio server wrote a line longer than {LINE_LIMIT} bytes; dropped")
                continue
            if not line:
                break
            try:
                value = json.loads(line)
            except ValueError:
                say(f"the stdio server wrote a line that is not JSON; dropped: {line[:200]!r}")
                continue
            for item in value if isinstance(value, list) else [value]:
                self._route(item)
        self.exited = await self.child.wait()
        self.arrived.set()
        for key, future in list(self.pending.items()):
            if not future.done():
                future.set_result(jsonrpc_error(json.loads(key), CHILD_EXITED,
                                                f"the stdio server exited ({self.exited}) before it answered"))

    def _route(self, item: Any) -> None:
        is_response = isinstance(item, dict) and "id" in item and "method" not in item
        if is_response:
            future = self.pending.get(id_key(item["id"]))
            if future is not None and not future.done():
                future.set_result(item)
            # else: the answer to a call already cut (cancelled at the child): nobody is waiting for it
            return
        self.held.append(item)
        self.arrived.set()


# -- the host's side: stdio in, every message through the sidecar -------------------------------------------
class HostRelay:
    """The host's messages as requests through the sidecar; the answers, and the listen stream, back as lines."""

    def __init__(self, url: str, proxy: str, token: str, out: asyncio.StreamWriter) -> None:
        self.url, self.proxy, self.token, self.out = url, proxy, token, out
        self.session: Any = None
        self.tasks: set[asyncio.Task] = set()
        self.answered = asyncio.Event()  # the first request answered: the session is up, the listen stream opens
        self.cancelled: set[str] = set()  # ids of requests the host cancelled: their answers are not the host's
        self._write = asyncio.Lock()

    async def to_host(self, value: Any) -> None:
        async with self._write:
            self.out.write(line_of(value))
            await self.out.drain()

    def headers(self, **more: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}", **more}

    async def relay(self, stdin: asyncio.StreamReader) -> None:
        import aiohttp

        # No timeout: a call may be held for a person's approval; the sidecar's call timeout bounds the rest.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        async with aiohttp.ClientSession(timeout=timeout, trust_env=False, auto_decompress=False) as session:
            self.session = session
            listen = asyncio.create_task(self.listen())
            try:
                while True:
                    try:
                        line = await stdin.readline()
                    except ValueError:
                        say(f"the host wrote a line longer than {LINE_LIMIT} bytes; dropped")
                        continue
                    if not line:
                        break  # the host closed stdin: the session is over
                    if line.strip():
                        task = asyncio.create_task(self.forward(line.strip()))
                        self.tasks.add(task)
                        task.add_done_callback(self.tasks.discard)
                if self.tasks:  # answers already on their way are still written
                    await asyncio.wait(set(self.tasks), timeout=5)
            finally:
                listen.cancel()
                for task in list(self.tasks):
                    task.cancel()
                await asyncio.gather(listen, *self.tasks, return_exceptions=True)

    async def forward(self, line: bytes) -> None:
        import aiohttp

        try:
            value = json.loads(line)
        except ValueError:
            await self.to_host(jsonrpc_error(None, -32700, "not JSON: nothing was sent to the server"))
            return
        ids = requests_in(value)
        self._note_cancelled(value)
        try:
            async with self.session.post(self.url, data=line, proxy=self.proxy, headers=self.headers(**{
                    "Content-Type": "application/json", "Accept": "application/json, text/event-stream"})) as resp:
                body = await resp.read()
                answer = self._answer(resp, body, ids)
        except (aiohttp.ClientError, OSError) as exc:
            # The request left and no complete answer came back (the sidecar cut it, or the sidecar is gone).
            ids = [i for i in ids if id_key(i) not in self.cancelled]
            if ids:
                await self._cut(ids, exc)
            return
        if ids and all(id_key(i) in self.cancelled for i in ids):
            self.cancelled.difference_update(id_key(i) for i in ids)
            return  # the host gave up on it: its answer (the endpoint's, or the server's) is nobody's
        if answer is not None:
            await self.to_host(answer)
            if ids:
                self.answered.set()
        elif resp.status >= 300 and not ids:
            say(f"a message from the host was refused ({resp.headers.get('Tether-Error') or resp.status}); "
                "it did not reach the server")

    def _note_cancelled(self, value: Any) -> None:
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and item.get("method") == "notifications/cancelled":
                params = item.get("params")
                if isinstance(params, dict) and "requestId" in params:
                    if len(self.cancelled) > 10_000:  # ids whose answer never came back: forget the oldest guesses
                        self.cancelled.clear()
                    self.cancelled.add(id_key(params["requestId"]))

    @staticmethod
    def _answer(resp: Any, body: bytes, ids: list[Any]) -> Any:
        """What the host gets for one POST: the JSON-RPC answer as the sidecar relayed it, or, when the answer is
        not JSON-RPC (a refusal of something else), a JSON-RPC error per request saying why. None: nothing."""
        text = body.strip()
        if text.startswith(b"data:") or "text/event-stream" in resp.headers.get("Content-Type", ""):
            text = b"".join(line[5:].strip() for line in text.splitlines() if line.startswith(b"data:"))
        try:
            value = json.loads(text) if text else None
        except ValueError:
            value = None
        items = value if isinstance(value, list) else [value]
        if value is not None and all(isinstance(m, dict) and m.get("jsonrpc") == "2.0" for m in items):
            return value
        if not ids:
            return None
        error = value.get("error") if isinstance(value, dict) and isinstance(value.get("error"), dict) else {}
        code = resp.headers.get("Tether-Error") or error.get("code") or f"http_{resp.status}"
        message = error.get("message") or f"the sidecar answered HTTP {resp.status}"
        answers = [jsonrpc_error(i, CUT, message, {**error, "code": code}) for i in ids]
        return answers if len(answers) > 1 else answers[0]

    async def _cut(self, ids: list[Any], exc: BaseException) -> None:
        message = ("tether cut this call before its answer came back (an abort, a drain past its window, or the "
                   f"call timeout); whether the server acted on it is unknown ({exc or type(exc).__name__})")
        for i in ids:
            await self.to_host(jsonrpc_error(i, CUT, message, {"code": ABORTED}))

    async def listen(self) -> None:
        """The GET listen stream through the sidecar, reopened whenever it ends (backing off while refused)."""
        import aiohttp

        await self.answered.wait()
        failures = 0
        refused_with: str | None = None
        while True:
            try:
                async with self.session.get(self.url, proxy=self.proxy,
                                            headers=self.headers(Accept="text/event-stream")) as resp:
                    if resp.status == 200 and "text/event-stream" in resp.headers.get("Content-Type", ""):
                        failures, refused_with = 0, None
                        await self._events(resp.content)
                        continue
                    why = resp.headers.get("Tether-Error") or f"HTTP {resp.status}"
                    if why != refused_with:
                        say(f"the listen stream for the server's own messages was refused ({why}); retrying")
                        refused_with = why
            except (aiohttp.ClientError, OSError):
                pass
            failures += 1
            await asyncio.sleep(min(5.0, 0.25 * 2 ** min(failures, 5)))

    async def _events(self, content: Any) -> None:
        data: list[bytes] = []
        async for raw in content:
            line = raw.rstrip(b"\r\n")
            if line.startswith(b"data:"):
                data.append(line[5:].lstrip(b" "))
            elif not line and data:
                try:
                    await self.to_host(json.loads(b"\n".join(data)))
                except ValueError:
                    say("the listen stream carried an event that is not JSON; dropped")
                data = []


# -- the whole bridge ------------------------------------------------------------------------------------
class Bridge:
    def __init__(self, args: argparse.Namespace, command: list[str]) -> None:
        self.args, self.command = args, command
        self.sidecar: subprocess.Popen | None = None

    async def run(self) -> int:
        from aiohttp import web

        from capability.catalog import stdio_endpoint

        from .run import _wait_ready

        args = self.args
        token = secrets.token_urlsafe(32)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))  # bound before the sidecar starts: its route names this port
        port = listener.getsockname()[1]
        state_dir = self._state_dir()
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        ready = state_dir / "sidecar.ready"
        ready.unlink(missing_ok=True)
        route = f"{args.name}=127.0.0.1:{port}"
        child: Any = None
        try:
            if args.enforce_server:
                # tether run starts the sidecar (with our route) and the server enclosed: one sidecar for both.
                child = await asyncio.create_subprocess_exec(
                    *self._run_argv(state_dir, ready, route), stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, limit=LINE_LIMIT, env=child_env(), preexec_fn=die_with_parent)
                agent_dir = state_dir / self._agent()
                log_path = agent_dir / "sidecar.log"
                info = await asyncio.to_thread(_wait_ready, _Polled(child), ready, log_path)
            else:
                log_path = state_dir / "sidecar.log"
                self.sidecar = self._start_sidecar(state_dir, ready, log_path, route)
                info = await asyncio.to_thread(_wait_ready, self.sidecar, ready, log_path)
            say(f"stdio server {args.name} behind the sidecar for {info['agent']} at {info['proxy']} "
                f"(log {log_path})")
            if not args.enforce_server:
                say("every MCP message passes the sidecar; the server's own outbound traffic does not (give "
                    "--enforce-server to enforce it too)")
            if child is None:
                child = await asyncio.create_subprocess_exec(
                    *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=LINE_LIMIT,
                    env=child_env(), preexec_fn=die_with_parent)
            endpoint = Endpoint(child, token)
            runner = web.AppRunner(endpoint.app(), handler_cancellation=True, access_log=None)
            await runner.setup()
            await web.SockSite(runner, listener).start()
            reading = asyncio.create_task(endpoint.read_child())
            stdin, out = await host_pipes()
            relay = HostRelay(stdio_endpoint(args.name), info["proxy"], token, out)
            hosting = asyncio.create_task(relay.relay(stdin))
            # Enforced, the sidecar is tether run's: it ends with the server, and so does the bridge.
            watching = asyncio.create_task(asyncio.to_thread(self.sidecar.wait) if self.sidecar is not None
                                           else asyncio.Event().wait())
            stopping = asyncio.get_running_loop().create_future()
            for sig in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(sig, lambda s=sig: stopping.done() or
                                                              stopping.set_result(s))
            done, _ = await asyncio.wait({hosting, reading, watching, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if watching in done and self.sidecar is not None:
                say(f"the sidecar exited ({self.sidecar.returncode}); nothing more reaches the stdio server "
                    f"(see {log_path})")
            # tether run stops its sidecar after the server: its stop window and reports come first.
            patience = args.stop_window + 20 if args.enforce_server else 5.0
            code = await self._finish(child, endpoint, hosting, reading, patience, relay)
            watching.cancel()
            await runner.cleanup()
            if watching in done and self.sidecar is not None:
                return self.sidecar.returncode or 1
            if stopping.done():
                return 128 + int(stopping.result())
            return code
        finally:
            listener.close()
            self._stop_sidecar()
            if child is not None and child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                await child.wait()

    async def _finish(self, child: Any, endpoint: Endpoint, hosting: asyncio.Task, reading: asyncio.Task,
                      patience: float, relay: HostRelay) -> int:
        """Close the child's stdin, give it ``patience`` seconds to exit (then SIGTERM, then SIGKILL); the host
        relay ends."""
        if child.stdin is not None:
            with contextlib.suppress(OSError):
                child.stdin.close()
        for step, wait_s in ((lambda: None, patience), (child.terminate, patience), (child.kill, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                step()
            try:
                await asyncio.wait_for(asyncio.shield(reading), wait_s)
                break
            except TimeoutError:
                continue
        if relay.tasks:  # a server that exited answered its waiting requests with an error: the host gets them
            await asyncio.wait(set(relay.tasks), timeout=3)
        hosting.cancel()
        await asyncio.gather(hosting, reading, return_exceptions=True)
        code = endpoint.exited if endpoint.exited is not None else child.returncode or 0
        return 128 - code if code < 0 else code

    def _agent(self) -> str:
        from capability.chain import parse_chain_unverified
        from capability.shared import read_chain

        return parse_chain_unverified(read_chain(self.args.chain))[-1].sub

    def _state_dir(self) -> Path:
        """The sidecar's state dir (enforced: the root of tether run's, which keeps the agent's inside it)."""
        if self.args.state_dir:
            return Path(self.args.state_dir)
        # Per server: a host that starts several stdio servers under one chain runs one sidecar for each.
        return default_state_root() / self._agent() / "stdio" / self.args.name

    def _sidecar_args(self, route: str) -> argparse.Namespace:
        return argparse.Namespace(**{**vars(self.args), "listen": "127.0.0.1:0", "transparent_listen": None,
                                     "dns_listen": None, "stdio_route": [route]})

    def _run_argv(self, state_dir: Path, ready: Path, route: str) -> list[str]:
        """``tether run`` for the server, enforced, with every sidecar option (and our route) forwarded."""
        from .remote import DEFAULT_CONTROLPLANE
        from .run import SET_BY_RUN

        args = self._sidecar_args(route)
        resolved = {"chain": args.chain, "key": args.key, "state_dir": str(state_dir), "ready_file": str(ready)}
        argv = [sys.executable, "-m", "cli", "run", "--controlplane", args.controlplane or DEFAULT_CONTROLPLANE]
        for option in SIDECAR_OPTIONS:
            argv += option.argv(resolved[option.dest] if option.dest in SET_BY_RUN else getattr(args, option.dest))
        return [*argv, "--", *self.command]

    def _start_sidecar(self, state_dir: Path, ready: Path, log_path: Path, route: str) -> subprocess.Popen:
        from .run import _die_with_parent, sidecar_argv, without_authority

        args = self._sidecar_args(route)
        argv = sidecar_argv(args, chain=args.chain, key=args.key, state_dir=state_dir, ready=ready)
        with open(log_path, "ab") as log_file:
            # Never the host's stdin or stdout: those carry the MCP session.
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                    start_new_session=True, env=without_authority(os.environ),
                                    preexec_fn=_die_with_parent)

    def _stop_sidecar(self) -> None:
        from .run import _stop

        if self.sidecar is not None:
            _stop(self.sidecar, self.args.stop_window)


class _Polled:
    """An asyncio child as ``_wait_ready`` polls a sidecar: ``poll()`` is its exit status, or None while it runs."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    def poll(self) -> int | None:
        return self.process.returncode


def child_env() -> dict[str, str]:
    """The stdio server's environment: the host's, without tether's tokens."""
    from .run import without_authority

    return without_authority(os.environ)


def die_with_parent() -> None:
    from .run import _die_with_parent

    _die_with_parent()


async def host_pipes() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The host's stdin and stdout as asyncio streams (the MCP session's only channel)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=LINE_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(os.dup(0), "rb", 0))
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                        os.fdopen(os.dup(1), "wb", 0))
    return reader, asyncio.StreamWriter(transport, protocol, None, loop)
