"""The registry's memory estimate counts the KV of every ``--parallel``
sequence: the llama engine gives each one the full window (``ctx * parallel``
cells), so a budget computed for one sequence would load models that do not fit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lmspd.engines.llama.gguf import read_gguf
from lmspd.engines.llama.models import resolve_model
from lmspd.engines.registry import ModelRegistry, kv_bytes_estimate, lazy_llama_engine
from lmspd.engines.specs import LlamaSpec


def _cost(parallel: int, ctx: int = 1024, max_mib: int | None = None) -> int:
    registry = ModelRegistry(max_bytes=max_mib << 20 if max_mib else None)
    spec = LlamaSpec(model=None, ctx=ctx, parallel=parallel)
    return lazy_llama_engine(spec, SimpleNamespace(models_dir=None), registry).cost_bytes


def test_kv_grows_with_the_sequences() -> None:
    path = resolve_model(None)[1]
    meta = read_gguf(path).metadata
    one = kv_bytes_estimate(meta, 1024)
    assert one > 0 and kv_bytes_estimate(meta, 1024, sequences=4) == 4 * one
    # SmolLM2-135M: 30 layers, 3 KV heads of 64: f16 K and V.
    assert one == 2 * 2 * 30 * 1024 * 3 * 64
    assert _cost(1) == path.stat().st_size + one
    assert _cost(4) - _cost(1) == 3 * one


def test_a_budget_that_fits_one_sequence_refuses_four() -> None:
    one_seq_mib = (_cost(1, ctx=8192) >> 20) + 1
    _cost(1, ctx=8192, max_mib=one_seq_mib)  # fits
    with pytest.raises(ValueError, match="models-max-mem"):
        _cost(4, ctx=8192, max_mib=one_seq_mib)
