"""Neutral conversation -> the chat-template messages of one model.

The same conversation always renders to the same text, which is what lets the
continuation cache compare a request with what the model already saw.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from lmspd.core.conversation import Conversation, Item, Message, Reasoning, ToolCall, ToolOutput, qualify
from lmspd.core.errors import ApiError

from .client_text import neutral_items
from .template import ChatTemplate


def template_messages(
    conversation: Conversation, template: ChatTemplate, tool_format: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Return ``(messages, tools)`` as a Hugging Face chat template expects them."""
    native_tools = bool(tool_format is not None and tool_format.native)
    # Client strings can never spell a control token (lmspd.engines.llama.client_text).
    client = template.client_text
    # tool_choice "none" still lists the tools, so that the prompt (and the
    # cache) stay the same across turns.
    offered = list(conversation.tools)
    items = [_as_written(item) for item in conversation.items]
    instructions = conversation.instructions
    if client is not None:
        offered, items = neutral_items(offered, client), neutral_items(items, client)
        instructions = client.neutral(instructions) if instructions else instructions
    all_items = list(items)
    messages: list[dict[str, Any]] = []
    system_parts: list[str] = []
    if instructions:
        system_parts.append(instructions)

    # Leading system/developer messages become the one system message most
    # templates require at the start.
    while items and isinstance(first := items[0], Message) and first.role in ("system", "developer"):
        items.pop(0)
        system_parts.append(first.text)

    if offered and tool_format is not None and not native_tools:
        system_parts.append(tool_format.system_block(offered))
    if system_parts:
        messages.append({"role": "system", "content": "\n\n".join(system_parts)})

    names = {i.call_id: i.name for i in all_items if isinstance(i, ToolCall)}
    pending_calls: list[ToolCall] = []
    pending_outputs: list[ToolOutput] = []
    # A native template's call turn that has no text: its hidden reasoning,
    # as the turn's content (the template renders it in front of the calls).
    calls_content: list[str] = [""]

    def flush_calls() -> None:
        if not pending_calls:
            return
        calls = list(pending_calls)
        pending_calls.clear()
        if native_tools:
            content, calls_content[0] = calls_content[0], ""
            entry = {"role": "assistant", "content": content, "tool_calls": tool_format.template_tool_calls(calls)}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]:
                messages[-1]["tool_calls"] = entry["tool_calls"]
            else:
                messages.append(entry)
            return
        text = _require_format(tool_format).render_calls([_canonical(c) for c in calls])
        if messages and messages[-1]["role"] == "assistant":
            messages[-1]["content"] += text
        else:
            messages.append({"role": "assistant", "content": text})

    def flush_outputs() -> None:
        if not pending_outputs:
            return
        outputs = list(pending_outputs)
        pending_outputs.clear()
        if native_tools:
            for out in outputs:
                messages.append(tool_format.template_tool_message(out, names.get(out.call_id)))
            return
        messages.append(
            {"role": "user", "content": _require_format(tool_format).render_outputs(outputs, names)}
        )

    hidden = ""  # a replayed turn's hidden reasoning, rendered in front of it
    for item in items:
        if isinstance(item, ToolCall):
            flush_outputs()
            if hidden and not pending_calls:
                # The reasoning of a turn that went straight to its calls.
                # (A native template's went unrendered: it waited for the
                # next assistant text, past the outputs and user turns, and
                # was rendered there, in a later turn.)
                if native_tools:
                    calls_content[0] = hidden
                else:
                    messages.append({"role": "assistant", "content": hidden})
                hidden = ""
            pending_calls.append(item)
            continue
        flush_calls()
        if isinstance(item, ToolOutput):
            pending_outputs.append(item)
            continue
        flush_outputs()
        if isinstance(item, Message):
            role = "system" if item.role == "developer" else item.role
            text = item.text
            if role == "assistant" and hidden:
                text, hidden = hidden + text, ""
            elif role != "assistant":
                hidden = ""  # a turn's reasoning never moves past another's message
            messages.append({"role": role, "content": text})
        elif isinstance(item, Reasoning):
            # Only reasoning the server sealed itself is rendered, exactly as
            # sampled; visible summaries are not part of the prompt.
            hidden = item.hidden or ""
    flush_calls()
    flush_outputs()
    tools = tool_format.template_tools(offered) if native_tools and offered else None
    return messages, tools


def _as_written(item: Item) -> Item:
    """A call as the model wrote it: a namespace's member under its
    qualified name, which is what the model was offered (the parser reads
    it back to the plain name and the namespace)."""
    if isinstance(item, ToolCall) and item.namespace:
        return dataclasses.replace(item, name=qualify(item.name, item.namespace), namespace=None)
    return item


def _canonical(call: ToolCall) -> ToolCall:
    """Past calls render with canonical JSON arguments: clients replay them
    re-serialized (Anthropic, Chat Completions SDKs parse and dump them), and
    the visible transcript must render the same whichever dialect replays."""
    if call.kind != "function":
        return call
    try:
        payload = json.dumps(json.loads(call.payload or "{}"), ensure_ascii=False)
    except ValueError:
        return call
    return dataclasses.replace(call, payload=payload)


def _require_format(tool_format: Any | None) -> Any:
    if tool_format is None:
        raise ApiError("unsupported_capability", "This model cannot render tool calls.")
    return tool_format
