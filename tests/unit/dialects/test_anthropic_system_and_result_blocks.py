"""Two shapes of SDK 2.10's Messages params that Claude Code sends:

* a ``role: "system"`` message inside ``messages`` (``SystemMessageParam``,
  text only), which becomes a neutral system message at its position, as a
  mid-list system message does on /v1/chat/completions;
* ``tool_result`` content blocks other than text and image
  (``tool_result_block_param.Content``: search_result, document,
  tool_reference, browser_state), which reach a text-only model as text.
  Claude Code's ToolSearch answers with ``tool_reference`` blocks.

Every text made counts against the same limits as any other text."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmspd.core.conversation import Message, ToolCall, ToolOutput
from lmspd.core.errors import ApiError
from lmspd.core.limits import DEFAULT_LIMITS, RequestLimits
from lmspd.dialects.anthropic_messages import decode_request
from lmspd.dialects.responses_items import media_placeholder
from support.inprocess import MODEL, serving
from support.mutation import json_values, paths, replaced

LIMITS = DEFAULT_LIMITS.request
CAPTURED = Path(__file__).resolve().parents[2] / "fixtures" / "claude-code" / "captured"
SEARCH_TOOL = {"name": "ToolSearch", "description": "Fetches deferred tools.",
               "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}
DEFERRED = {"name": "mcp__docs__lookup", "description": "Look a page up.", "defer_loading": True,
            "input_schema": {"type": "object", "properties": {"page": {"type": "string"}}}}
READ = {"name": "Read", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}


def request(messages: list[Any], **more: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 16, "messages": messages, **more}


def decode(messages: list[Any], limits: RequestLimits = LIMITS, **more: Any):
    return decode_request(request(messages, **more), limits)


def refused(messages: list[Any], limits: RequestLimits = LIMITS, **more: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        decode(messages, limits, **more)
    assert info.value.status == 400, info.value
    return info.value


# -- a system message inside messages ----------------------------------------------


def test_a_system_message_is_a_neutral_system_message_at_its_position():
    c = decode([
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Now be brief."},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": [{"type": "text", "text": "Deferred tools:"},
                                       {"type": "text", "text": "mcp__docs__lookup", "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": "Go on"},
    ]).conversation
    assert c.items == [
        Message(role="user", text="Hi"),
        Message(role="system", text="Now be brief."),
        Message(role="assistant", text="Hello."),
        Message(role="system", text="Deferred tools:\n\nmcp__docs__lookup",
                breakpoints=(len("Deferred tools:\n\nmcp__docs__lookup"),)),
        Message(role="user", text="Go on"),
    ]
    assert c.instructions is None, "the top-level 'system' stays the only instructions"


@pytest.mark.parametrize("block,param", [
    ({"type": "image", "source": {}}, "messages[1].content[0].type"),
    ({"type": "document", "source": {"type": "text", "data": "x"}}, "messages[1].content[0].type"),
    ({"type": "tool_use", "id": "t", "name": "n", "input": {}}, "messages[1].content[0].type"),
    ({"type": "thinking", "thinking": "t"}, "messages[1].content[0].type"),
    ({"type": "text", "text": 3}, "messages[1].content[0].text"),
    ("just a string", "messages[1].content[0]"),
])
def test_a_system_message_holds_text_only(block, param):
    err = refused([{"role": "user", "content": "Hi"}, {"role": "system", "content": [block]}])
    assert (err.code, err.param) == ("invalid_request", param), err.message
    if param.endswith(".type"):
        assert "not allowed in a system message (text blocks only)" in err.message, err.message


def test_a_system_message_is_bounded_like_any_message():
    small = replace(LIMITS, max_text_chars=8, max_content_parts=2, max_input_items=2)
    user = {"role": "user", "content": "Hi"}
    assert refused([user, {"role": "system", "content": "x" * 9}], small).param == "messages[1].content"
    assert refused([user, {"role": "system", "content": [{"type": "text", "text": "xxxx"}] * 2}],
                   small).param == "messages[1].content[0]"
    assert refused([user, {"role": "system", "content": [{"type": "text", "text": "x"}] * 3}],
                   small).param == "messages[1].content"
    assert refused([user, {"role": "system", "content": "a"}, user], small).param == "messages"
    assert refused([{"role": "system", "content": "a"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "t"}, {"type": "text", "text": "b"}]}], small).param == "messages[1].content[1]"


def test_claude_codes_first_request_is_served_with_its_system_message(tmp_path):
    body = json.loads((CAPTURED / "001-POST-v1_messages-400.json").read_text())["body"]
    body.update(model=MODEL, stream=False)
    with serving(tmp_path) as app:
        r = app.http.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        conversation = app.engine.conversations[-1]
    assert [(type(i), getattr(i, "role", None)) for i in conversation.items] == [(Message, "user"),
                                                                               (Message, "system")]
    assert conversation.items[1].text == body["messages"][1]["content"][0]["text"]
    assert r.json()["content"][0]["type"] == "text"


# -- tool_result content blocks ---------------------------------------------------------


def with_result(content: Any, tools: list[Any] | None = None) -> list[Any]:
    return [
        {"role": "user", "content": "Find a docs tool"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ToolSearch",
                                           "input": {"query": "docs"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": content}]},
    ]


def output(messages: list[Any], limits: RequestLimits = LIMITS) -> ToolOutput:
    (out,) = [i for i in decode(messages, limits, tools=[SEARCH_TOOL, DEFERRED, READ]).conversation.items
              if isinstance(i, ToolOutput)]
    return out


def test_tool_references_read_as_the_tools_they_name():
    out = output(with_result([{"type": "tool_reference", "tool_name": "mcp__docs__lookup"},
                              {"type": "tool_reference", "tool_name": "Read", "cache_control": {"type": "ephemeral"}}]))
    assert out.output == "Tool available: mcp__docs__lookup\n\nTool available: Read"
    assert out.breakpoints == (len(out.output),)


def test_search_results_documents_and_browser_state_read_as_text():
    out = output(with_result([
        {"type": "text", "text": "Found:"},
        {"type": "search_result", "title": "Install", "source": "https://docs/install",
         "content": [{"type": "text", "text": "Run make."}, {"type": "text", "text": "Then test."}],
         "citations": {"enabled": True}},
        {"type": "document", "title": "notes.txt", "context": "from the repo",
         "source": {"type": "text", "media_type": "text/plain", "data": "line 1"}},
        {"type": "document", "source": {"type": "content", "content": [
            {"type": "text", "text": "part"}, {"type": "image", "source": {}}]}},
        {"type": "document", "source": {"type": "content", "content": "plain"}},
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}},
        {"type": "document", "source": {"type": "url", "url": "https://x/a.pdf"}},
        {"type": "document", "source": {"type": "file", "file_id": "file_1"}},
        {"type": "browser_state", "tabs": [{"tab_id": "1", "title": "Docs", "url": "https://docs", "active": True}]},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
    ]))
    placeholder = media_placeholder("document")
    assert out.output.split("\n\n") == [
        "Found:",
        "Install\nSource: https://docs/install\nRun make.", "Then test.",
        "notes.txt\nfrom the repo\nline 1",
        "part", media_placeholder("image"),
        "plain",
        placeholder, placeholder, placeholder,
        'Browser state: {"tabs": [{"tab_id": "1", "title": "Docs", "url": "https://docs", "active": true}]}',
        media_placeholder("image"),
    ]


@pytest.mark.parametrize("block,param", [
    ({"type": "tool_reference"}, "[0].tool_name"),
    ({"type": "tool_reference", "tool_name": ""}, "[0].tool_name"),
    ({"type": "tool_reference", "tool_name": ["Read"]}, "[0].tool_name"),
    ({"type": "search_result", "title": "t", "source": "s", "content": "not blocks"}, "[0].content"),
    ({"type": "search_result", "title": "t", "source": "s", "content": [{"type": "image"}]}, "[0].content[0]"),
    ({"type": "search_result", "source": "s", "content": []}, "[0].title"),
    ({"type": "document", "source": {"type": "text"}}, "[0].source.data"),
    ({"type": "document", "source": {"type": "bytes"}}, "[0].source.type"),
    ({"type": "document", "source": "text"}, "[0].source"),
    ({"type": "document", "title": 5, "source": {"type": "text", "data": "d"}}, "[0].title"),
    ({"type": "browser_state", "tabs": {}}, "[0].tabs"),
    ({"type": "container_upload", "file_id": "f"}, "[0].type"),
    ({"type": "tool_use"}, "[0].type"),
    ("text", "[0]"),
])
def test_a_bad_result_block_is_a_400_naming_it(block, param):
    err = refused(with_result([block]), tools=[SEARCH_TOOL])
    assert (err.code, err.param) == ("invalid_request", "messages[2].content[0].content" + param), err.message


def test_the_text_a_result_block_makes_counts_against_the_limits():
    small = replace(LIMITS, max_text_chars=40, max_content_parts=2)
    ref = {"type": "tool_reference", "tool_name": "mcp__docs__lookup"}  # "Tool available: …": 34 characters
    assert output(with_result([ref]), small).output == "Tool available: mcp__docs__lookup"
    where = "messages[2].content[0].content"
    assert refused(with_result([ref, ref]), small, tools=[SEARCH_TOOL]).param == where
    assert refused(with_result([ref, ref, ref]), small, tools=[SEARCH_TOOL]).param == where
    search = {"type": "search_result", "title": "t", "source": "s", "content": [{"type": "text", "text": "x"}] * 3}
    assert refused(with_result([search]), small, tools=[SEARCH_TOOL]).param == where + "[0].content"
    document = {"type": "document", "source": {"type": "text", "data": "x" * 41}}
    assert refused(with_result([document]), small, tools=[SEARCH_TOOL]).param == where
    placeholders = {"type": "document", "source": {"type": "content", "content": [{"type": "image"}] * 2}}
    assert refused(with_result([placeholders]), small, tools=[SEARCH_TOOL]).param == where
    tabs = {"type": "browser_state", "tabs": [{}] * 3}
    assert refused(with_result([tabs]), small, tools=[SEARCH_TOOL]).param == where + "[0].tabs"


def test_a_tool_search_turn_is_served_and_the_deferred_tool_is_offered(tmp_path):
    """Claude Code's ToolSearch flow: the deferred tool (``defer_loading``)
    is offered in full from the first turn, and the reference that
    ToolSearch answers with reads as the tool's name."""
    body = request(with_result([{"type": "tool_reference", "tool_name": "mcp__docs__lookup"}]) + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "mcp__docs__lookup",
                                           "input": {"page": "install"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": [
            {"type": "search_result", "title": "Install", "source": "docs", "content": [{"type": "text", "text": "ok"}]}]}]},
    ], tools=[SEARCH_TOOL, DEFERRED], model=MODEL, stream=False)
    with serving(tmp_path) as app:
        r = app.http.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        conversation = app.engine.conversations[-1]
    assert [t.name for t in conversation.tools] == ["ToolSearch", "mcp__docs__lookup"]
    outputs = [i.output for i in conversation.items if isinstance(i, ToolOutput)]
    assert outputs == ["Tool available: mcp__docs__lookup", "Install\nSource: docs\nok"]
    assert [i.name for i in conversation.items if isinstance(i, ToolCall)] == ["ToolSearch", "mcp__docs__lookup"]


# -- never a 500 -------------------------------------------------------------------------

BLOCKS = [
    {"type": "tool_reference", "tool_name": "Read", "cache_control": {"type": "ephemeral"}},
    {"type": "search_result", "title": "t", "source": "s", "content": [{"type": "text", "text": "x"}]},
    {"type": "document", "title": "d", "context": "c", "source": {"type": "text", "media_type": "text/plain",
                                                                  "data": "x"}},
    {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "x"},
                                                                   {"type": "image", "source": {}}]}},
    {"type": "browser_state", "tabs": [{"tab_id": "1", "title": "", "url": ""}], "state_changes": [{"type": "x"}]},
]
@st.composite
def mutated_blocks(draw: st.DrawFn) -> list[Any]:
    path = draw(st.sampled_from(paths(BLOCKS)[1:]))
    return replaced(BLOCKS, path, draw(json_values))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_blocks())
def test_result_blocks_never_crash(blocks):
    messages = with_result(blocks)
    messages.insert(1, {"role": "system", "content": [copy.deepcopy(blocks[0])]})
    try:
        decode(messages, tools=[SEARCH_TOOL])
    except ApiError as exc:
        assert 400 <= exc.status < 500, (exc.status, exc.code, exc.message)
