"""Stream validators for the message-list dialects (Chat Completions,
Anthropic Messages), used by unit and end-to-end tests alike.

Each checks what clients of that API depend on and then rebuilds the final
object with the vendor SDK's own accumulator, so a stream the SDK would
misread fails here first.
"""

from __future__ import annotations

from typing import Any

from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message as AnthropicMessage
from anthropic.types import RawMessageStreamEvent
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import TypeAdapter

_ANTHROPIC_EVENT = TypeAdapter(RawMessageStreamEvent)


def validate_chat_stream(chunks: list[dict[str, Any]], *, include_usage: bool = False) -> dict[str, Any]:
    """Validate a whole chat.completion.chunk stream (without ``[DONE]``);
    return ``{completion, content, reasoning, tool_calls, finish_reason, usage}``."""
    assert chunks, "empty stream"
    assert all("error" not in c for c in chunks), f"stream failed: {chunks[-1]}"
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1, f"chunk id changed: {ids}"
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
        assert c["object"] == "chat.completion.chunk"
        assert ("usage" in c) == include_usage, "usage key on every chunk exactly when include_usage"
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant", "the first delta names the role"
    body = chunks[:-1] if include_usage else chunks
    if include_usage:
        last = chunks[-1]
        assert last["choices"] == [] and last["usage"] is not None, "the usage chunk comes last, without choices"
        assert all(c["usage"] is None for c in body)
    finishes = [c["choices"][0]["finish_reason"] for c in body]
    assert finishes[-1] is not None and all(f is None for f in finishes[:-1]), finishes
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in body)

    seen: list[int] = []
    for c in body:
        for call in c["choices"][0]["delta"].get("tool_calls") or []:
            if call["index"] not in seen:
                assert call["index"] == len(seen), "tool call indexes count up from 0"
                assert call["id"] and call["type"] == "function" and call["function"]["name"], call
                seen.append(call["index"])
            else:
                assert call["index"] == seen[-1], "arguments for an earlier call after a later one started"

    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    # The snapshot, not get_final_completion(): that one raises on a
    # ``length`` finish, which is a valid stream.
    completion = state.current_completion_snapshot
    message = completion.choices[0].message
    return {
        "completion": completion,
        "content": message.content,
        "reasoning": reasoning,
        "tool_calls": [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                       for t in message.tool_calls or []],
        "finish_reason": completion.choices[0].finish_reason,
        "usage": chunks[-1]["usage"] if include_usage else None,
    }


def check_chat_completion(body: dict[str, Any]) -> ChatCompletion:
    completion = ChatCompletion.model_validate(body)
    assert body["object"] == "chat.completion" and len(body["choices"]) == 1
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert 0 <= u["prompt_tokens_details"]["cached_tokens"] <= u["prompt_tokens"]
    return completion


def validate_anthropic_stream(events: list[tuple[str, dict[str, Any]]]) -> AnthropicMessage:
    """Validate an Anthropic Messages stream of ``(event name, data)``;
    return the final Message as the SDK's accumulator builds it."""
    assert events, "empty stream"
    for name, data in events:
        assert data["type"] == name, "the event: line must equal the data's type"
    names = [n for n, _ in events]
    assert names[0] == "message_start", names
    assert names[-1] == "message_stop" and names.count("message_stop") == 1, names
    assert names.count("message_delta") == 1 and names[-2] == "message_delta", names
    assert "error" not in names

    open_block: int | None = None
    started = 0
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    last_start: dict[str, Any] = {}
    for name, data in events:
        if name == "ping":
            continue
        _ANTHROPIC_EVENT.validate_python(data)
        if name == "content_block_start":
            assert open_block is None, "a block started before the previous one stopped"
            assert data["index"] == started, "block indexes count up from 0"
            open_block, started = data["index"], started + 1
        elif name == "content_block_delta":
            assert data["index"] == open_block, "a delta for a block that is not open"
            kind = data["delta"]["type"]
            block_type = last_start["content_block"]["type"]
            assert (kind, block_type) in {("text_delta", "text"), ("thinking_delta", "thinking"),
                                          ("signature_delta", "thinking"), ("input_json_delta", "tool_use")}, \
                (kind, block_type)
        elif name == "content_block_stop":
            assert data["index"] == open_block
            open_block = None
        if name == "content_block_start":
            last_start = data
        snapshot = accumulate_event(event=data, current_snapshot=snapshot,  # type: ignore[arg-type]
                                    json_bufs=json_bufs)
    assert open_block is None, "a block was never stopped"
    assert snapshot is not None
    return AnthropicMessage.model_validate(snapshot.model_dump())


def check_anthropic_message(body: dict[str, Any]) -> AnthropicMessage:
    message = AnthropicMessage.model_validate(body)
    assert body["type"] == "message" and body["role"] == "assistant"
    # Every StopReason of the SDK but pause_turn (server tools, which lmspd does not run).
    assert body["stop_reason"] in ("end_turn", "max_tokens", "tool_use", "stop_sequence", "refusal",
                                   "model_context_window_exceeded")
    u = body["usage"]
    assert u["input_tokens"] >= 0 and u["cache_read_input_tokens"] >= 0 and u["output_tokens"] >= 0
    return message
