"""``scripts/cuda_toolkit.sh`` (``./dev.sh``'s and ``bench/gpu/run.sh``'s CUDA
builds): what a llama.cpp CUDA build is told about the toolkit, for the
layouts nvcc comes in, and which of NVIDIA's toolkit wheels ``./dev.sh``
installs where parts are missing, on fake toolkits (empty files where the
libraries are; no GPU, no nvcc, no network). A system toolkit needs nothing;
NVIDIA's wheels have only versioned libraries (CMake's FindCUDAToolkit
fails with "Unable to find cudart library": seen with CUDA 13.0's wheels),
CUDA 12's spread over one package per library, CUDA 13's nvcc cannot link
without ``-L`` to its ``lib``; and with no driver the build links a libcuda
stub that must carry cuda.h's functions (an empty one is dropped from the
library's NEEDED entries, and the build then fails to load on the GPU
machine: ``undefined symbol: cuMemCreate``)."""

from __future__ import annotations

import ctypes
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from support.fake_cuda import CUDA_H, cuda_shell, driver_here, fake_nvcc, fake_pip, fake_toolkit, nvidia_smi, touch


def _run(tmp_path: Path, nvcc_bin: Path, site: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``cuda_libraries`` as run.sh calls it: prints cmake_args, cxx_flags and
    ``cuda_runtime_path`` one a line (the machine's PATH too: the stub is
    compiled)."""
    body = "cuda_libraries\nprintf '%s\\n' \"$cmake_args\" \"$cxx_flags\" \"$(cuda_runtime_path)\""
    return cuda_shell(tmp_path, body, [nvcc_bin], site, compiler=True), tmp_path / "work" / "cuda-shim"


def test_a_system_toolkit_needs_nothing(tmp_path):
    root = tmp_path / "cuda"
    fake_nvcc(root / "bin")
    for name in ("libcudart.so", "libcublas.so", "libcublasLt.so", "stubs/libcuda.so"):
        touch(root / "lib64" / name)
    for name in ("cuda_runtime.h", "cublas_v2.h", "cuda.h", "cub/cub.cuh"):
        touch(root / "include" / name)
    done, _ = _run(tmp_path, root / "bin", tmp_path / "site")
    assert done.returncode == 0, done.stderr
    args, cxx, runtime = done.stdout.split("\n")[:3]
    assert (args, cxx) == ("", "")
    assert runtime == ""  # nothing versioned there: the loader's own path finds them


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (the stub is compiled)")
def test_cuda_13_wheels_get_unversioned_links_their_lib_folder_and_a_stub_with_cuda_h_functions(tmp_path):
    site = tmp_path / "site"
    root = site / "nvidia" / "cu13"
    fake_nvcc(root / "bin")
    for name in ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcudart_static.a"):
        touch(root / "lib" / name)
    touch(root / "include" / "cuda_runtime.h")
    touch(root / "include" / "cublas_v2.h")
    touch(root / "include" / "cuda.h", CUDA_H)
    touch(root / "include" / "cccl" / "cub" / "cub.cuh")  # CUDA 13's place for CCCL: nvcc knows it
    done, shim = _run(tmp_path, root / "bin", site)
    assert done.returncode == 0, done.stderr
    args, cxx, runtime = done.stdout.split("\n")[:3]
    for name, lib in (("cudart", "libcudart.so.13"), ("CUDART", "libcudart.so.13"), ("cublas", "libcublas.so.13"),
                      ("cublasLt", "libcublasLt.so.13")):
        link = "libcudart.so" if name == "CUDART" else f"lib{name}.so"
        flag = f"-DCUDA_{name}=" if name == "CUDART" else f"-DCUDA_{name}_LIBRARY="
        assert f"{flag}{shim / link}" in shlex.split(args), args
        assert (shim / link).resolve() == (root / "lib" / lib).resolve()
        # and under its own name: the built library's RUNPATH names the shim
        assert (shim / lib).resolve() == (root / "lib" / lib).resolve()
    assert f"-DCMAKE_CUDA_FLAGS=-L{root / 'lib'}" in shlex.split(args)  # the headers are in its include: no -I
    assert cxx == ""
    assert runtime == str(root / "lib")
    if driver_here():
        assert (shim / "libcuda.so").resolve().name.startswith("libcuda.so")
        return
    assert f"-DCUDA_cuda_driver_LIBRARY={shim / 'libcuda.so'}" in shlex.split(args)
    stub = ctypes.CDLL(str(shim / "libcuda.so"))
    assert hasattr(stub, "cuInit") and hasattr(stub, "cuMemCreate")
    assert hasattr(stub, "cuMemAlloc_v2") and not hasattr(stub, "cuMemAlloc")  # the name cuda.h's macro links
    if shutil.which("readelf"):
        dynamic = subprocess.run(["readelf", "-d", str(shim / "libcuda.so")], capture_output=True, text=True).stdout
        assert "[libcuda.so.1]" in dynamic  # the soname a build records, the driver's


def test_cuda_12_cublas_from_its_own_wheel_gets_links_and_its_include_folder(tmp_path):
    """A CUDA 12 toolkit without cuBLAS beside PyTorch's cuBLAS wheel (CUDA
    12's wheels: one package per library, each with its own include folder;
    they carry no nvcc)."""
    root = tmp_path / "cuda-12.4"
    fake_nvcc(root / "bin")
    touch(root / "lib64" / "libcudart.so")
    touch(root / "lib64" / "stubs" / "libcuda.so")  # a driver stub: none made
    touch(root / "include" / "cuda_runtime.h")
    touch(root / "include" / "cub" / "cub.cuh")
    site = tmp_path / "site"
    cublas = site / "nvidia" / "cublas"
    touch(cublas / "lib" / "libcublas.so.12")
    touch(cublas / "lib" / "libcublasLt.so.12")
    touch(cublas / "include" / "cublas_v2.h")
    done, shim = _run(tmp_path, root / "bin", site)
    assert done.returncode == 0, done.stderr
    args, cxx, runtime = done.stdout.split("\n")[:3]
    for name in ("libcublas", "libcublasLt"):
        for link in (f"{name}.so", f"{name}.so.12"):  # CMake's name, and the loader's
            assert (shim / link).resolve() == (cublas / "lib" / f"{name}.so.12").resolve()
    assert "cudart" not in args.lower()  # the toolkit's own
    assert f"-DCMAKE_CUDA_FLAGS=-I{cublas / 'include'}" in shlex.split(args)
    assert cxx.strip() == f"-I{cublas / 'include'}"
    assert "cuda_driver" not in args
    assert runtime == str(cublas / "lib")


def test_a_toolkit_without_cublas_is_named_and_stops_the_build(tmp_path):
    root = tmp_path / "cuda"
    fake_nvcc(root / "bin")
    touch(root / "lib64" / "libcudart.so")
    done, _ = _run(tmp_path, root / "bin", tmp_path / "site")
    assert done.returncode == 1
    assert "no libcublas: not in" in done.stderr


@pytest.mark.parametrize(("nvcc", "driver", "cap", "parts", "wanted"), [
    # An nvcc: the same CUDA version's libraries, whatever the driver.
    ("12.4", "13.0", "90", "cublas", "cuda-toolkit[cublas]==12.4.*"),
    ("13.0", "", "", "cudart cublas", "cuda-toolkit[cudart,cublas]==13.0.*"),
    # None: a whole CUDA 13 toolkit, no newer than the driver runs.
    ("", "13.0", "90", "nvcc crt cudart cublas cccl", "cuda-toolkit[nvcc,crt,cudart,cublas,cccl]>=13.0,<13.1"),
    ("", "13.2", "120", "nvcc", "cuda-toolkit[nvcc]>=13.0,<13.3"),
    ("", "14.1", "", "nvcc", "cuda-toolkit[nvcc]>=13.0,<14"),
])
def test_the_wheels_asked_for_match_nvcc_or_else_the_driver(tmp_path, nvcc, driver, cap, parts, wanted):
    done = cuda_shell(tmp_path, f'cuda_wheel_requirement "{nvcc}" "{driver}" "{cap}" {parts}', [], tmp_path / "site")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == wanted


@pytest.mark.parametrize(("driver", "cap", "why"), [
    ("12.4", "89", "NVIDIA's wheels carry nvcc from CUDA 13 on (driver 580 or later)"),
    ("13.0", "70", "CUDA 13 does not build for this GPU (compute capability 70; 7.5 or later)"),
    ("", "90", "nvidia-smi does not say which CUDA version the driver supports"),
])
def test_no_wheels_fit_without_nvcc_says_why(tmp_path, driver, cap, why):
    done = cuda_shell(tmp_path, f'cuda_wheel_requirement "" "{driver}" "{cap}" nvcc cudart', [], tmp_path / "site")
    assert done.returncode == 1
    assert done.stdout == ""
    assert why in done.stderr


def test_the_driver_s_cuda_version_is_read_from_nvidia_smi(tmp_path):
    done = cuda_shell(tmp_path, "echo \"[$(cuda_driver_version)]\"", [nvidia_smi(tmp_path / "bin", "12.8")],
                  tmp_path / "site")
    assert done.stdout.strip() == "[12.8]", done.stderr
    done = cuda_shell(tmp_path, "echo \"[$(cuda_driver_version)]\"", [], tmp_path / "site")
    assert done.stdout.strip() == "[]", done.stderr  # no nvidia-smi


def test_the_root_is_where_nvcc_itself_runs_from_behind_a_wrapper(tmp_path):
    """An nvcc on PATH may be a script that runs the toolkit's (as on this
    project's machines: /usr/local/bin/nvcc runs /usr/local/cuda-13.0/bin/nvcc)."""
    root = tmp_path / "cuda-13.0"
    real = touch(root / "bin" / "nvcc", f"""#!/bin/sh
case "$*" in *--dryrun*) echo '#$ _HERE_={root / "bin"}' >&2 ;; esac
""")
    real.chmod(0o755)
    wrapper = touch(tmp_path / "bin" / "nvcc", f'#!/bin/sh\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    done = cuda_shell(tmp_path, "cuda_root", [tmp_path / "bin"], tmp_path / "site")
    assert done.stdout.strip() == str(root), done.stderr


def test_missing_parts_are_what_neither_the_toolkit_nor_the_wheels_hold(tmp_path):
    site = tmp_path / "site"
    assert cuda_shell(tmp_path, "cuda_missing_parts", [], site).stdout.strip() == "nvcc crt cudart cublas cccl"
    whole = fake_toolkit(tmp_path / "whole", cublas=True)
    assert cuda_shell(tmp_path, "cuda_missing_parts", [whole], site).stdout.strip() == ""
    # A toolkit without cuBLAS (this project's machines have one): cuBLAS only,
    # until a wheel brings it (its library and header: the library alone is not enough).
    partial = fake_toolkit(tmp_path / "partial", cublas=False)
    assert cuda_shell(tmp_path, "cuda_missing_parts", [partial], site).stdout.strip() == "cublas"
    touch(site / "nvidia" / "cu13" / "lib" / "libcublas.so.13")
    assert cuda_shell(tmp_path, "cuda_missing_parts", [partial], site).stdout.strip() == "cublas"
    touch(site / "nvidia" / "cu13" / "include" / "cublas_v2.h")
    assert cuda_shell(tmp_path, "cuda_missing_parts", [partial], site).stdout.strip() == "cublas"  # no cublasLt
    touch(site / "nvidia" / "cu13" / "lib" / "libcublasLt.so.13")
    assert cuda_shell(tmp_path, "cuda_missing_parts", [partial], site).stdout.strip() == ""
    # CCCL's headers (cub, thrust: llama.cpp's kernels include cub), in CUDA 13's
    # include/cccl or CUDA 12's include, the toolkit's or a wheel's.
    headless = fake_toolkit(tmp_path / "headless", cublas=True, cccl=False)
    assert cuda_shell(tmp_path, "cuda_missing_parts", [headless], site).stdout.strip() == "cccl"
    touch(site / "nvidia" / "cuda_cccl" / "include" / "cub" / "cub.cuh")
    assert cuda_shell(tmp_path, "cuda_missing_parts", [headless], site).stdout.strip() == ""


def test_a_driver_without_a_toolkit_gets_nvidia_s_wheels_and_their_nvcc(tmp_path):
    """./dev.sh's path on a machine with an NVIDIA driver and no CUDA toolkit
    (before, it built for the CPU without a word): the whole toolkit the
    driver runs is installed, and its nvcc is the one the build uses."""
    site = tmp_path / "site"
    pip = fake_pip(tmp_path, site)
    body = f'PIP={pip}; cuda_prepare; echo "arch=$arch"; command -v nvcc'
    done = cuda_shell(tmp_path, body, [nvidia_smi(tmp_path / "bin", "13.0", "9.0")], site)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "pip.log").read_text() == "install cuda-toolkit[nvcc,crt,cudart,cublas,cccl]>=13.0,<13.1\n"
    assert done.stdout.split() == ["arch=90", str(site / "nvidia" / "cu13" / "bin" / "nvcc")]
    assert "lacks nvcc crt cudart cublas cccl: installing NVIDIA's wheels" in done.stderr
    # Again (the next ./dev.sh): the wheels' nvcc is found, nothing installed.
    done = cuda_shell(tmp_path, body, [tmp_path / "bin"], site)
    assert done.returncode == 0, done.stderr
    assert len((tmp_path / "pip.log").read_text().splitlines()) == 1
    assert done.stdout.split()[-1] == str(site / "nvidia" / "cu13" / "bin" / "nvcc")


def test_a_toolkit_without_cublas_gets_only_cublas_for_its_own_version(tmp_path):
    site = tmp_path / "site"
    pip = fake_pip(tmp_path, site)
    toolkit = fake_toolkit(tmp_path / "cuda", cublas=False)
    done = cuda_shell(tmp_path, f"PIP={pip}; cuda_prepare; command -v nvcc", [toolkit, nvidia_smi(tmp_path / "smi")],
                  site)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "pip.log").read_text() == "install cuda-toolkit[cublas]==13.0.*\n"
    assert done.stdout.strip() == str(toolkit / "nvcc")  # the toolkit's nvcc still


@pytest.mark.parametrize(("cuda", "fails", "why"), [
    ("12.4", False, "no CUDA toolkit fits"),
    ("13.0", True, "could not be installed (offline? install the CUDA toolkit)"),
])
def test_where_no_toolkit_can_be_had_the_reason_is_given(tmp_path, cuda, fails, why):
    site = tmp_path / "site"
    pip = fake_pip(tmp_path, site, fails=fails)
    body = f'PIP={pip}; cuda_prepare && echo ready || echo "unusable: $cuda_unusable"'
    done = cuda_shell(tmp_path, body, [nvidia_smi(tmp_path / "bin", cuda)], site)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("unusable: ") and why in done.stdout
    assert (tmp_path / "pip.log").exists() == fails  # 12.4: nothing tried


def test_a_distribution_s_toolkit_is_found_where_the_system_keeps_it(tmp_path):
    """Debian's and Ubuntu's nvidia-cuda-toolkit: /usr/bin/nvcc runs the real
    one in /usr/lib/nvidia-cuda-toolkit, the libraries are where the loader's
    cache lists them, the headers in /usr/include. Nothing is missing, and
    the build is told nothing (CMake finds them; an -I/usr/include would
    break libstdc++'s #include_next)."""
    root = tmp_path / "usr" / "lib" / "nvidia-cuda-toolkit"
    real = touch(root / "bin" / "nvcc", f"""#!/bin/sh
case "$*" in *--dryrun*) echo '#$ _HERE_={root / "bin"}' >&2 ;; *) echo 'release 12.0, V12.0.140' ;; esac
""")
    real.chmod(0o755)
    wrapper = touch(tmp_path / "usr" / "bin" / "nvcc", f'#!/bin/sh\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    system_lib = tmp_path / "usr" / "lib" / "x86_64-linux-gnu"
    libraries = tuple(touch(system_lib / name) for name in ("libcudart.so", "libcublas.so", "libcublasLt.so",
                                                              "libcuda.so.1"))
    for header in ("cuda_runtime.h", "cublas_v2.h", "cub/cub.cuh"):
        touch(tmp_path / "usr" / "include" / header)
    site = tmp_path / "site"
    done = cuda_shell(tmp_path, 'echo "[$(cuda_missing_parts)]"; cuda_libraries; echo "[$cmake_args] [$cxx_flags]"',
                  [tmp_path / "usr" / "bin"], site, libraries)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", f"['-DCUDA_cuda_driver_LIBRARY={tmp_path / 'work' / 'cuda-shim'}"
                                                   "/libcuda.so'] []"]
    # Without the loader's cache entries the same toolkit lacks the runtime and cuBLAS.
    done = cuda_shell(tmp_path, "cuda_missing_parts", [tmp_path / "usr" / "bin"], site)
    assert done.stdout.strip() == "cudart cublas"


def test_a_failed_install_is_not_tried_again_on_every_run(tmp_path):
    site = tmp_path / "site"
    pip = fake_pip(tmp_path, site, fails=True)
    body = f'PIP={pip}; cuda_prepare || echo "unusable: $cuda_unusable"'
    first = cuda_shell(tmp_path, body, [nvidia_smi(tmp_path / "bin")], site)
    again = cuda_shell(tmp_path, body, [tmp_path / "bin"], site)
    assert len((tmp_path / "pip.log").read_text().splitlines()) == 1
    assert "could not be installed (offline?" in first.stdout
    marker = tmp_path / "work" / ".lmspd-cuda-wheels-failed"
    assert f"could not be installed before (rm {marker} to try again)" in again.stdout
    marker.unlink()  # as the message says: tried again
    cuda_shell(tmp_path, body, [tmp_path / "bin"], site)
    assert len((tmp_path / "pip.log").read_text().splitlines()) == 2
