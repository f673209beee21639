"""Compaction against a real server and the bundled model: ``/compact``,
the ``compaction_trigger`` item, ``context_management`` auto-compaction,
and the compaction item as input on every path (HTTP, WebSocket,
``previous_response_id`` chains, stored ``input_items``)."""

from __future__ import annotations

import httpx
import pytest

from support.sealed import assert_unreadable
from support.server import MODEL
from support.sse import parse_frames
from support.validate import validate_openai_stream
from support.ws import create, open_ws

WINDOW = [
    {"role": "user", "content": "My name is Ada. I am planning a trip to Oslo in May."},
    {"role": "assistant", "content": "Nice to meet you, Ada. Oslo in May is lovely: long days, mild weather."},
    {"role": "user", "content": "I want to see the Munch museum and the opera house."},
    {"role": "assistant", "content": "Both are by the harbour, a short walk apart."},
]


@pytest.fixture(scope="module")
def http(server):
    # A summary is up to 256 tokens, on a shared, loaded machine.
    with httpx.Client(base_url=server.url, timeout=900) as client:
        yield client


def stats(server):
    return server.health()["models"][MODEL]


def compact(http, **extra):
    r = http.post("/v1/responses/compact", json={"model": MODEL, "input": WINDOW, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def stream(http, body):
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        frames = list(parse_frames(r.iter_lines()))
    assert frames[-1].data == "[DONE]"
    return [f.json() for f in frames[:-1]]


def input_tokens(http, items):
    r = http.post("/v1/responses/input_tokens", json={"model": MODEL, "input": items})
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def test_compact_needs_a_model(http):
    r = http.post("/v1/responses/compact", json={"input": WINDOW})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = http.post("/v1/responses/compact", json={"model": MODEL, "input": WINDOW, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_compact_reply_shape(http):
    body = compact(http)
    assert body["object"] == "response.compaction" and isinstance(body["created_at"], int)
    output = body["output"]
    compactions = [i for i in output if i["type"] == "compaction"]
    assert len(compactions) == 1 and output[-1] is compactions[0]
    assert compactions[0]["id"] and len(compactions[0]["encrypted_content"]) > 40
    # The summary is sealed: the client cannot read it.
    assert_unreadable(compactions[0]["encrypted_content"])
    others = output[:-1]
    assert [m["content"][0]["text"] for m in others] == [WINDOW[0]["content"], WINDOW[2]["content"]]
    for item in others:
        assert item["type"] == "message" and item["role"] == "user" and item["status"] == "completed" and item["id"]
    assert body["usage"]["input_tokens"] > 0 and body["usage"]["output_tokens"] > 0
    assert body["usage"]["total_tokens"] == body["usage"]["input_tokens"] + body["usage"]["output_tokens"]


def test_compact_output_is_the_base_of_a_new_chain_over_http(server, http):
    output = compact(http)["output"]
    window = input_tokens(http, output)
    r = http.post("/v1/responses", json={"model": MODEL, "temperature": 0, "max_output_tokens": 8,
                                         "input": output + [{"role": "user", "content": "Where am I going?"}]})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    # The compacted window was prefilled while /compact answered.
    assert usage["input_tokens_details"]["cached_tokens"] >= window - 4, (usage, window, stats(server))
    assert usage["input_tokens"] > usage["input_tokens_details"]["cached_tokens"]


def test_compact_output_is_the_base_of_a_new_chain_over_websocket(server, http):
    output = compact(http)["output"]
    window = input_tokens(http, output)
    with open_ws(server.url) as ws:
        final = validate_openai_stream(create(ws, timeout=900, body={"model": MODEL, "temperature": 0, "max_output_tokens": 8,
                                                   "store": False, "input": output + [
                                                       {"role": "user", "content": "Where am I going?"}]}))
    assert final["usage"]["input_tokens_details"]["cached_tokens"] >= window - 4, final["usage"]


def test_tampered_compaction_is_a_400_naming_it(http):
    item = compact(http)["output"][-1]
    blob = item["encrypted_content"]
    tampered = blob[:20] + ("A" if blob[20] != "A" else "B") + blob[21:]
    for bad in (tampered, "not-a-blob"):
        r = http.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 4,
                                             "input": [{**item, "encrypted_content": bad}, {"role": "user", "content": "Hi"}]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "input[0].encrypted_content"


def test_compaction_item_in_chains_and_stored_input_items(http):
    item = compact(http)["output"][-1]
    first = http.post("/v1/responses", json={"model": MODEL, "temperature": 0, "max_output_tokens": 8,
                                             "input": [item, {"role": "user", "content": "Where am I going?"}]})
    assert first.status_code == 200, first.text
    listed = http.get(f"/v1/responses/{first.json()['id']}/input_items", params={"order": "asc"}).json()["data"]
    assert listed[0]["type"] == "compaction" and listed[0]["encrypted_content"] == item["encrypted_content"]
    second = http.post("/v1/responses", json={"model": MODEL, "temperature": 0, "max_output_tokens": 8,
                                              "previous_response_id": first.json()["id"],
                                              "input": "And when?"})
    assert second.status_code == 200, second.text


def test_compaction_trigger_streams_exactly_one_compaction_item(http):
    events = stream(http, {"model": MODEL, "temperature": 0, "store": True,
                           "input": WINDOW + [{"type": "compaction_trigger"}]})
    final = validate_openai_stream(events)
    assert final["status"] == "completed"
    assert [i["type"] for i in final["output"]] == ["compaction"]
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"] == ["compaction"]
    # A control signal, never stored as an item.
    listed = http.get(f"/v1/responses/{final['id']}/input_items").json()["data"]
    assert len(listed) == len(WINDOW) and all(i["type"] == "message" for i in listed)
    # The client replays the item as input next.
    r = http.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 8,
                                         "input": final["output"] + [{"role": "user", "content": "Go on."}]})
    assert r.status_code == 200, r.text


def test_compaction_over_websocket_trigger_then_auto(server, http):
    """Both in-stream forms over WebSocket: a ``compaction_trigger`` turn
    streams exactly one compaction item and the next turn, continuing it by
    ``previous_response_id`` with only new input, starts from the prefilled
    window; ``context_management`` compacts inside a turn's stream."""
    with open_ws(server.url) as ws:
        events = create(ws, timeout=900, body={"model": MODEL, "temperature": 0, "store": False,
                                               "input": WINDOW + [{"type": "compaction_trigger"}]})
        final = validate_openai_stream(events)
        assert [i["type"] for i in final["output"]] == ["compaction"], final["output"]
        assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"] == ["compaction"]
        window = input_tokens(http, [WINDOW[0], WINDOW[2], *final["output"]])
        after = validate_openai_stream(create(ws, timeout=900, body={
            "model": MODEL, "temperature": 0, "max_output_tokens": 8, "store": False,
            "previous_response_id": final["id"], "input": "Where am I going?"}))
        assert after["usage"]["input_tokens_details"]["cached_tokens"] >= window - 4, (after["usage"], window)

        auto = validate_openai_stream(create(ws, timeout=900, body={
            "model": MODEL, "temperature": 0, "max_output_tokens": 8, "store": False,
            "context_management": [{"type": "compaction", "compact_threshold": 40}],
            "input": WINDOW + [{"role": "user", "content": "What should I see first?"}]}))
        types = [i["type"] for i in auto["output"]]
        assert types[0] == "compaction" and "message" in types[1:], types


def test_compaction_trigger_only_as_the_last_item(http):
    r = http.post("/v1/responses", json={"model": MODEL, "input": [{"type": "compaction_trigger"}, *WINDOW]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].type"


def test_context_management_compacts_inside_the_stream(http):
    body = {"model": MODEL, "temperature": 0, "max_output_tokens": 12,
            "context_management": [{"type": "compaction", "compact_threshold": 40}],
            "input": WINDOW + [{"role": "user", "content": "What should I see first?"}]}
    final = validate_openai_stream(stream(http, body))
    types = [i["type"] for i in final["output"]]
    assert types[0] == "compaction" and "message" in types[1:], types
    # Under the threshold, nothing is compacted.
    small = validate_openai_stream(stream(http, {**body, "context_management": [
        {"type": "compaction", "compact_threshold": 100000}]}))
    assert "compaction" not in [i["type"] for i in small["output"]]


@pytest.mark.parametrize("bad", [[{"type": "compaction", "compact_threshold": 0}], [{"type": "other"}], "x"])
def test_context_management_is_validated(http, bad):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "context_management": bad})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("context_management"), r.text
