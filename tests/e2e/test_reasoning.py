"""Reasoning under a thinking-style template (a test fixture) with the bundled
model: hidden reasoning stays in the KV, replays continue from it, and the
sealed reasoning makes a stateless replay render exactly what the model saw."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from support.server import MODEL, ServerProcess
from support.sse import parse_frames
from support.validate import validate_openai_stream

TEMPLATE = str(Path(__file__).parent.parent / "fixtures" / "thinking_chatml.jinja")
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
THINK = {"reasoning": {"effort": "minimal"}, "include": ["reasoning.encrypted_content"]}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("reasoning"))


def start(data_dir, *extra):
    return ServerProcess("--ctx", "2048", "--chat-template", TEMPLATE, *extra, data_dir=data_dir).start()


def post(server, body):
    return httpx.post(server.url + "/v1/responses", json={"model": MODEL, "temperature": 0, **body}, timeout=120)


def stats(server):
    return server.health()["models"][MODEL]


def test_reasoning_item_hidden_state_and_sealed_replay(data_dir):
    srv = start(data_dir)
    try:
        lm = httpx.get(srv.url + "/lmsp/v1/models").json()["data"][0]
        assert lm["capabilities"]["reasoning"] is True

        with httpx.stream("POST", srv.url + "/v1/responses", timeout=120,
                          json={"model": MODEL, "temperature": 0, "input": POEM, "max_output_tokens": 40,
                                "stream": True, **THINK}) as r:
            frames = [f for f in parse_frames(r.iter_lines()) if f.data != "[DONE]"]
        events = [f.json() for f in frames]
        first = validate_openai_stream(events)
        types = [e["type"] for e in events]
        assert "response.reasoning_text.delta" in types
        reasoning, message = first["output"][0], first["output"][1]
        assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"]
        assert reasoning["encrypted_content"], "include asked for the sealed reasoning"
        assert message["type"] == "message" and message["content"][0]["text"]
        assert "<think>" not in message["content"][0]["text"]
        assert first["usage"]["output_tokens_details"]["reasoning_tokens"] == 16  # effort minimal's budget
        turn1_tokens = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]

        # A visible-only replay (no encrypted_content) continues the live KV,
        # hidden reasoning included: only the new user turn is prefilled.
        plain = [{k: v for k, v in item.items() if k != "encrypted_content"} for item in first["output"]]
        r = post(srv, {"input": POEM + plain + [{"role": "user", "content": "Shorter."}], "max_output_tokens": 8,
                       "reasoning": {"effort": "minimal"}})
        assert r.status_code == 200, r.text
        s = stats(srv)
        assert s["last_cache_source"] == "visible-prefix" and s["last_reused_tokens"] == turn1_tokens
        assert srv.terminate() in (0, -15)
    finally:
        srv.stop()

    # After a restart the turn-1 state is only on disk; the sealed replay
    # renders the hidden reasoning exactly, so its text extends the checkpoint.
    srv = start(data_dir)
    try:
        r = post(srv, {"input": POEM + first["output"] + [{"role": "user", "content": "Shorter."}],
                       "max_output_tokens": 8, "reasoning": {"effort": "minimal"}})
        assert r.status_code == 200, r.text
        s = stats(srv)
        assert s["last_cache_source"] == "disk", s
        assert s["last_prefilled_tokens"] < 20, s

        bad = dict(first["output"][0])
        bad["encrypted_content"] = bad["encrypted_content"][:-6] + "AAAAAA"
        r = post(srv, {"input": POEM + [bad, first["output"][1]] + [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].encrypted_content"
    finally:
        srv.stop()


def test_tool_call_replay_without_reasoning_state_renders_without_it(data_dir):
    """A replayed call with neither its reasoning item nor an item id (Codex,
    the Vercel AI SDK, the openai SDK's tool loop): accepted as OpenAI
    accepts it, rendered without reasoning, and the cache diagnostics say so."""
    srv = start(data_dir, "--kv-disk-space-mb", "0")
    try:
        before = stats(srv)["generations"]
        r = post(srv, {"input": [{"role": "user", "content": "Look it up."},
                                 {"type": "function_call", "call_id": "call_x", "name": "lookup", "arguments": "{}"},
                                 {"type": "function_call_output", "call_id": "call_x", "output": "42"}],
                       "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}],
                       "max_output_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["extensions"]["lmspd.cache"]["miss_reason"] == "reasoning_stripped"
        assert stats(srv)["generations"] == before + 1
        before += 1
        # With its reasoning item, the same replay is accepted.
        r = post(srv, {"input": [{"role": "user", "content": "Look it up."},
                                 {"type": "reasoning", "summary": [], "content": None, "encrypted_content": None},
                                 {"type": "function_call", "call_id": "call_x", "name": "lookup", "arguments": "{}"},
                                 {"type": "function_call_output", "call_id": "call_x", "output": "42"}],
                       "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}],
                       "max_output_tokens": 4, "reasoning": {"effort": "none"}})
        assert r.status_code == 200, r.text
        assert stats(srv)["generations"] == before + 1
        # Another provider's blob (a session that began on OpenAI) is passed
        # over, not refused: the turn renders as a visible-only replay.
        foreign = "gAAAAABo" + "x1Y2_-Zq" * 40
        r = post(srv, {"input": [{"role": "user", "content": "Look it up."},
                                 {"type": "reasoning", "summary": [], "encrypted_content": foreign},
                                 {"type": "function_call", "call_id": "call_x", "name": "lookup", "arguments": "{}"},
                                 {"type": "function_call_output", "call_id": "call_x", "output": "42"}],
                       "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}],
                       "max_output_tokens": 4, "reasoning": {"effort": "none"}})
        assert r.status_code == 200, r.text
    finally:
        srv.stop()


def test_pi_loop_with_reasoning_summary_continues_cached(data_dir):
    """pi's reasoning loop (its request shape: captured in
    tests/fixtures/clients/pi-coding-agent/captured/reasoning_model) asks for
    ``reasoning.summary: "auto"``: the reasoning item's summary is non-empty
    (pi drops an item whose summary is empty, then replays the turn without
    it), and pi's next request — the item replayed as pi replays it: id,
    summary, encrypted_content, no content — continues the live state."""
    bash = {"type": "function", "name": "bash", "description": "Execute a bash command.", "strict": False,
            "parameters": {"type": "object", "required": ["command"],
                           "properties": {"command": {"type": "string", "description": "Bash command to execute"}}}}
    prompt = [{"role": "developer", "content": "You are an expert coding assistant operating inside pi."},
              {"role": "user", "content": [{"type": "input_text", "text": "How do I print hello in bash?"}]}]
    shape = {"model": MODEL, "temperature": 0, "stream": True, "store": False, "tools": [bash],
             "prompt_cache_key": "01a22808-d5db-7003-b3da-b5451369891e", "include": ["reasoning.encrypted_content"],
             "reasoning": {"effort": "minimal", "summary": "auto"}}

    def turn(srv, items, max_tokens):
        with httpx.stream("POST", srv.url + "/v1/responses", timeout=120,
                          json={**shape, "input": items, "max_output_tokens": max_tokens}) as r:
            assert r.status_code == 200, r.read()
            events = [f.json() for f in parse_frames(r.iter_lines()) if f.data != "[DONE]"]
        return events, validate_openai_stream(events)

    srv = start(data_dir)
    try:
        events, first = turn(srv, prompt, 40)
        reasoning, message = first["output"][0], first["output"][1]
        assert reasoning["type"] == "reasoning" and message["type"] == "message", first["output"]
        assert reasoning["summary"] and reasoning["summary"][0]["text"].strip(), reasoning
        assert "response.reasoning_summary_text.delta" in [e["type"] for e in events]

        replay = [{"id": reasoning["id"], "type": "reasoning", "summary": reasoning["summary"],
                   "encrypted_content": reasoning["encrypted_content"]},
                  {"type": "message", "role": "assistant", "id": message["id"], "content": message["content"]},
                  {"role": "user", "content": [{"type": "input_text", "text": "Thanks."}]}]
        _, second = turn(srv, prompt + replay, 8)
        turn1 = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
        assert second["usage"]["input_tokens_details"]["cached_tokens"] >= turn1 - 1, (second["usage"], turn1)
        assert second["extensions"]["lmspd.cache"]["miss_reason"] is None, second["extensions"]
    finally:
        srv.stop()
