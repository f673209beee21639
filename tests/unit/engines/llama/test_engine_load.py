"""Loading a model: a failure says why in llama.cpp's words, and loads in
several threads at once (the model registry loads each model in its own)
leave the process's stdout and stderr alone."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path

import pytest

from lmspd.engines.llama.engine import LlamaEngine
from lmspd.engines.llama.models import resolve_model
from support.gguf_writer import gguf_bytes, model_metadata
from support.server import MODEL


def test_a_model_of_an_unknown_architecture_names_it(tmp_path: Path):
    """llama-cpp-python says only "Failed to load model from file"."""
    path = tmp_path / "frob.gguf"
    path.write_bytes(gguf_bytes(model_metadata(arch="frobnicator")))
    with pytest.raises(ValueError) as failed:
        LlamaEngine("frob", path, n_ctx=256, n_threads=1, parallel=1, grammars_at_start=False)
    message = str(failed.value)
    assert "unknown model architecture: 'frobnicator'" in message, message
    assert str(path) in message


def test_a_truncated_model_says_so(tmp_path: Path):
    _, bundled = resolve_model(MODEL)
    path = tmp_path / "cut.gguf"
    with open(bundled, "rb") as whole:
        path.write_bytes(whole.read(bundled.stat().st_size // 2))
    with pytest.raises(ValueError, match="not within the file bounds"):
        LlamaEngine("cut", path, n_ctx=256, n_threads=1, parallel=1, grammars_at_start=False)


def test_models_loading_in_threads_at_once_leave_stdout_and_stderr_alone():
    """llama-cpp-python's ``verbose=False`` points fds 1 and 2 at /dev/null
    and swaps ``sys.stdout``/``sys.stderr`` while it loads, then puts back
    what it found: two loads at once put /dev/null back, and the server's
    log was silent for good."""
    model_id, path = resolve_model(MODEL)
    streams = (sys.stdout, sys.stderr)
    fds = {fd: (os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)}
    seen: list[str] = []
    loading = threading.Event()

    def watch() -> None:
        while loading.is_set():
            if (sys.stdout, sys.stderr) != streams:
                seen.append("sys.stdout/sys.stderr swapped")
            for fd, ident in fds.items():
                if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) != ident:
                    seen.append(f"fd {fd} redirected")
            if seen:
                return
            loading.wait(0.0005)

    engines: list[LlamaEngine] = []
    failures: list[BaseException] = []

    def load() -> None:
        try:
            engines.append(LlamaEngine(model_id, path, n_ctx=256, n_threads=1, parallel=1, grammars_at_start=False))
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    loading.set()
    watcher = threading.Thread(target=watch)
    watcher.start()
    loaders = [threading.Thread(target=load) for _ in range(2)]
    try:
        for t in loaders:
            t.start()
        for t in loaders:
            t.join()
    finally:
        loading.clear()
        watcher.join()
        for engine in engines:
            asyncio.run(engine.aclose())
    assert not failures, failures
    assert len(engines) == 2
    assert not seen, seen
    assert (sys.stdout, sys.stderr) == streams
    assert {fd: (os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)} == fds
