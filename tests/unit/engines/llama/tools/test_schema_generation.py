"""Generated schemas, real generations: whatever the bundled model writes
under a schema's grammar validates against that schema (jsonschema), and
every schema llguidance refuses is a 400, never a 500.

Schemas are drawn by hypothesis from the constructs the grammar must get
right: nested objects, arrays with bounds, enums, anyOf, $ref, pattern,
string lengths, numeric bounds. Strings and arrays are bounded so that a
short generation can finish."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lmspd.core.errors import ApiError
from lmspd.engines.llama.grammars import json_schema_grammar
from support.grammar_rig import ModelRig

_strings = st.builds(
    lambda lo, span, pattern: {"type": "string", "minLength": lo, "maxLength": lo + span,
                               **({"pattern": pattern} if pattern else {})},
    st.integers(0, 2), st.integers(1, 6), st.sampled_from([None, "^[a-z]+$", "^[A-Z][a-z]*$", "[0-9]"]),
)
_integers = st.builds(
    lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
    st.integers(-50, 50), st.integers(0, 100),
)
_numbers = st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-5, 5))
_enums = st.lists(st.sampled_from(["red", "green", "blue", 1, 2, None, True]), min_size=1, max_size=4,
                  unique=True).map(lambda xs: {"enum": xs})
_leaves = st.one_of(_strings, _integers, _numbers, _enums, st.just({"type": "boolean"}))


def _objects(children):
    return st.dictionaries(st.sampled_from(["a", "b", "c", "name", "n"]), children, min_size=1, max_size=3).flatmap(
        lambda props: st.builds(
            lambda required: {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False},
            st.lists(st.sampled_from(sorted(props)), unique=True)))


_schemas = st.recursive(
    _leaves,
    lambda children: st.one_of(
        _objects(children),
        st.builds(lambda items, lo, span: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + span},
                  children, st.integers(0, 1), st.integers(0, 2)),
        st.lists(children, min_size=2, max_size=3).map(lambda xs: {"anyOf": xs}),
    ),
    max_leaves=5,
)


def _with_ref(schema: dict) -> dict:
    """The same shape, reached through a local $ref."""
    return {"$defs": {"inner": schema}, "type": "object", "properties": {"value": {"$ref": "#/$defs/inner"}},
            "required": ["value"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model() -> ModelRig:
    return ModelRig()


def chatml(user: str) -> str:
    return f"<|im_start|>system\nReply with JSON only.<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(schema=_schemas, ref=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_constrained_generations_validate(model, schema, ref: bool, seed: int) -> None:
    schema = _with_ref(schema) if ref else schema
    try:
        grammar = json_schema_grammar(schema)
    except ApiError as exc:
        assert 400 <= exc.status < 500  # refused up front, never a 500
        return
    text, ended = model.generate(chatml("Describe something as JSON: " + json.dumps(schema)), grammar, 96, seed=seed)
    # Cut off by the budget, there is nothing complete to validate (the prefix was
    # constrained): such an example does not count, so that the test cannot pass having
    # validated none.
    assume(ended)
    jsonschema.validate(json.loads(text), schema)
