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
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "cuda_toolkit.sh"

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
    """What the script looks for before it makes a stub, besides the loader's
    cache (an empty one in these tests)."""
    return any(Path(p).exists() for p in ("/usr/local/nvidia/lib64/libcuda.so.1",
                                          "/usr/lib/x86_64-linux-gnu/libcuda.so.1"))


def _system(tmp_path: Path, *libraries: Path) -> dict[str, str]:
    """The machine's own places, as fakes: a loader cache that lists only
    ``libraries`` (``ldconfig -p``) and an empty system include folder (a
    machine with Debian's CUDA toolkit has real ones)."""
    lines = "".join(f"\t{lib.name} (libc6,x86-64) => {lib}\n" for lib in libraries)
    ldconfig = _touch(tmp_path / "ldconfig", f"#!/bin/sh\nprintf '{lines}'\n")
    ldconfig.chmod(0o755)
    return {"LDCONFIG": str(ldconfig), "SYSTEM_INCLUDE": str(tmp_path / "usr" / "include")}


def _run(tmp_path: Path, nvcc_bin: Path, site: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``cuda_libraries`` as run.sh calls it: prints cmake_args, cxx_flags and
    ``cuda_runtime_path`` one a line (the machine's PATH too: the stub is
    compiled)."""
    body = "cuda_libraries\nprintf '%s\\n' \"$cmake_args\" \"$cxx_flags\" \"$(cuda_runtime_path)\""
    return _shell(tmp_path, body, [nvcc_bin], site, compiler=True), tmp_path / "work" / "cuda-shim"


def test_a_system_toolkit_needs_nothing(tmp_path):
    root = tmp_path / "cuda"
    _nvcc(root / "bin")
    for name in ("libcudart.so", "libcublas.so", "libcublasLt.so", "stubs/libcuda.so"):
        _touch(root / "lib64" / name)
    for name in ("cuda_runtime.h", "cublas_v2.h", "cuda.h", "cub/cub.cuh"):
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
    _touch(root / "include" / "cccl" / "cub" / "cub.cuh")  # CUDA 13's place for CCCL: nvcc knows it
    done, shim = _run(tmp_path, root / "bin", site)
    assert done.returncode == 0, done.stderr
    args, cxx, runtime = done.stdout.split("\n")[:3]
    for name, lib in (("cudart", "libcudart.so.13"), ("CUDART", "libcudart.so.13"), ("cublas", "libcublas.so.13"),
                      ("cublasLt", "libcublasLt.so.13")):
        link = "libcudart.so" if name == "CUDART" else f"lib{name}.so"
        flag = f"-DCUDA_{name}=" if name == "CUDART" else f"-DCUDA_{name}_LIBRARY="
        assert f"{flag}{shim / link}" in args.split(), args
        assert (shim / link).resolve() == (root / "lib" / lib).resolve()
        # and under its own name: the built library's RUNPATH names the shim
        assert (shim / lib).resolve() == (root / "lib" / lib).resolve()
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


def test_cuda_12_cublas_from_its_own_wheel_gets_links_and_its_include_folder(tmp_path):
    """A CUDA 12 toolkit without cuBLAS beside PyTorch's cuBLAS wheel (CUDA
    12's wheels: one package per library, each with its own include folder;
    they carry no nvcc)."""
    root = tmp_path / "cuda-12.4"
    _nvcc(root / "bin")
    _touch(root / "lib64" / "libcudart.so")
    _touch(root / "lib64" / "stubs" / "libcuda.so")  # a driver stub: none made
    _touch(root / "include" / "cuda_runtime.h")
    _touch(root / "include" / "cub" / "cub.cuh")
    site = tmp_path / "site"
    cublas = site / "nvidia" / "cublas"
    _touch(cublas / "lib" / "libcublas.so.12")
    _touch(cublas / "lib" / "libcublasLt.so.12")
    _touch(cublas / "include" / "cublas_v2.h")
    done, shim = _run(tmp_path, root / "bin", site)
    assert done.returncode == 0, done.stderr
    args, cxx, runtime = done.stdout.split("\n")[:3]
    for name in ("libcublas", "libcublasLt"):
        for link in (f"{name}.so", f"{name}.so.12"):  # CMake's name, and the loader's
            assert (shim / link).resolve() == (cublas / "lib" / f"{name}.so.12").resolve()
    assert "cudart" not in args.lower()  # the toolkit's own
    assert f"'-DCMAKE_CUDA_FLAGS=-I{cublas / 'include'}'" in args
    assert cxx.strip() == f"-I{cublas / 'include'}"
    assert "cuda_driver" not in args
    assert runtime == str(cublas / "lib")


def test_a_toolkit_without_cublas_is_named_and_stops_the_build(tmp_path):
    root = tmp_path / "cuda"
    _nvcc(root / "bin")
    _touch(root / "lib64" / "libcudart.so")
    done, _ = _run(tmp_path, root / "bin", tmp_path / "site")
    assert done.returncode == 1
    assert "no libcublas: not in" in done.stderr


TOOLS = ("bash", "sh", "sed", "awk", "grep", "head", "tr", "cut", "sort", "cat", "ls", "ln", "mkdir", "rm",
         "touch", "chmod", "dirname", "basename", "readlink", "printf", "env")


def _shell(tmp_path: Path, body: str, path: list[Path], site: Path, libraries: tuple[Path, ...] = (),
           compiler: bool = False) -> subprocess.CompletedProcess[str]:
    """``body`` after sourcing the script, with ``path`` and the shell's own
    tools on PATH, and nothing of the machine's CUDA: no nvcc or nvidia-smi
    of its own (a GPU machine has them in /usr/bin), a loader cache listing
    only ``libraries``, an empty system include folder. ``compiler``: the
    machine's PATH after those (a C compiler finds its tools there)."""
    # python3 without site-packages: the test's own environment may hold nvidia wheels.
    py = _touch(tmp_path / "py", f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    py.chmod(0o755)
    tools = tmp_path / "tools"
    if not tools.exists():
        tools.mkdir()
        for name in TOOLS:
            if (found := shutil.which(name)) is not None:
                (tools / name).symlink_to(found)
    script = f"""set -euo pipefail
say() {{ echo "say: $*" >&2; }}
PY={py}; WORK={tmp_path / "work"}; cmake_args=""; cxx_flags=""
. {SCRIPT}
{body}
"""
    search = [*map(str, path), str(tools), *([os.environ["PATH"]] if compiler else [])]
    environ = {"PATH": ":".join(search), "PYTHONPATH": str(site),
               "CUDA_HOME": str(tmp_path / "no-cuda-home"), "HOME": str(tmp_path), **_system(tmp_path, *libraries)}
    return subprocess.run(["bash", "-c", script], env=environ, capture_output=True, text=True, timeout=60)


def _nvidia_smi(bin_dir: Path, cuda: str = "13.0", cap: str = "9.0") -> Path:
    """nvidia-smi as a driver answers it: its banner names the CUDA version."""
    smi = _touch(bin_dir / "nvidia-smi", f"""#!/bin/sh
case "$*" in
  *compute_cap*) echo "{cap}" ;;
  "") echo "| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: {cuda}     |" ;;
esac
""")
    smi.chmod(0o755)
    return bin_dir


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
    done = _shell(tmp_path, f'cuda_wheel_requirement "{nvcc}" "{driver}" "{cap}" {parts}', [], tmp_path / "site")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == wanted


@pytest.mark.parametrize(("driver", "cap", "why"), [
    ("12.4", "89", "NVIDIA's wheels carry nvcc from CUDA 13 on (driver 580 or later)"),
    ("13.0", "70", "CUDA 13 does not build for this GPU (compute capability 70; 7.5 or later)"),
    ("", "90", "nvidia-smi does not say which CUDA version the driver supports"),
])
def test_no_wheels_fit_without_nvcc_says_why(tmp_path, driver, cap, why):
    done = _shell(tmp_path, f'cuda_wheel_requirement "" "{driver}" "{cap}" nvcc cudart', [], tmp_path / "site")
    assert done.returncode == 1
    assert done.stdout == ""
    assert why in done.stderr


def test_the_driver_s_cuda_version_is_read_from_nvidia_smi(tmp_path):
    done = _shell(tmp_path, "echo \"[$(cuda_driver_version)]\"", [_nvidia_smi(tmp_path / "bin", "12.8")],
                  tmp_path / "site")
    assert done.stdout.strip() == "[12.8]", done.stderr
    done = _shell(tmp_path, "echo \"[$(cuda_driver_version)]\"", [], tmp_path / "site")
    assert done.stdout.strip() == "[]", done.stderr  # no nvidia-smi


def test_the_root_is_where_nvcc_itself_runs_from_behind_a_wrapper(tmp_path):
    """An nvcc on PATH may be a script that runs the toolkit's (as on this
    project's machines: /usr/local/bin/nvcc runs /usr/local/cuda-13.0/bin/nvcc)."""
    root = tmp_path / "cuda-13.0"
    real = _touch(root / "bin" / "nvcc", f"""#!/bin/sh
case "$*" in *--dryrun*) echo '#$ _HERE_={root / "bin"}' >&2 ;; esac
""")
    real.chmod(0o755)
    wrapper = _touch(tmp_path / "bin" / "nvcc", f'#!/bin/sh\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    done = _shell(tmp_path, "cuda_root", [tmp_path / "bin"], tmp_path / "site")
    assert done.stdout.strip() == str(root), done.stderr


def _toolkit(root: Path, *, cublas: bool, cccl: bool = True) -> Path:
    _nvcc(root / "bin")
    _touch(root / "lib64" / "libcudart.so")
    _touch(root / "include" / "cuda_runtime.h")
    if cccl:
        _touch(root / "include" / "cccl" / "cub" / "cub.cuh")
    if cublas:
        _touch(root / "lib64" / "libcublas.so")
        _touch(root / "lib64" / "libcublasLt.so")
        _touch(root / "include" / "cublas_v2.h")
    return root / "bin"


def test_missing_parts_are_what_neither_the_toolkit_nor_the_wheels_hold(tmp_path):
    site = tmp_path / "site"
    assert _shell(tmp_path, "cuda_missing_parts", [], site).stdout.strip() == "nvcc crt cudart cublas cccl"
    whole = _toolkit(tmp_path / "whole", cublas=True)
    assert _shell(tmp_path, "cuda_missing_parts", [whole], site).stdout.strip() == ""
    # A toolkit without cuBLAS (this project's machines have one): cuBLAS only,
    # until a wheel brings it (its library and header: the library alone is not enough).
    partial = _toolkit(tmp_path / "partial", cublas=False)
    assert _shell(tmp_path, "cuda_missing_parts", [partial], site).stdout.strip() == "cublas"
    _touch(site / "nvidia" / "cu13" / "lib" / "libcublas.so.13")
    assert _shell(tmp_path, "cuda_missing_parts", [partial], site).stdout.strip() == "cublas"
    _touch(site / "nvidia" / "cu13" / "include" / "cublas_v2.h")
    assert _shell(tmp_path, "cuda_missing_parts", [partial], site).stdout.strip() == "cublas"  # no cublasLt
    _touch(site / "nvidia" / "cu13" / "lib" / "libcublasLt.so.13")
    assert _shell(tmp_path, "cuda_missing_parts", [partial], site).stdout.strip() == ""
    # CCCL's headers (cub, thrust: llama.cpp's kernels include cub), in CUDA 13's
    # include/cccl or CUDA 12's include, the toolkit's or a wheel's.
    headless = _toolkit(tmp_path / "headless", cublas=True, cccl=False)
    assert _shell(tmp_path, "cuda_missing_parts", [headless], site).stdout.strip() == "cccl"
    _touch(site / "nvidia" / "cuda_cccl" / "include" / "cub" / "cub.cuh")
    assert _shell(tmp_path, "cuda_missing_parts", [headless], site).stdout.strip() == ""


def _fake_pip(tmp_path: Path, site: Path, *, fails: bool = False) -> Path:
    """A pip that records what it was asked to install and lays out CUDA 13's
    wheels in ``site`` as NVIDIA's do (nvcc, versioned libraries, headers)."""
    cu13 = site / "nvidia" / "cu13"
    log = tmp_path / "pip.log"
    nvcc = "#!/bin/sh\\necho 'Cuda compilation tools, release 13.0, V13.0.88'\\n"
    pip = _touch(tmp_path / "pip", f"""#!/bin/sh
echo "$*" >> {log}
{"exit 1" if fails else ""}
mkdir -p {cu13}/bin {cu13}/lib {cu13}/include
printf "{nvcc}" > {cu13}/bin/nvcc && chmod +x {cu13}/bin/nvcc
touch {cu13}/lib/libcudart.so.13 {cu13}/lib/libcublas.so.13 {cu13}/lib/libcublasLt.so.13
touch {cu13}/include/cuda_runtime.h {cu13}/include/cublas_v2.h
mkdir -p {cu13}/include/cccl/cub && touch {cu13}/include/cccl/cub/cub.cuh
""")
    pip.chmod(0o755)
    return pip


def test_a_driver_without_a_toolkit_gets_nvidia_s_wheels_and_their_nvcc(tmp_path):
    """./dev.sh's path on a machine with an NVIDIA driver and no CUDA toolkit
    (before, it built for the CPU without a word): the whole toolkit the
    driver runs is installed, and its nvcc is the one the build uses."""
    site = tmp_path / "site"
    pip = _fake_pip(tmp_path, site)
    body = f'PIP={pip}; cuda_prepare; echo "arch=$arch"; command -v nvcc'
    done = _shell(tmp_path, body, [_nvidia_smi(tmp_path / "bin", "13.0", "9.0")], site)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "pip.log").read_text() == "install -q cuda-toolkit[nvcc,crt,cudart,cublas,cccl]>=13.0,<13.1\n"
    assert done.stdout.split() == ["arch=90", str(site / "nvidia" / "cu13" / "bin" / "nvcc")]
    assert "lacks nvcc crt cudart cublas cccl: installing NVIDIA's wheels" in done.stderr
    # Again (the next ./dev.sh): the wheels' nvcc is found, nothing installed.
    done = _shell(tmp_path, body, [tmp_path / "bin"], site)
    assert done.returncode == 0, done.stderr
    assert len((tmp_path / "pip.log").read_text().splitlines()) == 1
    assert done.stdout.split()[-1] == str(site / "nvidia" / "cu13" / "bin" / "nvcc")


def test_a_toolkit_without_cublas_gets_only_cublas_for_its_own_version(tmp_path):
    site = tmp_path / "site"
    pip = _fake_pip(tmp_path, site)
    toolkit = _toolkit(tmp_path / "cuda", cublas=False)
    done = _shell(tmp_path, f"PIP={pip}; cuda_prepare; command -v nvcc", [toolkit, _nvidia_smi(tmp_path / "smi")],
                  site)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "pip.log").read_text() == "install -q cuda-toolkit[cublas]==13.0.*\n"
    assert done.stdout.strip() == str(toolkit / "nvcc")  # the toolkit's nvcc still


@pytest.mark.parametrize(("cuda", "fails", "why"), [
    ("12.4", False, "no CUDA toolkit fits"),
    ("13.0", True, "could not be installed (offline? install the CUDA toolkit)"),
])
def test_where_no_toolkit_can_be_had_the_reason_is_given(tmp_path, cuda, fails, why):
    site = tmp_path / "site"
    pip = _fake_pip(tmp_path, site, fails=fails)
    body = f'PIP={pip}; cuda_prepare && echo ready || echo "unusable: $cuda_unusable"'
    done = _shell(tmp_path, body, [_nvidia_smi(tmp_path / "bin", cuda)], site)
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
    real = _touch(root / "bin" / "nvcc", f"""#!/bin/sh
case "$*" in *--dryrun*) echo '#$ _HERE_={root / "bin"}' >&2 ;; *) echo 'release 12.0, V12.0.140' ;; esac
""")
    real.chmod(0o755)
    wrapper = _touch(tmp_path / "usr" / "bin" / "nvcc", f'#!/bin/sh\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    system_lib = tmp_path / "usr" / "lib" / "x86_64-linux-gnu"
    libraries = tuple(_touch(system_lib / name) for name in ("libcudart.so", "libcublas.so", "libcublasLt.so",
                                                              "libcuda.so.1"))
    for header in ("cuda_runtime.h", "cublas_v2.h", "cub/cub.cuh"):
        _touch(tmp_path / "usr" / "include" / header)
    site = tmp_path / "site"
    done = _shell(tmp_path, 'echo "[$(cuda_missing_parts)]"; cuda_libraries; echo "[$cmake_args] [$cxx_flags]"',
                  [tmp_path / "usr" / "bin"], site, libraries)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", f"[ -DCUDA_cuda_driver_LIBRARY={tmp_path / 'work' / 'cuda-shim'}"
                                                   "/libcuda.so] []"]
    # Without the loader's cache entries the same toolkit lacks the runtime and cuBLAS.
    done = _shell(tmp_path, "cuda_missing_parts", [tmp_path / "usr" / "bin"], site)
    assert done.stdout.strip() == "cudart cublas"


def test_a_failed_install_is_not_tried_again_on_every_run(tmp_path):
    site = tmp_path / "site"
    pip = _fake_pip(tmp_path, site, fails=True)
    body = f'PIP={pip}; cuda_prepare || echo "unusable: $cuda_unusable"'
    first = _shell(tmp_path, body, [_nvidia_smi(tmp_path / "bin")], site)
    again = _shell(tmp_path, body, [tmp_path / "bin"], site)
    assert len((tmp_path / "pip.log").read_text().splitlines()) == 1
    assert "could not be installed (offline?" in first.stdout
    marker = tmp_path / "work" / ".lmspd-cuda-wheels-failed"
    assert f"could not be installed before (rm {marker} to try again)" in again.stdout
    marker.unlink()  # as the message says: tried again
    _shell(tmp_path, body, [tmp_path / "bin"], site)
    assert len((tmp_path / "pip.log").read_text().splitlines()) == 2
