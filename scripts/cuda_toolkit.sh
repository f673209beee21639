# Sourced by ./dev.sh, bench/gpu/run.sh and tests/unit/test_cuda_toolkit.py:
# the parts of the CUDA toolkit a llama.cpp build links, wherever nvcc came
# from, and which of NVIDIA's toolkit wheels to install where parts are missing.
# Uses PY (a python3, whose NVIDIA wheels count), WORK (a folder for the shim),
# PIP (cuda_prepare's installer) and say. A distribution's toolkit (Debian's
# nvidia-cuda-toolkit) keeps its libraries where the loader's cache lists them
# and its headers in $SYSTEM_INCLUDE (/usr/include): both count too.
SYSTEM_INCLUDE=${SYSTEM_INCLUDE:-/usr/include}

# The toolkit's root: the folder above nvcc's bin, as nvcc itself reports it
# (the nvcc on PATH may be a wrapper script elsewhere), else as its path says.
cuda_root() {
  local here
  here=$(nvcc --dryrun -E -x cu /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -1 || true)
  [ -n "$here" ] || here=$(dirname "$(readlink -f "$(command -v nvcc)")")
  dirname "$here"
}

# A CUDA toolkit installed from NVIDIA's wheels (as on some GPU images: CUDA
# 12's in one package per library beside python3, CUDA 13's in one nvidia/cu13
# tree) has only versioned libraries (libcudart.so.13) and no libcuda stub,
# which CMake's FindCUDAToolkit does not accept ("Unable to find cudart
# library"). Each library the build links that the toolkit lacks unversioned
# gets a link with that name in a shim folder, named to CMake; headers
# outside the toolkit's include folder are added to the compilers' flags. With
# no driver at all (a build here for a GPU machine elsewhere), libcuda is a
# stub made from cuda.h: the driver's own is loaded where it runs. Adds to
# cmake_args and cxx_flags (one CMAKE_CXX_FLAGS for the whole build).
cuda_libraries() {
  local root shim name found hdr inc drv cuda_flags=""
  root=$(cuda_root)
  shim=$WORK/cuda-shim
  mkdir -p "$shim"
  for name in cudart cublas cublasLt; do
    found=$(library_file $name) || { say "no lib$name: not in $root, python3's nvidia wheels or the loader's cache" >&2; return 1; }
    case "$found" in *.so) continue ;; esac  # unversioned: CMake finds it
    # (and under its own name: a build's RUNPATH names the shim, so that the
    # engine finds the library where it was built, without a loader path)
    ln -sf "$found" "$shim/lib$name.so"
    ln -sf "$found" "$shim/$(basename "$found")"
    cmake_arg "-DCUDA_${name}_LIBRARY=$shim/lib$name.so"
    # (CMake 3.25+ looks for cudart under this name first.)
    [ "$name" = cudart ] && cmake_arg "-DCUDA_CUDART=$shim/libcudart.so"
  done
  for hdr in cuda_runtime.h cublas_v2.h cub/cub.cuh; do
    inc=$(include_dir "$root" $hdr) || return 1
    # The toolkit's own and the system's: the compilers know them (an -I
    # /usr/include would break libstdc++'s #include_next).
    case "$inc" in "$root"/*|"$SYSTEM_INCLUDE"|"$SYSTEM_INCLUDE"/*) continue ;; esac
    nvcc_takes "$inc" || return 1
    cuda_flags="$cuda_flags -I$(flag_path "$inc")"
    cxx_flags="$cxx_flags -I$(flag_path "$inc")"
  done
  # nvcc.profile names lib64 for its own runtime (libcudart_static.a), which
  # CUDA 13's wheel keeps in lib: nvcc cannot link even CMake's test program.
  if [ ! -d "$root/lib64" ] && [ -d "$root/lib" ]; then
    nvcc_takes "$root/lib" || return 1
    cuda_flags="$cuda_flags -L$(flag_path "$root/lib")"
  fi
  [ -n "$cuda_flags" ] && cmake_arg "-DCMAKE_CUDA_FLAGS=${cuda_flags# }"
  if ! any_exists "$root"/lib64/stubs/libcuda.so "$root"/targets/*/lib/stubs/libcuda.so "$root"/lib64/libcuda.so; then
    # (|| true: called in the script's own shell, where set -e and pipefail
    # would end it at ls's missing path.)
    drv=$(loader_cache | awk '/libcuda\.so\.1 /{print $NF; exit}' || true)
    [ -n "$drv" ] || drv=$(ls /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>/dev/null | head -1 || true)
    if [ -n "$drv" ]; then
      ln -sf "$drv" "$shim/libcuda.so"
    else
      # Every function cuda.h declares (its macros resolved: cuMemAlloc is
      # cuMemAlloc_v2), each an empty body: a stub without them would be
      # dropped from the library's NEEDED entries (--as-needed), leaving
      # cuMemCreate & co. unresolved where the build is loaded.
      say "no NVIDIA driver here: linking against a libcuda stub made from cuda.h"
      inc=$(include_dir "$root" cuda.h) || return 1
      echo '#include <cuda.h>' | cc -E -I"$inc" -x c - | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' \
        | tr -d ' \t(' | sort -u | sed 's/.*/void &(void) {}/' \
        | cc -shared -fPIC -Wl,-soname,libcuda.so.1 -x c - -o "$shim/libcuda.so" \
        || { say "could not make the libcuda stub (a C compiler?)" >&2; return 1; }
    fi
    cmake_arg "-DCUDA_cuda_driver_LIBRARY=$shim/libcuda.so"
  fi
  return 0
}

# The file of the library $1 (cudart): lib$1.so, the toolkit's or else one the
# loader's cache lists; or else a versioned lib$1.so.13, the toolkit's, python3's
# NVIDIA wheels' (they have only those) or the cache's.
library_file() {
  local root d f IFS=$'\n'  # (one folder a line: a path may hold spaces)
  root=$(cuda_root)
  for d in "$root"/lib64 "$root"/lib "$root"/targets/*/lib; do
    [ -e "$d/lib$1.so" ] && echo "$d/lib$1.so" && return 0
  done
  f=$(loader_cache | awk -v n="lib$1.so" '$1 == n {print $NF; exit}')
  [ -n "$f" ] && echo "$f" && return 0
  for d in "$root"/lib64 "$root"/lib "$root"/targets/*/lib $(nvidia_wheel_dirs lib); do
    for f in "$d"/lib$1.so.[0-9]*; do [ -e "$f" ] && echo "$f" && return 0; done
  done
  f=$(loader_cache | awk -v n="lib$1.so." 'index($1, n) == 1 {print $NF; exit}')
  [ -n "$f" ] && echo "$f" && return 0
  return 1
}

# The dynamic loader's cache (ldconfig -p; $LDCONFIG), or nothing.
loader_cache() {
  "${LDCONFIG:-$(command -v ldconfig || echo /sbin/ldconfig)}" -p 2>/dev/null || true
}

# The first include folder under the toolkit root $1, in python3's nvidia
# wheels or $SYSTEM_INCLUDE that holds the header $2 (fails, saying so, where
# none does).
include_dir() {
  local d IFS=$'\n'  # (one folder a line: a path may hold spaces)
  # (CUDA 13 keeps CCCL's headers, cub/ and thrust/, in include/cccl.)
  for d in "$1"/include "$1"/include/cccl "$1"/targets/*/include $(nvidia_wheel_dirs include) \
           $(nvidia_wheel_dirs include | sed 's|$|/cccl|') "$SYSTEM_INCLUDE"; do
    [ -f "$d/$2" ] && echo "$d" && return 0
  done
  say "no $2: neither in $1 nor in python3's nvidia wheels nor in $SYSTEM_INCLUDE" >&2
  return 1
}

# Adds $1 to cmake_args, quoted: scikit-build-core splits CMAKE_ARGS as a
# shell would (shlex), so that a value may hold spaces or quotes (a checkout
# in "~/My Projects").
cmake_arg() {
  local q="'\\''"
  cmake_args="${cmake_args:+$cmake_args }'${1//\'/$q}'"
}

# The path $1 as one word of a compiler's command line, which CMake writes
# into its build rules from CMAKE_<LANG>_FLAGS as given (the shell splits it).
flag_path() {
  case "$1" in
    *[[:space:]]*) printf '"%s"' "$1" ;;
    *) printf '%s' "$1" ;;
  esac
}

# nvcc hands a path on to the tools it runs, which take one with spaces but
# not one with a quote ("fatal error: cuda_runtime.h: No such file"); nor
# would the shell that runs CMake's rules take a $, \ or ` inside -I"...".
nvcc_takes() {
  case "$1" in
    *[\'\"\\\$\`]*)
      say "nvcc cannot take a path with a quote, \$, \\ or \` in it: $1 (move the checkout, or install the CUDA toolkit outside it)" >&2
      return 1 ;;
  esac
}

any_exists() {
  local f
  for f in "$@"; do [ -e "$f" ] && return 0; done
  return 1
}

# The lib or include folders of python3's nvidia-* wheels (PyTorch's, say).
nvidia_wheel_dirs() {
  "$PY" -c 'import importlib.util as u, pathlib as p, sys
s = u.find_spec("nvidia")
print("\n".join(str(d) for r in (s.submodule_search_locations if s else []) for d in sorted(p.Path(r).glob("*/" + sys.argv[1]))))' "$1"
}

# Where the CUDA runtime and cuBLAS a build links are found at run time when
# no loader path names them: the toolkit's own folders, then the wheels'.
cuda_runtime_path() {
  local root d path="" IFS=$'\n'  # (one folder a line: a path may hold spaces)
  root=$(cuda_root)
  for d in "$root"/lib64 "$root"/lib "$root"/targets/*/lib $(nvidia_wheel_dirs lib); do
    case "$path:" in *":$d:"*) continue ;; esac  # (a wheel's toolkit is among the wheels)
    any_exists "$d"/libcudart.so.[0-9]* "$d"/libcublas.so.[0-9]* && path="$path:$d"
  done
  echo "${path#:}"
}

# Everything a llama.cpp CUDA build needs, for ./dev.sh: nvcc (on PATH, in
# $CUDA_HOME or /usr/local/cuda, or among python3's NVIDIA wheels) and the
# libraries it links; the parts missing are installed from NVIDIA's wheels
# with $PIP (into python3's environment). Sets arch (this GPU's compute
# capability, "90"; empty where nvidia-smi does not say) and PATH. Fails where
# it cannot, with the reason in cuda_unusable.
cuda_prepare() {
  local parts nvcc_version="" requirement failed
  cuda_find_nvcc
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)
  parts=$(cuda_missing_parts)
  [ -z "$parts" ] && return 0
  command -v nvcc >/dev/null 2>&1 && nvcc_version=$(cuda_nvcc_version)
  if ! requirement=$(cuda_wheel_requirement "$nvcc_version" "$(cuda_driver_version)" "$arch" $parts); then
    cuda_unusable="no CUDA toolkit fits (install one: see README)"
    return 1
  fi
  # (A failed install is not tried again on every run: offline, pip's retries take a while.)
  failed=$WORK/.lmspd-cuda-wheels-failed
  if [ "$(cat "$failed" 2>/dev/null)" = "$requirement" ]; then
    cuda_unusable="NVIDIA's toolkit wheels ($requirement) could not be installed before (rm $failed to try again)"
    return 1
  fi
  say "the CUDA toolkit here lacks $parts: installing NVIDIA's wheels ($requirement; up to 1.5 GB)"
  # (pip's own progress, not -q: a gigabyte downloaded without a word looks hung.)
  if ! $PIP install "$requirement" >&2; then
    mkdir -p "$WORK" && echo "$requirement" > "$failed"
    cuda_unusable="NVIDIA's toolkit wheels ($requirement) could not be installed (offline? install the CUDA toolkit)"
    return 1
  fi
  rm -f "$failed"
  cuda_find_nvcc
  parts=$(cuda_missing_parts)
  [ -z "$parts" ] || { cuda_unusable="NVIDIA's wheels ($requirement) did not bring $parts"; return 1; }
}

# Where there is no nvcc on PATH, the toolkit's in $CUDA_HOME (by default
# /usr/local/cuda) goes there, else one among python3's NVIDIA wheels (an
# earlier ./dev.sh installed it), if any.
cuda_find_nvcc() {
  local d IFS=$'\n'  # (one folder a line: a path may hold spaces)
  command -v nvcc >/dev/null 2>&1 && return 0
  for d in "${CUDA_HOME:-/usr/local/cuda}/bin" $(nvidia_wheel_dirs bin); do
    [ -x "$d/nvcc" ] && PATH="$d:$PATH" && return 0
  done
  return 0
}

# The CUDA version the NVIDIA driver supports ("13.0"), from nvidia-smi's
# banner; nothing where nvidia-smi does not say.
cuda_driver_version() {
  nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -1 || true
}

# nvcc's CUDA version ("13.0").
cuda_nvcc_version() {
  nvcc --version | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -1
}

# The parts of the toolkit a llama.cpp build needs that neither nvcc's toolkit
# nor python3's NVIDIA wheels hold, named as the extras of PyPI's cuda-toolkit
# package (nothing printed: all there). Without nvcc, all of them.
cuda_missing_parts() {
  local root missing=""
  if ! command -v nvcc >/dev/null 2>&1; then
    echo "nvcc crt cudart cublas cccl"
    return 0
  fi
  root=$(cuda_root)
  # (cuBLAS is two libraries; CCCL is headers only.)
  { library_file cudart && include_dir "$root" cuda_runtime.h; } >/dev/null 2>&1 || missing="$missing cudart"
  { library_file cublas && library_file cublasLt && include_dir "$root" cublas_v2.h; } >/dev/null 2>&1 \
    || missing="$missing cublas"
  include_dir "$root" cub/cub.cuh >/dev/null 2>&1 || missing="$missing cccl"
  echo "${missing# }"
}

# The pip requirement for NVIDIA's toolkit wheels holding the parts named
# ($4...): nvcc's own CUDA version ($1, "12.4") where there is an nvcc; else a
# whole toolkit, which NVIDIA's wheels carry (nvcc itself) only from CUDA 13
# on: as new as the driver supports ($2, "13.0") runs, for a GPU of compute
# capability 7.5 or later ($3, "90"). Fails, saying why, where none fits.
cuda_wheel_requirement() {
  local nvcc_version=$1 driver=$2 cap=$3 major minor range
  shift 3
  if [ -n "$nvcc_version" ]; then
    range="==$nvcc_version.*"
  else
    [ -n "$driver" ] || { say "nvidia-smi does not say which CUDA version the driver supports" >&2; return 1; }
    major=${driver%%.*}
    minor=${driver#*.}
    if [ "$major" -lt 13 ]; then
      say "the NVIDIA driver supports CUDA $driver, and NVIDIA's wheels carry nvcc from CUDA 13 on (driver 580 or later)" >&2
      return 1
    fi
    if [ -n "$cap" ] && [ "$cap" -lt 75 ]; then
      say "CUDA 13 does not build for this GPU (compute capability $cap; 7.5 or later)" >&2
      return 1
    fi
    range=$([ "$major" = 13 ] && echo ">=13.0,<13.$((minor + 1))" || echo ">=13.0,<14")
  fi
  echo "cuda-toolkit[$(echo "$*" | tr ' ' ',')]$range"
}
