"""Tool calls and structured output on the local engine, end to end (issue 3).

Everything runs against the shared real server with the bundled SmolLM2-135M,
whose chat template has no tool support: lmspd renders tools and calls in its
documented fallback format, and grammars make forced calls and JSON valid by
construction. The model is tiny, so a test that needs a call forces it
(``tool_choice`` required or named); ``auto`` is exercised where the model
answers in text. Every stream goes through the dialect's validator.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from pydantic import BaseModel

from support.clients import CODEX_CAPTURES
from support.server import MODEL
from support.sse import parse_frames
from support.validate import check_openai_response, validate_lmsp_stream, validate_openai_stream

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"timezone": {"type": "string"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city.",
           "strict": True, "parameters": WEATHER_SCHEMA}
TIME = {"type": "function", "name": "get_time", "description": "Get the current time in a timezone.",
        "strict": True, "parameters": TIME_SCHEMA}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
QUESTION = "What's the weather in Paris?"

CODEX_APPLY_PATCH = CODEX_CAPTURES / "gpt-5.5_reasoning_apply_patch" / "001-POST-v1_responses-request.json"
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n"

# Call and result markup of the fallback format (and of Hermes templates).
MARKUP = re.compile(r"</?tool_(call|response)")


# -- helpers ---------------------------------------------------------------------


def stream_openai(http, body: dict) -> tuple[list[dict], dict]:
    """POST /v1/responses with stream: the events and the validated final Response."""
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        frames = list(parse_frames(r.iter_lines()))
    assert frames[-1].data == "[DONE]"
    events = [f.json() for f in frames[:-1]]
    final = validate_openai_stream(events)
    assert_no_markup(final)
    return events, final


def stream_lmsp(http, body: dict) -> dict:
    with http.stream("POST", "/lmsp/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        frames = list(parse_frames(r.iter_lines()))
    summary = validate_lmsp_stream(frames)
    assert_no_markup({"output": summary["output"]})
    return summary


def create_openai(http, body: dict) -> dict:
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    resp = r.json()
    check_openai_response(resp)
    assert_no_markup(resp)
    return resp


def assert_no_markup(resp: dict) -> None:
    """Tool-call markup never reaches the client as text."""
    for item in resp["output"]:
        if item["type"] == "message":
            for part in item["content"]:
                assert not MARKUP.search(part.get("text", "")), f"markup in output_text: {part['text']!r}"


def assert_valid_call(item: dict, names=SCHEMAS) -> dict:
    """A complete function_call whose arguments validate against its tool's schema."""
    assert item["type"] == "function_call", item
    assert item["status"] == "completed"
    assert item["id"].startswith("fc_") and item["call_id"].startswith("call_")
    assert item["name"] in names, item
    args = json.loads(item["arguments"])
    jsonschema.validate(args, names[item["name"]])
    return args


def assert_problem(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert problem["status"] == status and problem["code"] == code
    return problem


def assert_openai_error(r, status: int, code: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def forced(**extra) -> dict:
    return {"model": MODEL, "input": QUESTION, "tools": [WEATHER, TIME], "tool_choice": "required",
            "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 60, **extra}


# -- forced and named calls ------------------------------------------------------------


def test_forced_call_json(http):
    resp = create_openai(http, forced())
    assert resp["status"] == "completed"
    assert resp["tool_choice"] == "required" and resp["parallel_tool_calls"] is False
    assert len(resp["output"]) == 1
    assert_valid_call(resp["output"][0])


def test_forced_call_stream(http):
    events, final = stream_openai(http, forced())
    assert final["status"] == "completed"
    types = [e["type"] for e in events]
    deltas = types.count("response.function_call_arguments.delta")
    assert deltas >= 1
    assert types == (["response.created", "response.in_progress", "response.output_item.added"]
                     + ["response.function_call_arguments.delta"] * deltas
                     + ["response.function_call_arguments.done", "response.output_item.done",
                        "response.completed"]), types
    added, done = events[2], events[-2]
    assert added["item"]["type"] == "function_call" and added["item"]["status"] == "in_progress"
    assert added["item"]["arguments"] == ""
    args_done = events[-3]
    assert args_done["name"] == added["item"]["name"] and args_done["item_id"] == added["item"]["id"]
    assert args_done["arguments"] == done["item"]["arguments"]
    assert_valid_call(done["item"])
    assert final["output"] == [done["item"]]


def test_named_call_streamed_by_the_sdk(openai_client):
    stream = openai_client.responses.create(
        model=MODEL, input=QUESTION, tools=[WEATHER, TIME], tool_choice={"type": "function", "name": "get_time"},
        parallel_tool_calls=False, temperature=0, max_output_tokens=60, stream=True)
    final = validate_openai_stream([e.model_dump(mode="json") for e in stream])
    assert final["status"] == "completed"
    assert [i["type"] for i in final["output"]] == ["function_call"]
    assert final["output"][0]["name"] == "get_time"
    assert_valid_call(final["output"][0])


def test_allowed_tools_required(openai_client):
    resp = openai_client.responses.create(
        model=MODEL, input=QUESTION, tools=[WEATHER, TIME], parallel_tool_calls=False,
        tool_choice={"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]},
        temperature=0, max_output_tokens=60)
    assert resp.status == "completed"
    [call] = resp.output
    assert call.type == "function_call" and call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TIME_SCHEMA)


def test_parallel_calls_in_one_turn(http):
    # A forced call ends the turn unless the request explicitly allows more.
    body = {"model": MODEL, "input": "Get the weather in Paris and in London.", "tools": [WEATHER],
            "tool_choice": "required", "parallel_tool_calls": True, "temperature": 0, "max_output_tokens": 200}
    _, final = stream_openai(http, body)
    calls = final["output"]
    assert final["status"] == "completed", final["incomplete_details"]
    # At most RequestLimits.max_parallel_tool_calls (4); this prompt makes the model use more than one.
    assert 2 <= len(calls) <= 4
    for call in calls:
        assert_valid_call(call)
    assert len({c["call_id"] for c in calls}) == len({c["id"] for c in calls}) == len(calls)


def test_cut_off_call_is_incomplete_not_failed(http):
    """max_output_tokens inside a call's arguments: response.incomplete with the
    call closed as incomplete, never response.failed."""
    events, final = stream_openai(http, forced(max_output_tokens=25))
    assert events[-1]["type"] == "response.incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    [call] = final["output"]
    assert call["type"] == "function_call" and call["status"] == "incomplete"
    assert "response.function_call_arguments.done" not in [e["type"] for e in events]


# -- LMSP -------------------------------------------------------------------------------


def test_lmsp_function_call_arrives_whole(http):
    body = {"model": MODEL, "input": [user(QUESTION)], "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 60}
    summary = stream_lmsp(http, body)
    assert summary["names"] == ["response.created", "response.output_item.added", "response.output_item.done",
                                "response.completed"]
    [call] = summary["output"]
    assert_valid_call({**call, "status": "completed"}, {"get_weather": WEATHER_SCHEMA})
    assert summary["data"]["status"] == "completed"

    # The client runs the tool and replays the full context (LMSP §6.5).
    replay = {**body, "stream": False, "tool_choice": "auto", "max_output_tokens": 16, "input": [
        user(QUESTION), call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": '{"temperature_c": 21}'}]}
    r = http.post("/lmsp/v1/responses", json=replay)
    assert r.status_code == 200, r.text
    assert r.json()["status"] in ("completed", "incomplete")
    assert_no_markup(r.json())


def test_lmsp_response_format_json_schema(http):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                               "population_millions": {"type": "integer"}},
              "required": ["city", "country", "population_millions"], "additionalProperties": False}
    body = {"model": MODEL, "input": "Give facts about Paris as JSON.", "temperature": 0, "max_output_tokens": 80,
            "response_format": {"type": "json_schema", "json_schema": {"name": "city_facts", "schema": schema}}}
    r = http.post("/lmsp/v1/responses", json=body)
    assert r.status_code == 200, r.text
    resp = r.json()
    assert resp["status"] == "completed"
    [message] = resp["output"]
    jsonschema.validate(json.loads(message["content"][0]["text"]), schema)


def test_models_report_tools_and_structured_output(http):
    r = http.get("/lmsp/v1/models")
    assert r.status_code == 200
    [model] = [m for m in r.json()["data"] if m["id"] == MODEL]
    assert model["capabilities"]["tools"] is True
    assert model["capabilities"]["structured_output"] is True


# -- the openai SDK: a tool loop and structured output ---------------------------------


def get_weather(city: str, unit: str) -> str:
    return json.dumps({"city": city, "temperature": 21 if unit == "c" else 70, "unit": unit, "sky": "sunny"})


def test_openai_sdk_tool_loop(openai_client):
    """call -> function_call_output -> final text. The first turn forces the
    call (the tiny model will not reliably choose one); the second is auto."""
    history: list = [{"role": "user", "content": QUESTION}]
    events = [e.model_dump(mode="json") for e in openai_client.responses.create(
        model=MODEL, input=history, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_output_tokens=60, stream=True)]
    first = validate_openai_stream(events)
    [call] = first["output"]
    args = assert_valid_call(call)
    history += [call, {"type": "function_call_output", "call_id": call["call_id"], "output": get_weather(**args)}]

    # Greedy, this model parrots the tool result (markup the engine stops at,
    # leaving no text); a little temperature with a fixed seed answers.
    finals = []
    for seed in (0, 1, 2, 3):
        # Not the SDK's stream helper: its get_final_response() raises on an
        # incomplete response, and 40 tokens may well run out here.
        final = openai_client.responses.create(
            model=MODEL, input=history, tools=[WEATHER], temperature=0.7, max_output_tokens=40,
            extra_body={"extensions": {"lmspd.sampling": {"seed": seed}}})
        assert final.status in ("completed", "incomplete")
        assert not MARKUP.search(final.output_text)
        finals.append(final)
        if final.output_text.strip() and all(i.type == "message" for i in final.output):
            break
    assert final.output_text.strip(), [f.output for f in finals]
    assert final.tool_choice == "auto"


class CityFacts(BaseModel):
    city: str
    country: str
    population_millions: int


def test_responses_parse_text_format(openai_client):
    kwargs = dict(model=MODEL, input="Give facts about Paris.", text_format=CityFacts, temperature=0,
                  max_output_tokens=80)
    resp = openai_client.responses.parse(**kwargs)
    assert resp.status == "completed"
    assert isinstance(resp.output_parsed, CityFacts)
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "CityFacts"

    with openai_client.responses.stream(**kwargs) as stream:
        streamed = stream.get_final_response()
    assert isinstance(streamed.output_parsed, CityFacts)


# -- custom tools ----------------------------------------------------------------------


def custom_events(events: list[dict]) -> tuple[list[str], dict]:
    types = [e["type"] for e in events]
    deltas = types.count("response.custom_tool_call_input.delta")
    assert deltas >= 1
    assert types == (["response.created", "response.in_progress", "response.output_item.added"]
                     + ["response.custom_tool_call_input.delta"] * deltas
                     + ["response.custom_tool_call_input.done", "response.output_item.done", "response.completed"]
                     ), types
    added, done = events[2]["item"], events[-2]["item"]
    assert added["type"] == "custom_tool_call" and added["input"] == "" and added["status"] == "in_progress"
    assert done["status"] == "completed" and done["id"] == added["id"] and done["call_id"].startswith("call_")
    text = "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta")
    assert events[-3]["input"] == text == done["input"]
    return types, done


def test_custom_tool_free_text(http):
    """A free-text custom tool, forced: one call whose input closes. It
    needs the model's own spelling of the forced opening tag (matchers:
    ``_model_spells``); forced into llguidance's canonical tokens, greedy
    decoding looped on ``<tool_name>Hi!</tool_name>`` until the budget ran out."""
    note = {"type": "custom", "name": "note", "description": "Write a short note."}
    body = {"model": MODEL, "input": "Write a note saying hi.", "tools": [note],
            "tool_choice": {"type": "custom", "name": "note"}, "parallel_tool_calls": False,
            "temperature": 0, "max_output_tokens": 60}
    events, final = stream_openai(http, body)
    _, call = custom_events(events)
    assert call["name"] == "note" and "</tool_call>" not in call["input"]


def apply_patch_tool() -> dict:
    body = json.loads(CODEX_APPLY_PATCH.read_text())["body"]
    [tool] = [t for t in body["tools"] if t.get("name") == "apply_patch"]
    assert tool["type"] == "custom" and tool["format"]["syntax"] == "lark"
    return tool


# The apply_patch Lark grammar Codex declares, as a regular expression (it is regular).
_LINE = r"[^\n]*\n"
PATCH_RE = re.compile(
    r"\*\*\* Begin Patch\n(?:"
    rf"\*\*\* Add File: [^\n]+\n(?:\+{_LINE})+"
    r"|\*\*\* Delete File: [^\n]+\n"
    rf"|\*\*\* Update File: [^\n]+\n(?:\*\*\* Move to: [^\n]+\n)?(?:(?:@@|@@ [^\n]+)\n|[-+ ]{_LINE})*"
    r"(?:\*\*\* End of File\n)?"
    r")+\*\*\* End Patch\n?"
)


def test_custom_tool_lark_grammar_apply_patch(http):
    """Codex's apply_patch, a custom tool with a Lark grammar: the input is a
    patch in that grammar; the call replays as custom_tool_call(+_output)."""
    tool = apply_patch_tool()
    body = {"model": MODEL, "instructions": "Call apply_patch with exactly this input:\n" + PATCH,
            "input": "Create hello.txt containing the word hello.", "tools": [tool],
            "tool_choice": {"type": "custom", "name": "apply_patch"}, "parallel_tool_calls": False,
            "temperature": 0, "max_output_tokens": 80}
    events, final = stream_openai(http, body)
    _, call = custom_events(events)
    assert call["name"] == "apply_patch"
    assert PATCH_RE.fullmatch(call["input"]), call["input"]

    replay = {**body, "tool_choice": "auto", "max_output_tokens": 8, "input": [
        user("Create hello.txt containing the word hello."), call,
        {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Exit code: 0\nDone!"}]}
    resp = create_openai(http, replay)
    assert resp["status"] in ("completed", "incomplete")


# -- namespaces, hosted tools, refusals ---------------------------------------------------


def test_namespace_tool_call_carries_namespace(http):
    ns = {"type": "namespace", "name": "weather", "description": "Weather tools.",
          "tools": [{"type": "function", "name": "current", "description": "Current weather for a city.",
                     "strict": True, "parameters": WEATHER_SCHEMA}]}
    body = {"model": MODEL, "input": QUESTION, "tools": [ns, {"type": "web_search"}], "tool_choice": "required",
            "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 60}
    _, final = stream_openai(http, body)
    [call] = final["output"]
    assert call["name"] == "current" and call["namespace"] == "weather"
    assert_valid_call(call, {"current": WEATHER_SCHEMA})

    replay = {**body, "tool_choice": "auto", "max_output_tokens": 8, "input": [
        user(QUESTION), call, {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]}
    assert create_openai(http, replay)["status"] in ("completed", "incomplete")


def test_codex_lite_additional_tools_are_offered_and_called(http):
    """Codex's Responses Lite request (its tools in an ``additional_tools``
    input item, the top-level ``tools`` unset): the model is offered them
    and a forced call is one of them, namespaced as Codex declared it."""
    capture = Path(__file__).parents[1] / "fixtures" / "codex" / "responses_lite_additional_tools.json"
    body = {**json.loads(capture.read_text())["request"], "model": MODEL, "temperature": 0,
            "max_output_tokens": 60, "tool_choice": {"type": "function", "name": "functions__exec_command"}}
    _, final = stream_openai(http, body)
    [call] = final["output"]
    assert call["type"] == "function_call" and call["namespace"] == "functions" and call["name"] == "exec_command"
    assert "cmd" in json.loads(call["arguments"])


def test_tool_choice_none_and_auto_never_leak_markup(http):
    """Greedy, the model answers a tool result by writing one itself; the
    engine stops there (auto and none alike), so no markup is ever text."""
    history = [user(QUESTION),
               {"type": "function_call", "call_id": "call_w1", "name": "get_weather",
                "arguments": '{"city": "Paris", "unit": "c"}'},
               {"type": "function_call_output", "call_id": "call_w1", "output": "Sunny, 21 C"}]
    for choice in ("auto", "none"):
        events, final = stream_openai(http, {"model": MODEL, "input": history, "tools": [WEATHER],
                                             "tool_choice": choice, "temperature": 0, "max_output_tokens": 40})
        assert final["status"] == "completed", choice
        assert all(i["type"] == "message" for i in final["output"]), choice
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert not MARKUP.search(text)


def test_unknown_call_id_rejected(server, http):
    before = server.generations()
    body = {"model": MODEL, "tools": [WEATHER], "input": [
        user(QUESTION),
        {"type": "function_call", "call_id": "call_known", "name": "get_weather",
         "arguments": '{"city": "Paris", "unit": "c"}'},
        {"type": "function_call_output", "call_id": "call_known", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_never_made", "output": "sunny"}]}
    err = assert_openai_error(http.post("/v1/responses", json=body), 400, "invalid_request", "input[3].call_id")
    assert "call_never_made" in err["message"] and "full history" in err["message"]
    problem = assert_problem(http.post("/lmsp/v1/responses", json=body), 400, "invalid_request")
    assert "call_never_made" in problem["detail"]
    assert server.generations() == before


def test_unenforceable_schema_keyword_is_named(server, http):
    before = server.generations()
    # (multipleOf, refused before llguidance, is enforced now: uniqueItems is not.)
    schema = {"type": "object", "properties": {"n": {"type": "array", "uniqueItems": True}}, "required": ["n"]}
    err = assert_openai_error(
        http.post("/v1/responses", json={"model": MODEL, "input": "A number.", "text": {"format": {
            "type": "json_schema", "name": "n", "schema": schema}}}),
        400, "unsupported_capability", "text.format.schema.properties.n.uniqueItems")
    assert "'uniqueItems'" in err["message"]

    problem = assert_problem(
        http.post("/lmsp/v1/responses", json={"model": MODEL, "input": "A number.", "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}),
        400, "unsupported_capability")
    assert "'uniqueItems'" in problem["detail"]
    assert problem["param"] == "response_format.json_schema.schema.properties.n.uniqueItems"

    # A strict tool's parameters are enforced too; what cannot be is refused.
    tool = {**WEATHER, "parameters": {**WEATHER_SCHEMA, "properties": {
        "city": {"type": "string", "not": {"const": "Atlantis"}}, "unit": {"type": "string"}}}}
    err = assert_openai_error(
        http.post("/v1/responses", json={"model": MODEL, "input": QUESTION, "tools": [tool],
                                          "tool_choice": "required"}),
        400, "unsupported_capability")
    assert "'not'" in err["message"] and "get_weather" in err["param"]
    assert server.generations() == before


def test_forcing_a_hosted_tool_is_unsupported(server, http):
    before = server.generations()
    for path in ("/v1/responses", "/lmsp/v1/responses"):
        r = http.post(path, json={"model": MODEL, "input": "Search the web.", "tools": [{"type": "web_search"}],
                                  "tool_choice": {"type": "web_search"}})
        if path == "/v1/responses":
            err = assert_openai_error(r, 400, "unsupported_capability", "tool_choice")
            assert "web_search" in err["message"]
        else:
            # LMSP declares function tools only: the hosted tool itself is refused.
            problem = assert_problem(r, 400, "invalid_request")
            assert problem["param"] == "tools[0].type" and "web_search" in problem["detail"]
            r = http.post(path, json={"model": MODEL, "input": "Search the web.", "tools": [WEATHER],
                                      "tool_choice": {"type": "web_search"}})
            assert "web_search" in assert_problem(r, 400, "unsupported_capability")["detail"]
    assert server.generations() == before


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_hosted_tools_alone_cannot_be_required(http, choice):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}],
                                         "tool_choice": choice})
    assert_openai_error(r, 400, "invalid_request")
