"""LMSP 1.0 (``/lmsp/v1/responses``): request decoding and wire encoding.

Shapes are those of the LMSP 1.0 draft §6 (seed 004): events carry integer
ids from 1, ``event:`` names, and small data objects keyed by
``response_id``; a function call arrives whole in ``output_item.done``.
A call keeps its ``namespace``, and a custom tool's call its own item type
(``item_json``), so that it is read back as the call the model made.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import Field, ValidationError

from lmspd.core import compaction
from lmspd.core.conversation import Conversation, CustomTool, Item, Message, Reasoning, ToolCall
from lmspd.core.errors import ApiError, invalid
from lmspd.core.limits import MAX_RESPONSE_ID_CHARS, RequestLimits
from lmspd.streaming import steps
from lmspd.streaming.session import ResponseState
from lmspd.streaming.steps import Step

from .extensions import Extensions, decode_extensions, response_extensions
from .responses_items import (
    Expansion,
    StoredContext,
    Strict,
    compaction_json,
    decode_items,
    decode_json_format,
    decode_tool_choice,
    decode_tools,
    stored_history,
    validation_error,
)

VERSION = "1.0"


def check_version(header: str | None) -> None:
    """A missing header means 1.0; any 1.x is accepted; another major is not."""
    if header is None or header.strip() == "":
        return
    major = header.strip().split(".", 1)[0]
    if major != "1":
        raise ApiError(
            "unsupported_version",
            f"LMSP-Version {header.strip()!r} is not supported; this server speaks LMSP {VERSION}.",
            param="LMSP-Version",
        )


class LmspCreateResponse(Strict):
    model: str = Field(min_length=1, max_length=256)
    input: Union[str, list[Any]]
    # null is the default, as for the optional fields below.
    stream: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = Field(default=None, max_length=MAX_RESPONSE_ID_CHARS)
    extensions: dict[str, Any] | None = None


class LmspRequest:
    """``input_items`` is this request's own input; ``conversation.items``
    puts the stored ``previous_response_id`` chain before it."""

    def __init__(self, body: LmspCreateResponse, conversation: Conversation, extensions: Extensions,
                 input_items: list[Item]) -> None:
        self.body = body
        self.conversation = conversation
        self.extensions = extensions
        self.input_items = input_items

    @property
    def stream(self) -> bool:
        return self.body.stream is True

    @property
    def store(self) -> bool:
        return self.body.store is True

    # LMSP runs in the background through tasks, not a request flag, and has
    # no conversations object.
    background = False
    conversation_id = None

    @property
    def previous_response_id(self) -> str | None:
        return self.body.previous_response_id


def decode_request(raw: dict[str, Any], limits: RequestLimits, *,
                   context: StoredContext | None = None) -> LmspRequest:
    try:
        body = LmspCreateResponse.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    expansion = Expansion(limits)
    items = decode_items(body.input, limits,
                         resolve_reference=context.resolve_reference if context is not None else None,
                         expansion=expansion)
    history = stored_history(context, body.previous_response_id, None, expansion)
    for i, entry in enumerate(body.tools or ()):
        # Before decoding, which drops the hosted tools /v1 cannot run (Codex
        # sends web_search every turn): here that would be a 200 and a model
        # that never calls the tool. LMSP 1.0 has function tools; lmspd also
        # takes a namespace of them, as /v1 writes its calls (item_json).
        if isinstance(entry, dict) and entry.get("type") not in ("function", "namespace"):
            raise invalid(f"LMSP 1.0 tools must be of type 'function', not {str(entry.get('type'))[:64]!r}: "
                          "the service runs no tools itself.", f"tools[{i}].type")
    tools = decode_tools(body.tools, limits)
    for i, tool in enumerate(tools):
        if isinstance(tool, CustomTool):
            raise invalid("LMSP 1.0 tools must be of type 'function'.", f"tools[{i}].type")
    choice = decode_tool_choice(body.tool_choice, tools)
    extensions = decode_extensions(body.extensions)
    conversation = Conversation(
        model=body.model,
        # A chain may pass through a compaction made over /v1: it stands
        # for the turns before it here too.
        items=compaction.effective_items(history + items),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        output_format=decode_json_format(body.response_format, "response_format"),
        sampling=extensions.sampling(temperature=body.temperature, top_p=body.top_p),
        max_output_tokens=body.max_output_tokens,
        previous_response_id=body.previous_response_id,
        cache_reuse=extensions.cache_reuse,
        speculative=extensions.speculative,
        require_reasoning_state=True,
    )
    return LmspRequest(body, conversation, extensions, items)


# -- encoding --------------------------------------------------------------------


def item_json(item: Message | ToolCall | Reasoning) -> dict[str, Any]:
    if isinstance(item, Message) and item.compaction is not None:
        # A response made over /v1 that compacted, read over /lmsp/v1: its
        # item as the client sends it back, not the summary as a message.
        return compaction_json(item)
    if isinstance(item, Message):
        content = [{"type": "output_text", "text": item.text}] if item.text or item.status != "in_progress" else []
        return {"id": item.id, "type": "message", "role": "assistant", "content": content}
    if isinstance(item, ToolCall):
        # Written as it is read back (seed 004 §6.5: the client replays the
        # call "as it was received"), in the Responses shapes LMSP's items
        # follow: a custom tool's call (LMSP declares functions only, but a
        # response made over /v1 is read and continued here too) stays a
        # ``custom_tool_call`` with its raw ``input``, and a namespace
        # member's call keeps its ``namespace``: the bare name is another
        # tool to the model, and a replay that no longer matches what it
        # generated. A call outside any namespace is the seed's shape exactly.
        if item.kind == "custom":
            call = {"id": item.id, "type": "custom_tool_call", "call_id": item.call_id, "name": item.name,
                    "input": item.payload}
        else:
            call = {"id": item.id, "type": "function_call", "call_id": item.call_id, "name": item.name,
                    "arguments": item.payload}
        if item.namespace:
            call["namespace"] = item.namespace
        return call
    # As the Responses dialect writes it: ``summary`` holds summaries only
    # (a /v1 request may have asked for them), the model's own reasoning is
    # ``reasoning_text`` content, never passed off as a summary.
    out: dict[str, Any] = {"id": item.id, "type": "reasoning",
                           "summary": [{"type": "summary_text", "text": s} for s in item.summary]}
    if item.text is not None:
        out["content"] = [{"type": "reasoning_text", "text": item.text}] if item.text else []
    return out


def usage_json(state: ResponseState) -> dict[str, Any] | None:
    u = state.usage
    if u is None:
        return None
    return {
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "total_tokens": u.total_tokens,
        # Not in the draft; how much of the input came from the KV cache.
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def error_json(state: ResponseState) -> dict[str, Any] | None:
    if state.error is None:
        return None
    return ApiError(state.error["code"], state.error["message"]).problem()


def error_event(exc: ApiError) -> dict[str, Any]:
    """The ``error`` event (§6.3): a problem after which the stream cannot go on."""
    return {"error": exc.problem()}


def response_json(state: ResponseState) -> dict[str, Any]:
    body = {
        "id": state.id,
        "object": "response",
        "created_at": state.created_at,
        "status": state.status,
        "model": state.model,
        "output": [item_json(i) for i in state.output],
        "usage": usage_json(state),
        "error": error_json(state),
        "incomplete_details": {"reason": state.incomplete_reason} if state.incomplete_reason else None,
    }
    extensions = response_extensions(state)
    if extensions is not None:
        body["extensions"] = extensions
    return body


class LmspEncoder:
    first_sequence_number = 1

    def encode(self, step: Step, state: ResponseState, seq: int) -> tuple[str, dict[str, Any]] | None:
        rid = state.id
        match step:
            case steps.TextDelta(_, item, delta):
                return "response.output_text.delta", {"response_id": rid, "item_id": item.id, "delta": delta}
            case steps.ItemAdded(index, item):
                return "response.output_item.added", {"response_id": rid, "output_index": index,
                                                      "item": item_json(item)}
            case steps.ItemDone(index, item):
                return "response.output_item.done", {"response_id": rid, "output_index": index,
                                                     "item": item_json(item)}
            case steps.ResponseCreated() | steps.ResponseCancelled():
                return step.event, {"response_id": rid, "status": state.status}
            case steps.ResponseCompleted():
                return step.event, {"response_id": rid, "status": state.status, "usage": usage_json(state)}
            case steps.ResponseIncomplete():
                return step.event, {"response_id": rid, "status": state.status,
                                    "incomplete_details": {"reason": state.incomplete_reason},
                                    "usage": usage_json(state)}
            case steps.ResponseFailed():
                return step.event, {"response_id": rid, "status": state.status, "error": error_json(state)}
        # in_progress, content parts, argument deltas, reasoning text: not in
        # LMSP 1.0's event set; the items arrive whole in output_item.done.
        return None


def state_from_log(
    events: list[tuple[str, dict[str, Any]]], *, model: str, created_at: int
) -> tuple[ResponseState, int | None]:
    """Replay a stream's events (as ``LmspEncoder`` wrote them) into the
    response they describe, and the index of the item still open, if any.
    LMSP events carry neither the model nor the creation time: the caller
    knows them from the task."""
    from .openai_responses import output_item

    state: ResponseState | None = None
    open_index: int | None = None
    by_id: dict[str, int] = {}
    for name, data in events:
        if name == "response.created":
            state = ResponseState(id=data["response_id"], model=model, created_at=created_at,
                                  status="in_progress")
            continue
        if state is None:
            continue
        if name in ("response.output_item.added", "response.output_item.done"):
            index = data["output_index"]
            item = output_item({**data["item"], "status": "in_progress" if name.endswith("added") else "completed"})
            if index == len(state.output):
                state.output.append(item)
            else:
                state.output[index] = item
            if item.id:
                by_id[item.id] = index
            if name.endswith("added") and isinstance(item, (Message, Reasoning)):
                open_index = index
            elif open_index == index:
                open_index = None
        elif name == "response.output_text.delta":
            item = state.output[by_id[data["item_id"]]]
            assert isinstance(item, Message)  # only messages get output_text deltas
            item.text += data["delta"]
    if state is None:
        raise ValueError("the log has no response.created event")
    return state, open_index
