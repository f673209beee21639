"""What the installed openai SDK lets a client send is not refused as an
unknown parameter or an invalid value: each is accepted (and mapped onto
what lmspd does, echoed as OpenAI would echo it), or refused by name where
lmspd cannot honour it. Genuinely unknown parameters stay a 400. In process,
with the scripted engine."""

from __future__ import annotations

import json
import typing

import pytest
from openai.types.chat import completion_create_params
from openai.types.responses import Response, response_compact_params, response_create_params
from openai.types.responses.responses_client_event import ResponseCreate
from openai.types.responses.responses_server_event import ResponsesServerEvent
from openai.types.shared.reasoning_effort import ReasoningEffort
from pydantic import TypeAdapter

from lmspd.compaction import COMPACT_FIELDS
from lmspd.core.limits import MAX_STREAM_ID_CHARS
from lmspd.dialects.chat_completions import ChatCompletionRequest
from lmspd.dialects.openai_responses import CreateResponse
from support.inprocess import MODEL, ScriptedEngine, serving

URL = "ws://localhost/v1/responses"
SERVER_EVENT = TypeAdapter(ResponsesServerEvent)


@pytest.fixture
def app(tmp_path):
    with serving(tmp_path) as app:
        yield app


def respond(app, **extra):
    return app.http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4,
                                                "store": False, **extra})


def chat(app, **extra):
    return app.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 4, **extra})


def refused(r, param: str, code: str = "unsupported_parameter") -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err
    return err["message"]


def test_every_parameter_the_sdk_sends_is_known():
    # The SDK's own lists, so that a newer SDK's field shows up here first.
    responses = set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase))
    assert responses - set(CreateResponse.model_fields) == set()
    chat_params = set(typing.get_type_hints(completion_create_params.CompletionCreateParamsBase))
    assert chat_params - set(ChatCompletionRequest.model_fields) == set()
    # A WebSocket response.create is a create body plus its envelope.
    assert set(ResponseCreate.model_fields) - set(CreateResponse.model_fields) == {"type", "generate", "stream_id"}


def test_every_parameter_the_sdk_sends_to_compact_is_known(app):
    assert set(typing.get_type_hints(response_compact_params.ResponseCompactParams)) - COMPACT_FIELDS == set()
    body = {"model": MODEL, "input": "a long story"}
    for extra in ({"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}},
                  {"image": {"context_compression": "auto"}}):
        r = app.http.post("/v1/responses/compact", json={**body, **extra})
        assert r.status_code == 200 and r.json()["object"] == "response.compaction", r.text
    # Decoded as a create body's: an invalid value is refused by name.
    r = app.http.post("/v1/responses/compact", json={**body, "image": {"context_compression": "always"}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("image"), r.text


def test_unknown_parameters_are_still_refused(app):
    assert refused(respond(app, prompt_cache_option={}), "prompt_cache_option") == \
        "Unknown parameter: 'prompt_cache_option'."
    refused(respond(app, prompt_cache_options={"mode": "implicit", "warm": True}), "prompt_cache_options.warm")
    refused(chat(app, moderations={}), "moderations")
    refused(respond(app, stream_id="lane"), "stream_id")  # WebSocket-only, as the SDK says


@pytest.mark.parametrize("effort", typing.get_args(typing.get_args(ReasoningEffort)[0]))
def test_every_sdk_reasoning_effort_is_accepted_and_echoed(app, effort):
    r = respond(app, reasoning={"effort": effort})
    assert r.status_code == 200, r.text
    assert Response.model_validate(r.json()).reasoning.effort == effort
    # The neutral scale tops out at xhigh, as Anthropic's "max" does.
    assert app.engine.conversations[-1].reasoning_effort == ("xhigh" if effort == "max" else effort)
    r = chat(app, reasoning_effort=effort)
    assert r.status_code == 200, r.text
    assert app.engine.conversations[-1].reasoning_effort == ("xhigh" if effort == "max" else effort)


@pytest.mark.parametrize("tier", ["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"])
def test_every_sdk_service_tier_is_accepted(app, tier):
    r = respond(app, service_tier=tier)
    assert r.status_code == 200, r.text
    # The tier "actually used": lmspd serves every request one way.
    assert r.json()["service_tier"] == "default"


def test_tolerated_options_change_nothing(app):
    plain = respond(app).json()
    options = {
        "prompt_cache_options": {"mode": "explicit", "ttl": "12h", "comparison_response_id": "resp_x"},
        "image": {"context_compression": "enabled"},
        "background_options": {"completion_window": "soonest", "continuation_id": "batch-7"},
        "access_programs": {"cyber": "standard"},
    }
    r = respond(app, **options)
    assert r.status_code == 200, r.text
    body = Response.model_validate(r.json())
    # Nothing of them was applied, so nothing is reported as applied.
    assert body.prompt_cache_options is None and body.image is None and body.access_programs is None
    assert app.engine.conversations[-1] == app.engine.conversations[-2]
    assert set(r.json()) == set(plain)
    r = chat(app, prompt_cache_options={"mode": "implicit", "ttl": "30m"})
    assert r.status_code == 200, r.text
    refused(chat(app, prompt_cache_options={"ttl": "12h"}), "prompt_cache_options.ttl", "invalid_request")


def test_a_long_completion_window_is_a_background_response(app):
    window = {"background_options": {"completion_window": "8h"}}
    refused(respond(app, **window), "background_options.completion_window", "invalid_request")
    refused(respond(app, **window, background=True, store=True, stream=True), "background_options.completion_window",
            "invalid_request")
    r = respond(app, **window, background=True, store=True)
    assert r.status_code == 200 and r.json()["background"] is True, r.text


def test_what_lmspd_cannot_honour_is_refused_by_name(app):
    generations = app.generations()
    moderation = {"model": "omni-moderation-latest", "policy": {"input": {"mode": "block"}}}
    assert "moderation" in refused(respond(app, moderation=moderation), "moderation")
    assert "moderation" in refused(chat(app, moderation=moderation), "moderation")
    refused(respond(app, access_programs={"cyber": "daybreak_red"}), "access_programs.cyber")
    assert app.generations() == generations


def test_prewarm_is_a_turn_that_does_not_generate(app):
    """``prompt_cache_options.prewarm`` "overrides generate to false": an
    empty completed response, over HTTP as over the WebSocket. (This engine
    cannot prefill without generating, so nothing at all reaches it; the
    llama engine's prefill: tests/e2e/test_websocket.py.)"""
    prepared = app.engine.prepared
    r = respond(app, prompt_cache_options={"prewarm": True, "ttl": "30m"})
    assert r.status_code == 200, r.text
    warm = Response.model_validate(r.json())
    assert warm.status == "completed" and warm.output == [] and app.engine.prepared == prepared
    r = respond(app, prompt_cache_options={"prewarm": False})
    assert r.status_code == 200 and r.json()["output"] and app.engine.prepared == prepared + 1
    with app.http.websocket_connect("ws://localhost/v1/responses") as ws:
        ws.send_text(json.dumps({"type": "response.create", "model": MODEL, "input": "hi",
                                 "prompt_cache_options": {"prewarm": True}}))
        while (event := json.loads(ws.receive_text()))["type"] != "response.completed":
            assert event["type"] not in ("error", "response.output_item.added"), event
    assert event["response"]["output"] == [] and app.engine.prepared == prepared + 1


def create(ws, **body) -> list[dict]:
    ws.send_text(json.dumps({"type": "response.create", "model": MODEL, "store": False, "input": "hi", **body}))
    events = []
    while True:
        events.append(json.loads(ws.receive_text()))
        if events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
            return events


def test_websocket_events_echo_their_turns_stream_id(app):
    with app.http.websocket_connect(URL) as ws:
        laned = create(ws, stream_id="lane-1")
        assert laned[-1]["type"] == "response.completed", laned[-1]
        assert {e.get("stream_id") for e in laned} == {"lane-1"}
        for event in laned:
            assert SERVER_EVENT.validate_python(event).stream_id == "lane-1"
        # Only the turn that named a lane: the next one names none.
        plain = create(ws, previous_response_id=laned[-1]["response"]["id"])
        assert plain[-1]["type"] == "response.completed" and all("stream_id" not in e for e in plain)
        # A turn refused before it starts still answers on its lane.
        failed = create(ws, stream_id="lane-2", previous_response_id="resp_missing")
        assert [(e["type"], e["stream_id"]) for e in failed] == [("error", "lane-2")], failed
        assert SERVER_EVENT.validate_python(failed[0]).stream_id == "lane-2"
        for bad in ("", 7, "x" * (MAX_STREAM_ID_CHARS + 1)):
            [error] = create(ws, stream_id=bad)
            assert error["error"]["param"] == "stream_id" and "stream_id" not in error, error


def test_a_create_refused_while_another_runs_answers_on_its_own_lane(tmp_path):
    with serving(tmp_path, engine=ScriptedEngine(words=("a",) * 20, delay_s=0.05)) as app, \
            app.http.websocket_connect(URL) as ws:
        for lane in ("first", "second"):
            ws.send_text(json.dumps({"type": "response.create", "model": MODEL, "input": "hi", "store": False,
                                     "stream_id": lane}))
        events = []
        while not any(e["type"] == "response.completed" for e in events):
            events.append(json.loads(ws.receive_text()))
        [refused] = [e for e in events if e["type"] == "error"]
        assert refused["error"]["code"] == "concurrent_request" and refused["stream_id"] == "second", refused
        assert {e["stream_id"] for e in events if e is not refused} == {"first"}


def test_a_json_schema_formats_strict_is_a_boolean(app):
    """As a tool's ``strict``: the string "false" is no boolean (it turned
    strict mode on), on every dialect's output format."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = {"type": "json_schema", "name": "x", "schema": schema}
    for strict in ("false", 0, "yes"):
        refused(respond(app, text={"format": {**fmt, "strict": strict}}), "text.format.strict", "invalid_request")
        refused(chat(app, response_format={"type": "json_schema", "json_schema": {**fmt, "strict": strict}}),
                "response_format.json_schema.strict", "invalid_request")
    for strict, applied in ((False, False), (None, False), (True, True)):
        assert respond(app, text={"format": {**fmt, "strict": strict}}).status_code == 200
        assert app.engine.conversations[-1].output_format.strict is applied


def test_include_obfuscation_is_accepted_and_adds_nothing(app):
    """OpenAI pads its deltas against length side channels on the network;
    a local server sends none, whatever the client asks."""
    body = {"model": MODEL, "input": "hi", "store": False, "stream": True,
            "stream_options": {"include_obfuscation": True}}
    with app.http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert events[-1]["type"] == "response.completed"
    assert not any("obfuscation" in e for e in events)
