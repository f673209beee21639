"""Anthropic Messages dialect: decoding into the neutral conversation, and
scripted engine events encoded as stream events / a Message object."""

from __future__ import annotations

import json

import pytest

from lmspd.core.conversation import Message, Reasoning, ToolCall, ToolChoice, ToolOutput
from lmspd.core.errors import ApiError
from lmspd.core.events import (
    Failed,
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStarted,
    Usage,
)
from lmspd.core.limits import RequestLimits
from lmspd.dialects.anthropic_messages import AnthropicEncoder, decode_count_tokens, decode_request, message_json
from lmspd.streaming.session import ResponseState, StreamSession
from support.compat import check_anthropic_message, validate_anthropic_stream

LIMITS = RequestLimits()
WEATHER = {"name": "get_weather", "description": "Weather for a city.", "cache_control": {"type": "ephemeral"},
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}


def decode(**body):
    return decode_request({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **body},
                          LIMITS)


def refused(**body) -> ApiError:
    with pytest.raises(ApiError) as info:
        decode(**body)
    return info.value


# -- decoding --------------------------------------------------------------------


def test_blocks_become_neutral_items():
    req = decode(
        system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Answer in English."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "<reminder/>"},
                                         {"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "sig-1"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "clock broken"}]},
                {"type": "text", "text": "And tomorrow?"},
            ]},
        ],
        tools=[WEATHER, TIME],
    )
    c = req.conversation
    assert c.instructions == "You are terse.\n\nAnswer in English."
    assert c.items == [
        Message(role="user", text="<reminder/>\n\nWeather?"),
        Reasoning(text="Use the tool.", encrypted_content="sig-1"),
        Reasoning(encrypted_content="opaque"),
        Message(role="assistant", text="Checking."),
        ToolCall(call_id="toolu_1", name="get_weather", payload='{"city": "Paris"}'),
        ToolCall(call_id="toolu_2", name="get_time", payload="{}"),
        ToolOutput(call_id="toolu_1", output="sunny"),
        ToolOutput(call_id="toolu_2", output="Error: clock broken"),
        Message(role="user", text="And tomorrow?"),
    ]
    assert [t.name for t in c.tools] == ["get_weather", "get_time"]
    assert c.tools[0].parameters["required"] == ["city"]
    assert c.max_output_tokens == 16


# None: the request did not say (a forced call then ends the turn, issue 14).
@pytest.mark.parametrize("choice,expected,parallel", [
    ({"type": "auto"}, ToolChoice(), None),
    ({"type": "any"}, ToolChoice(mode="required"), None),
    ({"type": "none"}, ToolChoice(mode="none"), None),
    ({"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
     ToolChoice(mode="required", allowed=["get_time"]), False),
])
def test_tool_choice_forms(choice, expected, parallel):
    c = decode(tools=[WEATHER, TIME], tool_choice=choice).conversation
    assert c.tool_choice == expected and c.parallel_tool_calls is parallel


def test_sampling_thinking_and_output_format():
    c = decode(system="Be brief.", temperature=0, top_p=0.5, stop_sequences=["END"],
               metadata={"user_id": "u"}, service_tier="auto", cache_control={"type": "ephemeral"},
               extensions={"lmspd.sampling": {"seed": 3}}).conversation
    assert c.instructions == "Be brief."
    assert (c.sampling.temperature, c.sampling.top_p, c.sampling.stop, c.sampling.seed) == (0, 0.5, ["END"], 3)
    assert decode(thinking={"type": "disabled"}).conversation.reasoning_effort == "none"
    assert decode(thinking={"type": "enabled", "budget_tokens": 1024}).conversation.reasoning_effort == "high"
    assert decode(thinking={"type": "enabled", "budget_tokens": 100}).conversation.reasoning_effort == "low"
    assert decode(thinking={"type": "adaptive"}).conversation.reasoning_effort is None
    assert decode().conversation.include_encrypted_reasoning, "thinking blocks always carry a signature"
    assert decode(output_config={"effort": "max"}).conversation.reasoning_effort == "xhigh"
    fmt = decode(output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}}).conversation
    assert (fmt.output_format.type, fmt.output_format.schema) == ("json_schema", {"type": "object"})
    # Tools Anthropic runs itself are ignored, like hosted tools on /v1/responses.
    assert decode(tools=[{"type": "web_search_20250305", "name": "web_search"}]).conversation.tools == []
    # count_tokens needs no max_tokens.
    counted = decode_count_tokens({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, LIMITS)
    assert counted.conversation.max_output_tokens is None
    # top_k is sampled with (the llama engine's chain has a top-k), over lmspd's extension.
    assert decode(top_k=5).conversation.sampling.top_k == 5
    assert decode(top_k=5, extensions={"lmspd.sampling": {"top_k": 9}}).conversation.sampling.top_k == 5
    assert decode(extensions={"lmspd.sampling": {"top_k": 9}}).conversation.sampling.top_k == 9


@pytest.mark.parametrize("body,code,param", [
    ({"frobnicate": 1}, "unsupported_parameter", "frobnicate"),
    ({"max_tokens": None}, "invalid_request", "max_tokens"),
    ({"top_k": -1}, "invalid_request", "top_k"),
    ({"temperature": 1.5}, "invalid_request", "temperature"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "unsupported_parameter",
     "context_management"),
    ({"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns",
                                                                                      "value": 1}}]}},
     "unsupported_parameter", "context_management"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "invalid_request", "messages[0].role"),
    # A system message holds text only (SDK 2.10's SystemMessageParam).
    ({"messages": [{"role": "system", "content": [{"type": "image", "source": {}}]}]}, "invalid_request",
     "messages[0].content[0].type"),
    ({"messages": [{"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "invalid_request", "messages[0].content[0].type"),
    ({"messages": [{"role": "system", "content": [{"type": "text"}]}]}, "invalid_request",
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "unsupported_capability",
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]},
     "invalid_request", "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}]}]},
     "invalid_request", "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "invalid_request", "messages[0].content[0].text"),
    ({"system": [{"type": "image"}]}, "invalid_request", "system[0]"),
    ({"tools": [{"name": "t"}]}, "invalid_request", "tools[0].input_schema"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "unsupported_capability", "tools[0].type"),
    ({"tools": [TIME], "tool_choice": {"type": "tool", "name": "nope"}}, "invalid_request", "tool_choice.name"),
    ({"tool_choice": {"type": "sometimes"}}, "invalid_request", "tool_choice.type"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "invalid_request", "stop_sequences"),
])
def test_bad_requests_name_the_field(body, code, param):
    err = refused(**body)
    assert (err.code, err.param) == (code, param), err.message


@pytest.mark.parametrize("code,status,kind", [
    ("invalid_request", 400, "invalid_request_error"),
    ("unauthorized", 401, "authentication_error"),
    ("forbidden", 403, "permission_error"),
    ("model_not_found", 404, "not_found_error"),
    ("request_too_large", 413, "request_too_large"),
    ("rate_limited", 429, "rate_limit_error"),
    ("server_error", 500, "api_error"),
    ("server_overloaded", 503, "overloaded_error"),
    ("upstream_timeout", 504, "timeout_error"),
])
def test_error_shape(code, status, kind):
    err = ApiError(code, "why")
    assert err.status == status
    assert err.anthropic() == {"type": "error", "error": {"type": kind, "message": "why"}}


# -- encoding --------------------------------------------------------------------


def run(events, input_tokens=10):
    state = ResponseState(id="msg_1", model="m", echo={"input_tokens": input_tokens})
    encoder = AnthropicEncoder()
    session = StreamSession(state, encoder)
    wire = session.start()
    for event in events:
        wire += session.handle(event)
    wire += [(-1, name, data) for name, data in encoder.trailer(state)]
    return state, [(name, data) for _, name, data in wire]


def test_text_stream_and_usage_split():
    state, events = run([TextDelta("Hel"), TextDelta("lo"), Finished("stop", Usage(10, 2, cached_tokens=7))])
    assert [n for n, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                      "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["usage"]["input_tokens"] == 10 and start["content"] == [] and start["stop_reason"] is None
    final = validate_anthropic_stream(events)
    assert final.content[0].text == "Hello" and final.stop_reason == "end_turn"
    # Anthropic's input_tokens excludes what was read from the cache.
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens, final.usage.output_tokens) == (3, 7, 2)
    body = message_json(state)
    check_anthropic_message(body)
    assert body["content"] == [{"type": "text", "text": "Hello"}]
    assert body["usage"] == {"input_tokens": 3, "output_tokens": 2, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 7}


def test_thinking_and_tool_use():
    state, events = run([
        ReasoningDelta("Need "), ReasoningDelta("weather."),
        ToolCallStarted(0, "toolu_a", "get_weather"), ToolCallDelta(0, '{"city":'), ToolCallDelta(0, '"Paris"}'),
        ToolCallDone(0, '{"city":"Paris"}'),
        ToolCallStarted(1, "toolu_b", "get_time"), ToolCallDone(1, "{}"),
        Finished("tool_calls", Usage(5, 9)),
    ])
    final = validate_anthropic_stream(events)
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["thinking", "tool_use", "tool_use"]
    assert final.content[0].thinking == "Need weather."
    assert (final.content[1].id, final.content[1].name, final.content[1].input) == (
        "toolu_a", "get_weather", {"city": "Paris"})
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert {"type": "thinking_delta", "thinking": "Need "} in deltas
    assert {"type": "input_json_delta", "partial_json": '{"city":'} in deltas
    body = message_json(state)
    check_anthropic_message(body)
    assert body["content"][1] == {"type": "tool_use", "id": "toolu_a", "name": "get_weather",
                                  "input": {"city": "Paris"}}
    assert body["content"][0] == {"type": "thinking", "thinking": "Need weather.", "signature": ""}


def test_a_call_sent_whole_at_its_end_streams_its_input():
    """An engine may send a call's input only with its end (no deltas, or
    the rest of it): the stream carries input in deltas only, and ended the
    block with what the deltas held (``{}``; the non-streamed body had it)."""
    state, events = run([
        ToolCallStarted(0, "toolu_a", "get_weather"), ToolCallDone(0, '{"city":"Paris"}'),
        ToolCallStarted(1, "toolu_b", "get_time"), ToolCallDelta(1, '{"tz":'), ToolCallDone(1, '{"tz":"UTC"}'),
        Finished("tool_calls", Usage(5, 9)),
    ])
    final = validate_anthropic_stream(events)
    assert [b.input for b in final.content] == [{"city": "Paris"}, {"tz": "UTC"}]
    assert [b["input"] for b in message_json(state)["content"]] == [{"city": "Paris"}, {"tz": "UTC"}]


def test_max_tokens_cuts_a_tool_call():
    state, events = run([ToolCallStarted(0, "toolu_a", "get_weather"), ToolCallDelta(0, '{"ci'),
                         Finished("length", Usage(5, 3))])
    final = validate_anthropic_stream(events)
    assert final.stop_reason == "max_tokens"
    assert message_json(state)["content"][0]["input"] == {}, "unfinished JSON reads as an empty input"


def test_failure_is_an_error_event_without_message_stop():
    state, events = run([TextDelta("par"), Failed("server_shutting_down", "The server is shutting down.")])
    names = [n for n, _ in events]
    assert names[-1] == "error" and "message_stop" not in names and "message_delta" not in names
    assert events[-1][1] == {"type": "error", "error": {"type": "overloaded_error",
                                                        "message": "The server is shutting down."}}
    assert names[-2] == "content_block_stop", "the open block is closed before the error"


def test_tool_input_round_trips_through_decode():
    """What the encoder sends is what a client replays: the decoder reads it back to the same call."""
    state, _ = run([ToolCallStarted(0, "toolu_a", "get_weather"), ToolCallDone(0, '{"city":"Paris"}'),
                    Finished("tool_calls")])
    replay = {"role": "assistant", "content": message_json(state)["content"]}
    req = decode(messages=[{"role": "user", "content": "Weather?"}, replay], tools=[WEATHER])
    call = req.conversation.items[1]
    assert isinstance(call, ToolCall) and call.call_id == "toolu_a"
    assert json.loads(call.payload) == {"city": "Paris"}
