"""Traffic captures: each call's flow in mitmproxy's format, secrets redacted, exportable as HAR.

A flow is written when its request is about to leave (so a call that cannot be captured is not
forwarded) and again when it resolves; readers keep the last state per flow id.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import os
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qsl, urlencode

from mitmproxy import http
from mitmproxy import io as mio
from mitmproxy.exceptions import FlowReadException
from mitmproxy.io import tnetstring
from mitmproxy.net.encoding import decode as encoding_decode
from mitmproxy.version import FLOW_FORMAT_VERSION

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


def _redact_state(state: dict, fields: frozenset[str], secret: frozenset[bytes]) -> dict:
    for name in ("request", "response"):
        part = state.get(name)
        if not part:
            continue
        part["headers"] = tuple((k, REDACTED.encode() if k.lower() in secret else v) for k, v in part["headers"])
        _redact_body(part, fields)
    state["request"]["path"] = _redact_query(state["request"]["path"], fields)
    return state


_SECRET = frozenset(h.encode() for h in SECRET_HEADERS)


def snapshot(flow: http.HTTPFlow, fields: frozenset[str], secret: frozenset[bytes] = _SECRET) -> dict:
    """The flow's serialisable state with secret headers, named JSON fields and query parameters redacted."""
    return _redact_state(_metadata_free_state(flow), fields, secret)


class ConnectionStates:
    """Connections' serialised states, made again only when a connection changes.

    A keep-alive connection carries many calls, and its state (addresses, timestamps, TLS details, the
    peer's certificate chain) is most of a flow's size and of the cost of serialising it. A connection is
    re-serialised when any of its fields differs from what was serialised last.
    """

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._cache: dict[str, tuple[tuple, bytes]] = {}
        self._names: dict[type, tuple[str, ...]] = {}

    def _fingerprint(self, conn: Any) -> tuple:
        names = self._names.get(type(conn))
        if names is None:
            names = self._names[type(conn)] = tuple(f.name for f in dataclasses.fields(conn))
        return tuple(tuple(v) if isinstance(v, list) else v for v in map(conn.__getattribute__, names))

    def encoded(self, conn: Any) -> bytes:
        fingerprint = self._fingerprint(conn)
        hit = self._cache.get(conn.id)
        if hit is not None and hit[0] == fingerprint:
            return hit[1]
        data = tnet_dumps(conn.get_state())
        self._cache.pop(conn.id, None)
        self._cache[conn.id] = (fingerprint, data)
        if len(self._cache) > self.limit:
            del self._cache[next(iter(self._cache))]
        return data


def tnet_dumps(value: Any) -> bytes:
    """``mitmproxy.io.tnetstring.dumps``, byte for byte, in about half the time (no deque of fragments).

    Exact types take the fast branches; anything else (a subclass, an unserialisable value) goes to
    mitmproxy's own encoder, so the output and the errors are always its own."""
    t = type(value)
    if t is str:
        data = value.encode()
        return b"%d:%s;" % (len(data), data)
    if t is bytes:
        return b"%d:%s," % (len(value), value)
    if value is None:
        return b"0:~"
    if t is tuple or t is list:
        payload = b"".join([tnet_dumps(v) for v in value])
        return b"%d:%s]" % (len(payload), payload)
    if t is dict:  # mitmproxy writes a dict's items last first
        payload = b"".join([tnet_dumps(k) + tnet_dumps(v) for k, v in reversed(value.items())])
        return b"%d:%s}" % (len(payload), payload)
    if t is float:
        data = repr(value).encode()
        return b"%d:%s^" % (len(data), data)
    if t is bool:
        return b"4:true!" if value else b"5:false!"
    if t is int:
        data = str(value).encode()
        return b"%d:%s#" % (len(data), data)
    return tnetstring.dumps(value)


def _tnet_dict(items: list[tuple[str, bytes]]) -> bytes:
    """A tnetstring dict from already-encoded values, as ``tnet_dumps`` of the dict would write it."""
    payload = b"".join(tnet_dumps(k) + v for k, v in reversed(items))
    return b"%d:%s}" % (len(payload), payload)


def encode_flow(flow: http.HTTPFlow, fields: frozenset[str], conns: ConnectionStates,
                secret: frozenset[bytes] = _SECRET) -> bytes:
    """``tnetstring.dumps(snapshot(flow))``, with each connection's state reused while it is unchanged."""
    if flow._backup is not None or flow.websocket is not None:  # not a sidecar's flow: the general path
        return tnet_dumps(snapshot(flow, fields, secret))
    # Flow.get_state and HTTPFlow.get_state, field for field, with the connections left out
    # (tests/test_capture.py holds the result to mitmproxy's own serialisation).
    parts = _redact_state({
        "request": flow.request.get_state(),
        "response": flow.response.get_state() if flow.response else None,
    }, fields, secret)
    dumps = tnet_dumps
    return _tnet_dict([
        ("version", dumps(FLOW_FORMAT_VERSION)),
        ("type", dumps(flow.type)),
        ("id", dumps(flow.id)),
        ("error", dumps(flow.error.get_state() if flow.error else None)),
        ("client_conn", conns.encoded(flow.client_conn)),
        ("server_conn", conns.encoded(flow.server_conn)),
        ("intercepted", dumps(flow.intercepted)),
        ("is_replay", dumps(flow.is_replay)),
        ("marked", dumps(flow.marked)),
        ("metadata", b"0:}"),  # tether's own bookkeeping is not part of the traffic
        ("comment", dumps(flow.comment)),
        ("timestamp_created", dumps(flow.timestamp_created)),
        ("backup", b"0:~"),
        ("request", dumps(parts["request"])),
        ("response", dumps(parts["response"])),
        ("websocket", b"0:~"),
    ])


def _metadata_free_state(flow: http.HTTPFlow) -> dict:
    metadata, flow.metadata = flow.metadata, {}  # get_state deep-copies metadata: tether's Call objects
    try:
        return flow.get_state()
    finally:
        flow.metadata = metadata


class CaptureWriter:
    """Appends flows to one capture file, each write all or nothing.

    A write cut short (a full disk) is cut back off the file: a reader stops at the first flow it cannot
    parse, so torn bytes left in the middle would hide every flow written after them. If even cutting
    back fails, nothing more is appended until the file is clean again (each attempt retries the cut)."""

    def __init__(self, path: Path, redact_fields: list[str] | tuple[str, ...] = ()) -> None:
        self.path = path
        self.fields = frozenset(f.lower() for f in redact_fields)
        self.last_error: str | None = None
        self._file: IO[bytes] | None = None
        self._clean_end: int | None = None  # where the file must be cut back to before the next write
        self.failures = 0
        self.conns = ConnectionStates()

    def write(self, flow: http.HTTPFlow) -> bool:
        try:
            data = encode_flow(flow, self.fields, self.conns)
            f = self._open()
            start = f.seek(0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:  # unbuffered: every byte is on disk or the write failed, nothing held back
                    written = f.write(view)
                    if not written:
                        raise OSError(errno.EIO, "the capture file accepted no bytes")
                    view = view[written:]
            except BaseException:
                self._cut_back(f, start)
                raise
            self.last_error = None
            return True
        except Exception as exc:  # any failure to capture affects this call only, never the sidecar
            self.failures += 1
            self.last_error = f"{self.path}: {getattr(exc, 'strerror', None) or exc}"
            if self.failures == 1 or self.failures % 100 == 0:
                log.error("capture failed (%d so far): %s", self.failures, self.last_error)
            self.close()
            return False

    def _open(self) -> IO[bytes]:
        if self._file is not None:
            return self._file
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "ab", buffering=0)
        if self._clean_end is not None:
            try:
                if f.seek(0, os.SEEK_END) > self._clean_end:  # (a smaller file is another file: leave it)
                    f.truncate(self._clean_end)
            except BaseException:
                f.close()
                raise
            log.info("capture file %s cut back to %d bytes: later flows are readable", self.path, self._clean_end)
            self._clean_end = None
        self._file = f
        return f

    def _cut_back(self, f: IO[bytes], start: int) -> None:
        try:
            f.truncate(start)
        except Exception as exc:
            log.error("cannot cut the failed capture write off %s (%s); no flow is appended until it can be",
                      self.path, exc)
            self._clean_end = start

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
