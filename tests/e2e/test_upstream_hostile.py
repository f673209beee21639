"""The upstream engine against a scripted, sometimes hostile, provider.

A real ``lmspd serve --engine upstream`` process sits in front of
``support.provider.ScriptedProvider``; each test scripts the provider's
bytes and asserts the exact downstream events, that every stream passes
the validators, and that nothing undeclared (provider ids, its model name,
an undeclared tool, our key) reaches the client.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from support.provider import (
    DONE,
    Reply,
    ScriptedProvider,
    finish_chunk,
    reasoning_chunk,
    split_every_byte,
    sse,
    text_chunk,
    text_stream,
    tool_chunk,
    tool_stream,
)
from support.server import ServerProcess
from support.sse import parse_frames
from support.validate import check_openai_response, validate_openai_stream

MODEL = "up"
KEY = "sk-test-UPSTREAM-KEY-0123456789abcdef"
LOOKUP = {"type": "function", "name": "lookup", "description": "Look something up.",
          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'}}
# What the provider says that must never reach a client.
PRIVATE = (b"PRIVATE", b"provider-private-model", KEY.encode())

TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
TEXT_CLOSE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def provider():
    p = ScriptedProvider().start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def lmspd(provider):
    srv = ServerProcess("--engine", "upstream", "--upstream-url", provider.url, "--upstream-model",
                        "scripted-upstream", "--served-model", MODEL, "--upstream-idle-timeout", "1",
                        env={"LMSPD_UPSTREAM_API_KEY": KEY}).start(timeout=60)
    yield srv
    srv.stop()


@pytest.fixture
def http(lmspd, provider):
    provider.clear()
    with httpx.Client(base_url=lmspd.url, timeout=30) as client:
        yield client


def stream(http: httpx.Client, body: dict) -> tuple[list[dict], bytes]:
    """POST a streaming request; return (events, raw bytes), validated."""
    raw = bytearray()
    with http.stream("POST", "/v1/responses", json={"model": MODEL, **body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for piece in r.iter_bytes():
            raw += piece
    frames = list(parse_frames(bytes(raw).decode().splitlines(keepends=True)))
    assert frames[-1].data == "[DONE]"
    events = [f.json() for f in frames[:-1]]
    for f, ev in zip(frames, events, strict=False):
        assert f.event == ev["type"]
    validate_openai_stream(events)
    for secret in PRIVATE:
        assert secret not in raw, f"{secret!r} leaked to the client"
    return events, bytes(raw)


def types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def failed_code(events: list[dict]) -> str:
    assert events[-1]["type"] == "response.failed", types(events)
    return events[-1]["response"]["error"]["code"]


# -- well-formed streams ------------------------------------------------------------


def test_text_stream_exact_events_and_request(http, provider):
    provider.push(Reply(parts=text_stream("Hello there, friend!", pieces=3)))
    events, _ = stream(http, {"input": "Hi", "instructions": "Be brief.", "temperature": 0.5,
                              "max_output_tokens": 50})
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "Hello there, friend!"
    assert types(events) == TEXT_EVENTS + ["response.output_text.delta"] * len(deltas) + TEXT_CLOSE + [
        "response.completed"]
    final = events[-1]["response"]
    assert final["model"] == MODEL and final["usage"]["input_tokens"] == 11 and final["usage"]["output_tokens"] == 7

    (sent,) = provider.requests
    assert sent.headers["authorization"] == f"Bearer {KEY}"
    assert sent.body["model"] == "scripted-upstream"
    assert sent.body["stream"] is True and sent.body["stream_options"] == {"include_usage": True}
    assert sent.body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert sent.body["temperature"] == 0.5 and sent.body["max_tokens"] == 50


def test_json_reply_is_a_complete_response(http, provider):
    provider.push(Reply(parts=text_stream("plain JSON reply")))
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi"})
    assert r.status_code == 200
    body = r.json()
    check_openai_response(body)
    assert body["output"][0]["content"][0]["text"] == "plain JSON reply"
    assert not any(s in r.content for s in PRIVATE)


def test_reasoning_then_text(http, provider):
    provider.push(Reply(parts=[reasoning_chunk("think "), reasoning_chunk("hard"), text_chunk("42"),
                               finish_chunk("stop"), DONE]))
    events, _ = stream(http, {"input": "?"})
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "think hard"}]
    assert final["output"][1]["content"][0]["text"] == "42"


# -- the allowlist ----------------------------------------------------------------------


def test_tool_name_growing_from_lookup_into_lookupEvil_fails_and_releases_nothing(http, provider):
    provider.push(Reply(parts=[
        tool_chunk(0, id="call_1", name="lookup", args=""),
        tool_chunk(0, args='{"q": "x"}'),
        tool_chunk(0, name="Evil"),
        finish_chunk("tool_calls"),
        DONE,
    ]))
    events, raw = stream(http, {"input": "look", "tools": [LOOKUP]})
    assert types(events) == ["response.created", "response.in_progress", "response.failed"]
    assert failed_code(events) == "undeclared_tool"
    assert b"Evil" not in raw and b"call_1" not in raw


def test_a_tool_outside_allowed_tools_is_refused(http, provider):
    other = {**LOOKUP, "name": "search"}
    provider.push(Reply(parts=tool_stream("search", {"q": "x"})))
    events, raw = stream(http, {"input": "look", "tools": [LOOKUP, other], "tool_choice": {
        "type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "lookup"}]}})
    assert failed_code(events) == "undeclared_tool"
    # Only the allowed subset was offered to the provider.
    assert [t["function"]["name"] for t in provider.requests[-1].body["tools"]] == ["lookup"]
    assert b'"function_call"' not in raw


def test_released_tool_call(http, provider):
    provider.push(Reply(parts=tool_stream("lookup", {"q": "weather"}, call_id="call_abc123")))
    events, _ = stream(http, {"input": "look", "tools": [LOOKUP], "tool_choice": "required"})
    assert types(events) == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.function_call_arguments.delta", "response.function_call_arguments.done",
                             "response.output_item.done", "response.completed"]
    (call,) = events[-1]["response"]["output"]
    assert call["type"] == "function_call" and call["name"] == "lookup" and call["call_id"] == "call_abc123"
    assert json.loads(call["arguments"]) == {"q": "weather"}
    assert provider.requests[-1].body["tool_choice"] == "required"


def test_custom_tool_is_a_strict_wrapper_that_never_leaks(http, provider):
    patch = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch\n"
    provider.push(Reply(parts=tool_stream("apply_patch", {"input": patch}, call_id="call_patch1")))
    events, raw = stream(http, {"input": "patch it", "tools": [LOOKUP, APPLY_PATCH]})
    (call,) = events[-1]["response"]["output"]
    assert call["type"] == "custom_tool_call" and call["name"] == "apply_patch" and call["input"] == patch
    assert "response.custom_tool_call_input.done" in types(events)
    assert b'"function_call' not in raw and b'{\\"input\\"' not in raw

    (offered,) = [t["function"] for t in provider.requests[-1].body["tools"] if t["function"]["name"] == "apply_patch"]
    assert offered["strict"] is True and offered["parameters"]["required"] == ["input"]
    assert offered["parameters"]["additionalProperties"] is False and "*** Begin Patch" in offered["description"]

    # The next turn replays the call and its output in the provider's shape.
    provider.push(Reply(parts=text_stream("Done.")))
    stream(http, {"tools": [LOOKUP, APPLY_PATCH], "input": [
        {"role": "user", "content": "patch it"},
        call,
        {"type": "custom_tool_call_output", "call_id": "call_patch1", "output": "Success."},
    ]})
    messages = provider.requests[-1].body["messages"]
    assert messages[1] == {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_patch1", "type": "function",
        "function": {"name": "apply_patch", "arguments": json.dumps({"input": patch})}}]}
    assert messages[2] == {"role": "tool", "tool_call_id": "call_patch1", "content": "Success."}


def test_malformed_custom_wrapper_fails(http, provider):
    provider.push(Reply(parts=tool_stream("apply_patch", {"patch": "x"})))
    events, _ = stream(http, {"input": "patch it", "tools": [APPLY_PATCH]})
    assert failed_code(events) == "upstream_malformed_custom_tool_input"


# -- hostile framing --------------------------------------------------------------------


def test_fragments_split_at_every_byte(http, provider):
    parts = [reasoning_chunk("hmm"), text_chunk("Héllo ✓"), tool_chunk(0, id="call_x", name="lookup", args=""),
             tool_chunk(0, args='{"q": "é"}'), finish_chunk("tool_calls"), DONE]
    provider.push(Reply(parts=split_every_byte(parts), pace_s=0.0005))
    events, _ = stream(http, {"input": "go", "tools": [LOOKUP]})
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "Héllo ✓"
    assert json.loads(final["output"][2]["arguments"]) == {"q": "é"}


def test_oversized_line_fails_at_the_limit(http, provider):
    huge = b"data: " + b"x" * (1024 * 1024 + 10)
    provider.push(Reply(parts=[text_chunk("ok"), huge, b"\n\n", DONE]))
    events, raw = stream(http, {"input": "go"})
    assert types(events) == TEXT_EVENTS + ["response.output_text.delta"] + TEXT_CLOSE + ["response.failed"]
    assert failed_code(events) == "upstream_sse_line_too_long"
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"
    assert b"xxxxxxxx" not in raw


def test_truncated_event_fails(http, provider):
    provider.push(Reply(parts=[text_chunk("ok"), b'data: {"id": "x", "choices": [{"ind']))
    events, _ = stream(http, {"input": "go"})
    assert failed_code(events) == "upstream_sse_truncated"


def test_stream_ending_without_finish_fails(http, provider):
    provider.push(Reply(parts=[text_chunk("ok")]))
    events, _ = stream(http, {"input": "go"})
    assert failed_code(events) == "upstream_truncated"


def test_nothing_is_read_after_the_first_done(http, provider):
    provider.push(Reply(parts=text_stream("fine") + [DONE, b"data: {not json\n\n", text_chunk("MORE")]))
    events, raw = stream(http, {"input": "go"})
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "fine" and b"MORE" not in raw


@pytest.mark.parametrize("parts, failed", [
    ([text_chunk("smile "), text_chunk("\ud83d"), text_chunk("\ude00"), finish_chunk("stop"), DONE], True),
    ([text_chunk("smile "), text_chunk("\ud83d"), finish_chunk("stop"), DONE], True),
    ([reasoning_chunk("\udfff"), finish_chunk("stop"), DONE], True),
    # An escape spelled out inside the arguments string is six ASCII characters: text, and fine.
    ([tool_chunk(0, id="call_1", name="lookup", args='{"q": "\\ud83d'), tool_chunk(0, args='"}'),
      finish_chunk("tool_calls"), DONE], False),
], ids=["split-pair", "lone-high", "lone-in-reasoning", "escape-in-arguments"])
def test_a_lone_surrogate_from_the_provider_ends_the_stream_with_one_failure(http, provider, parts, failed):
    """The provider's JSON is read as strictly as a client's: a lone
    surrogate escape (an emoji's pair split across chunks) is a malformed
    chunk, and the stream ends with exactly one terminal event (no UTF-8
    writer can encode the surrogate)."""
    provider.push(Reply(parts=parts))
    events, raw = stream(http, {"input": "go", "tools": [LOOKUP]})
    terminal = [e for e in events if e["type"] in ("response.completed", "response.failed", "response.incomplete")]
    assert len(terminal) == 1 and events[-1] is terminal[0], types(events)
    if failed:
        assert failed_code(events) == "upstream_malformed_chunk"
    else:
        assert events[-1]["type"] == "response.completed", types(events)
        (call,) = [i for i in events[-1]["response"]["output"] if i["type"] == "function_call"]
        assert call["arguments"] == '{"q": "\\ud83d"}'
    raw.decode("utf-8")  # strictly UTF-8 on the wire


def test_a_lone_surrogate_over_websocket_is_one_failure_and_the_socket_goes_on(lmspd, provider):
    from support.ws import create, open_ws

    provider.clear()
    provider.push(Reply(parts=[text_chunk("smile "), text_chunk("\ud83d"), text_chunk("\ude00"),
                               finish_chunk("stop"), DONE]),
                  Reply(parts=text_stream("after")))
    with open_ws(lmspd.url) as ws:
        events = create(ws, {"model": MODEL, "input": "Hi"}, timeout=30)
        assert [e["type"] for e in events].count("response.failed") == 1, events
        assert events[-1]["type"] == "response.failed", events
        assert events[-1]["response"]["error"]["code"] == "upstream_malformed_chunk"
        events = create(ws, {"model": MODEL, "input": "Hi"}, timeout=30)
        assert events[-1]["type"] == "response.completed", events
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == "after"


def test_provider_error_in_stream_is_one_failure_without_its_text(http, lmspd, provider):
    provider.push(Reply(parts=[text_chunk("ok"), sse({"error": {"message": f"boom {KEY} internal trace",
                                                                 "type": "server_error"}})]))
    events, raw = stream(http, {"input": "go"})
    assert failed_code(events) == "upstream_provider_error"
    assert b"internal trace" not in raw
    assert "server_error" in events[-1]["response"]["error"]["message"]
    # The operator sees what the provider said, without the key.
    deadline = time.monotonic() + 5
    while "internal trace" not in lmspd.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    said = [line for line in lmspd.log().splitlines() if "internal trace" in line]
    assert said and all(KEY not in line and "****" in line for line in said), said


def test_contradictory_finish_fails(http, provider):
    provider.push(Reply(parts=[text_chunk("a"), finish_chunk("stop"), finish_chunk("length"), DONE]))
    events, _ = stream(http, {"input": "go"})
    assert failed_code(events) == "upstream_contradictory_finish"


def test_length_finish_is_incomplete(http, provider):
    provider.push(Reply(parts=text_stream("cut", reason="length")))
    events, _ = stream(http, {"input": "go", "max_output_tokens": 3})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_content_filter_is_incomplete(http, provider):
    provider.push(Reply(parts=text_stream("some", reason="content_filter")))
    events, _ = stream(http, {"input": "go"})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "content_filter"}


def test_stall_trips_the_idle_watchdog_and_closes_the_provider(http, provider):
    (reply,) = provider.push(Reply(parts=[text_chunk("partial")], stall_s=20))
    started = time.monotonic()
    events, _ = stream(http, {"input": "go"})
    assert failed_code(events) == "upstream_timeout"
    assert time.monotonic() - started < 5
    assert reply.disconnected.wait(5), "lmspd kept the stalled provider stream open"


def test_client_disconnect_cancels_the_upstream_request(lmspd, provider):
    provider.clear()
    (reply,) = provider.push(Reply(parts=[text_chunk("tick ")] * 400, pace_s=0.02))
    with httpx.Client(base_url=lmspd.url, timeout=30) as client:
        with client.stream("POST", "/v1/responses", json={"model": MODEL, "input": "go", "stream": True}) as r:
            lines = r.iter_lines()
            while "output_text.delta" not in next(lines):
                pass
    assert reply.disconnected.wait(5), "the provider stream outlived its client"
    assert not reply.finished.is_set()


# -- refusals before the stream -------------------------------------------------------


def error_reply(status: int, body: dict | None = None, **headers: str) -> Reply:
    return Reply(status=status, content_type="application/json", headers=headers,
                 body=json.dumps(body or {"error": {"message": "nope", "type": "server_error"}}).encode())


@pytest.mark.parametrize("reply, status, code", [
    (error_reply(500), 502, "upstream_http_error"),
    (error_reply(503), 502, "upstream_http_error"),
    (error_reply(400, {"error": {"message": "bad", "type": "invalid_request_error"}}), 400,
     "upstream_rejected_request"),
    (error_reply(400, {"error": {"message": "too long", "code": "context_length_exceeded"}}), 400,
     "context_length_exceeded"),
    (error_reply(401, {"error": {"message": f"bad key {KEY}", "code": KEY}}), 502, "upstream_http_error"),
    (Reply(status=200, content_type="application/json", body=b'{"choices": []}'), 502, "upstream_http_error"),
])
def test_upstream_refusal_is_an_error_reply(http, provider, reply, status, code):
    provider.push(reply)
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert not any(s in r.content for s in PRIVATE)


def test_upstream_rate_limit_passes_retry_after(http, provider):
    provider.push(error_reply(429, {"error": {"message": "slow down", "type": "rate_limit_error"}},
                              **{"Retry-After": "7"}))
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
    assert r.headers["retry-after"] == "7"


def test_upstream_refusal_while_streaming_is_an_http_error(http, provider):
    """The handlers open the provider request before their own headers, so a
    refusal is an HTTP error in each dialect's shape, not a broken stream."""
    provider.push(error_reply(500))
    with http.stream("POST", "/v1/responses", json={"model": MODEL, "input": "Hi", "stream": True}) as r:
        body = r.read()
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_http_error"
    assert not any(s in body for s in PRIVATE)

    provider.push(error_reply(429, {"error": {"message": "slow down", "type": "rate_limit_error"}},
                              **{"Retry-After": "7"}))
    with http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}) as r:
        r.read()
    assert r.status_code == 429 and r.headers["retry-after"] == "7"
    assert r.json()["error"]["code"] == "rate_limited"

    provider.push(error_reply(503))
    with http.stream("POST", "/v1/messages", json={
            "model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}], "stream": True}) as r:
        r.read()
    assert r.status_code == 502 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "api_error"


def test_client_leaving_before_the_provider_answers_cancels_the_request(lmspd, provider):
    """The client goes away while the provider has not sent its headers yet
    (it is queueing): lmspd closes the provider request at once, rather than
    holding it until the provider answers or the idle timeout (1 s here)
    gives up on it."""
    provider.clear()
    provider.push(Reply(parts=text_stream("late"), head_delay_s=6))

    def upstream() -> dict:
        return httpx.get(lmspd.url + "/health").json()["models"][MODEL]

    timeouts = upstream()["outcomes"].get("upstream_timeout", 0)
    with httpx.Client(base_url=lmspd.url, timeout=httpx.Timeout(30, read=0.3)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/responses", json={"model": MODEL, "input": "go", "stream": True})
    time.sleep(2)  # past the idle timeout
    state = upstream()
    assert state["endpoints"][0]["outstanding"] == 0
    assert state["outcomes"].get("upstream_timeout", 0) == timeouts, "the provider request outlived its client"


# -- the key ------------------------------------------------------------------------------


def test_key_never_appears_in_listings_health_or_logs(http, lmspd, provider):
    provider.push(error_reply(401, {"error": {"message": f"invalid key {KEY}", "code": "invalid_api_key"}}))
    http.post("/v1/responses", json={"model": MODEL, "input": "Hi"})
    for path in ("/v1/models", "/lmsp/v1/models", "/health"):
        r = http.get(path)
        assert r.status_code == 200 and KEY not in r.text, path
    models = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    time.sleep(0.2)
    log = lmspd.log()
    assert "upstream_http_error" in log and "invalid key ****" in log
    assert KEY not in log


# -- over WebSocket -------------------------------------------------------------------


def test_websocket_refusal_is_an_error_frame_with_the_http_status(lmspd, provider):
    """The same refusal as over HTTP: an ``error`` frame whose status and
    code are what the HTTP reply carries (Codex retries on the status), not
    a ``response.failed``; the connection stays usable."""
    from support.ws import create, open_ws

    provider.clear()
    provider.push(error_reply(429, {"error": {"message": "slow down", "type": "rate_limit_error"}},
                              **{"Retry-After": "7"}),
                  error_reply(400, {"error": {"message": "too long", "code": "context_length_exceeded"}}),
                  Reply(parts=text_stream("fine")))
    with open_ws(lmspd.url) as ws:
        for status, code in ((429, "rate_limited"), (400, "context_length_exceeded")):
            events = create(ws, {"model": MODEL, "input": "Hi"})
            assert [e["type"] for e in events] == ["error"], events
            assert events[0]["status"] == status and events[0]["error"]["code"] == code
        events = create(ws, {"model": MODEL, "input": "Hi"})
        assert events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == "fine"
    assert len(provider.requests) == 3


def test_websocket_warm_up_does_not_call_the_provider(lmspd, provider):
    """``generate: false`` on a model lmspd cannot prefill: an empty completed
    response at once, nothing sent to the provider (which would generate
    and bill); the next turn continues it with the whole context."""
    from support.ws import create, open_ws

    provider.clear()
    provider.push(Reply(parts=text_stream("answer")))
    with open_ws(lmspd.url) as ws:
        warm = create(ws, {"model": MODEL, "input": "Context: the sky is blue.", "generate": False})
        assert warm[-1]["type"] == "response.completed", warm
        assert warm[-1]["response"]["output"] == []
        assert provider.requests == []
        events = create(ws, {"model": MODEL, "previous_response_id": warm[-1]["response"]["id"],
                             "input": "What colour is the sky?"})
        assert events[-1]["type"] == "response.completed", events
    (request,) = provider.requests
    sent = json.dumps(request.body["messages"])
    assert "the sky is blue" in sent and "What colour is the sky?" in sent
