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
from typing import NamedTuple

from lmspd.core.limits import MAX_SESSION_KEY_CHARS

__all__ = ["SESSION_HEADERS", "AgentLineage", "agent_lineage", "session_key"]

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


class AgentLineage(NamedTuple):
    """Which agent of a session sent a request, and which agent spawned it."""

    agent: str | None
    parent: str | None


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = (headers.get(name) or "").strip()
    return value if 0 < len(value) <= MAX_SESSION_KEY_CHARS else None


def agent_lineage(headers: Mapping[str, str]) -> AgentLineage:
    """The agent and its parent, from what the clients send for subagents.

    Claude Code (2.1.332, read from its binary: the headers are set from the
    request's ``agentId`` / ``parentAgentId``): its main agent sends only
    ``x-claude-code-session-id``; a subagent adds ``x-claude-code-agent-id``
    and, when a subagent spawned it, ``x-claude-code-parent-agent-id``; a
    first-level subagent's parent is the main agent, named by the session id.

    Codex (openai/codex: a spawned agent's requests): ``thread-id`` is the
    agent's own thread, ``session-id`` the root thread's, and a child adds
    ``x-codex-parent-thread-id`` (with ``x-openai-subagent: collab_spawn``).

    An agent without a parent (a main agent) is named by its session, so
    that its children's parent id names it."""
    claude_agent = _header(headers, "x-claude-code-agent-id")
    claude_session = _header(headers, "x-claude-code-session-id")
    if claude_agent is not None:
        return AgentLineage(claude_agent, _header(headers, "x-claude-code-parent-agent-id") or claude_session)
    if claude_session is not None:
        return AgentLineage(claude_session, None)
    codex_thread = _header(headers, "thread-id")
    if codex_thread is not None:
        return AgentLineage(codex_thread, _header(headers, "x-codex-parent-thread-id"))
    return AgentLineage(None, None)
