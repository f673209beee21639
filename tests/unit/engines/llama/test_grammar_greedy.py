"""Temperature 0 under a grammar: the grammar-first sampler's first try
reads the highest logit off the row, as free decoding's ``Greedy`` does,
instead of llama.cpp's greedy sampler, which writes a whole-vocabulary
candidate array (~0.6 MB on SmolLM2) every token first. Same token on
every row. The bundled model, in process."""

from __future__ import annotations

import pytest

from lmspd.core.conversation import Conversation, FunctionTool, Message, Sampling, ToolChoice
from lmspd.engines.llama.sampling import GrammarFirstRejection
from support.llama_engine import bundled_engine, every_row_decoded


@pytest.fixture(scope="module")
def engine():
    with bundled_engine(parallel=1) as eng:
        yield eng


def test_the_first_try_is_the_highest_logit_without_llama_cpps_sampler(engine):
    tool = FunctionTool("get_weather", "Weather for a city",
                        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    conv = Conversation(model="m", items=[Message("user", "Name three rivers of Europe and one of Asia.")],
                        tools=[tool], tool_choice=ToolChoice("auto"), sampling=Sampling(temperature=0))
    prepared = engine.prepare(conv)
    sampler = engine.preparation.sampler(prepared)
    assert isinstance(sampler, GrammarFirstRejection)
    chain_calls = []
    real = sampler._chain.sample
    sampler._chain.sample = lambda *a: chain_calls.append(a) or real(*a)  # type: ignore[method-assign]
    tokens = prepared.tokens
    try:
        with every_row_decoded(engine, tokens) as chain:
            # Asleep (no call trigger written), the lazy grammar allows every token.
            rows = range(len(tokens) - 40, len(tokens))
            picks = []
            for i in rows:
                picks.append(sampler.sample(engine.ctx, i))
            assert picks == [chain.sample(engine.ctx, i) for i in rows]
            assert len(set(picks)) > 5, "rows with different answers"
            assert chain_calls == [], "llama.cpp's sampler ran for a first try"
    finally:
        sampler.close()
