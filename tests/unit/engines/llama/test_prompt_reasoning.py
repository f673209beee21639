"""A replayed turn's hidden reasoning renders in that turn: in front of its
text, or in front of its calls, whichever the turn began with, on a native
template as on lmspd's own call syntax; never in a later turn."""

from __future__ import annotations

import pytest

from lmspd.core.conversation import Conversation, Message, Reasoning, ToolCall, ToolOutput
from lmspd.engines.llama.prompt import template_messages
from lmspd.engines.llama.template import ChatTemplate
from lmspd.engines.llama.tool_formats import FallbackFormat, HermesFormat

THINK = "<think>\nR1\n</think>\n\n"


def render(tool_format, items) -> list[dict]:
    conversation = Conversation(model="m", items=items)
    messages, _ = template_messages(conversation, ChatTemplate(None), tool_format)
    return messages


@pytest.mark.parametrize("tool_format", [HermesFormat(native=True), FallbackFormat()], ids=["native", "own"])
def test_the_reasoning_of_a_turn_that_went_straight_to_its_calls_renders_in_that_turn(tool_format):
    """On a native template (Qwen3's Hermes) it waited for the next assistant
    text and was rendered there, past the call's output: the model read a
    transcript it never wrote, and the replay missed the KV."""
    messages = render(tool_format, [
        Message("user", "Weather?"),
        Reasoning(hidden=THINK),
        ToolCall("call_1", "weather", '{"city": "Paris"}'),
        ToolOutput("call_1", "sunny"),
        Message("assistant", "It is sunny."),
    ])
    assistants = [m for m in messages if m["role"] == "assistant"]
    assert assistants[0]["content"].startswith(THINK)
    assert assistants[-1]["content"] == "It is sunny."


def test_a_turns_reasoning_never_moves_past_another_message():
    messages = render(HermesFormat(native=True), [
        Message("user", "one"),
        Reasoning(hidden=THINK),
        Message("user", "two"),
        Message("assistant", "answer"),
    ])
    assert messages[-1] == {"role": "assistant", "content": "answer"}
