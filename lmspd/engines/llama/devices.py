"""Which backend this llama.cpp build runs on, and the memory it reports free.

ggml lists its devices (``ggml_backend_dev_*``: a CUDA card, Metal, a
Vulkan device, the CPU) with their free and total memory; llama-cpp-python
binds none of that, so it is read here through ctypes from the ggml library
the package loads. Where a symbol is missing (another build), the backend is
``cpu`` and only RAM counts.

``LMSPD_FREE_MEMORY_MB`` states the free memory instead of measuring it (of
the device when offloading, else of RAM): for tests, and for an operator who
wants lmspd to plan for less than the machine has.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

from .fit import GIB, MIB, Memory

log = logging.getLogger("lmspd.engine")

FREE_MEMORY_ENV = "LMSPD_FREE_MEMORY_MB"
# A device keeps this much free for the driver and other programs
# (llama.cpp's --fit-target default).
DEVICE_HEADROOM = 1 * GIB
# RAM keeps a share for the rest of the machine: 10% of it, at least 1 GiB.
RAM_SHARE = 0.10
RAM_HEADROOM_MIN = 1 * GIB

# ggml_backend_dev_type
_GPU, _IGPU = 1, 2


@dataclass(frozen=True)
class Device:
    name: str  # ggml's: "CUDA0", "Metal", "Vulkan0"
    description: str
    free: int
    total: int


# What an NVIDIA driver puts on a Linux machine, with or without a toolkit.
NVIDIA_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl")


@dataclass(frozen=True)
class Devices:
    backend: str  # "cuda", "metal", "vulkan", ... or "cpu"
    gpus: tuple[Device, ...]
    # Where no GPU is listed though an NVIDIA driver is there: why, for the
    # start-up log (empty otherwise).
    unused: str = ""

    @property
    def offload(self) -> bool:
        return bool(self.gpus)


def probe() -> Devices:
    """The GPUs (and integrated GPUs) ggml can offload to, if any."""
    import llama_cpp

    try:
        if not llama_cpp.llama_supports_gpu_offload():
            return Devices("cpu", (), _unused("this llama-cpp-python is built for the CPU only (./dev.sh builds "
                                              "it for CUDA where it can, and says why not)"))
        lib = _ggml()
        gpus = []
        for i in range(lib.ggml_backend_dev_count()):
            dev = lib.ggml_backend_dev_get(i)
            if lib.ggml_backend_dev_type(dev) not in (_GPU, _IGPU):
                continue
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            gpus.append(Device((lib.ggml_backend_dev_name(dev) or b"?").decode(),
                               (lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                               int(free.value), int(total.value)))
    except (AttributeError, OSError) as exc:  # a build without these symbols
        log.warning("cannot list llama.cpp's devices (%s): planning for the CPU", exc)
        return Devices("cpu", ())
    if not gpus:
        return Devices("cpu", (), _unused("llama.cpp's GPU backend lists no device (its own log above says why)"))
    return Devices(_backend_name(gpus[0].name), tuple(gpus))


def _unused(why: str) -> str:
    """``why``, where an NVIDIA driver is there to make it worth saying."""
    return f"an NVIDIA GPU is here but unused: {why}" if any(map(os.path.exists, NVIDIA_DRIVER_FILES)) else ""


def _backend_name(device: str) -> str:
    name = device.rstrip("0123456789").lower()
    return {"mtl": "metal"}.get(name, name)


def _ggml() -> ctypes.CDLL:
    try:
        from llama_cpp._ggml import libggml as lib
    except (ImportError, OSError):
        from llama_cpp.llama_cpp import _lib as lib  # dlsym also searches its dependencies
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_count.argtypes = []
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, name).restype = ctypes.c_char_p
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_memory.restype = None
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    return lib


def stated_free() -> int | None:
    """``LMSPD_FREE_MEMORY_MB`` in bytes, if set."""
    raw = os.environ.get(FREE_MEMORY_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{FREE_MEMORY_ENV} must be a whole number of MiB, not {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{FREE_MEMORY_ENV} must be > 0")
    return value * MIB


def ram() -> Memory:
    """RAM lmspd may use: what is available now, less the machine's share."""
    stated = stated_free()
    free, total = (stated, stated) if stated is not None else _meminfo()
    headroom = max(RAM_HEADROOM_MIN, int(total * RAM_SHARE))
    return Memory("RAM", max(0, free - headroom), free, headroom)


def device(devices: Devices) -> Memory:
    """Device memory lmspd may use: the first GPU's free memory less the headroom
    (llama.cpp splits layers over several cards; lmspd plans for one)."""
    gpu = devices.gpus[0]
    stated = stated_free()
    free = stated if stated is not None else gpu.free
    return Memory(gpu.name, max(0, free - DEVICE_HEADROOM), free, DEVICE_HEADROOM)


def _meminfo() -> tuple[int, int]:
    """(available, total) bytes of RAM."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        return fields.get("MemAvailable", fields["MemFree"]), fields["MemTotal"]
    except (OSError, KeyError, ValueError):
        pass
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * size
    except (ValueError, OSError):
        free = pages * size // 2
    return free, pages * size
