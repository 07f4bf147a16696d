"""A large JSON list answer filtered as it arrives (issue 23 item 6). Pure: bytes in, judged bytes out.

The buffered filter (``mcp.read_answer`` and ``mcp.filtered``) holds the whole answer before a byte passes, so
a 10 MB ``tools/list`` costs its client the upstream's write, the sidecar's parse and the sidecar's write one
after the other. ``JsonListStream`` reads the answer chunk by chunk instead and passes what it has judged: the
message's members as the server wrote them and, of each list in its ``result`` (tools, resources, resource
templates, prompts, tasks), each item as soon as its end has arrived, if the agent holds it. Each item is read
by one C call (``json.JSONDecoder.raw_decode``) once its text is complete; only the envelope is walked here.

Its output is the buffered filter's, byte for byte (``mcp.splice``: the answer's text without the removed
items; nothing removed, the answer itself), for every answer it reads to the end. What it does not read the
buffered filter reads: a batch, a message with a ``method``, a ``result`` with ``inputRequests``, a key named
twice, an encoding other than UTF-8, a member or item over ``ITEM_LIMIT``, text that is not JSON. Met before a
byte has passed, these raise ``Fallback`` (the caller filters the whole answer, ``raw`` holding every byte);
met after, ``Cut`` (the caller cuts the answer: what passed is never a whole JSON text, as the message's closing
brace is held until the answer has ended, so no client reads it as an answer, and no unjudged item passed).

Memory: the unread rest of one member or item (at most ``ITEM_LIMIT``; the envelope before a list's first item
is held until that item is judged, and every byte until the first one passes, for the fall-back), what passed
(``out``: the capture writes the final body, as for the buffered filter) and the kept items' values (``value``:
the capture's redaction reads the body's keys off it, ``capture.ParsedBody``).

Time: linear in the answer. A value is parsed again only when a piece that may end it has arrived (an object's
closing brace) and, past ``RETRY_FROM``, once its unread text has grown by half; a piece costs about its items'
C parse (a 256 KiB piece: ~1 ms), in a worker thread when it is large (``streamlayer``).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from typing import Any

from . import mcp

ITEM_LIMIT = 4 << 20  # characters: the most of one unfinished member or list item held (else: not streamed)
RETRY_FROM = 4096  # characters: a value this large is tried again only once its text has grown by half (a
# piece may bring a closing brace each, an inputSchema's nested objects: a try per piece is quadratic)
STREAM_FROM = 64 * 1024  # bytes: an answer that says it is shorter is filtered whole (one read holds it)

_WS = re.compile(r"[ \t\n\r]*")
_NUMBER_GOES_ON = re.compile(r"[0-9.eE+\-]*")
_DECODER = json.JSONDecoder()


class Fallback(Exception):
    """Nothing has passed: filter the whole answer instead (``JsonListStream.raw`` holds it)."""


class Cut(Exception):
    """Part of the answer has passed and the rest cannot be judged: the answer must be cut."""


class _More(Exception):
    """Not enough text yet for the next step."""


class JsonListStream:
    """Feed it the answer's chunks (``feed``), then ``finish``; each returns the bytes judged (see the module)."""

    def __init__(self, allowed: mcp.Visible | Callable[[str], bool], item_limit: int = ITEM_LIMIT) -> None:
        self.visible = mcp.as_visible(allowed)
        self.item_limit = item_limit
        self.raw: list[bytes] | None = []  # every byte while nothing has passed (for the fall-back)
        self.out: list[bytes] = []  # what passed
        self.removed = 0
        self.value: dict[str, Any] = {}  # the message as it passes (the kept items' values)
        self.reason = ""  # why it fell back or was cut
        self.finished = False  # read to its end, all of it judged
        self._head = b""  # the first bytes, until the encoding is known
        self._decoder: Any = None
        self._buf = ""
        self._pos = 0
        self._pending: list[str] = []  # judged text not yet passed
        self._state = self._start
        self._tried = 0  # how much unread text the last try of a large object had
        self._parts: list[str] = []  # text arrived since the last try
        self._waiting = 0  # how much unread text there is
        self._want = ""  # the next try waits for this character to arrive
        self._result: dict[str, Any] | None = None
        self._key = ""  # the list being read: its key in the result
        self._listed: list[Any] = []
        self._field, self._judge = "", self.visible.tool
        self._lead = ""  # the text between a list's ``[`` and its first item
        self._gap = ""  # the text since the last item (or the ``[``)
        self._items = 0
        self._kept = 0
        self._held = ""  # the message's closing brace and what follows it
        self._ended = False
        self._final = False
        self._may_pass = False  # nothing passes before a list's first item is judged (the envelope may be odd)

    @property
    def sent(self) -> bool:
        return self.raw is None

    def pending_chars(self) -> int:
        """How much arrived text is not read yet (what ``finish`` still has to read)."""
        return self._waiting

    # -- the caller's side -----------------------------------------------------------------------------------
    def feed(self, chunk: bytes) -> bytes:
        if self.raw is not None:
            self.raw.append(chunk)
        self._read(self._decode(chunk, False), False)
        return self._flush()

    def finish(self) -> bytes:
        self._read(self._decode(b"", True), True)
        if not self._ended:
            self._odd("the answer ended inside its JSON text")
        self._pending.append(self._held)
        self._may_pass = True
        if self.visible.observe is not None and ("result" in self.value or "error" in self.value):
            self.visible.observe(self.value)
        out = self._flush()
        self.finished = True
        return out

    def body(self) -> bytes:
        """Everything that passed (once finished: the final body), held once."""
        if len(self.out) > 1:
            self.out[:] = [b"".join(self.out)]
        return self.out[0] if self.out else b""

    # -- reading ---------------------------------------------------------------------------------------------
    def _odd(self, reason: str) -> None:
        self.reason = reason
        raise (Cut if self.sent else Fallback)(reason)

    def _decode(self, chunk: bytes, final: bool) -> str:
        if self._decoder is None:
            self._head += chunk
            if len(self._head) < 4 and not final:
                return ""
            if json.detect_encoding(self._head) != "utf-8":
                self._odd("the answer is not UTF-8 without a BOM")
            self._decoder = codecs.getincrementaldecoder("utf-8")("surrogatepass")
            chunk, self._head = self._head, b""
        try:
            return self._decoder.decode(chunk, final)  # type: ignore[no-any-return]
        except UnicodeDecodeError:
            self._odd("the answer is not UTF-8")
            raise  # not reached

    def _flush(self) -> bytes:
        if not self._pending or not self._may_pass:
            return b""
        out = "".join(self._pending).encode("utf-8", "surrogatepass")
        self._pending.clear()
        if out:
            self.raw = None
            self.out.append(out)
        return out

    def _read(self, text: str, final: bool) -> None:
        if text:
            self._parts.append(text)
            self._waiting += len(text)
        if not final and ((self._want and self._want not in text) or self._waiting < self._tried * 3 // 2):
            # An object whose end has not arrived is tried again once a closing brace has, and any value past
            # ``RETRY_FROM`` once its text has grown by half: linear in the answer, whatever it holds.
            if self._waiting > self.item_limit:
                self._odd(f"a member or item of the answer is over {self.item_limit} characters")
            return
        if self._parts:
            self._buf = self._buf[self._pos:] + "".join(self._parts)
            self._pos = 0
            self._parts.clear()
        self._final, self._want = final, ""
        try:
            while not self._ended or self._pos < len(self._buf):
                self._state()
        except _More:
            rest = len(self._buf) - self._pos
            if final:
                self._odd("the answer ended inside its JSON text")
            if rest > self.item_limit or len(self._gap) > self.item_limit:
                self._odd(f"a member or item of the answer is over {self.item_limit} characters")
            self._waiting = rest
            self._tried = rest if rest >= RETRY_FROM else 0
            return
        self._waiting = self._tried = 0

    def _ws(self, at: int | None = None) -> int:
        """Past the whitespace at ``at`` (the read position) (``_More`` when the text ends there)."""
        end = _WS.match(self._buf, self._pos if at is None else at).end()  # type: ignore[union-attr]
        if end == len(self._buf):
            raise _More
        return end

    def _pass(self, end: int) -> None:
        self._pending.append(self._buf[self._pos:end])
        self._pos = end

    def _value(self, at: int) -> tuple[Any, int]:
        """The JSON value at ``at``, read whole (it must be followed by something, or be the answer's last)."""
        if not self._final and self._buf.startswith("{", at) and self._buf.rfind("}", at) < 0:
            self._want = "}"  # an object cannot end before a brace (and a failed try costs a look at all of it)
            raise _More
        try:
            value, end = _DECODER.raw_decode(self._buf, at)
        except (ValueError, RecursionError):
            if self._final:
                self._odd("the answer is not JSON")
            self._want = "}" if self._buf.startswith("{", at) else ""  # an object cannot end before a brace
            raise _More from None
        if not self._final and (end == len(self._buf) or (
                isinstance(value, (int, float)) and _NUMBER_GOES_ON.fullmatch(self._buf, end))):
            raise _More  # a number may go on in the next chunk (``12.`` then ``5e3``)
        return value, end

    def _start(self) -> None:
        at = self._ws()
        if self._buf[at] != "{":
            self._odd("the answer is not one JSON-RPC message")
        self._pass(at + 1)
        self._state = self._first_key

    def _first_key(self) -> None:
        at = self._ws()
        if self._buf[at] == "}":
            self._close(at)
        else:
            self._state = self._member
            self._member()

    def _member(self) -> None:
        """A member of the message (or, inside it, of its result): its key, then its value."""
        in_result = self._result is not None
        at = self._ws()
        if self._buf[at] != '"':
            self._odd("the answer is not JSON")
        key, at = self._value(at)
        at = self._ws(at)
        if self._buf[at] != ":":
            self._odd("the answer is not JSON")
        at = self._ws(at + 1)
        into = self._result if self._result is not None else self.value
        if key in into:
            self._odd(f"the answer names {key!r} twice")
        if not in_result and key == "method":
            self._odd("the answer is a message with a method")
        if in_result and key == "inputRequests":
            self._odd("the answer's result holds requests")
        opens = self._buf[at]
        if not in_result and key == "result" and opens == "{":
            self._result = into[key] = {}
            self._pass(at + 1)
            self._state = self._first_key
            return
        if in_result and key in _LISTS and opens == "[":
            self._field, kind = _LISTS[key]
            self._judge = getattr(self.visible, kind)
            self._key, self._listed, self._items, self._kept, self._gap = key, [], 0, 0, ""
            into[key] = self._listed
            self._pass(at + 1)
            self._state = self._first_item
            return
        value, end = self._value(at)
        # what loads_pieces walks of this member, checked as it checks it (mcp.splice: never a key twice)
        if opens in "{[" and mcp.names_a_key_twice(self._buf[at:end], mcp.PIECES_DEPTH - (2 if in_result else 1)):
            self._odd(f"the answer's {key!r} names a key twice")
        into[key] = value
        self._pass(end)
        self._state = self._after_member

    def _after_member(self) -> None:
        at = self._ws()
        c = self._buf[at]
        if c == ",":
            self._pass(at + 1)
            self._state = self._member
        elif c == "}":
            self._close(at)
        else:
            self._odd("the answer is not JSON")

    def _close(self, at: int) -> None:
        """The result's closing brace passes; the message's is held until the answer has ended."""
        if self._result is not None:
            self._result = None
            self._pass(at + 1)
            self._state = self._after_member
            return
        self._pass(at)
        self._held = "}"
        self._pos = at + 1
        self._ended = True
        self._state = self._trailing

    def _trailing(self) -> None:
        end = _WS.match(self._buf, self._pos).end()  # type: ignore[union-attr]
        self._held += self._buf[self._pos:end]
        self._pos = end
        if end < len(self._buf):
            self._odd("the answer holds more than one JSON text")

    def _skip_to_gap(self) -> int:
        end = _WS.match(self._buf, self._pos).end()  # type: ignore[union-attr]
        self._gap += self._buf[self._pos:end]
        self._pos = end
        if end == len(self._buf):
            raise _More
        return end

    def _first_item(self) -> None:
        at = self._skip_to_gap()
        if self._buf[at] == "]":
            self._end_list(at)
        else:
            self._lead = self._gap
            self._state = self._item
            self._item()

    def _item(self) -> None:
        at = self._skip_to_gap()
        if self._buf[at] == "]":
            self._odd("the answer is not JSON")  # a comma before the bracket
        item, end = self._value(at)
        field = item.get(self._field) if isinstance(item, dict) else None
        text = self._buf[at:end] if isinstance(field, str) and self._judge(field) else None
        if text is not None and not mcp.names_field_twice(text, self._field):  # (mcp._kept: the same)
            self._pending.append(self._gap if self._kept else self._lead)
            self._pending.append(text)
            self._listed.append(item)
            self._kept += 1
        else:
            self.removed += 1
        self._items += 1
        self._may_pass = True
        self._gap = ""
        self._pos = end
        self._state = self._after_item

    def _after_item(self) -> None:
        at = self._skip_to_gap()
        c = self._buf[at]
        if c == ",":
            self._gap += ","
            self._pos = at + 1
            self._state = self._item
        elif c == "]":
            self._end_list(at)
        else:
            self._odd("the answer is not JSON")

    def _end_list(self, at: int) -> None:
        self._pending.append(self._gap)
        self._gap = ""
        self._pos = at
        self._pass(at + 1)
        self._state = self._after_member


_LISTS = mcp._LISTS  # result key -> (the item's identifying field, which predicate of Visible judges it)


def streamable(status: int, headers: Any, http_version: str) -> bool:
    """An answer worth streaming and that can be: identity-coded, of a length not known to be small, to a client
    that can read a body of unknown length."""
    length = headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) < STREAM_FROM):
        return False
    coding = headers.get("content-encoding", "").strip().lower()
    return coding in ("", "identity") and http_version == "HTTP/1.1" and 200 <= status < 300
