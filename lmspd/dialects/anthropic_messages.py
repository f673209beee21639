"""Anthropic Messages (``/v1/messages``, ``/v1/messages/count_tokens``):
request decoding and wire encoding, over the same neutral core.

Content blocks map onto neutral items one to one: ``text`` runs become
messages, ``tool_use`` a ``ToolCall`` (its ``id`` is the call id),
``tool_result`` a ``ToolOutput``, ``thinking`` a ``Reasoning`` item whose
``signature`` is the opaque blob a stateless replay carries. Each output item
is one content block, so a block's ``index`` is the item's output index.

Usage follows Anthropic's accounting: ``input_tokens`` counts only the tokens
prefilled for this request; reused ones are ``cache_read_input_tokens``, so
their sum is the whole prompt.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import Field, ValidationError

from lmspd.core.conversation import (
    Conversation,
    Item,
    Message,
    OutputFormat,
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

from .common import check_answered, check_item_count, decode_stop, neutral_effort
from .extensions import decode_extensions
from .responses_items import (
    Lenient,
    Strict,
    StrList,
    decode_tool_choice,
    decode_tools,
    media_placeholder,
    validation_error,
)

# -- request ---------------------------------------------------------------------


class ThinkingIn(Lenient):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=0)


class OutputFormatIn(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfigIn(Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormatIn | None = None


class ToolChoiceIn(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CreateMessage(Strict):
    model: str = Field(min_length=1, max_length=256)
    messages: list[Any] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: Union[str, list[Any], None] = None
    stop_sequences: StrList | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=1_000_000)
    tools: list[Any] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingIn | None = None
    output_config: OutputConfigIn | None = None
    extensions: dict[str, Any] | None = None
    # Bookkeeping and hosting hints: accepted, nothing to do for a local model
    # (prompt caching is automatic here; ``cache_control`` on a system or text
    # block, a tool or a tool_result marks where a non-trimmable KV keeps an
    # exact-state checkpoint).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: Any = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Anthropic-hosted features lmspd cannot honour (refused when set).
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None


class CountTokens(CreateMessage):
    """``/v1/messages/count_tokens`` takes the same body without the cap."""

    max_tokens: int | None = Field(default=None, ge=1)  # type: ignore[assignment]


class MessagesRequest:
    """A decoded Messages request (a ``CompatRequest``)."""

    def __init__(self, body: CreateMessage, conversation: Conversation, item_paths: list[str]) -> None:
        self.body = body
        self.conversation = conversation
        # Where each neutral item came from, for errors the core raises about one.
        self.item_paths = item_paths

    @property
    def stream(self) -> bool:
        return bool(self.body.stream)

    @property
    def field_names(self) -> FieldNames:
        """What this request calls the fields the core names in its errors."""
        return FieldNames(FIELD_NAMES, self.item_paths)


# The neutral fields' names in a Messages request.
FIELD_NAMES = {
    RequestField.MAX_OUTPUT_TOKENS: "max_tokens",
    RequestField.ITEMS: "messages",
    RequestField.OUTPUT_FORMAT: "output_config.format",
}


def decode_request(raw: dict[str, Any], limits: RequestLimits) -> MessagesRequest:
    return _decode(CreateMessage, raw, limits)


def decode_count_tokens(raw: dict[str, Any], limits: RequestLimits) -> MessagesRequest:
    return _decode(CountTokens, raw, limits)


def _decode(model: type[CreateMessage], raw: dict[str, Any], limits: RequestLimits) -> MessagesRequest:
    try:
        body = model.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    _refuse_unhonourable(body)
    items, paths = decode_messages(body.messages, limits)
    check_answered(items, paths, call="tool_use block", output="tool_result block")
    tools = decode_tools(_flat_tools(body.tools), limits)
    choice = decode_tool_choice(_flat_tool_choice(body.tool_choice), tools)
    extensions = decode_extensions(body.extensions)
    conversation = Conversation(
        model=body.model,
        items=items,
        instructions=_system_text(body.system, limits),
        instructions_breakpoints=_system_breakpoints(body.system, limits),
        tools=tools,
        tools_breakpoint=_tools_breakpoint(body.tools, limits),
        tool_choice=choice,
        parallel_tool_calls=False if body.tool_choice and body.tool_choice.disable_parallel_tool_use else None,
        output_format=_output_format(body.output_config),
        sampling=extensions.sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                     stop=decode_stop(body.stop_sequences, limits, "stop_sequences")),
        max_output_tokens=body.max_tokens,
        max_output_tokens_is_ceiling=True,
        reasoning_effort=_effort(body),
        # A thinking block always carries its signature: the sealed hidden
        # reasoning that lets a stateless replay render what the model saw.
        include_encrypted_reasoning=True,
        cache_reuse=extensions.cache_reuse,
        speculative=extensions.speculative,
    )
    return MessagesRequest(body, conversation, paths)


def _refuse_unhonourable(body: CreateMessage) -> None:
    for name in ("container", "mcp_servers"):
        if getattr(body, name) is not None:
            raise unsupported(name, f"'{name}' is an Anthropic-hosted feature that lmspd does not provide.")
    if body.context_management is not None and not _keeps_everything(body.context_management):
        raise unsupported("context_management", "'context_management' edits that clear context are an "
                                                "Anthropic-hosted feature that lmspd does not provide.")


# Claude Code (2.1.3xx) sends ``{"edits": [{"type": "clear_thinking_20251015",
# "keep": "all"}]}`` on every request: an edit that clears nothing, which is
# what lmspd does anyway (thinking stays in the prompt as the client replays
# it). Only that edit is accepted; one that would clear something is refused.
_NO_OP_EDITS = ({"type": "clear_thinking_20251015", "keep": "all"},)


def _keeps_everything(value: Any) -> bool:
    if not isinstance(value, dict) or set(value) != {"edits"} or not isinstance(value["edits"], list):
        return False
    return len(value["edits"]) <= len(_NO_OP_EDITS) and all(edit in _NO_OP_EDITS for edit in value["edits"])


# Anthropic sizes thinking in tokens, the neutral scale (Responses') in
# effort levels: a budget maps to the largest level it affords.
_BUDGET_EFFORTS = ((4096, "xhigh"), (1024, "high"), (256, "medium"), (64, "low"), (0, "minimal"))


def _effort(body: CreateMessage) -> str | None:
    thinking = body.thinking
    if thinking is not None and thinking.type == "disabled":
        return "none"
    effort = body.output_config.effort if body.output_config else None
    if effort is not None:
        return neutral_effort(effort)
    if thinking is not None and thinking.budget_tokens is not None:
        return next(level for floor, level in _BUDGET_EFFORTS if thinking.budget_tokens >= floor)
    return None


def _output_format(config: OutputConfigIn | None) -> OutputFormat:
    if config is None or config.format is None:
        return OutputFormat()
    # Anthropic's format has no name; the neutral one wants one for logs.
    return OutputFormat(type="json_schema", name="output", schema=config.format.schema_, strict=True,
                        param="output_config.format.schema")


def _system_text(system: str | list[Any] | None, limits: RequestLimits) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    texts = []
    for i, block in enumerate(system):
        where = f"system[{i}]"
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise invalid(f"Invalid system block at '{where}': expected {{\"type\": \"text\", \"text\": ...}}.", where)
        texts.append(block["text"])
    return _check(_join(texts), "system", limits) or None


def _system_breakpoints(system: str | list[Any] | None, limits: RequestLimits) -> tuple[int, ...]:
    """Where the system blocks that carry ``cache_control`` end in the
    joined system text (validated by ``_system_text``)."""
    if not isinstance(system, list):
        return ()
    return _breakpoints([(b["text"], b.get("cache_control") is not None) for b in system], "system", limits)


def _breakpoints(blocks: list[tuple[str, bool]], path: str, limits: RequestLimits) -> tuple[int, ...]:
    """Offsets in ``_join`` of ``blocks`` where a block marked with
    ``cache_control`` ends: lmspd's exact-state checkpoints go there."""
    offsets: list[int] = []
    at = 0
    for i, (text, marked) in enumerate(blocks):
        at += len(text) + (2 if i else 0)
        if marked:
            offsets.append(at)
    if len(offsets) > limits.max_cache_breakpoints:
        raise invalid(f"'{path}' has {len(offsets)} cache_control blocks; the limit is "
                      f"{limits.max_cache_breakpoints}.", path)
    return tuple(offsets)


def _join(texts: list[str]) -> str:
    # Separate blocks are separate paragraphs to the model; gluing them
    # would fuse the last word of one with the first of the next.
    return "\n\n".join(texts)


def _check(text: str, path: str, limits: RequestLimits) -> str:
    if len(text) > limits.max_text_chars:
        raise invalid(f"'{path}' is {len(text)} characters; the limit is {limits.max_text_chars}.", path)
    return text


class MessageIn(Lenient):
    # SDK 2.10's MessageParam includes a ``system`` message (text only) that
    # may sit anywhere in the list: Claude Code's first request, sent with the
    # ``mid-conversation-tool-changes`` beta, has one after the user's turn.
    # It becomes a neutral system message at its position, as a mid-list
    # system message does on /v1/chat/completions.
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[Any]]


class ToolUseIn(Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=512)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultIn(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=512)
    content: Union[str, list[Any], None] = None
    is_error: bool | None = None


class ThinkingBlockIn(Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingIn(Lenient):
    type: Literal["redacted_thinking"]
    data: str


MEDIA_BLOCK_TYPES = {"image", "document", "search_result", "container_upload"}
_USER_BLOCKS = {"text", "tool_result"}
_ASSISTANT_BLOCKS = {"text", "tool_use", "thinking", "redacted_thinking"}
_SYSTEM_BLOCKS = {"text"}
_ALLOWED_BLOCKS = {"user": _USER_BLOCKS, "assistant": _ASSISTANT_BLOCKS, "system": _SYSTEM_BLOCKS}


def decode_messages(raw: list[Any], limits: RequestLimits) -> tuple[list[Item], list[str]]:
    """Messages and their content blocks -> neutral items, with wire paths."""
    if len(raw) > limits.max_input_items:
        raise invalid(f"'messages' has {len(raw)} entries; the limit is {limits.max_input_items}.", "messages")
    items: list[Item] = []
    paths: list[str] = []
    for i, entry in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(entry, dict):
            raise invalid(f"Invalid message at '{where}': expected an object.", where)
        try:
            msg = MessageIn.model_validate(entry)
        except ValidationError as exc:
            raise validation_error(exc, where) from None
        if isinstance(msg.content, str):
            items.append(Message(role=msg.role, text=_check(msg.content, f"{where}.content", limits)))
            paths.append(where)
        else:
            if len(msg.content) > limits.max_content_parts:
                raise invalid(f"'{where}.content' has {len(msg.content)} blocks; the limit is "
                              f"{limits.max_content_parts}.", f"{where}.content")
            _decode_blocks(msg.role, msg.content, f"{where}.content", limits, items, paths)
        if len(items) > limits.max_input_items:
            # max_content_parts bounds one message's blocks, so the items
            # built past the bound are few; the error names the first.
            check_item_count(len(items), paths[limits.max_input_items], limits,
                             parts="tool_use, tool_result and thinking blocks")
    return items, paths


def _decode_blocks(role: str, blocks: list[Any], path: str, limits: RequestLimits,
                   items: list[Item], paths: list[str]) -> None:
    allowed = _ALLOWED_BLOCKS[role]
    texts: list[str] = []
    marked: list[bool] = []
    text_at = ""

    def flush() -> None:
        if texts:
            breakpoints = _breakpoints(list(zip(texts, marked, strict=True)), text_at, limits)
            items.append(Message(role=role, text=_check(_join(texts), text_at, limits),  # type: ignore[arg-type]
                                 breakpoints=breakpoints))
            paths.append(text_at)
            texts.clear()
            marked.clear()

    for j, block in enumerate(blocks):
        where = f"{path}[{j}]"
        if not isinstance(block, dict):
            raise invalid(f"Invalid content block at '{where}': expected an object.", where)
        kind = tag(block.get("type"), f"{where}.type")
        if kind in MEDIA_BLOCK_TYPES and role != "system":
            raise ApiError("unsupported_capability",
                           f"Content block type {kind!r} at '{where}' is not supported: lmspd serves text-only "
                           "models.", param=f"{where}.type")
        if kind not in allowed:
            only = " (text blocks only)" if role == "system" else ""
            raise invalid(f"Content block type {kind!r} is not allowed in a {role} message{only} ('{where}.type').",
                          f"{where}.type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise invalid(f"Missing or invalid '{where}.text': expected a string.", f"{where}.text")
            if not texts:
                text_at = where
            texts.append(block["text"])
            marked.append(block.get("cache_control") is not None)
            continue
        flush()
        try:
            items.append(_block_item(kind, block, where, limits))
        except ValidationError as exc:
            raise validation_error(exc, where) from None
        paths.append(where)
    flush()


def _block_item(kind: str, block: dict[str, Any], where: str, limits: RequestLimits) -> Item:
    if kind == "tool_use":
        use = ToolUseIn.model_validate(block)
        # Compact, key order kept: the prompt renderer re-serializes it anyway.
        return ToolCall(call_id=use.id, name=use.name,
                        payload=_check(json.dumps(use.input, ensure_ascii=False), f"{where}.input", limits))
    if kind == "tool_result":
        result = ToolResultIn.model_validate(block)
        texts, marked = _result_blocks(result.content, f"{where}.content", limits)
        text = _check(_join(texts), f"{where}.content", limits)
        breakpoints = _breakpoints(list(zip(texts, marked, strict=True)), f"{where}.content", limits)
        if block.get("cache_control") is not None and len(text) not in breakpoints:
            breakpoints = (*breakpoints, len(text))
        if result.is_error:
            # The neutral tool output has no error flag; the model is told in
            # words, the same way on every replay (so the cache still matches).
            head = "Error: " if text else "Error"
            text = head + text
            breakpoints = tuple(at + len(head) for at in breakpoints)
        return ToolOutput(call_id=result.tool_use_id, output=text, breakpoints=breakpoints)
    if kind == "thinking":
        thought = ThinkingBlockIn.model_validate(block)
        return Reasoning(text=_check(thought.thinking, f"{where}.thinking", limits),
                         encrypted_content=thought.signature or None)
    redacted = RedactedThinkingIn.model_validate(block)
    return Reasoning(encrypted_content=redacted.data)


def _result_blocks(content: str | list[Any] | None, path: str, limits: RequestLimits) -> tuple[list[str], list[bool]]:
    """A tool_result's content blocks as texts (joined by ``_join``), and
    which of them carry ``cache_control``. Blocks other than text (SDK
    2.10's ``tool_result`` content: image, search_result, document,
    tool_reference, browser_state) become text a text-only model can read;
    the joined text is then bounded like any other (``_check``)."""
    if content is None or isinstance(content, str):
        return [content or ""], [False]
    _check_parts(content, path, limits)
    texts: list[str] = []
    marked: list[bool] = []
    for k, block in enumerate(content):
        where = f"{path}[{k}]"
        if not isinstance(block, dict):
            raise invalid(f"Invalid tool_result content at '{where}': expected an object.", where)
        kind = tag(block.get("type"), f"{where}.type")
        render = _RESULT_BLOCKS.get(kind or "")
        if render is None:
            raise invalid(f"Invalid tool_result content at '{where}': expected a block of type "
                          f"{', '.join(repr(name) for name in _RESULT_BLOCKS)}.", f"{where}.type")
        texts.append(render(block, where, limits))
        marked.append(block.get("cache_control") is not None)
    return texts, marked


def _check_parts(blocks: list[Any], path: str, limits: RequestLimits) -> None:
    if len(blocks) > limits.max_content_parts:
        raise invalid(f"'{path}' has {len(blocks)} blocks; the limit is {limits.max_content_parts}.", path)


def _string(block: dict[str, Any], field: str, where: str, *, optional: bool = False) -> str:
    value = block.get(field)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise invalid(f"Missing or invalid '{where}.{field}': expected a string.", f"{where}.{field}")
    return value


def _text_blocks(blocks: Any, path: str, limits: RequestLimits, *, images: bool = False) -> str:
    """A nested list of text blocks (a search result's content, a
    document's ``content`` source; ``images``: image blocks allowed, as a
    placeholder), joined."""
    if not isinstance(blocks, list):
        raise invalid(f"Invalid type for '{path}': expected an array of text blocks.", path)
    _check_parts(blocks, path, limits)
    texts = []
    for k, block in enumerate(blocks):
        where = f"{path}[{k}]"
        kind = tag(block.get("type"), f"{where}.type") if isinstance(block, dict) else None
        if images and kind == "image":
            texts.append(media_placeholder("image"))
        elif kind == "text":
            texts.append(_string(block, "text", where))
        else:
            raise invalid(f"Invalid block at '{where}': expected {{\"type\": \"text\", \"text\": ...}}.", where)
    return _join(texts)


def _text_result(block: dict[str, Any], where: str, limits: RequestLimits) -> str:
    return _string(block, "text", where)


def _image_result(block: dict[str, Any], where: str, limits: RequestLimits) -> str:
    return media_placeholder("image")


def _tool_reference(block: dict[str, Any], where: str, limits: RequestLimits) -> str:
    # Anthropic expands a reference into the deferred tool's definition;
    # lmspd offers every declared tool (``defer_loading`` included) in full
    # from the first turn, so the model only needs to read which one.
    name = _string(block, "tool_name", where)
    if not name or len(name) > 256:
        raise invalid(f"Invalid '{where}.tool_name': expected a tool name of 1 to 256 characters.",
                      f"{where}.tool_name")
    return f"Tool available: {name}"


def _search_result(block: dict[str, Any], where: str, limits: RequestLimits) -> str:
    head = [_string(block, "title", where), f"Source: {_string(block, 'source', where)}"]
    return "\n".join([*head, _text_blocks(block.get("content"), f"{where}.content", limits)])


def _document(block: dict[str, Any], where: str, limits: RequestLimits) -> str:
    source = block.get("source")
    at = f"{where}.source"
    if not isinstance(source, dict):
        raise invalid(f"Missing or invalid '{at}': expected an object.", at)
    kind = tag(source.get("type"), f"{at}.type")
    if kind == "text":
        body = _string(source, "data", at)
    elif kind == "content":
        content = source.get("content")
        body = content if isinstance(content, str) else _text_blocks(content, f"{at}.content", limits, images=True)
    elif kind in ("base64", "url", "file"):
        # A PDF (or a file by id): nothing a text-only model can read.
        body = media_placeholder("document")
    else:
        raise invalid(f"Invalid '{at}.type': expected 'text', 'content', 'base64', 'url' or 'file'.", f"{at}.type")
    head = [_string(block, "title", where, optional=True), _string(block, "context", where, optional=True)]
    return "\n".join([*(line for line in head if line), body])


def _browser_state(block: dict[str, Any], where: str, limits: RequestLimits) -> str:
    tabs = block.get("tabs")
    if not isinstance(tabs, list):
        raise invalid(f"Missing or invalid '{where}.tabs': expected an array.", f"{where}.tabs")
    _check_parts(tabs, f"{where}.tabs", limits)
    changes = block.get("state_changes")
    if changes is not None and not isinstance(changes, list):
        raise invalid(f"Invalid '{where}.state_changes': expected an array.", f"{where}.state_changes")
    _check_parts(changes or [], f"{where}.state_changes", limits)
    state = {"tabs": tabs, **({"state_changes": changes} if changes else {})}
    return "Browser state: " + json.dumps(state, ensure_ascii=False)


_RESULT_BLOCKS = {
    "text": _text_result,
    "image": _image_result,
    "search_result": _search_result,
    "document": _document,
    "tool_reference": _tool_reference,
    "browser_state": _browser_state,
}


def _tools_breakpoint(raw: list[Any] | None, limits: RequestLimits) -> bool:
    """Whether a tool carries ``cache_control``: one breakpoint at the end of
    the rendered tool definitions (lmspd renders the list as one block, in
    its own order, so a mark on any tool ends there)."""
    marked = [i for i, entry in enumerate(raw or []) if isinstance(entry, dict) and entry.get("cache_control") is not None]
    if len(marked) > limits.max_cache_breakpoints:
        raise invalid(f"'tools' has {len(marked)} cache_control entries; the limit is {limits.max_cache_breakpoints}.",
                      "tools")
    return bool(marked)


# Tools Anthropic runs on its own side; like hosted tools on /v1/responses
# they are accepted and ignored. Tools whose schema only Anthropic knows
# (bash_*, text_editor_*, computer_*, memory_*) cannot be offered to a local
# model and are refused.
_SERVER_TOOL_PREFIXES = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_", "mcp_toolset")


def _flat_tools(raw: list[Any] | None) -> list[Any] | None:
    if not raw:
        return raw
    flat: list[Any] = []
    for i, entry in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(entry, dict):
            raise invalid(f"Invalid tool at '{where}': expected an object.", where)
        kind = tag(entry.get("type"), f"{where}.type")
        if kind not in (None, "custom"):
            if isinstance(kind, str) and kind.startswith(_SERVER_TOOL_PREFIXES):
                continue
            raise ApiError("unsupported_capability",
                           f"Tool type {kind!r} at '{where}.type' is defined by Anthropic; lmspd accepts tools "
                           "with an 'input_schema'.", param=f"{where}.type")
        if "input_schema" not in entry:
            raise invalid(f"Missing required parameter: '{where}.input_schema'.", f"{where}.input_schema")
        schema = entry["input_schema"]
        if not isinstance(schema, dict):
            raise invalid(f"'{where}.input_schema' must be an object.", f"{where}.input_schema")
        flat.append({"type": "function", "name": entry.get("name"), "description": entry.get("description"),
                     "parameters": schema, "strict": entry.get("strict")})
    return flat


def _flat_tool_choice(choice: ToolChoiceIn | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise invalid("Missing required parameter: 'tool_choice.name'.", "tool_choice.name")
        return {"type": "function", "name": choice.name}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


# -- encoding --------------------------------------------------------------------


_STOP_REASONS = {"content_filter": "refusal", "context_window": "model_context_window_exceeded"}


def stop_reason(state: ResponseState) -> str | None:
    if state.status == "incomplete":
        # A provider's content filter is what Anthropic calls a refusal.
        return _STOP_REASONS.get(state.incomplete_reason or "", "max_tokens")
    if state.status == "completed":
        if any(isinstance(i, ToolCall) for i in state.output):
            return "tool_use"
        return "stop_sequence" if state.stop_sequence is not None else "end_turn"
    return None


def usage_json(state: ResponseState) -> dict[str, Any]:
    u = state.usage
    if u is None:
        # Before the prefill (message_start) only the prompt size is known;
        # message_delta carries the final split.
        return {"input_tokens": state.echo.get("input_tokens", 0), "output_tokens": 0,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    return {
        "input_tokens": max(u.input_tokens - u.cached_tokens - u.cache_write_tokens, 0),
        "output_tokens": u.output_tokens,
        "cache_creation_input_tokens": u.cache_write_tokens,
        "cache_read_input_tokens": u.cached_tokens,
    }


def _tool_input(payload: str) -> dict[str, Any]:
    # A call cut off by max_tokens has unfinished JSON; Anthropic's ``input``
    # is always an object, so it reads as empty.
    try:
        value = json.loads(payload) if payload else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def block_json(item: Message | ToolCall | Reasoning) -> dict[str, Any]:
    if isinstance(item, Message):
        return {"type": "text", "text": item.text}
    if isinstance(item, ToolCall):
        return {"type": "tool_use", "id": item.call_id, "name": item.name, "input": _tool_input(item.payload)}
    if item.text is None and item.encrypted_content is not None:
        return {"type": "redacted_thinking", "data": item.encrypted_content}
    return {"type": "thinking", "thinking": item.text or "", "signature": item.encrypted_content or ""}


def _start_block(item: Message | ToolCall | Reasoning) -> dict[str, Any]:
    if isinstance(item, Message):
        return {"type": "text", "text": ""}
    if isinstance(item, ToolCall):
        return {"type": "tool_use", "id": item.call_id, "name": item.name, "input": {}}
    return {"type": "thinking", "thinking": "", "signature": ""}


def message_json(state: ResponseState) -> dict[str, Any]:
    return {
        "id": state.id,
        "type": "message",
        "role": "assistant",
        "model": state.model,
        "content": [block_json(i) for i in state.output],
        "stop_reason": stop_reason(state),
        "stop_sequence": state.stop_sequence,
        "usage": usage_json(state),
        **diagnostics_json(state),
    }


def diagnostics_json(state: ResponseState) -> dict[str, Any]:
    """Anthropic's ``diagnostics.cache_miss_reason``, when part of the prompt
    that lmspd remembered was prefilled again (lmspd.cache.diagnostics)."""
    report = state.usage.cache_report if state.usage is not None else None
    diagnostics = report.anthropic_json() if report is not None else None
    return {"diagnostics": diagnostics} if diagnostics else {}


class AnthropicEncoder:
    """Writes lifecycle steps as Anthropic stream events (``event:`` = ``type``)."""

    first_sequence_number = 0

    def encode(self, step: Step, state: ResponseState, seq: int) -> tuple[str, dict[str, Any]] | None:
        match step:
            case steps.TextDelta(index, _, delta):
                return _delta(index, {"type": "text_delta", "text": delta})
            case steps.ReasoningDelta(index, _, delta):
                return _delta(index, {"type": "thinking_delta", "thinking": delta})
            case steps.ToolInputDelta(index, _, delta):
                return _delta(index, {"type": "input_json_delta", "partial_json": delta})
            case steps.ReasoningDone(index, item) if item.encrypted_content:
                return _delta(index, {"type": "signature_delta", "signature": item.encrypted_content})
            case steps.ItemAdded(index, item):
                return "content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": _start_block(item)}
            case steps.ItemDone(index, _):
                return "content_block_stop", {"type": "content_block_stop", "index": index}
            case steps.ResponseCreated():
                message = message_json(state)
                message["content"] = []
                return "message_start", {"type": "message_start", "message": message}
            case steps.ResponseInProgress() | steps.Heartbeat():
                # Anthropic sends a ping early; it also tells a queued client
                # that the stream is alive.
                return "ping", {"type": "ping"}
            case steps.ResponseCompleted() | steps.ResponseIncomplete():
                return "message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": stop_reason(state),
                                                   "stop_sequence": state.stop_sequence},
                                         "usage": usage_json(state)}
            case steps.ResponseFailed() | steps.ResponseCancelled():
                error = state.error or {"code": "cancelled", "message": "The request was cancelled."}
                return "error", ApiError(error["code"], error["message"]).anthropic()
        return None

    def trailer(self, state: ResponseState) -> list[tuple[str, dict[str, Any]]]:
        """``message_stop`` ends a stream that finished; a failed one ends at its ``error``."""
        if state.status not in ("completed", "incomplete"):
            return []
        return [("message_stop", {"type": "message_stop"})]


def _delta(index: int, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
