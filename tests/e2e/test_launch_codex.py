"""``lmspd launch codex`` against a server started as ``./dev.sh serve``
starts it (``default_server``), then one real ``codex exec`` turn (the CLI
``./dev.sh test`` installs, as in test_codex_exec.py): Codex finds the
served model in the catalog the launch wrote (no fallback-metadata
warning), the window it records for the turn is the served one, the turn
runs over WebSocket, and the user's own ``~/.codex/config.toml`` is
byte-identical afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx

from support.codex import assert_turn_ended, json_lines
from support.npm import dev_client
from support.server import MODEL

CODEX, pytestmark = dev_client("codex", "LMSPD_CODEX", "the Codex CLI")
# ~5k tokens of prompt on two shared cores: 7 min measured on a loaded machine, 16+ on a busier one.
TURN_TIMEOUT_S = 1800
USER_CONFIG = b'# my own settings\nmodel = "gpt-5.5"\n\n[model_providers.mine]\nname = "mine"\nbase_url = "https://example.invalid/v1"\n'


def test_launch_codex_then_one_exec_turn(default_server, tmp_path):
    home, work, data = tmp_path / "home", tmp_path / "work", tmp_path / "data"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    (home / ".codex" / "config.toml").write_bytes(USER_CONFIG)
    served = httpx.get(default_server.url + "/lmsp/v1/models").json()["data"][0]
    health = httpx.get(default_server.url + "/health").json()
    assert health["models"][MODEL]["context_window"] == served["context_window"]
    before = default_server.log()

    provider = "model_providers.lmspd"
    done = subprocess.run(
        [sys.executable, "-m", "lmspd", "launch", "codex", "--url", default_server.url, "--data-dir", str(data),
         "--bin", str(CODEX), "--", "exec", "--skip-git-repo-check", "--json",
         "-c", 'approval_policy="never"', "-c", 'sandbox_mode="read-only"',
         "-c", f"{provider}.request_max_retries=0", "-c", f"{provider}.stream_max_retries=0",
         "-c", f"{provider}.stream_idle_timeout_ms={TURN_TIMEOUT_S * 1000}",
         "Say hello in one short sentence."],
        cwd=work, env={**os.environ, "HOME": str(home), "LMSPD_API_KEY": "unused-on-loopback"},
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TURN_TIMEOUT_S + 60)
    events = json_lines(done.stdout)
    assert_turn_ended(done, events)
    # Codex reports the fallback as an error item ("Model metadata for `…`
    # not found. Defaulting to fallback metadata; …") and a stderr warning.
    assert not [e for e in events if e.get("item", {}).get("type") == "error"], events
    assert "fallback metadata" not in done.stdout + done.stderr
    assert f"created: {data / 'launch' / 'codex' / 'models.json'}" in done.stderr

    # The window Codex used for the turn: its session log's task_started.
    rollouts = list((home / ".codex" / "sessions").rglob("rollout-*.jsonl"))
    assert rollouts, list(home.rglob("*"))
    windows = [e["payload"].get("model_context_window") for e in json_lines(rollouts[0].read_text())
               if e.get("payload", {}).get("type") == "task_started"]
    assert windows == [served["context_window"]], windows

    new = default_server.log()[len(before):]
    assert re.search(r"websocket connection=ws_\w+ response=resp_\w+ status=(completed|incomplete)", new), new[-3000:]
    assert (home / ".codex" / "config.toml").read_bytes() == USER_CONFIG
