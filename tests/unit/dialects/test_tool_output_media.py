"""Media in a tool's output reaches a text-only model as a placeholder in
words (agents attach images to tool results on their own: Codex's
``view_image``, Claude Code reading a picture); media in a user's own
message stays a 400."""

from __future__ import annotations

import pytest

from lmspd.core.conversation import ToolOutput
from lmspd.core.errors import ApiError
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.dialects import anthropic_messages, openai_responses
from lmspd.dialects.responses_items import media_placeholder

LIMITS = DEFAULT_LIMITS.request
IMAGE = "data:image/png;base64,iVBORw0KGgo="
CALL = {"type": "function_call", "call_id": "call_1", "name": "view_image", "arguments": '{"path": "a.png"}'}


def tool_output(conversation) -> ToolOutput:
    (out,) = [i for i in conversation.items if isinstance(i, ToolOutput)]
    return out


def test_codex_view_image_output_reads_as_a_placeholder():
    # Codex's shape (codex-rs FunctionCallOutputContentItem): a list of parts.
    output = [{"type": "input_text", "text": "Here is a.png:"},
              {"type": "input_image", "image_url": IMAGE, "prompt_cache_breakpoint": {"mode": "explicit"}},
              {"type": "input_text", "text": "done"}]
    req = openai_responses.decode_request({"model": "m", "input": [
        {"role": "user", "content": "Look at a.png"}, CALL,
        {"type": "function_call_output", "call_id": "call_1", "output": output}]}, LIMITS)
    out = tool_output(req.conversation)
    head = "Here is a.png:\n" + media_placeholder("input_image") + "\n"
    assert out.output == head + "done"
    assert media_placeholder("input_image") == "[input_image omitted: this model reads text only]"
    # A breakpoint on the image part ends after its placeholder.
    assert out.breakpoints == (len(head),)


def test_media_in_a_user_message_or_other_media_anywhere_is_still_refused():
    with pytest.raises(ApiError) as info:
        openai_responses.decode_request({"model": "m", "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": IMAGE}]}]}, LIMITS)
    assert info.value.code == "unsupported_capability" and info.value.param == "input[0].content[0].type"
    # A file is not an image the agent attached on its own: still refused.
    with pytest.raises(ApiError) as info:
        openai_responses.decode_request({"model": "m", "input": [
            {"role": "user", "content": "Read it"}, CALL,
            {"type": "function_call_output", "call_id": "call_1", "output": [
                {"type": "input_file", "file_data": "JVBERi0=", "filename": "a.pdf"}]}]}, LIMITS)
    assert info.value.param == "input[2].output[0].type"


def test_an_image_in_a_tool_result_block_reads_as_a_placeholder():
    req = anthropic_messages.decode_request({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Read a.png"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                           "input": {"file_path": "a.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
    ]}, LIMITS)
    assert tool_output(req.conversation).output == media_placeholder("image")
    with pytest.raises(ApiError) as info:
        anthropic_messages.decode_request({"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {}}]}]}, LIMITS)
    assert info.value.code == "unsupported_capability"
