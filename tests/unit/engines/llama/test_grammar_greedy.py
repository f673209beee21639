"""Temperature 0 under a grammar: the grammar-first sampler's first try
reads the highest logit off the row, as free decoding's ``Greedy`` does,
instead of llama.cpp's greedy sampler, which writes a whole-vocabulary
candidate array (~0.6 MB on SmolLM2) every token first. Same token on
every row. The bundled model, in process."""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest

from lmspd.core.conversation import Conversation, FunctionTool, Message, OutputFormat, Sampling, ToolChoice
from lmspd.engines.llama.sampling import GrammarFirstRejection, greedy_tokens, logits_row
from support.llama_engine import bundled_engine, every_row_decoded


@pytest.fixture(scope="module")
def engine():
    with bundled_engine(parallel=2) as eng:
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


def test_a_rejected_first_try_takes_what_llama_cpps_greedy_sampler_takes_from_the_masked_candidates(engine):
    """Greedy under a grammar that refuses the highest logit: the pick is
    the first highest logit the grammar allows, read off the row with the
    mask applied (no whole-vocabulary candidate array), which is the token
    llama.cpp's greedy sampler picks from the masked candidates."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    conv = Conversation(model="m", items=[Message("user", "Name three rivers of Europe and one of Asia.")],
                        output_format=OutputFormat("json_schema", "answer", schema, strict=True),
                        sampling=Sampling(temperature=0))
    prepared = engine.prepare(conv)
    sampler = engine.preparation.sampler(prepared)
    assert isinstance(sampler, GrammarFirstRejection) and sampler.greedy
    tokens = prepared.tokens
    try:
        with every_row_decoded(engine, tokens) as chain:
            allowed = sampler._allowed()
            assert allowed is not None
            rows = range(len(tokens) - 40, len(tokens))
            refused = 0
            for i in rows:
                top = chain.sample(engine.ctx, i)
                if sampler.allows(top):
                    continue
                refused += 1
                logits = logits_row(engine.ctx, i, engine.vocab.n_vocab)
                picked = int(np.where(allowed, logits, -np.inf).argmax())
                assert picked == sampler._pick(logits, allowed), f"row {i}"
                # A tie among the allowed goes to the first, as in llama.cpp's sampler.
                first, second = np.flatnonzero(allowed)[:2]
                saved = logits[[first, second]].copy()
                logits[[first, second]] = logits.max() + 1
                try:
                    assert int(np.where(allowed, logits, -np.inf).argmax()) == sampler._pick(logits, allowed) == first
                finally:
                    logits[[first, second]] = saved
            assert refused > 10, "rows whose highest logit the grammar refuses"
    finally:
        sampler.close()


def test_greedy_tokens_reads_every_row_as_one_argmax_per_row_would(engine):
    """The step's greedy rows in one pass: the same tokens as one argmax
    per row, whichever rows are asked for and in whatever order."""
    conv = Conversation(model="m", items=[Message("user", "Name three rivers of Europe and one of Asia.")],
                        sampling=Sampling(temperature=0))
    tokens = engine.prepare(conv).tokens
    n_vocab = engine.vocab.n_vocab
    with every_row_decoded(engine, tokens):
        def one(i: int) -> int:
            return int(logits_row(engine.ctx, i, n_vocab).argmax())

        # Every position asked for logits: a position's row is its index.
        every = list(range(len(tokens)))
        assert greedy_tokens(engine.ctx, every, len(tokens), n_vocab) == [one(i) for i in every]
        for rows in ([3], [5, 4, 9], [0, len(tokens) - 1], every[::-3]):
            assert greedy_tokens(engine.ctx, rows, len(tokens), n_vocab) == [one(i) for i in rows]


def test_each_position_reads_its_own_row_when_only_some_ask_and_sequences_interleave(engine):
    """A step's batch as the scheduler builds one: two sequences' positions
    interleaved (llama.cpp decodes them in micro-batches of one sequence and
    puts the rows back in batch order), only some asking for logits. A
    position's row, counted among those that asked, holds what llama.cpp's
    own lookup by position (``llama_get_logits_ith``) gives."""
    assert engine.scheduler.active == 0
    conv = Conversation(model="m", items=[Message("user", "Name three rivers of Europe and one of Asia.")],
                        sampling=Sampling(temperature=0))
    tokens = engine.prepare(conv).tokens[:40]
    n, n_vocab = 2 * len(tokens), engine.vocab.n_vocab
    batch = llama_cpp.llama_batch_init(n, 0, 1)
    try:
        for i in range(n):
            seq, pos = i % 2, i // 2
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tokens[pos], pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = int(i % 3 == 0 or i >= n - 2)
        batch.n_tokens = n
        for seq in (0, 1):
            engine.kv.clear(seq)
        assert llama_cpp.llama_decode(engine.ctx.ctx, batch) == 0
        asked = [i for i in range(n) if batch.logits[i]]
        row = {i: r for r, i in enumerate(asked)}
        some = asked[1::4]
        # Through the whole buffer first, before llama.cpp's lookup by position has run.
        got = greedy_tokens(engine.ctx, [row[i] for i in asked], len(asked), n_vocab)
        got_some = greedy_tokens(engine.ctx, [row[i] for i in some[::-1]], len(asked), n_vocab)[::-1]
        expected = {i: int(logits_row(engine.ctx, i, n_vocab).argmax()) for i in asked}
        assert got == [expected[i] for i in asked]
        assert got_some == [expected[i] for i in some]
        assert len(set(got)) > 5, "rows with different answers"
    finally:
        llama_cpp.llama_batch_free(batch)
        for seq in (0, 1):
            engine.kv.clear(seq)
