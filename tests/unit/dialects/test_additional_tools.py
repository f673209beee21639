"""Codex's Responses Lite declares its tools in an ``additional_tools`` input
item instead of the top-level ``tools`` (the captured shape:
tests/fixtures/codex/responses_lite_additional_tools.json). lmspd renders
them as if they were ``tools``; one it cannot render is a 400 naming it,
never a tool quietly left out."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from lmspd.core.conversation import CustomTool, FunctionTool, ToolCall
from lmspd.core.limits import DEFAULT_LIMITS, Limits
from lmspd.history import StoredContext
from support.engine import codex_namespaced_calls
from support.inprocess import MODEL, ScriptedEngine, serving
from support.sse import parse_frames

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
    ({"type": "namespace", "name": "ns", "tools": [{"type": "custom", "name": "bad name"}]},
     "input[0].tools[3].tools[0].name", None),
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


# -- calls of a namespace's members ----------------------------------------------------



def named(items: list[dict]) -> list[tuple]:
    return [(i["type"], i["name"], i.get("namespace")) for i in items if i["type"].endswith("call")]


def engine_calls(app) -> list[tuple]:
    return [(i.kind, i.name, i.namespace) for i in app.engine.conversations[-1].items if isinstance(i, ToolCall)]


WIRE = [("custom_tool_call", "apply_patch", "functions"), ("function_call", "exec_command", "functions")]
NEUTRAL = [("custom", "apply_patch", "functions"), ("function", "exec_command", "functions")]
OUTPUTS = [{"type": "custom_tool_call_output", "call_id": "call_p", "output": "Success."},
           {"type": "function_call_output", "call_id": "call_x", "output": "a.txt"}]


def test_namespaced_calls_keep_their_namespace_streamed_stored_and_continued(tmp_path):
    """A custom tool's call from a namespace carries its namespace as a
    function's does (the SDK's ResponseCustomToolCall has the field), in
    every place the call is written and read back."""
    with serving(tmp_path, engine=ScriptedEngine(script=codex_namespaced_calls)) as app:
        r = app.http.post("/v1/responses", json={**lite_request(store=True), "stream": True})
        assert r.status_code == 200, r.text
        events = [f.json() for f in parse_frames(r.text.split("\n")) if f.data != "[DONE]"]
        added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        (completed,) = [e["response"] for e in events if e["type"] == "response.completed"]
        stored = app.http.get(f"/v1/responses/{completed['id']}").json()
        r = app.http.post("/v1/responses", json={"model": MODEL, "previous_response_id": completed["id"],
                                                  "input": OUTPUTS})
        assert r.status_code == 200, r.text
        continued = engine_calls(app)
        # Stateless, as Codex replays: the output items sent back verbatim.
        replay = lite_request(store=True)
        replay["input"] += completed["output"] + OUTPUTS
        r = app.http.post("/v1/responses", json=replay)
        assert r.status_code == 200, r.text
        replayed = engine_calls(app)
        listed = app.http.get(f"/v1/responses/{r.json()['id']}/input_items?order=asc").json()["data"]
    assert named(added) == named(done) == named(completed["output"]) == named(stored["output"]) == WIRE
    assert continued == replayed == NEUTRAL
    assert named(listed) == WIRE


def ws_turn(ws, body: dict) -> dict:
    ws.send_text(json.dumps({"type": "response.create", **body}))
    while (event := json.loads(ws.receive_text()))["type"] != "response.completed":
        assert event["type"] != "error", event
    return event["response"]


def test_a_namespaced_call_in_the_input_is_stored_under_its_own_name(tmp_path):
    """One neutral call whichever way it arrives: sent in the input, read
    back from the store by previous_response_id, or kept by a WebSocket
    connection, the engine gets the member's name and the namespace apart
    (it qualifies them where it renders the call), and input_items lists
    the call as it was sent."""
    tools = [{"type": "namespace", "name": "ns", "description": "d",
              "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]}]
    call = {"type": "function_call", "call_id": "c1", "name": "f", "namespace": "ns", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "res"}
    seen = []
    with serving(tmp_path) as app:
        r = app.http.post("/v1/responses", json={"model": MODEL, "tools": tools,
                                                  "input": [{"role": "user", "content": "hi"}, call, output]})
        assert r.status_code == 200, r.text
        seen.append(engine_calls(app))
        listed = app.http.get(f"/v1/responses/{r.json()['id']}/input_items?order=asc").json()["data"]
        r = app.http.post("/v1/responses", json={"model": MODEL, "tools": tools, "input": "more",
                                                  "previous_response_id": r.json()["id"]})
        assert r.status_code == 200, r.text
        seen.append(engine_calls(app))
        with app.http.websocket_connect("ws://localhost/v1/responses") as ws:
            first = ws_turn(ws, {"model": MODEL, "tools": tools, "store": False,
                                 "input": [{"role": "user", "content": "hi"}, call, output]})
            seen.append(engine_calls(app))
            ws_turn(ws, {"model": MODEL, "tools": tools, "store": False, "input": "more",
                         "previous_response_id": first["id"]})
            seen.append(engine_calls(app))
    assert named(listed) == [("function_call", "f", "ns")]
    assert seen == [[("function", "f", "ns")]] * 4


# -- how many tools -------------------------------------------------------------------

# The fixture declares six tools: four in its "functions" namespace, one
# in "mcp__docs" and the hosted web_search.
DECLARED = 6


def limited(max_tools: int) -> Limits:
    return dataclasses.replace(DEFAULT_LIMITS, request=dataclasses.replace(DEFAULT_LIMITS.request,
                                                                             max_tools=max_tools))


@pytest.mark.parametrize(("max_tools", "param"), [
    # tools[0], then the item's five in its two namespaces: web_search is the seventh.
    (DECLARED, "input[0].tools[2]"),
    # tools[0] and the first three of the item's "functions": its fourth.
    (4, "input[0].tools[0].tools[3]"),
])
def test_every_tool_counts_against_max_tools_wherever_it_is_declared(tmp_path, max_tools, param):
    """A namespace's tools count one by one, and the top-level tools and an
    additional_tools item's share the one limit: the refusal names the
    first tool past it."""
    lookup = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    with serving(tmp_path, limits=limited(max_tools)) as app:
        over = app.http.post("/v1/responses", json=lite_request(tools=[lookup]))
        assert app.engine.generations == 0
    assert over.status_code == 400, over.text
    error = over.json()["error"]
    assert error["param"] == param, error
    assert f"declares {DECLARED + 1} tools; the limit is {max_tools} (max_tools)" in error["message"], error


def test_the_tools_declared_up_to_max_tools_are_accepted(tmp_path):
    with serving(tmp_path, limits=limited(DECLARED)) as app:
        r = app.http.post("/v1/responses", json=lite_request())
        assert r.status_code == 200, r.text
        # The hosted web_search is counted, not offered.
        assert len(app.engine.conversations[-1].tools) == DECLARED - 1


def test_a_namespace_cannot_hold_more_tools_than_max_tools(tmp_path):
    def members(n: int) -> list[dict]:
        return [{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": f"f{i}"}
                                                               for i in range(n)]}]

    with serving(tmp_path, limits=limited(8)) as app:
        fits = app.http.post("/v1/responses", json={"model": MODEL, "input": "hi", "tools": members(8)})
        over = app.http.post("/v1/responses", json={"model": MODEL, "input": "hi", "tools": members(20_000)})
        assert app.engine.generations == 1
    assert fits.status_code == 200, fits.text
    assert len(app.engine.conversations[-1].tools) == 8
    assert over.status_code == 400 and over.json()["error"]["param"] == "tools[0].tools[8]", over.text
    assert "20000 tools" in over.json()["error"]["message"], over.text


def test_a_name_repeated_across_namespaces_and_tools_is_named(tmp_path):
    body = {"model": MODEL, "input": "hi", "tools": [
        {"type": "function", "name": "ns__f"}, {"type": "function", "name": "g"},
        {"type": "namespace", "name": "ns", "tools": [{"type": "custom", "name": "f"}, {"type": "function", "name": "h"}]},
        {"type": "function", "name": "g"}]}
    with serving(tmp_path) as app:
        r = app.http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "Tool names must be unique; repeated: g, ns__f."
