"""A forced call ends the turn (issue 14), in every dialect.

With ``tool_choice`` required or named and ``parallel_tool_calls`` not
explicitly true, the grammar allows one call and then only end-of-turn: the
bundled model, which otherwise repeats a forced call until the cap, ends a
64-token turn with ``tool_calls`` / ``tool_use`` after one good call
instead of running out of tokens.
"""

from __future__ import annotations

import json

import jsonschema

from support.server import MODEL

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
          "required": ["city"], "additionalProperties": False}
QUESTION = "What's the weather in Paris?"
BUDGET = 64


def test_responses_required(http):
    tool = {"type": "function", "name": "get_weather", "description": "Weather for a city.", "strict": True,
            "parameters": SCHEMA}
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        r = http.post("/v1/responses", json={"model": MODEL, "input": QUESTION, "tools": [tool], "tool_choice": choice,
                                              "temperature": 0, "max_output_tokens": BUDGET})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "completed", body.get("incomplete_details")
        [call] = body["output"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMA)


def test_lmsp_required(http):
    tool = {"type": "function", "name": "get_weather", "description": "Weather for a city.", "parameters": SCHEMA}
    r = http.post("/lmsp/v1/responses", json={"model": MODEL, "input": QUESTION, "tools": [tool],
                                               "tool_choice": "required", "temperature": 0,
                                               "max_output_tokens": BUDGET})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "completed", body
    assert [o["type"] for o in body["output"]] == ["function_call"]


def test_chat_completions_required(http):
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                             "parameters": SCHEMA}}
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
                                                 "tools": [tool], "tool_choice": "required", "temperature": 0,
                                                 "max_tokens": BUDGET})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)


def test_messages_any_and_named(http):
    tool = {"name": "get_weather", "description": "Weather for a city.", "input_schema": SCHEMA}
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": BUDGET, "tools": [tool], "tool_choice": choice,
                                             "messages": [{"role": "user", "content": QUESTION}], "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["stop_reason"] == "tool_use", body
        [use] = [b for b in body["content"] if b["type"] == "tool_use"]
        jsonschema.validate(use["input"], SCHEMA)

# An explicit parallel_tool_calls: true still allows several: test_tools.py::test_parallel_calls_in_one_turn.
