"""``scripts/llama_backend.sh``: which llama.cpp build ``./dev.sh`` makes on
which machine, and the CMAKE_ARGS it hands that build, as scikit-build-core
reads them (``shlex.split``). The machine is faked: ``uname``, the NVIDIA
driver's file, ``nvidia-smi``, the CUDA toolkit and the Vulkan SDK's
``glslc`` (tests/support/fake_cuda.py); nothing is installed or built."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from support.fake_cuda import ROOT, cuda_shell, fake_pip, fake_toolkit, nvidia_smi, touch

SCRIPT = ROOT / "scripts" / "llama_backend.sh"
NO_AMX = ["-DCMAKE_C_FLAGS=-U__AMX_INT8__", "-DCMAKE_CXX_FLAGS=-U__AMX_INT8__"]


def _uname(bin_dir: Path, system: str, machine: str) -> Path:
    fake = touch(bin_dir / "uname", f'#!/bin/sh\ncase "$1" in -s) echo {system} ;; -m) echo {machine} ;; esac\n')
    fake.chmod(0o755)
    return bin_dir


def _backend(tmp_path: Path, *, system: str = "Linux", machine: str = "x86_64", driver: bool = False,
             path: tuple[Path, ...] = (), env: dict[str, str] | None = None):
    """``llama_backend`` on the machine described: returns the finished
    shell, the backend's name and the CMake arguments (None where it stopped)."""
    driver_file = tmp_path / "proc-driver-nvidia-version"
    if driver:
        touch(driver_file, "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04\n")
    body = 'llama_backend\nprintf "%s\\n" "$backend" "$cmake_args"'
    done = cuda_shell(tmp_path, body, [_uname(tmp_path / "uname", system, machine), *path], tmp_path / "site",
                      script=SCRIPT, env={"NVIDIA_DRIVER_FILE": str(driver_file), **(env or {})})
    if done.returncode != 0:
        return done, None, None
    backend, args = done.stdout.split("\n")[:2]
    return done, backend, shlex.split(args)


@pytest.mark.parametrize(("system", "machine", "backend", "args"), [
    ("Linux", "x86_64", "cpu-noamx", NO_AMX),  # (the AMX kernels fault: lmspd/engines/llama/amx.py)
    ("Linux", "aarch64", "cpu", []),
    ("Darwin", "arm64", "metal", ["-DGGML_METAL=on"]),
    ("Darwin", "x86_64", "cpu", ["-DGGML_METAL=off"]),
])
def test_without_a_driver_the_machine_picks_the_backend(tmp_path, system, machine, backend, args):
    done, found, cmake_args = _backend(tmp_path, system=system, machine=machine)
    assert (found, cmake_args) == (backend, args), done.stderr


def _cuda_toolkit(tmp_path: Path) -> Path:
    """A whole toolkit, its driver stub included (none is made)."""
    bin_dir = fake_toolkit(tmp_path / "cuda", cublas=True)
    touch(tmp_path / "cuda" / "lib64" / "stubs" / "libcuda.so")
    return bin_dir


@pytest.mark.parametrize("answers", ["driver file", "nvidia-smi"])
def test_an_nvidia_driver_with_a_toolkit_gets_cuda_for_its_gpu(tmp_path, answers):
    smi = nvidia_smi(tmp_path / "smi", "13.0", "8.9")
    done, backend, args = _backend(tmp_path, driver=answers == "driver file", path=(_cuda_toolkit(tmp_path), smi))
    # (Named for CUDA's major version and the GPU's architecture: a wheel
    # built for another cannot load here.)
    assert backend == "cuda13-sm89-noamx", done.stderr
    assert args == ["-DGGML_CUDA=on", "-DCMAKE_CUDA_ARCHITECTURES=89", *NO_AMX]


def test_without_a_driver_a_toolkit_alone_is_not_cuda(tmp_path):
    """As on CI: nvcc installed, no GPU (a CUDA build could not load libcuda)."""
    done, backend, args = _backend(tmp_path, path=(_cuda_toolkit(tmp_path),))
    assert (backend, args) == ("cpu-noamx", NO_AMX), done.stderr


@pytest.mark.parametrize("asked", ["", "cuda"])
def test_a_driver_no_toolkit_fits_is_the_cpu_saying_why_or_a_stop_where_cuda_was_asked(tmp_path, asked):
    """A driver that runs CUDA 12.4 and no toolkit: NVIDIA's wheels carry nvcc
    only from CUDA 13 on, so nothing is installed."""
    pip = fake_pip(tmp_path, tmp_path / "site")
    done, backend, args = _backend(tmp_path, driver=True, path=(nvidia_smi(tmp_path / "smi", "12.4"),),
                                   env={"LMSPD_GPU": asked, "PIP": str(pip)})
    assert not (tmp_path / "pip.log").exists()
    if asked:
        assert done.returncode == 1 and backend is None
        assert "say: LMSPD_GPU=cuda: no CUDA toolkit fits (install one: see README)" in done.stderr
        return
    assert (backend, args) == ("cpu-noamx", NO_AMX), done.stderr
    assert ("say: an NVIDIA GPU answers, but no CUDA toolkit fits (install one: see README): building for the "
            "CPU instead (LMSPD_GPU=cpu skips these checks)") in done.stderr


def test_a_driver_and_an_incomplete_toolkit_is_the_cpu_with_nothing_of_cuda_in_its_arguments(tmp_path):
    """nvcc, the runtime and cuBLAS, but no driver stub and no cuda.h to make
    one from: cuda_libraries fails after it has named libraries to CMake."""
    toolkit = fake_toolkit(tmp_path / "cuda", cublas=True)
    for name in ("libcudart.so", "libcublas.so", "libcublasLt.so"):  # versioned only: linked through the shim
        (tmp_path / "cuda" / "lib64" / name).rename(tmp_path / "cuda" / "lib64" / f"{name}.13")
    done, backend, args = _backend(tmp_path, path=(toolkit, nvidia_smi(tmp_path / "smi")))
    if any(Path(p).exists() for p in ("/usr/local/nvidia/lib64/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1")):
        pytest.skip("this machine's driver library stands in for the stub")
    assert (backend, args) == ("cpu-noamx", NO_AMX), done.stderr
    assert "no cuda.h" in done.stderr and "the CUDA toolkit is incomplete (above)" in done.stderr


def test_vulkan_needs_the_sdk_s_shader_compiler(tmp_path):
    done, backend, _ = _backend(tmp_path, env={"LMSPD_GPU": "vulkan"})
    assert done.returncode == 1 and backend is None
    assert "LMSPD_GPU=vulkan needs the Vulkan SDK (glslc): see README" in done.stderr
    glslc = touch(tmp_path / "sdk" / "glslc", "#!/bin/sh\n")
    glslc.chmod(0o755)
    done, backend, args = _backend(tmp_path, path=(glslc.parent,), env={"LMSPD_GPU": "vulkan"})
    assert (backend, args) == ("vulkan-noamx", ["-DGGML_VULKAN=on", *NO_AMX]), done.stderr


def test_an_unknown_backend_is_refused(tmp_path):
    done, backend, _ = _backend(tmp_path, env={"LMSPD_GPU": "rocm"})
    assert done.returncode == 2 and backend is None
    assert "LMSPD_GPU must be cuda, metal, vulkan or cpu (not 'rocm')" in done.stderr


def _wheels_in(home: Path) -> tuple[Path, Path, Path]:
    """CUDA 13's nvcc and runtime and PyTorch's cuBLAS, as wheels in a venv
    under ``home``: versioned libraries, headers outside the toolkit, the
    runtime's lib folder nvcc needs named. Returns the site, the toolkit's
    root and cuBLAS's folder."""
    site = home / ".venv" / "site"
    root = site / "nvidia" / "cu13"
    fake_toolkit(root, cublas=False)
    (root / "lib64").rename(root / "lib")
    (root / "lib" / "libcudart.so").rename(root / "lib" / "libcudart.so.13")
    touch(root / "targets" / "x86_64-linux" / "lib" / "stubs" / "libcuda.so")
    cublas = site / "nvidia" / "cublas"
    touch(cublas / "lib" / "libcublas.so.13")
    touch(cublas / "lib" / "libcublasLt.so.13")
    touch(cublas / "include" / "cublas_v2.h")
    return site, root, cublas


def _in_checkout(home: Path, site: Path, root: Path):
    body = 'llama_backend\nprintf "%s\\n" "$backend" "$cmake_args"'
    return cuda_shell(home, body, [_uname(home / "uname", "Linux", "x86_64"), root / "bin", nvidia_smi(home / "smi")],
                      site, script=SCRIPT, env={"NVIDIA_DRIVER_FILE": str(home / "none")})


def test_a_checkout_path_with_spaces_reaches_cmake_and_the_compiler_whole(tmp_path):
    """A checkout in "~/My Projects": each CMAKE_ARGS value is one argument,
    and within the compiler flags (which CMake writes into its rules as
    they are, for the shell to split) each path is one word. Checked with
    nvcc 13.0 and CMake on a small CUDA project: it builds and links."""
    home = tmp_path / "My Projects" / "lmspd"
    site, root, cublas = _wheels_in(home)
    done = _in_checkout(home, site, root)
    assert done.returncode == 0, done.stderr
    backend, line = done.stdout.split("\n")[:2]
    assert backend == "cuda13-sm90-noamx", done.stderr
    args = dict(arg.split("=", 1) for arg in shlex.split(line))
    shim = home / "work" / "cuda-shim"
    assert args["-DCUDA_cudart_LIBRARY"] == str(shim / "libcudart.so")
    assert args["-DCUDA_cublas_LIBRARY"] == str(shim / "libcublas.so")
    assert (shim / "libcublas.so").resolve() == (cublas / "lib" / "libcublas.so.13").resolve()
    assert shlex.split(args["-DCMAKE_CUDA_FLAGS"]) == [f"-I{cublas / 'include'}", f"-L{root / 'lib'}"]
    assert shlex.split(args["-DCMAKE_CXX_FLAGS"]) == [f"-I{cublas / 'include'}", "-U__AMX_INT8__"]


def test_a_checkout_path_with_a_quote_is_the_cpu_saying_why(tmp_path):
    """nvcc passes its -I on to its own tools, which lose a path with a quote
    in it (with nvcc 13.0: "fatal error: answer.h: No such file")."""
    home = tmp_path / "Bob's lmspd"
    site, root, cublas = _wheels_in(home)
    done = _in_checkout(home, site, root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["cpu-noamx", "'-DCMAKE_C_FLAGS=-U__AMX_INT8__' "
                                                       "'-DCMAKE_CXX_FLAGS=-U__AMX_INT8__'"]
    assert f"nvcc cannot take a path with a quote, $, \\ or ` in it: {cublas / 'include'}" in done.stderr
    assert "the CUDA toolkit is incomplete (above): building for the CPU instead" in done.stderr


def test_a_cmake_argument_with_a_quote_is_one_argument(tmp_path):
    body = """cmake_arg "-DA=Bob's lib"; cmake_arg '-DB=a "b"'; cmake_arg -DC=1; echo "$cmake_args" """
    done = cuda_shell(tmp_path, body, [], tmp_path / "site")
    assert shlex.split(done.stdout) == ["-DA=Bob's lib", '-DB=a "b"', "-DC=1"], done.stderr
