"""A call report: the one shape in which a sidecar tells the control plane what became of a call.

The sidecar makes it from its call table (``proxy.state.Call.report``; a call still in flight is reported
by ``Call.summary``, the fields known before it ends); the control plane reads every report, start and
acknowledgement through ``read_doc`` (``CallReport.read`` without the object) and stores what it returns;
a reconciliation record lists each call with ``RECORD_FIELDS`` (docs/contract.md section 6). Pure: no I/O, no
clock.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .budget import TIERS
from .errors import BAD_REQUEST, TetherError
from .protocol import finite_number, kind_of
from .shared import RESOLUTIONS  # the documented list, imported where it is named (never copied)

MAX_CALL_ID = 200
MAX_RUN_ID = 64
MAX_TEXT = 64 * 1024  # a URL, a detail: long, never unbounded

# The fields of each call in a reconciliation record (docs/contract.md section 6), in the record's order.
RECORD_FIELDS = ("call_id", "agent", "capability", "method", "url", "started_at", "resolution", "status",
                 "capture_ref")

# What a call in flight is listed with (a heartbeat's ``inflight``; the sidecar adds the call's phase).
IN_FLIGHT_FIELDS = ("call_id", "capability", "method", "url", "started_at")


class ReportInvalid(TetherError):
    """A report that cannot be stored: the message names the report and the field."""

    code = BAD_REQUEST


@dataclass(frozen=True)
class CallReport:
    """What became of one call (a start, written ahead, has no resolution yet)."""

    call_id: str
    agent: str | None = None
    capability: str | None = None
    tier: str | None = None
    method: str | None = None
    url: str | None = None
    started_at: float | None = None
    resolution: str | None = None
    status: int | None = None
    code: str | None = None
    ended_at: float | None = None
    capture_ref: str | None = None
    termination_id: str | None = None
    detail: str | None = None
    run_id: str | None = None  # the run that delivered it (the control plane stamps its own)
    reissue_of: str | None = None  # an MCP call re-sending one whose answer the client never read: its call id

    def to_doc(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _NAMES}  # not fields(): this runs for every report in

    def in_flight(self) -> dict[str, Any]:
        """What is known of a call before it ends: a heartbeat's in-flight list, a record's last known."""
        return {name: getattr(self, name) for name in IN_FLIGHT_FIELDS}

    @classmethod
    def read(cls, doc: Any, where: str = "the report") -> CallReport:
        """A report as sent, checked field by field (``ReportInvalid`` names the first that is wrong).
        Fields beyond the report's own are not kept."""
        return cls(**read_doc(doc, where))


def read_doc(doc: Any, where: str = "the report") -> dict[str, Any]:
    """``CallReport.read(doc, where).to_doc()`` without the object in between: the control plane reads every
    report it is sent through this, so it builds the stored document directly."""
    if not isinstance(doc, dict):
        raise ReportInvalid(f"{where} must be an object")
    call_id = doc.get("call_id")
    if call_id is None:
        raise ReportInvalid(f"{where} needs 'call_id'", field="call_id")
    values: dict[str, Any] = {}
    for name, kind in _KINDS.items():
        value = doc.get(name)
        values[name] = None if value is None else _checked(name, kind, value, where)
    if not values["call_id"]:
        raise ReportInvalid(f"{where}: 'call_id' must not be empty", field="call_id")
    return values


_LIMITS = {"call_id": MAX_CALL_ID, "run_id": MAX_RUN_ID, "reissue_of": MAX_CALL_ID}
_KINDS = {f.name: ("int" if f.name == "status" else "number" if f.name.endswith("_at") else "str")
          for f in fields(CallReport)}
_NAMES = tuple(_KINDS)


def _checked(name: str, kind: str, value: Any, where: str) -> Any:
    if kind == "str":
        if not isinstance(value, str):
            raise ReportInvalid(f"{where}: '{name}' must be a string, not {kind_of(value)}", field=name)
        limit = _LIMITS.get(name, MAX_TEXT)
        if len(value) > limit:
            raise ReportInvalid(f"{where}: '{name}' is longer than {limit} characters", field=name)
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind == "int" and not isinstance(value, int)):
        expected = "an integer" if kind == "int" else "a number"
        raise ReportInvalid(f"{where}: '{name}' must be {expected}, not {kind_of(value)}", field=name)
    if not finite_number(value):  # NaN, infinities, and integers no float can hold (10**400)
        raise ReportInvalid(f"{where}: '{name}' must be a finite number", field=name)
    return value


_STATUS_RANGE = (100, 599)


def read_final(doc: Any, where: str = "the report") -> dict[str, Any]:
    """A final report (``read_doc``) that also says what the call became: a ``resolution`` from the documented
    list (``capability.shared.RESOLUTIONS``), a ``tier`` a grant can name, an HTTP ``status``. The control plane
    stores the first report of a call and drops later ones as duplicates, so a report it cannot read as the
    sidecar writes it must be refused, never kept in place of the true one."""
    values = read_doc(doc, where)
    resolution = values["resolution"]
    if resolution is None:
        raise ReportInvalid(f"{where} needs 'resolution' (one of {', '.join(RESOLUTIONS)})", field="resolution")
    if resolution not in RESOLUTIONS:
        raise ReportInvalid(f"{where}: 'resolution' must be one of {', '.join(RESOLUTIONS)}, not {resolution[:64]!r}",
                            field="resolution")
    if values["tier"] is not None and values["tier"] not in TIERS:
        raise ReportInvalid(f"{where}: 'tier' must be one of {', '.join(TIERS)}, not {values['tier'][:64]!r}",
                            field="tier")
    status = values["status"]
    if status is not None and not _STATUS_RANGE[0] <= status <= _STATUS_RANGE[1]:
        raise ReportInvalid(f"{where}: 'status' must be an HTTP status (100-599), not {status}", field="status")
    return values


def read_start(doc: Any, where: str = "the start") -> dict[str, Any]:
    """A write-ahead start (``read_doc``): a call that has not ended names no resolution."""
    values = read_doc(doc, where)
    if values["resolution"] is not None:
        raise ReportInvalid(f"{where}: a start has no 'resolution' (send the call's end as a report)",
                            field="resolution")
    return values
