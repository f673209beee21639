"""What Claude Code 2.1.332 really sends (captured through `lmspd launch
claude` and tests/fixtures/claude-code/capture_proxy.py): its first request,
sent with the ``mid-conversation-tool-changes-2026-07-01`` beta, carries a
mid-conversation ``role: "system"`` message (SDK 2.10's SystemMessageParam),
which lmspd once refused (the capture's 400; Claude Code then resent it
without the beta, wasting every session's first request) and now accepts as
a neutral system message at its position; every request carries
``context_management: {"edits": [{"type": "clear_thinking_20251015",
"keep": "all"}]}``, an edit that clears nothing, which lmspd accepts. The
main agent's requests carry ``X-Claude-Code-Session-Id`` and no agent id."""

from __future__ import annotations

import json
from pathlib import Path

from lmspd.core.conversation import Message
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


def test_the_first_request_with_its_mid_conversation_system_message_is_accepted():
    (record,) = captured(400)
    assert "mid-conversation-tool-changes-2026-07-01" in record["headers"]["anthropic-beta"]
    body = record["body"]
    assert [m["role"] for m in body["messages"]] == ["user", "system"]
    req = decode_request(body, LIMITS)
    items = req.conversation.items
    # The user's turn, then the system text as a system message where it was sent.
    assert [type(i) for i in items] == [Message, Message]
    assert [i.role for i in items if isinstance(i, Message)] == ["user", "system"]
    (block,) = body["messages"][1]["content"]
    system = items[1]
    assert isinstance(system, Message) and system.text == block["text"]
    # Its cache_control block is a breakpoint at the end of its text, as on a user message.
    assert block.get("cache_control") is not None and system.breakpoints == (len(block["text"]),)
    assert req.item_paths == ["messages[0].content[0]", "messages[1].content[0]"]
    assert {t.name for t in req.conversation.tools} >= {"Read", "Bash", "Edit", "Write", "ToolSearch"}
