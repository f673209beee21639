"""The session key agent clients' headers give a request (routing only)."""

from __future__ import annotations

from starlette.datastructures import Headers

from lmspd.core.limits import MAX_SESSION_KEY_CHARS as MAX_SESSION_KEY
from lmspd.dialects.session import SESSION_HEADERS, session_key


def test_each_documented_header_is_a_session_key():
    for name in SESSION_HEADERS:
        assert session_key(Headers(raw=[(name.encode(), b" thread-42 ")])) == "thread-42"


def test_codex_headers_as_captured():
    # Codex CLI 0.171 (tests/fixtures/clients/codex-cli/captured): session-id, plus x-codex-window-id.
    captured = Headers(raw=[(b"session-id", b"01a22807-69a7-7b00-9948-a1f7716bbc8f"),
                            (b"x-codex-window-id", b"01a22807-69a7-7b00-9948-a1f7716bbc8f:0")])
    assert session_key(captured) == "01a22807-69a7-7b00-9948-a1f7716bbc8f"


def test_the_documented_order_wins_not_the_wire_order():
    # ASGI servers hand header names over lower-cased.
    both = Headers(raw=[(b"x-codex-turn-state", b"turn"), (b"session_id", b"sess")])
    assert session_key(both) == "sess", "a session id wins over a turn token"
    assert session_key(Headers(headers={"X-Claude-Code-Session-Id": "cc-1"})) == "cc-1"


def test_absent_empty_or_oversized_is_no_key():
    assert session_key(Headers()) is None
    assert session_key(Headers(raw=[(b"session-id", b"   ")])) is None
    assert session_key(Headers(raw=[(b"session-id", b"x" * (MAX_SESSION_KEY + 1))])) is None
    assert session_key(Headers(raw=[(b"authorization", b"Bearer sk-1")])) is None
