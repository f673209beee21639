"""The request bounds on the message-list dialects (Chat Completions,
Anthropic Messages) hold for every text and every item a message decodes
into, not only for its content: a reasoning text, a tool call's arguments
or input, each tool call and content block (an item of its own, as the same
history sent to /v1/responses would be). In process, with the bounds shrunk;
a refusal generates nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lmspd.core.limits import DEFAULT_LIMITS
from support.engine import MODEL
from support.inprocess import serving

TEXT = 100
ITEMS = 8
LIMITS = replace(DEFAULT_LIMITS, request=replace(DEFAULT_LIMITS.request, max_text_chars=TEXT, max_input_items=ITEMS))
LONG = "x" * (TEXT + 1)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object"}}


@pytest.fixture
def app(tmp_path):
    with serving(tmp_path, limits=LIMITS) as app:
        yield app


def chat(app, messages):
    return app.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": [TOOL],
                                                       "max_tokens": 4})


def messages(app, messages):
    return app.http.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": messages,
                                               "tools": [ANTHROPIC_TOOL]})


def chat_refused(r, param: str, bound: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and bound in err["message"], err


def messages_refused(r, path: str, bound: str) -> None:
    # Anthropic's error has no param: the message names the field.
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"'{path}'" in message and bound in message, message


def call(i: int, arguments: str = "{}") -> dict:
    return {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": arguments}}


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_chat_reasoning_text_is_bounded(app, field):
    generations = app.generations()
    r = chat(app, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", field: LONG},
                   {"role": "user", "content": "hi"}])
    chat_refused(r, f"messages[1].{field}", str(TEXT))
    assert app.generations() == generations
    ok = chat(app, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", field: LONG[1:]},
                    {"role": "user", "content": "hi"}])
    assert ok.status_code == 200, ok.text


def test_chat_tool_call_arguments_are_bounded(app):
    r = chat(app, [{"role": "user", "content": "hi"},
                   {"role": "assistant", "tool_calls": [call(0), call(1, LONG)]},
                   {"role": "tool", "tool_call_id": "c0", "content": "r"},
                   {"role": "tool", "tool_call_id": "c1", "content": "r"}])
    chat_refused(r, "messages[1].tool_calls[1].function.arguments", str(TEXT))


def test_chat_tool_calls_count_as_items(app):
    generations = app.generations()
    # Two messages, but one user message and ITEMS tool calls are ITEMS + 1 items.
    r = chat(app, [{"role": "user", "content": "hi"},
                   {"role": "assistant", "tool_calls": [call(i) for i in range(ITEMS)]}])
    chat_refused(r, f"messages[1].tool_calls[{ITEMS - 1}]", "max_input_items")
    assert app.generations() == generations
    ok = chat(app, [{"role": "user", "content": "hi"},
                    {"role": "assistant", "tool_calls": [call(i) for i in range(ITEMS - 1)]}])
    assert ok.status_code == 200, ok.text
    assert len(app.engine.conversations[-1].items) == ITEMS


def test_chat_reasoning_counts_as_an_item(app):
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}] * (ITEMS // 2)
    assert chat(app, history).status_code == 200
    history[-1] = {**history[-1], "reasoning_content": "thought"}
    chat_refused(chat(app, history), f"messages[{ITEMS - 1}]", "max_input_items")


def test_anthropic_tool_use_input_is_bounded(app):
    r = messages(app, [{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                          "input": {"a": LONG}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}])
    messages_refused(r, "messages[1].content[0].input", str(TEXT))


def test_anthropic_thinking_is_bounded(app):
    r = messages(app, [{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": [{"type": "thinking", "thinking": LONG, "signature": "s"},
                                                         {"type": "text", "text": "ok"}]},
                       {"role": "user", "content": "hi"}])
    messages_refused(r, "messages[1].content[0].thinking", str(TEXT))


def test_anthropic_blocks_count_as_items(app):
    def uses(n: int) -> list[dict]:
        return [{"type": "tool_use", "id": f"t{i}", "name": "f", "input": {}} for i in range(n)]

    generations = app.generations()
    r = messages(app, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": uses(ITEMS)}])
    messages_refused(r, f"messages[1].content[{ITEMS - 1}]", "max_input_items")
    # A string message after the blocks is counted too.
    r = messages(app, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": uses(ITEMS - 1)},
                       {"role": "user", "content": "more"}])
    messages_refused(r, "messages[2]", "max_input_items")
    assert app.generations() == generations
