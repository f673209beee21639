"""A generation that fills the context window before any lower limit ends
as ``context_window``, one that reaches the request's own limit as
``length``: Anthropic's clients compact on the first
(``model_context_window_exceeded``) and raise the limit on the second. The
bundled model, in process, on a 256-token window."""

from __future__ import annotations

import asyncio

import pytest

from lmspd.core.conversation import Conversation, Message, Sampling
from lmspd.core.events import Finished
from lmspd.engines.base import CancelToken
from support.llama_engine import bundled_engine

COUNT = "Count from 1 to 1000, separated by commas: 1, 2, 3, 4,"


@pytest.fixture(scope="module")
def engine():
    with bundled_engine(n_ctx=256, parallel=1) as eng:
        yield eng


def finished(engine, **conversation) -> Finished:
    conv = Conversation(model="m", items=[Message("user", COUNT)], sampling=Sampling(temperature=0), **conversation)

    async def go() -> list:
        return [ev async for ev in engine.generate(engine.prepare(conv), CancelToken())]
    (end,) = [ev for ev in asyncio.run(go()) if isinstance(ev, Finished)]
    return end


def test_no_limit_runs_to_the_window_and_says_so(engine):
    end = finished(engine)
    assert end.reason == "context_window", end
    assert end.usage.input_tokens + end.usage.output_tokens == engine.info.context_window


def test_a_ceiling_past_the_room_is_the_window(engine):
    """Anthropic's ``max_tokens`` is a ceiling: lowered to the room left."""
    end = finished(engine, max_output_tokens=100_000, max_output_tokens_is_ceiling=True)
    assert end.reason == "context_window", end


def test_the_requests_own_limit_is_length(engine):
    end = finished(engine, max_output_tokens=12)
    assert (end.reason, end.usage.output_tokens) == ("length", 12)
    end = finished(engine, max_output_tokens=12, max_output_tokens_is_ceiling=True)
    assert (end.reason, end.usage.output_tokens) == ("length", 12)
