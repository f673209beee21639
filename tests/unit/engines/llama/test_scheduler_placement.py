"""A request the cache cannot place (an unexpected error while planning)
ends with an error instead of waiting for a placement that never comes; the
scheduler goes on serving. The bundled model, in process."""

from __future__ import annotations

import asyncio
import time

import pytest

from lmspd.core.conversation import Conversation, Message, Sampling
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
    def broken(req, **_):
        raise AssertionError("planning bug")

    monkeypatch.setattr(engine.cache, "plan", broken)
    events = asyncio.run(asyncio.wait_for(events_of(engine), 60))
    assert isinstance(events[-1], Failed) and events[-1].code == "server_error", events[-1]
    monkeypatch.undo()
    events = asyncio.run(asyncio.wait_for(events_of(engine), 60))
    assert isinstance(events[-1], Finished), "the scheduler still serves"


@pytest.fixture(scope="module")
def engine4():
    with bundled_engine(parallel=4) as eng:
        yield eng


async def run_text(engine, text: str, n: int = 4):
    conv = Conversation(model="m", items=[Message("user", text)], max_output_tokens=n,
                        sampling=Sampling(temperature=0))
    prepared = engine.prepare(conv)
    events = [e async for e in engine.generate(prepared, CancelToken())]
    assert isinstance(events[-1], Finished), events[-1]
    return list(prepared.tokens)


@pytest.mark.alone
def test_a_request_waiting_for_a_sequence_to_finish_starts_right_after_it(engine4, monkeypatch):
    """The cache may answer "not now" while a sequence evaluates the last
    token of a turn the request continues (or would be cut back on). That
    step releases the sequence; the request must be placed right after it,
    not at the scheduler's next 0.5 s poll."""
    sched = engine4.scheduler
    real_plan = engine4.cache.plan
    times: dict[str, float] = {}

    def plan(req, **kw):
        if "second" in req.text and any(r.busy for r in engine4.cache.residents):
            return None  # as the cache does while a turn it waits for ends
        return real_plan(req, **kw)

    real_release, real_start = sched._release, sched._start

    # Only the first release and the second request's start: the second's
    # own release comes a step after its reply and must not overwrite it.
    def release(run):
        real_release(run)
        times.setdefault("released", time.monotonic())

    def start(job, plan):
        if "second" in job.request.text:
            times["started"] = time.monotonic()
        real_start(job, plan)

    monkeypatch.setattr(engine4.cache, "plan", plan)
    monkeypatch.setattr(sched, "_release", release)
    monkeypatch.setattr(sched, "_start", start)

    async def go():
        first = asyncio.create_task(run_text(engine4, "The first request: count to five.", 8))
        await asyncio.sleep(0.05)
        second = await run_text(engine4, "The second request.", 2)
        await first
        return second

    asyncio.run(asyncio.wait_for(go(), 120))
    gap = times["started"] - times["released"]
    assert 0 <= gap < 0.3, f"placed {gap * 1000:.0f} ms after the sequence it waited for was released"


def test_a_generation_starts_when_asked_for_not_when_its_events_are_first_read(engine):
    """``generate`` hands the job to the scheduler at the call: the prompt
    is evaluated while the caller still writes what precedes the first
    token (``Run.events``: response.created). Nothing here reads an event
    until the prompt has been evaluated."""
    async def go():
        before = engine.stats()["generations"]  # counted when a prompt is evaluated
        prepared = engine.prepare(Conversation(model="m", items=[Message("user", "Say hi.")], max_output_tokens=2))
        events = engine.generate(prepared, CancelToken())
        deadline = time.monotonic() + 60
        while engine.stats()["generations"] == before:
            assert time.monotonic() < deadline, "the prompt was never evaluated before its events were read"
            await asyncio.sleep(0.01)
        got = [e async for e in events]
        assert isinstance(got[-1], Finished), got[-1]

    asyncio.run(go())


def test_a_generation_cancelled_before_its_events_are_read_frees_its_sequence(engine):
    """A caller that gives up before reading (``Run.events`` when its
    consumer leaves right after response.created) cancels the token: the
    scheduler ends the job although nobody reads its events."""
    async def go():
        prepared = engine.prepare(Conversation(model="m", items=[Message("user", "Count to a thousand.")],
                                               max_output_tokens=400))
        cancel = CancelToken()
        events = engine.generate(prepared, cancel)
        deadline = time.monotonic() + 60
        while engine.scheduler.active == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        cancel.cancel()
        while engine.scheduler.active:
            assert time.monotonic() < deadline, "a cancelled generation nobody reads kept its sequence"
            await asyncio.sleep(0.01)
        got = [e async for e in events]
        assert isinstance(got[-1], Finished) and got[-1].reason == "cancelled", got[-1]
        assert got[-1].usage.output_tokens < 400
        after = await asyncio.wait_for(events_of(engine), 60)
        assert isinstance(after[-1], Finished), "the scheduler still serves"

    asyncio.run(go())
