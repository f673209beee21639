"""Finding GGUFs where other tools keep them: one fixture tree per layout,
with the bundled model linked in the way each tool links its files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lmspd.engines.llama.discovery import Roots, discover, find
from lmspd.engines.llama.models import ModelNotFound, resolve_model
from support.gguf_writer import gguf_bytes, model_metadata

DIGEST = "a" * 64


@pytest.fixture(scope="module")
def bundled() -> Path:
    return resolve_model(None)[1]


def hf_tree(root: Path, bundled: Path) -> Path:
    """models--ORG--REPO/{blobs,refs,snapshots}: snapshot files are symlinks into blobs/."""
    repo = root / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct-GGUF"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    blob = repo / "blobs" / "deadbeef"
    blob.symlink_to(bundled)
    for rev in ("old1", "main1"):
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True)
        (snap / "smollm2-135m-instruct-q4_1.gguf").symlink_to(os.path.relpath(blob, snap))
    (repo / "snapshots" / "old1" / "stale-Q8_0.gguf").symlink_to("../../blobs/missing")  # dangling
    (repo / "refs" / "main").write_text("main1")
    (root / "hub" / "datasets--x--y").mkdir()
    return root / "hub"


def ollama_tree(root: Path, bundled: Path) -> Path:
    models = root / "ollama" / "models"
    (models / "blobs").mkdir(parents=True)
    (models / "blobs" / f"sha256-{DIGEST}").symlink_to(bundled)
    (models / "blobs" / f"sha256-{'b' * 64}").write_text("{}")  # a config blob
    manifest = {"schemaVersion": 2, "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                                               "digest": f"sha256:{'b' * 64}"},
                "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{DIGEST}",
                            "size": bundled.stat().st_size},
                           {"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{'c' * 64}"}]}
    for host, ns, model, tag in (("registry.ollama.ai", "library", "smollm2", "135m"),
                                 ("registry.ollama.ai", "library", "smollm2", "latest"),
                                 ("registry.ollama.ai", "someone", "tiny", "v1"),
                                 ("hf.co", "HuggingFaceTB", "SmolLM2-135M-Instruct-GGUF", "Q4_1")):
        path = models / "manifests" / host / ns / model / tag
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(manifest))
    broken = models / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    broken.parent.mkdir(parents=True)
    broken.write_text("not json")
    return models


def lmstudio_tree(root: Path, bundled: Path) -> Path:
    models = root / "lmstudio" / "models"
    one = models / "lmstudio-community" / "SmolLM2-135M-Instruct-GGUF"
    one.mkdir(parents=True)
    (one / "SmolLM2-135M-Instruct-Q4_1.gguf").symlink_to(bundled)
    two = models / "bartowski" / "Qwen-Tiny-GGUF"
    two.mkdir(parents=True)
    (two / "Qwen-Tiny-Q4_K_M.gguf").write_bytes(gguf_bytes(model_metadata(
        arch="qwen2", ctx=32768, file_type=15, template="{% if tools %}<tool_call>{% endif %}<think>")))
    (two / "Qwen-Tiny-Q8_0.gguf").write_bytes(gguf_bytes(model_metadata(arch="qwen2", file_type=7)))
    (two / "mmproj-Qwen-Tiny-f16.gguf").write_bytes(gguf_bytes(model_metadata(arch="clip")))
    return models


def test_models_dir_finds_files_by_stem(tmp_path, bundled):
    d = tmp_path / "models" / "nested"
    d.mkdir(parents=True)
    (d / "My-Model-Q4_1.gguf").symlink_to(bundled)
    (d / "big-00002-of-00003.gguf").write_bytes(b"GGUF")  # a later split part: not a model
    (d / "notes.txt").write_text("x")
    (d / "corrupt.gguf").write_bytes(b"GGUF\x03\x00")
    found = {m.name: m for m in discover(Roots(models_dir=tmp_path / "models"))}
    assert set(found) == {"my-model-q4_1", "corrupt"}
    m = found["my-model-q4_1"]
    assert (m.source, m.context_length, m.quantization, m.architecture) == ("models-dir", 8192, "Q4_1", "llama")
    assert m.size_bytes == bundled.stat().st_size
    assert found["corrupt"].error and "truncated" in found["corrupt"].error


def test_hugging_face_snapshots_and_symlinks(tmp_path, bundled):
    hub = hf_tree(tmp_path, bundled)
    models = discover(Roots(hf_hub=hub))
    # The dangling stale-Q8_0.gguf link is no file: not listed.
    assert [m.name for m in models] == ["HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/smollm2-135m-instruct-q4_1.gguf"]
    m = models[0]
    assert m.source == "huggingface" and m.context_length == 8192 and m.quantization == "Q4_1"
    assert m.path.resolve() == bundled.resolve()
    assert "main1" in str(m.path)  # refs/main's snapshot wins
    assert find("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1", Roots(hf_hub=hub)) == m
    assert find("huggingfacetb/smollm2-135m-instruct-gguf", Roots(hf_hub=hub)) == m


def test_hf_home_and_hub_cache_variables(tmp_path):
    assert Roots.default(env={"HOME": str(tmp_path)}).hf_hub == tmp_path / ".cache" / "huggingface" / "hub"
    assert Roots.default(env={"HOME": "/h", "HF_HOME": "/hf"}).hf_hub == Path("/hf/hub")
    assert Roots.default(env={"HOME": "/h", "HF_HOME": "/hf", "HF_HUB_CACHE": "/c"}).hf_hub == Path("/c")
    assert Roots.default(env={"HOME": "/h", "OLLAMA_MODELS": "/o"}).ollama == Path("/o")
    assert Roots.default(env={"HOME": "/h"}).lmstudio[0] == Path("/h/.lmstudio/models")


def test_ollama_manifests_name_models_as_ollama_does(tmp_path, bundled):
    store = ollama_tree(tmp_path, bundled)
    roots = Roots(ollama=store)
    names = [m.name for m in discover(roots)]
    assert names == ["hf.co/HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1", "smollm2:135m", "smollm2:latest",
                     "someone/tiny:v1"]
    latest = find("smollm2", roots)  # no tag means :latest
    assert latest is not None and latest.name == "smollm2:latest"
    assert latest.path.resolve() == bundled.resolve() and latest.context_length == 8192
    assert find("smollm2:135m", roots).source == "ollama"
    assert find("broken", roots) is None


def test_lm_studio_publisher_model_folders(tmp_path, bundled):
    roots = Roots(lmstudio=(lmstudio_tree(tmp_path, bundled),))
    found = {m.name: m for m in discover(roots)}
    assert set(found) == {"bartowski/Qwen-Tiny-GGUF/Qwen-Tiny-Q4_K_M.gguf",
                          "bartowski/Qwen-Tiny-GGUF/Qwen-Tiny-Q8_0.gguf",
                          "lmstudio-community/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf"}
    qwen = found["bartowski/Qwen-Tiny-GGUF/Qwen-Tiny-Q4_K_M.gguf"]
    assert qwen.capabilities == {"tools": True, "reasoning": True}
    assert (qwen.context_length, qwen.quantization, qwen.architecture) == (32768, "Q4_K_M", "qwen2")
    assert found["bartowski/Qwen-Tiny-GGUF/Qwen-Tiny-Q8_0.gguf"].quantization == "Q8_0"
    # A folder with one model answers to its folder name; one with two does not.
    assert find("lmstudio-community/SmolLM2-135M-Instruct-GGUF", roots).path.resolve() == bundled.resolve()
    assert find("bartowski/Qwen-Tiny-GGUF", roots) is None


def test_model_flag_accepts_every_store_name(tmp_path, bundled):
    roots = Roots(models_dir=None, hf_hub=hf_tree(tmp_path, bundled), ollama=ollama_tree(tmp_path, bundled),
                  lmstudio=(lmstudio_tree(tmp_path, bundled),))
    assert resolve_model("smollm2:135m", roots) == ("smollm2:135m", find("smollm2:135m", roots).path)
    served, path = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1", roots)
    assert served == "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"  # served as the user named it
    assert path.resolve() == bundled.resolve()
    with pytest.raises(ModelNotFound, match="lmspd models"):
        resolve_model("no-such-model:7b", roots)
    # The bundled id and plain paths work as before.
    assert resolve_model(None, roots)[0] == "smollm2-135m-instruct"
    assert resolve_model(str(bundled), roots)[1] == bundled


def test_walks_are_bounded(tmp_path, monkeypatch):
    import lmspd.engines.llama.discovery as discovery

    monkeypatch.setattr(discovery, "MAX_ENTRIES", 5)
    d = tmp_path / "many"
    d.mkdir()
    for i in range(20):
        (d / f"m{i:02d}.gguf").write_bytes(gguf_bytes(model_metadata()))
    assert 0 < len(discover(Roots(models_dir=d))) <= 5
