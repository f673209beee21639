"""The truncation search (``lmspd.engines.llama.truncation``) against brute
force, over generated conversations and a render/tokenizer whose costs the
estimate gets wrong on purpose (tokens per character vary per item, and a
template adds wrapping): the guided search must still find exactly the
fewest groups that fit, never keep a tool output whose call it dropped, and
measure a number of prompts that does not grow with the history."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.core.conversation import Item, Message, ToolCall, ToolOutput, drop_groups
from lmspd.engines.llama.truncation import Fit, fewest_dropped


def text_of(item: Item) -> str:
    if isinstance(item, Message):
        return item.text
    if isinstance(item, ToolCall):
        return item.name + item.payload
    assert isinstance(item, ToolOutput)
    return item.output


def render(items: list[Item]) -> str:
    return "".join(f"<{type(i).__name__}>{text_of(i)}</>" for i in items)


def tokenize(text: str) -> list[int]:
    # Dense runs of "x" are one token each, words of "a" one token per four letters:
    # an item's tokens are not proportional to its characters.
    tokens: list[int] = []
    for word in text.replace("<", " <").replace(">", "> ").split():
        tokens += [0] * (len(word) if set(word) == {"x"} else max(1, len(word) // 4))
    return tokens


@st.composite
def conversations(draw) -> list[Item]:
    items: list[Item] = [Message("system", "sys")]
    open_calls: list[str] = []
    for n in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(["user", "assistant", "call", "output"]))
        word = draw(st.sampled_from(["x" * draw(st.integers(1, 30)), "a" * draw(st.integers(1, 120))]))
        if kind == "call":
            call_id = f"c{n}"
            open_calls.append(call_id)
            items.append(ToolCall(call_id=call_id, name="f", payload=word))
        elif kind == "output" and open_calls:
            call_id = open_calls.pop(draw(st.integers(0, len(open_calls) - 1)))
            items.append(ToolOutput(call_id=call_id, output=word))
        else:
            items.append(Message("user" if kind != "assistant" else "assistant", word))
    return items


def fits_after(items: list[Item], groups: list[list[int]], k: int) -> list[Item]:
    gone = {i for g in groups[:k] for i in g}
    return [item for i, item in enumerate(items) if i not in gone]


@settings(max_examples=300, deadline=None)
@given(conversations(), st.integers(5, 200))
def test_the_guided_search_finds_what_brute_force_finds(items, budget):
    whole_text = render(items)
    whole = Fit(list(items), whole_text, tokenize(whole_text))
    if len(whole.tokens) <= budget:
        return  # fits: nothing to truncate
    groups = drop_groups(items)
    renders = []

    def counted(kept: list[Item]) -> str:
        renders.append(len(kept))
        return render(kept)

    fit = fewest_dropped(items, whole, budget, render=counted, tokenize=tokenize)
    fewest = next((k for k in range(1, len(groups) + 1)
                   if len(tokenize(render(fits_after(items, groups, k)))) <= budget), len(groups))
    assert fit.items == fits_after(items, groups, fewest)
    assert fit.text == render(fit.items) and fit.tokens == tokenize(fit.text)
    calls = {i.call_id for i in fit.items if isinstance(i, ToolCall)}
    orphans = [o for o in fit.items if isinstance(o, ToolOutput) and o.call_id not in calls]
    dropped_calls = {i.call_id for i in items if isinstance(i, ToolCall)} - calls
    assert not [o for o in orphans if o.call_id in dropped_calls], "an output outlived its call"
    # Guided, then bisection after a few misses: never more than that.
    assert len(renders) <= 1 + 4 + max(1, len(groups)).bit_length(), renders
