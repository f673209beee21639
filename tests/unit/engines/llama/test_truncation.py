"""``truncation: auto`` with the bundled model's real template and tokenizer:
the fewest oldest items are dropped, found in a constant number of renders
(what is tokenized is the whole prompt once plus a few prompts of what is
kept), and a tool call and its outputs go together."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lmspd.core.conversation import Conversation, Message, ToolCall, ToolOutput
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


class Counted:
    """The preparation's render and tokenize, counted."""

    def __init__(self, preparation, monkeypatch) -> None:
        self.renders = 0
        self.tokenized_chars = 0
        self.render, self.tokenize = preparation.render, preparation.vocab.tokenize
        monkeypatch.setattr(preparation, "render", self._render)
        monkeypatch.setattr(preparation.vocab, "tokenize", self._tokenize)

    def _render(self, conversation, **kw):
        self.renders += 1
        return self.render(conversation, **kw)

    def _tokenize(self, text):
        self.tokenized_chars += len(text)
        return self.tokenize(text)


@pytest.mark.parametrize("turns", [100, 1500])
def test_drops_the_fewest_oldest_items_in_a_constant_number_of_renders(preparation, monkeypatch, turns):
    conv = long_conversation(turns)
    original = list(conv.items)
    whole = len(preparation.render(conv))
    counted = Counted(preparation, monkeypatch)
    prepared = preparation.prepare(conv)
    # The whole prompt once, then where the estimate says it fits, one item
    # fewer (which does not), and the prompt without any droppable item
    # (rendered only: the estimate's wrapping). Bisection took ~log2(n) + 1.
    assert counted.renders <= 4, f"{counted.renders} renders for {2 * turns} droppable items"
    assert counted.tokenized_chars <= whole + 3 * len(prepared.text), (counted.tokenized_chars, whole)
    kept = prepared.conversation.items
    assert kept[0] == original[0] and kept[-1] == original[-1], "system message and last item stay"
    dropped = len(original) - len(kept)
    assert kept[1:] == original[1 + dropped:], "only the oldest items go"
    assert prepared.input_tokens + 64 <= 1024
    # One item fewer dropped would not fit: the fewest were dropped.
    one_more = Conversation(model="m", items=[original[0]] + original[dropped:], max_output_tokens=64)
    assert len(counted.tokenize(counted.render(one_more))) + 64 > 1024


def test_without_max_output_tokens_a_quarter_of_the_window_is_left_to_answer(preparation):
    """Truncating only until the prompt fit left it a few tokens to answer
    in, which ended as incomplete (``context_window``)."""
    conv = replace(long_conversation(100), max_output_tokens=None)
    original = list(conv.items)
    prepared = preparation.prepare(conv)
    room = preparation.n_ctx // 4  # under the server's default cap (8192)
    assert prepared.max_new_tokens >= room and prepared.input_tokens + room <= preparation.n_ctx
    # The fewest items for that room were dropped.
    dropped = len(original) - len(prepared.conversation.items)
    one_more = Conversation(model="m", items=[original[0]] + original[dropped:])
    assert len(preparation.vocab.tokenize(preparation.render(one_more))) + room > preparation.n_ctx


def calls_answered_later(words: int) -> list:
    """A call whose output comes two items later: a cut right after the call
    (the fewest items that fit) would keep the output without it."""
    return [Message("system", "You are terse."), Message("user", "Look it up."),
            ToolCall(call_id="c1", name="lookup", payload='{"q": "' + "words " * words + '"}'),
            Message("assistant", "Looking."), ToolOutput(call_id="c1", output="found it"),
            Message("user", "Thanks. The last question.")]


def test_a_dropped_call_takes_its_output_with_it(preparation):
    items = calls_answered_later(1200)  # the call alone is more than the window
    prepared = preparation.prepare(Conversation(model="m", items=items, max_output_tokens=64, truncate=True))
    kept = prepared.conversation.items
    assert items[2] not in kept, "the call had to go for the prompt to fit"
    assert not [i for i in kept if isinstance(i, ToolOutput)], f"an output outlived its call: {kept}"
    assert kept == [items[0], items[3], items[5]]


def test_the_call_the_last_item_answers_stays(preparation):
    items = calls_answered_later(600)[:5]  # ends with the call's output
    items[3] = Message("assistant", "Looking. " + "lorem ipsum " * 250)
    prepared = preparation.prepare(Conversation(model="m", items=items, max_output_tokens=64, truncate=True))
    # The oldest items up to the call would have fitted; the call stays, the
    # items around it go.
    assert prepared.conversation.items == [items[0], items[2], items[4]]
