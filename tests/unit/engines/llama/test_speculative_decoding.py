"""Speculative decoding in the scheduler, on the bundled model in process:
the acceptance rule (greedy decoding takes the same tokens with and without
drafts, free and under a grammar, and with a reasoning section cut by its
budget mid-draft), rollback (the KV holds exactly the sequence's tokens
afterwards), a cancelled sequence that drafted frees cleanly, a forced
reasoning close counts against the limit and the window (drafts included),
and a KV that cannot be trimmed does not speculate.

Drafting is made unconditional (``cheap_batches``: the GPU case, where a
batch costs what one token costs) so that drafts are proposed and rejected
here on every run, whatever this machine's speed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lmspd.core.conversation import Conversation, FunctionTool, Message, Sampling, ToolChoice
from lmspd.core.events import Finished, TextDelta, ToolCallDone
from lmspd.engines.base import CancelToken
from lmspd.engines.llama.engine import CacheSettings, LlamaEngine
from lmspd.engines.llama.stepcost import DecodeCost
from support.llama_engine import bundled_engine

THINKING = (Path(__file__).parents[3] / "fixtures" / "thinking_chatml.jinja").read_text()
CODE = "\n".join(f"def scale_{i}(x):\n    return x * {i} + {3 * i}" for i in range(8))
COPY = "Repeat this code exactly, then stop:\n\n" + CODE


class CheapBatches(DecodeCost):
    def ms(self, n_tokens: int) -> float:
        return 1.0


@contextmanager
def drafting(engine: LlamaEngine) -> Iterator[None]:
    sched = engine.scheduler
    before = sched.decode_cost
    sched.decode_cost = CheapBatches()
    try:
        yield
    finally:
        sched.decode_cost = before


def conversation(text: str, *, speculative: bool, **kw) -> Conversation:
    kw.setdefault("sampling", Sampling(temperature=0))
    return Conversation(model="m", items=[Message("user", text)], max_output_tokens=kw.pop("max_output_tokens", 60),
                        speculative=speculative, cache_reuse=False, **kw)


def run(engine: LlamaEngine, conv: Conversation, cancel_after: int | None = None):
    async def go():
        cancel = CancelToken()
        events = []
        async for ev in engine.generate(engine.prepare(conv), cancel):
            events.append(ev)
            if cancel_after is not None and sum(isinstance(e, TextDelta) for e in events) == cancel_after:
                cancel.cancel()
        return events
    events = asyncio.run(go())
    return engine.last_output_token_ids(), events


def kv_matches_tokens(engine: LlamaEngine) -> None:
    """Every sequence's KV holds exactly the tokens the cache says it holds:
    no rejected draft position left behind. After the scheduler is idle:
    a turn's last token is evaluated after its terminal event."""
    deadline = time.monotonic() + 30
    while engine.scheduler.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.scheduler.active == 0
    for seq, resident in enumerate(engine.cache.residents):
        assert engine.kv.n_tokens(seq) == len(resident.tokens), seq


@pytest.fixture(scope="module")
def engine():
    with bundled_engine(parallel=2, n_ctx=1024) as eng:
        yield eng


def test_greedy_takes_the_same_tokens_with_and_without_drafts(engine):
    with drafting(engine):
        before = engine.stats()["speculation"]["drafted"]
        plain, plain_events = run(engine, conversation(COPY, speculative=False))
        # Turned off for the request, it drafted nothing (the same text drafts below).
        assert engine.stats()["speculation"]["drafted"] == before
        fast, events = run(engine, conversation(COPY, speculative=True))
    assert fast == plain
    report = events[-1].usage.decode_report
    assert plain_events[-1].usage.decode_report is None
    stats = report.as_json()
    # Drafts were both kept and refused: the rule was exercised both ways.
    assert stats["by_source"]["ngram"]["accepted"] > 0
    assert stats["by_source"]["ngram"]["drafted"] > stats["by_source"]["ngram"]["accepted"]
    kv_matches_tokens(engine)
    # The engine's totals, for /metrics.
    assert engine.stats()["speculation"]["by_source"]["ngram"]["drafted"] >= stats["drafted"]


def test_a_seeded_sample_at_temperature_takes_the_same_tokens(engine):
    sampling = Sampling(temperature=0.7, seed=7)
    with drafting(engine):
        plain, _ = run(engine, conversation(COPY, speculative=False, sampling=sampling))
        fast, events = run(engine, conversation(COPY, speculative=True, sampling=sampling))
    assert fast == plain
    assert events[-1].usage.decode_report.as_json()["drafted"] > 0


def test_a_grammar_constrained_call_is_the_same_and_drafts_forced_tokens(engine):
    tool = FunctionTool("write_file", "Write a file",
                        {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                         "required": ["path", "content"]})
    text = "Save this code to scale.py:\n\n" + CODE

    def call(speculative: bool):
        conv = conversation(text, speculative=speculative, tools=[tool], max_output_tokens=90,
                            tool_choice=ToolChoice(mode="required"))
        return run(engine, conv)

    with drafting(engine):
        plain, plain_events = call(False)
        fast, events = call(True)
    assert fast == plain
    done = [e for e in events if isinstance(e, ToolCallDone)]
    assert [e.payload for e in done] == [e.payload for e in plain_events if isinstance(e, ToolCallDone)]
    stats = events[-1].usage.decode_report.as_json()["by_source"]
    assert stats["grammar"]["accepted"] > 0
    assert stats["ngram"]["drafted"] > 0
    kv_matches_tokens(engine)


def test_a_cancelled_sequence_that_drafted_frees_cleanly(engine):
    with drafting(engine):
        tokens, events = run(engine, conversation(COPY, speculative=True), cancel_after=5)
        assert isinstance(events[-1], Finished) and events[-1].reason == "cancelled"
        assert events[-1].usage.decode_report.as_json()["drafted"] > 0
        kv_matches_tokens(engine)
        # The sequences serve the next request as if nothing happened.
        again, _ = run(engine, conversation(COPY, speculative=True))
        plain, _ = run(engine, conversation(COPY, speculative=False))
    assert again == plain


def test_a_reasoning_section_cut_by_its_budget_mid_draft():
    with bundled_engine(parallel=1, n_ctx=1024, chat_template=THINKING) as eng:
        def think(speculative: bool):
            conv = conversation("Write the code below again.\n\n" + CODE, speculative=speculative,
                                reasoning_effort="minimal", max_output_tokens=50)
            tokens, events = run(eng, conv)
            text = "".join(e.text for e in events if isinstance(e, TextDelta))
            return tokens, text, events[-1]

        with drafting(eng):
            plain = think(False)
            fast = think(True)
        assert fast[0] == plain[0] and fast[1] == plain[1]
        assert fast[2].usage.reasoning_tokens == plain[2].usage.reasoning_tokens == 16  # effort minimal's budget
        assert fast[2].usage.decode_report.as_json()["drafted"] > 0
        kv_matches_tokens(eng)


@pytest.mark.parametrize("speculative", [False, True])
def test_a_forced_reasoning_close_stays_within_the_window_and_the_limit(speculative):
    """The close lmspd writes when the reasoning budget is spent is output
    too: it counts against the limit and takes cells of the window, and so
    limits the drafts. Without room for it after the budget (a limit of the
    window's room, or none; or a small one), the block runs on to the limit.
    A 256-token window, the prompt leaving 67 tokens of room."""
    with bundled_engine(parallel=1, n_ctx=256, chat_template=THINKING) as eng:
        prompt = "Write the code below again.\n\n" + CODE + "\ndef scale_8(x):\n    return x * 8 + 24"
        room = eng.n_ctx - len(eng.prepare(conversation(prompt, speculative=False)).tokens)
        assert room == 67
        with drafting(eng):
            for limit, reason in ((None, "context_window"), (room, "length"), (20, "length")):
                conv = conversation(prompt, speculative=speculative, reasoning_effort="minimal",
                                    max_output_tokens=limit)
                _, events = run(eng, conv)
                end = events[-1]
                assert isinstance(end, Finished), (limit, end)
                assert (end.reason, end.usage.output_tokens) == (reason, limit or room), (limit, end)
                if limit == 20:  # no room for the close after the budget (16): all reasoning
                    assert end.usage.reasoning_tokens == 20, end.usage
                if speculative:
                    assert end.usage.decode_report.as_json()["drafted"] > 0
                kv_matches_tokens(eng)


def test_a_kv_that_cannot_be_trimmed_does_not_speculate():
    with bundled_engine(parallel=1, n_ctx=512, model="gemma3-270m") as eng:
        assert eng.kv.kind == "swa"
        assert eng.speculative == "off" and eng.scheduler.planner is None
        _, events = run(eng, conversation("Say hi.", speculative=True, max_output_tokens=4))
        assert events[-1].usage.decode_report is None
    with bundled_engine(parallel=1, n_ctx=512, model="gemma3-270m", cache=CacheSettings(swa_full=True)) as eng:
        # A full-size window keeps every cell: rejected positions can go.
        assert eng.speculative == "auto"


class LinearCost(DecodeCost):
    """A fixed price list (10 ms + 0.5 ms a token), not learned: the step's
    composition, not this machine's speed, decides."""

    def observe(self, n_tokens: int, ms: float) -> None:
        pass

    def ms(self, n_tokens: int) -> float:
        return 10.0 + 0.5 * n_tokens


def test_fairness_a_drafting_sequence_never_delays_a_plain_one(engine):
    sched = engine.scheduler
    steps: list[tuple[int, int, int]] = []  # parts in the step, tokens before drafts, draft tokens
    real = sched._plan_drafts

    def spy(parts, n):
        real(parts, n)
        steps.append((len(parts), n, sum(len(r.draft.tokens) for r, _, _ in parts if r.draft is not None)))

    cost = LinearCost()
    before = sched.decode_cost
    sched._plan_drafts = spy
    sched.decode_cost = cost

    async def both():
        async def one(conv):
            return [ev async for ev in engine.generate(engine.prepare(conv), CancelToken())]
        await asyncio.gather(one(conversation(COPY, speculative=True, max_output_tokens=70)),
                             one(conversation("Tell me about the sea.", speculative=False, max_output_tokens=20)))
    try:
        asyncio.run(both())
    finally:
        del sched._plan_drafts
        sched.decode_cost = before
    shared = [s for s in steps if s[0] > 1]
    alone = [s for s in steps if s[0] == 1]
    assert shared and alone
    # Beside the plain sequence (or its prefill), the step grows by at most 10 %.
    for _, n, drafted in shared:
        assert cost.ms(n + drafted) <= 1.10 * cost.ms(n)
    # Alone, the same sequence drafts past that bound: the rule, not a lack of drafts, held it.
    assert max(d for _, _, d in alone) > max(d for _, _, d in shared)
    kv_matches_tokens(engine)
