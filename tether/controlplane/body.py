"""Reading API request bodies: the one JSON reader every handler uses, and typed field accessors.

Everything a client sends is hostile until read here. The reader bounds the size, parses strictly (no
``NaN``/``Infinity``, no number that overflows a float, no nesting deeper than ``MAX_DEPTH``), and every
problem, in the body as a whole or in one field, becomes ``400 tether.bad_request`` with a message naming
the field: never a traceback. Handlers ask :class:`Fields` for what they need (``string``, ``number``,
``integer``, ``boolean``, ``objects``...) instead of checking types by hand.

Authentication comes first where it can: ``raw_body`` returns the bytes a ``Tether-Proof`` signs, so a
handler authenticates the caller before ``parse`` spends anything on the body.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from tether.capability.errors import BAD_REQUEST, ApiError
from tether.capability.protocol import kind_of

MAX_BODY = 8 * 1024 * 1024  # a report batch of ~10k calls fits; aiohttp's client_max_size is set to this too
MAX_DEPTH = 32  # deeper than any document tether reads; the deepest legitimate one (a surface) is 5
_MISSING = object()


def bad(message: str, **details: Any) -> ApiError:
    return ApiError(400, BAD_REQUEST, message, **details)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a number")
    return value


def _unencodable(text: str) -> bool:
    """A lone surrogate (``"\\ud800"`` is valid JSON text, not valid Unicode): no store, log or terminal
    can take it, so it is refused here rather than failing wherever it is written."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# What a lone surrogate can come from: a \uD800-\uDFFF escape, or its UTF-8-like bytes (json.loads decodes
# bytes with surrogatepass). Where neither is in the raw text, no string of the document can hold one, and the
# walk below checks the nesting only: on a batch of reports that is most of the reader's time saved.
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _problem(value: Any, limit: int, strings: bool = True) -> str | None:
    """Iterative, so a document as deep as the parser allowed cannot exhaust the stack here either. With
    ``strings`` False only the nesting is checked (the raw text showed no surrogate can be in it)."""
    kinds = dict | list | str if strings else dict | list
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _unencodable(item):
                return "holds a string that is not valid Unicode (a lone surrogate)"
            continue
        if isinstance(item, dict):
            if strings and any(_unencodable(key) for key in item):
                return "holds a key that is not valid Unicode (a lone surrogate)"
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return f"is nested too deeply (at most {limit} levels)"
        stack.extend((child, depth + 1) for child in children if isinstance(child, kinds))
    return None


def loads(raw: bytes | str, what: str = "the request body") -> Any:
    """Strict JSON: ``400 tether.bad_request`` for anything malformed, non-finite, or nested too deep."""
    try:
        value = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise bad(f"{what} is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except (ValueError, TypeError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad(f"{what} is not valid JSON: {exc}") from None
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    problem = _problem(value, MAX_DEPTH, strings=_MAY_HOLD_SURROGATE.search(data) is not None)
    if problem is not None:
        raise bad(f"{what} {problem}")
    return value


async def raw_body(request: web.Request) -> bytes:
    """The body's bytes, at most ``MAX_BODY`` (413 with the same shape beyond it)."""
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise ApiError(413, BAD_REQUEST, f"the request body is larger than {MAX_BODY} bytes")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, BAD_REQUEST, f"the request body is larger than {MAX_BODY} bytes") from None


def parse(raw: bytes, what: str = "the request body") -> Fields:
    """An object body (an empty body reads as ``{}``)."""
    value = loads(raw, what) if raw.strip() else {}
    if not isinstance(value, dict):
        raise bad(f"{what} must be a JSON object, not {kind_of(value)}")
    return Fields(value, what)


async def read_json(request: web.Request) -> tuple[Fields, bytes]:
    """Read and parse in one step, for handlers that need no proof over the raw bytes first."""
    raw = await raw_body(request)
    return parse(raw), raw


class Fields:
    """Typed access to one JSON object's fields. Each accessor either returns a value of the promised type
    or raises ``400 tether.bad_request`` naming the field (``'ttl_s' must be a number, not a string``).
    An absent field gives ``default``; so does ``null`` where the accessor is ``nullable``."""

    def __init__(self, doc: Mapping[str, Any], where: str = "the request body") -> None:
        self.doc = dict(doc)
        self.where = where

    def __contains__(self, name: str) -> bool:
        return name in self.doc

    def _get(self, name: str, required: bool, nullable: bool) -> Any:
        value = self.doc.get(name, _MISSING)
        if value is None and nullable:
            value = _MISSING
        if value is _MISSING and required:
            raise bad(f"{self.where} needs '{name}'", field=name)
        return value

    @staticmethod
    def _wrong(name: str, expected: str, value: Any) -> ApiError:
        return bad(f"'{name}' must be {expected}, not {kind_of(value)}", field=name)

    def raw(self, name: str, default: Any = None) -> Any:
        """The field as sent, for a value a later check reads in full (a surface document, a chain)."""
        return self.doc.get(name, default)

    def string(self, name: str, default: str | None = None, *, required: bool = False, nullable: bool = True,
               max_len: int = 4096, non_empty: bool = False) -> str | None:
        value = self._get(name, required, nullable)
        if value is _MISSING:
            return default
        if not isinstance(value, str):
            raise self._wrong(name, "a string", value)
        if len(value) > max_len:
            raise bad(f"'{name}' is longer than {max_len} characters", field=name)
        if non_empty and not value:
            raise bad(f"'{name}' must not be empty", field=name)
        return value

    def number(self, name: str, default: float | None = None, *, required: bool = False, nullable: bool = False,
               minimum: float | None = None, maximum: float | None = None) -> float | None:
        """A finite JSON number (never a boolean, never a string such as ``"inf"``), within bounds."""
        value = self._get(name, required, nullable)
        if value is _MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._wrong(name, "a number", value)
        try:
            number = float(value)
        except OverflowError:  # an integer literal too large for a float
            number = math.inf
        if not math.isfinite(number):
            raise bad(f"'{name}' must be a finite number", field=name)
        return _bounded(name, number, minimum, maximum)

    def integer(self, name: str, default: int | None = None, *, required: bool = False, nullable: bool = False,
                minimum: int | None = None, maximum: int | None = None) -> int | None:
        value = self._get(name, required, nullable)
        if value is _MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._wrong(name, "an integer", value)
        return _bounded(name, value, minimum, maximum)

    def boolean(self, name: str, default: bool | None = None, *, required: bool = False,
                nullable: bool = False) -> bool | None:
        value = self._get(name, required, nullable)
        if value is _MISSING:
            return default
        if not isinstance(value, bool):
            raise self._wrong(name, "true or false", value)
        return value

    def obj(self, name: str, *, required: bool = False, nullable: bool = True) -> dict[str, Any] | None:
        value = self._get(name, required, nullable)
        if value is _MISSING:
            return None
        if not isinstance(value, dict):
            raise self._wrong(name, "an object", value)
        return value

    def objects(self, name: str, *, required: bool = False, max_items: int = 100_000) -> list[dict[str, Any]]:
        """A list of objects (absent or null: empty)."""
        value = self._get(name, required, True)
        if value is _MISSING:
            return []
        if not isinstance(value, list):
            raise self._wrong(name, "a list of objects", value)
        if len(value) > max_items:
            raise bad(f"'{name}' holds more than {max_items} items", field=name)
        for index, item in enumerate(value):
            if not isinstance(item, dict):
                raise bad(f"'{name}[{index}]' must be an object, not {kind_of(item)}", field=name)
        return value

    def strings(self, name: str, *, required: bool = False, max_items: int = 10_000) -> list[str]:
        """A list of strings (absent or null: empty)."""
        value = self._get(name, required, True)
        if value is _MISSING:
            return []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._wrong(name, "a list of strings", value)
        if len(value) > max_items:
            raise bad(f"'{name}' holds more than {max_items} items", field=name)
        return value

    def choice(self, name: str, options: tuple[str, ...], default: str | None = None, *,
               required: bool = False) -> str | None:
        value = self.string(name, default, required=required)
        if value is not None and value not in options:
            raise bad(f"'{name}' must be one of {', '.join(options)}", field=name)
        return value


def _bounded(name: str, value: Any, minimum: float | None, maximum: float | None) -> Any:
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if minimum is not None and maximum is not None:
            span = f"between {minimum:g} and {maximum:g}"
        else:
            span = f"at least {minimum:g}" if minimum is not None else f"at most {maximum:g}"
        raise bad(f"'{name}' must be {span}", field=name)
    return value


def query_number(request: web.Request, name: str, default: float) -> float:
    """A finite number from the query string."""
    text = request.query.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise bad(f"query parameter '{name}' must be a number", field=name) from None
    if not math.isfinite(value):
        raise bad(f"query parameter '{name}' must be a finite number", field=name)
    return value


def query_int(request: web.Request, name: str, default: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        if len(text) > 20:
            raise ValueError
        return int(text)
    except ValueError:
        raise bad(f"query parameter '{name}' must be an integer", field=name) from None


__all__ = ["MAX_BODY", "MAX_DEPTH", "Fields", "bad", "loads", "parse", "query_int", "query_number", "raw_body",
           "read_json"]
