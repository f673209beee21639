"""The registry's memory estimate counts the KV of every ``--parallel``
sequence: the llama engine gives each one the full window (``ctx * parallel``
cells), so a budget computed for one sequence would load models that do not
fit. It is the same arithmetic the engine plans its load with (fit.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lmspd.engines.llama.fit import ModelShape
from lmspd.engines.llama.gguf import read_gguf
from lmspd.engines.llama.models import resolve_model
from lmspd.engines.registry import ModelRegistry, lazy_llama_engine
from lmspd.engines.specs import ConfigError, LlamaSpec


def _cost(parallel: int, ctx: int = 1024, max_mib: int | None = None) -> int:
    registry = ModelRegistry(max_bytes=max_mib << 20 if max_mib else None)
    spec = LlamaSpec(model=None, ctx=ctx, parallel=parallel)
    return lazy_llama_engine(spec, SimpleNamespace(models_dir=None), registry).cost_bytes


def test_kv_grows_with_the_sequences() -> None:
    path = resolve_model(None)[1]
    shape = ModelShape.from_metadata(read_gguf(path).metadata)
    assert shape is not None
    one = shape.kv_bytes(1024)
    assert one > 0 and shape.kv_bytes(1024, 4) == 4 * one
    # SmolLM2-135M: 30 layers, 3 KV heads of 64: f16 K and V.
    assert one == 2 * 2 * 30 * 1024 * 3 * 64
    compute = shape.compute_bytes(1024, 1, flash_attn=False)
    assert _cost(1) == path.stat().st_size + one + compute
    assert _cost(4) - _cost(1) == 3 * one


def test_a_budget_that_fits_one_sequence_refuses_four() -> None:
    one_seq_mib = (_cost(1, ctx=8192) >> 20) + 1
    _cost(1, ctx=8192, max_mib=one_seq_mib)  # fits
    with pytest.raises(ConfigError, match="models-max-mem"):
        _cost(4, ctx=8192, max_mib=one_seq_mib)
