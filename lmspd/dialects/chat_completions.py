"""OpenAI Chat Completions (``/v1/chat/completions``): request decoding and
wire encoding, over the same neutral core as the Responses dialects.

A chat request is a message list; it decodes into the neutral items
(assistant ``tool_calls`` become ``ToolCall`` items, ``role: tool`` messages
``ToolOutput`` items, ``reasoning_content`` a ``Reasoning`` item), so the
prompt it renders — and therefore the KV prefix it can reuse — is the one a
Responses request with the same history renders.

Replies follow the ``openai`` SDK's ``ChatCompletion`` and
``ChatCompletionChunk`` types; streams are data-only SSE frames ending in
``data: [DONE]``.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field, ValidationError

from lmspd.core.conversation import (
    Conversation,
    Item,
    Message,
    Reasoning,
    ToolCall,
    ToolOutput,
)
from lmspd.core.errors import ApiError, RequestField, invalid, tag, unsupported
from lmspd.core.limits import RequestLimits
from lmspd.dialects.fields import FieldNames
from lmspd.streaming import steps
from lmspd.streaming.session import ResponseState
from lmspd.streaming.steps import Step

from .common import MODERATION_REFUSAL, check_answered, check_item_count, decode_stop, neutral_effort, seed32
from .extensions import decode_extensions
from .responses_items import (
    IntDict,
    Lenient,
    StrDict,
    Strict,
    StrList,
    check_metadata,
    content_text,
    decode_json_format,
    decode_tool_choice,
    decode_tools,
    validation_error,
)

# -- request ---------------------------------------------------------------------


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class PromptCacheOptions(Strict):
    # Hints to OpenAI's prompt cache; lmspd's KV cache reuses the longest
    # prefix it holds by its own rules (as openai_responses.PromptCacheOptions).
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class ChatCompletionRequest(Strict):
    model: str = Field(min_length=1, max_length=256)
    messages: list[Any] = Field(min_length=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: Union[str, StrList, None] = None
    n: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: IntDict | None = None
    modalities: StrList | None = None
    # Bookkeeping fields: accepted, nothing to do for a local model.
    user: str | None = Field(default=None, max_length=512)
    safety_identifier: str | None = Field(default=None, max_length=512)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    metadata: StrDict | None = None
    store: bool | None = None
    service_tier: str | None = None
    extensions: dict[str, Any] | None = None
    # Accepted by OpenAI but not something lmspd can honour (refused when set).
    audio: Any = None
    prediction: Any = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None
    moderation: Any = None


class FunctionDefIn(Lenient):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(Lenient):
    type: Literal["function"]
    function: FunctionDefIn


class CallFunctionIn(Lenient):
    name: str = Field(min_length=1, max_length=256)
    arguments: str


class ToolCallIn(Lenient):
    id: str = Field(min_length=1, max_length=512)
    type: Literal["function"] = "function"
    function: CallFunctionIn


class SystemMessageIn(Lenient):
    role: Literal["system", "developer"]
    content: Union[str, list[Any]]


class UserMessageIn(Lenient):
    role: Literal["user"]
    content: Union[str, list[Any]]


class AssistantMessageIn(Lenient):
    role: Literal["assistant"]
    content: Union[str, list[Any], None] = None
    tool_calls: list[ToolCallIn] | None = None
    # Reasoning models' visible thinking, replayed by clients that keep it
    # (DeepSeek-style ``reasoning_content``; some gateways say ``reasoning``).
    reasoning_content: str | None = None
    reasoning: str | None = None


class ToolMessageIn(Lenient):
    role: Literal["tool"]
    tool_call_id: str = Field(min_length=1, max_length=512)
    content: Union[str, list[Any]]


_MESSAGE_MODELS: dict[str, type[Lenient]] = {
    "system": SystemMessageIn,
    "developer": SystemMessageIn,
    "user": UserMessageIn,
    "assistant": AssistantMessageIn,
    "tool": ToolMessageIn,
}


class ChatCompletionsRequest:
    """A decoded chat request: the neutral conversation and how to deliver it."""

    def __init__(self, body: ChatCompletionRequest, conversation: Conversation, item_paths: list[str]) -> None:
        self.body = body
        self.conversation = conversation
        # Where each neutral item came from, for errors the core raises about one.
        self.item_paths = item_paths

    @property
    def stream(self) -> bool:
        return bool(self.body.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.body.stream_options and self.body.stream_options.include_usage)

    @property
    def field_names(self) -> FieldNames:
        """What this request calls the fields the core names in its errors."""
        cap = "max_tokens" if self.body.max_completion_tokens is None else "max_completion_tokens"
        return FieldNames({RequestField.MAX_OUTPUT_TOKENS: cap, RequestField.ITEMS: "messages",
                           RequestField.OUTPUT_FORMAT: "response_format"}, self.item_paths)


def decode_request(raw: dict[str, Any], limits: RequestLimits) -> ChatCompletionsRequest:
    try:
        body = ChatCompletionRequest.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    _refuse_unhonourable(body)
    check_metadata(body.metadata, limits)
    items, paths = decode_messages(body.messages, limits)
    check_answered(items, paths, call="tool_calls entry", output="tool message")
    tools = decode_tools(_flat_tools(body.tools), limits)
    choice = decode_tool_choice(_flat_tool_choice(body.tool_choice), tools)
    extensions = decode_extensions(body.extensions)
    conversation = Conversation(
        model=body.model,
        items=items,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        output_format=decode_json_format(body.response_format, "response_format"),
        sampling=extensions.sampling(temperature=body.temperature, top_p=body.top_p, seed=seed32(body.seed),
                                     stop=decode_stop(body.stop, limits, "stop")),
        # max_tokens is the deprecated spelling; the newer field wins.
        max_output_tokens=body.max_completion_tokens or body.max_tokens,
        reasoning_effort=neutral_effort(body.reasoning_effort),
        prompt_cache_key=body.prompt_cache_key,
        cache_reuse=extensions.cache_reuse,
        speculative=extensions.speculative,
    )
    return ChatCompletionsRequest(body, conversation, paths)


def _refuse_unhonourable(body: ChatCompletionRequest) -> None:
    if body.n is not None and body.n != 1:
        raise unsupported("n", "lmspd generates one choice per request; 'n' must be 1.")
    if body.logprobs or body.top_logprobs:
        raise unsupported("logprobs" if body.logprobs else "top_logprobs",
                          "Log probabilities are not supported yet; omit 'logprobs' and 'top_logprobs'.")
    if body.logit_bias:
        raise unsupported("logit_bias")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name):
            raise unsupported(name, f"'{name}' is not supported yet; omit it or send 0.")
    if body.modalities is not None and set(body.modalities) - {"text"}:
        raise unsupported("modalities", "lmspd serves text-only models; 'modalities' may only contain 'text'.")
    if body.moderation is not None:
        raise unsupported("moderation", MODERATION_REFUSAL)
    for name in ("audio", "prediction", "functions", "function_call", "web_search_options"):
        if getattr(body, name) is not None:
            hint = " Use 'tools' and 'tool_choice' instead." if name.startswith("function") else ""
            raise unsupported(name, f"Parameter '{name}' is not supported by lmspd.{hint}")
    if body.stream_options is not None and not body.stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true.", "stream_options")


def decode_messages(raw: list[Any], limits: RequestLimits) -> tuple[list[Item], list[str]]:
    """Chat messages -> neutral items, with the wire path of each item."""
    if len(raw) > limits.max_input_items:
        raise invalid(f"'messages' has {len(raw)} entries; the limit is {limits.max_input_items}.", "messages")
    items: list[Item] = []
    paths: list[str] = []

    def add(item: Item, path: str) -> None:
        items.append(item)
        paths.append(path)
        check_item_count(len(items), path, limits, parts="reasoning and tool_calls entries")

    for i, entry in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(entry, dict):
            raise invalid(f"Invalid message at '{where}': expected an object.", where)
        role = tag(entry.get("role"), f"{where}.role")
        model = _MESSAGE_MODELS.get(role)  # type: ignore[arg-type]
        if model is None:
            hint = " Use role 'tool' with 'tool_call_id'." if role == "function" else ""
            raise invalid(f"Unsupported role {role!r} at '{where}.role'.{hint}", f"{where}.role")
        try:
            msg = model.model_validate(entry)
        except ValidationError as exc:
            raise validation_error(exc, where) from None
        if isinstance(msg, ToolMessageIn):
            add(ToolOutput(call_id=msg.tool_call_id, output=_text(msg.content, f"{where}.content", limits)), where)
        elif isinstance(msg, AssistantMessageIn):
            field = "reasoning_content" if msg.reasoning_content is not None else "reasoning"
            thinking = getattr(msg, field)
            if thinking:
                add(Reasoning(text=_checked(thinking, f"{where}.{field}", limits)), where)
            text = _text(msg.content, f"{where}.content", limits)
            # An assistant turn that only calls tools has no message item,
            # exactly as the engine's own output for that turn has none.
            if text or not msg.tool_calls:
                add(Message(role="assistant", text=text), where)
            for j, call in enumerate(msg.tool_calls or []):
                at = f"{where}.tool_calls[{j}]"
                add(ToolCall(call_id=call.id, name=call.function.name,
                             payload=_checked(call.function.arguments, f"{at}.function.arguments", limits)), at)
        else:
            assert isinstance(msg, (SystemMessageIn, UserMessageIn))
            add(Message(role=msg.role, text=_text(msg.content, f"{where}.content", limits)), where)
    return items, paths


def _text(content: Any, path: str, limits: RequestLimits) -> str:
    return _checked(content_text(content, path, limits), path, limits)


def _checked(text: str, path: str, limits: RequestLimits) -> str:
    if len(text) > limits.max_text_chars:
        raise invalid(f"'{path}' is {len(text)} characters; the limit is {limits.max_text_chars}.", path)
    return text


def _flat_tools(raw: list[Any] | None) -> list[Any] | None:
    """Chat's nested ``{type, function: {...}}`` tools, checked here (so that
    errors name the chat field), then handed to the shared tool decoder in
    the Responses shape for its limits and uniqueness rules."""
    if not raw:
        return raw
    flat: list[Any] = []
    for i, entry in enumerate(raw):
        where = f"tools[{i}]"
        if isinstance(entry, dict) and entry.get("type") != "function":
            raise invalid(f"Unsupported tool type {entry.get('type')!r} at '{where}.type'; lmspd's chat "
                          "endpoint accepts 'function' tools.", f"{where}.type")
        try:
            tool = ToolIn.model_validate(entry)
        except ValidationError as exc:
            raise validation_error(exc, where) from None
        f = tool.function
        flat.append({"type": "function", "name": f.name, "description": f.description,
                     "parameters": f.parameters, "strict": f.strict})
    return flat


def _function_name(entry: Any) -> Any:
    """``{type: function, function: {name}}`` -> the name (None if malformed)."""
    fn = entry.get("function") if isinstance(entry, dict) else None
    return fn.get("name") if isinstance(fn, dict) else None


def _flat_tool_choice(raw: Any) -> Any:
    """Chat's ``{type: function, function: {name}}`` forms in the Responses shape."""
    if not isinstance(raw, dict):
        return raw
    kind = tag(raw.get("type"), "tool_choice.type")
    if kind == "function":
        return {"type": "function", "name": _function_name(raw)}
    if kind == "allowed_tools":
        spec = raw.get("allowed_tools")
        if not isinstance(spec, dict):
            raise invalid("'tool_choice.allowed_tools' must be an object.", "tool_choice.allowed_tools")
        listed = spec.get("tools") or []
        if not isinstance(listed, list):
            raise invalid("'tool_choice.allowed_tools.tools' must be an array.", "tool_choice.allowed_tools.tools")
        tools = [{"type": "function", "name": _function_name(t)} for t in listed]
        return {"type": "allowed_tools", "mode": spec.get("mode", "auto"), "tools": tools}
    return raw


# -- encoding --------------------------------------------------------------------


def finish_reason(state: ResponseState) -> str | None:
    if state.status == "incomplete":
        return "content_filter" if state.incomplete_reason == "content_filter" else "length"
    if state.status == "completed":
        return "tool_calls" if any(isinstance(i, ToolCall) for i in state.output) else "stop"
    return None


def usage_json(state: ResponseState) -> dict[str, Any] | None:
    u = state.usage
    if u is None:
        return None
    return {
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": u.cache_write_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    }


def _tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.payload}}


def message_json(state: ResponseState) -> dict[str, Any]:
    text = "".join(i.text for i in state.output if isinstance(i, Message))
    calls = [i for i in state.output if isinstance(i, ToolCall)]
    reasoning = "".join(i.text or "" for i in state.output if isinstance(i, Reasoning))
    # OpenAI sends ``content: null`` on a turn that only calls tools.
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None,
                               "refusal": None}
    if calls:
        message["tool_calls"] = [_tool_call_json(c) for c in calls]
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def completion_json(state: ResponseState) -> dict[str, Any]:
    return {
        "id": state.id,
        "object": "chat.completion",
        "created": state.created_at,
        "model": state.model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": message_json(state), "logprobs": None,
                     "finish_reason": finish_reason(state)}],
        "usage": usage_json(state),
    }


class ChatEncoder:
    """Writes lifecycle steps as ``chat.completion.chunk`` objects.

    Chunks carry no event name or sequence number; the tool call ``index`` is
    the call's position among this reply's tool calls (not its output index),
    as Chat Completions clients accumulate arguments by it.
    """

    first_sequence_number = 0

    def __init__(self, *, include_usage: bool = False) -> None:
        self._include_usage = include_usage
        self._tool_index: dict[int, int] = {}  # output index -> tool call index

    def _chunk(self, state: ResponseState, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": state.id,
            "object": "chat.completion.chunk",
            "created": state.created_at,
            "model": state.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self._include_usage:
            chunk["usage"] = None
        return chunk

    def encode(self, step: Step, state: ResponseState, seq: int) -> tuple[str, dict[str, Any]] | None:
        match step:
            case steps.ResponseCreated():
                return "chunk", self._chunk(state, {"role": "assistant", "content": "", "refusal": None})
            case steps.TextDelta(delta=delta):
                return "chunk", self._chunk(state, {"content": delta})
            case steps.ReasoningDelta(delta=delta):
                return "chunk", self._chunk(state, {"reasoning_content": delta})
            case steps.ItemAdded(index, ToolCall() as item):
                tool_index = self._tool_index[index] = len(self._tool_index)
                return "chunk", self._chunk(state, {"tool_calls": [{
                    "index": tool_index, "id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": ""}}]})
            case steps.ToolInputDelta(index, _, delta):
                return "chunk", self._chunk(state, {"tool_calls": [{
                    "index": self._tool_index[index], "function": {"arguments": delta}}]})
            case steps.ResponseCompleted() | steps.ResponseIncomplete():
                return "chunk", self._chunk(state, {}, finish_reason(state))
            case steps.ResponseFailed() | steps.ResponseCancelled():
                error = state.error or {"code": "cancelled", "message": "The request was cancelled."}
                # OpenAI's mid-stream failure: a data object whose top-level
                # ``error`` makes the SDKs raise instead of yielding a chunk.
                return "error", ApiError(error["code"], error["message"]).openai()
        return None

    def trailer(self, state: ResponseState) -> list[tuple[str, dict[str, Any]]]:
        """After the finish chunk: the usage-only chunk ``include_usage`` asks for."""
        if not self._include_usage or state.status not in ("completed", "incomplete"):
            return []
        chunk = self._chunk(state, {})
        chunk["choices"] = []
        chunk["usage"] = usage_json(state)
        return [("chunk", chunk)]

