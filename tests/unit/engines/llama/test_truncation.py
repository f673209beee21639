"""``truncation: auto`` with the bundled model's real template and tokenizer:
the fewest oldest items are dropped, found in O(log n) renders."""

from __future__ import annotations

import pytest

from lmspd.core.conversation import Conversation, Message
from support.grammar_rig import vocab_only_preparation


@pytest.fixture(scope="module")
def preparation():
    return vocab_only_preparation()


def long_conversation(turns: int) -> Conversation:
    items = [Message("system", "You are terse.")]
    for i in range(turns):
        items += [Message("user", f"Question {i}: " + "lorem ipsum dolor " * 8), Message("assistant", f"Answer {i}.")]
    items.append(Message("user", "The last question."))
    return Conversation(model="m", items=items, max_output_tokens=64, truncate=True)


def test_drops_the_fewest_oldest_items_in_log_n_renders(preparation, monkeypatch):
    conv = long_conversation(100)
    original = list(conv.items)
    calls = []
    render = preparation.render
    monkeypatch.setattr(preparation, "render", lambda c, **kw: calls.append(1) or render(c, **kw))
    prepared = preparation.prepare(conv)
    assert len(calls) <= 12, f"{len(calls)} renders for 200 droppable items"
    kept = prepared.conversation.items
    assert kept[0] == original[0] and kept[-1] == original[-1], "system message and last item stay"
    dropped = len(original) - len(kept)
    assert kept[1:] == original[1 + dropped:], "only the oldest items go"
    assert prepared.input_tokens + 64 <= 1024
    # One item fewer dropped would not fit: the fewest were dropped.
    one_more = Conversation(model="m", items=[original[0]] + original[dropped:], max_output_tokens=64)
    assert len(preparation.vocab.tokenize(render(one_more))) + 64 > 1024
