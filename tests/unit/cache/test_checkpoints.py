"""Matching on a KV that cannot be trimmed below a floor (sliding window,
recurrent): no rule cuts a state below it, the nearest exact-state
checkpoint at or before the divergence serves instead, and the diagnosis
names a missing checkpoint. The bundled model's real tokenizer, a fake KV
whose floor is set per sequence."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lmspd.cache.disk import DiskCheckpoints
from lmspd.cache.manager import CacheRequest
from lmspd.cache.state import SessionState, common_prefix
from lmspd.core.conversation import Message
from support.cache_rig import INSTRUCTIONS, hold, make_cache, request, turn


def conversation(user2):
    turn1 = INSTRUCTIONS + "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>"
    return turn1, turn1 + "\n<|im_start|>user\n" + user2 + "<|im_end|>\n<|im_start|>assistant\n"


def test_partial_prefix_below_the_floor_is_not_cut(vocab):
    tok = vocab.tokenize
    _, text = conversation("a long document " * 20)
    tokens = tok(text.encode(), add_bos=False, special=True)
    cache = make_cache(vocab, n_seq=2, floors={0: len(tokens) - 8})
    hold(cache, 0, SessionState(tokens=tokens, kv_text=text, owner="local"))
    _, edited = conversation("an edited document " * 20)
    req = CacheRequest(text=edited, tokens=cache.ops.tokenize(edited), items=[])
    plan = cache.plan(req)
    # Without a checkpoint the only exact start is a cold prefill.
    assert plan.source == "cold", plan
    report = cache.diagnose(req, plan)
    assert report.miss_reason == "checkpoint_missing" and report.divergence_token == report.longest_prefix > 64


def test_a_ram_state_below_its_floor_does_not_hide_a_disk_checkpoint_of_the_shared_prefix(vocab, tmp_path):
    """After a restart a new session of the same agent shares the
    instructions with a remembered conversation that diverges later: the RAM
    state cannot be cut there, the disk checkpoint at the end of the
    instructions can (it used to lose to the longer, unusable prefix)."""
    disk = DiskCheckpoints(tmp_path, 1 << 30, "fp")
    cache = make_cache(vocab, n_seq=1, floors={0: 10**6}, disk=disk)
    _, text = conversation("a long document " * 20)
    tok = cache.ops.tokenize
    head = tok(INSTRUCTIONS)
    disk.save(SessionState(tokens=head, kv_text=INSTRUCTIONS, owner="local", kv=b"head", floor=len(head)))
    tokens = tok(text)
    cache.tiers.remember(SessionState(tokens=tokens, kv_text=text, owner="local", kv=b"conv", floor=len(tokens) - 4))
    _, edited = conversation("an edited document " * 20)
    plan = cache.plan(CacheRequest(text=edited, tokens=tok(edited), items=[]))
    assert plan.source == "disk" and plan.keep == len(head) and plan.restore.kv == b"head", plan


def test_within_the_floor_the_state_is_cut(vocab):
    _, text = conversation("a long document " * 20)
    cache = make_cache(vocab, n_seq=2, floors={0: 10})
    tokens = cache.ops.tokenize(text)
    hold(cache, 0, SessionState(tokens=tokens, kv_text=text, owner="local"))
    _, edited = conversation("a long document " * 19 + "and more")
    req = CacheRequest(text=edited, tokens=cache.ops.tokenize(edited), items=[])
    plan = cache.plan(req)
    assert plan.source in ("memory-token", "copy") and plan.keep > 64, plan


def test_a_turn_extended_in_place_leaves_a_checkpoint_that_a_branch_restores(vocab):
    turn1, text = conversation("a long document " * 20)
    cache = make_cache(vocab, n_seq=2, floors={0: 10**6, 1: 10**6})
    t1 = SessionState(tokens=cache.ops.tokenize(turn1), kv_text=turn1, visible=turn1, owner="local",
                      items=[Message("user", "hello"), Message("assistant", "hi")])
    hold(cache, 0, t1)
    req = CacheRequest(text=text, tokens=cache.ops.tokenize(text), items=[])
    plan = cache.plan(req)
    assert plan.source == "visible-prefix" and plan.seq == 0
    cache.apply(plan, req)  # turn 2 runs on top of turn 1: turn 1 is captured first
    assert ("capture", 0) in cache.kv.calls and cache.stats.checkpoints == 1
    r = cache.residents[0]
    r.tokens.extend(plan.suffix)
    cache.finished(0, SessionState(tokens=list(r.tokens), kv_text=text, owner="local"))
    cache.release(0)
    _, edited = conversation("an edited document " * 20)
    branch = cache.plan(CacheRequest(text=edited, tokens=cache.ops.tokenize(edited), items=[]))
    assert branch.source == "checkpoint" and branch.detail.startswith("at=response from=ram"), branch
    assert branch.keep == len(t1.tokens) and branch.restore is t1


PROMPT = INSTRUCTIONS + "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n"
REASONING = "The user greets me; greet back.\n</think>\n\n"


def reasoned_turn(cache):
    """One turn on sequence 0 as the scheduler runs it: the prompt's prefill
    (its end checkpointed), the reasoning (its end checkpointed with the
    text sampled past the prompt), then a long answer."""
    req = request(cache, PROMPT)
    plan = cache.plan(req)
    cache.apply(plan, req)
    r = cache.residents[0]
    r.tokens.extend(plan.suffix)
    cache.checkpoint(0, "local", "input")
    r.tokens.extend(cache.ops.tokenize(REASONING))
    cache.checkpoint(0, "local", "reasoning", at=len(r.tokens), generated=REASONING)
    answer = "Hello! " * 40 + "<|im_end|>"
    r.tokens.extend(cache.ops.tokenize(answer))
    text = PROMPT + REASONING + answer
    cache.finished(0, SessionState(tokens=list(r.tokens), kv_text=text, visible=text, owner="local"))
    cache.release(0)
    return req


def test_a_sealed_replay_with_an_edited_answer_restores_the_end_of_reasoning(vocab):
    cache = make_cache(vocab, n_seq=1, floors={0: 10**6})
    turn1 = reasoned_turn(cache)
    assert cache.stats.checkpoints == 2
    replay = (PROMPT + REASONING + "Hi.<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n"
              "<|im_start|>assistant\n<think>\n")
    plan = cache.plan(request(cache, replay))
    assert plan.source == "checkpoint" and plan.detail == "at=reasoning from=ram visible", plan
    assert plan.keep == len(turn1.tokens) + len(cache.ops.tokenize(REASONING))
    assert plan.restore.visible == PROMPT + REASONING and plan.restore.boundary == "reasoning"
    # A replay that drops the reasoning parts before it: the end of the input serves.
    stripped = PROMPT + "Hi.<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n<think>\n"
    plan = cache.plan(request(cache, stripped))
    assert plan.source == "checkpoint" and plan.detail.startswith("at=input") and plan.keep == len(turn1.tokens)


def test_a_reasoning_checkpoint_is_taken_only_where_the_generation_said_the_kv_is(vocab):
    """``at``: the KV must hold exactly the tokens its text was sampled into."""
    cache = make_cache(vocab, n_seq=1, floors={0: 10**6})
    req = request(cache, PROMPT)
    plan = cache.plan(req)
    cache.apply(plan, req)
    r = cache.residents[0]
    r.tokens.extend(plan.suffix + cache.ops.tokenize(REASONING))
    cache.checkpoint(0, "local", "reasoning", at=len(r.tokens) - 1, generated=REASONING)
    assert cache.stats.checkpoints == 0
    cache.checkpoint(0, "local", "reasoning", at=len(r.tokens), generated=REASONING)
    assert cache.stats.checkpoints == 1


def test_a_trimmable_kv_takes_no_reasoning_checkpoint(vocab):
    cache = make_cache(vocab, n_seq=1)
    reasoned_turn(cache)
    assert cache.stats.checkpoints == 0 and not any(c[0] == "capture" for c in cache.kv.calls)


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_common_prefix_is_the_longest_shared_prefix(a, b):
    n = common_prefix(a, b)
    assert a[:n] == b[:n] and n == common_prefix(b, a)
    assert n == min(len(a), len(b)) or a[n] != b[n]


def test_a_checkpoint_already_kept_is_not_captured_again(vocab):
    """A second checkpoint of the same tokens finds the first by its key,
    before copying the sequence's KV (megabytes on a real model) to compare."""
    cache = make_cache(vocab, n_seq=1, floors={0: 10**6})
    req = request(cache, PROMPT)
    plan = cache.plan(req)
    cache.apply(plan, req)
    cache.residents[0].tokens.extend(plan.suffix)
    cache.checkpoint(0, "local", "input")
    captures = cache.kv.calls.count(("capture", 0))
    assert cache.stats.checkpoints == 1 and captures >= 1
    cache.checkpoint(0, "local", "breakpoint")
    assert cache.kv.calls.count(("capture", 0)) == captures and cache.stats.checkpoints == 1


def test_a_failed_run_leaves_no_agent_on_its_emptied_sequence(vocab):
    cache = make_cache(vocab, n_seq=1)
    req = request(cache, PROMPT, agent="child", parent_agent="parent")
    cache.apply(cache.plan(req), req)
    assert cache.sequences()[0]["agent"] is not None
    cache.discard(0)
    assert cache.sequences()[0] | {"idle_s": None} == {
        "id": 0, "owner": cache.residents[0].owner, "tokens": 0, "busy": False, "idle_s": None,
        "agent": None, "parent_agent": None}


def test_a_state_without_its_kv_bytes_restores_onto_a_cleared_sequence(vocab):
    """A plan to restore a state whose bytes are gone falls back to a cold
    prefill, which must not land on what the sequence held before."""
    cache = make_cache(vocab, n_seq=1)
    hold(cache, 0, turn(cache, INSTRUCTIONS + "<|im_start|>user\nsomething else<|im_end|>\n"))
    saved = turn(cache, PROMPT, owner="local")  # no kv: its bytes are gone
    cache.tiers.remember(saved)
    req = request(cache, PROMPT + "more")
    plan = cache.plan(req)
    assert plan.restore is saved, plan
    applied = cache.apply(plan, req)
    assert applied.source == "cold" and applied.detail == "restore failed"
    assert ("trim", 0, 0) in cache.kv.calls and cache.residents[0].tokens == []
