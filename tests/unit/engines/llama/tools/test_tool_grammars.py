"""JSON Schema and tool-call grammars: they compile, accept what is valid,
refuse what is not, and unenforceable schemas are refused up front."""

from __future__ import annotations

import datetime as dt
import enum
import json
import subprocess
import sys
import uuid
from typing import Annotated, Literal, Optional, Union

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from test_lark_grammar import APPLY_PATCH, PATCHES

from lmspd.core.conversation import CustomTool, FunctionTool, ToolCall
from lmspd.core.errors import ApiError
from lmspd.core.limits import Limits, RequestLimits
from lmspd.engines.llama.grammars import (
    check_json_schema,
    json_object_grammar,
    json_schema_grammar,
    lazy_tool_call_grammar,
    tool_call_grammar,
)
from lmspd.engines.llama.tool_formats import (
    FallbackFormat,
    HermesFormat,
    Llama3Format,
    MistralFormat,
    ToolFormat,
)

# --- JSON Schema -----------------------------------------------------------


class Color(str, enum.Enum):
    red = "red"
    blue = "blue"


class Cat(BaseModel):
    pet_type: Literal["cat"]
    meows: int = Field(ge=0)


class Dog(BaseModel):
    pet_type: Literal["dog"]
    barks: float = Field(ge=0)


class Node(BaseModel):
    name: str = Field(max_length=8)
    children: list["Node"] = Field(default_factory=list, max_length=3)


class Everything(BaseModel):
    title: str
    count: int
    ratio: Optional[float] = None
    color: Color
    tags: list[Annotated[str, Field(pattern=r"^[a-z]+$")]]
    pair: tuple[int, str]
    scores: dict[str, int]
    pet: Union[Cat, Dog] = Field(discriminator="pet_type")
    when: dt.datetime
    day: dt.date
    ident: uuid.UUID
    tree: Node
    flag: bool = False


# Properties in the schema's order, optional ones included where declared:
# the order llguidance's grammar enforces.
EVERYTHING_OK = {
    "title": "Ünïcode \"quoted\"",
    "count": -3,
    "ratio": None,
    "color": "blue",
    "tags": ["a", "bc"],
    "pair": [1, "x"],
    "scores": {"a": 1, "b": 2},
    "pet": {"pet_type": "dog", "barks": 2.5},
    "when": "2024-05-06T07:08:09Z",
    "day": "2024-05-06",
    "ident": "12345678-1234-1234-1234-123456789abc",
    "tree": {"name": "root", "children": [{"name": "kid", "children": []}]},
    "flag": True,
}


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def test_pydantic_schema_grammar_accepts_valid_and_refuses_invalid(rig) -> None:
    schema = Everything.model_json_schema()
    gbnf = json_schema_grammar(schema)
    assert rig.compiles(gbnf)
    assert rig.accepts(gbnf, _dumps(EVERYTHING_OK))
    bad = [
        {**EVERYTHING_OK, "color": "green"},
        {**EVERYTHING_OK, "tags": ["A"]},
        {**EVERYTHING_OK, "pet": {"pet_type": "cat", "meows": -1}},
        {**EVERYTHING_OK, "tree": {"name": "much too long", "children": []}},
        {**EVERYTHING_OK, "day": "2024-13-01"},
        {**EVERYTHING_OK, "extra": 1},
        {k: v for k, v in EVERYTHING_OK.items() if k != "title"},
    ]
    for value in bad:
        assert not rig.accepts(gbnf, _dumps(value)), value
    # A raw newline inside a string is not JSON.
    assert not rig.accepts(gbnf, _dumps(EVERYTHING_OK).replace("Ünïcode", "Ün\nïcode"))


SCHEMAS = [
    ({"type": "object"}, [{}, {"a": [1, {"b": None}]}], [[1], "x"]),
    ({"type": ["string", "null"]}, ["x", None], [1]),
    ({"enum": ["a", 1, None, {"k": [1]}]}, ["a", 1, None, {"k": [1]}], ["b"]),
    ({"type": "string", "enum": ["a", 2]}, ["a"], [2]),
    ({"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1, "maxItems": 2}, [[1], [1, 2]], [[], [0], [1, 2, 3]]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ["ab", 'a"', "éé"], ["a", "abcd"]),
    ({"type": "string", "pattern": "b+"}, ["abbc", "b"], ["ac"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, [{"a": 1, "b": "x"}], [{"a": 1}]),
    ({"type": "object", "additionalProperties": {"type": "boolean"}}, [{}, {"x": True}], [{"x": 1}]),
    ({"allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"properties": {"b": {"type": "string"}}}]}, [{"a": 1}, {"a": 1, "b": "x"}], [{"b": "x"}]),
    ({"$defs": {"n": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}]}}, "$ref": "#/$defs/n"}, [None, {"next": {"next": None}}], [{}]),
    ({"definitions": {"a": {"type": "integer"}}, "properties": {"x": {"$ref": "#/definitions/a"}, "y": {"$ref": "#/definitions/a"}}}, [{"x": 1, "y": 2}], [{"x": "1"}]),
    ({"type": "number", "minimum": 0}, [0, 1.5, 3e5], [-1]),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, ["x", 1], [None]),
    (True, [1, "x", None], []),
]


@pytest.mark.parametrize("schema, good, bad", SCHEMAS)
def test_schema_grammars(rig, schema, good, bad) -> None:
    gbnf = json_schema_grammar(schema)
    assert rig.compiles(gbnf), gbnf
    for value in good:
        assert rig.accepts(gbnf, _dumps(value)), (value, gbnf)
    for value in bad:
        assert not rig.accepts(gbnf, _dumps(value)), (value, gbnf)


def test_json_object_grammar(rig) -> None:
    gbnf = json_object_grammar()
    assert rig.compiles(gbnf)
    assert rig.accepts(gbnf, '{"a":[1,"x"]}')
    assert not rig.accepts(gbnf, "[1]")
    # Compact: no whitespace to spin in (see json_object_grammar).
    assert not rig.accepts(gbnf, '{"a": [1, "x"]}')


UNSUPPORTED = [
    ({"not": {"type": "string"}}, "not", "text.format.schema.not"),
    ({"properties": {"a": {"if": {}, "then": {}}}}, "if", "text.format.schema.properties.a.if"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "text.format.schema.uniqueItems"),
    ({"type": "array", "contains": {"const": 1}}, "contains", "text.format.schema.contains"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", "text.format.schema.dependentRequired"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames", "text.format.schema.propertyNames"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "oneOf", "text.format.schema.oneOf"),
    ({"$ref": "https://example.com/s.json"}, "$ref", "text.format.schema.$ref"),
    ({"type": "string", "pattern": "^(?=a)b$"}, "pattern", "text.format.schema.pattern"),
    ({"const": 5, "maximum": 3}, "maximum", "text.format.schema.maximum"),
    (False, "false", "text.format.schema"),
]

# Refused by the GBNF converter before llguidance; enforced now.
NOW_ENFORCED = [
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
     [{}, {"x1": 1}], [{"x1": "a"}, {"y": 1}]),
    ({"type": "integer", "multipleOf": 3}, [0, 9, -3], [1, 10]),
    ({"type": "number", "maximum": 10}, [10, -1.5, 9.99], [10.01, 11]),
    ({"type": "number", "minimum": 0.5}, [0.5, 2], [0.49, -1]),
    ({"type": "number", "minimum": -5}, [-5, 3.5], [-5.5, -6]),
    ({"type": "object", "minProperties": 2, "additionalProperties": {"type": "integer"}}, [{"a": 1, "b": 2}], [{}, {"a": 1}]),
    ({"$ref": "#/$defs/a", "maxLength": 3, "$defs": {"a": {"type": "string"}}}, ["abc"], ["abcd", 1]),
    ({"type": "string", "pattern": "a", "maxLength": 3}, ["a", "xay"], ["xxxa", "b"]),
    ({"properties": {"a": {"anyOf": [{"type": "string"}], "minLength": 1}}}, [{"a": "x"}], [{"a": ""}]),
]


@pytest.mark.parametrize("schema, good, bad", NOW_ENFORCED)
def test_keywords_llguidance_enforces(rig, schema, good, bad) -> None:
    grammar = json_schema_grammar(schema)
    for value in good:
        assert rig.accepts(grammar, _dumps(value)), (schema, value)
    for value in bad:
        assert not rig.accepts(grammar, _dumps(value)), (schema, value)


@pytest.mark.parametrize("schema, keyword, param", UNSUPPORTED)
def test_unenforceable_keywords_are_named(schema, keyword: str, param: str) -> None:
    with pytest.raises(ApiError) as info:
        json_schema_grammar(schema)
    err = info.value
    assert err.code == "unsupported_capability"
    assert repr(keyword) in err.message
    assert err.param == param


def test_annotations_and_unknown_keywords_are_fine() -> None:
    check_json_schema(
        {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "T",
            "description": "d",
            "examples": [{}],
            "$comment": "c",
            "x-vendor": 1,
            "type": "object",
            "properties": {"u": {"type": "string", "format": "uri", "default": "x", "deprecated": True},
                           "p": {"type": "string", "format": "password"}, "i": {"type": "integer", "format": "int64"}},
        }
    )


def test_schema_size_and_depth_are_bounded() -> None:
    small = Limits(request=RequestLimits(max_tool_schema_bytes=100, max_json_depth=3))
    with pytest.raises(ApiError) as info:
        check_json_schema({"type": "object", "description": "x" * 200}, limits=small)
    assert info.value.code == "invalid_request"
    deep: dict = {"type": "string"}
    for _ in range(5):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ApiError, match="deeper"):
        check_json_schema(deep, limits=Limits(request=RequestLimits(max_json_depth=3)))


# --- tool calls -------------------------------------------------------------

STRICT = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    FunctionTool("get_weather", "Weather", STRICT, strict=True),
    FunctionTool("loose", "No schema"),
    FunctionTool("odd", "Unenforceable but not strict", {"type": "object", "not": {}}),
    CustomTool("apply_patch", "Edit files", {"syntax": "lark", "definition": APPLY_PATCH}),
    CustomTool("free", "Anything"),
    CustomTool("digits", "Regex", {"syntax": "regex", "definition": r"\d+"}),
]
# What llguidance cannot compile is the request's 400, naming the line.
WEIRD = CustomTool("weird", "Unconvertible", {"syntax": "lark", "definition": 'start: "x" | b\nb: /a(?=b)/'})
FORMATS: dict[str, ToolFormat] = {
    "fallback": FallbackFormat(),
    "hermes": HermesFormat(True),
    "llama3": Llama3Format(True),
    "mistral": MistralFormat(True),
    "mistral_v11": MistralFormat(True, v11=True),
}
GOOD_CALLS = [
    ToolCall("c", "get_weather", '{"city": "Zürich \\"Z\\"", "unit": "c"}'),
    ToolCall("c", "loose", '{"anything": [1, {"x": null}]}'),
    ToolCall("c", "odd", "{}"),
    ToolCall("c", "apply_patch", PATCHES[0], kind="custom"),
    ToolCall("c", "free", "any text, even <tool_ and \"quotes\"\n", kind="custom"),
    ToolCall("c", "digits", "123", kind="custom"),
]


@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_forced_grammar_accepts_rendered_calls(rig, fmt_name: str) -> None:
    fmt = FORMATS[fmt_name]
    single = tool_call_grammar(fmt, TOOLS)
    parallel = tool_call_grammar(fmt, TOOLS, parallel=True)
    assert rig.compiles(single) and rig.compiles(parallel)
    for call in GOOD_CALLS:
        assert rig.accepts(single, fmt.render_calls([call])), (call, fmt.render_calls([call]))
    assert rig.accepts(parallel, fmt.render_calls(GOOD_CALLS))
    assert not rig.accepts(single, fmt.render_calls(GOOD_CALLS[:2]))


@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_forced_grammar_refuses_bad_calls(rig, fmt_name: str) -> None:
    fmt = FORMATS[fmt_name]
    gbnf = tool_call_grammar(fmt, TOOLS)
    bad = [
        ToolCall("c", "get_weather", '{"city": "Oslo"}'),
        ToolCall("c", "get_weather", '{"city": "Oslo", "unit": "k"}'),
        ToolCall("c", "loose", "[1]"),
        ToolCall("c", "nope", "{}"),
        ToolCall("c", "apply_patch", "not a patch", kind="custom"),
        ToolCall("c", "digits", "12a", kind="custom"),
    ]
    for call in bad:
        if call.name == "apply_patch" and not fmt.raw_custom:
            # Inside a JSON string the Lark grammar is not enforced (grammars docstring).
            assert rig.accepts(gbnf, fmt.render_calls([call]))
            continue
        assert not rig.accepts(gbnf, fmt.render_calls([call])), call
    assert not rig.accepts(gbnf, "Sure! " + fmt.render_calls(GOOD_CALLS[:1]))


@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_uncompilable_custom_grammar_is_a_400_naming_the_line(fmt_name: str) -> None:
    with pytest.raises(ApiError) as info:
        tool_call_grammar(FORMATS[fmt_name], [*TOOLS, WEIRD])
    assert info.value.status == 400 and info.value.param == "tools.weird.format.definition"
    assert "line 2" in info.value.message and "look-around" in info.value.message


def test_allowed_names_restrict_the_call(rig) -> None:
    fmt = HermesFormat(True)
    gbnf = tool_call_grammar(fmt, TOOLS, allowed_names=["loose"])
    assert rig.accepts(gbnf, fmt.render_calls([GOOD_CALLS[1]]))
    assert not rig.accepts(gbnf, fmt.render_calls([GOOD_CALLS[0]]))
    with pytest.raises(ApiError) as info:
        tool_call_grammar(fmt, TOOLS, allowed_names=["missing"])
    assert info.value.param == "tool_choice"


def test_strict_tool_with_unenforceable_schema_is_refused() -> None:
    tool = FunctionTool("f", None, {"type": "object", "properties": {"a": {"not": {}}}}, strict=True)
    with pytest.raises(ApiError) as info:
        tool_call_grammar(HermesFormat(True), [tool])
    assert info.value.code == "unsupported_capability"
    assert info.value.param == "tools.f.parameters.properties.a.not"


def test_free_text_raw_input_stops_at_the_closing_tag(rig) -> None:
    fmt = FallbackFormat()
    gbnf = tool_call_grammar(fmt, [CustomTool("free")])
    head = '<tool_call name="free">\n'
    assert rig.accepts(gbnf, head + "a </tool_ b\n</tool_call>")
    assert not rig.accepts(gbnf, head + "a</tool_call>b</tool_call>")


@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_lazy_grammar_leaves_text_free_and_constrains_the_call(rig, fmt_name: str) -> None:
    fmt = FORMATS[fmt_name]
    gbnf, patterns = lazy_tool_call_grammar(fmt, TOOLS)
    assert rig.compiles(gbnf)
    calls = fmt.render_calls(GOOD_CALLS[:2])
    lead = "" if fmt_name == "llama3" else "Let me check { the weather [TOOL_CALL <tool "
    if fmt_name == "llama3":
        assert rig.accepts(gbnf, calls, patterns=patterns)
        calls = "<|python_tag|>" + calls
        lead = "Let me check. "
    assert rig.accepts(gbnf, lead + calls, patterns=patterns)
    assert rig.accepts(gbnf, "No call at all { <tool_ca", patterns=patterns)
    head = {
        "fallback": "<tool_call>\n",
        "hermes": "<tool_call>\n",
        "llama3": "<|python_tag|>",
        "mistral": "[TOOL_CALLS][",
        "mistral_v11": "[TOOL_CALLS]",
    }[fmt_name]
    assert rig.rejects_after(gbnf, lead + head, "Hello there", patterns=patterns)


_LAZY_JUNK = r"""
import sys
sys.path.insert(0, "tests")
from support.grammar_rig import GrammarRig
from lmspd.core.conversation import FunctionTool
from lmspd.engines.llama.grammars import lazy_tool_call_grammar
from lmspd.engines.llama.tool_formats import FallbackFormat
rig = GrammarRig()
gbnf, patterns = lazy_tool_call_grammar(FallbackFormat(), [FunctionTool("f")])
# "calls" is one token: the trigger "<tool_call" arrives with an "s" the
# grammar cannot take, so the grammar must stay asleep (feeding it would
# abort the process).
print(rig.accepts(gbnf, "x <tool_calls are fun", patterns=patterns))
# Once triggered at a clean boundary, junk is refused, not fed.
print(rig.accepts(gbnf, "x <tool_call>Sure", patterns=patterns, complete=False))
"""


def test_lazy_trigger_with_junk_does_not_abort() -> None:
    proc = subprocess.run([sys.executable, "-c", _LAZY_JUNK], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "False"]


_arg_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.text(st.sampled_from(list('ab "\\é😀\n\t<>')), max_size=8)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(st.sampled_from(list("ab é")), max_size=4), inner, max_size=3),
    max_leaves=6,
)


_GRAMMARS: dict[str, str] = {}  # built once per format, reused by every example


@pytest.mark.parametrize("fmt_name", list(FORMATS))
@settings(max_examples=25, deadline=None)
@given(args=st.dictionaries(st.text(st.sampled_from(list('ab"é')), max_size=4), _arg_values, max_size=3), raw=st.text(st.sampled_from(list('ab \n"\\é<>/')), max_size=20))
def test_rendered_calls_round_trip_through_the_grammar(rig, fmt_name: str, args, raw: str) -> None:
    fmt = FORMATS[fmt_name]
    if fmt_name not in _GRAMMARS:
        _GRAMMARS[fmt_name] = tool_call_grammar(fmt, TOOLS, parallel=True)
    gbnf = _GRAMMARS[fmt_name]
    if fmt_name == "fallback" and "</tool_call>" in raw:
        return
    calls = [ToolCall("c", "loose", _dumps(args)), ToolCall("c", "free", raw, kind="custom")]
    assert rig.accepts(gbnf, fmt.render_calls(calls))



@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_max_calls_bounds_parallel_calls(rig, fmt_name: str) -> None:
    fmt = FORMATS[fmt_name]
    gbnf = tool_call_grammar(fmt, TOOLS, parallel=True, max_calls=2)
    assert rig.accepts(gbnf, fmt.render_calls(GOOD_CALLS[:2]))
    assert not rig.accepts(gbnf, fmt.render_calls(GOOD_CALLS[:3]))


_bounds = st.one_of(st.none(), st.integers(-1200, 1200))


@settings(max_examples=40, deadline=None)
@given(lo=_bounds, hi=_bounds, values=st.lists(st.integers(-3000, 3000) | st.sampled_from([0, -1, 1, 10**15, -(10**15)]), max_size=8))
def test_integer_ranges(rig, lo, hi, values) -> None:
    schema: dict = {"type": "integer"}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    if lo is not None and hi is not None and lo > hi:
        with pytest.raises(ApiError):
            json_schema_grammar(schema)
        return
    gbnf = json_schema_grammar(schema)
    for n in values + [v for v in (lo, hi) if v is not None]:
        inside = (lo is None or n >= lo) and (hi is None or n <= hi)
        assert rig.accepts(gbnf, str(n)) == inside, (schema, n)
    assert not rig.accepts(gbnf, "007")


@pytest.mark.parametrize(
    "schema, good, bad",
    [
        ({"type": "number", "minimum": 0, "maximum": 1}, ["0", "0.25", "1", "1.000", "0.999"], ["1.5", "1.01", "-0.1", "2", "1e0"]),
        ({"type": "number", "minimum": 1, "maximum": 5}, ["1", "4.99", "5.0", "3"], ["0.9", "5.1", "6"]),
        ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}, ["1", "9"], ["0", "10"]),
        ({"type": "integer", "minimum": 1.5, "maximum": 3.5}, ["2", "3"], ["1", "4"]),
    ],
)
def test_number_bounds(rig, schema, good, bad) -> None:
    gbnf = json_schema_grammar(schema)
    for text in good:
        assert rig.accepts(gbnf, text), (schema, text)
    for text in bad:
        assert not rig.accepts(gbnf, text), (schema, text)
