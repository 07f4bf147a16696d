"""The piecewise encoder must give exactly ``json.dumps``'s bytes: records are hashed and signed over it."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tether.capability import jsonpieces

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
documents = st.recursive(scalars, lambda inner: st.lists(inner, max_size=80) | st.dictionaries(st.text(), inner),
                         max_leaves=150)


def both(doc: Any, **options: Any) -> tuple[str, str]:
    expected = json.dumps(doc, sort_keys=True, separators=(",", ":"), **options)
    return jsonpieces.dumps(doc, **options), expected


@settings(max_examples=100, deadline=None)
@given(documents)
def test_any_document_encodes_exactly_as_json_dumps(doc: Any) -> None:
    got, expected = both(doc)
    assert got == expected
    got, expected = both(doc, ensure_ascii=False)
    assert got == expected


def test_a_record_sized_document_with_long_lists_is_identical() -> None:
    calls = [{"call_id": f"c{i}", "url": "http://é.example/x", "status": 200, "t": i / 7} for i in range(5000)]
    record = {"record_id": "r", "calls": calls, "nested": {"leases": [{"jti": str(i)} for i in range(100)]},
              "agents_terminated": [], "empty": {}}
    for ascii_only in (True, False):
        got, expected = both(record, ensure_ascii=ascii_only)
        assert got == expected


def test_a_verbatim_list_is_written_as_its_texts_and_only_when_asked() -> None:
    """``Verbatim`` (what the MCP list filter keeps of a list it read) is written as the texts it was read from;
    with ``verbatim=False``, and for ``json.dumps``, it is any list."""
    kept = jsonpieces.Verbatim()
    kept.extend([{"a": 1}, {"b": "\u00e9"}])
    kept.texts.extend(['{"a" :1}', '{"b": "\u00e9"}'])
    doc = {"result": {"tools": kept}, "id": 1}
    assert jsonpieces.dumps(doc, sort_keys=False, separators=(", ", ": ")) == \
        '{"result": {"tools": [{"a" :1}, {"b": "\u00e9"}]}, "id": 1}'
    plain = json.dumps(doc)
    assert jsonpieces.dumps(doc, sort_keys=False, separators=(", ", ": "), verbatim=False) == plain
    assert json.loads(plain) == {"result": {"tools": [{"a": 1}, {"b": "\u00e9"}]}, "id": 1}
