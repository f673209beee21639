"""Codex compacts on a socket of its own (remote compaction v2: a new client
session when none is open): the first ``response.create`` of a new
WebSocket ends with ``{"type": "compaction_trigger"}``, in the shape Codex
sends now (Responses Lite: its tools in an ``additional_tools`` input item,
tests/fixtures/codex). The turn completes with exactly one compaction item,
and the socket goes on from it."""

from __future__ import annotations

import json
from pathlib import Path

from support.inprocess import MODEL, serving

FIXTURE = Path(__file__).parents[2] / "fixtures" / "codex" / "responses_lite_additional_tools.json"
TRIGGER = {"type": "compaction_trigger"}
HISTORY = [
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Here they are."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Now compact."}]},
]


def turn(ws, body: dict) -> list[dict]:
    ws.send_text(json.dumps({"type": "response.create", **body}))
    events = []
    while True:
        events.append(json.loads(ws.receive_text()))
        if events[-1]["type"] in ("response.completed", "response.failed", "response.incomplete", "error"):
            return events


def lite(input_tail: list[dict]) -> dict:
    body = json.loads(FIXTURE.read_text())["request"]
    body.pop("stream")
    return {**body, "model": MODEL, "input": body["input"] + input_tail}


def test_a_new_socket_whose_first_turn_is_a_compaction_trigger_completes(tmp_path):
    with serving(tmp_path) as app, app.http.websocket_connect("ws://localhost/v1/responses") as ws:
        events = turn(ws, lite(HISTORY + [TRIGGER]))
        done = events[-1]
        assert done["type"] == "response.completed", done
        assert [i["type"] for i in done["response"]["output"]] == ["compaction"]
        assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"] == ["compaction"]
        # Codex's next turn starts a new chain from the compaction item.
        after = turn(ws, lite([*done["response"]["output"], {"role": "user", "content": "Go on."}]))
        assert after[-1]["type"] == "response.completed", after[-1]
        assert [t.name for t in app.engine.conversations[-1].tools][:1] == ["functions__exec_command"]


def test_a_warmed_socket_compacts_with_the_trigger_alone(tmp_path):
    """Codex warms a new socket (``generate: false``) and then sends only
    what is new: the trigger, continuing the warm-up."""
    with serving(tmp_path) as app, app.http.websocket_connect("ws://localhost/v1/responses") as ws:
        warm = turn(ws, {**lite(HISTORY), "generate": False})[-1]
        assert warm["type"] == "response.completed", warm
        done = turn(ws, {**lite([TRIGGER]), "input": [TRIGGER], "previous_response_id": warm["response"]["id"]})[-1]
        assert done["type"] == "response.completed", done
        assert [i["type"] for i in done["response"]["output"]] == ["compaction"]
