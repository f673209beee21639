"""Whether llama.cpp may put the model's weights in its extra CPU buffers
(AMX, repack). With a llama.cpp whose AMX kernels are broken, they crash
the first prompt on an AMX CPU.

A llama.cpp built natively on an Intel CPU with AMX (Sapphire Rapids and
later) repacks the weights for AMX's tile instructions when it loads a
model, and multiplies through them for every batch of more than one token.
Built by GCC 12 (Debian 12), that kernel (``ggml_backend_amx_mul_mat``)
loads a tile configuration whose second half was never written
(``ldtilecfg`` on 64 bytes of which the first 32 are zeroed): a general
protection fault, the process gone at its first prompt, or not, by what the
stack held before. Seen on this project's own machines; upstream,
ggml-org/llama.cpp#20824 (GCC 11) and the workaround in
stanfordnlp/dspy#10079. The tile instructions themselves work there.

``./dev.sh`` builds llama.cpp without the AMX kernels on x86-64 Linux
(``-U__AMX_INT8__``, every backend).
A build that has them, on a CPU that has AMX, loads the model without the
extra buffers (``use_extra_bufts``: llama.cpp has no switch for AMX alone,
so the repacked kernels go too): slower prompts, no crash.
``LMSPD_AMX=on`` uses them anyway (a build known to be sound); ``off``
never, whatever the build.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

SETTINGS = ("auto", "on", "off")


@dataclass(frozen=True)
class ExtraBuffers:
    """Whether the model loads with llama.cpp's extra CPU weight buffers."""

    use: bool
    reason: str  # for the start-up log line; "" when there is nothing to say


def decide(setting: str, *, built_with_amx: bool, cpu_has_amx: bool) -> ExtraBuffers:
    """``setting`` is ``LMSPD_AMX``. The extra buffers are off only where
    the AMX kernels would run: a build that has them on a CPU that has
    AMX (elsewhere ggml offers no AMX buffer, and the repacked kernels are
    sound)."""
    if setting == "off":
        return ExtraBuffers(False, "LMSPD_AMX=off: without llama.cpp's extra CPU weight buffers (AMX, repack)")
    if not (built_with_amx and cpu_has_amx):
        return ExtraBuffers(True, "")
    if setting == "on":
        return ExtraBuffers(True, "LMSPD_AMX=on: llama.cpp's AMX kernels in use")
    return ExtraBuffers(False, "this llama.cpp was built with AMX kernels, which have crashed the first prompt "
                               "(built by GCC 12 on lmspd's machines, GCC 11 in ggml-org/llama.cpp#20824): "
                               "the model loads without "
                               "llama.cpp's extra CPU weight buffers (AMX, repack), slower prompts rather than "
                               "a crash. ./dev.sh builds without them; LMSPD_AMX=on uses them")


def setting(environ: Mapping[str, str] = os.environ) -> str:
    value = environ.get("LMSPD_AMX", "auto").strip().lower() or "auto"
    if value not in SETTINGS:
        raise ValueError(f"LMSPD_AMX must be one of {', '.join(SETTINGS)} (not {value!r})")
    return value


def built_with_amx(system_info: str | None = None) -> bool:
    """Whether this llama.cpp's CPU backend was compiled with AMX kernels."""
    if system_info is None:
        system_info = llama_cpp.llama_print_system_info().decode(errors="replace")
    return "AMX_INT8 = 1" in system_info


def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo"), *, system: str = sys.platform,
                machine: str = platform.machine()) -> bool:
    """Whether the CPU says it has AMX (Linux on x86-64; llama.cpp has AMX
    kernels nowhere else)."""
    if system != "linux" or machine != "x86_64":
        return False
    try:
        with cpuinfo.open(errors="replace") as lines:
            for line in lines:
                if line.startswith("flags"):
                    return "amx_int8" in line.split()
    except OSError:
        pass
    return False


@functools.cache
def extra_buffers() -> ExtraBuffers:
    """This process's decision."""
    return decide(setting(), built_with_amx=built_with_amx(), cpu_has_amx=cpu_has_amx())


def model_params() -> llama_cpp.llama_model_params:
    """llama.cpp's default model parameters, the extra CPU buffers only
    where they are sound: every model lmspd loads with weights starts from
    these."""
    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = extra_buffers().use
    return params
