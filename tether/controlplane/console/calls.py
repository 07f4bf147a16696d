"""The console's calls: search over the call reports (pure), and one call's captured request and response.

A call's capture is read from the sidecars' state dirs the control plane was given (``TETHER_CAPTURES``), in
the capture file format, through ``export_har`` only: the one place this package touches
that format. What a capture holds was redacted when it was written (tether/proxy/capture.py); nothing here
sees more than a HAR export would.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

Doc = dict[str, Any]

SEARCHED = ("call_id", "agent", "capability", "method", "url", "resolution", "code", "termination_id", "run_id",
            "status")
BODY_SHOWN = 256 * 1024  # what the call view carries of a captured body; the HAR download has all of it


def matches(call: Mapping[str, Any], words: list[str]) -> bool:
    """Every word (lower case) is in one of the call's searched fields."""
    fields = " ".join(str(call.get(name) or "") for name in SEARCHED).lower()
    return all(word in fields for word in words)


def find_calls(calls: Iterable[Mapping[str, Any]], q: str = "", agent: str | None = None,
               resolution: str | None = None) -> list[Doc]:
    """The calls matching every word of ``q`` (agent, call id, capability, method, URL, resolution, code,
    termination, run, status), of ``agent`` and ``resolution`` when given, newest first."""
    words = q.lower().split()
    found = [dict(c) for c in calls if (agent in (None, "", c.get("agent")))
             and (resolution in (None, "", c.get("resolution"))) and matches(c, words)]
    found.sort(key=lambda c: (-(c.get("started_at") or 0), str(c.get("call_id"))))
    return found


def flow_id(call: Mapping[str, Any]) -> str | None:
    """The captured flow a call names (``capture_ref``: ``FILE#FLOW_ID``), or None."""
    ref = str(call.get("capture_ref") or "")
    return (ref.split("#", 1)[1] or None) if "#" in ref else None


def _cut(part: dict[str, Any] | None, limit: int) -> None:
    """A body past ``limit`` characters is cut, and says so (``_truncated``: its full length)."""
    if part and isinstance(part.get("text"), str) and len(part["text"]) > limit:
        part["_truncated"] = len(part["text"])
        part["text"] = part["text"][:limit]


def captured_call(root: Path, call: Mapping[str, Any], limit: int = BODY_SHOWN) -> Doc | None:
    """The call's capture as one HAR 1.2 entry (its ``request`` and ``response``, redacted as written,
    ``_tether`` lining it up with the call), bodies cut at ``limit``; None when no capture holds it."""
    if flow_id(call) is None or not call.get("agent"):
        return None
    entries = export_har(root, {"calls": [dict(call)]}, None, [dict(call)])["log"]["entries"]
    if not entries:
        return None
    entry = entries[0]
    _cut(entry["request"].get("postData"), limit)
    _cut(entry["response"].get("content"), limit)
    return entry


def export_har(root: Path, record: Mapping[str, Any] | None, agent: str | None, calls: list[Doc],
               since: str | None = None, until: str | None = None) -> Doc:
    """The HAR of a record's captured calls, one agent's, or every agent's under ``root`` (neither), within
    [since, until) (ISO 8601 or epoch seconds), lined up with ``calls`` (``tether capture export``'s own)."""
    from tether.capture.har import export, parse_when, selection  # the capture file format: imported here only

    har, _count, _missing = export(root, selection(root, dict(record) if record else None, agent), calls,
                                   parse_when(since), parse_when(until))
    return har


__all__ = ["BODY_SHOWN", "captured_call", "export_har", "find_calls", "flow_id", "matches"]
