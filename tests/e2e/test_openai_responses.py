"""/v1/responses driven by the openai SDK and by raw HTTP against the real model."""

from __future__ import annotations

import pytest

from support.server import MODEL
from support.sse import parse_frames
from support.validate import check_openai_response, validate_openai_stream


def stream_raw(http, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = list(parse_frames(r.iter_lines()))
    assert frames[-1].data == "[DONE]"
    events = [f.json() for f in frames[:-1]]
    for f, ev in zip(frames, events, strict=False):
        assert f.event == ev["type"], "the event: line must equal the JSON type"
    return events


def test_create_json_is_a_complete_response(openai_client, http):
    raw = http.post("/v1/responses", json={"model": MODEL, "input": "Say hello.", "temperature": 0,
                                           "max_output_tokens": 24}).json()
    check_openai_response(raw)
    assert raw["status"] in ("completed", "incomplete")
    assert raw["output"][0]["type"] == "message" and raw["output"][0]["content"][0]["text"]

    resp = openai_client.responses.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=24)
    assert resp.output_text == raw["output"][0]["content"][0]["text"], "temperature 0 is deterministic"
    assert resp.usage.input_tokens > 0 and resp.usage.output_tokens > 0


def test_stream_event_sequence(http):
    events = stream_raw(http, {"model": MODEL, "input": "Name three colors.", "temperature": 0,
                               "max_output_tokens": 40})
    final = validate_openai_stream(events)
    types = [e["type"] for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-4:-1] == tail
    assert final["status"] in ("completed", "incomplete")
    assert final["output"][0]["content"][0]["text"]


def test_sdk_stream_and_helper(openai_client):
    events = [e.model_dump(mode="json") for e in openai_client.responses.create(
        model=MODEL, input="Say hi.", temperature=0, max_output_tokens=200, stream=True)]
    final = validate_openai_stream(events)

    with openai_client.responses.stream(model=MODEL, input="Say hi.", temperature=0,
                                        max_output_tokens=200) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        helper_final = stream.get_final_response()
    assert "".join(deltas) == helper_final.output_text == final["output"][0]["content"][0]["text"]


def test_max_output_tokens_gives_incomplete(openai_client, http):
    resp = openai_client.responses.create(model=MODEL, input="Write a long story about a dragon.",
                                          temperature=0, max_output_tokens=5)
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 5
    events = stream_raw(http, {"model": MODEL, "input": "Write a long story about a dragon.",
                               "temperature": 0, "max_output_tokens": 5})
    final = validate_openai_stream(events)
    assert events[-1]["type"] == "response.incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"


def test_input_as_clients_send_it(http):
    body = {
        "model": MODEL,
        "instructions": "You answer briefly.",
        "input": [
            {"type": "message", "role": "developer", "content": "Be polite.", "id": "msg_dev1"},
            {"role": "system", "content": [{"type": "input_text", "text": "Use English."}]},
            {"type": "message", "role": "user", "id": "msg_u1",
             "content": [{"type": "input_text", "text": "What is 2+2?"}]},
            {"type": "message", "role": "assistant", "id": "msg_a1", "status": "completed", "phase": "final_answer",
             "content": [{"type": "output_text", "text": "4", "annotations": [], "logprobs": []}]},
            {"role": "user", "content": "And 3+3?"},
        ],
        "store": False, "include": [], "prompt_cache_key": "thread-1", "client_metadata": {"x": "y"},
        "text": {"verbosity": "low"}, "reasoning": {"summary": "auto"}, "metadata": {"k": "v"},
        "user": "u", "safety_identifier": "s", "parallel_tool_calls": True, "truncation": "disabled",
        "temperature": 0, "top_p": 0.9, "max_output_tokens": 16,
        "extensions": {"lmspd.sampling": {"seed": 7}, "other.vendor": {"anything": 1}},
    }
    events = stream_raw(http, body)
    final = validate_openai_stream(events)
    assert final["instructions"] == "You answer briefly."
    assert final["metadata"] == {"k": "v"} and final["prompt_cache_key"] == "thread-1"
    assert final["store"] is False and final["top_p"] == 0.9


def test_seed_makes_sampling_reproducible(http):
    body = {"model": MODEL, "input": "Invent a name for a cat.", "temperature": 1.0, "max_output_tokens": 12,
            "extensions": {"lmspd.sampling": {"seed": 1234}}}
    a = http.post("/v1/responses", json=body).json()
    b = http.post("/v1/responses", json=body).json()
    assert a["output"][0]["content"][0]["text"] == b["output"][0]["content"][0]["text"]
    # And the seed is what decides: other seeds sample other names (not greedy decoding).
    others = {http.post("/v1/responses", json={**body, "extensions": {"lmspd.sampling": {"seed": seed}}}).json()
              ["output"][0]["content"][0]["text"] for seed in range(1, 5)}
    assert others - {a["output"][0]["content"][0]["text"]}, others


@pytest.mark.parametrize("field,value", [("top_logprobs", 3), ("prompt", {"id": "pmpt_1"}),
                                         ("include", ["message.output_text.logprobs"])])
def test_fields_lmspd_cannot_honour_are_named(http, field, value):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", field: value})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "unsupported_parameter" and err["param"].startswith(field)
    assert field in err["message"]


def test_truncation_auto_drops_oldest_turns(small_server):
    import httpx

    filler = "lorem ipsum " * 60
    items = [{"role": "user", "content": filler}, {"role": "assistant", "content": "ok"}] * 3
    items.append({"role": "user", "content": "Say yes."})
    body = {"model": MODEL, "input": items, "temperature": 0, "max_output_tokens": 100}
    r = httpx.post(small_server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(small_server.url + "/v1/responses", json={**body, "truncation": "auto"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["truncation"] == "auto"
    assert r.json()["usage"]["input_tokens"] + 100 <= 512
