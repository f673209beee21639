"""A turn that continues a response the engine holds (a WebSocket
connection's latest, a previous_response_id chain) tokenizes only its new
input: the KV's own tokens stand for the history (Preparation._tokenize)."""

from __future__ import annotations

import asyncio

import pytest

from lmspd.core.conversation import Conversation, Message, Sampling
from lmspd.core.events import Finished, TextDelta
from lmspd.engines.base import CancelToken
from support.llama_engine import bundled_engine

HISTORY = "Here is a long tool result to read. " * 40


@pytest.fixture(scope="module")
def engine():
    with bundled_engine(parallel=2, n_ctx=2048) as eng:
        yield eng


def conversation(items, previous=None):
    return Conversation(model="m", items=items, max_output_tokens=4, sampling=Sampling(temperature=0),
                        previous_response_id=previous)


async def run(engine, conv, response_id):
    prepared = engine.prepare(conv)
    events = [e async for e in engine.generate(prepared, CancelToken(), response_id=response_id)]
    assert isinstance(events[-1], Finished), events[-1]
    return prepared, events


def test_a_continuation_tokenizes_only_what_follows_the_held_response(engine, monkeypatch):
    first = [Message("user", HISTORY)]
    _, events = asyncio.run(asyncio.wait_for(run(engine, conversation(first), "resp_1"), 120))
    reply = "".join(e.text for e in events if isinstance(e, TextDelta))
    [state] = [s for s in engine.cache.states("local") if s.response_id == "resp_1"]
    second = [*first, Message("assistant", reply), Message("user", "And now?")]

    tokenized: list[str] = []
    real = engine.preparation.vocab.tokenize

    def recording(text: str) -> list[int]:
        tokenized.append(text)
        return real(text)

    monkeypatch.setattr(engine.preparation.vocab, "tokenize", recording)
    continued = engine.prepare(conversation(list(second), previous="resp_1"))
    assert tokenized and all(HISTORY not in text for text in tokenized), \
        "the held history must not be tokenized again"
    assert continued.tokens[:len(state.tokens)] == state.tokens
    assert continued.text.startswith(state.visible)
    assert continued.tokens[len(state.tokens):] == real(continued.text[len(state.visible):])

    # Without the response id (a full replay) the whole prompt is tokenized.
    tokenized.clear()
    replay = engine.prepare(conversation(list(second)))
    assert any(HISTORY in text for text in tokenized)
    assert replay.text == continued.text

    monkeypatch.undo()
    prepared, _ = asyncio.run(asyncio.wait_for(run(engine, conversation(list(second), previous="resp_1"), "resp_2"),
                                               120))
    assert engine.stats_.last_cache_source == "response-id"
    assert prepared.tokens[:len(state.tokens)] == state.tokens
