"""The wire protocol between a sidecar run and the control plane, in one place both sides import.

What is here: the paths a sidecar calls, the header names both sides spell, the states a run reports, and the
messages they exchange, each a typed class whose fields are declared once (as dataclass fields with a
:func:`wire` spec). From that one declaration each message gets its reader (:meth:`Message.read`, which checks
a document from the other side and refuses it with ``400 tether.bad_request`` naming the field), its writer
(:meth:`Message.to_doc`) and its JSON Schema for ``/openapi.json`` (:meth:`Message.schema`).

Adding a message is one class here plus its handler on each side: the sidecar builds it and calls
``to_doc()``, the route reads it with ``read()``, and the OpenAPI document names its schema. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from .errors import BAD_REQUEST, ApiError

# -- paths and headers ------------------------------------------------------------------------------------------
REGISTER = "/v1/chains/register"
HEARTBEAT = "/v1/sidecars/heartbeat"
QUIESCED = "/v1/sidecars/quiesced"
EVENTS = "/v1/events"
EVENTS_STREAM = "/v1/events/stream"
REPORTS = "/v1/reports"
APPROVALS = "/v1/approvals"

PROOF_HEADER = "Tether-Proof"  # a sidecar run's signature over the request (tether/capability/proof.py)
ERROR_HEADER = "Tether-Error"  # the code of every refusal, beside the JSON body (contract section 5)
CHAIN_HEADER = "Tether-Chain"  # a chain on the wire: its links, root first, joined by commas

# -- the states a run reports -------------------------------------------------------------------------------------
SERVING, DRAINING, ABORTING, TERMINATED, STOPPED = "serving", "draining", "aborting", "terminated", "stopped"
RETIRING = "retiring"  # a run that will never serve (its chain died before it started): it delivers and goes
STOPPING = "stopping"  # the sidecar's own stop (a signal, the end of tether run): not a termination
RUN_STATES = (SERVING, DRAINING, ABORTING, TERMINATED, STOPPING, STOPPED, RETIRING)


# -- fields -------------------------------------------------------------------------------------------------------
KINDS = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "true or false",
         "object": "an object", "objects": "a list of objects", "strings": "a list of strings",
         "numbers": "an object of numbers", "chain": "the comma-joined links or a list of links"}


@dataclass(frozen=True)
class Wire:
    """How one field travels: its JSON kind, bounds and meaning."""

    kind: str
    doc: str = ""
    required: bool = False
    max_len: int = 4096
    minimum: float | None = None
    max_items: int = 100_000


def wire(kind: str, default: Any = None, doc: str = "", **spec: Any) -> Any:
    """A message field: ``state: str = wire("string", SERVING, max_len=32)``."""
    assert kind in KINDS, kind
    meta = {"wire": Wire(kind, doc, **spec)}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def kind_of(value: Any) -> str:
    """A JSON value's kind in words, for a refusal ("not a string")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), "something else")


def _bad(message: str, name: str) -> ApiError:
    return ApiError(400, BAD_REQUEST, message, field=name)


def finite_number(value: Any) -> bool:
    """A JSON number a float can hold (``10**400`` cannot; JSON numbers are never booleans)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _check(name: str, spec: Wire, value: Any, where: str) -> Any:
    """The value as the field promises it, or a refusal naming the field (in the words the control plane's
    body reader uses for every other route). Absent and null read as absent."""
    kind = spec.kind
    wrong = _bad(f"'{name}' must be {KINDS[kind]}, not {kind_of(value)} ({where})", name)
    if kind == "string":
        if not isinstance(value, str):
            raise wrong
        if len(value) > spec.max_len:
            raise _bad(f"'{name}' is longer than {spec.max_len} characters ({where})", name)
    elif kind == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong
    elif kind == "number":
        if not finite_number(value):
            raise wrong
        value = float(value)
    elif kind == "boolean":
        if not isinstance(value, bool):
            raise wrong
    elif kind == "object":
        if not isinstance(value, dict):
            raise wrong
    elif kind == "numbers":
        if not isinstance(value, dict) or not all(finite_number(v) for v in value.values()):
            raise wrong
    elif kind == "chain":  # read as the one spelling the verifier takes: the links joined by commas
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return ",".join(value)
        if not isinstance(value, str):
            raise wrong
    else:  # objects, strings
        item = dict if kind == "objects" else str
        if not isinstance(value, list):
            raise wrong
        for index, v in enumerate(value):
            if not isinstance(v, item):
                what = "an object" if item is dict else "a string"
                raise _bad(f"'{name}[{index}]' must be {what}, not {kind_of(v)} ({where})", name)
        if len(value) > spec.max_items:
            raise _bad(f"'{name}' holds more than {spec.max_items} items ({where})", name)
    if spec.minimum is not None and kind in ("integer", "number") and value < spec.minimum:
        raise _bad(f"'{name}' must be at least {spec.minimum:g} ({where})", name)
    return value


_SCHEMA = {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean", "object": "object",
           "objects": "array", "strings": "array", "numbers": "object"}


def _field_schema(spec: Wire) -> dict[str, Any]:
    if spec.kind == "chain":  # no length bound but the body's: a chain is as long as its links
        return {"oneOf": [{"type": "string", "description": "the links, root first, joined by commas"},
                          {"type": "array", "items": {"type": "string"}, "minItems": 1}],
                **({"description": spec.doc} if spec.doc else {})}
    schema: dict[str, Any] = {"type": [_SCHEMA[spec.kind], "null"] if not spec.required else _SCHEMA[spec.kind]}
    if spec.kind == "string":  # every bound the reader enforces is stated, the defaults included
        schema["maxLength"] = spec.max_len
    if spec.kind == "objects":
        schema["items"] = {"type": "object"}
    elif spec.kind == "strings":
        schema["items"] = {"type": "string"}
    if spec.kind in ("objects", "strings"):
        schema["maxItems"] = spec.max_items
    elif spec.kind == "numbers":
        schema["additionalProperties"] = {"type": "number"}
    if spec.minimum is not None:
        schema["minimum"] = spec.minimum
    if spec.doc:
        schema["description"] = spec.doc
    return schema


class Message:
    """A document one side sends and the other reads; subclasses are frozen dataclasses of :func:`wire`
    fields. ``WHAT`` names it in refusals ("the heartbeat body")."""

    WHAT: ClassVar[str] = "the message"

    @classmethod
    def specs(cls) -> list[tuple[str, Wire]]:
        return [(f.name, f.metadata["wire"]) for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def read(cls, doc: Mapping[str, Any]) -> Self:
        """Check a document from the other side: every declared field of the right kind (absent or null: its
        default), required ones present. Fields not declared are ignored (a newer peer may send more)."""
        if not isinstance(doc, Mapping):
            raise ApiError(400, BAD_REQUEST, f"{cls.WHAT} must be a JSON object, not {kind_of(doc)}")
        values: dict[str, Any] = {}
        for name, spec in cls.specs():
            value = doc.get(name)
            if value is None:
                if spec.required:
                    raise _bad(f"{cls.WHAT} needs '{name}'", name)
                continue
            values[name] = _check(name, spec, value, cls.WHAT)
        return cls(**values)

    def to_doc(self) -> dict[str, Any]:
        """The document to send: every field, null included (a reader reads null as absent)."""
        return {name: getattr(self, name) for name, _ in self.specs()}

    @classmethod
    def schema(cls) -> dict[str, Any]:
        specs = cls.specs()
        schema: dict[str, Any] = {"type": "object", "properties": {n: _field_schema(s) for n, s in specs}}
        required = [n for n, s in specs if s.required]
        if required:
            schema["required"] = required
        return schema


# -- the messages ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Heartbeat(Message):
    """A run renews its lease (``POST HEARTBEAT``), saying what it is doing."""

    WHAT: ClassVar[str] = "the heartbeat body"
    state: str = wire("string", SERVING, "the run's state: one of " + ", ".join(RUN_STATES), max_len=32)
    inflight: list[dict[str, Any]] = wire("objects", [], "the calls in flight (call_id, capability, method, url, "
                                          "started_at)")
    seq: int | None = wire("integer", None, "the last event sequence number the run applied")
    proxy: str | None = wire("string", None, "the proxy's listening address", max_len=200)
    pid: int | None = wire("integer")
    started_at: float | None = wire("number")
    spooled: int = wire("integer", 0, "reports waiting in the run's spool", minimum=0)
    supersedes: str | None = wire("string", None, "the run whose state dir this run took over", max_len=64)
    revocations_held: dict[str, float] | None = wire("numbers", None, "jti -> seconds since the run learned of "
                                                     "its revocation")
    budget_slices: dict[str, Any] | None = wire(
        "object", None, "the budget slices the run holds as of this beat: {asked: the sequence number of its last "
        "slice request when the beat was built, held: the tags of every slice it holds, is still asking for, or "
        "has not had its settlement acknowledged}; an open slice of the run asked for at or before 'asked' and "
        "not held goes back to its budget")

    def __post_init__(self) -> None:
        if self.budget_slices is not None:
            HeldSlices.read(self.budget_slices)  # refused here, naming the field, rather than misread later


@dataclass(frozen=True)
class HeldSlices:
    """What a heartbeat's ``budget_slices`` says: the sequence number of the run's last slice request when the
    beat was built (``asked``), and the tags of the slices it held then, was still asking for, or had sent
    for settlement without an acknowledgement yet (``held``). A slice asked for at or before ``asked`` and not
    held is one the run gave up on (its answer was lost) and will never spend."""

    asked: int
    held: frozenset[str]

    MAX_HELD: ClassVar[int] = 10_000

    @classmethod
    def read(cls, doc: Any) -> HeldSlices:
        where = "the heartbeat body"
        if not isinstance(doc, Mapping):
            raise _bad(f"'budget_slices' must be an object, not {kind_of(doc)} ({where})", "budget_slices")
        asked, held = doc.get("asked"), doc.get("held")
        if isinstance(asked, bool) or not isinstance(asked, int) or asked < 0:
            raise _bad(f"'budget_slices.asked' must be a whole number, 0 or more ({where})", "budget_slices")
        if not isinstance(held, list) or not all(isinstance(t, str) and 1 <= len(t) <= 64 for t in held):
            raise _bad(f"'budget_slices.held' must be a list of slice tags (1-64 characters) ({where})",
                       "budget_slices")
        if len(held) > cls.MAX_HELD:
            raise _bad(f"'budget_slices.held' holds more than {cls.MAX_HELD} tags ({where})", "budget_slices")
        return cls(asked, frozenset(held))


@dataclass(frozen=True)
class Lease(Message):
    """The control plane's answer to a heartbeat: the lease, and what the run must know now."""

    WHAT: ClassVar[str] = "the heartbeat's answer"
    lease_ttl_s: float = wire("number", required=True)
    lease_expires_at: float = wire("number", required=True)
    now: float = wire("number", required=True, doc="the control plane's clock")
    run_id: str = wire("string", required=True, max_len=200)
    revoked: list[str] = wire("strings", [], "revoked jtis of the run's chain (belt and braces beside the events)",
                              required=True)
    command: dict[str, Any] | None = wire("object", None, "a termination command for the run, if any")


@dataclass(frozen=True)
class Quiesced(Message):
    """A run acknowledges a termination (``POST QUIESCED``): its last reports, its counts, its final state."""

    WHAT: ClassVar[str] = "the acknowledgement"
    termination_id: str = wire("string", required=True, max_len=200)
    state: str = wire("string", TERMINATED, "the run's state (terminated)", max_len=32)
    reports: list[dict[str, Any]] = wire("objects", [], "final call reports not delivered yet")
    starts: list[dict[str, Any]] = wire("objects", [], "starts of calls not delivered yet")
    calls: dict[str, Any] | None = wire("object", None, "the run's call counts by resolution")


@dataclass(frozen=True)
class Register(Message):
    """A chain holder (or an admin) registers a chain (``POST REGISTER``): every link is registered before it
    is used. ``chain`` is read as the links joined by commas whichever way it was sent."""

    WHAT: ClassVar[str] = "the registration"
    chain: str = wire("chain", required=True, doc="the chain: its links, root first")


@dataclass(frozen=True)
class Registered(Message):
    """The control plane's answer to a registration: whose chain it is, its leaf link, its jtis root first, how
    many links were new, and which of its jtis are revoked (a run of a revoked chain never serves)."""

    WHAT: ClassVar[str] = "the registration's answer"
    agent: str = wire("string", required=True, max_len=200)
    link: str = wire("string", required=True, max_len=200, doc="the leaf link's hash")
    jtis: list[str] = wire("strings", [], "the chain's jtis, root first", required=True)
    new: int = wire("integer", 0, "links registered for the first time", required=True, minimum=0)
    revoked: list[str] = wire("strings", [], "revoked jtis of the chain", required=True)


@dataclass(frozen=True)
class Events(Message):
    """One document of the event channel (``GET EVENTS``'s long poll, or one line of ``EVENTS_STREAM``): the
    events the run may see, the sequence number to resume after, and, when the run cannot resume (``resync``),
    everything it must know at once: its chain's revoked jtis, its link's command, its decided approvals.
    A stream line that is not a resync carries only ``events`` and ``next``; the rest read as their defaults."""

    WHAT: ClassVar[str] = "the events answer"
    events: list[dict[str, Any]] = wire("objects", [], "the events, in sequence order", required=True)
    next: int = wire("integer", required=True, doc="the sequence number to ask after next")
    resync: bool = wire("boolean", False, "true when the run could not resume: the fields below say it all")
    revoked: list[str] = wire("strings", [], "on a resync: the revoked jtis of the run's chain")
    command: dict[str, Any] | None = wire("object", None, "on a resync: the link's termination command, if any")
    approvals: list[dict[str, Any]] = wire("objects", [], "on a resync: the link's decided approvals")


COMMAND_MODES = ("drain", "abort")


@dataclass(frozen=True)
class Command(Message):
    """A termination's command to every run of a link (in a lease, an events answer or a resync): drain within a
    window, or abort. Read by the run with :func:`command_from`, which obeys one it cannot read as an abort."""

    WHAT: ClassVar[str] = "the termination command"
    termination_id: str | None = wire("string", None, "the termination the command belongs to", max_len=128)
    mode: str = wire("string", "drain", "drain (finish what left, within the window) or abort", max_len=16)
    window_s: float = wire("number", 0.0, "the drain window, seconds", minimum=0)
    deadline: float | None = wire("number", None, "the window's end, on the control plane's clock")
    remaining_s: float | None = wire("number", None, "the window left when the command was handed out",
                                     minimum=0)
    grace_s: float = wire("number", 10.0, "the control plane's grace after the window, seconds", minimum=0)
    issued_at: float | None = wire("number", None, "when the termination's commands were sent")
    agent: str | None = wire("string", None, "the link's agent", max_len=256)
    link: str | None = wire("string", None, "the link the command is for", max_len=128)

    def __post_init__(self) -> None:
        if self.mode not in COMMAND_MODES:
            raise _bad(f"'mode' must be one of {', '.join(COMMAND_MODES)}, not {self.mode!r} ({self.WHAT})", "mode")

    def as_given(self) -> dict[str, Any]:
        """The command as the run's code reads it: the fields it carries (none null)."""
        return {name: value for name, value in self.to_doc().items() if value is not None}


def command_from(doc: Any) -> tuple[Command, str | None]:
    """The command a run obeys, and why it could not be read (None when it could). One that cannot be read is
    obeyed as an abort of the termination it names, if it names one: fail closed, the run stops serving rather
    than guess a window it was not given."""
    try:
        return Command.read(doc), None
    except ApiError as exc:
        tid = doc.get("termination_id") if isinstance(doc, Mapping) else None
        return Command(termination_id=tid if isinstance(tid, str) and len(tid) <= 128 else None, mode="abort"), \
            exc.message
