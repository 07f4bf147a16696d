"""Traffic captures: each call's flow in mitmproxy's format, secrets redacted, exportable as HAR.

A flow is written when its request is about to leave (so a call that cannot be captured is not
forwarded) and again when it resolves; readers keep the last state per flow id.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import IO, Any

from mitmproxy import http
from mitmproxy import io as mio
from mitmproxy.exceptions import FlowReadException

from controlplane.capability.errors import BAD_REQUEST, TetherError

log = logging.getLogger("tether.sidecar.capture")
REDACTED = "[REDACTED]"
SECRET_HEADERS = ("authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key")
CAPTURE_FILE = "flows.mitm"


def _redact_json(value: Any, fields: frozenset[str]) -> tuple[Any, bool]:
    changed = False
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k.lower() in fields:
                out[k], changed = REDACTED, True
            else:
                out[k], c = _redact_json(v, fields)
                changed = changed or c
        return out, changed
    if isinstance(value, list):
        items = []
        for v in value:
            v2, c = _redact_json(v, fields)
            items.append(v2)
            changed = changed or c
        return items, changed
    return value, False


def _redact_message(message: http.Message, fields: frozenset[str], headers: tuple[str, ...]) -> None:
    for name in headers:
        if name in message.headers:
            message.headers[name] = REDACTED
    if not fields or message.raw_content is None:
        return
    if "json" not in message.headers.get("content-type", ""):
        return
    try:
        value = json.loads(message.get_content(strict=False) or b"")
    except (ValueError, UnicodeDecodeError):
        return
    value, changed = _redact_json(value, fields)
    if changed:
        message.content = json.dumps(value).encode()


def redact(flow: http.HTTPFlow, fields: frozenset[str], headers: tuple[str, ...] = SECRET_HEADERS) -> http.HTTPFlow:
    """A copy of the flow with secret headers, named JSON fields and named query parameters redacted."""
    copy = flow.copy()
    copy.id = flow.id  # the same call keeps one id across its snapshots (and matches its capture_ref)
    copy.metadata = {}  # tether's own bookkeeping is not part of the traffic
    _redact_message(copy.request, fields, headers)
    for key in list(copy.request.query.keys()):
        if key.lower() in fields:
            copy.request.query[key] = REDACTED
    if copy.response is not None:
        _redact_message(copy.response, fields, headers)
    return copy


class CaptureWriter:
    def __init__(self, path: Path, redact_fields: list[str] | tuple[str, ...] = ()) -> None:
        self.path = path
        self.fields = frozenset(f.lower() for f in redact_fields)
        self.last_error: str | None = None
        self._file: IO[bytes] | None = None
        self.failures = 0

    def write(self, flow: http.HTTPFlow) -> bool:
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "ab")
            mio.FlowWriter(self._file).add(redact(flow, self.fields))
            self._file.flush()
            self.last_error = None
            return True
        except Exception as exc:  # any failure to capture affects this call only, never the sidecar
            self.failures += 1
            self.last_error = f"{self.path}: {getattr(exc, 'strerror', None) or exc}"
            if self.failures == 1 or self.failures % 100 == 0:
                log.error("capture failed (%d so far): %s", self.failures, self.last_error)
            self.close()
            return False

    def ref(self, flow: http.HTTPFlow) -> str:
        return f"{self.path.name}#{flow.id}"

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


def read_flows(path: Path) -> list[http.HTTPFlow]:
    """The last state of every flow in a capture file, in first-seen order."""
    latest: dict[str, http.HTTPFlow] = {}
    with open(path, "rb") as f:
        try:
            for flow in mio.FlowReader(f).stream():
                if isinstance(flow, http.HTTPFlow):
                    latest[flow.id] = flow
        except FlowReadException as exc:  # a torn tail after a crash: keep what was read
            log.warning("%s: %s (keeping the flows before it)", path, exc)
    return list(latest.values())


def to_har(flows: list[http.HTTPFlow]) -> dict[str, Any]:
    from mitmproxy.addons.savehar import SaveHar

    return SaveHar().make_har(flows)


def cmd_export(args: argparse.Namespace) -> int:
    root = Path(args.captures)
    wanted: dict[str, set[str] | None] = {}
    if args.termination:
        from controlplane.client import Client

        record = Client(args.controlplane).request("GET", f"/v1/records/{args.termination}")
        for call in record["calls"]:
            ref = call.get("capture_ref")
            if ref and "#" in ref:
                wanted.setdefault(call["agent"], set()).add(ref.split("#", 1)[1])  # type: ignore[union-attr]
    elif args.agent:
        wanted[args.agent] = None
    else:
        raise TetherError("give --agent ID or --termination ID", code=BAD_REQUEST)
    flows: list[http.HTTPFlow] = []
    for agent, ids in wanted.items():
        path = root / agent / "captures" / CAPTURE_FILE
        if not path.exists():
            print(f"warning: no capture for {agent} at {path}")
            continue
        flows += [f for f in read_flows(path) if ids is None or f.id in ids]
    Path(args.har).write_text(json.dumps(to_har(flows), indent=1))
    print(f"wrote {args.har}: {len(flows)} call(s) from {len(wanted)} agent(s)")
    return 0
