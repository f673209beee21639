"""A request the cache cannot place (an unexpected error while planning)
ends with an error instead of waiting for a placement that never comes; the
scheduler goes on serving. The bundled model, in process."""

from __future__ import annotations

import asyncio

import pytest

from lmspd.core.conversation import Conversation, Message
from lmspd.core.events import Failed, Finished
from lmspd.engines.base import CancelToken
from support.llama_engine import bundled_engine


@pytest.fixture(scope="module")
def engine():
    with bundled_engine(parallel=1) as eng:
        yield eng


async def events_of(engine):
    prepared = engine.prepare(Conversation(model="m", items=[Message("user", "Say hi.")], max_output_tokens=2))
    return [e async for e in engine.generate(prepared, CancelToken())]


def test_a_request_whose_placement_fails_ends_with_an_error(engine, monkeypatch):
    def broken(req):
        raise AssertionError("planning bug")

    monkeypatch.setattr(engine.cache, "plan", broken)
    events = asyncio.run(asyncio.wait_for(events_of(engine), 60))
    assert isinstance(events[-1], Failed) and events[-1].code == "server_error", events[-1]
    monkeypatch.undo()
    events = asyncio.run(asyncio.wait_for(events_of(engine), 60))
    assert isinstance(events[-1], Finished), "the scheduler still serves"
