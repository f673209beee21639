"""LMSP 1.0 writes a call as it reads it back, so that a client which sends
the call "as it was received" (seed 004, 6.5) replays exactly the call the
model made: a namespace member's call keeps its ``namespace`` (the model
called ``namespace__name``; the bare name would be another tool, and a
replayed prompt that no longer matches what was generated), and a custom
tool's call stays a ``custom_tool_call`` with its raw ``input``. The shapes
are the OpenAI Responses dialect's, which LMSP's items follow and which
both dialects already read back (``responses_items.decode_items``): in the
output, the stream, a stored response, a task's result and its event log."""

from __future__ import annotations

from lmspd.core.conversation import Conversation, ToolCall, ToolOutput
from lmspd.core.events import Finished, TextDelta, ToolCallDone, ToolCallStarted, Usage
from lmspd.dialects import lmsp
from lmspd.dialects.registry import LMSP
from lmspd.streaming.session import ResponseState, StreamSession
from support.engine import CODEX_PATCH, codex_namespaced_calls
from support.follow import follow, wait_for
from support.inprocess import MODEL, ScriptedEngine, serving
from support.sse import parse_frames
from support.validate import validate_lmsp_stream

TOOLS = [
    {"type": "namespace", "name": "functions", "description": "Codex's tools.",
     "tools": [{"type": "function", "name": "exec_command", "description": "Run a command.",
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]},
    {"type": "function", "name": "get_weather", "description": "The weather.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
]
ASK = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]}]
OUTPUTS = [{"type": "function_call_output", "call_id": "call_x", "output": "a.txt"},
           {"type": "function_call_output", "call_id": "call_w", "output": "sunny"}]

WIRE = [("function_call", "exec_command", "functions"), ("function_call", "get_weather", None)]
NEUTRAL = [("function", "exec_command", "functions"), ("function", "get_weather", None)]


def calls_then_answer(conversation: Conversation) -> list:
    """A namespace member's call (the model wrote ``functions__exec_command``)
    and a plain function's; once the outputs are in, an answer."""
    if any(isinstance(item, ToolOutput) for item in conversation.items):
        return [TextDelta("Done."), Finished("stop", Usage(3, 1))]
    return [ToolCallStarted(0, "call_x", "exec_command", "function", "functions"), ToolCallDone(0, '{"cmd": "ls"}'),
            ToolCallStarted(1, "call_w", "get_weather", "function", None), ToolCallDone(1, '{"city": "Hangzhou"}'),
            Finished("tool_calls", Usage(3, 2))]


def named(items: list[dict]) -> list[tuple]:
    return [(i["type"], i["name"], i.get("namespace")) for i in items if i["type"].endswith("call")]


def engine_calls(app) -> list[tuple]:
    return [(i.kind, i.name, i.namespace) for i in app.engine.conversations[-1].items if isinstance(i, ToolCall)]


def body(**more) -> dict:
    return {"model": MODEL, "input": ASK, "tools": TOOLS, **more}


def test_namespaced_calls_keep_their_namespace_in_every_lmsp_shape(tmp_path):
    with serving(tmp_path, engine=ScriptedEngine(script=calls_then_answer)) as app:
        r = app.http.post("/lmsp/v1/responses", json=body(stream=True, store=True))
        assert r.status_code == 200, r.text
        frames = list(parse_frames(r.text.split("\n")))
        streamed = validate_lmsp_stream(frames)
        added = [f.json()["item"] for f in frames if f.event == "response.output_item.added"]
        response_id = frames[0].json()["response_id"]
        stored = app.http.get(f"/lmsp/v1/responses/{response_id}").json()

        r = app.http.post("/lmsp/v1/responses", json=body(store=True))
        assert r.status_code == 200, r.text
        synchronous = r.json()

        r = app.http.post("/lmsp/v1/tasks", json=body())
        assert r.status_code == 202, r.text
        task_id = r.json()["id"]
        task = wait_for(lambda: (t := app.http.get(f"/lmsp/v1/tasks/{task_id}").json())["finished_at"] and t)
        status, task_frames, _ = follow(app.http, f"/lmsp/v1/tasks/{task_id}/events")
        assert status == 200
        task_streamed = validate_lmsp_stream(task_frames)

        # Continued by previous_response_id: the stored call, as it was made.
        r = app.http.post("/lmsp/v1/responses", json={"model": MODEL, "tools": TOOLS, "input": OUTPUTS,
                                                      "previous_response_id": synchronous["id"]})
        assert r.status_code == 200, r.text
        continued = engine_calls(app)
        # Stateless (seed 004, 6.5): the output items sent back as received.
        r = app.http.post("/lmsp/v1/responses", json=body(input=ASK + synchronous["output"] + OUTPUTS))
        assert r.status_code == 200, r.text
        replayed = engine_calls(app)

    for output in (added, streamed["output"], stored["output"], synchronous["output"], task["result"]["output"],
                   task_streamed["output"]):
        assert named(output) == WIRE, output
        # A call outside any namespace is the seed's function_call, no more.
        assert "namespace" not in output[1]
    assert synchronous["output"][0]["arguments"] == '{"cmd": "ls"}'
    assert continued == replayed == NEUTRAL


CODEX_TOOLS = [{"type": "namespace", "name": "functions", "description": "Codex's tools.", "tools": [
    {"type": "custom", "name": "apply_patch", "description": "Edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'}},
    {"type": "function", "name": "exec_command", "description": "Run a command.",
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]}]
CODEX_OUTPUTS = [{"type": "custom_tool_call_output", "call_id": "call_p", "output": "Success."},
                 {"type": "function_call_output", "call_id": "call_x", "output": "a.txt"}]




def test_a_custom_call_made_over_v1_reads_and_replays_as_one_over_lmsp(tmp_path):
    """LMSP 1.0 declares function tools only, but a response stored over
    /v1 (Codex's freeform apply_patch) is read, and continued, over LMSP
    too: its custom call stays a custom call, with its raw input."""
    with serving(tmp_path, engine=ScriptedEngine(script=codex_namespaced_calls)) as app:
        r = app.http.post("/v1/responses", json={"model": MODEL, "input": ASK, "tools": CODEX_TOOLS, "store": True})
        assert r.status_code == 200, r.text
        response_id = r.json()["id"]
        output = app.http.get(f"/lmsp/v1/responses/{response_id}").json()["output"]
        r = app.http.post("/lmsp/v1/responses", json={"model": MODEL, "input": ASK + output + CODEX_OUTPUTS})
        assert r.status_code == 200, r.text
        replayed = engine_calls(app)
    assert named(output) == [("custom_tool_call", "apply_patch", "functions"),
                             ("function_call", "exec_command", "functions")]
    assert output[0]["input"] == CODEX_PATCH and "arguments" not in output[0]
    assert replayed == [("custom", "apply_patch", "functions"), ("function", "exec_command", "functions")]


def test_a_task_log_cut_off_rebuilds_the_calls_it_made():
    """``state_from_log`` (closing a task's log after a crash) reads back
    what the LMSP encoder wrote: the kind, the namespace and the payload."""
    state = ResponseState(id="resp_1", model="m", created_at=1)
    session = StreamSession(state, LMSP.encoder())
    wires = session.start()
    for event in codex_namespaced_calls(Conversation(model="m", items=[])):
        wires += session.handle(event)
    rebuilt, open_index = lmsp.state_from_log([(name, data) for _, name, data in wires], model="m", created_at=1)

    def calls(items: list) -> list[tuple]:
        return [(i.kind, i.name, i.namespace, i.payload, i.call_id) for i in items if isinstance(i, ToolCall)]

    assert calls(rebuilt.output) == calls(session.state.output) == [
        ("custom", "apply_patch", "functions", CODEX_PATCH, "call_p"),
        ("function", "exec_command", "functions", '{"cmd": "ls"}', "call_x")]
    assert open_index is None


def test_a_compaction_item_made_over_v1_reads_as_one_over_lmsp(tmp_path):
    """A /v1 turn that compacted (its output: the compaction item), read and
    continued over /lmsp/v1: the item is the sealed compaction, as the
    client sends it back, never the summary written out as an assistant
    message (which a replay would render as a turn the model never took)."""
    with serving(tmp_path) as app:
        r = app.http.post("/v1/responses", json={"model": MODEL, "input": [*ASK, {"type": "compaction_trigger"}]})
        assert r.status_code == 200, r.text
        (made,) = r.json()["output"]
        made_id = r.json()["id"]
        assert made["type"] == "compaction"
        lmsp_read = app.http.get(f"/lmsp/v1/responses/{r.json()['id']}", headers={"LMSP-Version": "1.0"})
        assert lmsp_read.status_code == 200, lmsp_read.text
        (item,) = lmsp_read.json()["output"]
        assert item == {"id": made["id"], "type": "compaction", "encrypted_content": made["encrypted_content"]}
        # Sent back over LMSP, it is the item LMSP refuses by name (only /v1 expands one), not a message.
        r = app.http.post("/lmsp/v1/responses", headers={"LMSP-Version": "1.0"}, json={
            "model": MODEL, "input": [item, {"type": "message", "role": "user", "content": "Go on."}]})
        assert r.status_code == 400 and r.json()["param"] == "input[0]" and "compaction" in r.json()["detail"]
        # Continued by its id, the summary reaches the model as the compaction it is.
        r = app.http.post("/lmsp/v1/responses", headers={"LMSP-Version": "1.0"}, json={
            "model": MODEL, "previous_response_id": made_id, "input": "Go on."})
        assert r.status_code == 200, r.text
        assert any(getattr(i, "compaction", None) == made["encrypted_content"]
                   for i in app.engine.conversations[-1].items)


def test_a_tool_lmsp_cannot_offer_is_refused_not_dropped(tmp_path):
    """/v1 drops hosted tools (Codex sends web_search every turn); LMSP 1.0
    declares function tools only, so a hosted or custom tool is a 400
    naming it, never a 200 whose model was not shown the tool. A namespace
    of function tools is taken, as LMSP writes their calls."""
    weather = TOOLS[1]
    with serving(tmp_path) as app:
        for tools, where in (([weather, {"type": "web_search"}], "tools[1].type"),
                             ([{"type": "mcp", "server_label": "x", "server_url": "https://x"}], "tools[0].type"),
                             ([{"type": "custom", "name": "apply_patch"}], "tools[0].type"),
                             (CODEX_TOOLS, "tools[0].type")):
            r = app.http.post("/lmsp/v1/responses", json=body(tools=tools))
            assert r.status_code == 400, (tools, r.text)
            assert r.json()["param"] == where and "must be of type 'function'" in r.json()["detail"], r.text
        r = app.http.post("/lmsp/v1/responses", json=body(tools=TOOLS))
        assert r.status_code == 200, r.text
        assert [t.name for t in app.engine.conversations[-1].tools] == ["functions__exec_command", "get_weather"]
