"""A KV checkpoint on disk is used only by an engine that can restore it
exactly: the same model file, window, llama.cpp build and KV kind, and the
same cell types, V layout (flash attention) and positions' encoding (YaRN).
Otherwise a match cost a read, a refused restore and a cold prefill; a
state computed under other RoPE frequencies would be wrong if restored. The
model is named by its content (``model_identity``): another GGUF of the same
name and size must not restore the states of the one it replaced."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from lmspd.cache.disk import DiskCheckpoints
from lmspd.cache.state import SessionState
from lmspd.engines.llama.engine import (
    IDENTITY_BLOCK_BYTES,
    IDENTITY_BLOCKS,
    IDENTITY_HEAD_BYTES,
    CacheSettings,
    LlamaEngine,
    model_identity,
)
from support.llama_server import bundled_gguf


def fingerprint(tmp_path: Path, model: Path | None = None, **settings) -> str:
    engine = LlamaEngine("m", model or Path(bundled_gguf()), n_threads=1, parallel=1, grammars_at_start=False,
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


def changed(path: Path, offset: int) -> None:
    """One byte of ``path`` at ``offset`` flipped: same name, same size."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 1]))  # ASCII stays ASCII: a name stays loadable


def test_another_gguf_of_the_same_name_and_size_has_another_fingerprint(tmp_path: Path) -> None:
    """v1/model.gguf replaced by v2/model.gguf, other weights (one tensor
    byte in a block the identity samples) or other metadata (the model's
    name): each restored the states of the other."""
    source = Path(bundled_gguf())
    size = source.stat().st_size
    sampled = (size - IDENTITY_BLOCK_BYTES) * 8 // (IDENTITY_BLOCKS - 1) + 100  # in the 9th block
    assert sampled > IDENTITY_HEAD_BYTES
    named = source.read_bytes().index(b"Smollm2 135M")
    models = {}
    for version, offset in (("v1", None), ("weights", sampled), ("metadata", named)):
        model = tmp_path / version / "model.gguf"
        model.parent.mkdir()
        shutil.copy(source, model)
        if offset is not None:
            changed(model, offset)
        assert model.stat().st_size == size
        models[version] = fingerprint(tmp_path / version / "kv", model)
    assert len(set(models.values())) == 3, models


def test_the_model_identity_reads_its_head_and_sampled_blocks_only(tmp_path: Path) -> None:
    """Cheap for a 20 GB GGUF: the head (header, metadata, tensor index) and
    ``IDENTITY_BLOCKS`` blocks spread over the weights; a byte in any of
    them changes it, a byte between them does not (nothing else is read)."""
    size = 64 << 20
    model = tmp_path / "model.gguf"
    with open(model, "wb") as fh:
        fh.truncate(size)
    plain = model_identity(model)
    last = size - IDENTITY_BLOCK_BYTES
    block = [last * i // (IDENTITY_BLOCKS - 1) for i in range(IDENTITY_BLOCKS)]
    for offset in (100, IDENTITY_HEAD_BYTES - 1, block[9] + 5, size - 1):
        changed(model, offset)
        assert model_identity(model) != plain, offset
        changed(model, offset)  # back
        assert model_identity(model) == plain
    between = block[9] + IDENTITY_BLOCK_BYTES + 7
    assert between < block[10]
    changed(model, between)
    assert model_identity(model) == plain


def test_checkpoints_of_the_fingerprint_before_the_models_identity_are_removed(tmp_path: Path) -> None:
    """Upgrading: a checkpoint written under the file name and size alone
    is another model's to this build, removed at the scan, never restored."""
    kv = tmp_path / "kv"
    model = Path(bundled_gguf())
    probe = fingerprint(tmp_path / "probe")
    settings = probe[probe.index(":512:") + 1:]  # the window, the build, the KV's kind and layout
    old = f"{model.name}:{model.stat().st_size}:{settings}"
    DiskCheckpoints(kv, 1 << 30, old).save(SessionState(tokens=[1, 2, 3], kv_text="abc", kv=b"state"))
    assert len(list(kv.glob("*.kv"))) == 1
    fingerprint(kv)
    assert list(kv.glob("*.kv")) == []
