"""Requests released together share the first step (Scheduler._gather),
also when they reach the scheduler one by one over longer than
``gather_s``: admitted (``LlamaEngine.announce``, held by the service while
a request waits for a preparing thread), prepared, submitted, each a while
after the last. And a request that nothing is known to follow does not
wait. The bundled model, in process (issue 30: of 16 streams released
together, the last few missed a 30 ms gather and waited a whole prefill
step)."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

import llama_cpp
import pytest

from lmspd.core.conversation import Conversation, Message, Sampling
from lmspd.core.events import Finished, TextDelta
from lmspd.engines.base import CancelToken
from support.llama_engine import bundled_engine


@pytest.fixture(scope="module")
def engine():
    with bundled_engine(parallel=4) as eng:
        eng.prepare(conv("Warm the template up."))  # a first prepare compiles it: ~1 s
        yield eng


@pytest.fixture
def batches(engine, monkeypatch) -> list[set[int]]:
    seen: list[set[int]] = []
    real = llama_cpp.llama_decode

    def recording(ctx, batch):
        seen.append({batch.seq_id[i][0] for i in range(batch.n_tokens)})
        return real(ctx, batch)

    monkeypatch.setattr(llama_cpp, "llama_decode", recording)
    return seen


def slow_gather(engine, monkeypatch, *, gather_s: float) -> None:
    """The gather and the preparations' windows in seconds, not
    milliseconds, so that a loaded machine cannot break a test of them."""
    monkeypatch.setattr(engine.scheduler, "gather_s", gather_s)
    monkeypatch.setattr(engine.scheduler, "gather_max_s", 10.0)
    monkeypatch.setattr(engine.preparations, "grace_s", 10.0)
    monkeypatch.setattr(engine.preparations, "handoff_s", 10.0)


def conv(text: str) -> Conversation:
    return Conversation(model="m", items=[Message("user", text)], max_output_tokens=3, sampling=Sampling(temperature=0))


async def run(engine, prepared) -> list:
    return [e async for e in engine.generate(prepared, CancelToken())]


def test_a_burst_reaching_the_scheduler_over_longer_than_gather_s_shares_the_first_step(engine, batches,
                                                                                       monkeypatch) -> None:
    # Seconds, not milliseconds, so that a loaded machine cannot break it:
    # each request arrives 0.3 s after the last, the burst over 0.9 s; a
    # gather of 0.6 s from its start (as before) would leave the last behind.
    slow_gather(engine, monkeypatch, gather_s=0.6)
    convs = [conv(f"Name a {thing}.") for thing in ("fruit", "colour", "tree", "bird")]

    async def go():
        with ExitStack() as announced:
            # All four admitted together; the first is prepared and submitted
            # while the others still wait for a preparing thread.
            for c in convs:
                announced.enter_context(engine.announce(c))
            runs = [asyncio.create_task(run(engine, engine.prepare(convs[0])))]
            for c in convs[1:]:
                await asyncio.sleep(0.3)
                runs.append(asyncio.create_task(run(engine, engine.prepare(c))))
            return await asyncio.gather(*runs)

    results = asyncio.run(asyncio.wait_for(go(), 120))
    assert all(isinstance(r[-1], Finished) for r in results)
    assert len(batches[0]) == 4, f"the first step held fewer than the four: {batches[:4]}"


def test_a_lone_request_does_not_wait_for_the_gather(engine, batches, monkeypatch) -> None:
    # A gather that waited at all would wait seconds here.
    slow_gather(engine, monkeypatch, gather_s=5.0)

    async def first_token(prepared) -> float:
        t0 = time.monotonic()
        took = None
        async for event in engine.generate(prepared, CancelToken()):
            if took is None and isinstance(event, (TextDelta, Finished)):
                took = time.monotonic() - t0
        assert took is not None
        return took

    async def go():
        with engine.announce(c := conv("Name a fruit.")):
            prepared = engine.prepare(c)
        lone = await first_token(prepared)
        # One refused before its preparation (its announcement ended) leaves nothing to wait for.
        with engine.announce(conv("Name a colour.")):
            pass
        return lone, await first_token(engine.prepare(conv("Name a tree.")))

    lone, after_refused = asyncio.run(asyncio.wait_for(go(), 120))
    assert lone < 2.5 and after_refused < 2.5, (lone, after_refused)


def test_a_repeated_burst_keeps_each_prompt_in_place_and_shares_the_first_step(engine, batches,
                                                                               monkeypatch) -> None:
    # The same four prompts again, each held by the sequence its last round
    # left it in: a copy of it into another sequence would hold both until
    # the next step, and the last of the four would find no sequence
    # (issue 30, decode16). With every sequence wanted, each keeps its
    # prompt in place.
    slow_gather(engine, monkeypatch, gather_s=0.6)
    convs = [conv(f"Name a {thing}, and say in a few words why you like it best of all.")
             for thing in ("fruit", "colour", "tree", "bird")]

    async def burst():
        with ExitStack() as announced:
            for c in convs:
                announced.enter_context(engine.announce(c))
            runs = []
            for c in convs:
                runs.append(asyncio.create_task(run(engine, engine.prepare(c))))
                await asyncio.sleep(0.05)
            return await asyncio.gather(*runs)

    for _ in range(2):
        assert all(isinstance(r[-1], Finished) for r in asyncio.run(asyncio.wait_for(burst(), 120)))
    batches.clear()
    copies = engine.cache.stats.copies
    results = asyncio.run(asyncio.wait_for(burst(), 120))
    assert all(isinstance(r[-1], Finished) for r in results)
    assert len(batches[0]) == 4, f"the first step held fewer than the four: {batches[:4]}"
    assert engine.cache.stats.copies == copies
