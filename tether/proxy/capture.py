"""Traffic captures: each call's flow in mitmproxy's format, secrets redacted, exportable as HAR.

A flow is written when its request is about to leave (so a call that cannot be captured is not
forwarded) and again when it resolves; readers keep the last state per flow id.

Redaction works on what a reader will see (a HAR export, the console's approval card): a content-encoded body
is decoded before it is searched, and kept decoded when anything in it was redacted. Redacted are secret
headers by name, JSON/form fields and query parameters by name (``Fields``: the names that say secret by
default, plus ``--redact-field``), and every value the sidecar injected, in each spelling it can take
(tether/proxy/credentials.py makes them), wherever it appears: headers, path, bodies, websocket messages.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qsl, urlencode

from mitmproxy import http
from mitmproxy.net.encoding import decode as encoding_decode
from mitmproxy.version import FLOW_FORMAT_VERSION

from tether.capability.errors import BAD_REQUEST, TetherError

log = logging.getLogger("tether.sidecar.capture")
REDACTED = "[REDACTED]"
SECRET_HEADERS = ("authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key")
CAPTURE_FILE = "flows.mitm"


# Field names that say secret. A JSON key (at any depth), a form field or a query parameter is redacted by default
# when its name, lower-cased and without "-" and "_", ends with one of these: password, db_password, passwd,
# passphrase, secret, client_secret, clientSecret, token, access_token, refresh_token, id_token, api_key, apiKey,
# x-api-key, private_key, secret_key, authorization, credential(s). docs/operations.md lists them;
# ``--redact-field NAME`` adds names, ``--no-default-redact-fields`` turns these off.
SECRET_FIELD_ENDINGS = ("password", "passwd", "passphrase", "secret", "token", "apikey", "privatekey", "secretkey",
                        "authorization", "credential", "credentials")
_MARKERS = (b"pass", b"secret", b"token", b"key", b"authorization", b"credential")  # each ending holds one


def field_key(name: str) -> str:
    """A field name as redaction compares it: lower case, without "-" and "_" (``api_key`` = ``apiKey``)."""
    return name.lower().replace("-", "").replace("_", "")


@dataclass(frozen=True)
class Fields:
    """Which JSON, form and query field names are redacted: the ones named (``--redact-field``, compared as
    ``field_key``) and, unless ``defaults`` is off, every name that says secret (``SECRET_FIELD_ENDINGS``).

    ``name in fields`` asks about one name; a plain set of lower-case names works wherever a ``Fields`` does."""

    named: frozenset[str] = frozenset()
    defaults: bool = True
    _memo: dict[str, bool] = dataclasses.field(default_factory=dict, compare=False, repr=False)  # name -> answer

    @classmethod
    def of(cls, names: Iterable[str] = (), *, defaults: bool = True) -> Fields:
        return cls(frozenset(field_key(n) for n in names), defaults)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        answer = self._memo.get(name)
        if answer is None:  # a few distinct names recur in every body: each is judged once
            key = field_key(name)
            answer = key in self.named or (self.defaults and key.endswith(SECRET_FIELD_ENDINGS))
            if len(self._memo) >= 4096:
                self._memo.clear()
            self._memo[name] = answer
        return answer

    def __bool__(self) -> bool:
        return self.defaults or bool(self.named)

    def may_hold(self, body: bytes) -> bool:
        """False only when no field this redacts can be in ``body``: a cheap look before parsing it. An escaped
        name (JSON ``\\u``, form ``%``) is always parsed."""
        if self.named or b"\\u" in body or b"%" in body:
            return True
        lowered = body.lower()
        return any(marker in lowered for marker in _MARKERS)


FieldNames = Fields | frozenset[str]
_JSON_KEY = re.compile(rb'"([^"]*)"\s*:')
UNDECODABLE = b"[REDACTED: undecodable encoded body]"


def _redact_json(value: Any, fields: FieldNames) -> tuple[Any, bool]:
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


def _redact_fields(body: bytes, media: str, fields: FieldNames) -> bytes | None:
    """``body`` with its named fields redacted (a form, or anything that reads as JSON), or None when it is not
    JSON it claims to be."""
    if isinstance(fields, Fields) and not fields.may_hold(body):
        return body
    if "x-www-form-urlencoded" in media:
        return _redact_query(b"?" + body, fields)[1:]
    # Whatever the declared media type (in any case, or none, or a wrong one): a body that reads as JSON is
    # redacted as JSON; a server that parses it leniently would see the secret otherwise.
    if "json" not in media and body.lstrip()[:1] not in (b"{", b"["):
        return body
    if b"\\" not in body and not any(k.decode("utf-8", "replace").lower() in fields
                                      for k in dict.fromkeys(_JSON_KEY.findall(body))):
        return body  # no key it redacts (without escapes, every key is a quoted run followed by a colon)
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    value, changed = _redact_json(value, fields)
    return json.dumps(value).encode() if changed else body


def _redact_body(part: dict[str, Any], fields: FieldNames, values: Sequence[bytes] = ()) -> None:
    """Redact a message state's body as a reader will see it: decoded first (gzip, deflate, br, zstd), then its
    named fields and every injected value. A body that changed is kept decoded (its ``Content-Encoding``
    dropped); one that did not keeps its bytes as they travelled. A body whose encoding cannot be decoded could
    hold anything: none of it is kept."""
    content = part.get("content")
    if not content or not (fields or values):
        return
    headers = _header_dict(part["headers"])
    media = headers.get("content-type", "").lower()
    encoding = headers.get("content-encoding", "").strip().lower()
    encoded = bool(encoding) and encoding != "identity"
    try:
        body = encoding_decode(content, encoding) if encoded else content
    except ValueError:
        _replace(part, UNDECODABLE)
        return
    redacted = _redact_fields(body, media, fields) if fields else body
    if redacted is None:  # declared JSON that does not parse: when it came encoded, keep none of it
        redacted = UNDECODABLE if encoded else body
    if values:
        redacted = _scrub(redacted, values)
    if redacted != body:
        _replace(part, redacted)


def _replace(part: dict[str, Any], body: bytes) -> None:
    part["content"] = body
    part["headers"] = tuple((k, v) for k, v in part["headers"] if k.lower() != b"content-encoding")


def _redact_query(path: bytes, fields: FieldNames) -> bytes:
    head, sep, query = path.partition(b"?")
    if not sep or not fields:
        return path
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    if not any(k.lower() in fields for k, _ in pairs):
        return path
    redacted = [(k, REDACTED if k.lower() in fields else v) for k, v in pairs]
    return head + b"?" + urlencode(redacted).encode("latin-1")


def _scrub(data: bytes, values: Sequence[bytes]) -> bytes:
    for value in values:
        if value in data:
            data = data.replace(value, REDACTED.encode())
    return data


def _redact_headers(headers: tuple, secret: frozenset[bytes], values: Sequence[bytes]) -> tuple:
    """Secret headers' values replaced, and injected values scrubbed from the rest."""
    for k, _ in headers:
        if k.lower() in secret:
            headers = tuple((k, REDACTED.encode() if k.lower() in secret else v) for k, v in headers)
            break
    if values:
        headers = tuple((k, _scrub(v, values)) for k, v in headers)
    return headers


def _redact_state(state: dict, fields: FieldNames, secret: frozenset[bytes], values: Sequence[bytes] = ()) -> dict:
    for name in ("request", "response"):
        part = state.get(name)
        if not part:
            continue
        part["headers"] = _redact_headers(part["headers"], secret, values)
        _redact_body(part, fields, values)  # decoded: injected values wherever they appear (a tool echoing them)
    state["request"]["path"] = _redact_query(state["request"]["path"], fields)
    if values:
        state["request"]["path"] = _scrub(state["request"]["path"], values)
        websocket = state.get("websocket")
        if websocket and websocket.get("messages"):  # (type, from_client, content, timestamp[, dropped])
            websocket["messages"] = [(m[0], m[1], _scrub(m[2], values), *m[3:]) for m in websocket["messages"]]
    return state


def is_encoded(message: http.Message | None) -> bool:
    """The message's body travels content-encoded: searching its bytes finds no value."""
    encoding = message.headers.get("content-encoding", "").strip().lower() if message is not None else ""
    return bool(encoding) and encoding != "identity"


_SECRET = frozenset(h.encode() for h in SECRET_HEADERS)


def snapshot(flow: http.HTTPFlow, fields: FieldNames, secret: frozenset[bytes] = _SECRET) -> dict:
    """The flow's serialisable state with secret headers, named JSON fields and query parameters redacted."""
    return _redact_state(_metadata_free_state(flow), fields, secret)


HELD_BODY_LIMIT = 16 * 1024  # what an approver is shown of a held call's body; its full size is given too


def call_hash(request: http.Request) -> str:
    """SHA-256 over the request as it would leave: method, URL, every header in order, the body's bytes.

    An approval is bound to this value, so a decision can never apply to a different request."""
    h = hashlib.sha256()
    h.update(request.method.encode() + b"\n" + request.url.encode() + b"\n")
    for name, value in request.headers.fields:
        h.update(name.lower() + b": " + value + b"\n")
    h.update(b"\n")
    h.update(request.raw_content or b"")
    return "sha256:" + h.hexdigest()


def held_call(flow: http.HTTPFlow, fields: FieldNames, secret: frozenset[bytes] | None = None,
              limit: int = HELD_BODY_LIMIT) -> dict[str, Any]:
    """What an approver sees of a held call: method, URL, headers and body redacted exactly as a capture
    would be (the same code), the body cut at ``limit`` bytes with its full size, and the call's hash."""
    part = flow.request.get_state()
    _redact_state({"request": part, "response": None}, fields, secret or _SECRET)
    url = flow.request.url
    if part["path"] != flow.request.get_state()["path"]:  # a redacted query: the URL shows it redacted too
        url = url.split("?", 1)[0] + "?" + part["path"].decode("latin-1").split("?", 1)[1]
    body: bytes = part.get("content") or b""
    if flow.request.stream or flow.request.raw_content is None:  # a large upload, held at its headers
        streamed = {"body": "", "body_encoding": "text", "body_truncated": True, "body_streamed": True,
                    "body_size": int(length) if (length := flow.request.headers.get("content-length", "")).isdigit()
                    else -1}
        return {"method": flow.request.method, "url": url, "call_hash": call_hash(flow.request), **streamed,
                "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in part["headers"]]}
    shown = body[:limit]
    try:
        text, encoding = shown.decode("utf-8"), "text"
    except UnicodeDecodeError as exc:
        if len(body) > limit and exc.start >= len(shown) - 3:  # the cut fell inside one character
            text, encoding = shown[: exc.start].decode("utf-8"), "text"
        else:
            text, encoding = base64.b64encode(shown).decode(), "base64"
    return {
        "method": flow.request.method,
        "url": url,
        "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in part["headers"]],
        "body": text,
        "body_encoding": encoding,
        "body_size": len(flow.request.raw_content or b""),  # what leaves, not the redacted copy shown
        "body_truncated": len(body) > limit,
        "call_hash": call_hash(flow.request),
    }


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
    from mitmproxy.io import tnetstring  # (mitmproxy.io loads flow filters and HAR: readers' business, not a sidecar's)

    return tnetstring.dumps(value)


def _tnet_dict(items: list[tuple[str, bytes]]) -> bytes:
    """A tnetstring dict from already-encoded values, as ``tnet_dumps`` of the dict would write it."""
    payload = b"".join(tnet_dumps(k) + v for k, v in reversed(items))
    return b"%d:%s}" % (len(payload), payload)


def encode_flow(flow: http.HTTPFlow, fields: FieldNames, conns: ConnectionStates,
                secret: frozenset[bytes] = _SECRET, values: Sequence[bytes] = ()) -> bytes:
    """``tnetstring.dumps(snapshot(flow))``, with each connection's state reused while it is unchanged, and
    ``values`` (what the sidecar injected) scrubbed wherever they appear in the request or the response."""
    if values and (is_encoded(flow.request) or is_encoded(flow.response) or flow.websocket is not None):
        return _encode_flow(flow, fields, conns, secret, values)  # a compressed body hides a value from a search
    data = _encode_flow(flow, fields, conns, secret, ())
    # tnetstrings hold bytes and strings verbatim: a value absent from the encoding is absent from every part of
    # the flow, which is the usual case (the injected header is redacted by name). Only a flow that holds one (a
    # tool echoing its request back) is encoded again, scrubbing every header, body and path by value.
    for value in values:
        if value in data:
            return _encode_flow(flow, fields, conns, secret, values)
    return data


def _encode_flow(flow: http.HTTPFlow, fields: FieldNames, conns: ConnectionStates, secret: frozenset[bytes],
                 values: Sequence[bytes]) -> bytes:
    if flow._backup is not None or flow.websocket is not None:  # not a sidecar's flow: the general path
        return tnet_dumps(_redact_state(_metadata_free_state(flow), fields, secret, values))
    # Flow.get_state and HTTPFlow.get_state, field for field, with the connections left out
    # (tests/test_capture.py holds the result to mitmproxy's own serialisation).
    parts = _redact_state({
        "request": flow.request.get_state(),
        "response": flow.response.get_state() if flow.response else None,
    }, fields, secret, values)
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

    def __init__(self, path: Path, redact_fields: Iterable[str] = (), *, default_fields: bool = True) -> None:
        self.path = path
        self.fields = Fields.of(redact_fields, defaults=default_fields)
        self.last_error: str | None = None
        self._file: IO[bytes] | None = None
        self._clean_end: int | None = None  # where the file must be cut back to before the next write
        self.failures = 0
        self.conns = ConnectionStates()
        self.secret = _SECRET
        self.values: Callable[[], Sequence[bytes]] = tuple

    def protect(self, headers: frozenset[bytes], values: Callable[[], Sequence[bytes]]) -> None:
        """Also redact these headers (a credential's, whatever its name) and these values (what was injected)."""
        self.secret = _SECRET | headers
        self.values = values

    def write(self, flow: http.HTTPFlow) -> bool:
        try:
            data = encode_flow(flow, self.fields, self.conns, self.secret, self.values())
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
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # 0600: the flows hold what the agent sent and received, redacted or not, and are the sidecar's alone
        f = os.fdopen(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab", buffering=0)
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
    from mitmproxy import io as mio
    from mitmproxy.exceptions import FlowReadException

    latest: dict[str, http.HTTPFlow] = {}
    with open(path, "rb") as f:
        try:
            for flow in mio.FlowReader(f).stream():
                if isinstance(flow, http.HTTPFlow):
                    latest[flow.id] = flow
        except FlowReadException as exc:  # a torn tail after a crash: keep what was read
            log.warning("%s: %s (keeping the flows before it)", path, exc)
    return list(latest.values())


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


def export(root: Path, wanted: dict[str, set[str] | None], calls: list[dict[str, Any]],
           since: float | None = None, until: float | None = None) -> tuple[dict[str, Any], int, list[str]]:
    """The HAR of the chosen flows: per agent (``None``: all of its flows) or by flow id, within
    [since, until). Returns (har, entries, agents without a capture)."""
    flows: list[http.HTTPFlow] = []
    agents: dict[str, str] = {}
    missing: list[str] = []
    for agent, ids in sorted(wanted.items()):
        path = root / agent / "captures" / CAPTURE_FILE
        if not path.exists():
            missing.append(agent)
            continue
        for flow in read_flows(path):
            at = flow.request.timestamp_start
            if (ids is None or flow.id in ids) and (since is None or at >= since) and (until is None or at < until):
                flows.append(flow)
                agents[flow.id] = agent
    by_ref: dict[tuple[str, str], dict[str, Any]] = {}
    for call in calls:
        ref = call.get("capture_ref") or ""
        if "#" in ref:
            by_ref[call.get("agent", ""), ref.split("#", 1)[1]] = call
    return to_har(flows, by_ref, agents), len(flows), missing


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
    return {d.name: None for d in sorted(root.iterdir()) if (d / "captures" / CAPTURE_FILE).exists()} \
        if root.is_dir() else {}
