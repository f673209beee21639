"""The idle scheduler captures the state of the sequence the next new prompt
would take (issue 30), so that placing the prompt there only clears the
sequence; the session evicted that way comes back from RAM exactly as it
would have. The bundled model, in process."""

from __future__ import annotations

import asyncio
import time

import pytest

from lmspd.core.conversation import Conversation, Message, Sampling
from lmspd.core.events import Finished, TextDelta
from lmspd.core.run import RunContext
from lmspd.engines.base import CancelToken
from support.llama_engine import bundled_engine


@pytest.fixture(scope="module")
def engine():
    with bundled_engine(parallel=2, n_ctx=1024) as eng:
        yield eng


async def run(engine, items, owner):
    conv = Conversation(model="m", items=items, max_output_tokens=6, sampling=Sampling(temperature=0))
    prepared = engine.prepare(conv, RunContext(owner=owner))
    events = [e async for e in engine.generate(prepared, CancelToken())]
    assert isinstance(events[-1], Finished), events[-1]
    return "".join(e.text for e in events if isinstance(e, TextDelta)), events[-1].usage


def turn(engine, items, owner):
    return asyncio.run(asyncio.wait_for(run(engine, items, owner), 120))


def wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_new_prompt_lands_on_a_state_captured_while_idle_and_that_session_restores_exactly(engine, monkeypatch):
    cache, sched = engine.cache, engine.scheduler
    captures: list[tuple[int, bool]] = []  # (sequence, during a placement)
    placing = [False]
    real_capture, real_apply, real_ahead = cache.ops.capture, cache.apply, cache.capture_ahead

    def capture(seq):
        captures.append((seq, placing[0]))
        return real_capture(seq)

    def apply(plan, req):
        placing[0] = True
        try:
            return real_apply(plan, req)
        finally:
            placing[0] = False

    def capture_ahead():
        assert not sched._waiting and not sched._running, "only while nothing runs or waits"
        return real_ahead()

    monkeypatch.setattr(cache.ops, "capture", capture)
    monkeypatch.setattr(cache, "apply", apply)
    monkeypatch.setattr(cache, "capture_ahead", capture_ahead)

    # The same first turn for two owners (whose states never mix): one on
    # each sequence. Owner b's next turn, continuing its live KV, is the
    # reference for owner a's, which will have come back from RAM.
    first = [Message("user", "Name one river of Europe.")]
    reply_a, _ = turn(engine, first, "a")
    reply_b, _ = turn(engine, first, "b")
    assert reply_a == reply_b
    r0 = cache.residents[0]
    wait_until(lambda: r0.saved)
    assert captures == [(0, False)], "idle: the least recently used sequence's state is kept in RAM"
    state_a = r0.state
    assert state_a is not None and state_a.owner == "a" and cache.tiers.ram[state_a.key] is state_a

    second_a = [*first, Message("assistant", reply_a), Message("user", "And one lake?")]
    second_b = [*first, Message("assistant", reply_b), Message("user", "And one lake?")]
    reference, ref_usage = turn(engine, second_b, "b")
    assert engine.stats_.last_cache_source == "visible-prefix"

    # A new prompt takes sequence 0: nothing is captured on its way.
    turn(engine, [Message("user", "Something else entirely: count to three.")], "c")
    assert not any(during for _, during in captures), captures
    assert cache.residents[0].owner == "c"
    evictions = cache.stats.evictions
    assert evictions >= 1

    # Owner a's next turn comes back from RAM: all of its state reused, the same text as the live KV gave.
    restores = cache.stats.ram_restores
    wait_until(lambda: cache.residents[1].saved)  # idle again: sequence 1 (owner b) kept ahead in turn
    text, usage = turn(engine, second_a, "a")
    assert engine.stats_.last_cache_source == "ram" and cache.stats.ram_restores == restores + 1
    assert usage.cached_tokens == ref_usage.cached_tokens == len(state_a.tokens)
    assert text == reference
    assert not any(during for _, during in captures), "no placement captured: each state was kept ahead"
