"""bench/speculative.py gives llama.cpp's server the prompt tokens lmspd's
engine would feed the model, built from lmspd's own parts (the dialect's
decoding, the engine's preparation over the vocabulary alone). Those parts
move: 7b61cae removed a constructor the benchmark still called, and only a
full run, twenty minutes in, found out. This keeps the benchmark's copy in
step with the engine (in a child process: the benchmark puts bench/ first
on sys.path, whose modules would shadow others here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.dialects.openai_responses import decode_request
from support.cache_rig import GGUF
from support.llama_engine import bundled_engine

BENCH = Path(__file__).resolve().parents[2] / "bench"
BODY = {"model": "m", "instructions": "Be brief.", "input": "Name one colour.", "max_output_tokens": 8,
        "temperature": 0, "store": False}


def test_the_benchmarks_prompt_tokens_are_the_engines():
    script = (f"import json, sys; sys.path.insert(0, {str(BENCH)!r}); import speculative; "
              f"print(json.dumps(speculative.LmspdPrompts(__import__('pathlib').Path({str(GGUF)!r}))"
              f".tokens(json.loads(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(BODY)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    with bundled_engine(n_ctx=512) as engine:
        ours = engine.prepare(decode_request(BODY, DEFAULT_LIMITS.request).conversation).tokens
    assert theirs == ours and len(ours) > 10
