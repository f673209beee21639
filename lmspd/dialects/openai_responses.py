"""OpenAI Responses (``/v1/responses``): request decoding and wire encoding.

Shapes follow the ``openai`` SDK's types and the Open Responses
``ResponseResource`` schema: every required key is present, nullable ones
as ``null``, so strict clients (the Vercel AI SDK's zod schemas, typed Rust
clients) accept every object.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Union

from pydantic import Field, ValidationError

from lmspd.core import compaction
from lmspd.core.conversation import (
    Conversation,
    Item,
    Message,
    Reasoning,
    SamplingDefaults,
    ToolCall,
    ToolOutput,
)
from lmspd.core.errors import ApiError, invalid, unsupported
from lmspd.core.events import Usage
from lmspd.core.limits import MAX_RESPONSE_ID_CHARS, RequestLimits
from lmspd.streaming import steps
from lmspd.streaming.session import ResponseState
from lmspd.streaming.steps import Step

from .common import MODERATION_REFUSAL, neutral_effort
from .extensions import Extensions, decode_extensions, response_extensions
from .responses_items import (
    COMPACTION_TRIGGER,
    Expansion,
    Lenient,
    StoredContext,
    StrDict,
    Strict,
    StrList,
    additional_tools,
    additional_tools_items,
    check_metadata,
    compaction_json,
    decode_items,
    decode_json_format,
    decode_tool_choice,
    decode_tools,
    stored_history,
    validation_error,
)

SUPPORTED_INCLUDES = {
    "reasoning.encrypted_content",
    # Results of hosted tools lmspd never runs: nothing to include, nothing lost.
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "message.input_image.image_url",
}


class TextConfig(Lenient):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(Strict):
    """``include_obfuscation`` pads OpenAI's delta events against
    length side channels on the network; lmspd sends none (a server on
    loopback gains nothing from it), whatever it says."""

    include_obfuscation: bool | None = None


class CompactionSetting(Strict):
    """``context_management`` entry: compact inside the stream once the
    rendered input crosses ``compact_threshold`` tokens."""

    type: Literal["compaction"]
    compact_threshold: int | None = Field(default=None, ge=1)


class PromptCacheOptions(Strict):
    """Hints to OpenAI's prompt cache. lmspd's KV cache finds and keeps a
    request's longest reusable prefix by its own rules (``lmspd.cache``),
    with no breakpoints to choose and no lifetime to promise: ``mode``,
    ``ttl`` and ``comparison_response_id`` (diagnostics, "when the feature
    is enabled") change nothing, and nothing is echoed as applied.
    ``prewarm`` prepares the cache without generating (``OpenAIRequest.prewarm``:
    a ``generate: false`` turn, over HTTP too)."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m", "12h"] | None = None
    prewarm: bool | None = None
    comparison_response_id: str | None = Field(default=None, max_length=MAX_RESPONSE_ID_CHARS)


class ImageOptions(Strict):
    """Image context compression: lmspd's models read no images (an image in
    a tool's output reaches them as words, ``media_placeholder``), so no
    policy applies."""

    context_compression: Literal["auto", "enabled", "disabled"] | None = None


class BackgroundOptions(Strict):
    """A background response runs as soon as the model is free: within any
    completion window. ``continuation_id`` orders related background
    requests on OpenAI's side; lmspd's queue is first come, first served."""

    completion_window: Literal["soonest", "2h", "8h"] | None = None
    continuation_id: str | None = Field(default=None, max_length=512)


class AccessPrograms(Strict):
    # "standard" is how every request is served; a Daybreak program (access
    # OpenAI grants per organization) is refused (``_refuse_unhonourable``).
    cyber: Literal["standard", "daybreak_blue", "daybreak_red"] | None = None


class CreateResponse(Strict):
    model: str = Field(min_length=1, max_length=256)
    # OpenAI's schema makes these nullable: null is the default.
    input: Union[str, list[Any], None] = None
    instructions: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    background: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = Field(default=None, max_length=MAX_RESPONSE_ID_CHARS)
    conversation: Union[str, dict[str, Any], None] = None
    include: StrList | None = None
    truncation: Literal["auto", "disabled"] | None = None
    text: TextConfig | None = None
    tools: list[Any] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    max_output_tokens: int | None = Field(default=None, ge=1)
    reasoning: ReasoningConfig | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    client_metadata: dict[str, Any] | None = None
    metadata: StrDict | None = None
    user: str | None = Field(default=None, max_length=512)
    safety_identifier: str | None = Field(default=None, max_length=512)
    # Every tier is served the one way lmspd serves (the reply says
    # "default": the tier "actually used", as OpenAI reports it).
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None
    extensions: dict[str, Any] | None = None
    context_management: list[CompactionSetting] | None = Field(default=None, max_length=4)
    prompt_cache_options: PromptCacheOptions | None = None
    image: ImageOptions | None = None
    background_options: BackgroundOptions | None = None
    access_programs: AccessPrograms | None = None
    # Accepted by OpenAI but not something lmspd can honour.
    prompt: Any = None
    moderation: Any = None


class OpenAIRequest:
    """A decoded /v1/responses request: the neutral conversation plus what
    the dialect echoes back and how the response is to be delivered.
    ``input_items`` is this request's own input; ``conversation.items`` puts
    the stored history (previous response chain, conversation) before it."""

    def __init__(self, body: CreateResponse, conversation: Conversation, extensions: Extensions,
                 input_items: list[Item], *, compaction_trigger: bool = False,
                 declared_tools: list[tuple[str, Any]] | None = None,
                 tool_items: list[dict[str, Any]] | None = None) -> None:
        self.body = body
        # Tools an ``additional_tools`` item declared (this request's, or
        # its history's): a turn that continues this one inherits them.
        self.declared_tools = declared_tools or []
        # This request's own ``additional_tools`` items: stored with its
        # input, so that a continuation read from the store finds them.
        self.tool_items = tool_items or []
        self.conversation = conversation
        self.extensions = extensions
        self.input_items = input_items
        # The input ended with a compaction_trigger: this turn compacts.
        self.compaction_trigger = compaction_trigger

    @property
    def compact_threshold(self) -> int | None:
        """``context_management``'s threshold (the lowest one given)."""
        found = [c.compact_threshold for c in self.body.context_management or [] if c.compact_threshold]
        return min(found) if found else None

    @property
    def stream(self) -> bool:
        return self.body.stream is True

    @property
    def store(self) -> bool:
        return self.body.store is not False

    @property
    def background(self) -> bool:
        return bool(self.body.background)

    @property
    def prewarm(self) -> bool:
        """``prompt_cache_options.prewarm``: prepare the cache without
        generating ("overrides generate to false"): the turn prefills its
        input and keeps it, an empty completed response whose id the next
        turn continues, as a WebSocket ``generate: false`` does."""
        options = self.body.prompt_cache_options
        return options is not None and options.prewarm is True

    @property
    def previous_response_id(self) -> str | None:
        return self.body.previous_response_id

    @property
    def conversation_id(self) -> str | None:
        return conversation_id(self.body.conversation)


def conversation_id(raw: str | dict[str, Any] | None) -> str | None:
    if raw is None or isinstance(raw, str):
        return raw
    conv_id = raw.get("id")
    if not isinstance(conv_id, str) or not conv_id:
        raise invalid("'conversation.id' must be a non-empty string.", "conversation.id")
    return conv_id


def decode_request(raw: dict[str, Any], limits: RequestLimits, *,
                   context: StoredContext | None = None) -> OpenAIRequest:
    try:
        body = CreateResponse.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    _refuse_unhonourable(body)
    check_metadata(body.metadata, limits)
    raw_input, trigger = _take_compaction_trigger(body.input if body.input is not None else [])
    expansion = Expansion(limits)
    if body.instructions is not None:
        expansion.add_text(body.instructions, "instructions")
    items = decode_items(raw_input, limits,
                         resolve_reference=context.resolve_reference if context is not None else None,
                         open_compaction=context.open_compaction if context is not None else None,
                         expansion=expansion, additional_tools=True)
    conv_id = conversation_id(body.conversation)
    history = stored_history(context, body.previous_response_id, conv_id, expansion)
    # Codex's Responses Lite declares its tools in the input instead; the
    # item is part of the conversation, so a continuation keeps its tools
    # (until an item of its own declares others), as it keeps its messages.
    declared = additional_tools(raw_input)
    if not declared and context is not None and (body.previous_response_id is not None or conv_id is not None):
        declared = context.declared_tools(body.previous_response_id, conv_id)
    tools = decode_tools(body.tools, limits, more=declared)
    choice = decode_tool_choice(body.tool_choice, tools)
    fmt = decode_json_format(body.text.format if body.text else None, "text.format")
    extensions = decode_extensions(body.extensions)
    conversation = Conversation(
        model=body.model,
        # Before a compaction item, only the client's own messages remain.
        items=compaction.effective_items(history + items),
        instructions=body.instructions,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        output_format=fmt,
        sampling=extensions.sampling(temperature=body.temperature, top_p=body.top_p),
        max_output_tokens=body.max_output_tokens,
        truncate=body.truncation == "auto",
        reasoning_effort=neutral_effort(body.reasoning.effort if body.reasoning else None),
        include_encrypted_reasoning="reasoning.encrypted_content" in (body.include or []),
        prompt_cache_key=body.prompt_cache_key,
        previous_response_id=body.previous_response_id,
        conversation_id=conv_id,
        cache_reuse=extensions.cache_reuse,
        speculative=extensions.speculative,
        require_reasoning_state=True,
    )
    return OpenAIRequest(body, conversation, extensions, items, compaction_trigger=trigger, declared_tools=declared,
                         tool_items=[entry for _, entry in additional_tools_items(raw_input)])


def _take_compaction_trigger(raw: str | list[Any]) -> tuple[str | list[Any], bool]:
    """Codex's remote compaction: ``{"type": "compaction_trigger"}`` as the
    last input item asks this turn to compact (it is never stored as an item)."""
    if isinstance(raw, list) and raw and isinstance(raw[-1], dict) and raw[-1].get("type") == COMPACTION_TRIGGER:
        return raw[:-1], True
    return raw, False


def _refuse_unhonourable(body: CreateResponse) -> None:
    if body.prompt is not None:
        raise unsupported("prompt", "Reusable prompts ('prompt') are an OpenAI-hosted feature; send 'input' instead.")
    if body.moderation is not None:
        raise unsupported("moderation", MODERATION_REFUSAL)
    if body.access_programs is not None and body.access_programs.cyber not in (None, "standard"):
        raise unsupported("access_programs.cyber",
                          f"Access program {body.access_programs.cyber!r} is access OpenAI grants to its own models; "
                          "lmspd serves every request as 'standard'.")
    window = body.background_options.completion_window if body.background_options is not None else None
    if window in ("2h", "8h") and (not body.background or body.stream):
        # OpenAI's own rule for the discounted windows.
        raise invalid(f"'background_options.completion_window: {window}' needs 'background: true' and no "
                      "streaming.", "background_options.completion_window")
    if body.top_logprobs:
        raise unsupported("top_logprobs", "Log probabilities are not supported yet; omit 'top_logprobs'.")
    for i, name in enumerate(body.include or []):
        if name not in SUPPORTED_INCLUDES:
            raise unsupported(f"include[{i}]", f"include value {name!r} is not supported.")
    if body.conversation is not None and body.previous_response_id is not None:
        raise invalid("'conversation' and 'previous_response_id' cannot be used together.", "previous_response_id")


def echo_fields(req: OpenAIRequest, sampling: SamplingDefaults) -> dict[str, Any]:
    """The request fields a Response object reports back; the temperature
    and top-p it samples with where the request gave none (the model's own,
    ``sampling``, or 1.0)."""
    b = req.body
    fmt = (b.text.format if b.text and b.text.format else None) or {"type": "text"}
    text: dict[str, Any] = {"format": fmt}
    if b.text and b.text.verbosity:
        text["verbosity"] = b.text.verbosity
    reasoning = None
    if b.reasoning is not None:
        reasoning = {"effort": b.reasoning.effort, "summary": b.reasoning.summary or b.reasoning.generate_summary}
    echo = {
        "instructions": b.instructions,
        "max_output_tokens": b.max_output_tokens,
        "max_tool_calls": b.max_tool_calls,
        "metadata": b.metadata or {},
        "parallel_tool_calls": b.parallel_tool_calls is not False,
        "previous_response_id": b.previous_response_id,
        "prompt_cache_key": b.prompt_cache_key,
        "reasoning": reasoning,
        "safety_identifier": b.safety_identifier,
        "service_tier": "default",
        "store": req.store,
        "background": bool(b.background),
        "temperature": sampling.temperature_of(req.conversation.sampling),
        "text": text,
        "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
        "tools": [_echo_tool(t) for t in (b.tools or [])],
        "top_logprobs": b.top_logprobs or 0,
        "top_p": sampling.top_p_of(req.conversation.sampling),
        "truncation": b.truncation or "disabled",
        "user": b.user,
    }
    if b.prompt_cache_retention is not None:
        echo["prompt_cache_retention"] = b.prompt_cache_retention
    if req.conversation_id is not None:
        echo["conversation"] = {"id": req.conversation_id}
    return echo


def _echo_tool(tool: Any) -> Any:
    """Function tools carry every field of the Open Responses FunctionTool
    (``description``, ``parameters``, ``strict``: null where not given)."""
    if isinstance(tool, dict) and tool.get("type") == "function":
        return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                "parameters": tool.get("parameters"), "strict": tool.get("strict"),
                **{k: v for k, v in tool.items() if k not in ("type", "name", "description", "parameters", "strict")}}
    return tool


# What a Response reports for a request that did not come through this
# dialect (an LMSP response read back here): every required key, neutral values.
DEFAULT_ECHO: dict[str, Any] = {
    "instructions": None, "max_output_tokens": None, "max_tool_calls": None, "metadata": {},
    "parallel_tool_calls": True, "previous_response_id": None, "prompt_cache_key": None, "reasoning": None,
    "safety_identifier": None, "service_tier": "default", "store": True, "background": False,
    "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
    "top_logprobs": 0, "top_p": 1.0, "truncation": "disabled", "user": None,
}


# -- encoding --------------------------------------------------------------------


def summarizes(state: ResponseState) -> bool:
    """Whether the request asked for reasoning summaries (``reasoning.summary``:
    auto, concise, detailed): its reasoning items then carry the reasoning as
    ``summary_text`` parts, streamed as ``reasoning_summary_*`` events, instead
    of ``reasoning_text`` content. A local model writes no separate summary:
    its reasoning, in full, is the summary it gives."""
    reasoning = state.echo.get("reasoning")
    return isinstance(reasoning, dict) and bool(reasoning.get("summary"))


def item_json(item: Message | ToolCall | Reasoning, *, summarize: bool = False) -> dict[str, Any]:
    if isinstance(item, Message) and item.compaction is not None:
        return compaction_json(item)
    if isinstance(item, Message):
        content = [] if item.status == "in_progress" and not item.text else [_text_part(item.text)]
        out = {"id": item.id, "type": "message", "status": item.status, "role": "assistant", "content": content}
        if item.phase:
            out["phase"] = item.phase
        return out
    if isinstance(item, ToolCall):
        if item.kind == "custom":
            out = {"id": item.id, "type": "custom_tool_call", "status": item.status, "call_id": item.call_id,
                   "name": item.name, "input": item.payload}
        else:
            out = {"id": item.id, "type": "function_call", "status": item.status, "call_id": item.call_id,
                   "name": item.name, "arguments": item.payload}
        if item.namespace:
            out["namespace"] = item.namespace
        return out
    summary = item.summary or ([item.text] if summarize and item.text else [])
    out = {
        "id": item.id,
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": s} for s in summary],
        "status": item.status,
    }
    if item.text is not None and not summarize:
        # As a message: an item just added has no part yet; its
        # content_part.added brings the first (else a client that adds
        # parts as announced ends up with two).
        empty = item.status == "in_progress" and not item.text
        out["content"] = [] if empty else [{"type": "reasoning_text", "text": item.text}]
    if item.encrypted_content is not None:
        out["encrypted_content"] = item.encrypted_content
    return out


def error_event(exc: ApiError, seq: int) -> dict[str, Any]:
    """The stream's ``error`` event (the SDK's ``ResponseErrorEvent``)."""
    return {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param, "sequence_number": seq}


def input_item_json(item: Item) -> dict[str, Any]:
    """A request's input item as stored and listed (``input_items``,
    conversation items): the shapes the ``openai`` SDK's ``ResponseItem`` reads."""
    if isinstance(item, Message) and item.compaction is not None:
        return compaction_json(item)
    if isinstance(item, Message) and item.role != "assistant":
        return {"id": item.id, "type": "message", "role": item.role, "status": "completed",
                "content": [{"type": "input_text", "text": item.text}]}
    if isinstance(item, Message):
        return item_json(Message(role="assistant", text=item.text, id=item.id, phase=item.phase))
    if isinstance(item, ToolOutput):
        kind = "custom_tool_call_output" if item.kind == "custom" else "function_call_output"
        return {"id": item.id, "type": kind, "call_id": item.call_id, "output": item.output, "status": "completed"}
    return item_json(item)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage_json(state: ResponseState) -> dict[str, Any] | None:
    return None if state.usage is None else usage_object(state.usage)


def usage_object(u: Usage) -> dict[str, Any]:
    """A Response's ``usage`` (also a ``response.compaction``'s)."""
    return {
        "input_tokens": u.input_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": u.cache_write_tokens},
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.total_tokens,
    }


_OPENAI_REASONS = ("max_output_tokens", "content_filter")
# Where a /v1 response keeps the reason OpenAI's enum cannot say, so that it
# reaches a client that looks and survives storage (LMSP's GET says it).
INCOMPLETE_EXTENSION = "lmspd.incomplete"


def _incomplete_details(state: ResponseState) -> dict[str, str] | None:
    """OpenAI's reasons are ``max_output_tokens | content_filter`` (strict
    clients validate the enum): the repetition guard is a server-side output
    cap, reported as ``max_output_tokens`` (and as itself in
    ``extensions["lmspd.incomplete"]``)."""
    reason = state.incomplete_reason
    if not reason:
        return None
    return {"reason": "content_filter" if reason == "content_filter" else "max_output_tokens"}


def response_json(state: ResponseState) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": state.id,
        "object": "response",
        "created_at": state.created_at,
        "status": state.status,
        "completed_at": state.completed_at,
        "error": state.error,
        "incomplete_details": _incomplete_details(state),
        "model": state.model,
        "output": [item_json(i, summarize=summarizes(state)) for i in state.output],
        "usage": usage_json(state),
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
    }
    body.update(DEFAULT_ECHO)
    body.update(state.echo)
    extensions = response_extensions(state) or {}
    if state.incomplete_reason and state.incomplete_reason not in _OPENAI_REASONS:
        extensions[INCOMPLETE_EXTENSION] = {"reason": state.incomplete_reason}
    if extensions:
        body["extensions"] = extensions
    return body


# -- reading back ------------------------------------------------------------------
#
# Stored responses are kept as this dialect's Response objects (the richest
# shape: every echo field, item status, usage details); these rebuild the
# neutral state from one, or from a task's event log, for either dialect to
# render again.

_RESPONSE_KEYS = {"id", "object", "created_at", "status", "completed_at", "error", "incomplete_details",
                  "model", "output", "usage", "frequency_penalty", "presence_penalty", "extensions"}


def output_item(data: dict[str, Any]) -> Message | ToolCall | Reasoning:
    """A stored output item (``item_json``) as a neutral item, status kept."""
    (item,) = decode_items([data], RequestLimits(max_text_chars=2**62), path="output",
                           open_compaction=lambda blob, item_id, where: compaction.summary_message("", blob, item_id))
    assert isinstance(item, (Message, ToolCall, Reasoning)), item
    item.status = data.get("status") or "completed"
    return item


def state_from_json(body: dict[str, Any]) -> ResponseState:
    """The inverse of ``response_json``."""
    u = body.get("usage")
    usage = None
    if u:
        usage = Usage(
            input_tokens=u.get("input_tokens", 0),
            output_tokens=u.get("output_tokens", 0),
            cached_tokens=(u.get("input_tokens_details") or {}).get("cached_tokens", 0),
            cache_write_tokens=(u.get("input_tokens_details") or {}).get("cache_write_tokens", 0),
            reasoning_tokens=(u.get("output_tokens_details") or {}).get("reasoning_tokens", 0),
        )
    extensions = dict(body.get("extensions") or {})
    precise = extensions.pop(INCOMPLETE_EXTENSION, None) or {}
    return ResponseState(
        id=body["id"],
        model=body.get("model", ""),
        created_at=body.get("created_at", 0),
        status=body.get("status", "completed"),
        output=[output_item(i) for i in body.get("output") or []],
        usage=usage,
        error=body.get("error"),
        incomplete_reason=precise.get("reason") or (body.get("incomplete_details") or {}).get("reason"),
        completed_at=body.get("completed_at"),
        echo={k: v for k, v in body.items() if k not in _RESPONSE_KEYS},
        recorded_extensions=extensions or None,
    )


def state_from_log(events: list[tuple[str, dict[str, Any]]]) -> tuple[ResponseState, int | None]:
    """Replay a stream's events (as ``OpenAIEncoder`` wrote them) into the
    response they describe; also the index of the item still receiving
    deltas, if any. For closing a log that a crash cut off."""
    state: ResponseState | None = None
    open_index: int | None = None
    for _, data in events:
        kind = data.get("type", "")
        index: Any = data.get("output_index")
        if "response" in data:
            output = state.output if state is not None else []
            state = state_from_json(data["response"])
            state.output = output
            continue
        if state is None:
            continue
        if kind in ("response.output_item.added", "response.output_item.done"):
            item = output_item(data["item"])
            if index == len(state.output):
                state.output.append(item)
            else:
                state.output[index] = item
            if kind.endswith(".done") and open_index == index:
                open_index = None
        elif kind in ("response.content_part.added", "response.reasoning_summary_part.added"):
            # A reasoning item streamed as its summary opens with its summary part.
            open_index = index
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta",
                      "response.reasoning_summary_text.delta"):
            text_item = state.output[index]
            assert not isinstance(text_item, ToolCall)  # text deltas go to messages and reasoning
            text_item.text = (text_item.text or "") + data["delta"]
        elif kind in ("response.function_call_arguments.delta", "response.custom_tool_call_input.delta"):
            call = state.output[index]
            assert isinstance(call, ToolCall)
            call.payload += data["delta"]
    if state is None:
        raise ValueError("the log has no response.created event")
    return state, open_index


class OpenAIEncoder:
    """Writes each lifecycle step as the OpenAI stream event of that name."""

    first_sequence_number = 0

    def encode(self, step: Step, state: ResponseState, seq: int) -> tuple[str, dict[str, Any]] | None:
        # Reasoning goes out as reasoning_text events, or as summary events
        # when the client asked for summaries (``summarizes``).
        if summarizes(state) and isinstance(step, _REASONING_STEPS):
            return _summary_event(step, seq)
        match step:
            case steps.TextDelta(index, item, delta):
                name = "response.output_text.delta"
                return name, {"type": name, "sequence_number": seq, "item_id": item.id, "output_index": index,
                              "content_index": 0, "delta": delta, "logprobs": []}
            case steps.ResponseCancelled():
                # OpenAI's Responses has no cancelled event: a failed one.
                return "response.failed", {"type": "response.failed", "sequence_number": seq,
                                           "response": response_json(state)}
            case steps.Heartbeat():
                # The event that says so again (response.queued while queued),
                # without the output so far: its own events carried it once,
                # and a stall (a provider that streams a lot, then pings for
                # minutes) would have sent all of it again every interval.
                name = "response.queued" if state.status == "queued" else "response.in_progress"
                return name, {"type": name, "sequence_number": seq,
                              "response": response_json(dataclasses.replace(state, output=[]))}
            case (steps.ResponseCreated() | steps.ResponseInProgress() | steps.ResponseCompleted()
                  | steps.ResponseIncomplete() | steps.ResponseFailed()):
                return step.event, {"type": step.event, "sequence_number": seq, "response": response_json(state)}
            case steps.ItemAdded(index, item):
                name = "response.output_item.added"
                return name, {"type": name, "sequence_number": seq, "output_index": index,
                              "item": item_json(item, summarize=summarizes(state))}
            case steps.ItemDone(index, item):
                name = "response.output_item.done"
                return name, {"type": name, "sequence_number": seq, "output_index": index,
                              "item": item_json(item, summarize=summarizes(state))}
            case steps.TextPartAdded(index, item):
                name = "response.content_part.added"
                return name, {"type": name, "sequence_number": seq, "item_id": item.id, "output_index": index,
                              "content_index": 0,
                              "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}
            case steps.TextPartDone(index, item):
                name = "response.content_part.done"
                return name, {"type": name, "sequence_number": seq, "item_id": item.id, "output_index": index,
                              "content_index": 0, "part": _text_part(item.text)}
            case steps.TextDone(index, item):
                name = "response.output_text.done"
                return name, {"type": name, "sequence_number": seq, "item_id": item.id, "output_index": index,
                              "content_index": 0, "text": item.text, "logprobs": []}
            case steps.ToolInputDelta(index, item, delta):
                name = ("response.custom_tool_call_input.delta" if item.kind == "custom"
                        else "response.function_call_arguments.delta")
                return name, {"type": name, "sequence_number": seq, "item_id": item.id, "output_index": index,
                              "delta": delta}
            case steps.ToolInputDone(index, item) if item.kind == "custom":
                name = "response.custom_tool_call_input.done"
                return name, {"type": name, "sequence_number": seq, "item_id": item.id, "output_index": index,
                              "input": item.payload}
            case steps.ToolInputDone(index, item):
                name = "response.function_call_arguments.done"
                return name, {"type": name, "sequence_number": seq, "item_id": item.id, "output_index": index,
                              "name": item.name, "arguments": item.payload}
            case steps.ReasoningPartAdded(index, item):
                name = "response.content_part.added"
                return name, {"type": name, "sequence_number": seq, "item_id": item.id, "output_index": index,
                              "content_index": 0, "part": {"type": "reasoning_text", "text": ""}}
            case steps.ReasoningDelta(index, item, delta):
                name = "response.reasoning_text.delta"
                return name, {"type": name, "sequence_number": seq, "item_id": item.id, "output_index": index,
                              "content_index": 0, "delta": delta}
            case steps.ReasoningPartDone(index, item):
                name = "response.content_part.done"
                return name, {"type": name, "sequence_number": seq, "item_id": item.id, "output_index": index,
                              "content_index": 0, "part": {"type": "reasoning_text", "text": item.text or ""}}
            case steps.ReasoningDone(index, item):
                name = "response.reasoning_text.done"
                return name, {"type": name, "sequence_number": seq, "item_id": item.id, "output_index": index,
                              "content_index": 0, "text": item.text or ""}
        return None


_REASONING_STEPS = (steps.ReasoningPartAdded, steps.ReasoningDelta, steps.ReasoningDone, steps.ReasoningPartDone)


def _summary_event(step: Step, seq: int) -> tuple[str, dict[str, Any]]:
    """A reasoning step as the ``reasoning_summary_*`` event of its one
    ``summary_text`` part (summary_index 0)."""
    assert isinstance(step, _REASONING_STEPS)
    head = {"sequence_number": seq, "item_id": step.item.id, "output_index": step.index, "summary_index": 0}
    text = step.item.text or ""
    more: dict[str, Any]
    if isinstance(step, steps.ReasoningPartAdded):
        name, more = "response.reasoning_summary_part.added", {"part": {"type": "summary_text", "text": ""}}
    elif isinstance(step, steps.ReasoningDelta):
        name, more = "response.reasoning_summary_text.delta", {"delta": step.delta}
    elif isinstance(step, steps.ReasoningDone):
        name, more = "response.reasoning_summary_text.done", {"text": text}
    else:
        name, more = "response.reasoning_summary_part.done", {"part": {"type": "summary_text", "text": text}}
    return name, {"type": name, **head, **more}
