"""Who a run is for and how it runs (``core.run.RunContext``) is built by
the route, once, and reaches the engine beside the decoded conversation:
the credential's owner, the client's session header and agent lineage
(``dialects.session``), a WebSocket connection's pin and ``generate:
false``. Compaction's summary request keeps the turn's owner and session
but neither its pin nor its prefill-only. The conversation itself is
frozen: nothing after the dialect writes to it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lmspd.auth import _owner
from lmspd.core.conversation import Conversation, Message, SessionPin
from lmspd.core.run import RunContext
from support.engine import MODEL
from support.inprocess import serving

KEY = "alice-key"
OWNER = _owner(KEY)
# Claude Code's subagent headers: its session, the agent, the agent that spawned it.
CLAUDE = {"x-claude-code-session-id": "sess-1", "x-claude-code-agent-id": "agent-2",
          "x-claude-code-parent-agent-id": "agent-1"}
LINEAGE = RunContext(owner=OWNER, session_key="sess-1", agent_id="agent-2", parent_agent_id="agent-1")


@pytest.fixture
def app(tmp_path):
    with serving(tmp_path, keys=[KEY], key=KEY) as app:
        yield app


def test_the_responses_routes_hand_the_engine_the_credential_session_and_lineage(app):
    for path in ("/v1/responses", "/lmsp/v1/responses"):
        r = app.http.post(path, json={"model": MODEL, "input": "hi"}, headers=CLAUDE)
        assert r.status_code == 200, r.text
        assert app.engine.runs[-1] == LINEAGE, path


def test_the_message_list_routes_hand_the_engine_the_same(app):
    r = app.http.post("/v1/messages", json={"model": MODEL, "max_tokens": 8,
                                            "messages": [{"role": "user", "content": "hi"}]}, headers=CLAUDE)
    assert r.status_code == 200, r.text
    assert app.engine.runs[-1] == LINEAGE
    # Chat Completions routes by the session alone (no agent lineage).
    r = app.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                      headers=CLAUDE)
    assert r.status_code == 200, r.text
    assert app.engine.runs[-1] == RunContext(owner=OWNER, session_key="sess-1")


def turn(ws, body: dict) -> dict:
    ws.send_text(json.dumps({"type": "response.create", **body}))
    while True:
        event = json.loads(ws.receive_text())
        if event["type"] in ("response.completed", "response.failed", "response.incomplete", "error"):
            return event


def test_a_websocket_turn_carries_its_connection_and_a_compaction_summary_does_not(app):
    with app.http.websocket_connect("ws://localhost/v1/responses", headers=CLAUDE) as ws:
        assert turn(ws, {"model": MODEL, "input": "hi"})["type"] == "response.completed"
        run = app.engine.runs[-1]
        assert isinstance(run.pin, SessionPin) and run.pin.open
        assert dataclasses.replace(run, pin=None) == LINEAGE
        trigger = {"model": MODEL, "input": [{"role": "user", "content": "compact now"},
                                             {"type": "compaction_trigger"}]}
        done = turn(ws, trigger)
        assert done["type"] == "response.completed", done
        # The summary: the turn's owner, session and agent, off the connection.
        assert app.engine.runs[-1] == LINEAGE
    assert not run.pin.open


def test_the_conversation_is_frozen():
    conversation = Conversation(model=MODEL, items=[Message("user", "hi")])
    with pytest.raises(dataclasses.FrozenInstanceError):
        conversation.items = []  # type: ignore[misc]
    assert not hasattr(conversation, "owner"), "who the run is for is the RunContext's"
