"""Where a local model runs and with which window: decided once, before loading.

:func:`plan` reads the GGUF header, asks ggml which backend it has and how
much memory is free (``devices``), and fits the window, the sequences and
the layers offloaded (``fit``). What it decides is a frozen
:class:`RuntimeConfig`: the engine builds its llama.cpp model and context
from it, logs it and reports it in ``/health``; nothing below reads flags.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import devices as devs
from .fit import AUTO_MIN_WINDOW, DEFAULT_PARALLEL, MIB, Fit, FitError, Memory, ModelShape, Request, fit
from .gguf import GGUFError, GGUFInfo, read_gguf

__all__ = ["FLASH_ATTN", "KV_TYPES", "ROPE_SCALING", "FitError", "RopeScaling", "RuntimeConfig", "check_kv_type",
           "plan"]

log = logging.getLogger("lmspd.engine")

FLASH_ATTN = ("auto", "on", "off")
KV_TYPES = ("f16", "q8_0", "q4_0")
# --rope-scaling: "auto" stretches RoPE with YaRN over a window longer than
# the model was trained on (where the model carries no scaling of its own);
# "none" runs such a window unscaled, as llama.cpp does unless told.
ROPE_SCALING = ("auto", "none")


@dataclass(frozen=True)
class RopeScaling:
    """YaRN over a window longer than the trained length (llama.cpp's
    ``--rope-scaling yarn --rope-scale window/trained --yarn-orig-ctx trained``).
    Unscaled, positions past the trained length are ones the model never
    saw: the bundled SmolLM2 (trained on 8192) reads code at perplexity 805
    between 12k and 16k tokens, 8.8 with YaRN, for 2-4 % more below 8192."""

    trained: int
    window: int

    @property
    def freq_scale(self) -> float:
        return self.trained / self.window

    def describe(self) -> str:
        return f"YaRN x{self.window / self.trained:.3g} over the trained {self.trained}"

    def public(self) -> dict[str, Any]:
        return {"type": "yarn", "factor": round(self.window / self.trained, 4), "original_context": self.trained}


def rope_scaling(metadata: dict[str, Any], trained: int | None, window: int, mode: str) -> RopeScaling | None:
    """What RoPE scaling a window of ``window`` tokens gets: YaRN where it is
    longer than the trained length, unless the model scales on its own (a
    GGUF's ``rope.scaling.type``: llama.cpp applies that, over the length
    the model was extended to) or ``mode`` is "none"."""
    if mode == "none" or not trained or window <= trained:
        return None
    own = metadata.get(f"{metadata.get('general.architecture')}.rope.scaling.type")
    if isinstance(own, str) and own not in ("", "none"):
        return None
    return RopeScaling(trained=trained, window=window)


@dataclass(frozen=True)
class RuntimeConfig:
    """How the engine runs its model: decided by :func:`plan`, read by everything after."""

    backend: str  # "cuda", "metal", "vulkan", "cpu"
    device: str | None  # the GPU layers go to ("CUDA0: NVIDIA H200"), None on the CPU
    layers: int  # the model's layers
    gpu_layers: int  # of them offloaded
    flash_attn: bool
    kv_type: str
    window: int  # tokens per sequence
    parallel: int  # sequences
    kv_bytes: int
    reason: str
    # Weights, KV and compute buffers: what --models-max-mem counts.
    cost_bytes: int = 0
    rope: RopeScaling | None = None  # set by plan for the window it chose

    @property
    def n_gpu_layers(self) -> int:
        """llama_model_params.n_gpu_layers: -1 offloads every layer and the output."""
        return -1 if self.gpu_layers and self.gpu_layers >= self.layers else self.gpu_layers

    def line(self, model_id: str) -> str:
        where = f"{self.backend} ({self.device})" if self.device else self.backend
        return (f"{model_id} on {where}: {self.gpu_layers}/{self.layers} layers offloaded, flash attention "
                f"{'on' if self.flash_attn else 'off'}, KV {self.kv_type}, window {self.window} x {self.parallel} "
                f"sequences{f' ({self.rope.describe()})' if self.rope else ''}, KV {self.kv_bytes / MIB:,.0f} MiB "
                f"({self.reason})")

    def public(self) -> dict[str, Any]:
        return {"backend": self.backend, "device": self.device, "gpu_layers": self.gpu_layers,
                "layers": self.layers, "flash_attn": self.flash_attn, "kv_type": self.kv_type,
                "window": self.window, "parallel": self.parallel, "kv_bytes": self.kv_bytes, "reason": self.reason,
                "rope_scaling": self.rope.public() if self.rope else None}


def check_kv_type(kv_type: str, flash_attn: str, rope: str = "auto") -> None:
    """A quantized V cache needs flash attention (llama.cpp refuses the context otherwise)."""
    if rope not in ROPE_SCALING:
        raise FitError(f"--rope-scaling must be one of {', '.join(ROPE_SCALING)}, not {rope!r}")
    if kv_type not in KV_TYPES:
        raise FitError(f"--kv-type must be one of {', '.join(KV_TYPES)}, not {kv_type!r}")
    if flash_attn not in FLASH_ATTN:
        raise FitError(f"--flash-attn must be one of {', '.join(FLASH_ATTN)}, not {flash_attn!r}")
    if kv_type != "f16" and flash_attn == "off":
        raise FitError(f"--kv-type {kv_type} quantizes the V cache, which llama.cpp supports only with flash "
                       "attention: use --flash-attn on (or auto), or --kv-type f16")


def plan(path: Path, *, ctx: int | None = None, parallel: int | None = None, gpu_layers: int | None = None,
         flash_attn: str = "auto", kv_type: str = "f16", swa_full: bool = False, check: bool = True,
         budget: int | None = None, found: devs.Devices | None = None, rope: str = "auto") -> RuntimeConfig:
    """Decide how the GGUF at ``path`` runs. ``ctx`` None is ``--ctx auto`` (0:
    the trained length); ``parallel`` None is the default, lowered to fit;
    ``gpu_layers`` None is all that fit. ``check`` False takes ``ctx`` and
    ``parallel`` as given without measuring memory (engines built directly,
    in tests and benchmarks). ``budget`` caps the bytes (``--models-max-mem``).
    ``rope`` is ``--rope-scaling`` (:func:`rope_scaling`, for the window chosen).
    Raises :class:`FitError` with the numbers when the model does not fit."""
    check_kv_type(kv_type, flash_attn, rope)
    if gpu_layers is not None and gpu_layers < 0:
        raise FitError("--gpu-layers must be a number >= 0 or 'all'")
    try:
        header = read_gguf(path)
    except GGUFError as exc:
        raise FitError(f"{path}: {exc}") from None
    shape = ModelShape.from_metadata(header.metadata)
    chosen = _placed(path, header, shape, ctx=ctx, parallel=parallel, gpu_layers=gpu_layers, flash_attn=flash_attn,
                     kv_type=kv_type, swa_full=swa_full, check=check, budget=budget, found=found)
    return dataclasses.replace(chosen, rope=rope_scaling(header.metadata, shape.trained if shape else None,
                                                         chosen.window, rope))


def _placed(path: Path, header: GGUFInfo, shape: ModelShape | None, *, ctx: int | None, parallel: int | None,
            gpu_layers: int | None, flash_attn: str, kv_type: str, swa_full: bool, check: bool, budget: int | None,
            found: devs.Devices | None) -> RuntimeConfig:
    found = found if found is not None else devs.probe()
    offload = found.offload and gpu_layers != 0
    if found.unused and gpu_layers != 0:
        log.warning("%s; running on the CPU%s (--gpu-layers 0 says the CPU is meant)", found.unused,
                    f", not the --gpu-layers {gpu_layers} asked for" if gpu_layers else "")
    elif gpu_layers and not found.offload:
        log.warning("--gpu-layers %d: this llama-cpp-python build has no GPU backend with a device (./dev.sh "
                    "builds one: LMSPD_GPU=cuda|metal|vulkan); running on the CPU", gpu_layers)
    fa = _flash_attn(flash_attn, kv_type, offloaded=offload)
    weights = path.stat().st_size
    layers = shape.layers if shape is not None else int(header.metadata.get(f"{header.architecture}.block_count", 0)
                                                        or 0)
    ask = Request(ctx=ctx, parallel=parallel, kv_type=kv_type, swa_full=swa_full, flash_attn=fa)
    base = RuntimeConfig(backend=found.backend if offload else "cpu",
                         device=f"{found.gpus[0].name}: {found.gpus[0].description}" if offload else None,
                         layers=layers, gpu_layers=0, flash_attn=fa, kv_type=kv_type, window=0, parallel=0,
                         kv_bytes=0, reason="")
    if shape is None or not check:
        window = ctx or (shape.trained if shape else None) or AUTO_MIN_WINDOW
        seqs = parallel or DEFAULT_PARALLEL
        kv = shape.kv_bytes(window, seqs, kv_type, swa_full=swa_full) if shape else 0
        compute = shape.compute_bytes(window, seqs, flash_attn=fa) if shape else 0
        why = "as given" if shape else "the header has no attention shape: not sized to memory"
        return dataclasses.replace(base, gpu_layers=_all_or(gpu_layers, layers) if offload else 0, window=window,
                                   parallel=seqs, kv_bytes=kv, reason=why, cost_bytes=weights + kv + compute)

    if not offload:
        chosen = fit(shape, weights, _capped(devs.ram(), budget), ask)
        return _with(base, chosen, 0)
    device = _capped(dataclasses.replace(devs.device(found), gpu=True), budget)
    want = _all_or(gpu_layers, shape.layers)
    if want >= shape.layers:
        try:
            return _with(base, fit(shape, weights, device, ask), shape.layers)
        except FitError as on_device:
            if gpu_layers is not None:
                raise
            first = str(on_device)
    else:
        first = ""
    # Some layers on the device, the rest (and their KV) in RAM: the window
    # and sequences fit RAM as a CPU run would, the layers fit the device.
    chosen = fit(shape, weights, _capped(devs.ram(), budget), ask)
    n = _layers_that_fit(shape, weights, chosen, device, ask, up_to=want)
    if gpu_layers is not None and n < want:
        need = _on_device(shape, weights, chosen, ask, want)
        raise FitError(f"--gpu-layers {want} needs {need / MIB:,.0f} MiB on {device.where}, more than its "
                       f"{device.usable / MIB:,.0f} MiB usable; use --gpu-layers {n} or fewer (or 'all': what fits)")
    if n == 0 and fa != _flash_attn(flash_attn, kv_type, offloaded=False):
        # No layer fits the device: a CPU run after all, with flash attention
        # as --flash-attn auto gives the CPU (off: its CPU kernel is the slow
        # one), and fitted again for the compute buffers that takes.
        ask = dataclasses.replace(ask, flash_attn=False)
        base = dataclasses.replace(base, flash_attn=False)
        chosen = fit(shape, weights, _capped(devs.ram(), budget), ask)
    if first:
        log.info("all %d layers do not fit %s (%s): offloading %d", shape.layers, device.where, first, n)
        chosen = dataclasses.replace(chosen, reason=f"{n} of {shape.layers} layers fit {device.where}; "
                                                    f"{chosen.reason}")
    return _with(base, chosen, n)


def _flash_attn(flash_attn: str, kv_type: str, *, offloaded: bool) -> bool:
    """--flash-attn: auto is on where layers are offloaded (the GPU's fast
    path) or the V cache is quantized (llama.cpp needs it then), else off."""
    return flash_attn == "on" or (flash_attn == "auto" and (offloaded or kv_type != "f16"))


def _all_or(gpu_layers: int | None, layers: int) -> int:
    return layers if gpu_layers is None else min(gpu_layers, layers)


def _capped(memory: Memory, budget: int | None) -> Memory:
    if budget is None or budget >= memory.usable:
        return memory
    return dataclasses.replace(memory, where=f"{memory.where} (--models-max-mem)", usable=budget, capped=True)


def _with(base: RuntimeConfig, chosen: Fit, gpu_layers: int) -> RuntimeConfig:
    out = dataclasses.replace(base, gpu_layers=gpu_layers, window=chosen.window, parallel=chosen.parallel,
                              kv_bytes=chosen.kv_bytes, reason=chosen.reason, cost_bytes=chosen.total)
    return out if gpu_layers else dataclasses.replace(out, backend="cpu", device=None)


def _on_device(shape: ModelShape, weights: int, chosen: Fit, ask: Request, n: int) -> int:
    return (weights * n // (shape.layers + 1)
            + shape.kv_bytes(chosen.window, chosen.parallel, ask.kv_type, swa_full=ask.swa_full, layers=n)
            + chosen.compute_bytes)


def _layers_that_fit(shape: ModelShape, weights: int, chosen: Fit, device: Memory, ask: Request, up_to: int) -> int:
    n = up_to
    while n > 0 and _on_device(shape, weights, chosen, ask, n) > device.usable:
        n -= 1
    return n
