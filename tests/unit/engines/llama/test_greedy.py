"""Temperature 0 reads the highest logit straight off the row
(sampling.Greedy) instead of llama.cpp's greedy sampler, which fills a
whole-vocabulary candidate array first: it must pick the same token, on
every row of a batch. The bundled model, in process."""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest
from llama_cpp import _internals as internals

from lmspd.core.conversation import Conversation, Message, Sampling
from lmspd.engines.llama.sampling import Greedy
from support.llama_engine import bundled_engine


@pytest.fixture(scope="module")
def engine():
    with bundled_engine(parallel=1) as eng:
        yield eng


def test_greedy_picks_what_llama_cpps_greedy_sampler_picks_on_every_row(engine):
    conv = Conversation(model="m", items=[Message("user", "Name three rivers of Europe and one of Asia.")],
                        sampling=Sampling(temperature=0))
    prepared = engine.prepare(conv)
    assert isinstance(engine.preparation.sampler(prepared), Greedy)
    tokens = prepared.tokens
    # Run on the scheduler's context from this thread only while it idles: a
    # scratch sequence would race it, so take the KV while nothing runs.
    assert engine.scheduler.active == 0
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    chain = internals.LlamaSampler()
    chain.add_greedy()
    try:
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(tokens)
        engine.kv.clear(0)
        assert llama_cpp.llama_decode(engine.ctx.ctx, batch) == 0
        greedy = Greedy(engine.vocab.n_vocab)
        picks = [greedy.sample(engine.ctx, i) for i in range(len(tokens))]
        assert picks == [chain.sample(engine.ctx, i) for i in range(len(tokens))]
        assert len(set(picks)) > 5, "rows with different answers"
        # Ties go to the first maximum, as llama.cpp's greedy sampler does.
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(engine.ctx.ctx, 0), shape=(engine.vocab.n_vocab,))
        row[[7, 9]] = row.max() + 1
        assert greedy.sample(engine.ctx, 0) == chain.sample(engine.ctx, 0) == 7
    finally:
        chain.close()
        llama_cpp.llama_batch_free(batch)
        engine.kv.clear(0)
