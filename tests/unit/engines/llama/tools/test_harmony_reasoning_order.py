"""Harmony's analysis channel keeps the engines' ordering contract
(lmspd.core.events): every run of ``ReasoningDelta`` is closed by exactly one
``ReasoningDone`` before any text or call item opens, and before the end,
whatever the chunking of the model's output."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.core.conversation import FunctionTool
from lmspd.core.events import ReasoningDelta, ReasoningDone, TextDelta, ToolCallStarted
from lmspd.engines.llama.tool_formats import HarmonyFormat

TOOLS = [FunctionTool("get_weather", "Weather", {"type": "object", "properties": {"city": {"type": "string"}}})]
A = "<|channel|>analysis<|message|>Think about Paris.<|end|>"
A2 = "<|start|>assistant<|channel|>analysis<|message|>And again.<|end|>"
C = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"P\"}"
F = "<|start|>assistant<|channel|>final<|message|>Sunny."
# Reasoning cut off by the end of the output (no <|end|>): finish() closes it.
OUTPUTS = [A + F, A + A2 + F, A + C, A + F.replace("Sunny.", "") , "<|channel|>analysis<|message|>unfinished"]


def _events(out: str, cuts: list[int]):
    parser = HarmonyFormat(True).parser(TOOLS, lambda: "call_1")
    points = sorted({min(c, len(out)) for c in cuts}) + [len(out)]
    events, at = [], 0
    for p in points:
        events += parser.feed(out[at:p])
        at = p
    return events + parser.finish()


def _check_order(events) -> int:
    """The number of reasoning items; fails on a broken order."""
    open_, items = False, 0
    for e in events:
        if isinstance(e, ReasoningDelta):
            if not open_:
                items += 1
            open_ = True
        elif isinstance(e, ReasoningDone):
            assert open_, "ReasoningDone without a reasoning item"
            open_ = False
        else:
            assert not open_, f"{type(e).__name__} while a reasoning item is open"
    assert not open_, "the output ended with the reasoning item open"
    return items


def _shape(events) -> list[str]:
    """Event kinds in order, a run of deltas counted once (chunking splits deltas)."""
    kinds: list[str] = []
    for e in events:
        kind = type(e).__name__
        if not (kind.endswith("Delta") and kinds and kinds[-1] == kind):
            kinds.append(kind)
    return kinds


@settings(max_examples=200, deadline=None)
@given(which=st.integers(0, len(OUTPUTS) - 1), cuts=st.lists(st.integers(0, 200), max_size=15))
def test_reasoning_is_closed_before_anything_else(which: int, cuts: list[int]) -> None:
    out = OUTPUTS[which]
    events = _events(out, cuts)
    assert _check_order(events) == out.count("analysis<|message|>")
    whole = _events(out, [])
    assert _shape(whole) == _shape(events)
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == \
        "".join(e.text for e in whole if isinstance(e, ReasoningDelta))


def test_done_comes_at_the_end_marker_not_later() -> None:
    parser = HarmonyFormat(True).parser(TOOLS, lambda: "call_1")
    events = parser.feed(A)
    assert isinstance(events[-1], ReasoningDone), "the <|end|> closes the item at once"
    later = parser.feed(F) + parser.finish()
    assert [type(e) for e in later] == [TextDelta]
    assert not any(isinstance(e, ToolCallStarted) for e in later)


def test_a_harmony_generation_counts_its_analysis_tokens_as_reasoning():
    """gpt-oss marks its reasoning with channels, not a block a reasoning
    splitter sees: usage.reasoning_tokens stayed 0. Each token sampled inside
    an analysis body counts (its closing <|end|> too, as a </think> does);
    the headers and the final text do not."""
    from lmspd.core.conversation import Conversation, Message
    from lmspd.engines.llama.preparation import LlamaPrepared
    from support.generation_rig import EOG, PROMPT, ToyVocab, toy_generation

    vocab = ToyVocab()
    conv = Conversation(model="m", items=[Message("user", "q")])
    prepared = LlamaPrepared(conversation=conv, text="PROMPT", tokens=list(PROMPT), max_new_tokens=64, stop=[])
    gen = toy_generation(vocab, prepared, reasoning=None, tool_format=HarmonyFormat(True), parse_always=True)
    analysis = ["Think", " about", " Paris", ".", "<|end|>"]
    pieces = (["<|channel|>", "analysis", "<|message|>", *analysis]
              + ["<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Sunny", "."])
    for text in pieces:
        gen.before_sample()
        gen.on_token(vocab.id(text))
    gen.on_token(EOG)
    assert gen.done and gen.usage.reasoning_tokens == len(analysis)
    assert gen.usage.output_tokens == len(pieces)


def test_a_client_stop_sequence_stays_dormant_in_harmonys_analysis_channel():
    """As in a <think> block (test_reasoning_end): gpt-oss restating the
    stop sequence while it reasons goes on to answer; in the final channel
    the stop ends the turn."""
    from lmspd.core.conversation import Conversation, Message, Sampling
    from lmspd.core.events import Finished
    from lmspd.engines.llama.preparation import LlamaPrepared
    from support.generation_rig import PROMPT, ToyVocab, toy_generation

    vocab, events = ToyVocab(), []
    conv = Conversation(model="m", items=[Message("user", "q")], sampling=Sampling(stop=["Question:"]))
    prepared = LlamaPrepared(conversation=conv, text="PROMPT", tokens=list(PROMPT), max_new_tokens=64,
                             stop=["Question:", "<|start|>functions."])
    gen = toy_generation(vocab, prepared, reasoning=None, tool_format=HarmonyFormat(True), parse_always=True,
                         on_event=events.append)
    pieces = (["<|channel|>", "analysis", "<|message|>", "The", " Question", ":", " is", " easy", ".", "<|end|>"]
              + ["<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Sure", ".", " Question", ":", " more"])
    for text in pieces:
        gen.before_sample()
        gen.on_token(vocab.id(text))
        if gen.done:
            break
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    (finished,) = [e for e in events if isinstance(e, Finished)]
    assert reasoning == "The Question: is easy."
    assert text == "Sure. " and (finished.reason, finished.stop_sequence) == ("stop", "Question:")
    assert gen.usage.output_tokens == len(pieces) - 1  # it ended at the stop's last token
