"""A window longer than the model was trained on gets YaRN (``--rope-scaling
auto``): unscaled, the positions past the trained length are ones the model
never saw (the bundled SmolLM2, trained on 8192, reads code at perplexity
805 between 12k and 16k tokens, 8.8 with YaRN: ``bench/rope_scaling.py``).
Decided by ``placement.plan`` for the window it chose, applied by the engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from llama_cpp import _internals as internals

from lmspd.engines.llama.engine import LlamaEngine
from lmspd.engines.llama.fit import FitError
from lmspd.engines.llama.placement import RopeScaling, plan, rope_scaling
from support.gguf_writer import with_metadata
from support.llama_server import bundled_gguf

LLAMA = {"general.architecture": "llama"}


def test_yarn_only_past_the_trained_length_and_only_where_the_model_has_no_scaling_of_its_own() -> None:
    assert rope_scaling(LLAMA, 8192, 8192, "auto") is None
    assert rope_scaling(LLAMA, 8192, 4096, "auto") is None
    assert rope_scaling(LLAMA, None, 32768, "auto") is None  # a header without its length: nothing to scale from
    yarn = rope_scaling(LLAMA, 8192, 32768, "auto")
    assert yarn == RopeScaling(trained=8192, window=32768)
    assert yarn.freq_scale == 0.25
    assert yarn.public() == {"type": "yarn", "factor": 4.0, "original_context": 8192}
    assert rope_scaling(LLAMA, 8192, 32768, "none") is None
    # A model extended by its own scaling (Qwen's YaRN, a linear stretch): llama.cpp applies that.
    for own in ("yarn", "linear"):
        assert rope_scaling({**LLAMA, "llama.rope.scaling.type": own}, 8192, 32768, "auto") is None
    assert rope_scaling({**LLAMA, "llama.rope.scaling.type": "none"}, 8192, 32768, "auto") == yarn


def test_the_plan_scales_the_window_it_chose() -> None:
    path = Path(bundled_gguf())  # trained on 8192
    placed = plan(path, ctx=32768, parallel=1, check=False)
    assert placed.rope == RopeScaling(trained=8192, window=32768)
    assert "window 32768 x 1 sequences (YaRN x4 over the trained 8192)" in placed.line("m")
    assert placed.public()["rope_scaling"] == {"type": "yarn", "factor": 4.0, "original_context": 8192}
    assert plan(path, ctx=4096, parallel=1, check=False).rope is None
    assert plan(path, ctx=32768, parallel=1, check=False, rope="none").rope is None
    # --ctx auto: at least 32768 for a model trained on less, scaled.
    auto = plan(path, parallel=1)
    assert auto.window >= 32768 and auto.rope == RopeScaling(trained=8192, window=auto.window)
    with pytest.raises(FitError, match="--rope-scaling must be one of auto, none"):
        plan(path, ctx=4096, check=False, rope="linear")


def test_the_flag_and_the_config_key_reach_the_plan(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import lmspd.server
    from lmspd.cli import main
    from lmspd.engines.specs import ConfigError, load_config_file, plan_llama, specs_from_settings

    seen: list = []
    monkeypatch.setattr(lmspd.server, "serve", lambda settings: seen.append(settings) or 0)
    assert main(["serve", "--ctx", "16384"]) == 0 and main(["serve", "--ctx", "16384", "--rope-scaling", "none"]) == 0
    path = Path(bundled_gguf())
    planned = [plan_llama(specs_from_settings(s)[0], path, s) for s in seen]
    assert [p.rope for p in planned] == [RopeScaling(trained=8192, window=16384), None]
    with pytest.raises(SystemExit):
        main(["serve", "--rope-scaling", "linear"])

    config = tmp_path / "models.toml"
    config.write_text('[models.a]\nctx = 16384\nrope_scaling = "none"\n[models.b]\nctx = 16384\n')
    a, b = load_config_file(config)
    assert (a.rope_scaling, b.rope_scaling) == ("none", "auto")
    assert plan_llama(a, path, seen[0]).rope is None
    config.write_text('[models.a]\nrope_scaling = "yarn"\n')
    with pytest.raises(ConfigError, match="models.a: rope_scaling must be one of auto, none"):
        load_config_file(config)


def test_a_model_with_its_own_scaling_is_left_to_it(tmp_path: Path) -> None:
    copy = tmp_path / "own-yarn.gguf"
    copy.write_bytes(with_metadata(Path(bundled_gguf()).read_bytes(), {"llama.rope.scaling.type": "yarn"}))
    assert plan(copy, ctx=32768, parallel=1, check=False).rope is None


def _last_logits(engine: LlamaEngine, tokens: list[int]) -> np.ndarray:
    batch = internals.LlamaBatch(n_tokens=len(tokens), embd=0, n_seq_max=1)
    batch.set_batch(tokens, n_past=0, logits_all=False)
    engine.ctx.decode(batch)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(engine._model.model))
    return np.ctypeslib.as_array(engine.ctx.get_logits(), shape=(n_vocab,)).copy()


def test_the_engine_hands_the_scaling_to_llama_cpp() -> None:
    """The same prompt's logits at the start of a 16384-token window: YaRN
    moves every position's rotation a little, so they differ from the
    unscaled engine's; within the trained length no engine scales, and they
    are the same."""
    path = Path(bundled_gguf())
    tokens = list(range(100, 164))

    def logits(n_ctx: int, rope: str) -> tuple[np.ndarray, RopeScaling | None]:
        engine = LlamaEngine("m", path, n_ctx=n_ctx, n_threads=1, parallel=1, rope_scaling=rope,
                             grammars_at_start=False)
        try:
            return _last_logits(engine, tokens), engine.placement.rope
        finally:
            asyncio.run(engine.aclose())

    scaled, rope = logits(16384, "auto")
    unscaled, none = logits(16384, "none")
    assert rope == RopeScaling(trained=8192, window=16384) and none is None
    assert np.abs(scaled - unscaled).max() > 0.05
    short_auto, _ = logits(4096, "auto")
    short_none, _ = logits(4096, "none")
    assert np.array_equal(short_auto, short_none)
    assert np.abs(short_none - unscaled).max() < 1e-3  # the unscaled window's size alone changes nothing
