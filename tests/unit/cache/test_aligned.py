"""A branch after sampled turns (SessionState.aligned): the KV holds the
model's own tokens of each reply, which no tokenization of the replayed text
reproduces, so an edit of the latest message shares only a short token
prefix with the state. Through the points where each turn's prompt began and
ended it keeps every turn before the edit."""

from __future__ import annotations

from lmspd.cache.manager import CachePlan, CacheRequest, ContinuationCache
from lmspd.cache.state import SessionState, common_prefix
from support.cache_rig import INSTRUCTIONS, make_cache, request

USER = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def sampled(cache: ContinuationCache, reply: str) -> list[int]:
    """The model's tokens of ``reply``: one per character, as a sampler may
    write it, never what the tokenizer makes of the text."""
    return [t for ch in reply for t in cache.ops.tokenize(ch)] + cache.ops.tokenize("<|im_end|>")


def run_turn(cache: ContinuationCache, req: CacheRequest, reply: str) -> tuple[CachePlan, SessionState]:
    """Plan, apply and finish one turn as the scheduler does; the state's
    visible transcript is the prompt and the reply as a replay renders it."""
    plan = cache.plan(req)
    assert plan is not None
    plan = cache.apply(plan, req)
    r = cache.residents[plan.seq]
    r.tokens = r.prompt + sampled(cache, reply)
    visible = req.text + reply + "<|im_end|>\n"
    state = SessionState(tokens=list(r.tokens), kv_text=cache.ops.detokenize(r.tokens), visible=visible)
    cache.finished(plan.seq, state)
    cache.release(plan.seq)
    return plan, state


REPLY1 = 'I will look at the failing test first, then fix "parse_date" in utils.py.'
REPLY2 = "The test expects ISO dates; parse_date now accepts them."


def three_turns(cache: ContinuationCache) -> tuple[str, SessionState, SessionState]:
    prompt1 = INSTRUCTIONS + USER.format("Fix the failing test in utils.py.")
    plan1, state1 = run_turn(cache, request(cache, prompt1), REPLY1)
    assert plan1.source == "cold"
    prompt2 = state1.visible + USER.format("Which test was it?")
    plan2, state2 = run_turn(cache, request(cache, prompt2), REPLY2)
    assert plan2.source == "visible-prefix" and plan2.keep == len(state1.tokens)
    return prompt2, state1, state2


def test_an_edit_of_the_last_message_keeps_the_turns_before_it(vocab):
    cache = make_cache(vocab, n_seq=1)  # the state's own sequence is the only one: trimmed in place
    _, state1, state2 = three_turns(cache)
    assert state2.aligned[-2:] == ((len(state1.tokens), len(state1.visible)),
                                   (len(state1.tokens) + len(cache.ops.tokenize(USER.format("Which test was it?"))),
                                    len(state1.visible) + len(USER.format("Which test was it?"))))
    # The client edits its second message: a branch from the end of turn 1.
    edited = request(cache, state1.visible + USER.format("Which file did you change?"))
    tokens_only = common_prefix(state2.tokens, edited.tokens)
    assert tokens_only < len(state1.tokens) - 10, "the sampled reply breaks the token prefix (else this tests nothing)"
    plan = cache.plan(edited)
    assert plan.source == "memory-token" and "aligned" in plan.detail.split()
    assert plan.keep == len(state1.tokens)
    assert plan.suffix == cache.ops.tokenize(USER.format("Which file did you change?"))
    assert plan.base_text == state1.kv_text + USER.format("Which file did you change?")
    # The diagnosis names what was shared: the whole first turn, not the token prefix.
    assert cache.diagnose(edited, plan).longest_prefix == len(state1.tokens)
    applied = cache.apply(plan, edited)
    assert ("trim", applied.seq, len(state1.tokens)) in cache.kv.calls


def test_an_edit_copies_the_turns_before_it_into_a_free_sequence_when_the_state_should_stay(cache):
    _, state1, state2 = three_turns(cache)
    seq = next(r.seq for r in cache.residents if r.state is state2)
    # Another sequence is free and the resident one is the request's target
    # only if nothing else is: take one that is not the state's.
    for r in cache.residents:
        if r.seq != seq:
            r.last_used = 0.0
    edited = request(cache, state1.visible + USER.format("Which file did you change?"))
    plan = cache.plan(edited)
    assert plan.keep == len(state1.tokens)
    assert plan.source == "copy" and plan.copy_from == seq and plan.detail == f"from=seq{seq} aligned"


def test_an_edit_of_the_first_message_keeps_only_what_the_texts_share(cache):
    _, state1, state2 = three_turns(cache)
    # Only the instructions are shared: no alignment point lies inside them
    # but the start (a cold first turn), so the token prefix decides.
    edited = request(cache, INSTRUCTIONS + USER.format("Fix the failing test in dates.py."))
    plan = cache.plan(edited)
    assert "aligned" not in plan.detail.split()
    assert plan.keep == min(common_prefix(state2.tokens, edited.tokens), len(edited.tokens) - 1)


def test_points_survive_a_restore_from_ram(cache):
    _, state1, state2 = three_turns(cache)
    seq = next(r.seq for r in cache.residents if r.state is state2)
    # The session leaves its sequence (captured to RAM) and comes back for a branch.
    cache.residency.evict(cache.residents[seq])
    cache.residents[seq].tokens = []
    cache._publish()
    edited = request(cache, state1.visible + USER.format("Which file did you change?"))
    plan = cache.plan(edited)
    assert plan.source == "ram" and "aligned" in plan.detail.split(), plan
    assert plan.keep == len(state1.tokens) and plan.restore is state2


def test_a_replay_missing_its_reasoning_on_an_aligned_branch_renders_without_it_and_says_so(vocab):
    """As OpenAI accepts it (issue 32): not refused; the diagnosis names
    ``reasoning_stripped``."""
    cache = make_cache(vocab, n_seq=1)  # in place (memory-token), not a copy
    _, state1, _ = three_turns(cache)
    edited = request(cache, state1.visible + USER.format("Which file did you change?"), needs_reasoning_state=True)
    plan = cache.plan(edited)
    assert plan is not None and plan.reasoning_stripped
    assert cache.diagnose(edited, plan).miss_reason == "reasoning_stripped"


def test_only_the_aligned_branch_that_is_tried_detokenizes_its_kv(vocab):
    """Every remembered state of the owner may offer an aligned branch; its
    suffix (a tokenization of the rest of the prompt) and text (a
    detokenization of the kept KV, thousands of tokens) are worked out only
    for the candidate the plan tries, not for every one that competes."""
    cache = make_cache(vocab, n_seq=1)
    _, state1, state2 = three_turns(cache)
    # Two branches of turn 1 in RAM, both able to resume at its end.
    cache.residency.evict(cache.residents[0])
    cache.residents[0].tokens = []
    cache._publish()
    plan, state3 = run_turn(cache, request(cache, state1.visible + USER.format("Where is it?")), REPLY2)
    assert "aligned" in plan.detail.split()
    cache.residency.evict(cache.residents[0])
    cache.residents[0].tokens = []
    cache._publish()
    assert {state2.key, state3.key} <= set(cache.tiers.ram)

    kept: list[int] = []
    detokenize = cache.ops.detokenize

    def counting(tokens: list[int]) -> str:
        kept.append(len(tokens))
        return detokenize(tokens)

    cache.ops.detokenize = counting
    edited = request(cache, state1.visible + USER.format("Which file did you change?"))
    plan = cache.plan(edited)
    assert plan.source == "ram" and "aligned" in plan.detail.split() and plan.keep == len(state1.tokens), plan
    assert plan.restore in (state2, state3)
    assert plan.base_text == state1.kv_text + USER.format("Which file did you change?")
    assert plan.suffix == cache.ops.tokenize(USER.format("Which file did you change?"))
    assert kept == [len(state1.tokens)], "one detokenization of the kept KV, for the plan that was tried"
