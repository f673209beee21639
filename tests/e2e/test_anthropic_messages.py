"""/v1/messages and /v1/messages/count_tokens driven by the anthropic SDK
and raw HTTP against the real model: JSON and SSE, tools and tool results,
the continuation cache across turns, Anthropic's error shape and x-api-key."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from support.compat import check_anthropic_message, validate_anthropic_stream
from support.server import MODEL
from support.sse import parse_frames

# This SDK version has no ``temperature`` argument; the API still takes it.
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {"name": "get_weather", "description": "Get the current weather for a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOL_HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}]},
]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused-locally", max_retries=0, timeout=120)


def create(http, **body) -> dict:
    r = http.post("/v1/messages", json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    check_anthropic_message(r.json())
    return r.json()


def stream_raw(http, **body) -> list[tuple[str, dict]]:
    with http.stream("POST", "/v1/messages", json={"model": MODEL, "temperature": 0, **body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = list(parse_frames(r.iter_lines()))
    return [(f.event, f.json()) for f in frames]


def prompt_tokens(usage: dict) -> int:
    return usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]


def assert_reused(cached: int, prior: int) -> None:
    """The live KV holds the prior prompt plus every token sampled for it,
    and (for a turn that ended by itself) the end-of-turn marker that the
    next prompt repeats: reuse is exactly that, tokenization permitting."""
    assert prior <= cached <= prior + 1, f"cache_read_input_tokens={cached}, prior context={prior}"


def test_sdk_create_and_stream_agree(client, http):
    messages = [{"role": "user", "content": "Say hello."}]
    message = client.messages.create(model=MODEL, max_tokens=16, messages=messages, **GREEDY)
    assert message.role == "assistant" and message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens > 0 and message.usage.input_tokens + message.usage.cache_read_input_tokens > 0

    with client.messages.stream(model=MODEL, max_tokens=16, messages=messages, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == message.content[0].text, "temperature 0 is deterministic"
    assert final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens

    validated = validate_anthropic_stream(stream_raw(http, max_tokens=16, messages=messages))
    assert validated.content[0].text == message.content[0].text


def test_system_blocks_and_max_tokens(http):
    system = [{"type": "text", "text": "You are a storyteller."},
              {"type": "text", "text": "Be vivid.", "cache_control": {"type": "ephemeral"}}]
    body = create(http, max_tokens=4, system=system,
                  messages=[{"role": "user", "content": [{"type": "text", "text": "Tell a long story."}]}])
    assert body["stop_reason"] == "max_tokens" and body["usage"]["output_tokens"] == 4
    events = stream_raw(http, max_tokens=4, system="You are a storyteller.",
                        messages=[{"role": "user", "content": "Tell a long story."}])
    assert validate_anthropic_stream(events).stop_reason == "max_tokens"


def test_stop_sequence_is_reported_and_max_tokens_is_a_ceiling(http):
    """Claude Code sends max_tokens far above a local context window: it is
    clamped, not refused. The stop sequence that ended the text is named,
    as Anthropic does (and the earliest one wins)."""
    messages = [{"role": "user", "content": "Write the numbers 1, 2, 3."}]
    body = create(http, max_tokens=32000, stop_sequences=["zzz", ","], messages=messages)
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == ",", body
    assert "," not in body["content"][0]["text"]
    final = validate_anthropic_stream(stream_raw(http, max_tokens=32000, stop_sequences=[","], messages=messages))
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == ","
    # Chat Completions and Responses keep refusing a max_tokens that cannot fit.
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 32000, "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_tool_result_is_error_is_told_to_the_model(http):
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": [use]}]
    failed = [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "timeout", "is_error": True}]
    fine = [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "timeout"}]

    def count(result: list) -> int:
        r = http.post("/v1/messages/count_tokens", json={"model": MODEL, "tools": [WEATHER],
                                                         "messages": messages + [{"role": "user", "content": result}]})
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    assert count(failed) > count(fine)


def test_tool_result_turn(client, http):
    """A replayed tool_use and its tool_result are accepted and answered.
    (What the 135M model answers is its own business: at the time of
    writing, four tokens the engine does not surface as text.)"""
    message = client.messages.create(model=MODEL, max_tokens=16, tools=[WEATHER], messages=TOOL_HISTORY, **GREEDY)
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert message.usage.output_tokens > 0
    with client.messages.stream(model=MODEL, max_tokens=16, tools=[WEATHER], messages=TOOL_HISTORY,
                                **GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content == message.content and final.stop_reason == message.stop_reason
    events = stream_raw(http, max_tokens=16, tools=[WEATHER], messages=TOOL_HISTORY)
    assert validate_anthropic_stream(events).content == message.content


def test_forced_tool_use(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # One call per turn: offered parallel calls, the 135M model repeats its call until the cap.
    forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    message = client.messages.create(model=MODEL, max_tokens=48, tools=[WEATHER], tool_choice=forced,
                                     messages=messages, **GREEDY)
    assert message.stop_reason == "tool_use"
    use = [b for b in message.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and use.id and isinstance(use.input.get("city"), str)
    with client.messages.stream(model=MODEL, max_tokens=48, tools=[WEATHER],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                messages=messages, **GREEDY) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"][0]
    assert final.stop_reason == "tool_use" and streamed.input == use.input


def test_tool_loop_reuses_the_prior_context(http):
    """Anthropic clients replay a call's ``input`` as a parsed object, so its
    JSON comes back re-serialized, not as sampled; the engine renders past
    calls with canonical JSON, so the continuation still matches."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    one_call = {"type": "any", "disable_parallel_tool_use": True}
    first = create(http, max_tokens=48, tools=[WEATHER], tool_choice=one_call, messages=messages)
    assert first["stop_reason"] == "tool_use"
    use = [b for b in first["content"] if b["type"] == "tool_use"][0]
    messages += [{"role": "assistant", "content": first["content"]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "Sunny"}]}]
    second = create(http, max_tokens=12, tools=[WEATHER], messages=messages)
    u = first["usage"]
    assert_reused(second["usage"]["cache_read_input_tokens"], prompt_tokens(u) + u["output_tokens"])


def test_multi_turn_reuses_the_prior_context(http):
    messages = [{"role": "user", "content": "Name an animal."}]
    prior = None
    for _ in range(3):
        body = create(http, max_tokens=12, messages=messages)
        u = body["usage"]
        if prior is not None:
            assert_reused(u["cache_read_input_tokens"], prior)
            # Anthropic's input_tokens is only what was prefilled for this turn.
            assert u["input_tokens"] == prompt_tokens(u) - u["cache_read_input_tokens"]
        prior = prompt_tokens(u) + u["output_tokens"]
        messages += [{"role": "assistant", "content": body["content"]},
                     {"role": "user", "content": "Another one."}]


def test_chat_then_messages_continues_from_the_cache(http):
    chat = http.post("/v1/chat/completions", json={
        "model": MODEL, "temperature": 0, "max_tokens": 12,
        "messages": [{"role": "user", "content": "Name a city."}]}).json()
    text = chat["choices"][0]["message"]["content"]
    body = create(http, max_tokens=8, messages=[{"role": "user", "content": "Name a city."},
                                                {"role": "assistant", "content": text},
                                                {"role": "user", "content": "Another one."}])
    u = chat["usage"]
    assert_reused(body["usage"]["cache_read_input_tokens"], u["prompt_tokens"] + u["completion_tokens"])


def test_count_tokens_matches_the_prompt(client, http):
    body = {"system": "You are brief.", "messages": [{"role": "user", "content": "Name a planet."}]}
    counted = client.messages.count_tokens(model=MODEL, **body)
    message = create(http, max_tokens=2, **body)
    assert counted.input_tokens == prompt_tokens(message["usage"])
    with_tools = http.post("/v1/messages/count_tokens", json={"model": MODEL, "tools": [WEATHER], **body}).json()
    assert with_tools["input_tokens"] > counted.input_tokens, "tool definitions are part of the prompt"


def gens(server):
    return server.generations()


ERRORS = [
    ("missing max_tokens", {"max_tokens": None}, 400, "invalid_request_error"),
    ("unknown parameter", {"frobnicate": 1}, 400, "invalid_request_error"),
    ("unknown role in messages", {"messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_request_error"),
    ("orphan tool_result", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}]}]}, 400, "invalid_request_error"),
    ("image block", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     400, "invalid_request_error"),
    ("unknown model", {"model": "no-such-model"}, 404, "not_found_error"),
    ("context exceeded", {"messages": [{"role": "user", "content": "word " * 5000}]}, 400, "invalid_request_error"),
]


@pytest.mark.parametrize("desc,body,status,kind", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_in_anthropic_shape(server, http, desc, body, status, kind):
    before = gens(server)
    payload = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **body}
    r = http.post("/v1/messages", json={k: v for k, v in payload.items() if v is not None})
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]
    assert set(err) == {"type", "error"}
    assert gens(server) == before, "a refused request must not generate"


def test_transport_errors_in_anthropic_shape(http):
    r = http.post("/v1/messages", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.get("/v1/messages")
    assert r.status_code == 405 and r.json() == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "GET is not allowed on /v1/messages."}}
    r = http.post("/v1/messages/count_tokens", json={"model": "no-such-model", "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_sdk_raises_typed_errors(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "word " * 5000}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}])


def test_x_api_key_auth(keyed_server):
    """x-api-key and Bearer on the shared keyed process (tests/conftest.py)."""
    srv = keyed_server
    good = anthropic.Anthropic(base_url=srv.url, api_key="alice-key", max_retries=0, timeout=60)
    assert good.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
    message = good.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert message.usage.output_tokens > 0
    bad = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 401
    assert info.value.body["error"]["type"] == "authentication_error"
    # A stale Bearer token next to a valid x-api-key does not lock the client out.
    both = httpx.post(srv.url + "/v1/messages/count_tokens", timeout=60,
                      headers={"Authorization": "Bearer stale", "x-api-key": "alice-key"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert both.status_code == 200, both.text
    # Unknown /v1/messages routes answer in Anthropic's error shape too.
    r = httpx.post(srv.url + "/v1/messages/batches", headers={"x-api-key": "alice-key"}, json={}, timeout=60)
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
