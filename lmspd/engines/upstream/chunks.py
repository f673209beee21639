"""Chat Completions stream chunks: SSE events -> typed provider-side values.

This is the only place that knows the provider's JSON shapes. It checks
types strictly (a field of the wrong type is a protocol error, not a
guess) and keeps everything the provider said at the provider boundary:
its ids, model, creation time, choice and tool indexes, fragmented call ids,
names and arguments, finish reasons and usage. Whether those fragments form
a coherent, allowed response is the bridge's business.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from lmspd.core.errors import ApiError
from lmspd.core.limits import UpstreamStreamLimits
from lmspd.core.strict_json import count_values, decode_json, value_bound

from .credentials import Secret
from .errors import (
    DataAfterDone,
    DuplicateTerminal,
    DuplicateToolIndex,
    InvalidToolIndex,
    MalformedChunk,
    private_text,
)
from .sse import SSEDecoder, SSEEvent

__all__ = [
    "DONE",
    "ChatChunk",
    "ChatChunkDecoder",
    "ChatDelta",
    "ChunkChoice",
    "ChunkUsage",
    "Done",
    "ProviderError",
    "StreamItem",
    "ToolCallFragment",
    "decode_event",
    "decode_payload",
]


@dataclass(frozen=True, slots=True)
class ToolCallFragment:
    index: int
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass(frozen=True, slots=True)
class ChatDelta:
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    tool_calls: tuple[ToolCallFragment, ...] = ()


@dataclass(frozen=True, slots=True)
class ChunkChoice:
    index: int
    delta: ChatDelta = field(default_factory=ChatDelta)
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class ChunkUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ChatChunk:
    id: str | None = None
    model: str | None = None
    created: int | None = None
    choices: tuple[ChunkChoice, ...] = ()
    usage: ChunkUsage | None = None


@dataclass(frozen=True, slots=True)
class ProviderError:
    """An error the provider reported inside the stream. Untrusted text."""

    message: str | None = None
    type: str | None = None
    code: str | None = None


@dataclass(frozen=True, slots=True)
class Done:
    """The provider's ``data: [DONE]`` marker."""


DONE = Done()
StreamItem = ChatChunk | ProviderError | Done


# -- field readers ----------------------------------------------------------------


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise MalformedChunk(f"{where} must be an object.")
    return value


def _optional_object(value: Any, where: str) -> dict[str, Any]:
    return {} if value is None else _object(value, where)


def _string(obj: dict[str, Any], key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is None or isinstance(value, str):
        return value
    raise MalformedChunk(f"{where}.{key} must be a string.")


def _integer(obj: dict[str, Any], key: str, where: str) -> int | None:
    value = obj.get(key)
    # bool is an int subclass; true is not a count.
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise MalformedChunk(f"{where}.{key} must be an integer.")


def _count(obj: dict[str, Any], key: str, where: str) -> int:
    value = _integer(obj, key, where)
    if value is None:
        return 0
    if value < 0:
        raise MalformedChunk(f"{where}.{key} must not be negative.")
    return value


def _list(obj: dict[str, Any], key: str, where: str) -> list[Any]:
    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise MalformedChunk(f"{where}.{key} must be an array.")
    return value


# -- payload decoding -----------------------------------------------------------


def _tool_call(raw: Any) -> ToolCallFragment:
    where = "delta.tool_calls[]"
    call = _object(raw, where)
    index = call.get("index")
    if index is None:
        raise InvalidToolIndex("The upstream provider sent a tool call without an index.")
    if not isinstance(index, int) or isinstance(index, bool):
        raise InvalidToolIndex("The upstream provider sent a tool call index that is not an integer.")
    if index < 0:
        raise InvalidToolIndex("The upstream provider sent a negative tool call index.")
    kind = _string(call, "type", where)
    if kind not in (None, "function"):
        raise MalformedChunk("delta.tool_calls[].type must be 'function'.")
    function = _optional_object(call.get("function"), f"{where}.function")
    return ToolCallFragment(
        index=index,
        id=_string(call, "id", where),
        type=kind,
        name=_string(function, "name", f"{where}.function"),
        arguments=_string(function, "arguments", f"{where}.function"),
    )


def _delta(raw: Any) -> ChatDelta:
    delta = _optional_object(raw, "choices[].delta")
    if delta.get("function_call") is not None and delta.get("tool_calls") is None:
        # The legacy single-call shape has no index; we never ask for it.
        # Next to tool_calls it is a mirror (llama-cpp-python sends both) and
        # is ignored: tool_calls is the one source of truth.
        raise MalformedChunk("delta.function_call is not supported; expected delta.tool_calls.")
    fragments = tuple(_tool_call(call) for call in _list(delta, "tool_calls", "delta"))
    if len({fragment.index for fragment in fragments}) != len(fragments):
        raise DuplicateToolIndex("The upstream provider repeated a tool index within one chunk.")
    where = "delta"
    return ChatDelta(
        role=_string(delta, "role", where),
        content=_string(delta, "content", where),
        reasoning_content=_string(delta, "reasoning_content", where),
        reasoning=_string(delta, "reasoning", where),
        refusal=_string(delta, "refusal", where),
        tool_calls=fragments,
    )


def _choice(raw: Any) -> ChunkChoice:
    where = "choices[]"
    choice = _object(raw, where)
    index = _integer(choice, "index", where)
    if index is None or index < 0:
        raise MalformedChunk("choices[].index must be a non-negative integer.")
    return ChunkChoice(
        index=index,
        delta=_delta(choice.get("delta")),
        finish_reason=_string(choice, "finish_reason", where),
    )


def _usage(raw: Any) -> ChunkUsage | None:
    if raw is None:
        return None
    usage = _object(raw, "usage")
    prompt = _optional_object(usage.get("prompt_tokens_details"), "usage.prompt_tokens_details")
    completion = _optional_object(usage.get("completion_tokens_details"), "usage.completion_tokens_details")
    return ChunkUsage(
        prompt_tokens=_count(usage, "prompt_tokens", "usage"),
        completion_tokens=_count(usage, "completion_tokens", "usage"),
        total_tokens=_count(usage, "total_tokens", "usage"),
        cached_tokens=_count(prompt, "cached_tokens", "usage.prompt_tokens_details"),
        cache_write_tokens=_count(prompt, "cache_write_tokens", "usage.prompt_tokens_details"),
        reasoning_tokens=_count(completion, "reasoning_tokens", "usage.completion_tokens_details"),
    )


def _private_text(value: Any, secret: Secret | None) -> str | None:
    # Kept for logs only (errors.private_text: the key out, then the cut).
    if value is None:
        return None
    return private_text(value if isinstance(value, str) else json.dumps(value), secret)


def _provider_error(body: Any, secret: Secret | None) -> ProviderError:
    # Shapes seen in the wild: {"error": {...}}, {"error": "text"} and vLLM's
    # older top-level {"object": "error", "message": ...}.
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict):
            body = inner
        elif inner is not None:
            return ProviderError(message=_private_text(inner, secret))
    if not isinstance(body, dict):
        return ProviderError(message=_private_text(body, secret))
    code = body.get("code")
    return ProviderError(
        message=_private_text(body.get("message"), secret),
        type=_private_text(body.get("type"), secret),
        code=None if code is None else _private_text(code if isinstance(code, str) else str(code), secret),
    )


def decode_payload(payload: Any, secret: Secret | None = None) -> ChatChunk | ProviderError:
    """One parsed ``data`` JSON value -> a chunk or a provider error (its
    text with ``secret``, the provider key, scrubbed out)."""
    body = _object(payload, "The chunk")
    if body.get("error") is not None or body.get("object") == "error":
        return _provider_error(body, secret)
    return ChatChunk(
        id=_string(body, "id", "chunk"),
        model=_string(body, "model", "chunk"),
        created=_integer(body, "created", "chunk"),
        choices=_choices(body),
        usage=_usage(body.get("usage")),
    )


def _choices(body: dict[str, Any]) -> tuple[ChunkChoice, ...]:
    choices = tuple(_choice(choice) for choice in _list(body, "choices", "chunk"))
    if len({choice.index for choice in choices}) != len(choices):
        raise DuplicateToolIndex("The upstream provider repeated a choice index within one chunk.")
    return choices


def _parse_json(text: str, max_values: int) -> Any:
    # As strict as a client's body (lmspd.core.strict_json): a lone
    # surrogate (an emoji's pair split across chunks), a duplicate key or
    # a non-finite number is a malformed chunk, never text to stream.
    if _too_many_values(text, max_values):
        raise MalformedChunk(f"The upstream provider sent a chunk of more than {max_values} JSON values "
                             "(max_event_values).")
    try:
        return decode_json(text)
    except ApiError:
        raise MalformedChunk("The upstream provider sent a chunk that is not valid JSON.") from None


def _too_many_values(text: str, limit: int) -> bool:
    """Counted without parsing (``lmspd.core.strict_json``): nearly every
    chunk passes on the bound alone."""
    return value_bound(text) > limit and count_values(text.encode("utf-8", "surrogatepass"), limit) > limit


def _is_done(data: str) -> bool:
    return data.strip() == "[DONE]"


def decode_event(event: SSEEvent, secret: Secret | None = None,
                 max_values: int = UpstreamStreamLimits.max_event_values) -> StreamItem | None:
    """One SSE event -> a stream item, or None for events that carry none
    (named events a Chat Completions client has no listener for, empty
    keep-alive data)."""
    if event.event == "error":
        try:
            if _too_many_values(event.data, max_values):
                raise ValueError("too many values to parse")
            return _provider_error(json.loads(event.data), secret)
        except (ValueError, RecursionError):
            return ProviderError(message=_private_text(event.data, secret))
    if event.event != "message" or not event.data.strip():
        return None
    if _is_done(event.data):
        return DONE
    return decode_payload(_parse_json(event.data, max_values), secret)


class ChatChunkDecoder:
    """Bytes -> ``ChatChunk`` / ``ProviderError`` / ``Done``, under any chunking.

    A second ``[DONE]`` raises ``DuplicateTerminal`` and any other data after
    ``[DONE]`` raises ``DataAfterDone`` — for callers that keep draining. The
    bridge stops at the first terminal marker and never gets that far.
    """

    def __init__(self, limits: UpstreamStreamLimits | None = None, *, secret: Secret | None = None) -> None:
        self._sse = SSEDecoder(limits)
        self._max_values = (limits or UpstreamStreamLimits()).max_event_values
        self._secret = secret  # the provider key, kept out of what a provider's error said
        self._done_seen = False

    @property
    def done_seen(self) -> bool:
        return self._done_seen

    def feed(self, data: bytes) -> list[StreamItem]:
        return list(self.iter_feed(data))

    def iter_feed(self, data: bytes) -> Iterator[StreamItem]:
        for event in self._sse.iter_feed(data):
            item = self.decode(event)
            if item is not None:
                yield item

    def close(self) -> list[StreamItem]:
        # Raises SSETruncated when the stream stopped inside an event. An
        # SSE close never completes an event, so nothing else comes out.
        self._sse.close()
        return []

    def decode(self, event: SSEEvent) -> StreamItem | None:
        if self._done_seen:
            # Judge what follows [DONE] without parsing it: it is wrong either way.
            if event.event == "message" and _is_done(event.data):
                raise DuplicateTerminal()
            if event.event == "error" or (event.event == "message" and event.data.strip()):
                raise DataAfterDone()
            return None
        item = decode_event(event, self._secret, self._max_values)
        if isinstance(item, Done):
            self._done_seen = True
        return item
