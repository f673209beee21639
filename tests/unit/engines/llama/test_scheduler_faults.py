"""The scheduler thread outlives a fault of its own: the streams it was
serving end with ``server_error`` (none goes on with a gap, none waits
forever) and the next request is served. The bundled model, in process."""

from __future__ import annotations

import asyncio

import pytest

from lmspd.core.conversation import Conversation, Message, Sampling
from lmspd.core.events import Failed, Finished
from lmspd.engines.base import CancelToken
from support.llama_engine import bundled_engine


@pytest.fixture(scope="module")
def engine():
    with bundled_engine(parallel=1) as eng:
        yield eng


async def events_of(engine, n: int = 8):
    conv = Conversation(model="m", items=[Message("user", "Count to ten.")], max_output_tokens=n,
                        sampling=Sampling(temperature=0))
    prepared = engine.prepare(conv)
    return [e async for e in engine.generate(prepared, CancelToken())]


def run(engine):
    return asyncio.run(asyncio.wait_for(events_of(engine), 60))


def test_a_step_that_raises_ends_its_streams_and_the_next_request_is_served(engine, monkeypatch):
    original = engine.scheduler._step
    calls = [0]

    def flaky():
        calls[0] += 1
        if calls[0] == 3:  # mid-decode: the prefill and a first token done
            raise RuntimeError("injected fault")
        return original()

    monkeypatch.setattr(engine.scheduler, "_step", flaky)
    events = run(engine)
    assert calls[0] >= 3, "the fault was reached"
    assert isinstance(events[-1], Failed) and events[-1].code == "server_error", events[-1]
    assert isinstance(run(engine)[-1], Finished), "the scheduler still serves"


def test_a_hand_over_that_raises_ends_its_streams_and_the_next_request_is_served(engine, monkeypatch):
    """Events lost in a failed hand-over leave a gap in their stream: the
    stream ends with an error rather than going on without them, and the
    error itself goes out at once (nothing else would flush it). The fault
    is in the hand-over of a first token, made between steps (outside the
    step's own error handling)."""
    outbox = type(engine.scheduler.outbox)
    original = outbox.flush
    faults = [0]

    def flaky(self, *, yield_gil: bool = False):
        if yield_gil and not faults[0]:
            faults[0] += 1
            self._pending.clear()  # what a failing hand-over loses
            raise RuntimeError("injected fault")
        return original(self, yield_gil=yield_gil)

    monkeypatch.setattr(outbox, "flush", flaky)
    events = run(engine)
    assert faults[0] == 1, "the fault was reached"
    assert isinstance(events[-1], Failed) and events[-1].code == "server_error", events[-1]
    assert isinstance(run(engine)[-1], Finished), "the scheduler still serves"
