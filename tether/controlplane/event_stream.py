"""The streaming event channel (``GET /v1/events/stream``): one long-lived response per sidecar.

One follower task per replica reads the shared event log once per append (woken by this replica's own
publishes and, over Redis, by every other replica's through pub/sub), encodes each event once, and hands
the same bytes to exactly the subscribers that may see it, found by index: a revocation by its jti
(jti -> subscribers whose chain holds it), a command or an approval decision by its target link (link hash
-> subscribers). No subscriber ever looks at an event that is not its own, so an event costs O(1) per
subscriber that sees it and nothing for the others.

Wire: newline-delimited JSON (``application/x-ndjson``) over one chunked HTTP/1.1 response. Every line
is a document of the long poll's shape, so one client function reads both: ``{"events": [E], "next":
SEQ}`` for an event, ``{"events": [], "next": SEQ}`` for the opening line and a keepalive every
``KEEPALIVE_S`` (which also moves the client's cursor past events it does not see), or the long poll's
resync document when the client asked from a sequence the log no longer holds. JSON lines rather than
server-sent events: the only client is the sidecar, which signs every request (so a browser's
EventSource, SSE's reason to exist, could not connect anyway), and a line is the long poll's document
unchanged, with no second framing to parse.

Resumption: the client reconnects with ``after=SEQ`` (the ``next`` of the last line it read). What lies
between ``SEQ`` and the follower's position is read from the store for that client alone; from then on it
is served from the shared fan-out. A client that reads too slowly (more than ``MAX_BUFFER`` bytes waiting
in its socket's buffer) is disconnected and resumes the same way, so one stuck sidecar never holds the
others' memory.

Once a stream's opening line is out, the fan-out writes to its socket directly: the event's line is
framed as an HTTP/1.1 chunk once, and that one buffer is handed to each subscriber's transport, with no
task switch and no coroutine per subscriber (the handler only waits for the end, and writes keepalives).
The first write goes through aiohttp (which sends the headers with it), so the bytes on the wire are
always: headers, then whole chunks, then aiohttp's closing chunk when the handler returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tether.capability.events import REVOKE

from .store import Event, Store, StoreUnavailable

log = logging.getLogger("tether.controlplane.events")

KEEPALIVE_S = 10.0
MAX_PENDING = 1_000  # lines queued while a stream's opening is being written
MAX_BUFFER = 1 << 20  # bytes waiting in a subscriber's socket buffer before it is cut loose
READ_BATCH = 500
RETRY_S = 0.5


def encode(doc: object) -> bytes:
    return (json.dumps(doc, separators=(",", ":")) + "\n").encode()


def chunk(line: bytes) -> bytes:
    """One HTTP/1.1 chunk (the response is chunked, as aiohttp frames a response of unknown length)."""
    return b"%x\r\n%b\r\n" % (len(line), line)


def visible(event: Event, link_hash: str, chain_jtis: frozenset[str] | set[str]) -> bool:
    """A sidecar sees revocations of its own chain's links and events addressed to its link only (commands
    and approval decisions belong to a link, never to a bare agent id)."""
    if event.kind == REVOKE:
        return event.payload.get("jti") in chain_jtis
    return event.target == link_hash


@dataclass(eq=False)
class Subscriber:
    """One open stream: what its sidecar may see, and where its events go: queued (``pending``, as encoded
    lines) until its opening line is written, then straight to its socket (``transport``)."""

    link_hash: str
    jtis: frozenset[str]
    pending: list[tuple[int, bytes]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    closed: str | None = None  # why the stream must end (overflow, shutdown, the follower lost its place)
    transport: asyncio.Transport | None = None
    sent: int = 0  # the last sequence number written to the socket

    def push(self, seq: int, line: bytes, framed: bytes) -> None:
        transport = self.transport
        if transport is None:
            if len(self.pending) >= MAX_PENDING:
                self.close("overflow")
            else:
                self.pending.append((seq, line))
                self.wake.set()
            return
        if seq <= self.sent:
            return
        if transport.is_closing():
            self.close("gone")
        elif transport.get_write_buffer_size() > MAX_BUFFER:
            self.close("overflow")
        else:
            transport.write(framed)
            self.sent = seq

    def attach(self, transport: asyncio.Transport, sent: int) -> None:
        """From now on events go to the socket directly (called once ``pending`` is written and empty)."""
        self.sent = sent
        self.transport = transport

    def close(self, why: str) -> None:
        if self.closed is None:
            self.closed = why
        self.wake.set()


class EventHub:
    """The replica's one follower of the event log and its subscriber indexes."""

    def __init__(self, store: Store, signal: Callable[[], asyncio.Event],
                 wait: Callable[[int, float, asyncio.Event], Awaitable[None]],
                 count: Callable[[str, float], None]) -> None:
        self.store = store
        self._signal = signal  # this replica's publish signal, taken before each read
        self._wait = wait  # returns on a publish here, an append anywhere (Redis), or the timeout
        self._count = count
        self.by_link: dict[str, set[Subscriber]] = {}
        self.by_jti: dict[str, set[Subscriber]] = {}
        self.position = 0  # every event up to here has been handed to the subscribers that see it
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    @property
    def open_streams(self) -> int:
        return sum(len(subs) for subs in self.by_link.values())

    async def subscribe(self, link_hash: str, jtis: frozenset[str]) -> Subscriber:
        """Register a subscriber; from the follower's ``position`` on, its events are queued for it."""
        if self._task is None or self._task.done():
            self._ready.clear()
            self._task = asyncio.create_task(self._follow(), name="tether-event-hub")
        await self._ready.wait()
        sub = Subscriber(link_hash, jtis)
        self.by_link.setdefault(link_hash, set()).add(sub)
        for jti in jtis:
            self.by_jti.setdefault(jti, set()).add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        for index, key in ((self.by_link, sub.link_hash), *((self.by_jti, jti) for jti in sub.jtis)):
            subs = index.get(key)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del index[key]

    async def close(self) -> None:
        for subs in list(self.by_link.values()):
            for sub in subs:
                sub.close("shutdown")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def dispatch(self, event: Event) -> None:
        subs = self.by_jti.get(event.payload.get("jti", "")) if event.kind == REVOKE else (
            self.by_link.get(event.target or ""))
        if not subs:
            return
        line = encode({"events": [event.to_dict()], "next": event.seq})  # once, for every subscriber
        framed = chunk(line)
        for sub in list(subs):  # a subscriber cut loose here leaves the index when its handler returns
            sub.push(event.seq, line, framed)
        self._count("tether_events_delivered_total", len(subs))

    async def _follow(self) -> None:
        while True:
            try:
                _low, self.position = await self.store.event_bounds()
                break
            except (StoreUnavailable, ConnectionError, OSError) as exc:
                log.warning("event stream: cannot read the event log yet: %s", exc)
                await asyncio.sleep(RETRY_S)
        self._ready.set()
        while True:
            signal = self._signal()  # taken before reading, so a publish meanwhile still wakes us
            try:
                events = await self.store.events_after(self.position, READ_BATCH)
                if events and events[0].seq != self.position + 1:
                    low, _high = await self.store.event_bounds()
                    if self.position < low - 1:  # trimmed past us: every subscriber resumes (and resyncs)
                        self._lost_place()
            except (StoreUnavailable, ConnectionError, OSError) as exc:
                log.warning("event stream: reading the event log failed: %s", exc)
                await asyncio.sleep(RETRY_S)
                continue
            for event in events:
                self.dispatch(event)
            if events:
                self.position = events[-1].seq
                continue
            await self._wait(self.position, KEEPALIVE_S, signal)

    def _lost_place(self) -> None:
        log.warning("event stream: the log was trimmed past this replica's position; subscribers resync")
        for subs in list(self.by_link.values()):
            for sub in subs:
                sub.close("resync")
