"""The neutral conversation -> a Chat Completions request body.

This is the request half of the bridge: it decides what the provider sees
(messages, tools, tool_choice, response_format) and what the stream half
may release (the allowlist of provider function names and which of them
wrap a custom tool). Nothing here does I/O.

Custom tools (Codex's ``apply_patch``) have no Chat Completions shape, so
each becomes a strict function whose one parameter carries the raw input:
``{"input": "<raw>"}``. The bridge unwraps calls to it back into
``custom_tool_call`` events; a client never sees the wrapper. History is
replayed the same way, so the provider sees one consistent convention.

Names: a Responses tool name may contain ``.`` and ``:``, which strict
providers refuse (``^[A-Za-z0-9_-]{1,64}$``). Such names get a stable
provider alias and are mapped back on release. Chat Completions has no
namespaces: a namespace's member is offered, and replayed, under its
qualified name (``core.conversation.qualify``), and its calls come back
with the plain name and the namespace apart.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from lmspd.core.conversation import (
    Conversation,
    CustomTool,
    FunctionTool,
    Message,
    Reasoning,
    ToolCall,
    ToolOutput,
    member_name,
    qualify,
)
from lmspd.core.errors import invalid
from lmspd.core.events import ToolKind

__all__ = ["ProviderRequest", "ProviderProfile", "PROFILES", "PublicTool", "build_chat_request", "provider_name"]

_PROVIDER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
# A custom tool's description tells the model how to call the wrapper; the
# grammar, when there is one, is what the raw input must follow. Bounded so
# that a huge grammar cannot crowd out the prompt.
_MAX_GRAMMAR_CHARS = 16 * 1024


@dataclass(frozen=True)
class ProviderProfile:
    """The few places where providers disagree on the Chat Completions shape."""

    name: str
    # ``json_schema``: OpenAI's {"type": "json_schema", "json_schema": {...}}.
    # ``json_object_schema``: {"type": "json_object", "schema": {...}}
    # (llama-cpp-python's server accepts only this).
    schema_format: Literal["json_schema", "json_object_schema"] = "json_schema"
    # OpenAI's reasoning models refuse ``max_tokens``; most others know only it.
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"
    # Ask for a final usage chunk (``stream_options.include_usage``).
    stream_usage: bool = True
    # ``allowed_tools`` in tool_choice is recent; elsewhere the allowed subset
    # is sent as the tools list itself (the bridge enforces it either way).
    native_allowed_tools: bool = False
    # An assistant turn that is only tool calls has ``"content": null`` per
    # OpenAI; some servers' schemas demand a string there.
    null_assistant_content: bool = True


PROFILES: dict[str, ProviderProfile] = {
    # vLLM, SGLang, llama.cpp's llama-server, Ollama, most gateways.
    "generic": ProviderProfile("generic"),
    "openai": ProviderProfile("openai", max_tokens_field="max_completion_tokens", native_allowed_tools=True),
    "llama-cpp-python": ProviderProfile("llama-cpp-python", schema_format="json_object_schema",
                                        null_assistant_content=False),
}


@dataclass(frozen=True)
class PublicTool:
    """What the client declared behind one provider function name."""

    # Within ``namespace``, as the client's calls carry it.
    name: str
    kind: ToolKind
    namespace: str | None = None


@dataclass
class ProviderRequest:
    body: dict[str, Any]
    # Provider function names the bridge may release (functions only).
    allowed_function_names: frozenset[str] = frozenset()
    # Provider function names that wrap a custom tool, each to the name the
    # bridge releases its calls under: that provider name too, which
    # ``tools`` maps to the client's tool as it does a function's.
    custom_wrappers: dict[str, str] = field(default_factory=dict)
    # Provider function name -> public identity, for every declared tool.
    tools: dict[str, PublicTool] = field(default_factory=dict)


def provider_name(name: str) -> str:
    """A tool name a strict provider accepts; stable, and the identity for
    names that already are acceptable."""
    if _PROVIDER_NAME.match(name):
        return name
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:10]
    return f"{_UNSAFE.sub('_', name)[:53]}_{digest}"


def build_chat_request(
    conversation: Conversation, upstream_model: str, profile: ProviderProfile = PROFILES["generic"]
) -> ProviderRequest:
    request = ProviderRequest(body={"model": upstream_model})
    tools_json = _tools(conversation, request, profile)
    body = request.body
    body["messages"] = _messages(conversation, profile)
    if tools_json:
        body["tools"] = tools_json
        choice = _tool_choice(conversation, request, profile)
        if choice is not None:
            body["tool_choice"] = choice
        if conversation.parallel_tool_calls is False:
            body["parallel_tool_calls"] = False
    fmt = _response_format(conversation, profile)
    if fmt is not None:
        body["response_format"] = fmt
    sampling = conversation.sampling
    if sampling.temperature is not None:
        body["temperature"] = sampling.temperature
    if sampling.top_p is not None:
        body["top_p"] = sampling.top_p
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    # (lmspd's extension; vLLM, SGLang and llama.cpp's server take both.)
    if sampling.top_k is not None:
        body["top_k"] = sampling.top_k
    if sampling.min_p is not None:
        body["min_p"] = sampling.min_p
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if conversation.max_output_tokens is not None:
        body[profile.max_tokens_field] = conversation.max_output_tokens
    if conversation.reasoning_effort is not None:
        body["reasoning_effort"] = conversation.reasoning_effort
    body["stream"] = True
    if profile.stream_usage:
        body["stream_options"] = {"include_usage": True}
    return request


# -- tools ----------------------------------------------------------------------


def _tools(conversation: Conversation, request: ProviderRequest, profile: ProviderProfile) -> list[dict[str, Any]]:
    choice = conversation.tool_choice
    allowed = None if choice.allowed is None else set(choice.allowed)
    out: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for tool in conversation.tools:
        name = provider_name(tool.name)
        if name in seen:
            raise invalid(
                f"Tools {seen[name]!r} and {tool.name!r} map to the same provider function name {name!r}.", "tools"
            )
        seen[name] = tool.name
        request.tools[name] = PublicTool(member_name(tool), "custom" if isinstance(tool, CustomTool) else "function",
                                         tool.namespace)
        function = _custom_wrapper(tool, name) if isinstance(tool, CustomTool) else _function(tool, name)
        offered = allowed is None or tool.name in allowed
        if offered and choice.mode != "none":
            if isinstance(tool, CustomTool):
                request.custom_wrappers[name] = name
            else:
                request.allowed_function_names |= {name}
        # Without native allowed_tools the provider sees only what it may
        # call; with it, the full list stays (its prefix cache keeps hitting).
        if offered or profile.native_allowed_tools:
            out.append({"type": "function", "function": function})
    return out


def _function(tool: FunctionTool, name: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = tool.parameters if tool.parameters is not None else {"type": "object", "properties": {}}
    if tool.strict:
        function["strict"] = True
    return function


def _custom_wrapper(tool: CustomTool, name: str) -> dict[str, Any]:
    lines = [tool.description or f"The {tool.name} tool."]
    lines.append('Call it with a JSON object whose only key "input" holds the raw input text.')
    grammar = tool.grammar
    if grammar and grammar.get("definition"):
        definition = grammar["definition"][:_MAX_GRAMMAR_CHARS]
        lines.append(f"The input must match this {grammar.get('syntax', 'lark')} grammar:\n{definition}")
    return {
        "name": name,
        "description": "\n\n".join(lines),
        "parameters": {
            "type": "object",
            "properties": {"input": {"type": "string", "description": f"The raw input for {tool.name}."}},
            "required": ["input"],
            "additionalProperties": False,
        },
        "strict": True,
    }


def _tool_choice(conversation: Conversation, request: ProviderRequest, profile: ProviderProfile) -> Any:
    choice = conversation.tool_choice
    callable_names = sorted(request.allowed_function_names | request.custom_wrappers.keys())
    if choice.mode == "none":
        return "none"
    if choice.allowed is not None and profile.native_allowed_tools:
        return {
            "type": "allowed_tools",
            "allowed_tools": {
                "mode": choice.mode,
                "tools": [{"type": "function", "function": {"name": n}} for n in callable_names],
            },
        }
    if choice.mode == "required":
        if choice.allowed is not None and len(callable_names) == 1:
            return {"type": "function", "function": {"name": callable_names[0]}}
        return "required"
    return "auto"


# -- messages -------------------------------------------------------------------


def _messages(conversation: Conversation, profile: ProviderProfile) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if conversation.instructions:
        out.append({"role": "system", "content": conversation.instructions})
    # The assistant turn being assembled: Chat Completions puts reasoning,
    # text and tool calls of one turn into one message.
    turn: dict[str, Any] | None = None

    def flush() -> None:
        nonlocal turn
        # Reasoning with nothing after it has no message to ride on: dropped.
        if turn is not None and (turn.get("content") is not None or turn.get("tool_calls")):
            if turn["content"] is None and not profile.null_assistant_content:
                turn["content"] = ""
            out.append(turn)
        turn = None

    for item in conversation.items:
        if isinstance(item, Message):
            if item.role != "assistant":
                flush()
                # "developer" is OpenAI's newer name for system; many
                # providers' chat templates know only "system".
                role = "system" if item.role in ("system", "developer") else item.role
                out.append({"role": role, "content": item.text})
                continue
            if turn is None or turn.get("content") is not None or turn.get("tool_calls"):
                flush()
                turn = {"role": "assistant", "content": None}
            turn["content"] = item.text
        elif isinstance(item, Reasoning):
            flush()
            if item.text:
                # Providers that stream reasoning_content take it back the
                # same way (DeepSeek, vLLM, llama-server); it keeps their
                # prompt identical to what they generated. Summaries and
                # encrypted blobs mean nothing to them.
                turn = {"role": "assistant", "content": None, "reasoning_content": item.text}
        elif isinstance(item, ToolCall):
            if turn is None:
                turn = {"role": "assistant", "content": None}
            name = provider_name(qualify(item.name, item.namespace))
            arguments = item.payload
            if item.kind == "custom":
                arguments = json.dumps({"input": item.payload}, ensure_ascii=False)
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            )
        elif isinstance(item, ToolOutput):
            flush()
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    flush()
    return out


# -- structured output ------------------------------------------------------------


def _response_format(conversation: Conversation, profile: ProviderProfile) -> dict[str, Any] | None:
    fmt = conversation.output_format
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type != "json_schema":
        return None
    if profile.schema_format == "json_object_schema":
        return {"type": "json_object", "schema": fmt.schema}
    spec: dict[str, Any] = {"name": provider_name(fmt.name or "output"), "schema": fmt.schema}
    if fmt.strict:
        spec["strict"] = True
    return {"type": "json_schema", "json_schema": spec}
