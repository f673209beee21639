"""Unbounded numbers keep their sixteen-digit bound, written once per range
under ``$defs`` (``grammars._share_numbers``: the same range inline in every
property made llguidance compile a 50-property schema in ~50-170 ms)."""

from __future__ import annotations

import json

import jsonschema
from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.engines.llama import grammars

M = 10**16 - 1


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def test_one_definition_per_distinct_range() -> None:
    schema = _obj({"a": {"type": "integer"}, "b": {"type": "integer", "description": "same range"},
                   "c": {"type": "integer", "minimum": 0}, "d": {"type": "number"},
                   "e": {"type": "integer", "multipleOf": 2},
                   "f": {"type": "array", "items": {"type": "integer", "minimum": 0}}})
    out = grammars._enforced(schema)
    defs = out["$defs"]
    assert sorted(defs.values(), key=json.dumps) == sorted([
        {"type": "integer", "minimum": -M, "maximum": M}, {"type": "integer", "minimum": 0, "maximum": M},
        {"type": "number", "minimum": -M, "maximum": M}], key=json.dumps)
    props = out["properties"]
    assert props["a"] == props["b"] and "$ref" in props["a"]
    assert props["c"] == props["f"]["items"] != props["a"]
    # Other keywords: inline, still bounded.
    assert props["e"] == {"type": "integer", "multipleOf": 2, "minimum": -M, "maximum": M}


def test_what_is_left_alone() -> None:
    number = {"type": "integer"}
    assert "$ref" not in grammars._enforced(number), "the root is never replaced"
    one_of = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
    assert grammars._enforced(one_of) == grammars._closed(one_of)  # llguidance checks oneOf branches by type
    own = _obj({"a": {"$ref": "#/$defs/lmspd_number_0"}})
    own["$defs"] = {"lmspd_number_0": {"type": "string"}}
    assert grammars._enforced(own)["$defs"] == own["$defs"], "a client's own name is never overwritten"


def test_the_bound_is_enforced_through_the_reference(rig) -> None:
    grammar = grammars.json_schema_grammar(_obj({f"n{i}": {"type": "integer"} for i in range(17)}))
    ok = {f"n{i}": (-1) ** i * (M if i % 2 else 7) for i in range(17)}
    assert rig.accepts(grammar, json.dumps(ok))
    # llguidance holds bounds as f64 (10**16 - 1 rounds to 10**16): 17 digits is the first refused length.
    too_long = dict(ok, n3=10**17)
    assert not rig.accepts(grammar, json.dumps(too_long))


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.sampled_from("abcdef"), st.sampled_from([
    {"type": "integer"}, {"type": "number"}, {"type": "integer", "minimum": 3},
    {"type": "integer", "maximum": 9, "title": "t"}, {"type": "string"},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 2}]), min_size=1))
def test_same_instances_valid_before_and_after(props: dict) -> None:
    """Sharing changes the grammar's layout, not the language: any instance
    valid against the closed schema is valid against the shared one, and back."""
    closed = grammars._closed(_obj(props))
    shared = grammars._enforced(_obj(props))
    samples = [0, 5, -7, M, M + 1, 2.5, "x", [1], [1, 2, 3]]
    for name in props:
        for value in samples:
            inst = {k: (value if k == name else 4) for k in props}
            if props[k := name].get("type") == "string":
                inst = {n: ("s" if props[n].get("type") == "string" else 4) for n in props}
                inst[k] = value
            assert jsonschema.Draft202012Validator(closed).is_valid(inst) == \
                jsonschema.Draft202012Validator(shared).is_valid(inst), (inst, shared)
