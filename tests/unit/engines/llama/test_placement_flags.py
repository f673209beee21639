"""``--gpu-layers``, ``--flash-attn``, ``--kv-type`` and ``--ctx auto``: parsed and
checked before anything loads (in-process), and the same settings in a config file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import lmspd.server
from lmspd.cli import main
from lmspd.engines.llama import devices as devs
from lmspd.engines.llama.devices import FREE_MEMORY_ENV, Device, Devices
from lmspd.engines.llama.fit import MIB, FitError, Memory
from lmspd.engines.llama.models import resolve_model
from lmspd.engines.llama.placement import plan
from lmspd.engines.specs import ConfigError, load_config_file


def settings_of(monkeypatch: pytest.MonkeyPatch, *flags: str) -> Any:
    seen: list[Any] = []
    monkeypatch.setattr(lmspd.server, "serve", lambda settings: seen.append(settings) or 0)
    assert main(["serve", *flags]) == 0
    return seen[0]


def refusal(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main(["serve", *flags])
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_defaults_leave_the_choices_to_the_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    s = settings_of(monkeypatch)
    assert (s.ctx, s.parallel, s.gpu_layers, s.flash_attn, s.kv_type) == (None, None, None, "auto", "f16")


def test_given_values_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    s = settings_of(monkeypatch, "--ctx", "8192", "--parallel", "2", "--gpu-layers", "20", "--flash-attn", "on",
                    "--kv-type", "q4_0")
    assert (s.ctx, s.parallel, s.gpu_layers, s.flash_attn, s.kv_type) == (8192, 2, 20, "on", "q4_0")
    s = settings_of(monkeypatch, "--ctx", "0", "--gpu-layers", "all")
    assert (s.ctx, s.gpu_layers) == (0, None)


@pytest.mark.parametrize("flags,message", [
    (["--kv-type", "q8_0", "--flash-attn", "off"], "--kv-type q8_0 quantizes the V cache, which llama.cpp supports "
                                                     "only with flash attention"),
    (["--kv-type", "q4_0", "--flash-attn", "off"], "use --flash-attn on"),
    (["--gpu-layers", "-1"], "--gpu-layers must be >= 0"),
    (["--gpu-layers", "most"], "--gpu-layers must be 'all' or a number of layers"),
    (["--ctx", "big"], "--ctx must be 'auto' or a number of tokens"),
    (["--ctx", "-5"], "--ctx must be between 0"),
    (["--kv-type", "q5_1"], "invalid choice"),
    (["--flash-attn", "maybe"], "invalid choice"),
])
def test_bad_values_are_refused_before_loading(capsys: pytest.CaptureFixture[str], flags: list[str],
                                               message: str) -> None:
    assert message in refusal(capsys, *flags)


def test_the_config_file_takes_the_same_settings(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[models.a]\nctx = "auto"\ngpu_layers = 12\nflash_attn = "on"\nkv_type = "q8_0"\n'
                    '[models.b]\nctx = 4096\ngpu_layers = "all"\n')
    a, b = load_config_file(path)
    assert (a.ctx, a.gpu_layers, a.flash_attn, a.kv_type, a.parallel) == (None, 12, "on", "q8_0", None)
    assert (b.ctx, b.gpu_layers, b.flash_attn, b.kv_type) == (4096, None, "auto", "f16")
    path.write_text('[models.a]\nkv_type = "q4_0"\nflash_attn = "off"\n')
    with pytest.raises(ConfigError, match="models.a: kv_type q4_0 quantizes the V cache"):
        load_config_file(path)


def test_flash_attention_auto_follows_the_backend_and_the_kv_type() -> None:
    path = resolve_model(None)[1]
    # This build and machine: the CPU, where auto is off (the slower kernel there) ...
    cpu = plan(path, ctx=1024, parallel=1, check=False)
    assert (cpu.backend, cpu.gpu_layers, cpu.flash_attn) == ("cpu", 0, False)
    # ... unless the KV is quantized, which needs it.
    assert plan(path, ctx=1024, parallel=1, kv_type="q8_0", check=False).flash_attn is True
    assert plan(path, ctx=1024, parallel=1, flash_attn="on", check=False).flash_attn is True


def a_gpu(free_mib: int) -> Devices:
    return Devices("cuda", (Device("CUDA0", "a test card", free_mib * MIB, 24 * 1024 * MIB),))


def test_a_gpu_takes_every_layer_when_they_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    path = resolve_model(None)[1]
    monkeypatch.delenv(FREE_MEMORY_ENV, raising=False)
    # 8 GiB free, 7 GiB usable: 4 x 32768 x 22.5 KiB = 2880 MiB of KV fit beside the weights.
    gpu = plan(path, found=a_gpu(8192))
    assert (gpu.backend, gpu.gpu_layers, gpu.n_gpu_layers, gpu.flash_attn) == ("cuda", 30, -1, True)
    assert (gpu.window, gpu.parallel, gpu.device) == (32768, 4, "CUDA0: a test card")
    # 2 GiB free, 1 GiB usable: weights 92 MiB + compute 169 MiB + 720 MiB for one 32768 window: one sequence,
    # all layers on the card (rather than four sequences half in RAM).
    small = plan(path, found=a_gpu(2048))
    assert (small.gpu_layers, small.parallel, small.window) == (30, 1, 32768)
    # --gpu-layers 0: the CPU, flash attention auto off.
    cpu = plan(path, gpu_layers=0, found=a_gpu(8192))
    assert (cpu.backend, cpu.gpu_layers, cpu.n_gpu_layers, cpu.flash_attn, cpu.device) == ("cpu", 0, 0, False, None)


def test_layers_that_do_not_fit_the_card_stay_in_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    path = resolve_model(None)[1]
    monkeypatch.delenv(FREE_MEMORY_ENV, raising=False)
    monkeypatch.setattr(devs, "ram", lambda: Memory("RAM", 16 * 1024 * MIB, 18 * 1024 * MIB, 2 * 1024 * MIB))
    # 1536 MiB free, 512 usable: even one sequence of the 16384 floor (360 MiB of KV + 261) does not fit the
    # card. The window and sequences fit RAM (4 x 32768); each layer on the card costs ~3 MiB of weights and
    # 4 x 32768 x 768 B = 96 MiB of KV, beside 169 MiB of compute buffers: (512 - 169) / 99 -> 3 layers.
    partial = plan(path, found=a_gpu(1536))
    assert (partial.backend, partial.gpu_layers, partial.n_gpu_layers) == ("cuda", 3, 3)
    assert (partial.window, partial.parallel) == (32768, 4)
    assert partial.reason.startswith("3 of 30 layers fit CUDA0")
    # Asked for 10 layers: refused, naming what fits.
    with pytest.raises(FitError, match=r"--gpu-layers 10 needs [\d,]+ MiB on CUDA0, more than its 512 MiB usable; "
                                       r"use --gpu-layers 3 or fewer"):
        plan(path, gpu_layers=10, found=a_gpu(1536))


def test_a_gpu_that_takes_no_layer_leaves_flash_attention_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """--flash-attn auto is on where layers are offloaded: a card too full
    for one layer is a CPU run, where the flash attention kernel is the slow
    one (README: 2.9x slower per output token); it was on, decided from
    "a GPU exists" before the layers were placed."""
    path = resolve_model(None)[1]
    monkeypatch.delenv(FREE_MEMORY_ENV, raising=False)
    monkeypatch.setattr(devs, "ram", lambda: Memory("RAM", 16 * 1024 * MIB, 18 * 1024 * MIB, 2 * 1024 * MIB))
    # 1100 MiB free, 76 usable: less than the 169 MiB of compute buffers, no layer fits.
    none = plan(path, found=a_gpu(1100))
    assert (none.backend, none.gpu_layers, none.device) == ("cpu", 0, None)
    assert none.flash_attn is False
    assert none.reason.startswith("0 of 30 layers fit CUDA0")
    # Fitted for the CPU's compute buffers (without flash attention they grow with the window).
    cpu = plan(path, gpu_layers=0, found=a_gpu(1100))
    assert (none.window, none.parallel, none.cost_bytes) == (cpu.window, cpu.parallel, cpu.cost_bytes)
    # A quantized KV needs it wherever it runs; --flash-attn on is kept.
    assert plan(path, kv_type="q8_0", found=a_gpu(1100)).flash_attn is True
    assert plan(path, flash_attn="on", found=a_gpu(1100)).flash_attn is True


def test_a_refusal_names_the_flags_of_where_the_model_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU under --models-max-mem: a larger budget, not "fewer
    --gpu-layers"; on a card given every layer: fewer of them."""
    path = resolve_model(None)[1]
    monkeypatch.delenv(FREE_MEMORY_ENV, raising=False)
    monkeypatch.setattr(devs, "ram", lambda: Memory("RAM", 16 * 1024 * MIB, 18 * 1024 * MIB, 2 * 1024 * MIB))
    with pytest.raises(FitError) as cpu:
        plan(path, budget=50 * MIB, found=Devices("cpu", ()))
    assert "50 MiB usable in RAM (--models-max-mem)" in str(cpu.value)
    assert str(cpu.value).endswith("use a larger --models-max-mem, or a smaller quantization of the model")
    with pytest.raises(FitError) as card:
        plan(path, gpu_layers=30, found=a_gpu(1100))
    assert "use fewer --gpu-layers (the rest stays in RAM)" in str(card.value)
    assert "--models-max-mem" not in str(card.value)


def test_an_nvidia_gpu_left_unused_is_named_with_the_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """A machine with an NVIDIA driver whose llama.cpp cannot use it says so
    at start, and why; a machine without one says nothing."""
    import llama_cpp

    driver = tmp_path / "version"
    monkeypatch.setattr(devs, "NVIDIA_DRIVER_FILES", (str(tmp_path / "absent"),))
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: False)
    assert devs.probe() == Devices("cpu", ())
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04\n")
    monkeypatch.setattr(devs, "NVIDIA_DRIVER_FILES", (str(tmp_path / "absent"), str(driver)))
    cpu_build = devs.probe()
    assert cpu_build.unused.startswith("an NVIDIA GPU is here but unused: this llama-cpp-python is built for the "
                                       "CPU only")
    # A CUDA build whose backend finds no device (no driver library, a driver too old for the runtime).
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
    monkeypatch.setattr(devs, "_ggml", lambda: type("NoDevices", (), {"ggml_backend_dev_count": lambda: 0}))
    assert "GPU backend lists no device" in devs.probe().unused

    path = resolve_model(None)[1]
    with caplog.at_level("WARNING", logger="lmspd.engine"):
        cpu = plan(path, ctx=1024, parallel=1, check=False, found=cpu_build)
    assert cpu.backend == "cpu"
    assert [r.getMessage() for r in caplog.records] == [
        f"{cpu_build.unused}; running on the CPU (--gpu-layers 0 says the CPU is meant)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="lmspd.engine"):
        plan(path, ctx=1024, parallel=1, check=False, found=cpu_build, gpu_layers=8)
    assert [r.getMessage() for r in caplog.records] == [
        f"{cpu_build.unused}; running on the CPU, not the --gpu-layers 8 asked for (--gpu-layers 0 says the CPU "
        "is meant)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="lmspd.engine"):
        plan(path, ctx=1024, parallel=1, check=False, found=cpu_build, gpu_layers=0)  # the CPU, as asked
    assert caplog.records == []
