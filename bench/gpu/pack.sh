#!/usr/bin/env bash
# Packs what bench/gpu/run.sh needs on a bare GPU machine with no network into
# bench/gpu/payload/ (git-ignored, ~30 MiB): a slim copy of the llama.cpp source
# that llama-cpp-python 0.3.36 vendors, wheels of lmspd's dependencies for
# CPython 3.12 (manylinux x86-64), and the bundled model's tokenizer and chat
# template. Run it here, where PyPI is reachable:
#     bash bench/gpu/pack.sh
#     bash bench/gpu/pack.sh --prebuild-cuda 90   # and llama-cpp-python built for sm_90 (H100, H200)
# --prebuild-cuda ARCH also builds llama-cpp-python here, with CUDA for that
# architecture and CPU code for any x86-64 with AVX2 (run.sh --build-only
# --portable), so that the GPU machine skips its build, minutes of its time
# (run.sh uses the build if it loads there, else builds). It needs nvcc on
# PATH (NVIDIA's wheels will do: pip install
# "cuda-toolkit[nvcc,cudart,cublas,cccl,crt]==13.0.*", then
# PATH=.../site-packages/nvidia/cu13/bin:$PATH) and a Python with
# scikit-build-core, cmake and ninja (BUILD_PYTHON, default PYTHON); no GPU.
# Its build folder is $LMSPD_GPU_WORK if set (kept: a second run rebuilds
# only what changed).
set -euo pipefail
prebuild=""
while [ $# -gt 0 ]; do
  case "$1" in
    --prebuild-cuda) prebuild=$2; shift 2 ;;
    *) echo "usage: pack.sh [--prebuild-cuda ARCH]" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")"
ROOT=$(cd ../.. && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
LLAMA_CPP_PYTHON=llama-cpp-python==0.3.36
OUT=payload
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
rm -rf "$OUT" && mkdir -p "$OUT/wheels"

say() { printf '[gpu-pack] %s\n' "$*" >&2; }

# 1. The source: the sdist is 73 MiB, mostly what a CUDA build never reads
# (vocab test GGUFs, docs, the web UI, other backends).
say "slimming the $LLAMA_CPP_PYTHON source"
"$PY" -m pip download -q --no-deps --no-binary :all: "$LLAMA_CPP_PYTHON" -d "$TMP" 2>/dev/null
tar xzf "$TMP"/llama_cpp_python-*.tar.gz -C "$TMP"
SRC=$(echo "$TMP"/llama_cpp_python-*/)
V="$SRC/vendor/llama.cpp"
rm -rf "$SRC/.git" "$SRC/docs" "$SRC/examples" "$SRC/tests" "$SRC/docker" \
  "$V/models" "$V/docs" "$V/media" "$V/benches" "$V/tests" "$V/examples" "$V/scripts" \
  "$V/conversion" "$V/.devops" "$V/.github" "$V/grammars" "$V/prompts" "$V/requirements" \
  "$V/pocs" "$V/licenses"
# tools/: only mtmd is built (llama-cpp-python's LLAVA_BUILD), the rest is never added.
find "$V/tools" -mindepth 1 -maxdepth 1 ! -name mtmd ! -name CMakeLists.txt -exec rm -rf {} +
for b in sycl opencl hexagon et vulkan metal cann musa hip webgpu zdnn openvino virtgpu zendnn blas rpc; do
  rm -rf "$V/ggml/src/ggml-$b"
done
tar -C "$TMP" -cJf "$OUT/llama-cpp-python-src.tar.xz" "$(basename "$SRC")"

# 2. lmspd's runtime dependencies, for the GPU machine's Python 3.12 (it has
# numpy, scikit-build-core, cmake and ninja; nothing can be installed there).
say "downloading wheels for CPython 3.12"
plat=""
for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  plat="$plat --platform $p"
done
# The pins of pyproject.toml, plus llama-cpp-python's own needs (diskcache).
pins=$("$PY" - <<'PYEOF'
import tomllib, pathlib
deps = tomllib.loads(pathlib.Path("../../pyproject.toml").read_text())["project"]["dependencies"]
print(" ".join(d for d in deps if not d.startswith("llama-cpp-python")))
PYEOF
)
# shellcheck disable=SC2086
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp $plat \
  -d "$OUT/wheels" $pins httpx==0.28.1 diskcache==5.6.3 2>/dev/null
rm -f "$OUT"/wheels/numpy-*.whl

# 3. The bundled model's tokenizer and chat template (a few MB of JSON rather
# than its 85 MB GGUF): the synthetic model speaks the same tokens.
say "extracting the bundled model's tokenizer"
"$PY" "$ROOT/bench/gpu/synth_gguf.py" extract-tokenizer --src "$V/gguf-py" --out "$OUT/tokenizer.json.gz"

# 4. The engine built here for the GPU machine's architecture (--prebuild-cuda).
if [ -n "$prebuild" ]; then
  work=${LMSPD_GPU_WORK:-$TMP/prebuild}
  say "building llama-cpp-python for CUDA sm_$prebuild (portable CPU code) in $work: ~20 minutes on 2 cores"
  OUT="$work/results" PYTHON="${BUILD_PYTHON:-$PY}" LMSPD_GPU_WORK="$work" LMSPD_GPU_SKIP_WHEELS=1 \
    bash run.sh --build-only --arch "$prebuild" --portable >&2
  # pip installs each library three times (libX.so, .so.0, .so.0.N.M): one
  # file and two links in the tarball.
  rm -rf "$TMP/prebuilt" && mkdir -p "$TMP/prebuilt" && cp -a "$work/site/llama_cpp" "$TMP/prebuilt/"
  for f in "$TMP"/prebuilt/llama_cpp/lib/*.so.*.*; do
    base=${f%%.so.*}
    for alias in "$base.so" "$base.so.0"; do
      [ "$alias" != "$f" ] && [ -f "$alias" ] && cmp -s "$alias" "$f" && ln -sf "$(basename "$f")" "$alias"
    done
  done
  tar -C "$TMP/prebuilt" -cJf "$OUT/llama-cpp-python-cuda-sm$prebuild.tar.xz" llama_cpp
fi

# (One du each: du counts a folder it has been through once.)
du -sh "$OUT"/* >&2
du -sh "$OUT" >&2
say "done: bench/gpu/payload (carry it to the GPU machine; run: bash bench/gpu/run.sh)"
