"""The neighbours of WebSocket mode and compaction that agents use:
``/v1/responses/input_tokens``, ``phase`` on assistant messages, the Codex
model catalog on ``GET /v1/models``, and function tools echoed with every
field of the Open Responses ``FunctionTool``."""

from __future__ import annotations

from support.server import MODEL


def test_input_tokens_counts_what_the_model_sees(http):
    short = http.post("/v1/responses/input_tokens", json={"model": MODEL, "input": "Hello."})
    assert short.status_code == 200, short.text
    body = short.json()
    assert body["object"] == "response.input_tokens" and body["input_tokens"] > 0
    longer = http.post("/v1/responses/input_tokens", json={"model": MODEL, "input": "Hello. " * 50}).json()
    assert longer["input_tokens"] > body["input_tokens"] + 40
    # It is the count a generation reports as input_tokens.
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hello.", "max_output_tokens": 2})
    assert r.json()["usage"]["input_tokens"] == body["input_tokens"]
    # Tools are part of the prompt.
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
    with_tool = http.post("/v1/responses/input_tokens", json={"model": MODEL, "input": "Hello.", "tools": [tool]})
    assert with_tool.json()["input_tokens"] > body["input_tokens"]


def test_input_tokens_refuses_what_create_refuses(http):
    r = http.post("/v1/responses/input_tokens", json={"model": MODEL, "input": "x", "bogus": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"
    r = http.post("/v1/responses/input_tokens", json={"model": "nope", "input": "x"})
    assert r.status_code == 404


def test_phase_is_kept_and_replayed(http):
    items = [{"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant", "phase": "commentary",
              "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "message", "role": "assistant", "phase": "final_answer",
              "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": "Bye"}]
    r = http.post("/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    listed = http.get(f"/v1/responses/{r.json()['id']}/input_items", params={"order": "asc"}).json()["data"]
    assert [i.get("phase") for i in listed] == [None, "commentary", "final_answer", None]


def test_models_carry_the_codex_catalog_with_the_true_context_window(http):
    body = http.get("/v1/models").json()
    # The shared server runs --ctx 4096; LMSP's model list says the same.
    window = http.get("/lmsp/v1/models").json()["data"][0]["context_window"]
    assert window == 4096
    assert body["data"][0]["id"] == MODEL and body["data"][0]["context_window"] == window
    (entry,) = body["models"]
    assert entry["slug"] == MODEL and entry["display_name"] and entry["context_window"] == window
    # The fields Codex's ModelInfo requires, with lmspd's true answers.
    for key in ("supported_reasoning_levels", "shell_type", "visibility", "supported_in_api", "priority",
                "truncation_policy", "supports_parallel_tool_calls", "experimental_supported_tools"):
        assert key in entry


def test_echoed_function_tools_carry_every_field(http):
    bare = {"type": "function", "name": "ping"}
    full = {"type": "function", "name": "pong", "description": "d", "strict": True,
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, "tools": [bare, full]})
    assert r.status_code == 200, r.text
    tools = r.json()["tools"]
    assert tools[0] == {"type": "function", "name": "ping", "description": None, "parameters": None, "strict": None}
    assert tools[1] == full
