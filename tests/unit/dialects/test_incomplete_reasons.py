"""How each dialect says why a response is incomplete, for the reasons its
protocol has no word for: the repetition guard and the end of the context
window. LMSP's set is open; OpenAI Responses' is closed (a strict client
validates it), so it says ``max_output_tokens`` and keeps the reason in
``extensions["lmspd.incomplete"]``; Chat Completions says ``length``;
Anthropic has ``model_context_window_exceeded`` for the window."""

from __future__ import annotations

import pytest

from lmspd.core.events import Finished, TextDelta, Usage
from support.compat import check_anthropic_message, check_chat_completion
from support.inprocess import MODEL, ScriptedEngine, serving
from support.validate import check_openai_response

ASK = "Count."
USER = [{"role": "user", "content": ASK}]


def ending(reason: str):
    return lambda conversation: [TextDelta("1, 2, 3"), Finished(reason, Usage(input_tokens=3, output_tokens=3))]


@pytest.mark.parametrize("reason,lmsp,extension,anthropic", [
    ("length", "max_output_tokens", None, "max_tokens"),
    ("repetition", "repetition", "repetition", "max_tokens"),
    ("context_window", "context_window", "context_window", "model_context_window_exceeded"),
])
def test_each_dialect_says_why(tmp_path, reason, lmsp, extension, anthropic):
    with serving(tmp_path, engine=ScriptedEngine(script=ending(reason))) as app:
        http = app.http
        r = http.post("/lmsp/v1/responses", json={"model": MODEL, "input": ASK}, headers={"LMSP-Version": "1.0"})
        assert r.json()["status"] == "incomplete" and r.json()["incomplete_details"] == {"reason": lmsp}

        body = http.post("/v1/responses", json={"model": MODEL, "input": ASK}).json()
        check_openai_response(body)
        assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
        said = (body.get("extensions") or {}).get("lmspd.incomplete")
        assert said == (None if extension is None else {"reason": extension})

        chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER}).json()
        check_chat_completion(chat)
        assert chat["choices"][0]["finish_reason"] == "length"

        message = http.post("/v1/messages", json={"model": MODEL, "messages": USER, "max_tokens": 50}).json()
        check_anthropic_message(message)
        assert message["stop_reason"] == anthropic
        streamed = http.post("/v1/messages", json={"model": MODEL, "messages": USER, "max_tokens": 50,
                                                    "stream": True}).text
        assert f'"stop_reason":"{anthropic}"' in streamed
