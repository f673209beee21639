"""A tool call the model opens inside its reasoning block (Qwen3, gpt-oss
and DeepSeek models do): with tools declared, the call marker ends the
reasoning and the call is parsed as a real call, instead of being lost in
the reasoning text. The template is the thinking-style fixture
(tests/fixtures/thinking_chatml.jinja: the generation prompt opens
``<think>``; no tool support, so lmspd's fallback call syntax); the tokens
are fed as the scheduler feeds sampled ones, through the real splitter and
tool-call parser."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.core.conversation import Conversation, FunctionTool, Message, ToolChoice
from lmspd.core.events import Finished, ReasoningDelta, ReasoningDone, TextDelta, ToolCallDone, ToolCallStarted
from lmspd.engines.llama.preparation import LlamaPrepared
from lmspd.engines.llama.reasoning import ReasoningSplitter, ReasoningSyntax
from lmspd.engines.llama.template import ChatTemplate
from lmspd.engines.llama.tool_formats import detect_tool_format
from lmspd.engines.llama.tool_formats.hermes import HermesFormat
from support.generation_rig import EOG, PROMPT, ToyVocab, toy_generation

FIXTURE = Path(__file__).parents[3] / "fixtures" / "thinking_chatml.jinja"
TEMPLATE = ChatTemplate(FIXTURE.read_text())
SYNTAX = ReasoningSyntax.detect(TEMPLATE)
LOOKUP = FunctionTool("lookup", parameters={"type": "object", "properties": {"q": {"type": "string"}},
                                            "required": ["q"], "additionalProperties": False})
THOUGHT = "The user wants the weather. I will look it up."
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"q": "Paris weather"}}\n</tool_call>'


def generate(pieces: list[str], *, fmt=None, tools=(LOOKUP,), choice: str = "auto") -> list:
    """The engine events of a generation whose sampled tokens are ``pieces``."""
    vocab = ToyVocab()
    events: list = []
    conv = Conversation(model="m", items=[Message("user", "Weather in Paris?")], tools=list(tools),
                        tool_choice=ToolChoice(mode=choice), reasoning_effort="high")
    prepared = LlamaPrepared(conversation=conv, text="PROMPT", tokens=list(PROMPT), max_new_tokens=256,
                             tools=list(tools) if choice != "none" else [])
    gen = toy_generation(vocab, prepared, reasoning=SYNTAX, tool_format=fmt or detect_tool_format(TEMPLATE.source),
                         on_event=events.append)
    for text in [*pieces, ""]:
        gen.kv_tokens.extend(gen.before_sample())
        gen.kv_tokens.extend(gen.on_token(vocab.id(text) if text else EOG))
        if gen.done:
            break
    return events


def test_a_call_opened_inside_the_reasoning_is_a_real_call():
    # The fixture: a thinking template (its prompt opens the block) without tool support.
    assert SYNTAX is not None and SYNTAX.prompt_tail == "<think>\n"
    assert detect_tool_format(TEMPLATE.source).name == "fallback"
    events = generate(["The user wants the weather.", " I will look it up.", "<tool", "_call>\n",
                       '{"name": "lookup", ', '"arguments": {"q": "Paris weather"}}', "\n</tool_call>"])
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert reasoning == THOUGHT  # the call is not reasoning text
    kinds = [type(e) for e in events]
    assert kinds.index(ReasoningDone) < kinds.index(ToolCallStarted)
    [started] = [e for e in events if isinstance(e, ToolCallStarted)]
    [done] = [e for e in events if isinstance(e, ToolCallDone)]
    assert started.name == "lookup" and json.loads(done.payload) == {"q": "Paris weather"}
    assert not [e for e in events if isinstance(e, TextDelta)]
    assert isinstance(events[-1], Finished) and events[-1].reason == "tool_calls"
    # With nothing to call (tool_choice none), the block is the model's to
    # write as it likes: the marker is reasoning text there.
    events = generate([THOUGHT, CALL, "</think>", "Sunny."], choice="none")
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == THOUGHT + CALL
    assert not [e for e in events if isinstance(e, ToolCallStarted)]


def test_qwen3_style_hermes_calls_too():
    events = generate([THOUGHT, "<tool_call>", "\n", '{"name": "lookup", "arguments": {"q": "Paris weather"}}',
                       "\n", "</tool_call>"], fmt=HermesFormat(native=True))
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == THOUGHT
    [done] = [e for e in events if isinstance(e, ToolCallDone)]
    assert json.loads(done.payload) == {"q": "Paris weather"}


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(THOUGHT + CALL)), max_size=12))
def test_the_split_does_not_depend_on_where_tokens_end(cuts):
    text = THOUGHT + CALL
    bounds = sorted(set(cuts))
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    splitter = ReasoningSplitter(ReasoningSyntax("<think>", "</think>", "<think>\n"), ("<tool_call",))
    pieces = [p for chunk in chunks for p in splitter.feed(chunk)] + splitter.feed("", final=True)
    assert "".join(t for kind, t in pieces if kind == "reasoning") == THOUGHT
    assert "".join(t for kind, t in pieces if kind == "text") == CALL
    assert splitter.hidden == "<think>\n" + THOUGHT  # with the call: what the KV holds
