"""The scheduler thread outlives a fault of its own: the streams it was
serving end with ``server_error`` (none goes on with a gap, none waits
forever) and the next request is served. The bundled model, in process."""

from __future__ import annotations

import asyncio

import pytest

from lmspd.core.conversation import Conversation, Message, Sampling
from lmspd.core.events import Failed, Finished
from lmspd.core.run import RunContext
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
    assert events[-1].usage.output_tokens > 0, "what was output before the fault is counted"
    assert isinstance(run(engine)[-1], Finished), "the scheduler still serves"


@pytest.mark.parametrize("part", ["apply", "breakpoints_ahead"])
def test_a_fault_while_placing_a_request_ends_it_and_frees_its_sequence(engine, monkeypatch, part):
    """Placed, a request is out of the waiting list before it runs: a fault
    there (a failed capture in ``apply``, or anything after it, with its
    sequence marked busy) ends it with ``server_error``, and the next
    request gets the one sequence."""
    original = getattr(engine.cache, part)
    faults = [0]

    def flaky(*args):
        if not faults[0]:
            faults[0] += 1
            raise RuntimeError("injected fault")
        return original(*args)

    monkeypatch.setattr(engine.cache, part, flaky)
    events = run(engine)
    assert faults[0] == 1, "the fault was reached"
    assert isinstance(events[-1], Failed) and events[-1].code == "server_error", events[-1]
    assert isinstance(run(engine)[-1], Finished), "the sequence is free again"


def test_a_fault_while_ending_a_warm_up_that_is_already_held_ends_it(engine, monkeypatch):
    """A warm-up whose prompt the cache holds ends without running: a fault
    there ends it with ``server_error`` too."""
    warm_up = RunContext(prefill_only=True)
    conv = Conversation(model="m", items=[Message("user", "Warm up.")], sampling=Sampling(temperature=0))

    async def events_of_warm_up() -> list:
        return [e async for e in engine.generate(engine.prepare(conv, warm_up), CancelToken())]

    assert isinstance(asyncio.run(asyncio.wait_for(events_of_warm_up(), 60))[-1], Finished)
    faults = [0]

    def flaky(seq: int) -> None:
        faults[0] += 1
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.cache, "hold", flaky)
    events = asyncio.run(asyncio.wait_for(events_of_warm_up(), 60))
    assert faults[0] == 1, "the fault was reached"
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


def test_a_fault_while_ending_one_cancelled_generation_ends_only_that_one(monkeypatch):
    """Ending a cancelled generation remembers its turn (renders it): a fault
    there reached the loop's handler, which failed every stream running."""
    from lmspd.engines.llama.generation import Generation

    original = Generation.cancelled

    def flaky(self, pending):
        raise RuntimeError("injected fault")

    async def both(engine) -> tuple[list, list]:
        def conv(text: str, n: int) -> Conversation:
            return Conversation(model="m", items=[Message("user", text)], max_output_tokens=n,
                                sampling=Sampling(temperature=0))

        doomed_cancel = CancelToken()
        doomed_events: list = []

        async def doomed() -> None:
            async for event in engine.generate(engine.prepare(conv("Count to one hundred.", 200)), doomed_cancel):
                doomed_events.append(event)
                if len(doomed_events) == 3:
                    monkeypatch.setattr(Generation, "cancelled", flaky)
                    doomed_cancel.cancel()

        async def other() -> list:
            return [e async for e in engine.generate(engine.prepare(conv("Name three colours.", 24)), CancelToken())]

        _, others = await asyncio.gather(doomed(), other())
        monkeypatch.setattr(Generation, "cancelled", original)
        return doomed_events, others

    with bundled_engine(parallel=2) as two:
        doomed_events, others = asyncio.run(asyncio.wait_for(both(two), 120))
    assert isinstance(doomed_events[-1], Failed) and doomed_events[-1].code == "server_error", doomed_events[-1]
    assert isinstance(others[-1], Finished), others[-1]
