"""The benchmarks' in-process baselines (``llama_cpp.Llama`` in the
benchmark's own process) load the model with the parameters lmspd's engine
uses: on a llama.cpp built with AMX kernels, on an AMX CPU, without the
extra CPU weight buffers. With llama.cpp's defaults there the baseline of
``bench/overhead.py`` died at its first prompt (a segfault, seen when
``bench/gpu/run.sh --backend cpu`` ran on llama-cpp-python from pip's cache)
while lmspd beside it ran. In a child process: ``LMSPD_AMX`` is read once a
process, and bench/ first on sys.path would shadow modules here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lmspd.engines.llama import amx
from support.cache_rig import GGUF

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPT = f"""
import json, sys
sys.path.insert(0, {str(BENCH)!r})
import llama_cpp.llama_cpp as low
from _common import llama_as_lmspd_loads
llm = llama_as_lmspd_loads({str(GGUF)!r}, n_ctx=256, n_threads=1, verbose=False)
out = llm.create_completion("The sea is", max_tokens=4, temperature=0)
print(json.dumps({{"loaded": llm.model_params.use_extra_bufts,
                   "after": low.llama_model_default_params().use_extra_bufts,
                   "tokens": out["usage"]["completion_tokens"]}}))
"""


def _load(setting: str) -> dict[str, object]:
    env = {**os.environ, "LMSPD_AMX": setting}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_in_process_baseline_loads_as_lmspd_does() -> None:
    # ``off`` leaves the extra buffers out on any machine, as ``auto`` does
    # on an AMX build on an AMX CPU; llama.cpp's defaults are back after
    # (read where ``Llama`` reads them, the binding swapped for the load).
    assert _load("off") == {"loaded": False, "after": True, "tokens": 4}
    auto = amx.decide("auto", built_with_amx=amx.built_with_amx(), cpu_has_amx=amx.cpu_has_amx()).use
    assert _load("auto") == {"loaded": auto, "after": True, "tokens": 4}
