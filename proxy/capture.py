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
from urllib.parse import parse_qsl, urlencode

from mitmproxy import http
from mitmproxy import io as mio
from mitmproxy.exceptions import FlowReadException
from mitmproxy.io import tnetstring
from mitmproxy.net.encoding import decode as encoding_decode

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


def _header_dict(headers: Any) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}


def _redact_body(part: dict[str, Any], fields: frozenset[str]) -> None:
    """Redact named JSON fields in a message state's body (decoding it first if it is encoded)."""
    content = part.get("content")
    headers = _header_dict(part["headers"])
    if not fields or not content or "json" not in headers.get("content-type", ""):
        return
    encoding = headers.get("content-encoding", "").strip().lower()
    try:
        body = encoding_decode(content, encoding) if encoding and encoding != "identity" else content
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        if encoding:  # a body we cannot read could hold the secret: keep none of it
            part["content"] = b"[REDACTED: undecodable encoded body]"
        return
    value, changed = _redact_json(value, fields)
    if changed:
        part["content"] = json.dumps(value).encode()
        part["headers"] = tuple((k, v) for k, v in part["headers"] if k.lower() != b"content-encoding")


def _redact_query(path: bytes, fields: frozenset[str]) -> bytes:
    head, sep, query = path.partition(b"?")
    if not sep or not fields:
        return path
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    if not any(k.lower() in fields for k, _ in pairs):
        return path
    redacted = [(k, REDACTED if k.lower() in fields else v) for k, v in pairs]
    return head + b"?" + urlencode(redacted).encode("latin-1")


def snapshot(flow: http.HTTPFlow, fields: frozenset[str], headers: tuple[str, ...] = SECRET_HEADERS) -> dict:
    """The flow's serialisable state with secret headers, named JSON fields and query parameters redacted.

    Works on ``get_state()`` rather than a copied flow: one snapshot per write, nothing rebuilt."""
    state = flow.get_state()
    state["metadata"] = {}  # tether's own bookkeeping is not part of the traffic
    secret = {h.encode() for h in headers}
    for name in ("request", "response"):
        part = state.get(name)
        if not part:
            continue
        part["headers"] = tuple((k, REDACTED.encode() if k.lower() in secret else v) for k, v in part["headers"])
        _redact_body(part, fields)
    state["request"]["path"] = _redact_query(state["request"]["path"], fields)
    return state


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
            tnetstring.dump(snapshot(flow, self.fields), self._file)
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
