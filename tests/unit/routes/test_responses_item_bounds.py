"""The per-text bound (``max_text_chars``) on Responses input items holds
for every text an item carries, not only a message's content and a tool
output: a call's arguments or input, a reasoning item's content, summary
and encrypted_content. In process, with the bound shrunk; a refusal
generates nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lmspd.core.limits import DEFAULT_LIMITS
from support.engine import MODEL
from support.inprocess import serving

TEXT = 100
LIMITS = replace(DEFAULT_LIMITS, request=replace(DEFAULT_LIMITS.request, max_text_chars=TEXT))
LONG = "x" * (TEXT + 1)


@pytest.fixture
def app(tmp_path):
    with serving(tmp_path, limits=LIMITS) as app:
        yield app


def _reasoning_parts(text: str) -> dict:
    half = len(text) // 2
    return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text[:half]},
                                                            {"type": "reasoning_text", "text": text[half:]}]}


@pytest.mark.parametrize(("item", "param"), [
    (lambda text: {"type": "function_call", "call_id": "c", "name": "f", "arguments": text}, "input[1].arguments"),
    (lambda text: {"type": "custom_tool_call", "call_id": "c", "name": "f", "input": text}, "input[1].input"),
    # The parts are one text, as a message's are.
    (_reasoning_parts, "input[1].content"),
    (lambda text: {"type": "reasoning", "summary": [{"type": "summary_text", "text": text}]},
     "input[1].summary[0].text"),
    (lambda text: {"type": "reasoning", "summary": [], "encrypted_content": text}, "input[1].encrypted_content"),
])
def test_call_and_reasoning_texts_are_bounded(app, item, param):
    def send(text: str):
        sent = item(text)
        answer = [{"type": f"{sent['type']}_output", "call_id": "c", "output": "r"}] if "call_id" in sent else []
        return app.http.post("/v1/responses", json={
            "model": MODEL, "store": False, "tools": [{"type": "function", "name": "f"}],
            "input": [{"role": "user", "content": "hi"}, sent, *answer]})

    generations = app.generations()
    refused = send(LONG)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == param and f"limit is {TEXT}" in error["message"], error
    assert app.generations() == generations
    ok = send(LONG[1:])
    assert ok.status_code == 200, ok.text
