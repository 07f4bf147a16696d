"""The sidecar's only line to the control plane: its async transport, signed requests over ``proxy/http1.py``.

Every request carries a fresh ``Tether-Proof`` signed with the chain's key, so the control plane knows
which agent speaks and no agent can read another's commands or forge its reports. How a request is signed and
encoded and how an answer or a refusal is read is the client core's (``tether/capability/transport.py``, shared
with the CLI's transport); this module moves the bytes (``proxy/http1.py``: HTTP/1.1 on asyncio streams and h11,
keep-alive, never through a proxy) and follows the event stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from collections.abc import AsyncIterator, Sequence
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tether.capability import protocol, transport
from tether.capability.errors import CONTROLPLANE_UNREACHABLE as UNREACHABLE
from tether.capability.errors import ApiError

from . import http1

COMPRESS_ABOVE = 16 * 1024  # bytes of a request body above which it is sent gzip-compressed
MAX_LINE = http1.MAX_BODY  # bytes of one document of the event stream: a longer one breaks the stream


class ControlChannel:
    def __init__(self, url: str, agent: str, link: str, key: Ed25519PrivateKey, run: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.agent = agent
        self.link = link
        self.key = key
        self.run = run  # this sidecar start's run id, signed into every request
        self._session: http1.Client | None = None

    @property
    def session(self) -> http1.Client:
        if self._session is None or self._session.closed:
            # http1 never sends through a proxy: the sidecar's own traffic must not go through one.
            self._session = http1.Client(limit=16)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def call(self, method: str, path: str, body: Any = None, *, timeout: float = 10.0,
                   signed: bool = True, encoded: bytes | None = None) -> Any:
        """``body`` is JSON-encoded here, unless the caller already has its bytes (``encoded``). Report batches
        are repetitive JSON: past ``COMPRESS_ABOVE`` they are sent compressed, so they cross a slow or narrow
        link several times faster (an acknowledgement that must carry a drain's worth of refusals most of all)."""
        request = transport.prepare(self.url, method, path, body, encoded=encoded,
                                    signer=self.signer if signed else None, compress_above=COMPRESS_ABOVE)
        try:
            resp = await self.session.request(method, request.url, body=request.body or None,
                                              headers=request.headers, timeout=timeout)
        except (TimeoutError, OSError) as exc:  # http1.ClientError is an OSError
            raise transport.unreachable(self.url, why(exc)) from None
        return transport.read_answer(resp.status, resp.body, resp.content_type, f"{method} {self.url}{path}")

    @property
    def signer(self) -> transport.Signer:
        return transport.Signer(self.agent, self.link, self.key, self.run)

    def _headers(self, method: str, path: str, data: bytes) -> dict[str, str]:
        return transport.prepare(self.url, method, path, encoded=data, signer=self.signer).headers

    async def stream_events(self, after: int, idle_s: float = 35.0) -> AsyncIterator[dict[str, Any]]:
        """Follow ``GET /v1/events/stream``: yields the long poll's documents, one per line, until the
        control plane ends the stream. Silence longer than ``idle_s`` (three missed keepalives) counts as a
        lost connection, as does anything else that breaks it: ApiError tether.controlplane_unreachable."""
        path = f"/v1/events/stream?after={after}"
        try:
            async with self.session.stream("GET", self.url + path, headers=self._headers("GET", path, b""),
                                           connect_timeout=10.0, read_timeout=idle_s) as resp:
                if resp.status >= 400:
                    transport.read_answer(resp.status, await resp.read(), None, f"GET {self.url}{path}")
                buffer = b""
                async for chunk in resp.chunks():  # lines may be longer than any reader limit
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    if len(buffer) > MAX_LINE:
                        raise ValueError(f"a line of the stream is over {MAX_LINE} bytes")
                    for line in lines:
                        if line.strip():
                            yield json.loads(line)
        except (TimeoutError, OSError, ValueError) as exc:
            raise ApiError(503, UNREACHABLE, f"event stream from {self.url} broken: {why(exc)}") from None

    # -- the calls a sidecar makes -------------------------------------------------------------------
    async def register(self, wire: str) -> protocol.Registered:
        """Register the run's chain; a malformed answer is refused like an unreachable control plane (start-up
        tries again, and never serves on an answer it could not read)."""
        answer = await self.call("POST", protocol.REGISTER, protocol.Register(wire).to_doc())
        try:
            return protocol.Registered.read(answer)
        except ApiError as exc:
            raise ApiError(503, UNREACHABLE, f"the control plane's registration answer: {exc.message}") from None

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
        lines, written as ``protocol.ReportBatch`` by its fast path): nothing is encoded twice."""
        return await self.call("POST", protocol.REPORTS, encoded=protocol.ReportBatch.encoded(lines, starts))

    async def ask_approval(self, doc: dict[str, Any]) -> Any:
        return await self.call("POST", protocol.APPROVALS, doc)

    async def quiesced(self, ack: protocol.Quiesced) -> Any:
        return await self.call("POST", protocol.QUIESCED, ack.to_doc(), timeout=15.0)

    async def public(self, path: str) -> Any:
        return await self.call("GET", path, signed=False)


async def sleep_backoff(attempt: int, cap: float = 2.0) -> None:
    """Wait before another try (``transport.backoff_s``: exponential, with jitter)."""
    await asyncio.sleep(transport.backoff_s(attempt, cap))


def why(exc: BaseException) -> str:
    """A failed request in a few words (``connection refused``, ``timed out``), not the exception's repr."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ssl.SSLError):  # its errno is OpenSSL's, not the system's
        return f"TLS: {exc.verify_message if isinstance(exc, ssl.SSLCertVerificationError) else exc.reason or exc}"
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno).lower()
    return str(exc) or type(exc).__name__
