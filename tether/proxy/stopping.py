"""The async edge of ``proxy.quiesce``: carries out its actions on the sidecar's parts and feeds the events back.

A termination's command reaches ``Termination.on_command`` (from the heartbeat or the event stream); a drain is
then driven by one task, woken when a call finishes (the sidecar's ``resolved`` listeners) or at the machine's
``wake_at``, never by polling. Handing budget back and acknowledging are the only awaited actions: the machine
orders them (every termination that reached the sidecar is acknowledged, one after another, each once).
``drain`` runs the same ``Drain`` for the sidecar's own stop (``Sidecar.stop``); ``finish`` then carries out the
stop's tail, the pure machine of ``proxy.stoptail``, one action at a time, each by its carrier in
``STOP_CARRIERS`` within the action's own time limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mitmproxy import http

from tether.capability import protocol
from tether.capability.errors import ApiError

from .approvals import Approvals
from .capture import CaptureWriter
from .channel import ControlChannel, sleep_backoff
from .cutting import Cutter
from .loops import ControlLoops
from .quiesce import (
    Acknowledge,
    Action,
    CancelHeld,
    Cut,
    Drain,
    MarkQuiesced,
    Quiesce,
    Release,
    Stamp,
    Sweep,
    View,
)
from .reporting import Reporter
from .state import DRAINING, TERMINATED, Call, CallTable, SidecarState
from .stoptail import (
    CloseConnections,
    CloseEnclosure,
    CloseFiles,
    CloseSessions,
    Farewell,
    Join,
    Pause,
    ReleaseBudget,
    ShutDown,
    StopListening,
    Stopped,
    StopTail,
    SweepLeft,
    TailAction,
)

if TYPE_CHECKING:
    from .budget import Budgets
    from .startup import Proxy  # builds the pipeline: the addons are not this module's to load

log = logging.getLogger("tether.sidecar")


def obeyed(doc: Any) -> dict[str, Any]:
    """A termination command as this run obeys it (``protocol.command_from``): its fields as given, or, when it
    cannot be read, an abort of the termination it names (a command is only ever sent to stop the run: guessing
    a window would be failing open)."""
    command, problem = protocol.command_from(doc)
    if problem:
        log.error("a termination command that cannot be read (%s): aborting", problem)
    return command.as_given()


# Reports per request when an acknowledgement delivers what was pending (sent compressed): on a slow link each
# request costs its round trips whatever its size, and a drain's worth of refusals must not outlast the grace.
ACK_BATCH = 5000
SAFETY_TICK_S = 0.5  # a drain looks at the table at least this often, whether or not a call's end woke it

Resolve = Callable[..., None]  # Sidecar.resolve: (call, resolution, *, status, code, detail)


class Edge:
    """What the machines' actions act on, and how a drain waits: for a call's end or its next wake-up time."""

    def __init__(self, calls: CallTable[http.HTTPFlow], approvals: Approvals, cutter: Cutter, resolve: Resolve,
                 state: Callable[[], SidecarState]) -> None:
        self.calls, self.approvals, self.cutter, self.resolve, self.state = calls, approvals, cutter, resolve, state
        self._changed = asyncio.Event()

    def call_ended(self, _call: Call) -> None:
        """A ``resolved`` listener: a drain waiting on the table looks again."""
        self._changed.set()

    def wake(self) -> None:
        self._changed.set()

    def view(self) -> View:
        """The table now; a call that ends from here on wakes the next ``until``."""
        self._changed.clear()
        calls = self.calls
        return View(leaving=frozenset(c.call_id for c in calls.leaving()), inflight=frozenset(calls.inflight),
                    unsent_on_flow=calls.unsent_with_flow())

    async def until(self, wake_at: float | None) -> None:
        """Sleep until ``wake_at`` (monotonic), a call's end or a new command since the last ``view``, whichever
        comes first."""
        timeout = SAFETY_TICK_S if wake_at is None else min(SAFETY_TICK_S, max(0.0, wake_at - time.monotonic()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    def do(self, action: Action, cut_message: str) -> None:
        """Carry out one of the actions that need no waiting."""
        if isinstance(action, CancelHeld):
            self.approvals.cancel_held()
        elif isinstance(action, Stamp):
            for call in self.calls.inflight.values():
                call.termination_id = action.termination_id
        elif isinstance(action, Cut):
            log.warning(cut_message, len(action.call_ids))
            for call_id in action.call_ids:
                flow = self.calls.flow_of(call_id)
                if flow is not None:
                    self.cutter.abort(flow)
        elif isinstance(action, Sweep):
            self.sweep(action.detail)
        elif isinstance(action, MarkQuiesced):
            self.state().quiesced()
        else:
            raise TypeError(f"{type(action).__name__} is not carried out here")

    def sweep(self, detail: str) -> None:
        """Resolve every call still in flight, saying only what is known: it left (unknown) or it did not."""
        for call in list(self.calls.inflight.values()):
            self.resolve(call, "unknown" if call.left else "cancelled_not_sent", detail=detail)

    async def drain(self, drain: Drain, begun: Iterable[Action], cut_message: str) -> None:
        """Run a drain to its end (a stop's; a termination's runs inside ``Termination``)."""
        for action in begun:
            self.do(action, cut_message)
        while True:
            for action in drain.tick(time.monotonic(), self.view()):
                self.do(action, cut_message)
            if drain.drained:
                return
            await self.until(drain.wake_at)


class Termination:
    """The sidecar's half of a termination: drain or abort, then report, hand budget back and acknowledge."""

    def __init__(self, edge: Edge, channel: ControlChannel, reporter: Reporter,
                 release: Callable[[], Awaitable[None]], spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self.edge, self.channel, self.reporter, self.release, self.spawn = edge, channel, reporter, release, spawn
        self.machine = Quiesce()
        self._driver: asyncio.Task[None] | None = None

    def on_command(self, command: dict[str, Any]) -> None:
        state = self.edge.state()
        before = state.mode
        mode = state.commanded(command)  # a terminated state takes no command: it stays terminated
        if mode != before:
            log.warning("control plane commands %s (termination %s)", mode, command.get("termination_id"))
        actions = self.machine.command(command, mode_changed=mode != before,
                                       draining=mode == DRAINING, now=time.monotonic(), wall=time.time())
        for action in actions:
            if isinstance(action, Acknowledge):  # quiesced already: answered at once, beside anything under way
                self.spawn(self._acknowledge_alone(action))
            else:
                self.edge.do(action, "aborting %d call(s) still in flight")
        if self.machine.draining:
            if self._driver is None or self._driver.done():
                self._driver = asyncio.get_running_loop().create_task(self._drive())
            self.edge.wake()

    async def _drive(self) -> None:
        pending: list[Action] = []
        while self.machine.draining:
            pending += self.machine.tick(time.monotonic(), self.edge.view())
            while pending and not isinstance(pending[0], Release | Acknowledge):
                self.edge.do(pending.pop(0), "aborting %d call(s) still in flight")
            if self.machine.draining:
                await self.edge.until(self.machine.wake_at)
        while pending:
            action = pending.pop(0)
            if isinstance(action, Release):
                with contextlib.suppress(Exception):  # nothing more is forwarded: hand unused budget back
                    await asyncio.wait_for(self.release(), action.timeout_s)
                pending += self.machine.released()
            elif isinstance(action, Acknowledge):
                await self.acknowledge(action.command)
                pending += self.machine.acked_one(action.termination_id)
            else:
                self.edge.do(action, "aborting %d call(s) still in flight")

    async def _acknowledge_alone(self, action: Acknowledge) -> None:
        await self.acknowledge(action.command)
        self.machine.acked_one(action.termination_id)  # not one the queue holds: nothing follows it

    async def acknowledge(self, command: dict[str, Any] | Any) -> None:
        """Deliver every report, then tell the control plane this sidecar is quiescent (retrying).

        Every report: every one queued when the acknowledgement began. A call refused meanwhile (an agent
        that keeps calling) is reported after it, or an agent calling fast enough on a slow link would keep
        the acknowledgement from ever being sent."""
        tid = command.get("termination_id")
        mark = self.reporter.mark()
        attempt = 0
        while True:
            try:
                await self.reporter.flush(mark, batch=ACK_BATCH)
                await self.channel.quiesced(protocol.Quiesced(
                    termination_id=tid, reports=self.reporter.pending_until(mark),
                    calls=dict(self.edge.calls.counts), state=TERMINATED))
                log.warning("quiesced and acknowledged termination %s; refusing everything from now on", tid)
                return
            except ApiError as exc:
                attempt += 1
                if attempt == 1:
                    log.warning("cannot acknowledge termination %s yet: %s", tid, exc.message)
                await sleep_backoff(attempt)


@dataclass(frozen=True)
class StopParts:
    """What a stop's tail acts on (``Sidecar.stop`` gives its own)."""

    proxy: Proxy | None
    cutter: Cutter
    tasks: list[asyncio.Task[Any]]
    edge: Edge
    budgets: Budgets
    reporter: Reporter
    channel: ControlChannel
    loops: ControlLoops
    state: SidecarState | None
    close_sessions: Callable[[], Awaitable[None]]
    capture: CaptureWriter
    lock: Any  # the state dir's lock file (``reporting.lock_state_dir``)
    stopped: asyncio.Event


async def _stop_listening(parts: StopParts, _: StopListening) -> None:
    assert parts.proxy is not None
    await parts.proxy.server.servers.update([])


async def _close_enclosure(parts: StopParts, _: CloseEnclosure) -> None:
    assert parts.proxy is not None and parts.proxy.enclosure is not None
    parts.proxy.enclosure[0].close()


async def _close_connections(parts: StopParts, _: CloseConnections) -> bool:
    """Close what is open while the addons still run: every call on a connection meets its end, and its report,
    before the last delivery, none after it."""
    return parts.cutter.close_connections()


async def _pause(_: StopParts, action: Pause) -> None:
    await asyncio.sleep(action.seconds)  # the closed connections' last hooks resolve (and report) their calls


async def _shut_down(parts: StopParts, _: ShutDown) -> None:
    assert parts.proxy is not None
    parts.proxy.master.shutdown()


async def _join(parts: StopParts, _: Join) -> None:
    for task in parts.tasks:
        task.cancel()
    await asyncio.gather(*parts.tasks, *([parts.proxy.task] if parts.proxy else []), return_exceptions=True)


async def _sweep(parts: StopParts, action: SweepLeft) -> None:
    parts.edge.sweep(action.detail)


async def _release(parts: StopParts, _: ReleaseBudget) -> None:
    await parts.budgets.release()  # what is not returned counts as spent


async def _farewell(parts: StopParts, _: Farewell) -> None:
    await farewell(parts.reporter, parts.channel, parts.loops, parts.state)


async def _close_sessions(parts: StopParts, _: CloseSessions) -> None:
    await parts.close_sessions()


async def _close_files(parts: StopParts, _: CloseFiles) -> None:
    proxy = parts.proxy
    if proxy is not None and proxy.dns is not None:
        proxy.dns.close()
    if proxy is not None and proxy.enclosure is not None:
        proxy.enclosure[1].close()
    parts.capture.close()
    parts.lock.close()


async def _stopped(parts: StopParts, _: Stopped) -> None:
    parts.stopped.set()


# One carrier per action of the tail (tests/test_stop_tail.py checks the table has exactly the machine's actions).
STOP_CARRIERS: Mapping[type, Callable[[StopParts, Any], Awaitable[bool | None]]] = {
    StopListening: _stop_listening, CloseEnclosure: _close_enclosure, CloseConnections: _close_connections,
    Pause: _pause, ShutDown: _shut_down, Join: _join, SweepLeft: _sweep, ReleaseBudget: _release,
    Farewell: _farewell, CloseSessions: _close_sessions, CloseFiles: _close_files, Stopped: _stopped,
}


async def carry(parts: StopParts, action: TailAction,
                carriers: Mapping[type, Callable[[StopParts, Any], Awaitable[bool | None]]] = STOP_CARRIERS,
                ) -> bool | None:
    """One action, within its time limit; a tolerant action's failure (or timeout) is swallowed."""
    job: Awaitable[bool | None] = carriers[type(action)](parts, action)
    if action.timeout_s is not None:
        job = asyncio.wait_for(job, action.timeout_s)
    if not action.tolerant:
        return await job
    with contextlib.suppress(Exception):
        return await job
    return None


async def finish(parts: StopParts,
                 carriers: Mapping[type, Callable[[StopParts, Any], Awaitable[bool | None]]] = STOP_CARRIERS) -> None:
    """Run a stop's tail (``proxy.stoptail``) to its end."""
    proxy = parts.proxy
    tail = StopTail(proxy=proxy is not None, enclosed=proxy is not None and proxy.enclosure is not None)
    action: TailAction | None = tail.begin()
    while action is not None:
        closed = await carry(parts, action, carriers)
        action = tail.done(closed=bool(closed))


async def farewell(reporter: Reporter, channel: ControlChannel, loops: ControlLoops,
                   state: SidecarState | None) -> None:
    """Final reports, then a last heartbeat saying the proxy is gone: nothing more can pass through it."""
    if not await reporter.flush():
        log.warning("reports could not be delivered; not telling the control plane we stopped "
                    "(they stay in %s)", reporter.spool_path)
        return
    if state is not None and state.registered and state.mode != TERMINATED:
        await channel.heartbeat(protocol.Heartbeat(
            state=protocol.STOPPED, seq=loops.seq, pid=os.getpid(), started_at=loops.started_at,
            spooled=reporter.count))


async def retire(reporter: Reporter, channel: ControlChannel, loops: ControlLoops, capture: CaptureWriter,
                 acknowledge: Callable[[dict[str, Any]], Awaitable[None]]) -> str:
    """This run may never serve (its chain was revoked or expired, or its agent terminated, before it started):
    deliver what the spool holds, acknowledge a standing termination of this link (late: the record gets an
    addendum) or say goodbye; returns what it did. Nothing is forwarded: the proxy never listens."""
    attempt = 0
    while not await reporter.flush():
        attempt += 1
        if attempt == 1:
            log.warning("retiring: waiting to deliver %d spooled report(s)", reporter.count)
        await sleep_backoff(attempt)
    lease = await channel.heartbeat(protocol.Heartbeat(
        state=protocol.RETIRING, pid=os.getpid(), started_at=loops.started_at, supersedes=loops.supersedes or None,
        spooled=reporter.count))
    command = lease.command
    if command and command.get("termination_id"):
        capture.hold(command["termination_id"], command.get("window_s"))
        await acknowledge(command)
        return f"acknowledged termination {command['termination_id']}"
    await channel.heartbeat(protocol.Heartbeat(
        state=protocol.STOPPED, pid=os.getpid(), started_at=loops.started_at, spooled=reporter.count))
    return "told the control plane it stopped"
