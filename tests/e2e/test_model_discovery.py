"""A model found only through an Ollama-style store, served by its Ollama name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from lmspd.engines.llama.models import resolve_model
from support.server import ServerProcess

DIGEST = "0123456789abcdef" * 4


def ollama_store(root: Path) -> Path:
    """~/.ollama/models with the bundled GGUF as the blob of two tags."""
    models = root / ".ollama" / "models"
    (models / "blobs").mkdir(parents=True)
    os.symlink(resolve_model(None)[1], models / "blobs" / f"sha256-{DIGEST}")
    manifest = json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{DIGEST}", "size": 1}]})
    for model, tag in (("tinychat", "latest"), ("othermodel", "q4")):
        path = models / "manifests" / "registry.ollama.ai" / "library" / model / tag
        path.parent.mkdir(parents=True)
        path.write_text(manifest)
    return models


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("home")
    ollama_store(home)
    return home


@pytest.fixture(scope="module")
def ollama_server(home):
    # HOME is the only place the model exists: no path, no bundled id.
    srv = ServerProcess("--model", "tinychat", "--ctx", "1024", env={"HOME": str(home)}).start()
    yield srv
    srv.stop()


def test_the_ollama_name_serves_and_answers(ollama_server):
    r = httpx.post(ollama_server.url + "/v1/responses",
                   json={"model": "tinychat", "input": "Say hi.", "max_output_tokens": 8, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tinychat"
    assert r.json()["output"][0]["content"][0]["text"]


def test_models_lists_the_served_one_and_the_other_found_one(ollama_server):
    data = httpx.get(ollama_server.url + "/v1/models", timeout=30).json()["data"]
    by_id = {d["id"]: d for d in data}
    assert by_id["tinychat"]["served"] is True
    other = by_id["othermodel:q4"]
    assert other["served"] is False and other["owned_by"] == "ollama"
    assert other["gguf"]["context_length"] == 8192 and other["gguf"]["quantization"] == "Q4_1"
    assert "path" not in other["gguf"] and str(ollama_server.data_dir) not in json.dumps(data)


def test_the_cli_table_lists_ollama_names(home):
    out = subprocess.run([sys.executable, "-m", "lmspd", "models"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HOME": str(home)})
    assert out.returncode == 0, out.stderr
    assert "tinychat:latest" in out.stdout and "othermodel:q4" in out.stdout and "ollama" in out.stdout
    rows = json.loads(subprocess.run([sys.executable, "-m", "lmspd", "models", "--json"], capture_output=True,
                                     text=True, timeout=60, env={**os.environ, "HOME": str(home)}).stdout)
    assert {r["name"] for r in rows} >= {"smollm2-135m-instruct", "tinychat:latest", "othermodel:q4"}
