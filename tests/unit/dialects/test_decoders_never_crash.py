"""Every request decoder, fed any JSON: it either decodes or refuses with an
``ApiError`` carrying a 4xx status. A wrong type anywhere (a list where a
name belongs, an object where a string does) must never become a 500.

The bodies start from a valid request of each dialect and replace one value
somewhere inside with arbitrary JSON, so the decoders get past their first
checks and into the nested ones."""

from __future__ import annotations

import copy
from typing import Any, Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmspd.core.errors import ApiError
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.dialects import anthropic_messages, chat_completions, lmsp, openai_responses
from support.mutation import json_values, paths, replaced

FUNCTION = {"type": "function", "name": "lookup", "description": "d",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}

RESPONSES = {
    "model": "m", "instructions": "be brief", "temperature": 0.5, "max_output_tokens": 16,
    "tools": [FUNCTION, {"type": "custom", "name": "apply_patch", "format": {"type": "text"}}],
    "tool_choice": {"type": "function", "name": "lookup"},
    "text": {"format": {"type": "json_schema", "name": "r", "schema": {"type": "object"}}},
    "reasoning": {"effort": "low"}, "metadata": {"k": "v"}, "include": ["reasoning.encrypted_content"],
    "input": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "t"}]},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "r"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
    ],
}
LMSP = {
    "model": "m", "temperature": 0.5, "max_output_tokens": 16, "tools": [FUNCTION],
    "tool_choice": {"type": "function", "name": "lookup"}, "parallel_tool_calls": False,
    "response_format": {"type": "json_schema", "name": "r", "schema": {"type": "object"}},
    "extensions": {"lmspd.sampling": {"seed": 1}, "lmspd.cache": {"reuse": False}},
    "input": RESPONSES["input"],
}
CHAT = {
    "model": "m", "temperature": 0.5, "max_completion_tokens": 16, "stop": ["x"], "seed": 1,
    "stream": True, "stream_options": {"include_usage": True},
    "tools": [{"type": "function", "function": {"name": "lookup", "parameters": FUNCTION["parameters"]}}],
    "tool_choice": {"type": "function", "function": {"name": "lookup"}},
    "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}},
    "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "r"},
    ],
}
ANTHROPIC = {
    "model": "m", "max_tokens": 16, "temperature": 0.5, "stop_sequences": ["x"],
    "system": [{"type": "text", "text": "s"}], "metadata": {"user_id": "u"},
    "tools": [{"name": "lookup", "description": "d", "input_schema": FUNCTION["parameters"]}],
    "tool_choice": {"type": "tool", "name": "lookup", "disable_parallel_tool_use": True},
    "thinking": {"type": "enabled", "budget_tokens": 16},
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "sig"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"}]},
    ],
}

# The other shapes of tool_choice and content.
CHAT_ALLOWED = {**CHAT, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
    "mode": "auto", "tools": [{"type": "function", "function": {"name": "lookup"}}]}}, "response_format": None}
RESPONSES_ALLOWED = {**RESPONSES, "tool_choice": {"type": "allowed_tools", "mode": "required",
                                                  "tools": [{"type": "function", "name": "lookup"}]},
                     "text": {"format": {"type": "json_object"}}}
ANTHROPIC_RESULT_BLOCKS = {**ANTHROPIC, "tool_choice": {"type": "any"}, "messages": ANTHROPIC["messages"][:2] + [
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                  "content": [{"type": "text", "text": "r"}]}]}]}

DECODERS: dict[str, tuple[dict, Callable[[dict], Any]]] = {
    "openai-responses": (RESPONSES, lambda raw: openai_responses.decode_request(raw, DEFAULT_LIMITS.request)),
    "lmsp": (LMSP, lambda raw: lmsp.decode_request(raw, DEFAULT_LIMITS.request)),
    "chat": (CHAT, lambda raw: chat_completions.decode_request(raw, DEFAULT_LIMITS.request)),
    "chat-allowed": (CHAT_ALLOWED, lambda raw: chat_completions.decode_request(raw, DEFAULT_LIMITS.request)),
    "responses-allowed": (RESPONSES_ALLOWED, lambda raw: openai_responses.decode_request(raw, DEFAULT_LIMITS.request)),
    "anthropic-results": (ANTHROPIC_RESULT_BLOCKS,
                          lambda raw: anthropic_messages.decode_request(raw, DEFAULT_LIMITS.request)),
    "anthropic": (ANTHROPIC, lambda raw: anthropic_messages.decode_request(raw, DEFAULT_LIMITS.request)),
    "anthropic-count": (ANTHROPIC, lambda raw: anthropic_messages.decode_count_tokens(
        {k: v for k, v in raw.items() if k != "max_tokens"} if isinstance(raw, dict) else raw, DEFAULT_LIMITS.request)),
}

@st.composite
def mutated(draw: st.DrawFn, base: dict) -> dict:
    body = base
    for _ in range(draw(st.integers(1, 2))):
        places = paths(body)
        path = draw(st.sampled_from(places[1:] if len(places) > 1 else places))
        body = replaced(body, path, draw(json_values))
    return body if isinstance(body, dict) else {"model": "m", "input": body}


def _check(decode: Callable[[dict], Any], body: dict) -> None:
    try:
        decode(body)
    except ApiError as exc:
        assert 400 <= exc.status < 500, (exc.status, exc.code, exc.message)


def _test(name: str) -> Callable[[], None]:
    base, decode = DECODERS[name]

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(mutated(base))
    def test(body: dict) -> None:
        _check(decode, body)

    return test


def test_the_base_bodies_decode() -> None:
    for base, decode in DECODERS.values():
        decode(copy.deepcopy(base))


test_openai_responses_never_crash = _test("openai-responses")
test_lmsp_never_crash = _test("lmsp")
test_chat_completions_never_crash = _test("chat")
test_anthropic_messages_never_crash = _test("anthropic")
test_anthropic_count_tokens_never_crash = _test("anthropic-count")
test_chat_allowed_tools_never_crash = _test("chat-allowed")
test_responses_allowed_tools_never_crash = _test("responses-allowed")
test_anthropic_tool_result_blocks_never_crash = _test("anthropic-results")
