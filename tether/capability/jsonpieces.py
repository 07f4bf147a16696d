"""Canonical JSON (the one spelling every hash is taken over), encoded in pieces for large documents.

``canonical_json`` is the one canonical form: sorted keys, no spaces, UTF-8. Catalog hashes and record
hashes are both taken over it. ``dumps`` is byte for byte what one ``json.dumps`` call would give.

``json.dumps`` is a single C call that holds the GIL from its first byte to its last, so a worker thread
encoding a termination record of 20,000 calls (8 MB, a quarter of a second) stalls the event loop for all
of it: moving the work to a thread does not help by itself. Encoding a long list element by element gives
the interpreter a point between elements to hand the GIL to the loop (every ``sys.getswitchinterval()``,
5 ms), at the cost of one small call per element. Records are hashed over this encoding, so it must never
differ from ``json.dumps``: ``tests/test_jsonpieces.py`` holds it to that.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from typing import Any

LONG = 64  # lists longer than this are encoded one element at a time
DEPTH = 3  # how deep into nested objects long lists are looked for (a record's calls are one level down)


class Verbatim(list):  # type: ignore[type-arg]
    """A list written as ``texts`` (each element's JSON as it was read), not encoded again: what a filter keeps
    of a list it read (``proxy.mcp``). ``json.dumps`` of it encodes the elements as any list's."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []


def dumps(doc: Any, *, sort_keys: bool = True, separators: tuple[str, str] = (",", ":"),
          ensure_ascii: bool = True, verbatim: bool = True) -> str:
    """``json.dumps(doc)``, but a ``Verbatim`` list (unless not ``verbatim``) written as its texts."""
    encode = functools.partial(json.dumps, sort_keys=sort_keys, separators=separators, ensure_ascii=ensure_ascii)
    return "".join(_pieces(doc, encode, separators, sort_keys, DEPTH, verbatim))


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no spaces, UTF-8; a large document (a termination record) is encoded in pieces, so
    hashing it in a worker thread never holds the event loop."""
    return dumps(value, ensure_ascii=False).encode()


def _pieces(value: Any, encode: Callable[[Any], str], separators: tuple[str, str], sort_keys: bool,
            depth: int, verbatim: bool = True) -> Iterator[str]:
    item_sep, key_sep = separators
    if verbatim and isinstance(value, Verbatim) and len(value.texts) == len(value):
        yield "[" + item_sep.join(value.texts) + "]"
    elif depth > 0 and isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        yield "{"
        items = sorted(value.items()) if sort_keys else value.items()
        for n, (key, item) in enumerate(items):
            if n:
                yield item_sep
            yield encode(key)
            yield key_sep
            yield from _pieces(item, encode, separators, sort_keys, depth - 1, verbatim)
        yield "}"
    elif isinstance(value, list) and len(value) > LONG:
        yield "["
        for n, item in enumerate(value):
            if n:
                yield item_sep
            yield encode(item)  # one call per element: the GIL can change hands between them
        yield "]"
    else:
        yield encode(value)
