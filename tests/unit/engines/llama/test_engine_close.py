"""Closing an engine right after it started: the grammar tokenizer, built
on a background thread from the model's vocabulary, must be stopped before
the model is freed. It was not, and a server stopped in its first seconds
(or any short-lived engine: bench/overhead.py renders its prompts with one)
died of a segmentation fault."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import asyncio, threading
from lmspd.engines.llama.engine import LlamaEngine
from lmspd.engines.llama.models import resolve_model

model_id, path = resolve_model("smollm2-135m-instruct")
for _ in range(3):
    engine = LlamaEngine(model_id, path, n_ctx=256, n_threads=1, parallel=1)
    walking = any(t.name == "lmspd-grammar-vocab" for t in threading.enumerate())
    asyncio.run(engine.aclose())
    print("walking at close:", walking,
          "alive after:", any(t.name == "lmspd-grammar-vocab" for t in threading.enumerate()))
"""


def test_an_engine_closed_while_its_grammar_tokenizer_builds_exits_cleanly():
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", SCRIPT],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("walking at close")]
    assert len(lines) == 3
    # The build was still running when the engine closed (else this tests
    # nothing), and no walk outlives its engine.
    assert any("walking at close: True" in line for line in lines), lines
    assert all(line.endswith("alive after: False") for line in lines), lines
