"""``bench/gpu/cuda_toolkit.sh``: what a llama.cpp CUDA build is told about
the toolkit, for the layouts nvcc comes in, on fake toolkits (empty files
where the libraries are; no GPU, no nvcc). A system toolkit needs nothing;
NVIDIA's wheels have only versioned libraries (CMake's FindCUDAToolkit
fails with "Unable to find cudart library": seen with CUDA 13.0's wheels),
CUDA 12's spread over one package per library, CUDA 13's nvcc cannot link
without ``-L`` to its ``lib``; and with no driver the build links a libcuda
stub that must carry cuda.h's functions (an empty one is dropped from the
library's NEEDED entries, and the build then fails to load on the GPU
machine: ``undefined symbol: cuMemCreate``)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "cuda_toolkit.sh"

CUDA_H = """typedef int CUresult;
#define cuMemAlloc cuMemAlloc_v2
CUresult cuInit(unsigned int flags);
CUresult cuMemAlloc(void **ptr, unsigned long size);
CUresult cuMemCreate(void *handle, unsigned long size, const void *prop, unsigned long long flags);
"""


def _touch(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _nvcc(bin_dir: Path) -> None:
    nvcc = _touch(bin_dir / "nvcc", "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)


def _driver_here() -> bool:
    """What the script looks for before it makes a stub."""
    listed = subprocess.run(["sh", "-c", "ldconfig -p 2>/dev/null | grep -q 'libcuda\\.so\\.1 '"]).returncode == 0
    return listed or any(Path(p).exists() for p in ("/usr/local/nvidia/lib64/libcuda.so.1",
                                                   "/usr/lib/x86_64-linux-gnu/libcuda.so.1"))


def _run(tmp_path: Path, nvcc_bin: Path, site: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Source the script as run.sh does and call ``cuda_libraries``: prints
    cmake_args, cxx_flags and ``cuda_runtime_path`` one a line."""
    # python3 without site-packages: the test's own environment may hold nvidia wheels.
    py = _touch(tmp_path / "py", f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    py.chmod(0o755)
    work = tmp_path / "work"
    script = f"""set -euo pipefail
say() {{ echo "say: $*" >&2; }}
PY={py}; WORK={work}; cmake_args=""; cxx_flags=""
. {SCRIPT}
cuda_libraries
printf '%s\\n' "$cmake_args" "$cxx_flags" "$(cuda_runtime_path)"
"""
    env = {**os.environ, "PATH": f"{nvcc_bin}:{os.environ['PATH']}", "PYTHONPATH": str(site)}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    return done, work / "cuda-shim"


def test_a_system_toolkit_needs_nothing(tmp_path):
    root = tmp_path / "cuda"
    _nvcc(root / "bin")
    for name in ("libcudart.so", "libcublas.so", "libcublasLt.so", "stubs/libcuda.so"):
        _touch(root / "lib64" / name)
    for name in ("cuda_runtime.h", "cublas_v2.h", "cuda.h"):
        _touch(root / "include" / name)
    done, _ = _run(tmp_path, root / "bin", tmp_path / "site")
    assert done.returncode == 0, done.stderr
    args, cxx, runtime = done.stdout.split("\n")[:3]
    assert (args, cxx) == ("", "")
    assert runtime == ""  # nothing versioned there: the loader's own path finds them


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (the stub is compiled)")
def test_cuda_13_wheels_get_unversioned_links_their_lib_folder_and_a_stub_with_cuda_h_functions(tmp_path):
    site = tmp_path / "site"
    root = site / "nvidia" / "cu13"
    _nvcc(root / "bin")
    for name in ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcudart_static.a"):
        _touch(root / "lib" / name)
    _touch(root / "include" / "cuda_runtime.h")
    _touch(root / "include" / "cublas_v2.h")
    _touch(root / "include" / "cuda.h", CUDA_H)
    done, shim = _run(tmp_path, root / "bin", site)
    assert done.returncode == 0, done.stderr
    args, cxx, runtime = done.stdout.split("\n")[:3]
    for name, lib in (("cudart", "libcudart.so.13"), ("CUDART", "libcudart.so.13"), ("cublas", "libcublas.so.13"),
                      ("cublasLt", "libcublasLt.so.13")):
        link = "libcudart.so" if name == "CUDART" else f"lib{name}.so"
        flag = f"-DCUDA_{name}=" if name == "CUDART" else f"-DCUDA_{name}_LIBRARY="
        assert f"{flag}{shim / link}" in args.split(), args
        assert (shim / link).resolve() == (root / "lib" / lib).resolve()
    assert f"'-DCMAKE_CUDA_FLAGS=-L{root / 'lib'}'" in args  # the headers are in its include: no -I
    assert cxx == ""
    assert runtime == str(root / "lib")
    if _driver_here():
        assert (shim / "libcuda.so").resolve().name.startswith("libcuda.so")
        return
    assert f"-DCUDA_cuda_driver_LIBRARY={shim / 'libcuda.so'}" in args.split()
    stub = ctypes.CDLL(str(shim / "libcuda.so"))
    assert hasattr(stub, "cuInit") and hasattr(stub, "cuMemCreate")
    assert hasattr(stub, "cuMemAlloc_v2") and not hasattr(stub, "cuMemAlloc")  # the name cuda.h's macro links
    if shutil.which("readelf"):
        dynamic = subprocess.run(["readelf", "-d", str(shim / "libcuda.so")], capture_output=True, text=True).stdout
        assert "[libcuda.so.1]" in dynamic  # the soname a build records, the driver's


def test_cuda_12_wheels_get_links_and_include_folders_from_each_package(tmp_path):
    site = tmp_path / "site"
    nvidia = site / "nvidia"
    _nvcc(nvidia / "cuda_nvcc" / "bin")
    _touch(nvidia / "cuda_nvcc" / "lib64" / "stubs" / "libcuda.so")  # a driver stub: none made
    _touch(nvidia / "cuda_runtime" / "lib" / "libcudart.so.12")
    _touch(nvidia / "cuda_runtime" / "include" / "cuda_runtime.h")
    _touch(nvidia / "cublas" / "lib" / "libcublas.so.12")
    _touch(nvidia / "cublas" / "lib" / "libcublasLt.so.12")
    _touch(nvidia / "cublas" / "include" / "cublas_v2.h")
    done, shim = _run(tmp_path, nvidia / "cuda_nvcc" / "bin", site)
    assert done.returncode == 0, done.stderr
    args, cxx, runtime = done.stdout.split("\n")[:3]
    assert (shim / "libcudart.so").resolve() == (nvidia / "cuda_runtime" / "lib" / "libcudart.so.12").resolve()
    assert (shim / "libcublasLt.so").resolve() == (nvidia / "cublas" / "lib" / "libcublasLt.so.12").resolve()
    includes = f"-I{nvidia / 'cuda_runtime' / 'include'} -I{nvidia / 'cublas' / 'include'}"
    assert f"'-DCMAKE_CUDA_FLAGS={includes}'" in args
    assert cxx.strip() == includes
    assert "cuda_driver" not in args
    assert runtime.split(":") == [str(nvidia / "cublas" / "lib"), str(nvidia / "cuda_runtime" / "lib")]


def test_a_toolkit_without_cublas_is_named_and_stops_the_build(tmp_path):
    root = tmp_path / "cuda"
    _nvcc(root / "bin")
    _touch(root / "lib64" / "libcudart.so")
    done, _ = _run(tmp_path, root / "bin", tmp_path / "site")
    assert done.returncode == 1
    assert "no libcublas: neither in" in done.stderr
