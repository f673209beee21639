"""Responses-style input items, tools and formats, as both Responses dialects
(LMSP 1.0 and OpenAI) send them, decoded into the neutral conversation.

Request bodies are strict at the top level (an unknown parameter is a 400
naming it), but replayed items are read leniently: clients send back output
items verbatim, with whatever fields a newer API version put on them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Protocol, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lmspd.core.conversation import (
    CustomTool,
    FunctionTool,
    Item,
    Message,
    OutputFormat,
    Reasoning,
    ToolCall,
    ToolChoice,
    ToolOutput,
    item_chars,
    qualify,
)
from lmspd.core.errors import ApiError, invalid, tag
from lmspd.core.limits import RequestLimits


class Expansion:
    """What a request's input comes to once what it names is expanded:
    ``previous_response_id``'s chain, a ``conversation``'s items, each
    ``item_reference`` and ``compaction`` item, and the input itself, in
    characters (``RequestLimits.max_expanded_chars``) and in items
    (``max_expanded_items``). Counted as the items arrive, so that an
    expansion past either bound stops there: a few references to one large
    stored item would otherwise build gigabytes of strings, and a
    conversation of empty messages, which costs no characters, hundreds of
    thousands of items."""

    def __init__(self, limits: RequestLimits) -> None:
        self.limits = limits
        self.limit = limits.max_expanded_chars
        self.item_limit = limits.max_expanded_items
        self.chars = 0
        self.items = 0

    def add(self, item: Item, where: str) -> Item:
        self.items += 1
        self._count(item_chars(item), where)
        if self.items > self.item_limit:
            raise invalid(
                f"The input is more than {self.item_limit} items once the stored history it names is expanded "
                f"(previous_response_id, conversation, item_reference and compaction items, the input itself), "
                f"exceeded at '{where}'; the limit is {self.item_limit} items (max_expanded_items). "
                "Send less history, or compact it (/v1/responses/compact).", where)
        return item

    def add_all(self, items: list[Item], where: str) -> list[Item]:
        for item in items:
            self.add(item, where)
        return items

    def add_text(self, text: str, where: str) -> str:
        """Text the model reads besides the items (``instructions``): no
        item, but its characters count."""
        _check_text(text, where, self.limits)
        self._count(len(text), where)
        return text

    def _count(self, chars: int, where: str) -> None:
        self.chars += chars
        if self.chars > self.limit:
            raise invalid(
                f"The input is more than {self.limit} characters once the stored history it names is expanded "
                f"(previous_response_id, conversation, item_reference and compaction items, the input itself, "
                f"the instructions), exceeded at '{where}'; the limit is {self.limit} characters "
                "(max_expanded_chars). Send less history, or compact it (/v1/responses/compact).", where)


class StoredContext(Protocol):
    """What the store lends a request's decoding (``lmspd.history``): the
    items a ``previous_response_id`` or ``conversation`` stands for, and the
    item an ``item_reference`` names. Each raises ``ApiError`` naming what it
    could not find; ``history`` counts what it expands in ``expansion``."""

    def history(self, previous_response_id: str | None, conversation_id: str | None,
                expansion: Expansion) -> list[Item]: ...

    def resolve_reference(self, item_id: str, where: str) -> Item: ...

    def open_compaction(self, blob: str, item_id: str | None, where: str) -> Item: ...

    def declared_tools(self, previous_response_id: str | None,
                       conversation_id: str | None) -> list[tuple[str, Any]]:
        """The tools the latest ``additional_tools`` items of the history that
        ``previous_response_id`` or ``conversation_id`` names declared, as
        ``additional_tools()`` gives them."""
        ...


def stored_history(
    context: StoredContext | None, previous_response_id: str | None, conversation_id: str | None,
    expansion: Expansion,
) -> list[Item]:
    if previous_response_id is None and conversation_id is None:
        return []
    if context is None:
        # Decoding without a store (tools, tests): nothing can be continued.
        if previous_response_id is not None:
            raise ApiError("previous_response_not_found",
                           f"Previous response {previous_response_id!r} not found.", param="previous_response_id")
        raise ApiError("conversation_not_found", f"Conversation {conversation_id!r} not found.", param="conversation")
    return context.history(previous_response_id, conversation_id, expansion)


# Both take values of their JSON type only (``strict``): ``"stream": "yes"``
# or ``"max_output_tokens": true`` is a 400 naming the field, as OpenAI answers
# it, not a stream or a one-token reply (pydantic's lax mode coerces them).
# An integer is still a number. They differ in what an unknown key is:
# ``Lenient`` ignores it (items a client replays carry output-only fields).
class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# A request's typed collections stop at their first bad member: pydantic
# otherwise lists an error per member, and 130 k of them (a metadata of
# numbers, well within max_json_values) held the interpreter lock for 0.3 s
# to be listed, stalling every stream.
_FAIL_FAST = Field(fail_fast=True)
StrList = Annotated[list[str], _FAIL_FAST]
StrDict = Annotated[dict[str, str], _FAIL_FAST]
IntDict = Annotated[dict[str, int], _FAIL_FAST]


# -- content parts -------------------------------------------------------------

TEXT_PART_TYPES = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal",
                   "summary_text": "text", "reasoning_text": "text"}
MEDIA_PART_TYPES = {"input_image", "input_file", "input_audio", "image_url", "file"}
IMAGE_PART_TYPES = {"input_image", "image_url"}


def media_placeholder(kind: str) -> str:
    """What a text-only model reads in place of an image in a tool's
    output. Agents attach images to tool results on their own (Codex's
    ``view_image``, Claude Code reading a picture): a 400 there would fail
    that turn and every later replay of the session, while the model, told
    in words, can go on. An image in a user's own message, and any other
    media (a file, audio), is still a 400."""
    return f"[{kind} omitted: this model reads text only]"


def _image_text(kind: str, first: bool) -> str:
    # On a line of its own: parts are joined with nothing between them.
    return ("" if first else "\n") + media_placeholder(kind) + "\n"


def content_text(content: Any, path: str, limits: RequestLimits, *, tool_output: bool = False) -> str:
    """A message's content (a string or a list of parts) as plain text;
    ``tool_output``: image parts become ``media_placeholder`` text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"Invalid type for '{path}': expected a string or an array of content parts.", path)
    if len(content) > limits.max_content_parts:
        raise invalid(f"'{path}' has {len(content)} parts; the limit is {limits.max_content_parts}.", path)
    texts: list[str] = []
    for i, part in enumerate(content):
        where = f"{path}[{i}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise invalid(f"Invalid content part at '{where}': expected an object.", where)
        kind = tag(part.get("type"), f"{where}.type")
        if kind in IMAGE_PART_TYPES and tool_output:
            texts.append(_image_text(kind, first=i == 0))
            continue
        if kind in MEDIA_PART_TYPES:
            raise ApiError(
                "unsupported_capability",
                f"Content part type {kind!r} at '{where}' is not supported: lmspd serves text-only models.",
                param=f"{where}.type",
            )
        field = TEXT_PART_TYPES.get(kind or "")
        if field is None:
            raise invalid(f"Unknown content part type {kind!r} at '{where}'.", f"{where}.type")
        value = part.get(field)
        if not isinstance(value, str):
            raise invalid(f"Missing or invalid '{where}.{field}': expected a string.", f"{where}.{field}")
        texts.append(value)
    return "".join(texts)


def content_breakpoints(content: Any, path: str, limits: RequestLimits) -> tuple[int, ...]:
    """Where the content parts that carry ``prompt_cache_breakpoint``
    (``{"mode": "explicit"}``, OpenAI's shape) end, as offsets into the text
    ``content_text`` joins (call it first: it validates the parts)."""
    if not isinstance(content, list):
        return ()
    offsets: list[int] = []
    at = 0
    for i, part in enumerate(content):
        if isinstance(part, str):
            at += len(part)
            continue
        kind = part.get("type") or ""
        if kind in IMAGE_PART_TYPES:  # only a tool output's get here: a message's are refused first
            at += len(_image_text(kind, first=i == 0))
        else:
            at += len(part.get(TEXT_PART_TYPES.get(kind, "text")) or "")
        marker = part.get("prompt_cache_breakpoint")
        if marker is None:
            continue
        where = f"{path}[{i}].prompt_cache_breakpoint"
        if not isinstance(marker, dict) or marker.get("mode", "explicit") != "explicit" or set(marker) - {"mode"}:
            raise invalid(f"Invalid '{where}': expected {{\"mode\": \"explicit\"}}.", where)
        offsets.append(at)
    if len(offsets) > limits.max_cache_breakpoints:
        raise invalid(f"'{path}' has {len(offsets)} cache breakpoints; the limit is {limits.max_cache_breakpoints}.",
                      path)
    return tuple(offsets)


# -- items ---------------------------------------------------------------------


class MessageIn(Lenient):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[Any], None] = None
    id: str | None = None
    phase: str | None = None


class FunctionCallIn(Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=512)
    name: str = Field(min_length=1, max_length=256)
    arguments: str
    id: str | None = None
    namespace: str | None = Field(default=None, max_length=256)


class CustomToolCallIn(Lenient):
    type: Literal["custom_tool_call"]
    call_id: str = Field(min_length=1, max_length=512)
    name: str = Field(min_length=1, max_length=256)
    input: str
    id: str | None = None
    namespace: str | None = Field(default=None, max_length=256)


class ToolOutputIn(Lenient):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str = Field(min_length=1, max_length=512)
    output: Union[str, list[Any]]
    id: str | None = None


class SummaryPart(Lenient):
    type: Literal["summary_text"] = "summary_text"
    text: str


class ReasoningPart(Lenient):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningIn(Lenient):
    type: Literal["reasoning"]
    id: str | None = None
    summary: Annotated[list[SummaryPart], _FAIL_FAST] | None = None
    content: Annotated[list[ReasoningPart], _FAIL_FAST] | None = None
    encrypted_content: str | None = None


class ItemReferenceIn(Lenient):
    type: Literal["item_reference"]
    id: str = Field(min_length=1, max_length=512)


class CompactionIn(Lenient):
    """A compaction item replayed (``lmspd.core.compaction``)."""

    type: Literal["compaction", "compaction_summary"]
    id: str | None = Field(default=None, max_length=512)
    encrypted_content: str = Field(min_length=1)


_ITEM_MODELS: dict[str, type[Lenient]] = {
    "message": MessageIn,
    "function_call": FunctionCallIn,
    "custom_tool_call": CustomToolCallIn,
    "function_call_output": ToolOutputIn,
    "custom_tool_call_output": ToolOutputIn,
    "reasoning": ReasoningIn,
    "item_reference": ItemReferenceIn,
    "compaction": CompactionIn,
    "compaction_summary": CompactionIn,
}

# A control signal, not an item: only as the last input item of a create
# request (``openai_responses.decode_request`` takes it off first).
COMPACTION_TRIGGER = "compaction_trigger"


# pydantic names the union member it tried in an error's location ("str",
# "list[any]", "dict[str,any]"): that is no parameter of the request.
_MEMBER_TYPES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
                 "list": "an array", "dict": "an object", "none": "null"}


def _member(part: str | int) -> str | None:
    """What a union member a location part names accepts, or None: a field."""
    if isinstance(part, int):
        return None
    base = part.split("[", 1)[0].removeprefix("constrained-")
    if base in _MEMBER_TYPES and (base == part or "[" in part or part.startswith("constrained-")):
        return _MEMBER_TYPES[base]
    if base == "literal":
        return "one of the listed values"
    return "a value of another type" if "[" in part else None


def _param(loc: tuple[str | int, ...], prefix: str, member_at: int | None = None) -> str:
    param = prefix
    for i, part in enumerate(loc):
        if isinstance(part, int):
            param += f"[{part}]"
        elif i != member_at:
            param += f".{part}" if param else str(part)
    return param


def _union_members(errors: list[Any]) -> tuple[int, list[Any]] | None:
    """Where the first error's location names a union member, and the
    errors of its members: a position at which errors under one parameter
    differ by member names, those that end there all about one value (the
    parameter's). Keys of an object named "str" and "list" are told apart
    by their values."""
    loc = errors[0]["loc"]
    for at, part in enumerate(loc):
        if _member(part) is None:
            continue
        here = [e for e in errors if e["loc"][:at] == loc[:at] and len(e["loc"]) > at and _member(e["loc"][at])]
        ending = [e.get("input") for e in here if len(e["loc"]) == at + 1]
        if len({e["loc"][at] for e in here}) > 1 and all(value == ending[0] for value in ending):
            return at, here
    return None


def _kind(value: Any) -> str:
    for types, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                        (list, "an array"), (dict, "an object")):
        if isinstance(value, types):
            return name
    return "null" if value is None else "a value of another type"


def validation_error(exc: ValidationError, prefix: str = "") -> ApiError:
    """The first pydantic error as an ApiError naming the parameter. Where a
    union's members all failed, the member that got furthest (the value had
    its type, a part of it was wrong) says what is wrong; if none did, the
    error lists the types the parameter accepts."""
    errors = exc.errors()
    err = errors[0]
    at: int | None = None
    if (union := _union_members(errors)) is not None:
        at, members = union
        base = err["loc"][:at]
        # A member whose type the value has fails deeper, or on a constraint.
        deeper = [e for e in members if len(e["loc"]) > at + 1 or not e["type"].endswith("_type")]
        if deeper:
            err = deeper[0]
        else:
            loc = _param(base, prefix)
            accepted = list(dict.fromkeys(str(_member(e["loc"][at])) for e in members))
            return invalid(f"Invalid type for '{loc}': expected one of {' or '.join(accepted)}, "
                           f"but got {_kind(err.get('input'))} instead.", loc)
    loc = _param(err["loc"], prefix, at)
    if err["type"] == "extra_forbidden":
        return ApiError("unsupported_parameter", f"Unknown parameter: '{loc}'.", param=loc)
    if err["type"] == "missing":
        return invalid(f"Missing required parameter: '{loc}'.", loc)
    return invalid(f"Invalid value for '{loc}': {err['msg']}.", loc)


def decode_items(
    raw: str | list[Any],
    limits: RequestLimits,
    *,
    path: str = "input",
    resolve_reference: Any = None,
    open_compaction: Any = None,
    expansion: Expansion | None = None,
    additional_tools: bool = False,
) -> list[Item]:
    """Input items -> neutral items. ``resolve_reference(id)`` turns an
    ``item_reference`` into an item (stored items; each distinct id is
    resolved once); without one it is a 400. ``open_compaction(blob, id,
    where)`` expands a ``compaction`` item (the server key); without one it
    is a 400 too. ``expansion`` counts the items against the request's
    expanded bound. ``additional_tools``: the dialect reads those items'
    tools itself (``additional_tools()``); otherwise such an item is a 400
    like any unknown one."""
    if isinstance(raw, str):
        _check_text(raw, path, limits)
        items: list[Item] = [Message(role="user", text=raw)]
        if expansion is not None:
            expansion.add_all(items, path)
        return items
    if len(raw) > limits.max_input_items:
        raise invalid(f"'{path}' has {len(raw)} items; the limit is {limits.max_input_items}.", path)
    items = []
    referenced: dict[str, Item] = {}
    for i, entry in enumerate(raw):
        where = f"{path}[{i}]"
        if additional_tools and isinstance(entry, dict) and entry.get("type") == ADDITIONAL_TOOLS:
            continue
        item = _decode_item(entry, where, limits, resolve_reference, open_compaction, referenced)
        items.append(expansion.add(item, where) if expansion is not None else item)
    return items


def _decode_item(entry: Any, where: str, limits: RequestLimits, resolve_reference: Any, open_compaction: Any,
                 referenced: dict[str, Item]) -> Item:
    if not isinstance(entry, dict):
        raise invalid(f"Invalid item at '{where}': expected an object.", where)
    kind = tag(entry.get("type", "message"), f"{where}.type")
    model = _ITEM_MODELS.get(kind or "")
    if kind == COMPACTION_TRIGGER:
        raise invalid(f"'{where}': a compaction_trigger must be the last input item of a /v1/responses "
                      "request.", f"{where}.type")
    if model is None:
        raise invalid(f"Unsupported input item type {kind!r} at '{where}'.", f"{where}.type")
    try:
        parsed = model.model_validate(entry)
    except ValidationError as exc:
        raise validation_error(exc, where) from None
    if isinstance(parsed, ItemReferenceIn):
        if resolve_reference is None:
            raise invalid(
                f"'{where}' references item {parsed.id!r}, which this server has not stored; "
                "send the item itself.",
                where,
            )
        found = referenced.get(parsed.id)
        if found is None:
            found = referenced[parsed.id] = resolve_reference(parsed.id, where)
        # A copy (its strings shared): preparing a request may set fields
        # on its items, and each place in the input is an item of its own.
        return dataclasses.replace(found)
    if isinstance(parsed, CompactionIn):
        if len(parsed.encrypted_content) > limits.max_text_chars:
            raise invalid(f"'{where}.encrypted_content' is too long.", f"{where}.encrypted_content")
        if open_compaction is None:
            raise invalid(f"'{where}' is a compaction item, which only a /v1/responses request can expand.",
                          where)
        item: Item = open_compaction(parsed.encrypted_content, parsed.id, where)
        return item
    return _to_item(parsed, where, limits)


def _to_item(parsed: Lenient, where: str, limits: RequestLimits) -> Item:
    if isinstance(parsed, MessageIn):
        text = content_text(parsed.content, f"{where}.content", limits)
        _check_text(text, f"{where}.content", limits)
        return Message(role=parsed.role, text=text, id=parsed.id, phase=parsed.phase,
                       breakpoints=content_breakpoints(parsed.content, f"{where}.content", limits))
    if isinstance(parsed, FunctionCallIn):
        _check_text(parsed.arguments, f"{where}.arguments", limits)
        return ToolCall(call_id=parsed.call_id, name=parsed.name, payload=parsed.arguments, kind="function",
                        namespace=parsed.namespace or None, id=parsed.id)
    if isinstance(parsed, CustomToolCallIn):
        _check_text(parsed.input, f"{where}.input", limits)
        return ToolCall(call_id=parsed.call_id, name=parsed.name, payload=parsed.input, kind="custom",
                        namespace=parsed.namespace or None, id=parsed.id)
    if isinstance(parsed, ToolOutputIn):
        output = parsed.output if isinstance(parsed.output, str) else content_text(parsed.output, f"{where}.output", limits,
                                                                                         tool_output=True)
        _check_text(output, f"{where}.output", limits)
        return ToolOutput(call_id=parsed.call_id, output=output, id=parsed.id,
                          kind="custom" if parsed.type == "custom_tool_call_output" else "function",
                          breakpoints=content_breakpoints(parsed.output, f"{where}.output", limits))
    assert isinstance(parsed, ReasoningIn)
    summary = [p.text for p in parsed.summary or []]
    for k, part in enumerate(summary):
        _check_text(part, f"{where}.summary[{k}].text", limits)
    reasoning = "".join(p.text for p in parsed.content) if parsed.content else None
    if reasoning is not None:
        _check_text(reasoning, f"{where}.content", limits)
    if parsed.encrypted_content is not None:
        _check_text(parsed.encrypted_content, f"{where}.encrypted_content", limits)
    return Reasoning(summary=summary, text=reasoning, encrypted_content=parsed.encrypted_content, id=parsed.id)


def _check_text(text: str, path: str, limits: RequestLimits) -> None:
    if len(text) > limits.max_text_chars:
        raise invalid(f"'{path}' is {len(text)} characters; the limit is {limits.max_text_chars}.", path)


# -- tools -----------------------------------------------------------------------

# Built-in tools OpenAI runs on its side: the client never sees their
# calls. lmspd accepts them and leaves them out (Codex sends web_search on
# every request), and a tool_choice cannot force them. ``shell`` is one of
# them in a container only (``_runs_on_client``). ``tool_search`` with
# ``execution: "client"`` is Codex's own, sent on every request
# (tests/fixtures/clients/codex-cli): left out as well, so that Codex is
# served; the model is offered the tools declared up front, never a search
# for deferred ones.
HOSTED_TOOL_TYPES = {
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
    "file_search", "tool_search", "mcp", "code_interpreter", "image_generation", "shell",
    "programmatic_tool_calling",
}
# Built-in tools the client runs itself: the model's call comes back for it
# to carry out. lmspd cannot offer a model their built-in form, and leaving
# them out would answer for a model that never had them: a 400 naming them
# (a client that runs one declares it as a function or custom tool, as Codex
# declares apply_patch).
CLIENT_TOOL_TYPES = {"apply_patch", "local_shell", "computer_use_preview", "computer", "computer_use"}
# Where a shell tool runs OpenAI's container (else on the client: "local").
_HOSTED_SHELL_ENVIRONMENTS = {"container_auto", "container_reference"}


class FunctionToolIn(Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomFormatIn(Lenient):
    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class CustomToolIn(Lenient):
    type: Literal["custom"]
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    format: CustomFormatIn | None = None


class NamespaceToolIn(Lenient):
    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)


def decode_tools(raw: list[Any] | None, limits: RequestLimits, *,
                 more: Sequence[tuple[str, Any]] = ()) -> list[FunctionTool | CustomTool]:
    """``tools`` (and ``more``: ``(where, tool)`` pairs from elsewhere in the
    request, such as an ``additional_tools`` input item) as neutral tools.
    Hosted tools are skipped (OpenAI runs them, the client never does); a
    built-in tool the client runs, and any type lmspd cannot render, is a
    400 naming it."""
    entries = [(f"tools[{i}]", entry) for i, entry in enumerate(raw or [])] + list(more)
    if not entries:
        return []
    _count_tools(entries, limits)
    tools: list[FunctionTool | CustomTool] = []
    for where, entry in entries:
        tools.extend(_decode_tool(where, entry, limits))
    seen: set[str] = set()
    dupes: set[str] = set()
    for tool in tools:
        (dupes if tool.name in seen else seen).add(tool.name)
    if dupes:
        raise invalid(f"Tool names must be unique; repeated: {', '.join(sorted(dupes))}.", "tools")
    return tools


def _count_tools(entries: Sequence[tuple[str, Any]], limits: RequestLimits) -> None:
    """Every tool the model is offered counts against ``max_tools``: each
    member of a namespace as one, wherever it is declared. Counted before
    anything is decoded, so that an oversized namespace costs no work."""
    namespaces = [_namespace_members(entry) for _, entry in entries]
    sizes = [1 if members is None else len(members) for members in namespaces]
    total = sum(sizes)
    if total <= limits.max_tools:
        return
    before = 0
    for (where, _), members, size in zip(entries, namespaces, sizes, strict=True):
        if before + size > limits.max_tools:
            at = where if members is None else f"{where}.tools[{limits.max_tools - before}]"
            raise invalid(f"The request declares {total} tools; the limit is {limits.max_tools} (max_tools), "
                          f"passed at '{at}'. Each tool counts, a namespace's tools and those of additional_tools "
                          "items too.", at)
        before += size


def _namespace_members(entry: Any) -> list[Any] | None:
    if isinstance(entry, dict) and entry.get("type") == "namespace" and isinstance(entry.get("tools"), list):
        members: list[Any] = entry["tools"]
        return members
    return None


def _decode_tool(where: str, entry: Any, limits: RequestLimits) -> list[FunctionTool | CustomTool]:
    if not isinstance(entry, dict):
        raise invalid(f"Invalid tool at '{where}': expected an object.", where)
    kind = tag(entry.get("type"), f"{where}.type")
    try:
        if kind == "function":
            return [_function_tool(FunctionToolIn.model_validate(entry), where, limits)]
        if kind == "custom":
            return [_custom_tool(CustomToolIn.model_validate(entry))]
        if kind == "namespace":
            ns = NamespaceToolIn.model_validate(entry)
            out: list[FunctionTool | CustomTool] = []
            for j, sub in enumerate(ns.tools):
                sub_where = f"{where}.tools[{j}]"
                if not isinstance(sub, dict) or sub.get("type") not in ("function", "custom"):
                    shown = sub.get("type") if isinstance(sub, dict) else type(sub).__name__
                    raise invalid(f"'{sub_where}' ({_tool_label(sub)}) is of type {str(shown)[:64]!r}: lmspd renders "
                                  "only function and custom tools inside a namespace.", sub_where)
                try:
                    inner = (
                        _function_tool(FunctionToolIn.model_validate(sub), sub_where, limits)
                        if sub["type"] == "function"
                        else _custom_tool(CustomToolIn.model_validate(sub))
                    )
                except ValidationError as exc:
                    raise validation_error(exc, sub_where) from None
                inner.namespace = ns.name
                inner.name = qualify(inner.name, ns.name)
                out.append(inner)
            return out
        if kind in CLIENT_TOOL_TYPES or _runs_on_client(kind, entry):
            raise ApiError("unsupported_capability", f"'{where}' is the built-in {kind!r} tool, which the client "
                           "runs: lmspd cannot offer it to the model in that form; declare it as a function or "
                           "custom tool instead.", param=f"{where}.type")
        if kind in HOSTED_TOOL_TYPES:
            return []
    except ValidationError as exc:
        raise validation_error(exc, where) from None
    raise invalid(f"Unsupported tool type {kind!r} at '{where}' ({_tool_label(entry)}): lmspd cannot render it "
                  "for the model.", f"{where}.type")


def _runs_on_client(kind: str | None, entry: dict[str, Any]) -> bool:
    """A shell tool outside OpenAI's containers: ``environment`` local, or
    none (the shell tool's first form, whose calls the client runs)."""
    if kind != "shell":
        return False
    environment = entry.get("environment")
    return not (isinstance(environment, dict) and environment.get("type") in _HOSTED_SHELL_ENVIRONMENTS)


def _tool_label(entry: Any) -> str:
    name = entry.get("name") if isinstance(entry, dict) else None
    return f"tool {name[:128]!r}" if isinstance(name, str) else "a tool without a name"


# Codex's Responses Lite sends its tools as an input item instead of the
# top-level ``tools``: ``{"type": "additional_tools", "id"?, "role":
# "developer", "tools": [...]}`` (codex-rs/protocol ``ResponseItem::
# AdditionalTools``; the tools are Responses tool objects, its functions
# and its freeform ``exec`` inside a ``functions`` namespace).
ADDITIONAL_TOOLS = "additional_tools"


class AdditionalToolsIn(Lenient):
    type: Literal["additional_tools"]
    id: str | None = Field(default=None, max_length=512)
    role: Literal["developer", "system"] = "developer"
    tools: list[Any]


def additional_tools(raw: str | list[Any], path: str = "input") -> list[tuple[str, Any]]:
    """The tools ``raw`` input's ``additional_tools`` items declare, as
    ``(where, tool)`` pairs for ``decode_tools`` (``decode_items`` given
    ``additional_tools=True`` then passes over those items)."""
    tools: list[tuple[str, Any]] = []
    for i, entry in additional_tools_items(raw):
        where = f"{path}[{i}]"
        try:
            parsed = AdditionalToolsIn.model_validate(entry)
        except ValidationError as exc:
            raise validation_error(exc, where) from None
        tools += [(f"{where}.tools[{j}]", tool) for j, tool in enumerate(parsed.tools)]
    return tools


def additional_tools_item(declared: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """One item that declares ``declared`` (``additional_tools()`` pairs) again."""
    return {"type": ADDITIONAL_TOOLS, "role": "developer", "tools": [tool for _, tool in declared]}


def additional_tools_items(raw: str | list[Any]) -> list[tuple[int, dict[str, Any]]]:
    """``raw`` input's ``additional_tools`` items, with their places."""
    if isinstance(raw, str):
        return []
    return [(i, entry) for i, entry in enumerate(raw)
            if isinstance(entry, dict) and entry.get("type") == ADDITIONAL_TOOLS]


def _function_tool(parsed: FunctionToolIn, where: str, limits: RequestLimits) -> FunctionTool:
    if parsed.parameters is not None:
        size = len(json.dumps(parsed.parameters))
        if size > limits.max_tool_schema_bytes:
            raise invalid(
                f"'{where}.parameters' is {size} bytes; the limit is {limits.max_tool_schema_bytes}.",
                f"{where}.parameters",
            )
    return FunctionTool(
        name=parsed.name,
        description=parsed.description,
        parameters=parsed.parameters,
        strict=bool(parsed.strict),
    )


def _custom_tool(parsed: CustomToolIn) -> CustomTool:
    grammar = None
    if parsed.format is not None and parsed.format.type == "grammar":
        grammar = {"syntax": parsed.format.syntax or "lark", "definition": parsed.format.definition or ""}
    return CustomTool(name=parsed.name, description=parsed.description, grammar=grammar)


def decode_tool_choice(raw: Any, tools: list[FunctionTool | CustomTool]) -> ToolChoice:
    names = {t.name for t in tools}
    if raw is None:
        return ToolChoice()
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise invalid(f"Invalid value for 'tool_choice': {raw!r}.", "tool_choice")
        if raw == "required" and not tools:
            raise invalid("'tool_choice' is 'required' but no callable tools were given.", "tool_choice")
        return ToolChoice(mode=raw)  # type: ignore[arg-type]
    if not isinstance(raw, dict):
        raise invalid("Invalid type for 'tool_choice'.", "tool_choice")
    kind = tag(raw.get("type"), "tool_choice.type")
    if kind in ("function", "custom"):
        name = raw.get("name")
        if not isinstance(name, str) or name not in names:
            raise invalid(f"'tool_choice' names tool {name!r}, which is not in 'tools'.", "tool_choice.name")
        return ToolChoice(mode="required", allowed=[name])
    if kind == "allowed_tools":
        mode = tag(raw.get("mode", "auto"), "tool_choice.mode")
        if mode != "auto" and mode != "required":
            raise invalid(f"Invalid 'tool_choice.mode': {mode!r}.", "tool_choice.mode")
        chosen: Literal["auto", "required"] = "auto" if mode == "auto" else "required"
        listed = raw.get("tools") or []
        if not isinstance(listed, list):
            raise invalid("'tool_choice.tools' must be an array.", "tool_choice.tools")
        allowed: list[str] = []
        for j, t in enumerate(listed):
            if not isinstance(t, dict):
                raise invalid(f"'tool_choice.tools[{j}]' must be an object.", f"tool_choice.tools[{j}]")
            listed_kind = tag(t.get("type"), f"tool_choice.tools[{j}].type")
            if listed_kind in CLIENT_TOOL_TYPES:
                raise _forced_builtin(listed_kind, f"tool_choice.tools[{j}]")
            if listed_kind in HOSTED_TOOL_TYPES:
                continue
            name = t.get("name")
            if not isinstance(name, str) or name not in names:
                raise invalid(f"'tool_choice.tools[{j}]' names {name!r}, which is not in 'tools'.",
                              f"tool_choice.tools[{j}]")
            allowed.append(name)
        if mode == "required" and not allowed:
            raise invalid("'tool_choice' requires a call but allows no callable tool.", "tool_choice.tools")
        return ToolChoice(mode=chosen, allowed=allowed)
    if kind in HOSTED_TOOL_TYPES or kind in CLIENT_TOOL_TYPES:
        raise _forced_builtin(kind, "tool_choice")
    raise invalid(f"Invalid 'tool_choice.type': {kind!r}.", "tool_choice.type")


def _forced_builtin(kind: str, param: str) -> ApiError:
    where = "runs on the client" if kind in CLIENT_TOOL_TYPES else "OpenAI runs"
    return ApiError("unsupported_capability", f"'{param}' names the built-in tool {kind!r}, which {where}: lmspd "
                    "never offers it to the model (a tool the client runs is declared as a function or custom "
                    "tool).", param=param)


def decode_json_format(raw: dict[str, Any] | None, path: str) -> OutputFormat:
    """OpenAI ``text.format`` (flat) or LMSP ``response_format`` (nested)."""
    if raw is None:
        return OutputFormat()
    kind = tag(raw.get("type", "text"), f"{path}.type")
    if kind == "text":
        return OutputFormat()
    if kind == "json_object":
        return OutputFormat(type="json_object")
    if kind != "json_schema":
        raise invalid(f"Invalid '{path}.type': {kind!r}.", f"{path}.type")
    nested = "json_schema" in raw  # Chat Completions nests it; Responses does not
    spec = raw.get("json_schema", raw)
    base = f"{path}.json_schema" if nested else path
    if not isinstance(spec, dict):
        raise invalid(f"'{base}' must be an object.", base)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"Missing required parameter: '{base}.name'.", f"{base}.name")
    schema = spec.get("schema")
    if schema is None and nested:
        # Optional in Chat Completions: any JSON object then.
        return OutputFormat(type="json_object")
    if not isinstance(schema, dict):
        raise invalid(f"Missing required parameter: '{base}.schema'.", f"{base}.schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        # As a tool's strict: "false" is no boolean, never a truthy string.
        raise invalid(f"Invalid value for '{base}.strict': Input should be a valid boolean.", f"{base}.strict")
    return OutputFormat(type="json_schema", name=name, schema=schema, strict=strict is True, param=f"{base}.schema")


def check_metadata(metadata: dict[str, str] | None, limits: RequestLimits) -> None:
    """OpenAI's metadata bounds (Responses and Chat Completions alike)."""
    if metadata is None:
        return
    if len(metadata) > limits.max_metadata_pairs:
        raise invalid(f"'metadata' has {len(metadata)} keys; the limit is {limits.max_metadata_pairs}.", "metadata")
    for key, value in metadata.items():
        if len(key) > limits.max_metadata_key_chars or len(value) > limits.max_metadata_value_chars:
            raise invalid(f"'metadata.{key[:64]}' is too long.", "metadata")


def compaction_json(item: Message) -> dict[str, Any]:
    """A compaction item as both Responses dialects write it: the sealed
    summary, never its text (what it expands to is the server's alone)."""
    return {"id": item.id, "type": "compaction", "encrypted_content": item.compaction}
