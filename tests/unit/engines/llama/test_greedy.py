"""Temperature 0 reads the highest logit straight off the row
(sampling.Greedy) instead of llama.cpp's greedy sampler, which fills a
whole-vocabulary candidate array first: it must pick the same token, on
every row of a batch. The bundled model, in process."""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest

from lmspd.core.conversation import Conversation, Message, Sampling
from lmspd.engines.llama.sampling import Greedy
from support.llama_engine import bundled_engine, every_row_decoded


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
    with every_row_decoded(engine, tokens) as chain:
        greedy = Greedy(engine.vocab.n_vocab)
        picks = [greedy.sample(engine.ctx, i) for i in range(len(tokens))]
        assert picks == [chain.sample(engine.ctx, i) for i in range(len(tokens))]
        assert len(set(picks)) > 5, "rows with different answers"
        # Ties go to the first maximum, as llama.cpp's greedy sampler does.
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(engine.ctx.ctx, 0), shape=(engine.vocab.n_vocab,))
        row[[7, 9]] = row.max() + 1
        assert greedy.sample(engine.ctx, 0) == chain.sample(engine.ctx, 0) == 7
