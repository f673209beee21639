# Sourced by ./dev.sh and tests/unit/test_llama_backend.py: which llama.cpp
# build this machine gets. llama_backend sets
#   backend     the build's name, and its wheel cache's key: cpu-noamx,
#               cuda13-sm90-noamx, metal, ...
#   cmake_args  the CMAKE_ARGS for llama-cpp-python's build
# from LMSPD_GPU (cuda, metal, vulkan or cpu) or, without it, what it finds:
# Metal on Apple Silicon; CUDA where an NVIDIA driver answers (the toolkit's
# nvcc, or NVIDIA's toolkit wheels installed into the venv where there is
# none: a toolkit without a GPU, as on CI, would build for minutes a library
# that cannot load libcuda); else the CPU. A GPU found but not usable means
# the CPU, saying why; where that GPU was asked for, it exits instead. Uses
# what scripts/cuda_toolkit.sh uses (PY, WORK, PIP, say).
. "$(dirname "${BASH_SOURCE[0]}")/cuda_toolkit.sh"

# (A variable: the tests stand in for the driver.)
NVIDIA_DRIVER_FILE=${NVIDIA_DRIVER_FILE:-/proc/driver/nvidia/version}

llama_backend() {
  local asked=${LMSPD_GPU:-} c_flags="" cxx_flags=""
  backend=$asked
  cmake_args=""
  if [ -z "$backend" ]; then
    if [ "$(uname -s)" = Darwin ] && [ "$(uname -m)" = arm64 ]; then backend=metal
    elif [ -e "$NVIDIA_DRIVER_FILE" ] || nvidia-smi -L >/dev/null 2>&1; then backend=cuda
    else backend=cpu
    fi
  fi
  if [ "$backend" = cuda ]; then
    # Libraries the toolkit has only under versioned names, and headers
    # outside it (NVIDIA's wheels), go to CMake through a shim folder in the
    # venv that the built library's RUNPATH names.
    if ! cuda_prepare; then
      llama_backend_no_cuda "$asked" "$cuda_unusable"
    elif ! cuda_libraries; then
      cmake_args=""
      cxx_flags=""
      llama_backend_no_cuda "$asked" "the CUDA toolkit is incomplete (above)"
    fi
  fi
  case "$backend" in
    cpu) if [ "$(uname -s)" = Darwin ]; then cmake_arg -DGGML_METAL=off; fi ;;
    cuda)
      cmake_args="'-DGGML_CUDA=on'${cmake_args:+ $cmake_args}"
      # Which toolkit's major version the build links (libcudart.so.13): a
      # wheel built against another cannot load beside this one.
      backend="cuda$(cuda_nvcc_version | cut -d. -f1)"
      if [ -n "$arch" ]; then cmake_arg "-DCMAKE_CUDA_ARCHITECTURES=$arch"; backend="$backend-sm$arch"; fi ;;
    metal) cmake_arg -DGGML_METAL=on ;;
    vulkan)
      command -v glslc >/dev/null 2>&1 || { say "LMSPD_GPU=vulkan needs the Vulkan SDK (glslc): see README"; exit 1; }
      cmake_arg -DGGML_VULKAN=on ;;
    *) say "LMSPD_GPU must be cuda, metal, vulkan or cpu (not '$backend')"; exit 2 ;;
  esac
  # Without llama.cpp's AMX kernels on x86-64 Linux, whatever the backend
  # (the layers a GPU does not hold run on the CPU): built natively on an AMX
  # CPU by GCC 12 they load a tile configuration whose second half was never
  # written and fault on the first prompt (lmspd/engines/llama/amx.py). The
  # macro is what the kernels are compiled under; the rest of the native
  # build (AVX-512, the repacked kernels) stays. Its own wheel: pip's cache
  # may hold a build with them.
  if [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ]; then
    c_flags="$c_flags -U__AMX_INT8__"
    cxx_flags="$cxx_flags -U__AMX_INT8__"
    backend="$backend-noamx"
  fi
  [ -n "$c_flags" ] && cmake_arg "-DCMAKE_C_FLAGS=${c_flags# }"
  [ -n "$cxx_flags" ] && cmake_arg "-DCMAKE_CXX_FLAGS=${cxx_flags# }"
  return 0
}

# The CUDA found cannot be built for ($2): the CPU instead, saying why; where
# CUDA was asked for ($1), stop.
llama_backend_no_cuda() {
  if [ "$1" = cuda ]; then say "LMSPD_GPU=cuda: $2"; exit 1; fi
  say "an NVIDIA GPU answers, but $2: building for the CPU instead (LMSPD_GPU=cpu skips these checks)"
  backend=cpu
}
