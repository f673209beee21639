"""How a ``codex exec --json`` turn against the bundled model may end, and
how a client's JSON-lines output is read."""

from __future__ import annotations

import json
import subprocess
from typing import Any

# Codex's report of a response that ended incomplete: lmspd's output
# ceiling or its repetition guard (OpenAI Responses names both
# max_output_tokens).
CAPPED = "Incomplete response returned, reason: max_output_tokens"


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects of a client's JSON-lines output (``codex exec
    --json``, Claude Code's ``stream-json``, Codex's session logs). Lines end
    at ``\\n`` only: ``str.splitlines`` also splits at U+0085, U+2028 and
    U+2029, which JSON writers leave unescaped inside strings, so a model
    that writes one of them would cut its own event in two."""
    return [json.loads(line) for line in text.split("\n") if line.startswith("{")]


def assert_turn_ended(done: subprocess.CompletedProcess[str], events: list[dict[str, Any]]) -> None:
    """The turn ran end to end: the model's answer reached Codex as an
    agent message, and the turn completed — or Codex reported only that the
    answer was cut. The bundled 135M model, at the sampling Codex leaves to
    the server, now and then writes on until the repetition guard or the
    server's output ceiling ends it (tests/conftest.py: default_server); how
    long it writes is not what these tests are about. Any other error fails."""
    context = (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    kinds = [e["type"] for e in events]
    replies = [e["item"] for e in events if e["type"] == "item.completed" and e["item"].get("type") == "agent_message"]
    assert replies and any(r.get("text", "").strip() for r in replies), context
    errors = [e["message"] for e in events if e["type"] == "error"]
    errors += [e["error"]["message"] for e in events if e["type"] == "turn.failed"]
    if done.returncode == 0:
        assert "turn.completed" in kinds and not errors, context
    else:
        assert "turn.failed" in kinds and errors and all(m == CAPPED for m in errors), context
