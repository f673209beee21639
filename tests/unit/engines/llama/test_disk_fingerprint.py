"""A KV checkpoint on disk is used only by an engine that can restore it
exactly: the same model file, window, llama.cpp build and KV kind, and the
same cell types, V layout (flash attention) and positions' encoding (YaRN).
Otherwise a match cost a read, a refused restore and a cold prefill; a
state computed under other RoPE frequencies would be wrong if restored."""

from __future__ import annotations

import asyncio
from pathlib import Path

from lmspd.engines.llama.engine import CacheSettings, LlamaEngine
from support.llama_server import bundled_gguf


def fingerprint(tmp_path: Path, **settings) -> str:
    engine = LlamaEngine("m", Path(bundled_gguf()), n_threads=1, parallel=1, grammars_at_start=False,
                         cache=CacheSettings(disk_dir=tmp_path), **{"n_ctx": 512, **settings})
    try:
        assert engine.cache.disk is not None
        return engine.cache.disk.fingerprint
    finally:
        asyncio.run(engine.aclose())


def test_the_checkpoints_fingerprint_names_what_a_restore_needs(tmp_path: Path) -> None:
    plain = fingerprint(tmp_path)
    assert fingerprint(tmp_path) == plain  # the same engine again reads its own checkpoints
    assert fingerprint(tmp_path, kv_type="q8_0") != plain  # (q8_0 turns flash attention on)
    assert fingerprint(tmp_path, flash_attn="on") != plain
    assert fingerprint(tmp_path, n_ctx=16384) != fingerprint(tmp_path, n_ctx=16384, rope_scaling="none")
