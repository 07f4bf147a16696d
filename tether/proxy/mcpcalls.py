"""What one sidecar remembers across MCP requests: sessions it saw issued, calls in flight (for cancellation),
cancelled calls a client may re-send, tasks and the calls that created them, and multi-round-trip states.

``McpLedger`` is pure (no flows, no clock: monotonic time passed in) and bounded (each table keeps its newest
``limit`` entries; what is forgotten fails closed: an unknown session or task is refused, an unrecorded round is
held and counted again). ``McpCalls`` is its edge, an addon placed right after the decision (``proxy.enforce``'s
``Enforcer``) and before the hold and the forwarder, so what it refuses never waits for a person, never takes a
budget unit and never leaves:

* a request carrying an ``Mcp-Session-Id`` this sidecar run did not see issued is refused
  (``tether.mcp_session_unknown``, HTTP 404 as a server answers an unknown session), DELETE included;
* a task method (``tasks/get``, ``tasks/result``, ``tasks/update``, ``tasks/cancel``) and a ``subscriptions/listen``
  naming ``taskIds`` are governed as the capability of the call that created each task (a ``tools/call`` answered
  with a task, in the 2025-11-25 or the 2026-07-28 shape, alone or in a batch): a task this sidecar did not see
  created, or whose capability the agent no longer holds, is refused; ``tasks/list`` answers and
  ``notifications/tasks`` show the agent's own tasks only (``proxy.addons.McpFilter``);
* a ``notifications/cancelled`` naming a request still unanswered marks that call ``cancelled``;
* a re-send of a call that ended ``cancelled`` or ``unknown`` (same method, same params but ``_meta``) is a new
  call with ``reissue_of`` the first call's id, and is not charged again against a budget when it uses exactly
  the capabilities the first was charged for (anything else: charged, fail closed);
* a follow-up round of a multi-round-trip (``input_required``) call, carrying the ``requestState`` the server
  gave that call and the same params, is covered by the call's approval and budget unit: not held, not counted.
  Each ``requestState`` covers one follow-up; one tether did not see issued is a new call (held, counted).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mitmproxy import http

from tether.capability import errors as codes

from . import mcp
from .decision import ChainState, Refusal
from .flowstate import FlowState, refuse, state_of
from .framing import no_continue
from .state import Call

LIMIT = 10_000  # entries per table
REISSUE_WINDOW_S = 600.0  # how long after a cancelled call a re-send of it is a re-issue
RESENDABLE = ("cancelled", "unknown")  # a call that left and whose answer the agent never read
ITEM_METHODS = frozenset({"tools/call", "prompts/get", "resources/read"})  # what a re-issue or a round can be
ROUND_FIELDS = ("_meta", "inputResponses", "requestState")  # what a follow-up round adds to the original params


@dataclass(frozen=True, slots=True)
class Origin:
    """A call whose answer the agent never read: a re-send of it is its re-issue."""

    call_id: str  # the first call of the chain of re-sends
    capabilities: tuple[str, ...]  # what it was charged for
    until: float  # monotonic


@dataclass(frozen=True, slots=True)
class Task:
    capability: str
    call_id: str


@dataclass(frozen=True, slots=True)
class Round:
    """The ``requestState`` a server gave in an ``input_required`` answer, and the call it belongs to."""

    fingerprint: str
    capabilities: tuple[str, ...]
    call_id: str


class _Bounded(OrderedDict[Any, Any]):
    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


def fingerprint(method: str, params: Any, drop: tuple[str, ...] = ("_meta",)) -> str:
    """A request as a re-send repeats it: its method and params, without what differs per send."""
    kept = {k: v for k, v in params.items() if k not in drop} if isinstance(params, dict) else params
    return json.dumps([method, kept], sort_keys=True, separators=(",", ":"))


class McpLedger:
    def __init__(self, limit: int = LIMIT, reissue_window_s: float = REISSUE_WINDOW_S) -> None:
        self.window = reissue_window_s
        self.sessions = _Bounded(limit)  # (server, session id) -> True
        self.inflight = _Bounded(limit)  # (server, session, id_key) -> FlowState of the request
        self.pending = _Bounded(limit)  # call id -> (fingerprint, root call id, capabilities)
        self.origins = _Bounded(limit)  # (server, fingerprint) -> Origin
        self.tasks = _Bounded(limit)  # (server, task id) -> Task
        self.rounds = _Bounded(limit)  # (server, requestState) -> Round

    # -- sessions -------------------------------------------------------------------------------------
    def issued(self, server: str, session: str) -> None:
        self.sessions.put((server, session), True)

    def ended(self, server: str, session: str) -> None:
        self.sessions.pop((server, session), None)

    def knows(self, server: str, session: str) -> bool:
        return (server, session) in self.sessions

    # -- cancellation and re-issue ----------------------------------------------------------------------
    def sent(self, key: tuple[str, str | None, str], state: Any) -> None:
        self.inflight.put(key, state)

    def done(self, key: tuple[str, str | None, str], state: Any) -> None:
        if self.inflight.get(key) is state:
            del self.inflight[key]

    def cancelled(self, key: tuple[str, str | None, str]) -> Any:
        """The request a ``notifications/cancelled`` names, if it is still in flight (its state), else None."""
        return self.inflight.get(key)

    def watch(self, call_id: str, server: str, print_: str, root: str, capabilities: tuple[str, ...]) -> None:
        """A call that may end without its answer read: remember how a re-send of it would look."""
        self.pending.put(call_id, ((server, print_), root, capabilities))

    def reissue_of(self, server: str, print_: str, now: float) -> Origin | None:
        """The call a request re-sends, if any (each cancelled call has one re-issue: the next re-send is new)."""
        origin = self.origins.pop((server, print_), None)
        return origin if origin is not None and now <= origin.until else None

    def resolved(self, call_id: str, resolution: str | None, now: float) -> None:
        entry = self.pending.pop(call_id, None)
        if entry is not None and resolution in RESENDABLE:
            key, root, capabilities = entry
            self.origins.put(key, Origin(root, capabilities, now + self.window))

    # -- tasks and rounds ---------------------------------------------------------------------------------
    def created(self, server: str, task_id: str, capability: str, call_id: str) -> None:
        self.tasks.put((server, task_id), Task(capability, call_id))

    def task(self, server: str, task_id: str) -> Task | None:
        return self.tasks.get((server, task_id))

    def needs_input(self, server: str, state: str, round_: Round) -> None:
        self.rounds.put((server, state), round_)

    def follow_up(self, server: str, state: str) -> Round | None:
        return self.rounds.pop((server, state), None)


def _session(flow: http.HTTPFlow) -> str | None:
    return flow.request.headers.get("mcp-session-id")


def _body(flow: http.HTTPFlow) -> Any:
    try:
        return json.loads(flow.request.raw_content or b"")
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


class McpCalls:
    """The ledger's edge: see the module docstring. Refuses with the same answer shapes as the decision."""

    def __init__(self, chain: ChainState, ledger: McpLedger, clock: Callable[[], float] = time.monotonic) -> None:
        self.chain, self.ledger, self.clock = chain, ledger, clock

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        session = _session(flow)
        if flow.response is not None or state.mcp_server is None or session is None:
            return
        if not self.ledger.knows(state.mcp_server, session):
            refusal = Refusal(codes.MCP_SESSION_UNKNOWN, "this MCP session was not opened through this sidecar "
                              "run; start a new session (initialize) through it", reason="mcp_session")
            refusal.http_status = 404  # what a server answers to a session id it does not know
            no_continue(flow)
            refuse(flow, refusal)

    def request(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        parsed, server, call = state.mcp_parsed, state.mcp_server, state.call
        if flow.response is not None or not state.decided or parsed is None or server is None or call is None:
            return
        try:
            refusal = self._govern(flow, state, parsed, server, call)
        except Exception as exc:  # fail closed: what cannot be judged does not leave
            refusal = Refusal(codes.CAPABILITY_ABSENT, f"tether could not decide on this call ({exc!r}); refused")
        if refusal is not None:
            refuse(flow, refusal)

    def _govern(self, flow: http.HTTPFlow, state: FlowState, parsed: mcp.Parsed, server: str,
                call: Call) -> Refusal | None:
        session = _session(flow)
        for message in parsed.messages:
            # A task method names one task; a 2026-07-28 subscriptions/listen may name several (their status
            # notifications carry their results): each must be the agent's own.
            for task_id in (message.task or "",) if message.method in mcp.TASK_METHODS else message.tasks:
                refusal = self._task_method(state, server, call, message.method or "", task_id)
                if refusal is not None:
                    return refusal
        body = None
        for message in parsed.messages:
            if message.method == "notifications/cancelled":
                body = _body(flow) if body is None else body
                self._cancel(server, session, body)
        for message in parsed.messages:
            if message.is_request:
                key = (server, session, mcp.id_key(message.id))
                self.ledger.sent(key, state)
                state.mcp_keys.append(key)
        if not parsed.batch and parsed.messages[0].method in ITEM_METHODS and parsed.messages[0].id is not None:
            self._item_call(state, server, call, _body(flow) if body is None else body)
        return None

    def _task_method(self, state: FlowState, server: str, call: Call, method: str, task_id: str) -> Refusal | None:
        task = self.ledger.task(server, task_id)
        if task is None:
            return Refusal(codes.CAPABILITY_ABSENT, f"task {task_id!r} was not created through this sidecar "
                           "run; an agent reaches only its own tasks", reason="mcp_task")
        if self.chain.tier(task.capability) == "absent":
            return Refusal(codes.CAPABILITY_ABSENT, f"task {task_id!r} belongs to {task.capability}, which is "
                           f"not granted to {self.chain.agent}", capability=task.capability, reason="mcp_task")
        call.capability, call.tier = task.capability, self.chain.tier(task.capability)
        call.detail = f"mcp {method} (task of call {task.call_id})"
        if state.mcp_tools is None:  # governed as the call's capability, counted once: when the call was made
            state.mcp_tools = ()
        return None

    def _cancel(self, server: str, session: str | None, body: Any) -> None:
        for item in body if isinstance(body, list) else [body]:
            params = item.get("params") if isinstance(item, dict) else None
            if not isinstance(params, dict) or item.get("method") != "notifications/cancelled":
                continue
            target = self.ledger.cancelled((server, session, mcp.id_key(params.get("requestId"))))
            if not isinstance(target, FlowState):
                continue
            sse = target.mcp_sse
            if sse is not None and mcp.id_key(params.get("requestId")) in sse.answered:
                continue  # its answer reached the agent before the cancellation did
            target.mcp_cancelled = True

    def _item_call(self, state: FlowState, server: str, call: Call, body: Any) -> None:
        if not isinstance(body, dict):
            return
        method, params = body.get("method"), body.get("params")
        charged = state.mcp_charged = tuple(state.mcp_tools or ())
        print_ = fingerprint(method, params)
        root = call.call_id
        state.mcp_round = fingerprint(method, params, ROUND_FIELDS)
        request_state = params.get("requestState") if isinstance(params, dict) else None
        round_ = self.ledger.follow_up(server, request_state) if isinstance(request_state, str) else None
        if round_ is not None and round_.fingerprint == state.mcp_round and round_.capabilities == charged:
            state.hold = None  # the call's approval covers its rounds
            state.mcp_tools = ()  # and so does its budget unit
            call.detail = f"mcp {method} (input_required round of call {round_.call_id})"
            root = round_.call_id
        else:
            origin = self.ledger.reissue_of(server, print_, self.clock())
            if origin is not None:
                call.reissue_of = root = origin.call_id
                if origin.capabilities == charged:
                    state.mcp_tools = ()  # the first send was charged for exactly this: not again
        self.ledger.watch(call.call_id, server, print_, root, charged)
        state.mcp_root = root

    def response(self, flow: http.HTTPFlow) -> None:
        self._done(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._done(flow)

    def _done(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow)
        for key in state.mcp_keys:
            self.ledger.done(key, state)

    # -- answers (called by McpFilter for every JSON-RPC response it reads) ------------------------------
    def answered(self, flow: http.HTTPFlow, item: dict[str, Any]) -> None:
        state = state_of(flow)
        parsed, server, call = state.mcp_parsed, state.mcp_server, state.call
        result = item.get("result")
        if parsed is None or server is None or call is None or not isinstance(result, dict):
            return
        key = mcp.id_key(item.get("id"))
        message = next((m for m in parsed.messages if m.is_request and mcp.id_key(m.id) == key), None)
        if message is None:
            return
        task_id = mcp.created_task(result) if message.method == "tools/call" else None
        capability = state.mcp_callers.get(key)
        if task_id is not None and capability is not None:
            # Bound to the tools/call that created it (by its id, so a batch's calls each own their tasks).
            root = call.call_id if parsed.batch else state.mcp_root or call.call_id
            self.ledger.created(server, task_id, capability, root)
        request_state = result.get("requestState")
        if (not parsed.batch and message.method in ITEM_METHODS and result.get("resultType") == "input_required"
                and isinstance(request_state, str) and state.mcp_round is not None):
            self.ledger.needs_input(server, request_state, Round(state.mcp_round, state.mcp_charged,
                                                                 state.mcp_root or call.call_id))

    def visible_task(self, server: str) -> Callable[[str], bool]:
        def held(task_id: str) -> bool:
            task = self.ledger.task(server, task_id)
            return task is not None and self.chain.tier(task.capability) != "absent"
        return held

    def on_resolved(self, call: Call) -> None:
        """Told of every call's end (``Sidecar.resolved``): a cancelled or cut call may be re-sent."""
        self.ledger.resolved(call.call_id, call.resolution, self.clock())
