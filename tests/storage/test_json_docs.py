"""``json_docs``: what a writer encodes, the reader of the same kind parses back.

A property over JSON values (text with lone surrogates, brackets and quotes inside
strings, deep nesting, non-finite floats): ``encode`` either refuses with a
StructureError or gives bytes that ``parse`` returns equal; the nesting found on the
bytes is the value's; a repeated key is damage where the kind says so."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flax_orbax_plugin._errors import CorruptCheckpointError, StructureError
from flax_orbax_plugin._storage import local_files as json_docs

SMALL = json_docs.DocKind("test document", 2000, 6)

_text = st.text(
    alphabet=st.sampled_from(["a", '"', "\\", "[", "]", "{", "}", "\ud800", "é", "\U0001f600"]),
    max_size=8,
)
_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=30,
)


def _nesting(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_nesting, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_nesting, value.values()), default=0)
    return 0


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


@settings(max_examples=300, deadline=None)
@given(value=_values)
def test_what_encode_writes_parse_reads_back_and_what_it_refuses_parse_would(value):
    try:
        raw = json_docs.encode(value, "doc.json", SMALL)
    except StructureError as e:
        text = json.dumps(value)  # what a writer without the check would have written
        assert "doc.json" in str(e)
        with pytest.raises(CorruptCheckpointError, match="doc.json"):
            json_docs.parse(text.encode(), "doc.json", SMALL)
        return
    assert json_docs.depth(raw) == _nesting(value)
    assert json.dumps(json_docs.parse(raw, "doc.json", SMALL)) == json.dumps(value)


def test_brackets_and_escaped_quotes_inside_strings_do_not_count():
    raw = json.dumps({'a"[[[': ']]]]\\"{{', "b": [[1]]}).encode()
    assert json_docs.depth(raw) == 3
    with pytest.raises(CorruptCheckpointError, match=r"doc: nested 7 levels deep.*\(6\)"):
        json_docs.parse(b'{"x": "]]]]]]", "y": ' + b"[" * 6 + b"]" * 6 + b"}", "doc", SMALL)


def test_a_repeated_key_is_damage_where_the_kind_says_so():
    raw = b'{"a": 1, "b": {"c": 1, "c": 2}}'
    with pytest.raises(CorruptCheckpointError, match=r"doc: field 'c': expected once"):
        json_docs.parse(raw, "doc", SMALL)
    loose = json_docs.DocKind("loose", 2000, 6, unique_keys=False)
    assert json_docs.parse(raw, "doc", loose) == {"a": 1, "b": {"c": 2}}


@pytest.mark.parametrize("value", [1e300, -1.0, float("nan"), 10**400, True, "1"])
def test_times_past_what_a_date_holds_are_refused_both_ways(value):
    with pytest.raises(CorruptCheckpointError, match="doc: field t: expected a time"):
        json_docs.check_time(value, "doc", "t", stored=True)
    with pytest.raises(ValueError, match="doc: field t: expected a time"):
        json_docs.check_time(value, "doc", "t", stored=False)
    assert json_docs.check_time(json_docs.MAX_TIME, "doc", "t", stored=True) == json_docs.MAX_TIME


@pytest.mark.parametrize("value", [{"a": object()}, {"n": float("inf")}, {(1, 2): 3}])
def test_a_value_json_cannot_hold_is_a_structure_error_naming_the_document(value):
    with pytest.raises(StructureError, match="doc.json: cannot be stored as a test document"):
        json_docs.encode(value, "doc.json", SMALL)
