"""The bundled model's llama engine in this process, for unit tests of the
engine's parts that need a real model but no server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import llama_cpp
from llama_cpp import _internals as internals

from lmspd.engines.llama.engine import LlamaEngine
from lmspd.engines.llama.models import resolve_model
from support.server import MODEL


@contextmanager
def bundled_engine(*, n_ctx: int = 512, model: str = MODEL, **options: Any) -> Iterator[LlamaEngine]:
    """One thread, so that a test's timing does not depend on the machine's
    core count; closed (its scheduler thread stopped) afterwards."""
    model_id, path = resolve_model(model)
    engine = LlamaEngine(model_id, path, n_ctx=n_ctx, n_threads=1, **options)
    try:
        yield engine
    finally:
        asyncio.run(engine.aclose())


@contextmanager
def every_row_decoded(engine: LlamaEngine, tokens: list[int]) -> Iterator[internals.LlamaSampler]:
    """``tokens`` evaluated on sequence 0 of the engine's own context with
    logits on every row, and llama.cpp's greedy sampler to compare picks
    with. Only while the scheduler idles: a scratch sequence would race it,
    so the test takes the KV while nothing runs, and clears it afterwards."""
    assert engine.scheduler.active == 0
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    chain = internals.LlamaSampler()
    chain.add_greedy()
    try:
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(tokens)
        engine.kv.clear(0)
        assert llama_cpp.llama_decode(engine.ctx.ctx, batch) == 0
        yield chain
    finally:
        chain.close()
        llama_cpp.llama_batch_free(batch)
        engine.kv.clear(0)
