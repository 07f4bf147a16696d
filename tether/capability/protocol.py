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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from .errors import APPROVAL_BODY_TOO_LARGE, BAD_REQUEST, ApiError
from .events import APPROVAL_BODY_LIMIT, DENIED

# -- paths and headers ------------------------------------------------------------------------------------------
REGISTER = "/v1/chains/register"
HEARTBEAT = "/v1/sidecars/heartbeat"
QUIESCED = "/v1/sidecars/quiesced"
EVENTS = "/v1/events"
EVENTS_STREAM = "/v1/events/stream"
REPORTS = "/v1/reports"
APPROVALS = "/v1/approvals"
SLICES = "/v1/budgets/slices"
SLICES_RETURN = "/v1/budgets/slices/return"

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
         "numbers": "an object of numbers", "chain": "the comma-joined links or a list of links",
         "pairs": "a list of [name, value] pairs of strings"}


@dataclass(frozen=True)
class Wire:
    """How one field travels: its JSON kind, bounds and meaning."""

    kind: str
    doc: str = ""
    required: bool = False
    max_len: int = 4096
    minimum: float | None = None
    max_items: int = 100_000
    min_len: int = 0  # a string's shortest (1: not empty)
    maximum: float | None = None
    nullable: bool = True  # False: null is refused, and an unset field is left out of the document
    item: Any = None  # a Message class: the object (kind "object") or each object (kind "objects") read as one
    choices: tuple[str, ...] | None = None  # a string's only values (the schema's enum)


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


def _wrong(name: str, kind: str, value: Any, where: str) -> ApiError:
    return _bad(f"'{name}' must be {KINDS[kind]}, not {kind_of(value)} ({where})", name)


def _check(name: str, spec: Wire, value: Any, where: str) -> Any:
    """The value as the field promises it, or a refusal naming the field (in the words the control plane's
    body reader uses for every other route). Absent and null read as absent."""
    kind = spec.kind  # the refusal's words are made only when one is raised: a batch of reports is read per request
    if kind == "string":
        if not isinstance(value, str):
            raise _wrong(name, kind, value, where)
        if len(value) > spec.max_len:
            raise _bad(f"'{name}' is longer than {spec.max_len} characters ({where})", name)
        if len(value) < spec.min_len:
            raise _bad(f"'{name}' must not be empty ({where})" if spec.min_len == 1 else
                       f"'{name}' is shorter than {spec.min_len} characters ({where})", name)
        if spec.choices is not None and value not in spec.choices:
            raise _bad(f"'{name}' must be one of {', '.join(spec.choices)}, not {value[:32]!r} ({where})", name)
    elif kind == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            raise _wrong(name, kind, value, where)
    elif kind == "number":
        if not finite_number(value):
            raise _wrong(name, kind, value, where)
        value = float(value)
    elif kind == "boolean":
        if not isinstance(value, bool):
            raise _wrong(name, kind, value, where)
    elif kind == "object":
        if not isinstance(value, dict):
            raise _wrong(name, kind, value, where)
        if spec.item is not None:
            return _nested(spec.item, value, name, name, where)
    elif kind == "pairs":  # headers: [name, value], each string bounded by max_len
        if not isinstance(value, list) or len(value) > spec.max_items or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) and len(x) <= spec.max_len for x in p)
                for p in value):
            raise _bad(f"'{name}' must be at most {spec.max_items} [name, value] pairs of strings "
                       f"({spec.max_len // 1024} KiB each) ({where})", name)
    elif kind == "numbers":
        if not isinstance(value, dict) or not all(finite_number(v) for v in value.values()):
            raise _wrong(name, kind, value, where)
    elif kind == "chain":  # read as the one spelling the verifier takes: the links joined by commas
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return ",".join(value)
        if not isinstance(value, str):
            raise _wrong(name, kind, value, where)
    else:  # objects, strings
        item = dict if kind == "objects" else str
        if not isinstance(value, list):
            raise _wrong(name, kind, value, where)
        for index, v in enumerate(value):
            if not isinstance(v, item):
                what = "an object" if item is dict else "a string"
                raise _bad(f"'{name}[{index}]' must be {what}, not {kind_of(v)} ({where})", name)
        if len(value) > spec.max_items:
            raise _bad(f"'{name}' holds more than {spec.max_items} items ({where})", name)
        if spec.item is not None:
            return [_nested(spec.item, v, f"{name}[{index}]", name, where) for index, v in enumerate(value)]
    if spec.minimum is not None and kind in ("integer", "number") and value < spec.minimum:
        raise _bad(f"'{name}' must be at least {spec.minimum:g} ({where})", name)
    if spec.maximum is not None and kind in ("integer", "number") and value > spec.maximum:
        raise _bad(f"'{name}' must be at most {spec.maximum:g} ({where})", name)
    return value


def _nested(item: type[Message], value: dict[str, Any], path: str, name: str, where: str) -> Message:
    """An object inside a message read as its own message; a refusal names the outer field (``settle``) and
    says where inside it (``'settle[2]': 'used' must be an integer...``)."""
    try:
        return item.read(value)
    except ApiError as exc:
        if exc.http_status != 400:  # not a malformed field: a refusal of its own (413 for a held call cut short)
            raise
        inner = exc.details.get("field")  # one object: name the field inside it too ('request.headers')
        named = f"{name}.{inner}" if inner and path == name else name
        raise _bad(f"'{path}': {exc.message} ({where})", named) from None


_SCHEMA = {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean", "object": "object",
           "objects": "array", "strings": "array", "numbers": "object", "pairs": "array"}


def _field_schema(spec: Wire) -> dict[str, Any]:
    if spec.kind == "chain":  # no length bound but the body's: a chain is as long as its links
        return {"oneOf": [{"type": "string", "description": "the links, root first, joined by commas"},
                          {"type": "array", "items": {"type": "string"}, "minItems": 1}],
                **({"description": spec.doc} if spec.doc else {})}
    if spec.kind == "object" and spec.item is not None:
        nested = {**spec.item.schema(), **({"description": spec.doc} if spec.doc else {})}
        return nested if spec.required or not spec.nullable else {"anyOf": [nested, {"type": "null"}]}
    strict = spec.required or not spec.nullable
    schema: dict[str, Any] = {"type": _SCHEMA[spec.kind] if strict else [_SCHEMA[spec.kind], "null"]}
    if spec.kind == "string":  # every bound the reader enforces is stated, the defaults included
        schema["maxLength"] = spec.max_len
        if spec.min_len:
            schema["minLength"] = spec.min_len
        if spec.choices is not None:
            schema["enum"] = [*spec.choices, *([] if strict else [None])]
    if spec.kind == "objects":
        schema["items"] = spec.item.schema() if spec.item is not None else {"type": "object"}
    elif spec.kind == "strings":
        schema["items"] = {"type": "string"}
    elif spec.kind == "pairs":
        schema["items"] = {"type": "array", "items": {"type": "string", "maxLength": spec.max_len},
                           "minItems": 2, "maxItems": 2}
    if spec.kind in ("objects", "strings", "pairs"):
        schema["maxItems"] = spec.max_items
    elif spec.kind == "numbers":
        schema["additionalProperties"] = {"type": "number"}
    if spec.minimum is not None:
        schema["minimum"] = spec.minimum
    if spec.maximum is not None:
        schema["maximum"] = spec.maximum
    if spec.doc:
        schema["description"] = spec.doc
    return schema


_SPECS: dict[type, list[tuple[str, Wire]]] = {}


class Message:
    """A document one side sends and the other reads; subclasses are frozen dataclasses of :func:`wire`
    fields. ``WHAT`` names it in refusals ("the heartbeat body")."""

    WHAT: ClassVar[str] = "the message"

    @classmethod
    def specs(cls) -> list[tuple[str, Wire]]:
        specs = _SPECS.get(cls)
        if specs is None:  # once per class: the declaration does not change
            specs = _SPECS[cls] = [(f.name, f.metadata["wire"]) for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        return specs

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
                if not spec.nullable and name in doc:
                    raise _bad(f"'{name}' must be {KINDS[spec.kind]}, not null ({cls.WHAT})", name)
                continue
            values[name] = _check(name, spec, value, cls.WHAT)
        return cls(**values)

    def to_doc(self) -> dict[str, Any]:
        """The document to send: every field, null included (a reader reads null as absent), but for a field
        that may not be null, left out when unset; a nested message as its own document."""
        doc: dict[str, Any] = {}
        for name, spec in self.specs():
            value = getattr(self, name)
            if value is None and not spec.nullable:
                continue
            if spec.item is not None and value is not None:
                value = value.to_doc() if spec.kind == "object" else [v.to_doc() for v in value]
            doc[name] = value
        return doc

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


# -- call reports ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReportBatch(Message):
    """A run delivers call reports (``POST REPORTS``): final reports, and the write-ahead starts of calls still in
    flight. Each item is a call report (``tether/capability/report.py``'s ``CallReport``, read by
    ``read_final``/``read_start`` on the control plane, where one that does not fit refuses the whole batch).

    The hot path: the sidecar's spool holds each report as its JSON line, so :meth:`encoded` writes the
    document ``to_doc()`` would, from those lines, decoding and encoding nothing; the control plane reads the
    batch with :meth:`read` (a list check per field) and each report once, as a ``CallReport``'s document."""

    WHAT: ClassVar[str] = "the report batch"
    reports: list[dict[str, Any]] = wire("objects", [], "final call reports")
    starts: list[dict[str, Any]] = wire("objects", [], "write-ahead starts of calls in flight (no resolution)")

    @staticmethod
    def encoded(reports: Sequence[str], starts: Sequence[str] = ()) -> bytes:
        """The batch's document from reports already encoded as JSON (the spool's lines): ``starts`` is left out
        when there are none, which reads as the empty list."""
        more = f',"starts":[{",".join(starts)}]' if starts else ""
        return f'{{"reports":[{",".join(reports)}]{more}}}'.encode()


@dataclass(frozen=True)
class Accepted(Message):
    """The control plane's answer to a report batch: reports stored for the first time, and repeats dropped."""

    WHAT: ClassVar[str] = "the report batch's answer"
    accepted: int = wire("integer", 0, "reports stored for the first time", required=True, minimum=0)
    duplicates: int = wire("integer", 0, "reports of calls already reported (dropped)", required=True, minimum=0)


# -- budget slices --------------------------------------------------------------------------------------------
MAX_SLICE_SEQ = 10**12 - 1  # a slice's request number survives Redis's Lua JSON (14 significant digits) exactly


@dataclass(frozen=True)
class Settlement(Message):
    """What one slice used, sent to settle it (the rest goes back to every counter it was taken from)."""

    WHAT: ClassVar[str] = "a slice settlement"
    slice: str = wire("string", required=True, max_len=200, doc="the slice's id, as its lease named it")
    used: int = wire("integer", required=True, minimum=0, doc="calls of the slice the run forwarded")


@dataclass(frozen=True)
class SliceRequest(Message):
    """A run leases a slice of a capability's calls budget (``POST SLICES``), settling used-up slices with it."""

    WHAT: ClassVar[str] = "the slice request"
    capability: str = wire("string", required=True, doc="the budgeted capability")
    want: int = wire("integer", 1, "calls wanted (the control plane may give fewer)", minimum=1)
    slice: str = wire("string", required=True, max_len=64, min_len=1,
                      doc="the run's tag for the slice (no '/'): a retry takes nothing twice")
    seq: int | None = wire("integer", None, "the run's number for this request, 1 up (a heartbeat names the last)",
                           minimum=1, maximum=MAX_SLICE_SEQ)
    settle: list[Settlement] = wire("objects", [], "used-up slices to settle first", item=Settlement)

    def __post_init__(self) -> None:
        if "/" in self.slice:
            raise _bad(f"'slice' is the run's tag for the slice, with no '/' ({self.WHAT})", "slice")


@dataclass(frozen=True)
class SliceRefusal(Message):
    """Why no slice was leased: the refusal the run gives its calls of the capability until it asks again."""

    WHAT: ClassVar[str] = "the slice refusal"
    code: str = wire("string", required=True, max_len=64, doc="tether.budget_exhausted or tether.rate_limited")
    message: str = wire("string", "", "what is spent, and by whom", max_len=64 * 1024)
    retry_after_s: float | None = wire("number", None, "a rate window: when the next one opens", minimum=0)
    capability: str | None = wire("string", None)
    jti: str | None = wire("string", None, "the link whose budget is spent", max_len=200)


@dataclass(frozen=True)
class SliceLease(Message):
    """The control plane's answer to a slice request: the slice (its id and calls, and for a rate budget how
    long its window lasts), or no slice (``calls`` 0) and why."""

    WHAT: ClassVar[str] = "the slice answer"
    slice: str | None = wire("string", None, "the slice's id (the run's id, '/', its tag)", max_len=200)
    calls: int = wire("integer", 0, "calls leased (0: none, see error)", required=True, minimum=0)
    window_ends_in: float | None = wire("number", None, "a rate budget's slice: seconds its window has left",
                                        minimum=0)
    error: SliceRefusal | None = wire("object", None, "why no slice was leased", item=SliceRefusal)

    def __post_init__(self) -> None:
        if self.calls and self.slice is None:
            raise _bad(f"a slice of {self.calls} calls needs 'slice' ({self.WHAT})", "slice")


@dataclass(frozen=True)
class SliceReturn(Message):
    """A run settles slices without taking one (``POST SLICES_RETURN``): on a stop, a drain, or the flush."""

    WHAT: ClassVar[str] = "the slice return"
    slices: list[Settlement] = wire("objects", [], "the slices to settle", required=True, item=Settlement)


@dataclass(frozen=True)
class Settled(Message):
    """One slice settled: what it used, and what went back to its budget."""

    WHAT: ClassVar[str] = "a settled slice"
    slice: str = wire("string", required=True, max_len=200)
    used: int = wire("integer", required=True, minimum=0)
    returned: int = wire("integer", required=True, minimum=0)


@dataclass(frozen=True)
class SlicesSettled(Message):
    """The control plane's answer to a slice return: each slice it settled now (one settled before is left out)."""

    WHAT: ClassVar[str] = "the slice return's answer"
    settled: list[Settled] = wire("objects", [], "the slices settled by this request", required=True, item=Settled)


# -- approvals ------------------------------------------------------------------------------------------------
MAX_HELD_HEADERS = 500
MAX_HELD_BODY = 4 * ((APPROVAL_BODY_LIMIT + 2) // 3)  # characters: the limit's bytes as base64 (text is fewer)


@dataclass(frozen=True)
class HeldCall(Message):
    """The held call inside an approval request, as the approver sees it: method, URL, headers and body, redacted
    by the sidecar as captures are (``proxy/capture.py``'s ``held_call``), and its hash. Kept only whole: what the
    approver sees is all that would leave. ``read`` refuses a field of the wrong kind or past its bound (400,
    naming it) and a body past the limit (413 ``tether.approval_body_too_large``); ``cut`` says whether the call
    was cut or streamed past the approver (then the control plane refuses it 413 too, and the sidecar the call)."""

    WHAT: ClassVar[str] = "the held call"
    method: str = wire("string", "", max_len=32)
    url: str = wire("string", "", max_len=64 * 1024)
    headers: list[list[str]] = wire("pairs", [], "the request's headers as sent, redacted", max_len=64 * 1024,
                                    max_items=MAX_HELD_HEADERS)
    body: str = wire("string", "", "the whole body (base64 when body_encoding says so)", max_len=MAX_HELD_BODY)
    body_encoding: str = wire("string", "text", max_len=8, choices=("text", "base64"))
    body_size: int = wire("integer", 0, f"the body's bytes as they leave (at most {APPROVAL_BODY_LIMIT}; -1: "
                          "unknown, a streamed body: refused)", minimum=-1, nullable=False)
    body_truncated: bool = wire("boolean", False, "never true when filed: a cut body is refused "
                                "(413 tether.approval_body_too_large)")
    body_streamed: bool = wire("boolean", False, "never true when filed: a body streamed past the approver is "
                               "refused")
    call_hash: str | None = wire("string", None, "the call's hash, which an approval binds to", max_len=80)

    @classmethod
    def read(cls, doc: Mapping[str, Any]) -> Self:
        body = doc.get("body") if isinstance(doc, Mapping) else None
        if isinstance(body, str) and len(body) > MAX_HELD_BODY:  # too large, not malformed: the 413 below
            raise cls.too_large(None)
        return super().read(doc)

    def cut(self) -> ApiError | None:
        """The refusal of a held call that is not whole (cut, streamed, of a size unknown or past the limit);
        None when it is whole."""
        if self.body_truncated or self.body_streamed or not 0 <= self.body_size <= APPROVAL_BODY_LIMIT:
            return self.too_large(self.body_size if self.body_size >= 0 else None)
        return None

    @staticmethod
    def too_large(size: int | None) -> ApiError:
        return ApiError(413, APPROVAL_BODY_TOO_LARGE, "a held call is filed only with its whole body, at most "
                        f"{APPROVAL_BODY_LIMIT} bytes (this one: {size if size is not None else 'unknown'} bytes, "
                        "or cut by the sender): the approver must see everything that would leave",
                        limit=APPROVAL_BODY_LIMIT)


@dataclass(frozen=True)
class ApprovalRequest(Message):
    """A run files a call it holds for a person's decision (``POST APPROVALS``). ``request`` is the held call,
    whole (``HeldCall``); the control plane keeps it only whole."""

    WHAT: ClassVar[str] = "the approval request"
    call_id: str = wire("string", required=True, max_len=200, min_len=1)
    capability: str | None = wire("string", None, max_len=200)
    method: str | None = wire("string", None, max_len=32)
    url: str | None = wire("string", None, max_len=8192)
    timeout_s: float | None = wire("number", None, "how long the run holds the call (capped at a day)", minimum=0,
                                   nullable=False)
    request: HeldCall | None = wire("object", None, "the held call as the approver sees it, whole", item=HeldCall)
    call_hash: str | None = wire("string", None, "the held call's hash (as in request)", max_len=200)
    summary: str | None = wire("string", None, "a line for the approver (cut to 500 characters)",
                               max_len=64 * 1024, nullable=False)


@dataclass(frozen=True)
class ApprovalFiled(Message):
    """The control plane's answer to an approval request (built by its approval service): the approval's id,
    which the decision will name, its status and when it lapses. Answers written before this message was the
    answer were the approval document, whole: this reads them too (a reader ignores fields it does not know)."""

    WHAT: ClassVar[str] = "the approval request's answer"
    id: str = wire("string", required=True, max_len=200, min_len=1, doc="the approval's id")
    status: str | None = wire("string", None, "pending", max_len=32)
    expires_at: float | None = wire("number", None, "when the approval lapses, on the control plane's clock")
    call_id: str | None = wire("string", None, "the held call the approval is for", max_len=200)
    call_hash: str | None = wire("string", None, "the hash of the call filed, which an approval binds to",
                                 max_len=200)
    requested_at: float | None = wire("number", None, "when it was filed, on the control plane's clock")


@dataclass(frozen=True)
class ApprovalDecision(Message):
    """What a run reads of a decided approval (an approval event's payload, built by the control plane's approval
    service, or one of a resync's approvals): which approval, its status (approved, denied, expired, cancelled),
    and the call hash it approved; which call it was and who decided, for the run's log."""

    WHAT: ClassVar[str] = "the approval decision"
    id: str = wire("string", required=True, max_len=200, min_len=1)
    status: str = wire("string", DENIED, "approved, denied, expired or cancelled (absent: denied)", max_len=32)
    call_hash: str | None = wire("string", None, "the hash of the call that was shown and approved", max_len=200)
    call_id: str | None = wire("string", None, "the held call", max_len=200)
    decided_by: str | None = wire("string", None, "who decided (an operator, or a termination)", max_len=64 * 1024)


def decision_from(doc: Any) -> tuple[ApprovalDecision | None, str | None]:
    """The decision a run applies, and why it could not be read (None when it could). One that cannot be read
    is a denial of the approval it names, if it names one (fail closed: the held call is refused); one naming
    no approval is none of the run's calls' and is dropped."""
    try:
        return ApprovalDecision.read(doc), None
    except ApiError as exc:
        aid = doc.get("id") if isinstance(doc, Mapping) else None
        named = isinstance(aid, str) and 0 < len(aid) <= 200
        return (ApprovalDecision(aid, DENIED) if named else None), exc.message
