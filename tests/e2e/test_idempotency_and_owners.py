"""Idempotency-Key on POSTs, and one credential never reaching another's
stored responses, tasks, conversations or keys."""

from __future__ import annotations

import uuid

import httpx
import pytest
from support.server import MODEL
from support.follow import LONG, SHORT, follow, openai_events, wait_for
from support.server import ServerProcess
from support.sse import parse_frames
from support.validate import validate_lmsp_stream, validate_openai_stream


def key() -> dict[str, str]:
    return {"Idempotency-Key": f"test-{uuid.uuid4()}"}


def body(text: str = SHORT, **extra):
    return {"model": MODEL, "input": text, "temperature": 0, "max_output_tokens": 16, **extra}


def test_retry_returns_the_original_and_never_generates_twice(server, http):
    k = key()
    before = server.generations()
    first = http.post("/v1/responses", json=body(), headers=k)
    again = http.post("/v1/responses", json=body(), headers=k)
    assert first.status_code == again.status_code == 200
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert server.generations() == before + 1

    # The same key with another body, or on another endpoint, is a conflict.
    r = http.post("/v1/responses", json=body("Something else."), headers=k)
    assert r.status_code == 422 and r.json()["error"]["code"] == "idempotency_conflict"
    r = http.post("/lmsp/v1/responses", json=body(), headers=k)
    assert r.status_code == 422 and r.json()["code"] == "idempotency_conflict"
    assert server.generations() == before + 1

    # Other POSTs keep their keys too.
    k3 = key()
    conv = http.post("/v1/conversations", json={"metadata": {"a": "b"}}, headers=k3)
    assert http.post("/v1/conversations", json={"metadata": {"a": "b"}}, headers=k3).json() == conv.json()

    # A failed attempt does not hold the key.
    k2 = key()
    for _ in range(2):
        r = http.post("/v1/responses", json=body(model="no-such-model"), headers=k2)
        assert r.status_code == 404 and "idempotent-replayed" not in r.headers
    assert http.post("/v1/responses", json=body(), headers=k2).status_code == 200


def test_retry_while_running_gets_409_then_the_same_stream(server, http):
    server.wait_idle()
    k = key()
    before = server.generations()
    with http.stream("POST", "/lmsp/v1/responses", json=body(LONG, stream=True, max_output_tokens=30),
                     headers=k) as r:
        lines = r.iter_lines()
        first = [next(lines) for _ in range(3)]
        busy = http.post("/lmsp/v1/responses", json=body(LONG, stream=True, max_output_tokens=30), headers=k)
        assert busy.status_code == 409 and busy.json()["code"] == "idempotency_in_progress"
        assert int(busy.headers["retry-after"]) >= 1
        original = first + list(lines)
    frames = list(parse_frames(original))
    validate_lmsp_stream(frames)
    replay = http.post("/lmsp/v1/responses", json=body(LONG, stream=True, max_output_tokens=30), headers=k)
    assert replay.status_code == 200 and replay.headers["content-type"].startswith("text/event-stream")
    assert [(f.id, f.event, f.data) for f in parse_frames(replay.text.splitlines())] == \
        [(f.id, f.event, f.data) for f in frames]
    assert server.generations() == before + 1


def test_background_and_task_retries_return_the_same_work(server, http):
    before = server.generations()
    k = key()
    task = http.post("/lmsp/v1/tasks", json=body(), headers=k)
    again = http.post("/lmsp/v1/tasks", json=body(), headers=k)
    assert task.status_code == again.status_code == 202
    assert again.json()["id"] == task.json()["id"] and again.headers["location"] == task.headers["location"]

    # A background stream's retry follows the same response's events again.
    k = key()
    with http.stream("POST", "/v1/responses", json=body(background=True, stream=True), headers=k) as r:
        original = openai_events(list(parse_frames(r.iter_lines())))
    validate_openai_stream(original)
    with http.stream("POST", "/v1/responses", json=body(background=True, stream=True), headers=k) as r:
        assert r.headers["idempotent-replayed"] == "true"
        replayed = openai_events(list(parse_frames(r.iter_lines())))
    assert replayed == original
    wait_for(lambda: http.get(task.headers["location"]).json()["finished_at"])
    assert server.generations() == before + 2


@pytest.fixture(scope="module")
def two_keys():
    srv = ServerProcess("--ctx", "1024", "--api-key", "alice-key", "--api-key", "bob-key").start()
    alice = httpx.Client(base_url=srv.url, timeout=120, headers={"Authorization": "Bearer alice-key"})
    bob = httpx.Client(base_url=srv.url, timeout=120, headers={"Authorization": "Bearer bob-key"})
    yield srv, alice, bob
    alice.close()
    bob.close()
    srv.stop()


def test_one_credential_cannot_reach_anothers_state(two_keys):
    srv, alice, bob = two_keys
    stored = alice.post("/v1/responses", json=body()).json()
    # Still running (or queued) while Bob tries: the cancels below must not land.
    task = alice.post("/lmsp/v1/tasks", json=body(LONG, max_output_tokens=400)).json()
    background = alice.post("/v1/responses", json=body(LONG, background=True, max_output_tokens=400)).json()
    conv = alice.post("/v1/conversations", json={}).json()

    def gone(r, code):
        assert r.status_code == 404, r.text
        err = r.json().get("error", r.json())
        assert err["code"] == code

    rid, tid, bid, cid = stored["id"], task["id"], background["id"], conv["id"]
    gone(bob.get(f"/v1/responses/{rid}"), "response_not_found")
    gone(bob.get(f"/v1/responses/{rid}/input_items"), "response_not_found")
    gone(bob.get(f"/lmsp/v1/responses/{rid}"), "response_not_found")
    gone(bob.delete(f"/v1/responses/{rid}"), "response_not_found")
    gone(bob.get(f"/v1/responses/{bid}", params={"stream": "true"}), "response_not_found")
    gone(bob.post(f"/v1/responses/{bid}/cancel"), "response_not_found")
    gone(bob.get(f"/lmsp/v1/tasks/{tid}"), "task_not_found")
    gone(bob.get(f"/lmsp/v1/tasks/{tid}/events", params={"after": 0}), "task_not_found")
    gone(bob.post(f"/lmsp/v1/tasks/{tid}/cancel"), "task_not_found")
    gone(bob.get(f"/v1/conversations/{cid}"), "conversation_not_found")
    r = bob.post("/v1/responses", json=body(previous_response_id=rid))
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    r = bob.post("/v1/responses", json=body([{"type": "item_reference", "id": stored["output"][0]["id"]}]))
    assert r.status_code == 400
    # The same message for an id that never existed: nothing is revealed.
    assert bob.get(f"/v1/responses/{rid}").json()["error"]["message"].replace(rid, "X") == \
        bob.get("/v1/responses/resp_never").json()["error"]["message"].replace("resp_never", "X")

    # Alice still has everything, and her work ran undisturbed until she stops it.
    assert alice.get(f"/v1/responses/{rid}").json() == stored
    assert alice.post(f"/lmsp/v1/tasks/{tid}/cancel").json()["status"] == "cancelled"
    assert alice.post(f"/v1/responses/{bid}/cancel").json()["status"] == "cancelled"
    _, frames, _ = follow(alice, f"/lmsp/v1/tasks/{tid}/events")
    assert validate_lmsp_stream(frames)["terminal"] == "response.cancelled"

    # Keys are per credential too: Bob's key does not replay Alice's reply.
    k = key()
    assert alice.post("/v1/responses", json=body(), headers=k).status_code == 200
    r = bob.post("/v1/responses", json=body(), headers=k)
    assert r.status_code == 200 and "idempotent-replayed" not in r.headers
    assert alice.delete(f"/v1/responses/{rid}").json()["deleted"] is True
    assert alice.get(f"/v1/conversations/{cid}").status_code == 200
    assert bob.get("/v1/responses/resp_x").status_code == 404
    assert httpx.get(srv.url + f"/v1/responses/{bid}").status_code == 401


WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the weather for a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                "strict": True}


def test_one_credential_never_continues_anothers_kv_state(two_keys):
    """The KV cache is per credential: Bob's identical prompt is prefilled
    cold (a cached-token count would reveal Alice's prompt), and a tool
    output for Alice's call finds no state for Bob to continue."""
    srv, alice, bob = two_keys
    srv.wait_idle()

    def usage(client, text: str) -> dict:
        r = client.post("/v1/responses", json={"model": MODEL, "input": text, "temperature": 0,
                                               "max_output_tokens": 4, "store": False})
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    # Long enough (> 64 tokens) that a repeated prompt may reuse a trimmed
    # sequence at all (shorter shared prefixes are prefilled, not trimmed).
    secret = ("Alice's secret plan for the weekend: buy seven blue kites and fly them over the harbour, "
              "then row to the island, count the lighthouses, and write every number in a green notebook "
              "that nobody else may read.")
    prompt_tokens = usage(alice, secret)["input_tokens"]
    usage(bob, "Hello there.")  # Bob's own state: it shares only the template's opening with the secret
    bob_cached = usage(bob, secret)["input_tokens_details"]["cached_tokens"]
    alice_cached = usage(alice, secret)["input_tokens_details"]["cached_tokens"]
    assert alice_cached >= prompt_tokens - 1  # hers is still remembered for her
    assert bob_cached < prompt_tokens - 12, (bob_cached, prompt_tokens)  # none of Alice's words

    first = alice.post("/v1/responses", json={
        "model": MODEL, "input": "Weather in Oslo?", "tools": [WEATHER_TOOL], "tool_choice": "required",
        "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 32, "store": False}).json()
    call = next(o for o in first["output"] if o["type"] == "function_call")
    only_output = {"model": MODEL, "tools": [WEATHER_TOOL], "temperature": 0, "max_output_tokens": 4, "store": False,
                   "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny"}]}
    r = bob.post("/v1/responses", json=only_output)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].call_id", r.text
    r = alice.post("/v1/responses", json=only_output)
    assert r.status_code == 200 and r.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0, r.text
