#!/usr/bin/env bash
# The GPU check, in one command, for a bare GPU machine with no network:
#     bash bench/gpu/run.sh                      # CUDA, a Llama-3.1-8B-shaped model
#     bash bench/gpu/run.sh --backend cpu --shape tiny   # the same steps on a CPU, in minutes
# Needs bench/gpu/payload/ (made by bench/gpu/pack.sh where PyPI is reachable),
# python3 (3.12 for the payload's wheels) with numpy, scikit-build-core, cmake
# and ninja; CUDA: nvcc and nvidia-smi. Steps: install the carried wheels into
# a private site folder, build llama-cpp-python from the slim source for this
# GPU's architecture only, write a synthetic GGUF, then run bench/overhead.py
# (lmspd through HTTP against llama-cpp-python in-process on the same build)
# bench/concurrency.py (4 streams at once against 1) and bench/backend_sampling.py
# (the greedy pick in llama.cpp's graph against lmspd's on the host), and print
# a summary.
# Results and logs go to $OUT (or $LMSPD_GPU_WORK/results).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
backend=cuda
shape=llama3.1-8b
quick=0
arch=""
cap=""
build_only=0
portable=0
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) backend=$2; shift 2 ;;
    --shape) shape=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    # The CUDA architecture to build for (90: H100, H200), instead of asking nvidia-smi.
    --arch) arch=$2; shift 2 ;;
    # Build, and stop: what pack.sh --prebuild does on a machine without a GPU.
    --build-only) build_only=1; shift ;;
    # CPU code for any x86-64 with AVX2, not for this CPU: a build carried to another machine.
    --portable) portable=1; shift ;;
    *) echo "usage: run.sh [--backend cuda|cpu] [--shape llama3.1-8b|tiny] [--quick] [--arch N] [--build-only] [--portable]" >&2
       exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
PAYLOAD=$ROOT/bench/gpu/payload
WORK=${LMSPD_GPU_WORK:-/tmp/lmspd-gpu}
RESULTS=${OUT:-$WORK/results}
mkdir -p "$WORK" "$RESULTS"
exec > >(tee -a "$RESULTS/run.log") 2>&1
start=$SECONDS
say() { printf '[gpu %4ds] %s\n' "$((SECONDS - start))" "$*"; }
[ -d "$PAYLOAD" ] || { say "no $PAYLOAD: run bench/gpu/pack.sh first (where PyPI is reachable)"; exit 2; }

SITE=$WORK/site
if [ "${LMSPD_GPU_SKIP_WHEELS:-0}" != 1 ]; then
  say "installing $(ls "$PAYLOAD"/wheels/*.whl | wc -l) carried wheels into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$PAYLOAD"/wheels/*.whl
fi

SRC=$WORK/src
if [ ! -d "$SRC" ]; then
  mkdir -p "$SRC" && tar xJf "$PAYLOAD/llama-cpp-python-src.tar.xz" -C "$SRC" --strip-components 1
fi
# Finding the CUDA toolkit's parts, wherever it was installed from.
. "$ROOT/scripts/cuda_toolkit.sh"
cmake_args="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
c_flags=""
cxx_flags=""
case "$backend" in
  cuda)
    cuda_find_nvcc  # (as ./dev.sh looks for it)
    if [ -n "$arch" ]; then
      cap=$arch
      say "CUDA architecture $cap as asked; $(nvcc --version | tail -1)"
    else
      cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
      say "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1); $(nvcc --version | tail -1)"
    fi
    cmake_args="$cmake_args -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$cap"
    runtime_path=$(cuda_runtime_path)
    [ -n "$runtime_path" ] && export LD_LIBRARY_PATH=$runtime_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    cuda_libraries ;;
  cpu) cmake_args="$cmake_args -DGGML_CUDA=off" ;;
  *) say "unknown backend $backend"; exit 2 ;;
esac
# Without llama.cpp's AMX kernels, as ./dev.sh builds it (the layers on the
# CPU would fault on an AMX host: lmspd/engines/llama/amx.py).
if [ "$(uname -m)" = x86_64 ]; then
  c_flags="$c_flags -U__AMX_INT8__"
  cxx_flags="$cxx_flags -U__AMX_INT8__"
  # (Portable builds are carried: nvcc's own fatbin compression off, since xz
  # packs the library to 30 MB without it and to 41 MB with it.)
  [ "$portable" = 1 ] && cmake_args="$cmake_args -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_CUDA_COMPRESSION_MODE=none"
fi
# A build made elsewhere for this backend and architecture (pack.sh --prebuild):
# used if it loads here (the check below), else built again.
prebuilt=$PAYLOAD/llama-cpp-python-$backend${cap:+-sm$cap}.tar.xz
if [ "$build_only" = 0 ] && [ -f "$prebuilt" ] && [ ! -d "$SITE/llama_cpp" ]; then
  say "unpacking $(basename "$prebuilt") into $SITE"
  mkdir -p "$SITE" && tar xJf "$prebuilt" -C "$SITE"
fi
[ -n "$c_flags" ] && cmake_arg "-DCMAKE_C_FLAGS=${c_flags# }"
[ -n "$cxx_flags" ] && cmake_arg "-DCMAKE_CXX_FLAGS=${cxx_flags# }"
# Built already: for this backend (and CUDA architecture), and without AMX
# kernels (not, say, a llama-cpp-python that an earlier pip install left
# there). Read from the build's own features, which a CUDA build lists
# without a GPU too (--build-only on a machine without one).
if ! PYTHONPATH=$SITE "$PY" -c "import llama_cpp, sys
info = llama_cpp.llama_print_system_info()
ok = (b'CUDA : ARCHS = ${cap}0' in info) if '$backend' == 'cuda' else b'CUDA : ' not in info
sys.exit(0 if ok and b'AMX_INT8 = 1' not in info else 1)" 2>/dev/null; then
  say "building llama-cpp-python ($backend; $cmake_args) with $(nproc) jobs"
  export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
  set +e
  CMAKE_ARGS="$cmake_args" "$PY" -m pip install -v --no-index --no-deps --no-build-isolation --no-compile \
      --upgrade --target "$SITE" -C "build-dir=$WORK/build-$backend" "$SRC" > "$WORK/build.log" 2>&1 &
  pid=$!
  last=""
  while kill -0 "$pid" 2>/dev/null; do
    sleep 15
    now=$(grep -aoE '\[[0-9]+/[0-9]+\]' "$WORK/build.log" | tail -1)
    [ "$now" != "$last" ] && say "compiling llama.cpp $now" && last=$now
  done
  wait "$pid"; rc=$?
  set -e
  cp "$WORK/build.log" "$RESULTS/build.log" 2>/dev/null || true
  if [ "$rc" -ne 0 ]; then tail -40 "$WORK/build.log"; say "build failed (rc=$rc)"; exit 1; fi
fi
if [ "$build_only" = 1 ]; then
  for lib in "$SITE"/llama_cpp/lib/*.so; do
    say "built $(basename "$lib") ($(du -h "$lib" | cut -f1)), needs: $(readelf -d "$lib" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
  done
  exit 0
fi
export PYTHONPATH=$SITE:$ROOT
"$PY" -c "import llama_cpp; print('[gpu] llama-cpp-python', llama_cpp.__version__, 'gpu offload:', llama_cpp.llama_supports_gpu_offload())"

MODEL=$WORK/synthetic-$shape.gguf
if [ ! -f "$MODEL" ]; then
  say "writing a synthetic $shape GGUF"
  "$PY" bench/gpu/synth_gguf.py write --src "$SRC/vendor/llama.cpp/gguf-py" \
    --tokenizer "$PAYLOAD/tokenizer.json.gz" --shape "$shape" --out "$MODEL"
fi

threads=$(( $(nproc) > 8 ? 8 : $(nproc) ))
place=(--gpu-layers all --flash-attn on)
[ "$backend" = cpu ] && place=(--gpu-layers 0 --flash-attn off)
reps=6; tokens=64; [ "$quick" = 1 ] && reps=2 && tokens=32

say "bench/overhead.py: lmspd over HTTP against llama-cpp-python in-process"
timeout 170 "$PY" bench/overhead.py --model "$MODEL" --systems lmspd,in-process --threads "$threads" --ctx 4096 \
  --reps "$reps" --max-tokens "$tokens" "${place[@]}" --json "$RESULTS/overhead.json" \
  || say "overhead.py ended with $?"

say "bench/concurrency.py: 4 streams at once (--parallel 4) against one (--parallel 1)"
timeout 130 "$PY" bench/concurrency.py --model "$MODEL" --systems lmspd-p4,lmspd-p1 --scenarios decode,short \
  --threads "$threads" --ctx 4096 --decode-tokens 128 "${place[@]}" --json "$RESULTS/concurrency.json" \
  || say "concurrency.py ended with $?"

say "bench/backend_sampling.py: the greedy pick in llama.cpp's graph against lmspd's on the host"
timeout 90 "$PY" bench/backend_sampling.py --model "$MODEL" --threads "$threads" --parallel 4,16 \
  --gpu-layers "${place[1]}" 2>&1 | grep -v '^llama_context' | tee "$RESULTS/backend_sampling.txt" \
  || say "backend_sampling.py ended with $?"

if [ -f bench/speculative.py ] && [ -n "${LMSPD_GPU_SPECULATIVE:-}" ]; then
  say "bench/speculative.py $LMSPD_GPU_SPECULATIVE"
  # shellcheck disable=SC2086
  timeout 110 "$PY" bench/speculative.py --model "$MODEL" --threads "$threads" "${place[@]}" $LMSPD_GPU_SPECULATIVE \
    || say "speculative.py ended with $?"
fi

"$PY" bench/gpu/summary.py "$RESULTS" || true
say "done"
