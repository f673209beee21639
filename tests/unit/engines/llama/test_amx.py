"""llama.cpp's AMX kernels (lmspd/engines/llama/amx.py): a build that has
them, on a CPU that has AMX, loads the model without the extra CPU weight
buffers unless ``LMSPD_AMX=on``; ``./dev.sh`` builds without them; and a
model loaded with lmspd's parameters survives its first prompt batch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tests.unit.engines.llama.test_placement_flags import refusal

from lmspd.engines.llama import amx
from lmspd.engines.llama.models import resolve_model

REPO = Path(__file__).resolve().parents[4]


@pytest.mark.parametrize("setting,built,cpu,use", [
    ("auto", True, True, False),   # the kernels would run: off
    ("auto", True, False, True),   # no AMX CPU: ggml offers no AMX buffer
    ("auto", False, True, True),   # no AMX kernels built: the repacked kernels are sound
    ("auto", False, False, True),
    ("on", True, True, True),
    ("off", False, False, False),
    ("off", True, True, False),
])
def test_the_extra_buffers_are_off_only_where_the_amx_kernels_would_run(setting: str, built: bool, cpu: bool,
                                                                         use: bool) -> None:
    decided = amx.decide(setting, built_with_amx=built, cpu_has_amx=cpu)
    assert decided.use is use
    # Every departure from llama.cpp's defaults, and every forced use, is said at start.
    assert bool(decided.reason) == (not use or setting == "on" and built and cpu)


def test_the_reason_names_the_way_out() -> None:
    reason = amx.decide("auto", built_with_amx=True, cpu_has_amx=True).reason
    assert "LMSPD_AMX=on" in reason and "./dev.sh" in reason and "20824" in reason


def test_the_setting_is_read_from_the_environment() -> None:
    assert amx.setting({}) == "auto"
    assert amx.setting({"LMSPD_AMX": " OFF "}) == "off"
    assert amx.setting({"LMSPD_AMX": ""}) == "auto"
    with pytest.raises(ValueError, match="LMSPD_AMX must be one of auto, on, off"):
        amx.setting({"LMSPD_AMX": "yes"})


def test_a_bad_setting_is_refused_before_loading(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMSPD_AMX", "sometimes")
    assert "LMSPD_AMX must be one of auto, on, off (not 'sometimes')" in refusal(capsys)


def test_the_build_is_read_from_llama_cpp_system_info() -> None:
    assert amx.built_with_amx("CPU : AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 |")
    assert not amx.built_with_amx("CPU : AVX512 = 1 | AMX_INT8 = 0 | REPACK = 1 |")
    assert not amx.built_with_amx("CPU : AVX2 = 1 | REPACK = 1 |")


def test_the_cpu_is_read_from_its_flags(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8 avx512_vnni\n"
                       "processor\t: 1\n")
    assert amx.cpu_has_amx(cpuinfo, system="linux", machine="x86_64")
    assert not amx.cpu_has_amx(cpuinfo, system="darwin", machine="x86_64")
    assert not amx.cpu_has_amx(cpuinfo, system="linux", machine="aarch64")
    cpuinfo.write_text("flags\t\t: fpu avx512f avx512_vnni amx_tile amx_int8_extra\n")  # whole flags only
    assert not amx.cpu_has_amx(cpuinfo, system="linux", machine="x86_64")
    assert not amx.cpu_has_amx(tmp_path / "missing", system="linux", machine="x86_64")


def test_dev_sh_builds_llama_cpp_without_amx_kernels() -> None:
    """Where ./dev.sh built llama.cpp on x86-64 Linux (its stamp says so),
    the library has no AMX kernels: the flag it builds with took effect."""
    stamp = Path(sys.prefix) / ".lmspd-llama-backend"
    if not stamp.exists() or not stamp.read_text().strip().endswith("-noamx"):
        pytest.skip(f"llama.cpp not built by ./dev.sh on x86-64 Linux here ({stamp})")
    assert not amx.built_with_amx()


def test_a_model_loaded_with_lmspds_parameters_survives_a_prompt_batch() -> None:
    """A batch of 32 tokens is where a broken AMX kernel faults (a single
    token takes another path); in a child, so that a fault fails this test
    instead of ending the run."""
    path = resolve_model(None)[1]
    script = f"""
import llama_cpp
from llama_cpp import _internals as internals
from lmspd.engines.llama import amx
llama_cpp.llama_backend_init()
model = internals.LlamaModel(path_model={str(path)!r}, params=amx.model_params(), verbose=False)
params = llama_cpp.llama_context_default_params()
params.n_ctx, params.n_batch, params.n_ubatch, params.n_threads, params.n_threads_batch = 256, 64, 64, 2, 2
ctx = internals.LlamaContext(model=model, params=params, verbose=False)
batch = internals.LlamaBatch(n_tokens=64, embd=0, n_seq_max=1, verbose=False)
batch.set_batch(list(range(100, 132)), n_past=0, logits_all=False)
ctx.decode(batch)
print("decoded", amx.extra_buffers().use)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"rc={done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.strip().startswith("decoded")
