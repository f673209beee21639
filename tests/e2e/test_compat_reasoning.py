"""Reasoning through the message-list dialects, under the thinking-style
template fixture: ``reasoning_content`` on /v1/chat/completions, ``thinking``
blocks with sealed signatures on /v1/messages, and replays of either that
continue from the KV holding the hidden reasoning."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from support.compat import (
    check_anthropic_message,
    check_chat_completion,
    validate_anthropic_stream,
    validate_chat_stream,
)
from support.server import MODEL, ServerProcess
from support.sse import parse_frames

TEMPLATE = str(Path(__file__).parent.parent / "fixtures" / "thinking_chatml.jinja")
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = ServerProcess("--ctx", "2048", "--chat-template", TEMPLATE,
                           data_dir=str(tmp_path_factory.mktemp("compat-reasoning"))).start()
    yield server
    server.stop()


def post(srv, path, body) -> dict:
    r = httpx.post(srv.url + path, json={"model": MODEL, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def frames(srv, path, body) -> list:
    with httpx.stream("POST", srv.url + path, json={"model": MODEL, "temperature": 0, **body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        return list(parse_frames(r.iter_lines()))


def test_chat_reasoning_content_and_visible_replay(srv):
    first = post(srv, "/v1/chat/completions", {"messages": POEM, "max_tokens": 32, "reasoning_effort": "minimal"})
    check_chat_completion(first)
    message = first["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"]
    assert "<think>" not in message["content"]
    assert first["usage"]["completion_tokens_details"]["reasoning_tokens"] == 16  # effort minimal's budget

    chunks = [f.json() for f in frames(srv, "/v1/chat/completions",
                                       {"messages": POEM, "max_tokens": 32, "reasoning_effort": "minimal"})[:-1]]
    summary = validate_chat_stream(chunks)
    assert summary["reasoning"] == message["reasoning_content"] and summary["content"] == message["content"]

    # Clients replay only the visible answer; the KV still holds the hidden
    # reasoning and the next turn continues from all of it.
    u = first["usage"]
    second = post(srv, "/v1/chat/completions", {"max_tokens": 8, "reasoning_effort": "minimal", "messages": [
        *POEM, {"role": "assistant", "content": message["content"]}, {"role": "user", "content": "Another."}]})
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert u["prompt_tokens"] + u["completion_tokens"] <= cached <= u["prompt_tokens"] + u["completion_tokens"] + 1


def test_anthropic_thinking_blocks_and_signed_replay(srv):
    thinking = {"type": "enabled", "budget_tokens": 16}
    first = post(srv, "/v1/messages", {"messages": POEM, "max_tokens": 32, "thinking": thinking})
    check_anthropic_message(first)
    block, text = first["content"][0], first["content"][1]
    assert block["type"] == "thinking" and block["thinking"] and block["signature"]
    assert text["type"] == "text" and "<think>" not in text["text"]

    events = [(f.event, f.json()) for f in frames(srv, "/v1/messages",
                                                  {"messages": POEM, "max_tokens": 32, "thinking": thinking})]
    final = validate_anthropic_stream(events)
    assert final.content[0].thinking == block["thinking"] and final.content[1].text == text["text"]
    deltas = {d["delta"]["type"] for name, d in events if name == "content_block_delta"}
    assert deltas == {"thinking_delta", "signature_delta", "text_delta"}

    # Replaying the signed thinking block is accepted and continues from the cache...
    u = first["usage"]
    prior = u["input_tokens"] + u["cache_read_input_tokens"] + u["output_tokens"]
    history = [*POEM, {"role": "assistant", "content": first["content"]}, {"role": "user", "content": "Another."}]
    second = post(srv, "/v1/messages", {"messages": history, "max_tokens": 8, "thinking": thinking})
    assert prior <= second["usage"]["cache_read_input_tokens"] <= prior + 1

    # ...and an altered signature is refused in Anthropic's shape.
    forged = [dict(block, signature=block["signature"][:-4] + "AAAA"), text]
    r = httpx.post(srv.url + "/v1/messages", timeout=120, json={
        "model": MODEL, "max_tokens": 8,
        "messages": [*POEM, {"role": "assistant", "content": forged}, {"role": "user", "content": "Another."}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "altered" in r.json()["error"]["message"]


def test_thinking_disabled_means_no_thinking(srv):
    body = post(srv, "/v1/messages", {"messages": POEM, "max_tokens": 8, "thinking": {"type": "disabled"}})
    assert body["content"][-1]["type"] == "text" and body["content"][-1]["text"]
    # The template opens a <think> block itself, so the engine still closes
    # one; with thinking disabled nothing is thought inside it.
    assert all(not b["thinking"].strip() for b in body["content"] if b["type"] == "thinking")
