"""Requests that arrive together share their first step
(Scheduler._gather): an idle scheduler given one request while another is
still being prepared waits for it, so that both prefill in the same decode,
instead of leaving the second to wait out the first's whole prefill step.
The bundled model, in process."""

from __future__ import annotations

import asyncio

import llama_cpp
import pytest

from lmspd.core.conversation import Conversation, Message, Sampling
from lmspd.core.events import Finished
from lmspd.engines.base import CancelToken
from support.llama_engine import bundled_engine


@pytest.fixture(scope="module")
def engine():
    with bundled_engine(parallel=2) as eng:
        yield eng


def conv(text: str) -> Conversation:
    return Conversation(model="m", items=[Message("user", text)], max_output_tokens=3, sampling=Sampling(temperature=0))


def test_a_request_being_prepared_shares_the_first_step_of_one_submitted_just_before(engine, monkeypatch):
    batches: list[set[int]] = []
    real = llama_cpp.llama_decode

    def recording(ctx, batch):
        batches.append({batch.seq_id[i][0] for i in range(batch.n_tokens)})
        return real(ctx, batch)

    monkeypatch.setattr(llama_cpp, "llama_decode", recording)
    # Generous on a loaded machine: the mechanism, not the bound, is tested here.
    monkeypatch.setattr(engine.scheduler, "gather_s", 3.0)
    monkeypatch.setattr(engine.preparations, "grace_s", 5.0)
    monkeypatch.setattr(engine.preparations, "handoff_s", 5.0)

    async def run(prepared):
        return [e async for e in engine.generate(prepared, CancelToken())]

    async def go():
        engine.prepare(conv("Warm the template up."))  # a first prepare compiles it: ~1 s
        second = conv("Name a colour.")
        with engine.preparations.running(second) as landed:
            # The first request reaches the scheduler while the second is still being prepared.
            first = asyncio.create_task(run(engine.prepare(conv("Name a fruit."))))
            await asyncio.sleep(0.3)  # the first would have had its first step by now
            prepared = engine.prepare(second)
            landed(prepared)
        return await asyncio.gather(first, run(prepared))

    a, b = asyncio.run(asyncio.wait_for(go(), 120))
    assert isinstance(a[-1], Finished) and isinstance(b[-1], Finished)
    assert len(batches[0]) == 2, f"the first step held one sequence only: {batches[:3]}"
