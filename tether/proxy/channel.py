"""The sidecar's only line to the control plane: signed requests over aiohttp.

Every request carries a fresh ``Tether-Proof`` signed with the chain's key, so the control plane knows
which agent speaks and no agent can read another's commands or forge its reports.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tether.capability import protocol
from tether.capability.errors import CONTROLPLANE_UNREACHABLE as UNREACHABLE
from tether.capability.errors import ApiError
from tether.capability.proof import make_proof

COMPRESS_ABOVE = 16 * 1024  # bytes of a request body above which it is sent gzip-compressed


class ControlChannel:
    def __init__(self, url: str, agent: str, link: str, key: Ed25519PrivateKey, run: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.agent = agent
        self.link = link
        self.key = key
        self.run = run  # this sidecar start's run id, signed into every request
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # trust_env stays False: the sidecar must never send its own traffic through a proxy.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def call(self, method: str, path: str, body: Any = None, *, timeout: float = 10.0,
                   signed: bool = True, encoded: bytes | None = None) -> Any:
        """``body`` is JSON-encoded here, unless the caller already has its bytes (``encoded``)."""
        data = encoded if encoded is not None else b"" if body is None else json.dumps(body).encode()
        headers = self._headers(method, path, data) if signed else {"Content-Type": "application/json"}
        sent = data
        if len(data) > COMPRESS_ABOVE:
            # Report batches are repetitive JSON: compressed they cross a slow or narrow link several times
            # faster (an acknowledgement that must carry a drain's worth of refusals most of all). The proof
            # signs the body as the control plane reads it, decompressed.
            sent = gzip.compress(data, compresslevel=1)
            headers = {**headers, "Content-Encoding": "gzip"}
        try:
            async with self.session.request(method, self.url + path, data=sent or None, headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise ApiError(503, UNREACHABLE, f"control plane {self.url} unreachable: {why(exc)}") from None
        try:
            doc = json.loads(raw) if raw else None
        except ValueError:
            raise ApiError(status, "tether.bad_response", f"{method} {path}: not JSON (HTTP {status})") from None
        if status >= 400:
            raise _refusal(status, doc, f"{method} {self.url}{path}")
        return doc

    def _headers(self, method: str, path: str, data: bytes) -> dict[str, str]:
        proof = make_proof(self.key, agent=self.agent, method=method, path=path, body=data, now=time.time(),
                           link=self.link, run=self.run)
        return {"Content-Type": "application/json", protocol.PROOF_HEADER: proof}

    async def stream_events(self, after: int, idle_s: float = 35.0) -> AsyncIterator[dict[str, Any]]:
        """Follow ``GET /v1/events/stream``: yields the long poll's documents, one per line, until the
        control plane ends the stream. Silence longer than ``idle_s`` (three missed keepalives) counts as a
        lost connection, as does anything else that breaks it: ApiError tether.controlplane_unreachable."""
        path = f"/v1/events/stream?after={after}"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=idle_s)
        try:
            async with self.session.get(self.url + path, headers=self._headers("GET", path, b""),
                                        timeout=timeout) as resp:
                if resp.status >= 400:
                    raw = await resp.read()
                    try:
                        doc = json.loads(raw) if raw else None
                    except ValueError:
                        doc = None
                    raise _refusal(resp.status, doc, f"GET {self.url}{path}")
                buffer = b""
                async for chunk in resp.content.iter_any():  # lines may be longer than any reader limit
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield json.loads(line)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            raise ApiError(503, UNREACHABLE, f"event stream from {self.url} broken: {exc!r}") from None

    # -- the calls a sidecar makes -------------------------------------------------------------------
    async def register(self, wire: str) -> Any:
        return await self.call("POST", protocol.REGISTER, {"chain": wire})

    async def heartbeat(self, beat: protocol.Heartbeat) -> protocol.Lease:
        """Renew the lease; a malformed answer is refused like an unreachable control plane (nothing renewed)."""
        answer = await self.call("POST", protocol.HEARTBEAT, beat.to_doc(), timeout=5.0)
        try:
            return protocol.Lease.read(answer)
        except ApiError as exc:
            raise ApiError(503, UNREACHABLE, f"the control plane's heartbeat answer: {exc.message}") from None

    async def events(self, after: int, wait: float) -> Any:
        return await self.call("GET", f"{protocol.EVENTS}?after={after}&wait={wait:g}", timeout=wait + 10.0)

    async def reports(self, lines: list[str], starts: Sequence[str] = ()) -> Any:
        """Deliver reports (and the starts of calls in flight) given as their JSON encodings (the spool's
        lines): nothing is encoded twice."""
        more = f',"starts":[{",".join(starts)}]' if starts else ""
        return await self.call("POST", protocol.REPORTS, encoded=f'{{"reports":[{",".join(lines)}]{more}}}'.encode())

    async def ask_approval(self, doc: dict[str, Any]) -> Any:
        return await self.call("POST", protocol.APPROVALS, doc)

    async def quiesced(self, ack: protocol.Quiesced) -> Any:
        return await self.call("POST", protocol.QUIESCED, ack.to_doc(), timeout=15.0)

    async def public(self, path: str) -> Any:
        return await self.call("GET", path, signed=False)


def _refusal(status: int, doc: Any, what: str) -> ApiError:
    err = (doc or {}).get("error", {}) if isinstance(doc, dict) else {}
    if not isinstance(err, dict) or "code" not in err:  # not a tether answer: say where it came from
        return ApiError(status, "tether.http_error", f"{what}: HTTP {status}, not a tether control plane's answer "
                        "(is the URL right?)")
    return ApiError(status, err["code"], err.get("message", f"HTTP {status}"))


async def sleep_backoff(attempt: int, cap: float = 2.0) -> None:
    """Exponential, with jitter: a fleet that lost its replica at once must not come back at once."""
    await asyncio.sleep(min(cap, 0.1 * 2 ** min(attempt, 6)) * random.uniform(0.5, 1.0))


def why(exc: BaseException) -> str:
    """A failed request in a few words (``connection refused``, ``timed out``), not the exception's repr."""
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return "timed out"
    cause = getattr(exc, "os_error", None) or exc
    if isinstance(cause, OSError) and cause.errno:
        return os.strerror(cause.errno).lower()
    return str(exc) or type(exc).__name__
