"""A machine's CUDA, faked for the tests of ``scripts/cuda_toolkit.sh`` and
``scripts/llama_backend.sh``: toolkits as empty files where the libraries
are, an ``nvidia-smi`` that answers as a driver would, a ``pip`` that lays
out NVIDIA's wheels, and a shell that sees none of the machine's own CUDA
(no GPU, no nvcc, no network needed)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CUDA_TOOLKIT = ROOT / "scripts" / "cuda_toolkit.sh"

CUDA_H = """typedef int CUresult;
#define cuMemAlloc cuMemAlloc_v2
CUresult cuInit(unsigned int flags);
CUresult cuMemAlloc(void **ptr, unsigned long size);
CUresult cuMemCreate(void *handle, unsigned long size, const void *prop, unsigned long long flags);
"""


def touch(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def fake_nvcc(bin_dir: Path) -> None:
    nvcc = touch(bin_dir / "nvcc", "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)


def driver_here() -> bool:
    """What the script looks for before it makes a stub, besides the loader's
    cache (an empty one in these tests)."""
    return any(Path(p).exists() for p in ("/usr/local/nvidia/lib64/libcuda.so.1",
                                          "/usr/lib/x86_64-linux-gnu/libcuda.so.1"))


def system_places(tmp_path: Path, *libraries: Path) -> dict[str, str]:
    """The machine's own places, as fakes: a loader cache that lists only
    ``libraries`` (``ldconfig -p``) and an empty system include folder (a
    machine with Debian's CUDA toolkit has real ones)."""
    lines = "".join(f"\t{lib.name} (libc6,x86-64) => {lib}\n" for lib in libraries)
    ldconfig = touch(tmp_path / "ldconfig", f"#!/bin/sh\nprintf '{lines}'\n")
    ldconfig.chmod(0o755)
    return {"LDCONFIG": str(ldconfig), "SYSTEM_INCLUDE": str(tmp_path / "usr" / "include")}



TOOLS = ("bash", "sh", "sed", "awk", "grep", "head", "tr", "cut", "sort", "cat", "ls", "ln", "mkdir", "rm",
         "touch", "chmod", "dirname", "basename", "readlink", "printf", "env")


def cuda_shell(tmp_path: Path, body: str, path: list[Path], site: Path, libraries: tuple[Path, ...] = (),
               compiler: bool = False, script: Path = CUDA_TOOLKIT,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``body`` after sourcing ``script``, with ``path`` and the shell's own
    tools on PATH, and nothing of the machine's CUDA: no nvcc or nvidia-smi
    of its own (a GPU machine has them in /usr/bin), a loader cache listing
    only ``libraries``, an empty system include folder; ``env`` besides.
    ``compiler``: the machine's PATH after those (a C compiler finds its
    tools there)."""
    # python3 without site-packages: the test's own environment may hold nvidia wheels.
    py = touch(tmp_path / "py", f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    py.chmod(0o755)
    tools = tmp_path / "tools"
    if not tools.exists():
        tools.mkdir()
        for name in TOOLS:
            if (found := shutil.which(name)) is not None:
                (tools / name).symlink_to(found)
    program = f"""set -euo pipefail
say() {{ echo "say: $*" >&2; }}
PY={shlex.quote(str(py))}; WORK={shlex.quote(str(tmp_path / "work"))}; cmake_args=""; cxx_flags=""
. {shlex.quote(str(script))}
{body}
"""
    search = [*map(str, path), str(tools), *([os.environ["PATH"]] if compiler else [])]
    environ = {"PATH": ":".join(search), "PYTHONPATH": str(site), "CUDA_HOME": str(tmp_path / "no-cuda-home"),
               "HOME": str(tmp_path), **system_places(tmp_path, *libraries), **(env or {})}
    return subprocess.run(["bash", "-c", program], env=environ, capture_output=True, text=True, timeout=60)


def nvidia_smi(bin_dir: Path, cuda: str = "13.0", cap: str = "9.0") -> Path:
    """nvidia-smi as a driver answers it: its banner names the CUDA version."""
    smi = touch(bin_dir / "nvidia-smi", f"""#!/bin/sh
case "$*" in
  *compute_cap*) echo "{cap}" ;;
  "") echo "| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: {cuda}     |" ;;
esac
""")
    smi.chmod(0o755)
    return bin_dir



def fake_toolkit(root: Path, *, cublas: bool, cccl: bool = True) -> Path:
    fake_nvcc(root / "bin")
    touch(root / "lib64" / "libcudart.so")
    touch(root / "include" / "cuda_runtime.h")
    if cccl:
        touch(root / "include" / "cccl" / "cub" / "cub.cuh")
    if cublas:
        touch(root / "lib64" / "libcublas.so")
        touch(root / "lib64" / "libcublasLt.so")
        touch(root / "include" / "cublas_v2.h")
    return root / "bin"



def fake_pip(tmp_path: Path, site: Path, *, fails: bool = False) -> Path:
    """A pip that records what it was asked to install and lays out CUDA 13's
    wheels in ``site`` as NVIDIA's do (nvcc, versioned libraries, headers)."""
    cu13 = site / "nvidia" / "cu13"
    log = tmp_path / "pip.log"
    nvcc = "#!/bin/sh\\necho 'Cuda compilation tools, release 13.0, V13.0.88'\\n"
    pip = touch(tmp_path / "pip", f"""#!/bin/sh
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
