"""Chat Completions dialect: decoding into the neutral conversation, and
scripted engine events encoded as chunks / a completion object."""

from __future__ import annotations

import pytest

from lmspd.core.conversation import Message, Reasoning, ToolCall, ToolChoice, ToolOutput
from lmspd.core.errors import ApiError, RequestField
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
from lmspd.dialects.chat_completions import ChatEncoder, completion_json, decode_request
from lmspd.streaming.session import ResponseState, StreamSession
from support.compat import check_chat_completion, validate_chat_stream

LIMITS = RequestLimits()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def decode(**body):
    return decode_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, LIMITS)


def refused(**body) -> ApiError:
    with pytest.raises(ApiError) as info:
        decode(**body)
    return info.value


# -- decoding --------------------------------------------------------------------


def test_every_role_becomes_neutral_items():
    req = decode(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "text", "text": "Use "}, {"type": "text", "text": "English."}]},
        {"role": "user", "content": "Weather in Paris?", "name": "ann"},
        {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
                        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
        {"role": "assistant", "content": "Sunny at noon.", "refusal": None},
        {"role": "user", "content": "Thanks"},
    ], tools=[WEATHER, TIME])
    assert req.conversation.items == [
        Message(role="system", text="Be brief."),
        Message(role="developer", text="Use English."),
        Message(role="user", text="Weather in Paris?"),
        Reasoning(text="Need the tool."),
        ToolCall(call_id="call_1", name="get_weather", payload='{"city":"Paris"}'),
        ToolCall(call_id="call_2", name="get_time", payload="{}"),
        ToolOutput(call_id="call_1", output="sunny"),
        ToolOutput(call_id="call_2", output="noon"),
        Message(role="assistant", text="Sunny at noon."),
        Message(role="user", text="Thanks"),
    ]
    assert [t.name for t in req.conversation.tools] == ["get_weather", "get_time"]
    assert req.conversation.tools[0].parameters["required"] == ["city"]


@pytest.mark.parametrize("choice,expected", [
    (None, ToolChoice()),
    ("auto", ToolChoice()),
    ("none", ToolChoice(mode="none")),
    ("required", ToolChoice(mode="required")),
    ({"type": "function", "function": {"name": "get_time"}}, ToolChoice(mode="required", allowed=["get_time"])),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}},
     ToolChoice(mode="required", allowed=["get_weather"])),
])
def test_tool_choice_forms(choice, expected):
    body = {"tools": [WEATHER, TIME]}
    if choice is not None:
        body["tool_choice"] = choice
    assert decode(**body).conversation.tool_choice == expected


def test_sampling_caps_and_formats():
    c = decode(temperature=0.5, top_p=0.9, seed=-1, stop="END", max_tokens=7).conversation
    assert (c.sampling.temperature, c.sampling.top_p, c.sampling.stop) == (0.5, 0.9, ["END"])
    assert c.sampling.seed == 0xFFFFFFFF, "a negative seed folds into llama.cpp's uint32"
    assert c.max_output_tokens == 7
    c = decode(max_tokens=7, max_completion_tokens=9, stop=["a", "b"]).conversation
    assert c.max_output_tokens == 9 and c.sampling.stop == ["a", "b"]
    assert decode(response_format={"type": "json_object"}).conversation.output_format.type == "json_object"
    fmt = decode(response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "strict": True, "schema": {"type": "object"}}}).conversation.output_format
    assert (fmt.type, fmt.name, fmt.schema, fmt.strict) == ("json_schema", "answer", {"type": "object"}, True)
    req = decode(stream=True, stream_options={"include_usage": True}, reasoning_effort="low",
                 extensions={"lmspd.cache": {"reuse": False}})
    assert req.stream and req.include_usage and req.conversation.reasoning_effort == "low"
    assert req.conversation.cache_reuse is False
    assert decode(extensions={"lmspd.sampling": {"seed": 5}}).conversation.sampling.seed == 5
    # The request's own seed over the extension's; top-k and min-p from the extension (0: off).
    sampling = decode(seed=7, extensions={"lmspd.sampling": {"seed": 5, "top_k": 0, "min_p": 0.1}}).conversation.sampling
    assert (sampling.seed, sampling.top_k, sampling.min_p) == (7, 0, 0.1)
    # Harmless bookkeeping fields are accepted.
    decode(user="u", metadata={"k": "v"}, store=False, service_tier="auto", prompt_cache_key="k",
           parallel_tool_calls=False, n=1, presence_penalty=0, frequency_penalty=0, logprobs=False,
           modalities=["text"], verbosity="low")
    cap = RequestField.MAX_OUTPUT_TOKENS
    assert decode(max_completion_tokens=3).field_names.names[cap] == "max_completion_tokens"
    assert decode(max_tokens=3).field_names.names[cap] == "max_tokens"


@pytest.mark.parametrize("body,code,param", [
    ({"frobnicate": 1}, "unsupported_parameter", "frobnicate"),
    ({"n": 2}, "unsupported_parameter", "n"),
    ({"logprobs": True}, "unsupported_parameter", "logprobs"),
    ({"presence_penalty": 0.5}, "unsupported_parameter", "presence_penalty"),
    ({"functions": [{"name": "f"}]}, "unsupported_parameter", "functions"),
    ({"stream_options": {"include_usage": True}}, "invalid_request", "stream_options"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "invalid_request", "stop"),
    ({"temperature": 3}, "invalid_request", "temperature"),
    ({"extensions": {"lmspd.sampling": {"top_k": -1}}}, "invalid_request", "extensions.lmspd.sampling.top_k"),
    ({"extensions": {"lmspd.sampling": {"min_p": 1.5}}}, "invalid_request", "extensions.lmspd.sampling.min_p"),
    ({"messages": []}, "invalid_request", "messages"),
    ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "invalid_request", "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "invalid_request", "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "unsupported_capability", "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_x", "content": "r"}]},
     "invalid_request", "messages[1]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "invalid_request",
     "tools[0].function.name"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "invalid_request", "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "invalid_request",
     "tool_choice.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, "invalid_request",
     "response_format.json_schema.name"),
])
def test_bad_requests_name_the_field(body, code, param):
    err = refused(**body)
    assert (err.code, err.param) == (code, param), err.message


# -- encoding --------------------------------------------------------------------


def run(events, *, include_usage=False):
    state = ResponseState(id="chatcmpl_1", model="m")
    encoder = ChatEncoder(include_usage=include_usage)
    session = StreamSession(state, encoder)
    wire = session.start()
    for event in events:
        wire += session.handle(event)
    wire += [(-1, name, data) for name, data in encoder.trailer(state)]
    return state, [data for _, _, data in wire]


def test_text_stream_with_usage():
    usage = Usage(input_tokens=10, output_tokens=2, cached_tokens=4, cache_write_tokens=6)
    state, chunks = run([TextDelta("Hel"), TextDelta("lo"), Finished("stop", usage)], include_usage=True)
    summary = validate_chat_stream(chunks, include_usage=True)
    assert summary["content"] == "Hello" and summary["finish_reason"] == "stop"
    # openai 3.57's PromptTokensDetails has cache_write_tokens, as Responses' usage does.
    assert summary["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                                "prompt_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 6},
                                "completion_tokens_details": {"reasoning_tokens": 0}}
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [
        {"role": "assistant", "content": "", "refusal": None}, {"content": "Hel"}, {"content": "lo"}]
    body = completion_json(state)
    check_chat_completion(body)
    assert body["choices"][0]["message"]["content"] == "Hello"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 4


def test_reasoning_and_parallel_tool_calls():
    state, chunks = run([
        ReasoningDelta("Need "), ReasoningDelta("tools."),
        TextDelta("Checking."),
        ToolCallStarted(0, "call_a", "get_weather"), ToolCallDelta(0, '{"city":'), ToolCallDelta(0, '"Paris"}'),
        ToolCallDone(0, '{"city":"Paris"}'),
        ToolCallStarted(1, "call_b", "get_time"), ToolCallDelta(1, "{}"), ToolCallDone(1, "{}"),
        Finished("tool_calls", Usage(5, 9)),
    ])
    summary = validate_chat_stream(chunks)
    assert summary["reasoning"] == "Need tools." and summary["content"] == "Checking."
    assert summary["finish_reason"] == "tool_calls"
    assert summary["tool_calls"] == [{"id": "call_a", "name": "get_weather", "arguments": '{"city":"Paris"}'},
                                     {"id": "call_b", "name": "get_time", "arguments": "{}"}]
    # The second call is index 1 among tool calls although it is output item 3.
    starts = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks
              if "id" in (c["choices"][0]["delta"].get("tool_calls") or [{}])[0]]
    assert [s["index"] for s in starts] == [0, 1]
    message = completion_json(state)["choices"][0]["message"]
    check_chat_completion(completion_json(state))
    assert message["reasoning_content"] == "Need tools." and message["content"] == "Checking."
    assert [t["function"]["name"] for t in message["tool_calls"]] == ["get_weather", "get_time"]


def test_a_call_sent_whole_at_its_end_streams_its_arguments():
    """An engine may send a call's arguments only with its end (no deltas,
    or the rest of them): the stream carries arguments in deltas only, and
    a streaming client read ``""`` where the non-streamed body had them."""
    state, chunks = run([
        ToolCallStarted(0, "call_a", "get_weather"), ToolCallDone(0, '{"city":"Paris"}'),
        ToolCallStarted(1, "call_b", "get_time"), ToolCallDelta(1, '{"tz":'), ToolCallDone(1, '{"tz":"UTC"}'),
        Finished("tool_calls"),
    ])
    streamed = [(t["id"], t["arguments"]) for t in validate_chat_stream(chunks)["tool_calls"]]
    assert streamed == [("call_a", '{"city":"Paris"}'), ("call_b", '{"tz":"UTC"}')]
    body = [(t["id"], t["function"]["arguments"]) for t in completion_json(state)["choices"][0]["message"]["tool_calls"]]
    assert body == streamed


def test_tool_only_turn_has_null_content():
    state, chunks = run([ToolCallStarted(0, "call_a", "get_time"), ToolCallDone(0, "{}"), Finished("stop")])
    assert validate_chat_stream(chunks)["finish_reason"] == "tool_calls"
    message = completion_json(state)["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["id"] == "call_a"


def test_length_and_content_filter():
    state, chunks = run([TextDelta("a b"), Finished("length", Usage(3, 2))], include_usage=True)
    assert validate_chat_stream(chunks, include_usage=True)["finish_reason"] == "length"
    assert completion_json(state)["choices"][0]["finish_reason"] == "length"
    state, chunks = run([TextDelta("x"), Finished("content_filter")])
    assert validate_chat_stream(chunks)["finish_reason"] == "content_filter"


def test_failure_is_an_error_object_and_no_usage_chunk():
    state, chunks = run([TextDelta("par"), Failed("server_shutting_down", "The server is shutting down.")],
                        include_usage=True)
    assert chunks[-1] == {"error": {"message": "The server is shutting down.", "type": "server_error",
                                    "param": None, "code": "server_shutting_down"}}
    assert all("error" not in c for c in chunks[:-1])


def test_metadata_is_bounded_like_the_responses_dialect():
    with pytest.raises(ApiError) as info:
        decode(metadata={"note": "x" * 10_000})
    assert info.value.param == "metadata"
    with pytest.raises(ApiError):
        decode(metadata={f"k{i}": "v" for i in range(100)})
    decode(metadata={"note": "fine"})
