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
import collections
import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qsl, urlencode

from mitmproxy import http
from mitmproxy.net.encoding import decode as encoding_decode
from mitmproxy.version import FLOW_FORMAT_VERSION

from tether.capture.maintenance import MAINTAIN_EVERY_S, Outcome, Watch, prune, tidy, write_metrics
from tether.capture.retention import Hold, Policy
from tether.capture.segments import CAPTURE_FILE as CAPTURE_FILE  # the sidecar names its capture by it
from tether.capture.segments import Index, index_path, next_seq, sealed_name, write_hold

log = logging.getLogger("tether.sidecar.capture")
REDACTED = "[REDACTED]"
SECRET_HEADERS = ("authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key")


# Field names that say secret. A JSON key (at any depth), a form field or a query parameter is redacted by default
# when its name, lower-cased and without "-" and "_", ends with one of these: password, db_password, passwd,
# passphrase, secret, client_secret, clientSecret, token, access_token, refresh_token, id_token, api_key, apiKey,
# x-api-key, private_key, secret_key, authorization, credential(s). docs/operations.md lists them;
# ``--redact-field NAME`` adds names, ``--no-default-redact-fields`` turns these off.
SECRET_FIELD_ENDINGS = ("password", "passwd", "passphrase", "secret", "token", "apikey", "privatekey", "secretkey",
                        "authorization", "credential", "credentials")
_MARKERS = (b"pass", b"secret", b"token", b"key", b"authorization", b"credential")  # each ending holds one
_SLICE, _OVERLAP = 1 << 20, max(map(len, _MARKERS)) - 1  # Fields.may_hold looks at a large body a slice at a time


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
    # name -> answer; read and written from the loop and the capture encoder alike: each dict step is atomic, and
    # a race costs at most a name judged twice (never a different answer)
    _memo: dict[str, bool] = dataclasses.field(default_factory=dict, compare=False, repr=False)

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
        name (JSON ``\\u``, form ``%``) is always parsed. Names are compared without "-" and "_" (``field_key``),
        so the look drops them too: ``pass_word`` holds the marker ``pass``."""
        if self.named or b"\\u" in body or b"%" in body:
            return True
        # In slices (overlapping by a marker's length, counted without "-" and "_"): the same work, but each step
        # short, so that on the capture's encoder thread the event loop gets the interpreter back between them,
        # and a marker early in a large body ends the look there.
        for start in range(0, max(len(body), 1), _SLICE):
            lowered = body[start:_slice_end(body, start + _SLICE)].translate(None, b"-_").lower()
            if any(marker in lowered for marker in _MARKERS):
                return True
        return False


def _slice_end(body: bytes, end: int) -> int:
    """Where a slice of ``may_hold``'s that ends at ``end`` stops: ``_OVERLAP`` bytes further, and as much again as
    those hold of "-" and "_" (which the look drops), so that a marker spelt across the cut is whole in it."""
    stop = end + _OVERLAP
    while stop < len(body):
        dropped = body.count(b"-", end, stop) + body.count(b"_", end, stop)
        if stop - end - dropped >= _OVERLAP:
            break
        stop = end + _OVERLAP + dropped
    return stop


FieldNames = Fields | frozenset[str]
_JSON_KEY = re.compile(rb'"([^"]*)"\s*:')
UNDECODABLE = b"[REDACTED: undecodable encoded body]"
UNPARSED = object()  # no parse of the body is known (``_redact_fields``)


def json_keys(value: Any) -> set[str]:
    """Every object key in a parsed JSON value, at any depth (what ``_redact_json`` compares): a walk of the
    value, each step short (no single long C call), a fraction of a millisecond for a 10 MB list of 200 tools.
    (An SSE answer's parse is the list of its events' values: their keys are all of its keys.)"""
    keys: set[str] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            keys.update(item)
            stack.extend(v for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            stack.extend(v for v in item if isinstance(v, (dict, list)))
    return keys


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


def _redact_fields(body: bytes, media: str, fields: FieldNames, parsed: Any = UNPARSED) -> bytes | None:
    """``body`` with its named fields redacted (a form, or anything that reads as JSON), or None when it is not
    JSON it claims to be. ``parsed``: the JSON value tether parsed ``body`` to already (``ParsedBody``), whose keys
    are the body's: read off it, they say whether anything is to be redacted without a search of the bytes."""
    form = "x-www-form-urlencoded" in media
    sse = not form and "text/event-stream" in media
    # Whatever the declared media type (in any case, or none, or a wrong one): a body that reads as JSON is
    # redacted as JSON; a server that parses it leniently would see the secret otherwise.
    if not form and not sse and "json" not in media and body.lstrip()[:1] not in (b"{", b"["):
        return body
    if not form and parsed is not UNPARSED:
        if not any(k.lower() in fields for k in json_keys(parsed)):
            return body  # exactly what the parse below would find: no key it redacts
    elif isinstance(fields, Fields) and not fields.may_hold(body):
        return body
    if form:
        return _redact_query(b"?" + body, fields)[1:]
    if sse:
        return _redact_events(body, fields)
    if b"\\" not in body and not any(k.decode("utf-8", "replace").lower() in fields
                                      for k in dict.fromkeys(_JSON_KEY.findall(body))):
        return body  # no key it redacts (without escapes, every key is a quoted run followed by a colon)
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    value, changed = _redact_json(value, fields)
    return json.dumps(value).encode() if changed else body


def _redact_events(body: bytes, fields: FieldNames) -> bytes:
    """An SSE body with its events' data redacted by field name, each event's data read as an MCP client reads it
    (cut and joined as the list filter does, ``mcp.whole_events`` and ``mcp.event_data``, then parsed as JSON). An
    event whose data changed is written again, its other lines kept and its data on one line; any other event, one
    whose data is not JSON among them, is kept as it came."""
    from . import mcp  # (the SSE reading is the list filter's; mcp loads nothing of the capture)

    out: list[bytes] = []
    changed = False
    for event in mcp.whole_events(body):
        data = mcp.event_data(event)
        value: Any = None
        if data is not None:
            try:
                value = json.loads(bytes(data[2]))
            except (ValueError, UnicodeDecodeError, RecursionError):
                data = None
        redacted, hit = _redact_json(value, fields) if data is not None else (None, False)
        if not hit or data is None:
            out.append(event)
            continue
        changed = True
        lines, data_idx, _ = data
        skip = set(data_idx)
        kept = [bytes(line) for i, line in enumerate(lines) if line and i not in skip]
        out.append(b"\n".join([*kept, b"data: " + json.dumps(redacted).encode()]) + b"\n\n")
    return b"".join(out) if changed else body


def _redact_body(part: dict[str, Any], fields: FieldNames, values: Sequence[bytes] = (),
                 parsed: Any = UNPARSED) -> None:
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
    redacted = _redact_fields(body, media, fields, parsed if not encoded else UNPARSED) if fields else body
    if redacted is None:  # declared JSON that does not parse: when it came encoded, keep none of it
        redacted = UNDECODABLE if encoded else body
    if values:
        redacted = _scrub(redacted, values)
    if redacted is not body and redacted != body:
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


def _redact_state(state: dict, fields: FieldNames, secret: frozenset[bytes], values: Sequence[bytes] = (),
                  parsed: Any = UNPARSED) -> dict:
    """``parsed``: the response body's JSON value, when tether parsed it already (``ParsedBody``)."""
    for name in ("request", "response"):
        part = state.get(name)
        if not part:
            continue
        part["headers"] = _redact_headers(part["headers"], secret, values)
        # decoded: injected values wherever they appear (a tool echoing them)
        _redact_body(part, fields, values, parsed if name == "response" else UNPARSED)
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


PIECE_BYTES = 64 << 10  # bytes at least this long go into a record as they are, not copied into it


def coalesced(pieces: Iterable[bytes]) -> Iterator[bytes]:
    """A record's pieces as few writes: runs of small ones joined (a small flow's record is some 70 pieces, and an
    unbuffered file makes each write a system call), a large one (``PIECE_BYTES`` on) written as it is."""
    run: list[bytes] = []
    for piece in pieces:
        if len(piece) < PIECE_BYTES:
            run.append(piece)
            continue
        if run:
            yield b"".join(run)
            run = []
        yield piece
    if run:
        yield b"".join(run)


def tnet_pieces(value: Any, out: list[bytes]) -> int:
    """Append ``tnet_dumps(value)`` to ``out`` in pieces, and return its length: the concatenation of what was
    appended is that encoding, byte for byte. A tnetstring is ``LENGTH:DATA`` and a type mark, so a dict's length
    can be summed from its items' pieces, and a long bytes value (a 10 MB body) is appended itself, never copied
    into a joined record (each copy of it held the interpreter's lock for its whole length). Dicts are walked
    (a flow's state and its request and response, where a body sits); everything else is one ``tnet_dumps``
    piece, so each string or bytes value lies whole inside one piece."""
    t = type(value)
    if t is bytes and len(value) >= PIECE_BYTES:
        head = b"%d:" % len(value)
        out += (head, value, b",")
        return len(head) + len(value) + 1
    if t is dict:
        at = len(out)
        out.append(b"")
        size = 0
        for k, v in reversed(value.items()):  # (tnet_dumps writes a dict's items last first)
            size += tnet_pieces(k, out) + tnet_pieces(v, out)
        out[at] = head = b"%d:" % size
        out.append(b"}")
        return len(head) + size + 1
    data = tnet_dumps(value)
    out.append(data)
    return len(data)


def encode_flow(flow: http.HTTPFlow, fields: FieldNames, conns: ConnectionStates,
                secret: frozenset[bytes] = _SECRET, values: Sequence[bytes] = ()) -> bytes:
    """``tnetstring.dumps(snapshot(flow))``, with each connection's state reused while it is unchanged, and
    ``values`` (what the sidecar injected) scrubbed wherever they appear in the request or the response."""
    return encode_taken(take(flow, conns, secret, values), fields)


@dataclass(frozen=True, slots=True)
class Taken:
    """A flow's state as it stood, taken on the event loop (cheap: no body is copied, each connection's encoding
    is cached), holding nothing the loop goes on changing: the redaction and the encoding, which cost in
    proportion to the bodies, can then run on another thread (``CaptureWriter.write_later``)."""

    flow_id: str
    started: float  # the request's timestamp_start, for the segment's index
    parts: dict[str, Any]  # a sidecar's flow: request and response states; else the whole flow's state
    head: list[tuple[str, bytes]] | None  # a sidecar's flow: its other fields, encoded (None: the general path)
    secret: frozenset[bytes]
    values: tuple[bytes, ...]
    scrub_first: bool  # an encoded body or a websocket: a search of the encoding cannot rule a value out
    parsed: Any = UNPARSED  # the response body's JSON value, tether's own parse of those very bytes (``ParsedBody``)

    @property
    def size(self) -> int:
        """About what it holds (its bodies): the writer bounds what waits to be encoded by it."""
        total = 0
        for name in ("request", "response"):
            part = self.parts.get(name)
            if part:
                total += len(part.get("content") or b"")
        return total


@dataclass(frozen=True, slots=True)
class ParsedBody:
    """A response body and the JSON value tether parsed it to (the MCP list filter's parse, or the value its
    filtered body encodes): the value's keys are the body's keys, so redaction by field name reads them off the
    value (``json_keys``, a short walk) instead of searching 10 MB of bytes for secret-looking names. It applies
    only while the flow's response still holds that very bytes object, identity-coded (``take`` checks)."""

    content: bytes
    value: Any


def take(flow: http.HTTPFlow, conns: ConnectionStates, secret: frozenset[bytes] = _SECRET,
         values: Sequence[bytes] = (), parsed: ParsedBody | None = None) -> Taken:
    """What ``encode_taken`` needs of ``flow``, taken where the flow lives (the event loop)."""
    scrub_first = bool(values) and (is_encoded(flow.request) or is_encoded(flow.response)
                                    or flow.websocket is not None)
    started = flow.request.timestamp_start
    known = UNPARSED
    if parsed is not None and flow.response is not None and flow.response.raw_content is parsed.content \
            and not is_encoded(flow.response):
        known = parsed.value
    if flow._backup is not None or flow.websocket is not None:  # not a sidecar's flow: the general path
        return Taken(flow.id, started, _metadata_free_state(flow), None, secret, tuple(values), scrub_first, known)
    # Flow.get_state and HTTPFlow.get_state, field for field, with the connections left out
    # (tests/test_capture.py holds the result to mitmproxy's own serialisation).
    parts = {"request": flow.request.get_state(), "response": flow.response.get_state() if flow.response else None}
    dumps = tnet_dumps
    head = [
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
    ]
    return Taken(flow.id, started, parts, head, secret, tuple(values), scrub_first, known)


def encode_taken(taken: Taken, fields: FieldNames) -> bytes:
    """The taken flow, redacted and tnetstring-encoded; ``taken`` is left as it was. Safe off the loop."""
    return b"".join(encode_pieces(taken, fields))


def encode_pieces(taken: Taken, fields: FieldNames) -> list[bytes]:
    """``encode_taken``'s bytes as pieces (``tnet_pieces``), to be written one after the other: a large body is
    a piece of its own, the very bytes object the flow holds."""
    if taken.values and taken.scrub_first:
        return _encode_taken(taken, fields, taken.values)  # a compressed body hides a value from a search
    pieces = list(coalesced(_encode_taken(taken, fields, ())))  # a small flow's record: one piece
    # tnetstrings hold bytes and strings verbatim, each whole inside one piece: a value absent from every piece is
    # absent from every part of the flow, which is the usual case (the injected header is redacted by name). Only
    # a flow that holds one (a tool echoing its request back) is encoded again, scrubbing every header, body and
    # path by value. (Joined pieces can only add a match across two of them: one more scrub, never one less.)
    for value in taken.values:
        for piece in pieces:
            if value in piece:
                return _encode_taken(taken, fields, taken.values)
    return pieces


def _fresh(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of a state that redaction may write into (it replaces values, never changes one in place)."""
    out = dict(state)
    for name in ("request", "response", "websocket"):
        if out.get(name):
            out[name] = dict(out[name])
    return out


def _encode_taken(taken: Taken, fields: FieldNames, values: Sequence[bytes]) -> list[bytes]:
    parts = _redact_state(_fresh(taken.parts), fields, taken.secret, values, taken.parsed)
    pieces: list[bytes] = []
    if taken.head is None:
        tnet_pieces(parts, pieces)
        return pieces
    # the flow's dict, as _tnet_dict writes it: its items last first (websocket, response, request, the head's)
    pieces.append(b"")
    size = tnet_pieces("websocket", pieces) + tnet_pieces(None, pieces)
    size += tnet_pieces("response", pieces) + tnet_pieces(parts["response"], pieces)
    size += tnet_pieces("request", pieces) + tnet_pieces(parts["request"], pieces)
    for key, data in reversed(taken.head):
        size += tnet_pieces(key, pieces) + len(data)
        pieces.append(data)
    pieces[0] = b"%d:" % size
    pieces.append(b"}")
    return pieces


def _metadata_free_state(flow: http.HTTPFlow) -> dict:
    metadata, flow.metadata = flow.metadata, {}  # get_state deep-copies metadata: tether's Call objects
    try:
        return flow.get_state()
    finally:
        flow.metadata = metadata


FLUSH_WAIT_S = 60.0  # what close waits for the final states still being encoded
PENDING_BYTES = 64 << 20  # bodies waiting to be encoded beyond this: the loop waits for the encoder (memory bound)
INLINE_BELOW = 64 << 10  # a final state with less than this of bodies, and nothing waiting, is written at once


class CaptureWriter:
    """Appends flows to the active segment of one capture, each write all or nothing, and rotates it.

    A write cut short (a full disk) is cut back off the file: a reader stops at the first flow it cannot
    parse, so torn bytes left in the middle would hide every flow written after them. If even cutting
    back fails, nothing more is appended until the file is clean again (each attempt retries the cut).

    Rotation (tether/capture/segments.py has the layout): once the active segment reaches the policy's size or
    age it is sealed (renamed ``flows.NNNNNN.mitm``, its index written beside it) and a new one begun; the
    maintenance thread then compresses it and applies the retention policy (tether/capture/retention.py). A
    capture left by an earlier run is sealed at the first write, so every sealed segment has one writer's index.
    A failed write asks for a maintenance round at once: pruning may make room for the next call."""

    def __init__(self, path: Path, redact_fields: Iterable[str] = (), *, default_fields: bool = True,
                 policy: Policy | None = None, root: Path | None = None, agent: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.fields = Fields.of(redact_fields, defaults=default_fields)
        self.last_error: str | None = None
        self._file: IO[bytes] | None = None
        self._clean_end: int | None = None  # where the file must be cut back to before the next write
        self.failures = 0
        self.written = 0  # bytes appended by this writer, every segment
        self.conns = ConnectionStates()
        self.secret = _SECRET
        self.values: Callable[[], Sequence[bytes]] = tuple
        self.policy = policy or Policy()
        self.agent = agent or path.parent.parent.name
        self.root = root  # the state root whose node cap this sidecar helps keep (None: its own capture only)
        self.clock = clock
        self._segment: _Active | None = None  # what the active segment holds (for its index)
        self._held: set[str] = set()  # terminations whose hold this run wrote (or found) already
        self.maintenance = Maintenance(self)
        self._lock = threading.RLock()  # the file, the segment and the counters: the loop's writes and the encoder's
        self.encoder = Encoder(self._commit)

    def protect(self, headers: frozenset[bytes], values: Callable[[], Sequence[bytes]]) -> None:
        """Also redact these headers (a credential's, whatever its name) and these values (what was injected)."""
        self.secret = _SECRET | headers
        self.values = values

    def write(self, flow: http.HTTPFlow) -> bool:
        """Capture ``flow`` now, on the caller's thread: True once it is on disk (a request about to leave)."""
        taken = self._take(flow)
        return taken is not None and self._commit(taken)

    def write_later(self, flow: http.HTTPFlow, parsed: ParsedBody | None = None) -> None:
        """Capture ``flow``'s state as it stands, encoded and appended by the writer's encoder thread: a call's
        final state (its answer on its way to the agent already), whose redaction and encoding cost in
        proportion to its bodies and would stall the event loop, every other call of the sidecar with it.
        The state is taken here, on the loop; ``close`` waits for every one taken. A failure is counted and
        logged like ``write``'s. ``parsed``: the response body as tether parsed it (``ParsedBody``), if it did."""
        taken = self._take(flow, parsed)
        if taken is not None:
            self.encoder.put(taken)

    def flush(self, timeout_s: float = FLUSH_WAIT_S) -> bool:
        """Wait until every state given to ``write_later`` is on disk (or failed); False if some still wait."""
        return self.encoder.flush(timeout_s)

    def _take(self, flow: http.HTTPFlow, parsed: ParsedBody | None = None) -> Taken | None:
        try:
            return take(flow, self.conns, self.secret, self.values(), parsed)
        except Exception as exc:  # counted as a failed capture: the request-time one then refuses the call
            with self._lock:
                self._failed(exc)
            return None

    def _commit(self, taken: Taken) -> bool:
        try:
            pieces = encode_pieces(taken, self.fields)
        except Exception as exc:  # (an unserialisable value): this call's capture only
            with self._lock:
                self._failed(exc)
            return False
        with self._lock:  # the loop's writes and the encoder's: one at a time, each whole
            return self._append(taken, pieces)

    def _append(self, taken: Taken, pieces: list[bytes]) -> bool:
        size = 0
        try:
            f = self._open()
            start = f.seek(0, os.SEEK_END)
            try:
                for piece in coalesced(pieces):  # one record: a large body written from the flow's own bytes
                    view = memoryview(piece)
                    while view:  # unbuffered: every byte is on disk or the write failed, nothing held back
                        written = f.write(view)
                        if not written:
                            raise OSError(errno.EIO, "the capture file accepted no bytes")
                        view = view[written:]
                    size += len(piece)
            except BaseException:
                self._cut_back(f, start)
                raise
            self.last_error = None
            self.written += size
        except Exception as exc:  # any failure to capture affects this call only, never the sidecar
            self._failed(exc)
            return False
        segment = self._segment
        if segment is not None:
            segment.add(taken.flow_id, taken.started, start + size)
            now = self.clock()
            if segment.size >= self.policy.segment_bytes or now - segment.opened_at >= self.policy.segment_age_s:
                self.rotate()
            elif now - self.maintenance.last >= MAINTAIN_EVERY_S:
                self.maintenance.request()
        return True

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        self.last_error = f"{self.path}: {getattr(exc, 'strerror', None) or exc}"
        if self.failures == 1 or self.failures % 100 == 0:
            log.error("capture failed (%d so far): %s", self.failures, self.last_error)
        self._close_file()
        self.maintenance.request()

    def _open(self) -> IO[bytes]:
        if self._file is not None:
            return self._file
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self._segment is None:
            self._seal_leftover()
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
        if self._segment is None:
            self._segment = _Active(self.clock())
        self._file = f
        return f

    def _cut_back(self, f: IO[bytes], start: int) -> None:
        try:
            f.truncate(start)
        except Exception as exc:
            log.error("cannot cut the failed capture write off %s (%s); no flow is appended until it can be",
                      self.path, exc)
            self._clean_end = start

    def _seal_leftover(self) -> None:
        """An active segment an earlier run left (its index unknown) is sealed as it is; maintenance indexes it."""
        try:
            st = self.path.stat()
        except OSError:
            return
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:  # (not a file: opening it fails, and says why)
            return
        os.replace(self.path, sealed_name(self.path, next_seq(self.path)))
        self.maintenance.request()

    def rotate(self) -> None:
        """Seal the active segment (renamed, its index beside it) and begin the next with the next write."""
        with self._lock:
            self._rotate()

    def _rotate(self) -> None:
        segment = self._segment
        if segment is None or not segment.ids:
            return
        self._close_file()
        seq = next_seq(self.path)
        target = sealed_name(self.path, seq)
        try:
            Index(seq, segment.opened_at, self.clock(), segment.first_at,
                  segment.last_at, list(segment.ids)).write(index_path(target))
            os.replace(self.path, target)
        except OSError as exc:  # a full disk: keep appending to this segment; the next write tries again
            log.warning("cannot seal capture segment %s: %s", self.path, exc)
            with contextlib.suppress(OSError):
                index_path(target).unlink()
            self.maintenance.request()
            return
        self._segment = _Active(self.clock())
        self.maintenance.request()

    def hold(self, termination_id: str, window_s: Any) -> None:
        """A termination's record will name flows of this capture: keep every segment opened until its window and a
        grace have passed, until the record is exported or the hold's retention ends (tether/capture/retention.py).
        Never raises: a hold that cannot be written is logged, and the termination goes on."""
        if termination_id in self._held:
            return
        self._held.add(termination_id)
        try:
            window_s = max(0.0, float(window_s or 0))
        except (TypeError, ValueError):
            window_s = 0.0
        now = self.clock()
        try:
            write_hold(self.path.parent, Hold(termination_id, self.agent, now, now + window_s + HOLD_GRACE_S,
                                              now + self.policy.hold_s))
        except OSError as exc:
            log.error("cannot write the capture hold for termination %s: %s", termination_id, exc)

    def ref(self, flow: http.HTTPFlow) -> str:
        return f"{self.path.name}#{flow.id}"

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def close(self, wait_s: float = FLUSH_WAIT_S) -> None:
        """The sidecar stops: every final state still being encoded is written first (a termination's record
        names them), then the active segment stays as it is (the next run seals it); maintenance ends."""
        if not self.encoder.close(wait_s):
            log.error("capture %s closed with %d final state(s) still unwritten after %.0fs", self.path,
                      self.encoder.pending, wait_s)
        with self._lock:
            self._close_file()
        self.maintenance.stop()


class Encoder:
    """The writer's encoder: one thread that encodes and appends the final states ``write_later`` took, in the
    order they were taken. What waits is bounded (``PENDING_BYTES`` of bodies): past it, the next ``put`` waits
    for the encoder to catch up, as every write waited before. After ``close``, a ``put`` commits at once, on the
    caller's thread: nothing taken is lost."""

    def __init__(self, commit: Callable[[Taken], bool], pending_bytes: int = PENDING_BYTES,
                 inline_below: int = INLINE_BELOW) -> None:
        self._commit = commit
        self.pending_bytes = pending_bytes
        self.inline_below = inline_below
        self._queue: collections.deque[Taken] = collections.deque()
        self._cv = threading.Condition()
        self.pending = 0  # taken and not yet committed (or failed)
        self._bytes = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    def put(self, taken: Taken) -> None:
        size = taken.size
        with self._cv:
            # A small state with nothing ahead of it is committed here: encoding it costs less than handing it
            # to the thread and waking it (most calls). Puts come from the event loop alone, so nothing can get
            # in between this check and the commit, and the order holds.
            queued = not self._closed and not (size < self.inline_below and self.pending == 0)
            if queued:
                self._cv.wait_for(lambda: self._bytes == 0 or self._bytes + size <= self.pending_bytes or self._closed)
                queued = not self._closed
            if queued:
                self._queue.append(taken)
                self.pending += 1
                self._bytes += size
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="tether-capture-encoder", daemon=True)
                    self._thread.start()
                self._cv.notify_all()
                return
        self._commit(taken)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return
                taken = self._queue.popleft()
            try:
                self._commit(taken)
            except Exception:  # (commit counts and logs its own failures): the encoder never stops for one
                log.exception("capture encoder failed on flow %s", taken.flow_id)
            finally:
                with self._cv:
                    self.pending -= 1
                    self._bytes -= taken.size
                    self._cv.notify_all()

    def flush(self, timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self.pending == 0, timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Every state taken is committed (up to ``timeout_s``), then the thread ends; later puts commit at once."""
        done = self.flush(timeout_s)
        with self._cv:
            self._closed = True
            thread = self._thread
            self._cv.notify_all()
        if thread is not None and done:
            thread.join(timeout_s)
        return done


MAINTAIN_IDLE_S = 600.0  # a round at least this often once the writer has written
HOLD_GRACE_S = 300.0  # beyond a termination's window: the grace it waits for acknowledgements, and then some


class _Active:
    """The active segment's index as it grows."""

    __slots__ = ("first_at", "ids", "last_at", "opened_at", "size")

    def __init__(self, opened_at: float) -> None:
        self.opened_at = opened_at
        self.ids: dict[str, None] = {}
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.size = 0

    def add(self, flow_id: str, at: float, size: int) -> None:
        self.ids[flow_id] = None
        self.first_at = at if self.first_at is None else min(self.first_at, at)
        self.last_at = at if self.last_at is None else max(self.last_at, at)
        self.size = size


class Maintenance:
    """The writer's maintenance thread: compress and index sealed segments, prune by the policy (this capture's
    age and cap, the state root's node cap, the disk's floor), write the gauges, log when the disk turns low.
    A daemon thread: a sidecar exiting mid-compression leaves a ``.gz.tmp`` the next round removes."""

    def __init__(self, writer: CaptureWriter) -> None:
        self.writer = writer
        self.last = 0.0  # when the last round was asked for (the writer's clock)
        self.pruned = 0
        self.watch = Watch()
        self.rounds = 0
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def request(self) -> None:
        self.last = self.writer.clock()
        with self._lock:
            if self._stopped:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tether-capture-maintenance", daemon=True)
                self._thread.start()
        self._wake.set()

    def stop(self, wait_s: float = 10.0) -> None:
        """No more rounds; a round under way is waited for (up to ``wait_s``), so nothing of the capture
        changes after the writer closed."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)

    def _run(self) -> None:
        while True:
            self._wake.wait(MAINTAIN_IDLE_S)  # an idle capture still ages, and the node's other captures grow
            self._wake.clear()
            if self._stopped:
                return
            try:
                self.round()
            except Exception:  # maintenance never takes the sidecar down; the next round tries again
                log.exception("capture maintenance failed")

    def round(self) -> Outcome:
        w = self.writer
        tidy(w.path, w.policy.compress)
        root = w.root if w.root is not None else w.path.parent
        outcome = prune(root, w.policy, w.clock(), own=(w.agent, w.path))
        self.pruned += outcome.freed
        self.watch.observe(outcome, w.path.parent, w.policy)
        decided = outcome.plan
        write_metrics(w.path.parent, w.agent, {
            "tether_capture_bytes": outcome.agent_bytes.get(w.agent, 0),
            "tether_capture_segments": outcome.segments.get(w.agent, 0),
            "tether_capture_held_segments": decided.held,
            "tether_capture_node_bytes": decided.node_bytes_after,
            "tether_capture_disk_free_bytes": decided.free_after or 0,
            "tether_capture_disk_low": int(decided.low),
            "tether_capture_pruned_bytes_total": self.pruned,
            "tether_capture_failures_total": w.failures,
            "tether_capture_written_bytes_total": w.written,
        })
        self.rounds += 1
        return outcome
