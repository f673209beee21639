"""The ``openai`` SDK's own clients for the new surface: WebSocket mode
(``client.responses.connect()``), ``responses.compact`` and
``responses.input_tokens.count``, against a real server."""

from __future__ import annotations

import pytest

from support.server import MODEL


@pytest.fixture(scope="module")
def sdk(server):
    from openai import OpenAI

    # A compaction summary is up to 256 tokens, on a shared, loaded machine.
    return OpenAI(base_url=server.url + "/v1", api_key="unused-locally", max_retries=0, timeout=900)


TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}


def turn(conn, **kwargs):
    conn.response.create(model=MODEL, temperature=0, max_output_tokens=8, **kwargs)
    events = []
    for event in conn:
        events.append(event)
        if event.type in TERMINAL:
            return events
    raise AssertionError("the socket closed before a terminal event")


def test_sdk_websocket_two_turns(sdk):
    try:
        manager = sdk.responses.connect()
        conn = manager.__enter__()
    except ImportError as exc:  # the SDK's websockets pin (<16) vs the one installed
        pytest.skip(f"openai SDK WebSocket support unavailable: {exc}")
    try:
        first = turn(conn, input="Say hi.", store=False)
        assert first[0].type == "response.created" and first[-1].type in ("response.completed", "response.incomplete")
        response = first[-1].response
        second = turn(conn, input="Again.", previous_response_id=response.id, store=False)
        assert second[-1].type in ("response.completed", "response.incomplete")
        assert second[-1].response.usage.input_tokens_details.cached_tokens >= response.usage.input_tokens
    finally:
        manager.__exit__(None, None, None)


# The SDK types a compaction's output as output items, so the user messages
# it carries (``input_text`` content, as OpenAI's own /compact returns them)
# warn when the SDK serializes them back; the values are what the server sent.
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")
def test_sdk_compact_and_input_tokens(sdk):
    counted = sdk.responses.input_tokens.count(model=MODEL, input="Hello there.")
    assert counted.object == "response.input_tokens" and counted.input_tokens > 0
    compacted = sdk.responses.compact(model=MODEL, input=[
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada."}])
    assert compacted.object == "response.compaction"
    assert [i.type for i in compacted.output] == ["message", "compaction"]
    follow = sdk.responses.create(model=MODEL, max_output_tokens=4, input=[
        *[i.model_dump(exclude_none=True) for i in compacted.output], {"role": "user", "content": "Name?"}])
    assert follow.status in ("completed", "incomplete")
