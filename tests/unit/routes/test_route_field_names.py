"""The core and the engines name neutral fields in their errors
(``core.errors.RequestField``); every dialect answers in its own field names:
``input[1].content`` for a Responses request, ``messages[2].content[1]``
for the Messages block the item came from, ``response_format`` for LMSP's
output format and ``text.format`` for OpenAI's."""

from __future__ import annotations

import pytest

from lmspd.core.conversation import Conversation
from lmspd.core.errors import FIELD, ApiError, RequestField
from lmspd.core.run import LOCAL, RunContext
from support.engine import MODEL, ScriptedEngine
from support.inprocess import serving


class RefusesLastItem(ScriptedEngine):
    """Refuses the conversation's last item, as an engine refuses a part of
    a conversation: by its neutral index, knowing nothing of the wire.
    The first ``passes`` requests are served (a stored response to build on)."""

    def __init__(self, passes: int = 0) -> None:
        super().__init__()
        self.passes = passes

    def prepare(self, conversation: Conversation, run: RunContext = LOCAL):
        if self.prepared >= self.passes:
            last = len(conversation.items) - 1
            raise ApiError("invalid_request", f"The item at {FIELD} is refused.",
                           path=(RequestField.ITEMS, last, "content"))
        return super().prepare(conversation, run)


@pytest.fixture
def refusing(tmp_path):
    with serving(tmp_path, engine=RefusesLastItem()) as app:
        yield app


def _openai(r) -> tuple[str | None, str]:
    err = r.json()["error"]
    return err["param"], err["message"]


def _problem(r) -> tuple[str | None, str]:
    body = r.json()
    return body.get("param"), body["detail"]


def _anthropic(r) -> tuple[str | None, str]:
    # Anthropic's error has no param: the message is what names the field.
    return None, r.json()["error"]["message"]


TWO_MESSAGES = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]

ITEM_CASES = [
    ("openai", "/v1/responses", {"input": TWO_MESSAGES}, _openai, "input[1].content"),
    ("lmsp", "/lmsp/v1/responses", {"input": TWO_MESSAGES}, _problem, "input[1].content"),
    ("chat", "/v1/chat/completions", {"messages": [*TWO_MESSAGES, {"role": "user", "content": "c"}]}, _openai,
     "messages[2].content"),
    # A tool_result block and the text after it are two neutral items; the
    # refused one is the text, the second block of the third message.
    ("anthropic", "/v1/messages", {"max_tokens": 8, "messages": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"},
                                     {"type": "text", "text": "b"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, _anthropic, "messages[2].content[1].content"),
]


@pytest.mark.parametrize("dialect,route,body,read,expected", ITEM_CASES, ids=[c[0] for c in ITEM_CASES])
def test_an_engines_item_path_names_the_dialects_field(refusing, dialect, route, body, read, expected):
    r = refusing.http.post(route, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    param, message = read(r)
    if param is not None or dialect != "anthropic":
        assert param == expected
    assert f"The item at {expected} is refused." == message


def test_a_continued_responses_request_names_its_own_input(tmp_path):
    """The conversation is the stored history, then the input: the engine's
    index counts both, the client's ``input`` only its own items."""
    with serving(tmp_path, engine=RefusesLastItem(passes=1)) as app:
        first = app.http.post("/v1/responses", json={"model": MODEL, "input": TWO_MESSAGES})
        assert first.status_code == 200, first.text
        r = app.http.post("/v1/responses", json={"model": MODEL, "previous_response_id": first.json()["id"],
                                                 "input": [{"role": "user", "content": "c"}]})
        assert r.status_code == 400, r.text
        # The engine saw four items (two in, one out, one in): it refused item 3.
        assert _openai(r) == ("input[0].content", "The item at input[0].content is refused.")


FORMAT_CASES = [
    ("openai", "/v1/responses", {"input": "hi", "text": {"format": {"type": "json_object"}}}, _openai,
     "text.format"),
    ("lmsp", "/lmsp/v1/responses", {"input": "hi", "response_format": {"type": "json_object"}}, _problem,
     "response_format"),
    ("chat", "/v1/chat/completions", {"messages": TWO_MESSAGES, "response_format": {"type": "json_object"}},
     _openai, "response_format"),
]


@pytest.mark.parametrize("dialect,route,body,read,expected", FORMAT_CASES, ids=[c[0] for c in FORMAT_CASES])
def test_the_services_output_format_refusal_names_the_dialects_field(tmp_path, dialect, route, body, read, expected):
    engine = ScriptedEngine(capabilities={"streaming": True, "tools": True, "structured_output": False})
    with serving(tmp_path, engine=engine) as app:
        r = app.http.post(route, json={"model": MODEL, **body})
        assert r.status_code == 400, r.text
        assert read(r)[0] == expected
        assert engine.prepared == 0
