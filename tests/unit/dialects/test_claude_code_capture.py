"""What Claude Code 2.1.332 really sends (captured through `lmspd launch
claude` and tests/fixtures/claude-code/capture_proxy.py): its first request
carries a mid-conversation ``role: "system"`` message, which lmspd refuses
(400, naming it) and Claude Code then resends without it; every request
carries ``context_management: {"edits": [{"type": "clear_thinking_20251015",
"keep": "all"}]}``, an edit that clears nothing, which lmspd accepts. The
main agent's requests carry ``X-Claude-Code-Session-Id`` and no agent id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmspd.core.errors import ApiError
from lmspd.core.limits import RequestLimits
from lmspd.dialects.anthropic_messages import decode_request
from lmspd.dialects.session import agent_lineage, session_key

CAPTURED = Path(__file__).resolve().parents[2] / "fixtures" / "claude-code" / "captured"
LIMITS = RequestLimits()


def captured(status: int) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(CAPTURED.glob(f"*-{status}.json"))]


def test_the_requests_lmspd_answered_decode_with_their_tools_and_context_management():
    accepted = captured(200)
    assert accepted
    for record in accepted:
        assert record["body"]["context_management"] == {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
        req = decode_request(record["body"], LIMITS)
        assert {t.name for t in req.conversation.tools} >= {"Read", "Bash", "Edit", "Write"}
        headers = {k.lower(): v for k, v in record["headers"].items()}
        assert session_key(headers) == headers["x-claude-code-session-id"]
        assert agent_lineage(headers) == (headers["x-claude-code-session-id"], None)


def test_the_refused_first_request_names_its_system_message():
    (record,) = captured(400)
    with pytest.raises(ApiError) as refused:
        decode_request(record["body"], LIMITS)
    assert refused.value.status == 400 and "role" in str(refused.value.param), refused.value
