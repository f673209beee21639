"""Conversation -> Chat Completions JSON: exactly what the provider sees."""

from __future__ import annotations

import json

import pytest

from lmspd.core.conversation import (
    Conversation,
    CustomTool,
    FunctionTool,
    Message,
    OutputFormat,
    Reasoning,
    Sampling,
    ToolCall,
    ToolChoice,
    ToolOutput,
)
from lmspd.core.errors import ApiError
from lmspd.engines.upstream.request import PROFILES, PublicTool, build_chat_request, provider_name

LOOKUP = FunctionTool(name="lookup", description="Look up.", parameters={"type": "object", "properties": {}})
PATCH = CustomTool(name="apply_patch", description="Apply a patch.",
                   grammar={"syntax": "lark", "definition": 'start: "*** Begin Patch"'})


def build(**kw):
    kw.setdefault("items", [Message(role="user", text="hi")])
    return build_chat_request(Conversation(model="served", **kw), "provider-model")


def test_plain_request():
    body = build(instructions="Be brief.", sampling=Sampling(temperature=0.2, top_p=0.9, seed=3, stop=["\n"]),
                 max_output_tokens=64).body
    assert body == {
        "model": "provider-model",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "temperature": 0.2, "top_p": 0.9, "seed": 3, "stop": ["\n"], "max_tokens": 64,
        "stream": True, "stream_options": {"include_usage": True},
    }


def test_a_requested_top_k_and_min_p_go_to_the_provider():
    """(lmspd's ``lmspd.sampling`` extension: vLLM, SGLang and llama.cpp's server take both.)"""
    body = build(sampling=Sampling(top_k=20, min_p=0.05)).body
    assert (body["top_k"], body["min_p"]) == (20, 0.05)
    assert "top_k" not in build().body and "min_p" not in build().body


def test_profiles_differ_only_where_providers_do():
    conv = Conversation(model="s", items=[Message(role="user", text="x")], max_output_tokens=5,
                        output_format=OutputFormat(type="json_schema", name="answer", schema={"type": "object"},
                                                   strict=True))
    generic = build_chat_request(conv, "m", PROFILES["generic"]).body
    openai = build_chat_request(conv, "m", PROFILES["openai"]).body
    llama = build_chat_request(conv, "m", PROFILES["llama-cpp-python"]).body
    assert generic["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"type": "object"}, "strict": True}}
    assert llama["response_format"] == {"type": "json_object", "schema": {"type": "object"}}
    assert generic["max_tokens"] == 5 and openai["max_completion_tokens"] == 5 and "max_tokens" not in openai


def test_json_object_format():
    assert build(output_format=OutputFormat(type="json_object")).body["response_format"] == {"type": "json_object"}


def test_developer_becomes_system_and_history_is_grouped_per_turn():
    items = [
        Message(role="developer", text="rules"),
        Message(role="user", text="q"),
        Reasoning(text="let me think", encrypted_content="opaque"),
        Message(role="assistant", text="checking"),
        ToolCall(call_id="call_1", name="lookup", payload='{"q":1}'),
        ToolCall(call_id="call_2", name="apply_patch", payload="*** Begin Patch", kind="custom"),
        ToolOutput(call_id="call_1", output="one"),
        ToolOutput(call_id="call_2", output="ok", kind="custom"),
        Reasoning(summary=["summary only"]),
        Message(role="assistant", text="done"),
    ]
    messages = build(items=items, tools=[LOOKUP, PATCH]).body["messages"]
    assert messages == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "checking", "reasoning_content": "let me think", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q":1}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "apply_patch", "arguments": json.dumps({"input": "*** Begin Patch"})}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "ok"},
        {"role": "assistant", "content": "done"},
    ]


def test_tools_and_custom_wrapper():
    req = build(tools=[LOOKUP, PATCH])
    tools = req.body["tools"]
    assert tools[0] == {"type": "function", "function": {
        "name": "lookup", "description": "Look up.", "parameters": {"type": "object", "properties": {}}}}
    patch = tools[1]["function"]
    assert patch["name"] == "apply_patch" and patch["strict"] is True
    assert patch["parameters"] == {"type": "object", "properties": {"input": {
        "type": "string", "description": "The raw input for apply_patch."}}, "required": ["input"],
        "additionalProperties": False}
    assert 'start: "*** Begin Patch"' in patch["description"]
    assert req.body["tool_choice"] == "auto"
    assert req.allowed_function_names == {"lookup"} and req.custom_wrappers == {"apply_patch": "apply_patch"}


@pytest.mark.parametrize("choice, expected, allowed", [
    (ToolChoice(mode="none"), "none", set()),
    (ToolChoice(mode="required"), "required", {"lookup", "search"}),
    (ToolChoice(mode="required", allowed=["search"]), {"type": "function", "function": {"name": "search"}},
     {"search"}),
    (ToolChoice(mode="auto", allowed=["search"]), "auto", {"search"}),
])
def test_tool_choice(choice, expected, allowed):
    search = FunctionTool(name="search")
    req = build(tools=[LOOKUP, search], tool_choice=choice)
    assert req.body["tool_choice"] == expected
    assert req.allowed_function_names == allowed
    offered = [t["function"]["name"] for t in req.body["tools"]]
    assert offered == (["search"] if choice.allowed else ["lookup", "search"])


def test_native_allowed_tools_keeps_the_whole_list():
    conv = Conversation(model="s", items=[Message(role="user", text="x")],
                        tools=[LOOKUP, FunctionTool(name="search")],
                        tool_choice=ToolChoice(mode="required", allowed=["search"]))
    req = build_chat_request(conv, "m", PROFILES["openai"])
    assert [t["function"]["name"] for t in req.body["tools"]] == ["lookup", "search"]
    assert req.body["tool_choice"] == {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "search"}}]}}
    assert req.allowed_function_names == {"search"}


def test_parallel_tool_calls_false_is_sent():
    assert build(tools=[LOOKUP], parallel_tool_calls=False).body["parallel_tool_calls"] is False
    assert "parallel_tool_calls" not in build(tools=[LOOKUP]).body


def test_names_a_strict_provider_refuses_get_stable_aliases():
    dotted = FunctionTool(name="fs.read:v2")
    alias = provider_name("fs.read:v2")
    assert alias != "fs.read:v2" and alias == provider_name("fs.read:v2") and len(alias) <= 64
    req = build(tools=[dotted])
    assert req.body["tools"][0]["function"]["name"] == alias
    assert req.tools[alias].name == "fs.read:v2"
    assert provider_name("x" * 80) != "x" * 80 and len(provider_name("x" * 80)) <= 64


def test_namespaced_tools_are_offered_qualified_and_map_back_plain():
    """Chat Completions has no namespaces: the provider sees one qualified
    name, for the tool and for each replayed call, and a call it makes maps
    back to the member's own name and its namespace, custom tools too."""
    spawn = FunctionTool(name="multi_agent_v1__spawn_agent", namespace="multi_agent_v1")
    patch = CustomTool(name="functions__apply_patch", namespace="functions")
    # A member whose own name begins as its namespace does is still qualified.
    nested = FunctionTool(name="ns__ns__f", namespace="ns")
    items = [Message(role="user", text="go"),
             ToolCall(call_id="c1", name="spawn_agent", namespace="multi_agent_v1", payload="{}"),
             ToolOutput(call_id="c1", output="ok"),
             ToolCall(call_id="c2", name="apply_patch", namespace="functions", payload="*** Begin Patch",
                      kind="custom"),
             ToolOutput(call_id="c2", output="ok"),
             ToolCall(call_id="c3", name="ns__f", namespace="ns", payload="{}")]
    req = build(items=items, tools=[spawn, patch, nested])
    assert [t["function"]["name"] for t in req.body["tools"]] == [
        "multi_agent_v1__spawn_agent", "functions__apply_patch", "ns__ns__f"]
    assert req.tools["multi_agent_v1__spawn_agent"] == PublicTool("spawn_agent", "function", "multi_agent_v1")
    assert req.tools["functions__apply_patch"] == PublicTool("apply_patch", "custom", "functions")
    assert req.tools["ns__ns__f"] == PublicTool("ns__f", "function", "ns")
    assert req.custom_wrappers == {"functions__apply_patch": "functions__apply_patch"}
    names = [m["tool_calls"][0]["function"]["name"] for m in req.body["messages"] if m.get("tool_calls")]
    assert names == ["multi_agent_v1__spawn_agent", "functions__apply_patch", "ns__ns__f"]


def test_alias_collision_is_a_400():
    with pytest.raises(ApiError) as caught:
        build(tools=[FunctionTool(name="a.b"), FunctionTool(name=provider_name("a.b"))])
    assert caught.value.status == 400


def test_reasoning_effort_passes_through():
    assert build(reasoning_effort="low").body["reasoning_effort"] == "low"


def test_llama_cpp_python_wants_a_string_content_next_to_tool_calls():
    conv = Conversation(model="s", items=[Message(role="user", text="q"),
                                          ToolCall(call_id="c", name="lookup", payload="{}"),
                                          ToolOutput(call_id="c", output="r")], tools=[LOOKUP])
    assert build_chat_request(conv, "m", PROFILES["generic"]).body["messages"][1]["content"] is None
    assert build_chat_request(conv, "m", PROFILES["llama-cpp-python"]).body["messages"][1]["content"] == ""
