# Sourced by bench/gpu/run.sh (and tests/unit/test_gpu_cuda_toolkit.py): the
# parts of the CUDA toolkit a llama.cpp build links, wherever nvcc came from.
# Uses PY (a python3), WORK (a folder for the shim) and say.

# The toolkit's root: the folder above nvcc's bin.
cuda_root() {
  dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"
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
  local root shim name found d f hdr inc drv cuda_flags=""
  root=$(cuda_root)
  shim=$WORK/cuda-shim
  mkdir -p "$shim"
  for name in cudart cublas cublasLt; do
    any_exists "$root"/lib64/lib$name.so "$root"/lib/lib$name.so "$root"/targets/*/lib/lib$name.so && continue
    found=""
    for d in "$root"/lib64 "$root"/lib $(nvidia_wheel_dirs lib); do
      for f in "$d"/lib$name.so.[0-9]*; do [ -e "$f" ] && found=$f && break 2; done
    done
    [ -n "$found" ] || { say "no lib$name: neither in $root nor in python3's nvidia wheels" >&2; exit 1; }
    ln -sf "$found" "$shim/lib$name.so"
    cmake_args="$cmake_args -DCUDA_${name}_LIBRARY=$shim/lib$name.so"
    # (CMake 3.25+ looks for cudart under this name first.)
    [ "$name" = cudart ] && cmake_args="$cmake_args -DCUDA_CUDART=$shim/libcudart.so"
  done
  for hdr in cuda_runtime.h cublas_v2.h; do
    inc=$(include_dir "$root" $hdr) || exit 1
    case "$inc" in "$root"/*) continue ;; esac  # the toolkit's own: nvcc and CMake know it
    cuda_flags="$cuda_flags -I$inc"
    cxx_flags="$cxx_flags -I$inc"
  done
  # nvcc.profile names lib64 for its own runtime (libcudart_static.a), which
  # CUDA 13's wheel keeps in lib: nvcc cannot link even CMake's test program.
  [ ! -d "$root/lib64" ] && [ -d "$root/lib" ] && cuda_flags="$cuda_flags -L$root/lib"
  [ -n "$cuda_flags" ] && cmake_args="$cmake_args '-DCMAKE_CUDA_FLAGS=${cuda_flags# }'"
  if ! any_exists "$root"/lib64/stubs/libcuda.so "$root"/targets/*/lib/stubs/libcuda.so "$root"/lib64/libcuda.so; then
    # (|| true: called in the script's own shell, where set -e and pipefail
    # would end it at ldconfig's SIGPIPE or at ls's missing path.)
    drv=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}' || true)
    [ -n "$drv" ] || drv=$(ls /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>/dev/null | head -1 || true)
    if [ -n "$drv" ]; then
      ln -sf "$drv" "$shim/libcuda.so"
    else
      # Every function cuda.h declares (its macros resolved: cuMemAlloc is
      # cuMemAlloc_v2), each an empty body: a stub without them would be
      # dropped from the library's NEEDED entries (--as-needed), leaving
      # cuMemCreate & co. unresolved where the build is loaded.
      say "no NVIDIA driver here: linking against a libcuda stub made from cuda.h"
      inc=$(include_dir "$root" cuda.h) || exit 1
      echo '#include <cuda.h>' | cc -E -I"$inc" -x c - | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' \
        | tr -d ' \t(' | sort -u | sed 's/.*/void &(void) {}/' \
        | cc -shared -fPIC -Wl,-soname,libcuda.so.1 -x c - -o "$shim/libcuda.so"
    fi
    cmake_args="$cmake_args -DCUDA_cuda_driver_LIBRARY=$shim/libcuda.so"
  fi
  return 0
}

# The first include folder under the toolkit root $1 or in python3's nvidia
# wheels that holds the header $2 (the caller stops where none does).
include_dir() {
  local d
  for d in "$1"/include "$1"/targets/*/include $(nvidia_wheel_dirs include); do
    [ -f "$d/$2" ] && echo "$d" && return 0
  done
  say "no $2: neither in $1 nor in python3's nvidia wheels" >&2
  exit 1
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
  local root d path=""
  root=$(cuda_root)
  for d in "$root"/lib64 "$root"/lib "$root"/targets/*/lib $(nvidia_wheel_dirs lib); do
    case "$path:" in *":$d:"*) continue ;; esac  # (a wheel's toolkit is among the wheels)
    any_exists "$d"/libcudart.so.[0-9]* "$d"/libcublas.so.[0-9]* && path="$path:$d"
  done
  echo "${path#:}"
}
