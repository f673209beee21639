"""The two syntaxes added with llguidance: gpt-oss's Harmony channels and
Qwen3-Coder's XML calls. Detection from their templates, parsing (any
chunking of an output gives the same calls, text and reasoning; markup never
leaks), rendering round trips, and grammars that accept what is rendered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.core.conversation import CustomTool, FunctionTool, ToolCall
from lmspd.core.events import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallDone, ToolCallStarted
from lmspd.engines.llama.grammars import lazy_tool_call_grammar, tool_call_grammar
from lmspd.engines.llama.tool_formats import (
    FallbackFormat,
    HarmonyFormat,
    HermesFormat,
    Llama3Format,
    MistralFormat,
    Qwen3CoderFormat,
    ToolCallError,
    detect_tool_format,
)
from lmspd.engines.llama.tool_formats.base import ParamBlocks

TEMPLATES = Path(__file__).resolve().parents[4] / "fixtures" / "templates"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [FunctionTool("get_weather", "Weather", WEATHER), CustomTool("apply_patch", "Patch")]

# Outputs in the shape the models write (transcribed from the formats' documentation).
HARMONY_OUT = (
    "<|channel|>analysis<|message|>The user wants the weather in Paris. I should call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris", "days": 2}'
)
HARMONY_FINAL = ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
                 "It is <b>sunny</b> in Paris.")
QWEN_OUT = (
    "Let me check that.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis <3\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=apply_patch>\n"
    "<parameter=input>\n*** Begin Patch\n*** Add File: a.txt\n+<tool_call> inside\n*** End Patch\n</parameter>\n"
    "</function>\n</tool_call>"
)


def _parse(fmt, chunks: list[str]):
    counter = iter(range(100))
    parser = fmt.parser(TOOLS, lambda: f"call_{next(counter)}")
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    started = [(e.index, e.name, e.kind) for e in events if isinstance(e, ToolCallStarted)]
    deltas: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            deltas[e.index] = deltas.get(e.index, "") + e.delta
    done = {e.index: e.payload for e in events if isinstance(e, ToolCallDone)}
    assert deltas == {i: p for i, p in done.items() if p or i in deltas}, "deltas add up to the payload"
    return text, reasoning, started, done


def _chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(max(c, 0), len(text)) for c in cuts})
    out, at = [], 0
    for p in points + [len(text)]:
        out.append(text[at:p])
        at = p
    return out


def test_detected_from_their_templates() -> None:
    assert isinstance(detect_tool_format((TEMPLATES / "gpt_oss_harmony.jinja").read_text()), HarmonyFormat)
    assert isinstance(detect_tool_format((TEMPLATES / "qwen3_coder.jinja").read_text()), Qwen3CoderFormat)


def test_harmony_channels() -> None:
    text, reasoning, started, done = _parse(HarmonyFormat(True), [HARMONY_OUT])
    assert reasoning == "The user wants the weather in Paris. I should call get_weather."
    assert text == "Checking the forecast."
    assert started == [(0, "get_weather", "function")]
    assert json.loads(done[0]) == {"city": "Paris", "days": 2}
    text, reasoning, started, _ = _parse(HarmonyFormat(True), [HARMONY_FINAL])
    assert (text, reasoning, started) == ("It is <b>sunny</b> in Paris.", "Easy.", [])


def test_harmony_recipient_before_the_channel_and_unknown_tools() -> None:
    out = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
    _, _, started, done = _parse(HarmonyFormat(True), [out])
    assert started == [(0, "get_weather", "function")] and json.loads(done[0]) == {"city": "Oslo"}
    with pytest.raises(ToolCallError):
        _parse(HarmonyFormat(True), ["<|channel|>commentary to=functions.nope <|message|>{}"])
    with pytest.raises(ToolCallError):
        _parse(HarmonyFormat(True), ["<|channel|>commentary to=functions.get_weather <|message|>[1]<|call|>"])


def test_qwen3_coder_calls() -> None:
    text, _, started, done = _parse(Qwen3CoderFormat(True), [QWEN_OUT])
    assert text == "Let me check that.\n"
    assert started == [(0, "get_weather", "function"), (1, "apply_patch", "custom")]
    # city is a string by the schema (kept raw); days is JSON.
    assert json.loads(done[0]) == {"city": "Paris <3", "days": 2}
    assert done[1] == "*** Begin Patch\n*** Add File: a.txt\n+<tool_call> inside\n*** End Patch"
    with pytest.raises(ToolCallError):
        _parse(Qwen3CoderFormat(True), ["<tool_call>\n<function=nope>\n</function>\n</tool_call>"])
    with pytest.raises(ToolCallError):
        _parse(Qwen3CoderFormat(True), ["<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"])


@pytest.mark.parametrize("fmt, out", [(HarmonyFormat(True), HARMONY_OUT), (HarmonyFormat(True), HARMONY_FINAL),
                                      (Qwen3CoderFormat(True), QWEN_OUT)])
@settings(max_examples=150, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_chunking_gives_the_same_result(fmt, out: str, cuts: list[int]) -> None:
    whole = _parse(fmt, [out])
    assert _parse(fmt, _chunked(out, cuts)) == whole
    text = whole[0]
    for marker in ("<|", "|>", "<tool_call", "<function=", "<parameter=", "</parameter", "</function"):
        assert marker not in text


@settings(max_examples=60, deadline=None)
@given(city=st.none() | st.text(st.sampled_from(list("ab <>é\n")), min_size=1, max_size=8),
       days=st.none() | st.integers(-5, 5))
def test_qwen3_coder_render_parse_round_trip(city, days) -> None:
    fmt = Qwen3CoderFormat(True)
    # Values as the schema types them; one newline at either end is syntax.
    args = {k: v for k, v in (("city", city), ("days", days)) if v is not None
            and not (isinstance(v, str) and (v.startswith("\n") or v.endswith("\n")))}
    call = ToolCall("c", "get_weather", json.dumps(args))
    _, _, started, done = _parse(fmt, [fmt.render_calls([call])])
    assert started == [(0, "get_weather", "function")] and json.loads(done[0]) == args


@pytest.mark.parametrize("fmt", [HarmonyFormat(True), Qwen3CoderFormat(True)])
def test_grammar_accepts_rendered_calls(rig, fmt) -> None:
    calls = [ToolCall("c", "get_weather", '{"city": "Paris", "days": 2}'),
             ToolCall("c", "apply_patch", "*** Begin Patch\n*** End Patch", kind="custom")]
    grammar = tool_call_grammar(fmt, TOOLS, specials=rig.specials(fmt))
    for call in calls:
        rendered = fmt.render_calls([call])
        assert rig.accepts(grammar, rendered), rendered
    lazy, triggers = lazy_tool_call_grammar(fmt, TOOLS, specials=rig.specials(fmt))
    assert rig.accepts(lazy, "Some text first. " + fmt.render_calls(calls[:1]), patterns=triggers)


def test_qwen3_coder_grammar_refuses_undeclared_parameters(rig) -> None:
    fmt = Qwen3CoderFormat(True)
    grammar = tool_call_grammar(fmt, TOOLS)
    bad = "<tool_call>\n<function=get_weather>\n<parameter=town>\nParis\n</parameter>\n</function>\n</tool_call>"
    assert not rig.accepts(grammar, bad)
    assert not rig.accepts(grammar, bad.replace("get_weather", "nope"))


def test_parameter_blocks_are_the_syntax_data_alone(rig) -> None:
    """The block-argument grammar reads only ``ParamBlocks``: another syntax
    that declares blocks gets a grammar of its own blocks (nothing of
    Qwen3-Coder's is assumed), and one that declares none gets JSON."""

    class Blocks(HermesFormat):
        param_blocks = ParamBlocks("<arg name=", ">", "</arg>")

    fmt = Blocks(True)
    grammar = tool_call_grammar(fmt, TOOLS[:1])
    before, after = fmt.call_parts("get_weather", raw=False)
    assert rig.accepts(grammar, f"{before}<arg name=city>Paris</arg><arg name=days>2</arg>{after}")
    assert not rig.accepts(grammar, f"{before}<parameter=city>\nParis\n</parameter>\n{after}")
    assert not rig.accepts(grammar, before + '{"city": "Paris"}' + after)
    json_args = tool_call_grammar(HermesFormat(True), TOOLS[:1])
    assert rig.accepts(json_args, before + '{"city": "Paris"}' + after)
    every = (FallbackFormat, HarmonyFormat, HermesFormat, Llama3Format, MistralFormat, Qwen3CoderFormat)
    assert [cls for cls in every if cls.param_blocks is not None] == [Qwen3CoderFormat]


# Parameters whose schemas admit a string beside other types, or say their
# type only through anyOf, an enum or a const: the raw text is typed by them.
TYPED = {"type": "object", "properties": {
    "note": {"type": ["string", "null"]},                                   # Optional[str], as pydantic writes it
    "label": {"anyOf": [{"type": "string"}, {"type": "null"}]},             # Optional[str], anyOf
    "code": {"enum": ["01", "02", "10"]},                                   # an enum of strings, no type
    "level": {"enum": [1, 2, 3]},                                           # an enum of integers
    "limit": {"type": ["integer", "string"]},
    "flag": {"type": "boolean"},
    "ratio": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    "mode": {"const": "fast"},
    "free": {},
    "color": {"anyOf": [{"$ref": "#/$defs/Color"}, {"type": "null"}]},   # pydantic's Optional[StrEnum]
    "size": {"$ref": "#/definitions/Size"},
    "count": {"type": ["integer", "null"]},
    "weight": {"type": "number"},
}, "$defs": {"Color": {"enum": ["1", "2", "red"], "type": "string"}},
   "definitions": {"Size": {"type": "integer"}}}


def _typed_args(body: str) -> dict:
    fmt = Qwen3CoderFormat(True)
    parser = fmt.parser([FunctionTool("typed", "T", TYPED)], lambda: "c")
    events = parser.feed(f"<tool_call>\n<function=typed>\n{body}</function>\n</tool_call>") + parser.finish()
    (done,) = [e for e in events if isinstance(e, ToolCallDone)]
    return json.loads(done.payload)


@pytest.mark.parametrize("name, raw, value", [
    ("note", "1234", "1234"), ("note", "true", "true"), ("note", "null", None), ("note", "[1]", "[1]"),
    ("label", "1234", "1234"), ("label", "null", None),
    ("code", "01", "01"), ("code", "10", "10"),
    ("level", "2", 2),
    ("limit", "5", 5), ("limit", "all", "all"), ("limit", '"5"', '"5"'),
    ("flag", "true", True), ("flag", "False", False),
    ("ratio", "0.5", 0.5), ("ratio", "null", None),
    ("mode", "fast", "fast"),
    ("free", "3", 3), ("free", "three", "three"),
    ("color", "1", "1"), ("color", "null", None), ("size", "3", 3),
    ("count", "None", None), ("count", "4", 4), ("note", "None", "None"),
    ("weight", "NaN", "NaN"), ("weight", "Infinity", "Infinity"), ("free", "-Infinity", "-Infinity"),
])
def test_qwen3_coder_types_values_by_what_the_schema_admits(name: str, raw: str, value) -> None:
    assert _typed_args(f"<parameter={name}>\n{raw}\n</parameter>\n") == {name: value}


def test_qwen3_coder_keeps_the_first_value_of_a_parameter_given_twice() -> None:
    """It was two keys in one JSON object ({"note": "a", "note": "b"}), which
    a strict decoder refuses and others resolve as they please; the first
    value has streamed already, so it stands, and the arguments stay JSON
    with one key each (not an invalid call: the tool-call grammar admits a
    repeated parameter, and a constrained turn would fail)."""
    fmt = Qwen3CoderFormat(True)
    parser = fmt.parser([FunctionTool("typed", "T", TYPED)], lambda: "c")
    body = "<parameter=note>\na\n</parameter>\n<parameter=level>\n2\n</parameter>\n<parameter=note>\nb\n</parameter>\n"
    events = parser.feed(f"<tool_call>\n<function=typed>\n{body}</function>\n</tool_call>") + parser.finish()
    (done,) = [e for e in events if isinstance(e, ToolCallDone)]
    assert done.payload == '{"note": "a", "level": 2}'
    deltas = "".join(e.delta for e in events if isinstance(e, ToolCallDelta))
    assert deltas == done.payload
    # Per call: the next call may give it again.
    assert _typed_args("<parameter=note>\nb\n</parameter>\n") == {"note": "b"}


@settings(max_examples=150, deadline=None)
@given(args=st.fixed_dictionaries({}, optional={
    "note": st.none() | st.text(st.sampled_from(list("ab1 <>")), min_size=1, max_size=6),
    "code": st.sampled_from(["01", "02", "10"]),
    "level": st.sampled_from([1, 2, 3]),
    "limit": st.integers(-5, 5) | st.text(st.sampled_from(list("ab ")), min_size=1, max_size=4),
    "flag": st.booleans(),
    "ratio": st.none() | st.floats(-2, 2, allow_nan=False).map(lambda f: round(f, 3)),
}))
def test_qwen3_coder_typed_round_trip(args: dict) -> None:
    """What a rendered call holds, parsed back, is the arguments it was
    rendered from: the text of a string parameter is never read as JSON
    (except ``null`` of an optional string, which is None)."""
    if isinstance(args.get("note"), str) and args["note"].strip() == "null":
        return
    fmt = Qwen3CoderFormat(True)
    call = ToolCall("c", "typed", json.dumps(args))
    parser = fmt.parser([FunctionTool("typed", "T", TYPED)], lambda: "c")
    events = parser.feed(fmt.render_calls([call])) + parser.finish()
    (done,) = [e for e in events if isinstance(e, ToolCallDone)]
    assert json.loads(done.payload) == args
