"""The Codex CLI itself (``codex exec``, the version ../shared/clients
captured) against a server started with the defaults ``./dev.sh serve``
gives it, but for an output ceiling (``default_server``, tests/conftest.py,
shared with the other Codex tests): one turn over HTTP, then one with the
provider's WebSocket transport on, asserting from the server log which
transport carried it.

The CLI comes from npm (``./dev.sh test`` installs it into ``.tools/codex``
when npm is there; ``LMSPD_CODEX`` names another binary). The model is the
bundled 135M one, so what it says is not checked: only that Codex's turn
completes with a reply. Its shell runs read-only in a scratch directory,
in case the model calls a tool.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from support.codex import assert_turn_ended, json_lines
from support.npm import dev_client
from support.server import MODEL, ServerProcess

CODEX, pytestmark = dev_client("codex", "LMSPD_CODEX", "the Codex CLI")
# Codex's first request is ~9k tokens, prefilled on two CPU cores.
TURN_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def codex_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """One CODEX_HOME and one working directory for both runs. Codex writes
    their paths into its prompt (the skill roots, the cwd), so with the same
    ones the second run's prompt is the first one's up to the user's message
    and continues from the first run's KV on the shared ``default_server``
    instead of prefilling ~9k tokens again. Each run still starts Codex
    afresh (``--ephemeral``: no session is kept) with its own config."""
    root = tmp_path_factory.mktemp("codex")
    home, work = root / "codex-home", root / "work"
    home.mkdir()
    work.mkdir()
    return home, work


def codex_exec(server: ServerProcess, dirs: tuple[Path, Path], *, websockets: bool) -> list[dict]:
    home, work = dirs
    (home / "config.toml").write_text(f"""
model = "{MODEL}"
model_provider = "lmspd"
approval_policy = "never"
sandbox_mode = "read-only"

[model_providers.lmspd]
name = "lmspd"
base_url = "{server.url}/v1"
env_key = "LMSPD_API_KEY"
wire_api = "responses"
supports_websockets = {str(websockets).lower()}
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {TURN_TIMEOUT_S * 1000}
""")
    env = {**os.environ, "CODEX_HOME": str(home), "LMSPD_API_KEY": "unused-on-loopback"}
    done = subprocess.run(
        [str(CODEX), "exec", "--skip-git-repo-check", "--json", "--ephemeral", "Say hello in one short sentence."],
        cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TURN_TIMEOUT_S + 60)
    events = json_lines(done.stdout)
    assert_turn_ended(done, events)
    return events


def test_codex_exec_over_http(default_server, codex_dirs):
    before = default_server.log()
    codex_exec(default_server, codex_dirs, websockets=False)
    new = default_server.log()[len(before):]
    assert re.search(r"generation response=resp_\w+ seq=\d+ cache_source=", new), new[-3000:]
    assert "websocket connection=" not in new


def test_codex_exec_over_websocket(default_server, codex_dirs):
    before = default_server.log()
    codex_exec(default_server, codex_dirs, websockets=True)
    new = default_server.log()[len(before):]
    assert re.search(r"websocket connection=ws_\w+ response=resp_\w+ status=(completed|incomplete)", new), new[-3000:]
    # Codex warms up first (generate: false, its instructions and tools) and
    # gives up on it after 15 s, opening another connection for the turn.
    # The prompt is held from the run over HTTP, so the warm-up ends at once
    # ("prefill_only already held") and the turn continues it...
    assert re.search(r"websocket connection=ws_\w+ response=resp_\w+ status=(completed|incomplete) continued=True",
                     new), new[-3000:]
    # ...reusing the whole prompt the HTTP run left, not only the warm-up's
    # part of it (~3.8k of ~9k tokens: a minute of prefill on CPU).
    turns = re.findall(r"generation response=\S+ seq=\d+ cache_source=.* prefilled=(\d+) (?!.*prefill_only)", new)
    assert turns and int(turns[0]) < 1000, new[-3000:]
