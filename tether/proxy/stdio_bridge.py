"""The two halves of ``tether mcp stdio``'s bridge (tether/cli/mcp_stdio.py starts them, and the sidecar between them).

* ``Endpoint``: the stdio server's side. Its stdio as a streamable-HTTP MCP endpoint on a loopback port, for the
  sidecar alone (a bearer token only the bridge holds): a POST writes its JSON-RPC message to the child's stdin and
  answers with the child's response for each of its request ids (``application/json``); whatever else the child
  writes (notifications, its own requests to the host) waits for the GET listen stream. A POST whose connection
  goes away before its answer (the sidecar cut it: an abort, a drain past its window, the call timeout) is
  cancelled at the child with ``notifications/cancelled``; one the host cancelled is answered at once.
* ``HostRelay``: the host's side. Each line the host writes goes as a POST for the server's reserved URL
  (``http://NAME.stdio.tether/mcp``) through the sidecar, and each answer comes back as one line; a GET listen
  stream through the sidecar carries the child's own messages. A request the sidecar cut gets a JSON-RPC error
  (its outcome is unknown: the tool may have run).

Neither decides anything: the sidecar between them does, as for any MCP server over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import sys
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp
    from aiohttp import web

LINE_LIMIT = 64 << 20  # the longest JSON-RPC line read from the host or the child (a large resource, say)
LISTEN_S = 60.0  # a listen stream is ended by the endpoint this often (the bridge reopens it at once): each stays
# well inside the sidecar's call timeout, so none of them ends in the record as a call cut off
CUT = -32003  # the JSON-RPC error code of tether's refusals (tether/proxy/mcp.py JSONRPC_REFUSED)
CHILD_EXITED = -32000
REQUEST_CANCELLED = -32800  # the answer the endpoint gives a request the host cancelled (the server gives none)
ABORTED = "tether.aborted"
SIDECAR_FAILED = "tether.sidecar_failed"


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

    def app(self) -> web.Application:
        from aiohttp import web

        app = web.Application(client_max_size=LINE_LIMIT)
        app.router.add_post("/mcp", self.post)
        app.router.add_get("/mcp", self.listen)
        app.router.add_delete("/mcp", self.end_session)
        return app

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    async def to_child(self, value: Any) -> None:
        stdin = self.child.stdin
        if stdin is None or self.exited is not None:
            raise ConnectionResetError("the stdio server has exited")
        async with self._write:
            stdin.write(line_of(value))
            await stdin.drain()

    async def post(self, request: web.Request) -> web.StreamResponse:
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
            except OSError as exc:  # the server is gone: its requests are answered as a server would, at 200
                answers = [jsonrpc_error(i, CHILD_EXITED, str(exc)) for i in ids]
                if not answers:
                    return web.Response(status=502, text=str(exc))
                return web.Response(body=line_of(answers if isinstance(value, list) else answers[0]),
                                    content_type="application/json")
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

    async def listen(self, request: web.Request) -> web.StreamResponse:
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

    async def end_session(self, request: web.Request) -> web.StreamResponse:
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
        self.session: aiohttp.ClientSession | None = None
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
        async with aiohttp.ClientSession(timeout=timeout, trust_env=False, auto_decompress=False,
                                         read_bufsize=LINE_LIMIT) as session:  # a listen event is one line
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
        assert self.session is not None
        try:
            async with self.session.post(self.url, data=line, proxy=self.proxy, headers=self.headers(**{
                    "Content-Type": "application/json", "Accept": "application/json, text/event-stream"})) as resp:
                body = await resp.read()
                answers = self._answers(resp, body, ids)
        except aiohttp.ClientConnectorError as exc:  # the sidecar is not there: nothing left
            for i in ids:
                await self.to_host(jsonrpc_error(i, CUT, f"the sidecar cannot be reached, so nothing was sent ({exc})",
                                                 {"code": SIDECAR_FAILED}))
            return
        except (aiohttp.ClientError, OSError) as exc:
            # The request left and no complete answer came back (the sidecar cut it, or the sidecar went away).
            ids = [i for i in ids if id_key(i) not in self.cancelled]
            if ids:
                await self._cut(ids, exc)
            return
        if ids and all(id_key(i) in self.cancelled for i in ids):
            self.cancelled.difference_update(id_key(i) for i in ids)
            return  # the host gave up on it: its answer (the endpoint's, or the server's) is nobody's
        if not ids:  # notifications and the host's own answers get none back, refused or not
            if resp.status >= 300:
                say(f"a message from the host was refused ({resp.headers.get('Tether-Error') or resp.status}); "
                    "it did not reach the server")
            return
        for answer in answers:
            await self.to_host(answer)
        if answers:
            self.answered.set()

    def _note_cancelled(self, value: Any) -> None:
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and item.get("method") == "notifications/cancelled":
                params = item.get("params")
                if isinstance(params, dict) and "requestId" in params:
                    if len(self.cancelled) > 10_000:  # ids whose answer never came back: forget the oldest guesses
                        self.cancelled.clear()
                    self.cancelled.add(id_key(params["requestId"]))

    @staticmethod
    def _answers(resp: aiohttp.ClientResponse, body: bytes, ids: list[Any]) -> list[Any]:
        """The lines the host gets for one POST: the JSON-RPC answer as the sidecar relayed it (each SSE event's,
        should an answer come as a stream), or, when the answer is not JSON-RPC (a refusal of something else), a
        JSON-RPC error per request saying why. Nothing for a notification that was accepted."""
        if "text/event-stream" in resp.headers.get("Content-Type", ""):
            texts = [b"\n".join(line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:"))
                     for event in body.replace(b"\r\n", b"\n").split(b"\n\n")]
        else:
            texts = [body.strip()]
        values: list[Any] = []
        for text in (t for t in texts if t.strip()):
            try:
                values.append(json.loads(text))
            except ValueError:
                values = []
                break
        items = [m for v in values for m in (v if isinstance(v, list) else [v])]
        if items and all(isinstance(m, dict) and m.get("jsonrpc") == "2.0" for m in items):
            return values
        if not ids:
            return []
        value = values[0] if len(values) == 1 else None
        error = value.get("error") if isinstance(value, dict) and isinstance(value.get("error"), dict) else {}
        code = resp.headers.get("Tether-Error") or error.get("code") or f"http_{resp.status}"
        message = error.get("message") or f"the sidecar answered HTTP {resp.status}"
        return [jsonrpc_error(i, CUT, message, {**error, "code": code}) for i in ids]

    async def _cut(self, ids: list[Any], exc: BaseException) -> None:
        message = ("tether cut this call before its answer came back (an abort, a drain past its window, or the "
                   f"call timeout); whether the server acted on it is unknown ({exc or type(exc).__name__})")
        for i in ids:
            await self.to_host(jsonrpc_error(i, CUT, message, {"code": ABORTED}))

    async def listen(self) -> None:
        """The GET listen stream through the sidecar, reopened whenever it ends (backing off while refused)."""
        import aiohttp

        await self.answered.wait()
        assert self.session is not None
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
            except (aiohttp.ClientError, OSError, ValueError):  # ValueError: a line past LINE_LIMIT
                pass
            failures += 1
            await asyncio.sleep(min(5.0, 0.25 * 2 ** min(failures, 5)))

    async def _events(self, content: aiohttp.StreamReader) -> None:
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


async def host_pipes() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The host's stdin and stdout as asyncio streams (the MCP session's only channel)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=LINE_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(os.dup(0), "rb", 0))
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                        os.fdopen(os.dup(1), "wb", 0))
    return reader, asyncio.StreamWriter(transport, protocol, None, loop)
