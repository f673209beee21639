"""Stored responses, previous_response_id chains, conversations and
item_reference against the real model: what reuses its KV cache and what
it renders. Reading back, deleting, store=false and the chain's errors are
protocol behaviour, tested in-process: tests/unit/routes/test_route_stored.py."""

from __future__ import annotations

import asyncio

from support.follow import SHORT
from support.server import MODEL
from support.sse import parse_frames
from support.validate import validate_lmsp_stream, validate_openai_stream


def body(text: str = SHORT, **extra):
    return {"model": MODEL, "input": text, "temperature": 0, "max_output_tokens": 24, **extra}


def cached(resp: dict) -> int:
    return resp["usage"]["input_tokens_details"]["cached_tokens"]


def test_lmsp_stored_stream_and_chain(http):
    with http.stream("POST", "/lmsp/v1/responses", json=body(store=True, stream=True)) as r:
        frames = list(parse_frames(r.iter_lines()))
    summary = validate_lmsp_stream(frames)
    first_id = frames[0].json()["response_id"]
    got = http.get(f"/lmsp/v1/responses/{first_id}").json()
    assert got["status"] == summary["status"] and got["output"] == summary["output"]

    second = http.post("/lmsp/v1/responses", json=body("And 3+3?", store=True, previous_response_id=first_id))
    assert second.status_code == 200, second.text
    assert cached(second.json()) > 0, "the stored chain's tokens are still in the KV cache"

    r = http.post("/lmsp/v1/responses", json=body(previous_response_id="resp_nope"))
    assert r.status_code == 400 and r.json()["code"] == "previous_response_not_found"
    assert "resp_nope" in r.json()["detail"]


def test_three_turn_chain_reuses_tokens(openai_client, http):
    first = openai_client.responses.create(**body("My name is Ada. Say hi."))
    second = openai_client.responses.create(**body("What is my name?", previous_response_id=first.id))
    events = [e.model_dump(mode="json") for e in openai_client.responses.create(
        **body("Say it again.", previous_response_id=second.id), stream=True)]
    third = validate_openai_stream(events)
    assert third["previous_response_id"] == second.id
    # The context is the chain: each turn's input holds the one before.
    assert first.usage.input_tokens < second.usage.input_tokens < third["usage"]["input_tokens"]
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert third["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2
    # Input items are the turn's own input, not the chain.
    items = http.get(f"/v1/responses/{third['id']}/input_items").json()["data"]
    assert [i["content"][0]["text"] for i in items] == ["Say it again."]


def test_conversation_turns_grow_the_prompt(http):
    """What only the real model shows: the second turn's prompt holds the
    first (its token count). The conversation's items, paging, edits and
    deletion: tests/unit/routes/test_route_stored.py."""
    conv = http.post("/v1/conversations", json={"metadata": {"topic": "math"}, "items": [
        {"type": "message", "role": "system", "content": "Answer briefly."}]}).json()
    first = http.post("/v1/responses", json=body(conversation=conv["id"])).json()
    second = http.post("/v1/responses", json=body("And 3+3?", conversation={"id": conv["id"]})).json()
    assert first["conversation"] == second["conversation"] == {"id": conv["id"]}
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]


def test_item_reference_resolves_stored_items(http):
    """The referenced items reach the prompt (its token count); an unknown
    reference's 400 is tested in-process."""
    first = http.post("/v1/responses", json=body()).json()
    answer_id = first["output"][0]["id"]
    question_id = http.get(f"/v1/responses/{first['id']}/input_items").json()["data"][0]["id"]
    refs = [{"type": "item_reference", "id": question_id}, {"type": "item_reference", "id": answer_id},
            {"role": "user", "content": "And 3+3?"}]
    r = http.post("/v1/responses", json=body(refs))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"]


def test_openai_agents_chains_with_auto_previous_response_id(server):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    async def run() -> None:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused-locally", max_retries=0)
        agent = Agent(name="brief", instructions="Be brief.",
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(temperature=0, max_tokens=120))
        first = await Runner.run(agent, "Hello", auto_previous_response_id=True)
        assert first.final_output and first.last_response_id
        second = await Runner.run(agent, "Hello again", previous_response_id=first.last_response_id,
                                  auto_previous_response_id=True)
        assert second.final_output
        stored = await client.responses.retrieve(second.last_response_id)
        assert stored.previous_response_id == first.last_response_id
        assert second.raw_responses[-1].usage.input_tokens_details.cached_tokens > 0
        await client.close()

    asyncio.run(run())
