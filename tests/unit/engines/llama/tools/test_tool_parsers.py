"""Incremental tool-call parsers: any chunking gives the same calls and text."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from lmspd.core.conversation import CustomTool, FunctionTool, ToolCall, ToolOutput, member_name
from lmspd.core.events import TextDelta, ToolCallDelta, ToolCallDone, ToolCallStarted
from lmspd.engines.llama.tool_formats import (
    FallbackFormat,
    HarmonyFormat,
    HermesFormat,
    Llama3Format,
    MistralFormat,
    Qwen3CoderFormat,
    ToolCallError,
    ToolFormat,
    detect_tool_format,
)
from lmspd.engines.llama.tool_formats.base import dumps

TOOLS = [
    FunctionTool("get_weather", "Weather for a city", {"type": "object", "properties": {"city": {"type": "string"}}}),
    FunctionTool("lookup", "Look something up"),
    FunctionTool("ns__search", "Namespaced", namespace="ns"),
    CustomTool("apply_patch", "Edit files"),
    CustomTool("ns__exec", "Namespaced freeform", namespace="ns"),
]
FUNCTIONS = [t.name for t in TOOLS if isinstance(t, FunctionTool)]
CUSTOMS = [t.name for t in TOOLS if isinstance(t, CustomTool)]
# The model writes a tool's declared name; its call carries the member's
# own name and the namespace apart.
CALLED = {t.name: (member_name(t), t.namespace) for t in TOOLS}

FORMATS: dict[str, ToolFormat] = {
    "fallback": FallbackFormat(),
    "hermes": HermesFormat(native=True),
    "llama3": Llama3Format(native=True),
    "mistral": MistralFormat(native=True),
    "mistral_v11": MistralFormat(native=True, v11=True),
}
MARKUP = ["<tool_call", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"]


# --- strategies -----------------------------------------------------------

_chars = st.sampled_from(list('ab Z09é😀"\\/<>{}[];,:_\n\t') + ["tool", "call", "<tool_ca", "</tool_", "[TOOL_CALL", "<|python_ta", "[ARG"])
texts = st.lists(_chars, max_size=12).map("".join)
_keys = st.text(st.sampled_from(list('ab"\\é😀 \n')), max_size=5)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**9), 10**9),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(st.sampled_from(list('xy "\\/é😀\n\t\x01}{][<>')), max_size=10),
)
_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=3), max_leaves=6
)


@st.composite
def arguments(draw) -> str:
    value = draw(st.dictionaries(_keys, _values, max_size=4))
    indent = draw(st.sampled_from([None, 2]))
    separators = draw(st.sampled_from([None, (",", ":"), (", ", ": ")]))
    return json.dumps(value, ensure_ascii=draw(st.booleans()), indent=indent, separators=separators)


raw_inputs = st.lists(st.sampled_from(list("ab \n\"\\<>/é") + ["</tool_", "tool_call", "\n\n"]), max_size=12).map("".join)


@st.composite
def calls(draw) -> ToolCall:
    if draw(st.booleans()):
        return ToolCall("", draw(st.sampled_from(FUNCTIONS)), draw(arguments()))
    return ToolCall("", draw(st.sampled_from(CUSTOMS)), draw(raw_inputs), kind="custom")


# A model's output: text, and groups of parallel calls.
Segment = str | list[ToolCall]


@st.composite
def outputs(draw) -> list[Segment]:
    segments: list[Segment] = []
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            segments.append(draw(texts))
        segments.append(draw(st.lists(calls(), min_size=1, max_size=3)))
    if draw(st.booleans()):
        segments.append(draw(texts))
    return segments


@st.composite
def chunkings(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# --- rendering a case in a format -----------------------------------------


@dataclass
class Case:
    text: str
    visible: str
    calls: list[ToolCall]


def _clean(text: str) -> bool:
    return not any(m in text for m in MARKUP)


def render(fmt_name: str, segments: list[Segment]) -> Case | None:
    """The model text for ``segments``, or None where the format cannot say it."""
    fmt = FORMATS[fmt_name]
    out, visible, all_calls = [], [], []
    after_call = False
    for pos, seg in enumerate(segments):
        if isinstance(seg, str):
            if not _clean(seg):
                return None
            shown = seg.lstrip(" \t\r\n;" if fmt_name == "llama3" else " \t\r\n") if after_call else seg
            if after_call and fmt_name == "llama3" and shown.startswith("{"):
                return None
            if fmt_name == "llama3" and pos == 0 and seg.lstrip().startswith("{"):
                return None
            out.append(seg)
            visible.append(shown)
            after_call = False
            continue
        group = seg
        # The raw syntax cannot carry its own closing tag.
        if fmt_name == "fallback" and any(c.kind == "custom" and "</tool_call>" in c.payload for c in group):
            return None
        rendered = fmt.render_calls(group)
        if fmt_name == "llama3" and (pos > 0 or rendered.startswith(" ")):
            rendered = "<|python_tag|>" + rendered
        out.append(rendered)
        all_calls += group
        after_call = True
    return Case("".join(out), "".join(visible), all_calls)


# --- running a parser ----------------------------------------------------


def run(fmt: ToolFormat, chunks: list[str], tools=TOOLS) -> list:
    counter = iter(range(10_000))
    parser = fmt.parser(tools, lambda: f"call_{next(counter)}")
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    return events


def summarize(events: list) -> tuple[str, list[tuple]]:
    """Visible text and calls, checking the event-order contract on the way."""
    text, calls_seen = [], []
    open_call = None
    for ev in events:
        if isinstance(ev, TextDelta):
            assert open_call is None, "text inside a call"
            assert _clean(ev.text), f"markup leaked into text: {ev.text!r}"
            text.append(ev.text)
        elif isinstance(ev, ToolCallStarted):
            assert open_call is None
            assert ev.index == len(calls_seen)
            open_call = [ev, []]
        elif isinstance(ev, ToolCallDelta):
            assert open_call is not None and ev.index == open_call[0].index
            open_call[1].append(ev.delta)
        elif isinstance(ev, ToolCallDone):
            assert open_call is not None and ev.index == open_call[0].index
            started, deltas = open_call
            assert "".join(deltas) == ev.payload
            calls_seen.append((started.name, started.kind, started.namespace, ev.payload, started.call_id))
            open_call = None
        else:  # pragma: no cover
            raise AssertionError(f"unexpected event {ev!r}")
    assert open_call is None
    return "".join(text), calls_seen


def expected_calls(case: Case) -> list[tuple]:
    return [
        (CALLED[c.name][0], c.kind, CALLED[c.name][1], c.payload, f"call_{i}") for i, c in enumerate(case.calls)
    ]


@pytest.mark.parametrize("fmt_name", list(FORMATS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_chunking_gives_the_same_calls_and_text(fmt_name: str, data) -> None:
    case = render(fmt_name, data.draw(outputs()))
    assume(case is not None)
    assert case is not None
    event(f"{len(case.calls)} calls, {'with' if case.visible else 'no'} text")
    fmt = FORMATS[fmt_name]
    whole = summarize(run(fmt, [case.text]))
    assert whole == (case.visible, expected_calls(case))
    chunks = data.draw(chunkings(case.text))
    assert summarize(run(fmt, chunks)) == whole
    # One character at a time is the hardest split of all.
    assert summarize(run(fmt, list(case.text))) == whole


@pytest.mark.parametrize("fmt_name", list(FORMATS))
@settings(max_examples=60, deadline=None)
@given(name=st.text(st.sampled_from(list("abcdefghijklmnopqrstuvwxyz_")), min_size=1, max_size=12), data=st.data())
def test_undeclared_names_raise(fmt_name: str, name: str, data) -> None:
    declared = {t.name for t in TOOLS}
    if name in declared:
        return
    text = FORMATS[fmt_name].render_calls([ToolCall("x", name, '{"a": 1}')])
    if fmt_name == "fallback" and data.draw(st.booleans()):
        text = f'<tool_call name="{name}">\nraw\n</tool_call>'
    events = []
    with pytest.raises(ToolCallError):
        counter = iter(range(100))
        parser = FORMATS[fmt_name].parser(TOOLS, lambda: f"c{next(counter)}")
        for chunk in data.draw(chunkings(text)):
            events += parser.feed(chunk)
        events += parser.finish()
    assert not any(isinstance(e, ToolCallStarted) for e in events)


@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_a_declared_prefix_is_not_enough(fmt_name: str) -> None:
    """``lookup`` is declared; ``lookupEvil`` must not start a ``lookup`` call."""
    text = FORMATS[fmt_name].render_calls([ToolCall("x", "lookupEvil", "{}")])
    parser = FORMATS[fmt_name].parser(TOOLS, lambda: "c")
    seen = []
    with pytest.raises(ToolCallError, match="lookupEvil"):
        for ch in text:
            seen += parser.feed(ch)
        parser.finish()
    assert not any(isinstance(e, ToolCallStarted) for e in seen)


def _feed_all(fmt: ToolFormat, text: str, tools=TOOLS) -> list:
    return run(fmt, [text], tools)


@pytest.mark.parametrize(
    "fmt_name, text",
    [
        ("fallback", "<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"a\": 1}"),
        ("fallback", '<tool_call name="apply_patch">\nabc'),
        ("fallback", "<tool_call>\n{\"arguments\": {}}\n</tool_call>"),
        ("fallback", "<tool_call>\n[1, 2]\n</tool_call>"),
        ("fallback", "<tool_call>\n{\"name\": \"lookup\", \"arguments\": [1]}\n</tool_call>"),
        ("fallback", "<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"a\": tru}}\n</tool_call>"),
        ("fallback", "<tool_call>\n{\"name\": \"lookup\", \"arguments\": {}}\nextra</tool_call>"),
        ("hermes", "<tool_call>\n{\"name\": \"apply_patch\", \"arguments\": {\"patch\": \"x\"}}\n</tool_call>"),
        ("hermes", "<tool_call>\n{\"name\": \"lookup\", \"arguments\": \"{\\\"a\\\": \\ud800\"}\n</tool_call>"),
        ("llama3", "<|python_tag|>brave_search.call(query=\"x\")"),
        ("mistral", "[TOOL_CALLS][{\"name\": \"lookup\", \"arguments\": {}} oops"),
        ("mistral", "[TOOL_CALLS]"),
        ("mistral_v11", "[TOOL_CALLS]lookup"),
    ],
)
def test_unparseable_calls_raise(fmt_name: str, text: str) -> None:
    with pytest.raises(ToolCallError):
        _feed_all(FORMATS[fmt_name], text)


def test_text_is_released_promptly_and_a_trigger_prefix_is_held() -> None:
    parser = FallbackFormat().parser(TOOLS, lambda: "c")
    assert parser.feed("Hello <tool_ca") == [TextDelta("Hello ")]
    assert parser.feed("t") == [TextDelta("<tool_cat")]
    assert parser.feed("<") == []
    assert parser.finish() == [TextDelta("<")]


def test_events_stream_as_the_call_arrives() -> None:
    parser = HermesFormat(True).parser(TOOLS, lambda: "call_1")
    assert parser.feed('<tool_call>\n{"name": "get_wea') == []
    assert parser.feed('ther", "arguments": {"ci') == [
        ToolCallStarted(0, "call_1", "get_weather", "function", None),
        ToolCallDelta(0, '{"ci'),
    ]
    assert parser.feed('ty": "Paris"}}\n</tool_call>\n\n Done') == [
        ToolCallDelta(0, 'ty": "Paris"}'),
        ToolCallDone(0, '{"city": "Paris"}'),
        TextDelta("Done"),
    ]


def test_string_encoded_arguments_are_decoded() -> None:
    text = '<tool_call>\n{"name": "lookup", "arguments": "{\\"q\\": \\"\\u00e9\\"}"}\n</tool_call>'
    _, calls_seen = summarize(_feed_all(HermesFormat(True), text))
    assert calls_seen[0][3] == '{"q": "é"}'


def test_arguments_before_the_name() -> None:
    text = '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
    events = _feed_all(HermesFormat(True), text)
    assert summarize(events)[1][0][:4] == ("get_weather", "function", None, '{"city": "Oslo"}')


def test_missing_arguments_mean_an_empty_object() -> None:
    events = _feed_all(Llama3Format(True), '{"name": "lookup"}')
    assert summarize(events)[1][0][3] == "{}"


def test_custom_tool_unwrapped_under_a_json_syntax() -> None:
    text = '[TOOL_CALLS][{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n\\"x\\"\\n"}, "id": "abcdefghi"}]'
    events = _feed_all(MistralFormat(True), text)
    assert summarize(events)[1][0][:4] == ("apply_patch", "custom", None, '*** Begin Patch\n"x"\n')


def test_fallback_function_in_raw_form_is_accepted() -> None:
    text = '<tool_call name="lookup">\n{"q": 1}\n</tool_call>'
    assert summarize(_feed_all(FallbackFormat(), text))[1][0][3] == '{"q": 1}'


@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_namespaced_calls_carry_the_namespace(fmt_name: str) -> None:
    fmt = FORMATS[fmt_name]
    text = fmt.render_calls([ToolCall("x", "ns__search", '{"q": "a"}'), ToolCall("y", "ns__exec", "ls", kind="custom")])
    if fmt_name == "llama3":
        text = "<|python_tag|>" + text
    calls_seen = summarize(_feed_all(fmt, text))[1]
    assert [c[:3] for c in calls_seen] == [("search", "function", "ns"), ("exec", "custom", "ns")]


def test_llama3_json_text_that_is_not_a_call_stays_text() -> None:
    text = '{"answer": 42}'
    assert summarize(_feed_all(Llama3Format(True), text)) == (text, [])


def test_whitespace_between_calls_is_not_text() -> None:
    fmt = FallbackFormat()
    one = fmt.render_calls([ToolCall("x", "lookup", "{}")])
    text, calls_seen = summarize(_feed_all(fmt, f"Let me look.\n{one}\n\n  {one}\n"))
    assert text == "Let me look.\n" and len(calls_seen) == 2


SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}"
    "{{- '<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>' }}{%- endif %}"
)
LLAMA_TEMPLATE = "{{- '<|start_header_id|>' }}{%- if tools %}{{- '<|python_tag|>' }}{%- endif %}"
MISTRAL_TEMPLATE = "{%- if tools %}[AVAILABLE_TOOLS]{%- endif %}[TOOL_CALLS]"
MISTRAL_V11_TEMPLATE = "{%- if tools %}[AVAILABLE_TOOLS]{%- endif %}[TOOL_CALLS]{{ name }}[ARGS]"


@pytest.mark.parametrize(
    "template, name, native",
    [
        (None, "fallback", False),
        (SMOL_TEMPLATE, "fallback", False),
        (QWEN_TEMPLATE, "hermes", True),
        (LLAMA_TEMPLATE, "llama3", True),
        (MISTRAL_TEMPLATE, "mistral", True),
        (MISTRAL_V11_TEMPLATE, "mistral", True),
    ],
)
def test_detection(template: str | None, name: str, native: bool) -> None:
    fmt = detect_tool_format(template)
    assert (fmt.name, fmt.native) == (name, native)
    if template is MISTRAL_V11_TEMPLATE:
        assert isinstance(fmt, MistralFormat) and fmt.v11


def test_fallback_prompt_pieces() -> None:
    fmt = FallbackFormat()
    block = fmt.system_block(TOOLS)
    for tool in TOOLS:
        assert f"## {tool.name}" in block
    assert '<tool_call name="<tool name>">' in block and '"arguments"' in block
    out = fmt.render_outputs([ToolOutput("call_1", "21 C")], {"call_1": "get_weather"})
    assert out == '<tool_response call_id="call_1" name="get_weather">\n21 C\n</tool_response>'


def test_template_helpers() -> None:
    fmt = MistralFormat(True)
    tool_calls = fmt.template_tool_calls(
        [ToolCall("call_abc", "lookup", '{"q": 1}'), ToolCall("call_def", "apply_patch", "raw", kind="custom")]
    )
    assert tool_calls[0]["function"] == {"name": "lookup", "arguments": {"q": 1}}
    assert tool_calls[1]["function"]["arguments"] == {"input": "raw"}
    assert len(tool_calls[0]["id"]) == 9 and tool_calls[0]["id"].isalnum()
    listed = fmt.template_tools(TOOLS)
    assert listed[-1]["function"]["parameters"]["properties"]["input"]["type"] == "string"



# --- argument deltas add up to the final arguments -------------------------
#
# A streaming client sees a call's arguments only as its deltas; a
# non-streaming one sees the ``ToolCallDone`` payload. They must agree for
# every syntax, every way the model may spell the arguments (a JSON object,
# a JSON string holding one, left out, the raw ``<tool_call name=...>``
# form) and every split of the text into tokens.

DELTA_FORMATS: dict[str, ToolFormat] = {
    **FORMATS,
    "harmony": HarmonyFormat(native=True),
    "qwen3_coder": Qwen3CoderFormat(native=True),
}
_TAGGED = ("fallback", "hermes")


@st.composite
def spelled_calls(draw, fmt_name: str) -> tuple[str, list[str | None]]:
    """Model text holding 1-3 calls, and each call's expected payload."""
    expected: list[str | None] = []
    if fmt_name == "qwen3_coder":
        # One block per parameter: names are plain words, values raw text
        # (retyped by the schema, so only the empty call's payload is known).
        group: list[ToolCall] = []
        for _ in range(draw(st.integers(1, 3))):
            if draw(st.booleans()):
                group.append(ToolCall("", draw(st.sampled_from(CUSTOMS)), draw(raw_inputs), kind="custom"))
                expected.append(group[-1].payload)
            else:
                params = draw(st.dictionaries(st.sampled_from(["city", "days", "q"]), _values, max_size=3))
                group.append(ToolCall("", draw(st.sampled_from(FUNCTIONS)), dumps(params)))
                expected.append(None if params else "{}")
        return DELTA_FORMATS[fmt_name].render_calls(group), expected
    pieces: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        custom = draw(st.booleans())
        name = draw(st.sampled_from(CUSTOMS if custom else FUNCTIONS))
        payload = draw(raw_inputs) if custom else draw(arguments())
        spellings = ["plain", "string"]
        if fmt_name not in ("mistral_v11", "harmony"):
            spellings.append("missing")
        if fmt_name in _TAGGED and not (custom and "</tool_call>" in payload):
            spellings.append("raw")
        spelling = draw(st.sampled_from(spellings))
        if spelling == "missing":
            payload = "" if custom else "{}"
            args = None
        elif custom:
            args = payload if spelling == "raw" else dumps({"input": payload}) if draw(st.booleans()) else dumps(payload)
        else:
            args = dumps(payload) if spelling == "string" or (spelling == "raw" and draw(st.booleans())) else payload
        expected.append(payload)
        if spelling == "raw":
            pad = draw(st.sampled_from(["", " ", "\n", " \n\t"])) if not custom else ""
            pieces.append(f'<tool_call name="{name}">\n{pad}{args}{pad}\n</tool_call>')
            continue
        if fmt_name == "mistral_v11":
            pieces.append(f"[TOOL_CALLS]{name}[ARGS]{args}")
            continue
        if fmt_name == "harmony":
            before, after = DELTA_FORMATS[fmt_name].call_parts(name, raw=False)
            pieces.append(before + str(args) + after)
            continue
        members = [f'"name": {dumps(name)}']
        if args is not None:
            key = "parameters" if fmt_name == "llama3" else "arguments"
            members.insert(draw(st.integers(0, 1)), f"{dumps(key)}: {args}")
        obj = "{" + ", ".join(members) + "}"
        pieces.append(f"<tool_call>\n{obj}\n</tool_call>" if fmt_name in _TAGGED else obj)
    if fmt_name == "llama3":
        return "<|python_tag|>" + "\n".join(pieces), expected
    if fmt_name == "mistral":
        return "[TOOL_CALLS][" + ", ".join(pieces) + "]", expected
    sep = {"mistral_v11": "", "harmony": "<|start|>assistant"}.get(fmt_name, "\n")
    return sep.join(pieces), expected


def deltas_and_payloads(events: list) -> list[tuple[str, str]]:
    """Per call, in order: its argument deltas joined, and its final payload."""
    deltas: dict[int, list[str]] = {}
    out = []
    for ev in events:
        if isinstance(ev, ToolCallStarted):
            deltas[ev.index] = []
        elif isinstance(ev, ToolCallDelta):
            deltas[ev.index].append(ev.delta)
        elif isinstance(ev, ToolCallDone):
            out.append(("".join(deltas.pop(ev.index)), ev.payload))
    assert not deltas, "a call was started and never done"
    return out


@pytest.mark.parametrize("fmt_name", list(DELTA_FORMATS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_argument_deltas_add_up_to_the_final_arguments(fmt_name: str, data) -> None:
    text, expected = data.draw(spelled_calls(fmt_name))
    fmt = DELTA_FORMATS[fmt_name]
    for chunks in ([text], data.draw(chunkings(text)), list(text)):
        seen = deltas_and_payloads(run(fmt, chunks))
        assert len(seen) == len(expected)
        for (joined, payload), want in zip(seen, expected, strict=True):
            assert joined == payload
            if want is not None:
                assert payload == want


@pytest.mark.parametrize("fmt_name", _TAGGED)
@pytest.mark.parametrize(
    "body",
    [
        '"{\\"a\\": 1}"',  # the arguments as a JSON string holding the object
        ' \n"{\\"a\\": 1}"\t',
        '{"a": 1}',
        '\n{"a": 1}  ',
    ],
)
def test_raw_form_arguments_stream_what_the_payload_says(fmt_name: str, body: str) -> None:
    """``<tool_call name="lookup">`` with a function's arguments: the deltas
    were the raw text (the JSON string, quotes and escapes) while the
    payload was the decoded object, so a streaming client got a string."""
    text = f'<tool_call name="lookup">\n{body}\n</tool_call>'
    for chunks in ([text], list(text)):
        assert deltas_and_payloads(run(FORMATS[fmt_name], chunks)) == [('{"a": 1}', '{"a": 1}')]
