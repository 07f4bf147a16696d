"""The API's one JSON reader and its typed fields (tether/controlplane/body.py), as pure functions."""

from __future__ import annotations

from typing import Any

import pytest

from tether.capability.errors import ApiError
from tether.controlplane.body import MAX_DEPTH, Fields, parse


def refused(call: Any) -> str:
    with pytest.raises(ApiError) as info:
        call()
    assert (info.value.http_status, info.value.code) == (400, "tether.bad_request")
    return info.value.message


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"a": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}", "nested too deeply"),
        (b'{"a": NaN}', "not valid JSON"),
        (b'{"a": -Infinity}', "not valid JSON"),
        (b'{"a": 1e400}', "not valid JSON"),
        (b'{"a": "\\ud800"}', "not valid Unicode"),
        (b'{"\\udfff": 1}', "not valid Unicode"),
        (b'{"a": "\\uDBff"}', "not valid Unicode"),
        (b'{"a": ["x", {"b": "\xed\xa0\x80"}]}', "not valid Unicode"),  # a surrogate's bytes, not an escape
        (b'{"a": "\\ud83d\\ude00", "b": "\\udc00"}', "not valid Unicode"),  # a good pair beside a lone one
        (b"\xc3\x28", "not valid JSON"),
        (b"[]", "must be a JSON object, not a list"),
        (b"null", "must be a JSON object, not null"),
    ],
)
def test_hostile_bodies_are_refused(raw: bytes, fragment: str) -> None:
    assert fragment in refused(lambda: parse(raw))


def test_what_only_looks_like_a_surrogate_is_read() -> None:
    """The reader looks for surrogates only where the raw text could hold one: a pair, an escaped backslash
    before "ud800", and other non-ASCII text are read as they are."""
    body = parse(b'{"pair": "\\ud83d\\ude00", "text": "\\\\ud800", "e": "\xc3\xa9"}')
    assert (body.string("pair"), body.string("text"), body.string("e")) == ("\U0001f600", "\\ud800", "\u00e9")


def test_what_is_read_is_typed() -> None:
    body = parse(b'{"s": "x", "n": 2, "i": 3, "b": true, "o": {"k": 1}, "l": [{"c": 1}], "z": null, '
                 b'"deep": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b', "e": "\\u00e9"}')
    assert (body.string("s"), body.number("n"), body.integer("i"), body.boolean("b")) == ("x", 2.0, 3, True)
    assert body.obj("o") == {"k": 1} and body.objects("l") == [{"c": 1}] and body.string("e") == "é"
    assert (body.string("absent", "d"), body.number("absent", 1.5), body.objects("z"), body.obj("z")) == (
        "d", 1.5, [], None)
    assert parse(b"").doc == {} and parse(b"  ").doc == {}


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda f: f.number("s"), "'s' must be a number, not a string"),
        (lambda f: f.number("b"), "'b' must be a number, not a boolean"),
        (lambda f: f.number("big"), "'big' must be a finite number"),
        (lambda f: f.number("z"), "'z' must be a number, not null"),
        (lambda f: f.number("n", maximum=1), "'n' must be at most 1"),
        (lambda f: f.number("n", minimum=5, maximum=9), "'n' must be between 5 and 9"),
        (lambda f: f.integer("f"), "'f' must be an integer, not a number"),
        (lambda f: f.string("n"), "'n' must be a string, not a number"),
        (lambda f: f.string("s", max_len=0), "'s' is longer than 0 characters"),
        (lambda f: f.string("missing", required=True), "needs 'missing'"),
        (lambda f: f.objects("n"), "'n' must be a list of objects"),
        (lambda f: f.objects("nums"), "'nums[0]' must be an object, not a number"),
        (lambda f: f.strings("nums"), "'nums' must be a list of strings"),
        (lambda f: f.choice("s", ("a", "b")), "'s' must be one of a, b"),
        (lambda f: f.boolean("n"), "'n' must be true or false"),
    ],
)
def test_ill_typed_fields_name_the_field(call: Any, fragment: str) -> None:
    fields = Fields({"s": "x", "b": True, "big": 10**400, "z": None, "n": 2, "f": 2.5, "nums": [1]})
    assert fragment in refused(lambda: call(fields))
