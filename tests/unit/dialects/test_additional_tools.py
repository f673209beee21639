"""Codex's Responses Lite declares its tools in an ``additional_tools`` input
item instead of the top-level ``tools`` (the captured shape:
tests/fixtures/codex/responses_lite_additional_tools.json). lmspd renders
them as if they were ``tools``; one it cannot render is a 400 naming it,
never a tool quietly left out."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from lmspd.core.conversation import CustomTool, FunctionTool
from lmspd.history import StoredContext
from support.inprocess import MODEL, serving

FIXTURE = Path(__file__).parents[2] / "fixtures" / "codex" / "responses_lite_additional_tools.json"


def lite_request(**more) -> dict:
    body = copy.deepcopy(json.loads(FIXTURE.read_text())["request"])
    body.update(model=MODEL, stream=False, **more)
    return body


def test_the_additional_tools_item_declares_the_tools(tmp_path):
    with serving(tmp_path) as app:
        r = app.http.post("/v1/responses", json=lite_request())
        assert r.status_code == 200, r.text
        conversation = app.engine.conversations[-1]
    tools = {t.name: t for t in conversation.tools}
    # Namespaced as every namespace tool is (namespace__name); the hosted
    # web_search runs at OpenAI and is left to it, as in 'tools'.
    assert list(tools) == ["functions__exec_command", "functions__update_plan", "functions__apply_patch",
                           "functions__exec", "mcp__docs__search"]
    assert isinstance(tools["functions__exec_command"], FunctionTool)
    assert tools["functions__exec_command"].namespace == "functions"
    assert tools["functions__exec_command"].parameters["required"] == ["cmd"]
    exec_tool = tools["functions__exec"]
    assert isinstance(exec_tool, CustomTool) and exec_tool.grammar["syntax"] == "lark"
    # The item itself is no message: the developer message and the user's remain.
    assert [(i.role, i.text[:10]) for i in conversation.items] == [("developer", "You are Co"),
                                                                   ("user", "List the f")]


def test_forced_choice_can_name_a_tool_the_item_declares(tmp_path):
    body = lite_request()
    body["tool_choice"] = {"type": "function", "name": "functions__exec_command"}
    with serving(tmp_path) as app:
        r = app.http.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        assert app.engine.conversations[-1].tool_choice.allowed == ["functions__exec_command"]


@pytest.mark.parametrize(("tool", "param", "named"), [
    ({"type": "computer_use_2030", "name": "screen"}, "input[0].tools[3].type", "'screen'"),
    ({"type": "namespace", "name": "mcp__fs", "tools": [{"type": "local_shell", "name": "sh"}]},
     "input[0].tools[3].tools[0]", "'sh'"),
    ({"type": "function", "name": "bad name"}, "input[0].tools[3].name", None),
])
def test_a_tool_lmspd_cannot_render_is_a_400_naming_it(tmp_path, tool, param, named):
    body = lite_request()
    body["input"][0]["tools"].append(tool)
    with serving(tmp_path) as app:
        r = app.http.post("/v1/responses", json=body)
        assert app.engine.generations == 0
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if named:
        assert named in error["message"], error


def test_names_are_unique_across_tools_and_the_item(tmp_path):
    body = lite_request()
    body["tools"] = [{"type": "function", "name": "functions__exec_command"}]
    with serving(tmp_path) as app:
        r = app.http.post("/v1/responses", json=body)
    assert r.status_code == 400 and "unique" in r.json()["error"]["message"], r.text


def test_a_websocket_turn_that_sends_only_new_input_keeps_the_tools(tmp_path):
    """Over WebSocket Codex continues its last response with only the new
    items: the additional_tools item is in that response's input, so its
    tools are still declared (and not dropped with the item)."""
    body = lite_request()
    body.pop("stream")
    with serving(tmp_path) as app, app.http.websocket_connect("ws://localhost/v1/responses") as ws:
        ws.send_text(json.dumps({"type": "response.create", **body}))
        while (first := json.loads(ws.receive_text()))["type"] != "response.completed":
            assert first["type"] != "error", first
        ws.send_text(json.dumps({"type": "response.create", "model": MODEL, "store": False,
                                 "previous_response_id": first["response"]["id"],
                                 "input": [{"role": "user", "content": "And the hidden files?"}]}))
        while (second := json.loads(ws.receive_text()))["type"] != "response.completed":
            assert second["type"] != "error", second
        tools = [t.name for t in app.engine.conversations[-1].tools]
    assert tools[:2] == ["functions__exec_command", "functions__update_plan"] and len(tools) == 5


def _continue(app, previous_response_id: str, text: str, **more) -> list[str]:
    """The tools the model is offered on an HTTP turn that sends only new input."""
    r = app.http.post("/v1/responses", json={"model": MODEL, "previous_response_id": previous_response_id,
                                             "input": [{"role": "user", "content": text}], **more})
    assert r.status_code == 200, r.text
    return [t.name for t in app.engine.conversations[-1].tools]


def test_an_http_continuation_keeps_the_tools_through_the_stored_chain(tmp_path):
    """As over WebSocket: the item is part of the stored response's input,
    so a turn that names it by previous_response_id keeps its tools, and so
    does the turn after that one, which declared none of its own."""
    with serving(tmp_path) as app:
        first = app.http.post("/v1/responses", json=lite_request(store=True))
        assert first.status_code == 200, first.text
        listed = app.http.get(f"/v1/responses/{first.json()['id']}/input_items?order=asc").json()["data"]
        second_id = app.http.post("/v1/responses", json={
            "model": MODEL, "previous_response_id": first.json()["id"],
            "input": [{"role": "user", "content": "And the hidden files?"}]}).json()["id"]
        tools = [t.name for t in app.engine.conversations[-1].tools]
        third = _continue(app, second_id, "Sort them by size.")
    assert tools[:2] == ["functions__exec_command", "functions__update_plan"] and len(tools) == 5
    assert third == tools
    assert listed[0]["type"] == "additional_tools"


def test_a_turn_that_declares_its_own_tools_replaces_the_chains(tmp_path):
    with serving(tmp_path) as app:
        first = app.http.post("/v1/responses", json=lite_request(store=True)).json()["id"]
        own = {"type": "additional_tools", "role": "developer",
               "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]}
        r = app.http.post("/v1/responses", json={"model": MODEL, "previous_response_id": first,
                                                  "input": [own, {"role": "user", "content": "Look it up."}]})
        assert r.status_code == 200, r.text
        assert [t.name for t in app.engine.conversations[-1].tools] == ["lookup"]
        assert _continue(app, r.json()["id"], "Again.") == ["lookup"]


def test_a_conversation_keeps_the_tools_of_its_latest_declaration(tmp_path):
    with serving(tmp_path) as app:
        conv = app.http.post("/v1/conversations", json={}).json()["id"]
        body = lite_request(store=True, conversation=conv)
        assert app.http.post("/v1/responses", json=body).status_code == 200
        r = app.http.post("/v1/responses", json={"model": MODEL, "conversation": conv,
                                                  "input": [{"role": "user", "content": "And the hidden files?"}]})
        assert r.status_code == 200, r.text
        tools = [t.name for t in app.engine.conversations[-1].tools]
        # Declared again by the client (the conversation now holds two
        # declarations): the latest one holds, not both (names would repeat).
        assert app.http.post("/v1/responses", json=body).status_code == 200
        r = app.http.post("/v1/responses", json={"model": MODEL, "conversation": conv,
                                                  "input": [{"role": "user", "content": "Sort them."}]})
        assert r.status_code == 200, r.text
        again = [t.name for t in app.engine.conversations[-1].tools]
    assert tools[:2] == ["functions__exec_command", "functions__update_plan"] and len(tools) == 5
    assert again == tools


def test_a_websocket_turn_continuing_an_unstored_response_stores_the_tools_it_keeps(tmp_path):
    """The turn is stored without the store: false response it continued
    (that one is in the connection's memory only), so its record declares
    the tools itself: an HTTP turn continuing it keeps them."""
    body = lite_request()
    body.pop("stream")
    with serving(tmp_path) as app, app.http.websocket_connect("ws://localhost/v1/responses") as ws:
        ws.send_text(json.dumps({"type": "response.create", **body, "store": False}))
        while (first := json.loads(ws.receive_text()))["type"] != "response.completed":
            assert first["type"] != "error", first
        ws.send_text(json.dumps({"type": "response.create", "model": MODEL,
                                 "previous_response_id": first["response"]["id"],
                                 "input": [{"role": "user", "content": "And the hidden files?"}]}))
        while (second := json.loads(ws.receive_text()))["type"] != "response.completed":
            assert second["type"] != "error", second
        over_ws = [t.name for t in app.engine.conversations[-1].tools]
        over_http = _continue(app, second["response"]["id"], "Sort them by size.")
    assert len(over_ws) == 5 and over_http == over_ws


def test_an_additional_tools_item_cannot_be_referenced(tmp_path):
    with serving(tmp_path) as app:
        first = app.http.post("/v1/responses", json=lite_request(store=True)).json()["id"]
        item_id = app.http.get(f"/v1/responses/{first}/input_items?order=asc").json()["data"][0]["id"]
        r = app.http.post("/v1/responses", json={"model": MODEL, "input": [
            {"type": "item_reference", "id": item_id}, {"role": "user", "content": "hi"}]})
        assert app.engine.generations == 1
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0]", r.text


def test_the_store_gives_the_declared_tools_without_the_history_read_first(tmp_path):
    """``declared_tools`` reuses what ``history`` read; asked alone (another
    caller of the StoredContext protocol), it reads the chain itself."""
    declaring = lite_request(store=True)
    with serving(tmp_path) as app:
        first = app.http.post("/v1/responses", json=declaring).json()["id"]
        second = app.http.post("/v1/responses", json={"model": MODEL, "previous_response_id": first,
                                                       "input": "And the hidden files?"}).json()["id"]
        context = StoredContext(app.store, "local")
        declared = context.declared_tools(second, None)
        assert context.declared_tools("resp_gone", None) == []
    assert [tool for _, tool in declared] == declaring["input"][0]["tools"]
    assert declared[0][0] == "previous_response_id[0].tools[0]"
