"""Calls of a namespace's members (Codex's Responses Lite: the function
``exec_command`` and the custom ``apply_patch`` in its ``functions``
namespace) through the llama engine: the model is offered, and writes,
``functions__apply_patch``; the call the client gets carries
``apply_patch`` and the namespace apart; replayed, the call renders to the
model exactly as the model wrote it, which is what lets the cache continue
the turn. The tokens are fed as the scheduler feeds sampled ones, through
the real tool-call parser; the items go through the Responses dialect's own
encoder and decoder."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

from lmspd.core.conversation import Conversation, Message, ToolCall
from lmspd.core.events import ToolCallDone, ToolCallStarted
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.dialects import openai_responses
from lmspd.dialects.responses_items import decode_items
from lmspd.engines.llama.preparation import LlamaPrepared
from lmspd.engines.llama.prompt import template_messages
from lmspd.engines.llama.template import ChatTemplate
from lmspd.engines.llama.tool_formats import FallbackFormat
from support.generation_rig import EOG, PROMPT, ToyVocab, toy_generation

FIXTURE = Path(__file__).parents[3] / "fixtures" / "codex" / "responses_lite_additional_tools.json"
TEMPLATE = ChatTemplate(None)  # ChatML, which knows no tools: lmspd's own call syntax
FORMAT = FallbackFormat()
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+a\n*** End Patch\n"
# What the model writes: the names it was offered.
WRITTEN = FORMAT.render_calls([ToolCall("", "functions__apply_patch", PATCH, kind="custom"),
                               ToolCall("", "functions__exec_command", '{"cmd": "ls"}')])


def lite_conversation() -> Conversation:
    body = copy.deepcopy(json.loads(FIXTURE.read_text())["request"])
    body["model"] = "m"
    return openai_responses.decode_request(body, DEFAULT_LIMITS.request).conversation


def sampled_calls(conversation: Conversation, text: str) -> list[ToolCall]:
    """The calls of a generation that samples ``text``, as the stream session
    makes them of the engine's events."""
    vocab = ToyVocab()
    events: list = []
    prepared = LlamaPrepared(conversation=conversation, text="PROMPT", tokens=list(PROMPT), max_new_tokens=256,
                             tools=list(conversation.tools))
    gen = toy_generation(vocab, prepared, reasoning=None, tool_format=FORMAT, on_event=events.append)
    for piece in [*(text[i:i + 5] for i in range(0, len(text), 5)), ""]:
        gen.kv_tokens.extend(gen.before_sample())
        gen.kv_tokens.extend(gen.on_token(vocab.id(piece) if piece else EOG))
        if gen.done:
            break
    calls = {e.index: ToolCall(e.call_id, e.name, "", kind=e.kind, namespace=e.namespace)
             for e in events if isinstance(e, ToolCallStarted)}
    for e in events:
        if isinstance(e, ToolCallDone):
            calls[e.index].payload = e.payload
    return [calls[i] for i in sorted(calls)]


def rendered(conversation: Conversation, items: list) -> str:
    after = dataclasses.replace(conversation, items=conversation.items + items)
    messages, tools = template_messages(after, TEMPLATE, FORMAT)
    return TEMPLATE.render(messages, tools=tools, add_generation_prompt=False)


def test_a_namespaced_call_is_read_as_the_member_and_replays_as_written():
    conversation = lite_conversation()
    calls = sampled_calls(conversation, WRITTEN)
    assert [(c.kind, c.name, c.namespace) for c in calls] == [("custom", "apply_patch", "functions"),
                                                               ("function", "exec_command", "functions")]
    assert [c.payload for c in calls] == [PATCH, '{"cmd": "ls"}']
    # What the client gets, and sends back.
    wire = [openai_responses.item_json(c) for c in calls]
    assert [(w["type"], w["name"], w["namespace"]) for w in wire] == [
        ("custom_tool_call", "apply_patch", "functions"), ("function_call", "exec_command", "functions")]
    replayed = decode_items(wire, DEFAULT_LIMITS.request)
    assert [(c.name, c.namespace) for c in replayed if isinstance(c, ToolCall)] == [
        ("apply_patch", "functions"), ("exec_command", "functions")]
    # The replay is the model's own turn, character for character.
    assert rendered(conversation, replayed) == rendered(conversation, [Message("assistant", WRITTEN)])
    assert WRITTEN in rendered(conversation, replayed)
