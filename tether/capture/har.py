"""HAR export of captured flows: entries in time order, each lined up with the record's (or the reports') call.

Read by both sides: ``tether capture export`` and the console's HAR download (the control plane), from the capture
files the sidecars wrote (tether/capture/segments.py). Nothing here writes a capture or redacts: the sidecar
redacted every flow before it reached the disk (tether/proxy/capture.py), so a reader shows what is there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tether.capability.errors import BAD_REQUEST, TetherError

from .segments import CAPTURE_FILE, agent_dirs, has_capture, read_capture

if TYPE_CHECKING:
    from mitmproxy import http

EMPTY_CONTENT = {"size": 0, "mimeType": "x-unknown"}  # HAR 1.2: content needs both, even when empty


def to_har(flows: list[http.HTTPFlow], calls: dict[tuple[str, str], dict[str, Any]] | None = None,
           agents: dict[str, str] | None = None) -> dict[str, Any]:
    """A HAR 1.2 log of ``flows`` in time order, each entry lined up with the record's call.

    ``agents`` maps a flow id to the agent whose capture holds it; ``calls`` maps (agent, flow id) to that
    call's report or record entry (joined on ``capture_ref``). Each entry carries ``_tether`` (agent,
    call_id, capability, resolution, capture_ref). A call that got no answer (refused, cut by a
    termination, reset) has a valid empty ``content``, the duration the record gives it, and its
    resolution as the error."""
    from mitmproxy.addons.savehar import SaveHar

    calls = calls or {}
    agents = agents or {}
    ordered = sorted(flows, key=lambda f: (f.request.timestamp_start, f.id))
    har = SaveHar().make_har(ordered)
    for flow, entry in zip(ordered, har["log"]["entries"], strict=True):
        agent = agents.get(flow.id)
        call = calls.get((agent or "", flow.id), {})
        entry["_tether"] = {
            "agent": agent,
            "call_id": call.get("call_id"),
            "capability": call.get("capability"),
            "resolution": call.get("resolution") or ("completed" if flow.response is not None else None),
            "capture_ref": call.get("capture_ref") or f"{CAPTURE_FILE}#{flow.id}",
        }
        if flow.response is None:
            _cut_entry(flow, entry, call)
    har["log"]["creator"] = {"name": "tether", "version": "0.1.0", "comment": "mitmproxy flows, lined up with "
                             "tether's call reports"}
    return har


def _cut_entry(flow: http.HTTPFlow, entry: dict[str, Any], call: dict[str, Any]) -> None:
    """An entry with no response: what tether made of the call, not what the socket last said."""
    response = entry["response"]
    response["content"] = dict(EMPTY_CONTENT)
    response["bodySize"] = 0
    response["httpVersion"] = response["httpVersion"] or flow.request.http_version
    resolution = call.get("resolution")
    reason = f"tether: {resolution}" + (f" ({call['code']})" if call.get("code") else "") if resolution else None
    response["_error"] = reason or (flow.error.msg if flow.error else "no response")
    started, ended = call.get("started_at"), call.get("ended_at")
    if started is not None and ended is not None:
        duration_ms = max(0.0, (float(ended) - float(started)) * 1000)
    elif flow.error is not None:
        duration_ms = max(0.0, (flow.error.timestamp - flow.request.timestamp_start) * 1000)
    else:
        duration_ms = float(entry["time"])
    timings = entry["timings"]
    spent = sum(v for k, v in timings.items() if k != "wait" and v is not None and v > 0)
    timings["wait"] = max(0.0, duration_ms - spent)
    entry["time"] = spent + timings["wait"]
    entry["comment"] = response["_error"]


def parse_when(value: str | None) -> float | None:
    """``--since``/``--until``: epoch seconds or an ISO 8601 time (UTC when it names no zone)."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    from datetime import UTC, datetime

    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise TetherError(f"{value!r} is neither epoch seconds nor an ISO 8601 time", code=BAD_REQUEST) from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


@dataclass
class Export:
    """What an export wrote: the HAR, how many entries, the agents whose flows are in it, and the agents asked for
    that have no capture at all."""

    har: dict[str, Any]
    entries: int
    agents: list[str]
    missing: list[str]
    lost: int  # flows the selection named (a record's calls) that no segment holds any more


def export(root: Path, wanted: dict[str, set[str] | None], calls: list[dict[str, Any]],
           since: float | None = None, until: float | None = None) -> tuple[dict[str, Any], int, list[str]]:
    """``collect``'s HAR, entry count and agents without a capture (the console's download)."""
    done = collect(root, wanted, calls, since, until)
    return done.har, done.entries, done.missing


def collect(root: Path, wanted: dict[str, set[str] | None], calls: list[dict[str, Any]],
            since: float | None = None, until: float | None = None) -> Export:
    """The HAR of the chosen flows: per agent (``None``: all of its flows) or by flow id, within [since, until),
    read across every segment of each agent's capture, compressed or not."""
    flows: list[http.HTTPFlow] = []
    agents: dict[str, str] = {}
    missing: list[str] = []
    lost = 0
    for agent, ids in sorted(wanted.items()):
        captures = root / agent / "captures"
        if not has_capture(captures):
            missing.append(agent)
            lost += len(ids or ())
            continue
        found = read_capture(captures / CAPTURE_FILE, ids, since, until)
        if ids is not None and since is None and until is None:
            lost += len(ids - {f.id for f in found})
        for flow in found:
            flows.append(flow)
            agents[flow.id] = agent
    by_ref: dict[tuple[str, str], dict[str, Any]] = {}
    for call in calls:
        ref = call.get("capture_ref") or ""
        if "#" in ref:
            by_ref[call.get("agent", ""), ref.split("#", 1)[1]] = call
    return Export(to_har(flows, by_ref, agents), len(flows), sorted(set(agents.values())), missing, lost)


def selection(root: Path, record: dict[str, Any] | None, agent: str | None) -> dict[str, set[str] | None]:
    """Which flows an export covers: a record's calls, one agent's, or (neither) every agent's under root."""
    if record is not None:
        wanted: dict[str, set[str] | None] = {}
        for call in record["calls"]:
            ref = call.get("capture_ref")
            if ref and "#" in ref:
                wanted.setdefault(call["agent"], set()).add(ref.split("#", 1)[1])  # type: ignore[union-attr]
        return wanted
    if agent is not None:
        return {agent: None}
    return {d.name: None for d in agent_dirs(root)}
