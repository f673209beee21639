"""The session a request belongs to, from the headers agent clients send.

An agent resends its whole history every turn; a gateway in front of
several providers keeps the turns of one session on one provider by the
session id the client already sends (the upstream engine's routing,
lmspd/engines/upstream/routing.py). The first of these headers present
wins; a body's ``prompt_cache_key`` (Responses, Chat Completions) wins
over all of them:

    x-claude-code-session-id    Claude Code (v2.1.86 on, every request: one UUID per session)
    session-id                  Codex CLI (0.171: the thread id, also in prompt_cache_key)
    session_id                  Codex CLI (older releases, and over WebSocket), pi
    x-session-id                generic gateways and SDK users
    x-session-affinity          generic gateways
    x-opencode-session          OpenCode
    x-codex-turn-state          Codex's sticky-routing token within one turn

The value is only a routing hint: never stored, never echoed, and one
longer than ``MAX_SESSION_KEY_CHARS`` (lmspd.core.limits) is ignored rather than refused (a header
a client always sends must not make a request fail).
"""

from __future__ import annotations

from collections.abc import Mapping

from lmspd.core.limits import MAX_SESSION_KEY_CHARS

__all__ = ["SESSION_HEADERS", "session_key"]

SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "session_id", "x-session-id", "x-session-affinity",
                   "x-opencode-session", "x-codex-turn-state")


def session_key(headers: Mapping[str, str]) -> str | None:
    """The session id among ``headers`` (looked up case-insensitively by a
    Starlette ``Headers``; lower-case names otherwise), or None."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            value = value.strip()
            if 0 < len(value) <= MAX_SESSION_KEY_CHARS:
                return value
    return None
