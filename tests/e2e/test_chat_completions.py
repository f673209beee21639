"""/v1/chat/completions driven by the openai SDK and raw HTTP against the
real model: JSON and SSE, tools, structured output, the continuation cache
across turns and across dialects, and OpenAI's error shape."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from support.compat import check_chat_completion, validate_chat_stream
from support.server import MODEL
from support.sse import parse_frames

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# The 135M model, offered parallel calls, repeats its call until the cap:
# one call per turn keeps these short and ending in tool_calls.
ONE_CALL = {"parallel_tool_calls": False}


def chat(http, **body) -> dict:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    check_chat_completion(r.json())
    return r.json()


def stream_raw(http, **body) -> list[dict]:
    with http.stream("POST", "/v1/chat/completions",
                     json={"model": MODEL, "temperature": 0, **body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = list(parse_frames(r.iter_lines()))
    assert frames[-1].data == "[DONE]"
    assert all(f.event is None for f in frames), "chat streams are data-only (no event: lines)"
    return [f.json() for f in frames[:-1]]


def assert_reused(cached: int, prior: int) -> None:
    """The live KV holds the prior prompt plus every token sampled for it,
    and (for a turn that ended by itself) the end-of-turn marker that the
    next prompt repeats: reuse is exactly that, tokenization permitting."""
    assert prior <= cached <= prior + 1, f"cached_tokens={cached}, prior context={prior}"


def test_sdk_create_and_stream_agree(openai_client, http):
    messages = [{"role": "user", "content": "Say hello."}]
    done = openai_client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
    choice = done.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length") and done.object == "chat.completion"
    assert done.usage.prompt_tokens > 0 and done.usage.completion_tokens > 0
    assert done.usage.prompt_tokens_details.cached_tokens is not None

    chunks = [c.model_dump(mode="json", exclude_unset=True) for c in openai_client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=16, stream=True,
        stream_options={"include_usage": True})]
    summary = validate_chat_stream(chunks, include_usage=True)
    assert summary["content"] == choice.message.content, "temperature 0 is deterministic"
    assert summary["finish_reason"] == choice.finish_reason
    assert summary["usage"]["completion_tokens"] == done.usage.completion_tokens

    # Without include_usage there is no usage anywhere in the stream.
    chunks = stream_raw(http, messages=messages, max_tokens=16)
    assert validate_chat_stream(chunks)["content"] == choice.message.content


def test_max_tokens_gives_length(http):
    body = chat(http, messages=[{"role": "user", "content": "Write a long story about a dragon."}],
                max_completion_tokens=4)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4
    summary = validate_chat_stream(stream_raw(http, messages=[{"role": "user", "content": "Write a long story."}],
                                              max_tokens=4))
    assert summary["finish_reason"] == "length"


def test_stop_sequence_cuts_the_reply(http):
    messages = [{"role": "user", "content": "Name three colors."}]
    full = chat(http, messages=messages, max_tokens=16)["choices"][0]["message"]["content"]
    word = full.split()[2]
    cut = chat(http, messages=messages, max_tokens=16, stop=[word])
    assert cut["choices"][0]["message"]["content"] == full[: full.index(word)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_seed_makes_sampling_reproducible(http):
    body = {"messages": [{"role": "user", "content": "Invent a name for a cat."}], "temperature": 1.0,
            "max_tokens": 10, "seed": 1234}
    a = chat(http, **body)["choices"][0]["message"]["content"]
    assert chat(http, **body)["choices"][0]["message"]["content"] == a
    # And the seed is what decides: other seeds sample other names (not greedy decoding).
    others = {chat(http, **{**body, "seed": seed})["choices"][0]["message"]["content"] for seed in range(1, 5)}
    assert others - {a}, others


class Weather(BaseModel):
    city: str
    sunny: bool


def test_json_schema_reply(openai_client, http):
    parsed = openai_client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Is it sunny in Paris? Answer in JSON."}],
        response_format=Weather, temperature=0, max_completion_tokens=40)
    assert parsed.choices[0].finish_reason == "stop"
    assert isinstance(parsed.choices[0].message.parsed, Weather)
    # Greedy and a prompt with a short answer: an open-ended one sampled at
    # temperature 1 lets the 135M model ramble past any small budget.
    body = chat(http, messages=[{"role": "user", "content": 'Give a JSON object with one key "color" and the value "red".'}],
                response_format={"type": "json_object"}, max_tokens=40, temperature=0)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


def test_every_role_in_one_request(http):
    """System, developer, user, assistant with tool_calls and reasoning, tool: all accepted."""
    body = chat(http, max_tokens=8, tools=[WEATHER], tool_choice="none", messages=[
        {"role": "system", "content": "You are brief."},
        {"role": "developer", "content": [{"type": "text", "text": "Use English."}]},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
        {"role": "user", "content": "Summarize."},
    ])
    assert body["choices"][0]["message"]["content"] is not None
    assert "tool_calls" not in body["choices"][0]["message"]


def test_forced_tool_call(openai_client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    done = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                 tool_choice=forced, temperature=0, max_tokens=48, **ONE_CALL)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    assert isinstance(json.loads(call.function.arguments).get("city"), str)

    chunks = [c.model_dump(mode="json", exclude_unset=True) for c in openai_client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=48,
        stream=True, **ONE_CALL)]
    summary = validate_chat_stream(chunks)
    assert summary["finish_reason"] == "tool_calls"
    assert summary["tool_calls"][0]["name"] == "get_weather"
    assert json.loads(summary["tool_calls"][0]["arguments"]) == json.loads(call.function.arguments)


def test_tool_loop_reuses_the_prior_context(http):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = chat(http, messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=48, **ONE_CALL)
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    call = first["choices"][0]["message"]["tool_calls"][0]
    messages += [first["choices"][0]["message"],
                 {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"}]
    second = chat(http, messages=messages, tools=[WEATHER], max_tokens=12)
    u = first["usage"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert_reused(cached, u["prompt_tokens"] + u["completion_tokens"])


def test_multi_turn_reuses_the_prior_context(http):
    messages = [{"role": "user", "content": "Name a color."}]
    prior = None
    for _ in range(3):
        body = chat(http, messages=messages, max_tokens=12)
        u = body["usage"]
        if prior is not None:
            assert_reused(u["prompt_tokens_details"]["cached_tokens"], prior)
        prior = u["prompt_tokens"] + u["completion_tokens"]
        messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Another one."}]


def test_dialect_switch_continues_from_the_cache(http):
    """A Responses turn, then a chat turn over the same history: the chat
    turn continues from the KV the Responses turn left, not cold."""
    first = http.post("/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": "Name a fruit."}],
                                             "temperature": 0, "max_output_tokens": 12}).json()
    text = first["output"][0]["content"][0]["text"]
    body = chat(http, max_tokens=12, messages=[{"role": "user", "content": "Name a fruit."},
                                               {"role": "assistant", "content": text},
                                               {"role": "user", "content": "Another one."}])
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert_reused(cached, first["usage"]["input_tokens"] + first["usage"]["output_tokens"])


def gens(server):
    return server.generations()


ERRORS = [
    ("unknown parameter", {"frobnicate": 1}, 400, "unsupported_parameter", "frobnicate"),
    ("missing messages", {"messages": None}, 400, "invalid_request", "messages"),
    ("bad temperature", {"temperature": 5}, 400, "invalid_request", "temperature"),
    ("n above 1", {"n": 2}, 400, "unsupported_parameter", "n"),
    ("unknown model", {"model": "no-such-model"}, 404, "model_not_found", "model"),
    ("context exceeded", {"max_tokens": 100000}, 400, "context_length_exceeded", "max_tokens"),
    ("orphan tool message", {"messages": [{"role": "user", "content": "hi"},
                                          {"role": "tool", "tool_call_id": "call_x", "content": "r"}]},
     400, "invalid_request", "messages[1]"),
    ("image part", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     400, "unsupported_capability", "messages[0].content[0].type"),
]


@pytest.mark.parametrize("desc,body,status,code,param", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_in_openai_shape(server, http, desc, body, status, code, param):
    before = gens(server)
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    r = http.post("/v1/chat/completions", json={k: v for k, v in payload.items() if v is not None})
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param) and err["message"] and err["type"]
    assert gens(server) == before, "a refused request must not generate"


def test_sdk_raises_typed_errors(openai_client):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=100000)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])


def test_invalid_json_body(http):
    r = http.post("/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
