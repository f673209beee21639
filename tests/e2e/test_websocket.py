"""Responses over WebSocket (``ws://…/v1/responses``) against a real server
and the bundled model, with the ``websockets`` client: turns, connection-
local state, eviction, warm-up, errors that end a turn but not the
connection, auth on the upgrade, the connection age limit, and the same
events as SSE."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from support.server import MODEL, ServerProcess
from support.sse import parse_frames
from support.validate import validate_openai_stream
from support.ws import create, open_ws, read_turn

NO_REUSE = {"lmspd.cache": {"reuse": False}}


def body(**extra):
    return {"model": MODEL, "temperature": 0, "max_output_tokens": 12, **extra}


def stats(server):
    return server.health()["models"][MODEL]


def test_one_turn_is_a_complete_stream_without_done(server):
    with open_ws(server.url) as ws:
        events = create(ws, body(input="Say hello."))
    final = validate_openai_stream(events)
    assert final["status"] in ("completed", "incomplete")
    assert final["output"][0]["type"] == "message"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_two_turns_on_one_socket_and_a_continuation_with_only_new_input(server):
    with open_ws(server.url) as ws:
        first = validate_openai_stream(create(ws, body(input="Name a colour.", store=False)))
        prior = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
        second_events = create(ws, body(input="Name another one.", previous_response_id=first["id"], store=False))
        second = validate_openai_stream(second_events)
        s = stats(server)
        assert s["last_cache_source"] == "connection", s
        # The whole prior context (prompt and reply) stays in the KV: only
        # the new user turn is prefilled.
        assert second["usage"]["input_tokens_details"]["cached_tokens"] == s["last_reused_tokens"] >= prior
        assert s["last_prefilled_tokens"] < 20, s
        assert second["previous_response_id"] == first["id"]
        # A third, unrelated turn on the same socket.
        third = validate_openai_stream(create(ws, body(input="Count to three.")))
        assert third["id"] not in (first["id"], second["id"])


def test_store_false_response_is_not_visible_from_another_connection(server):
    with open_ws(server.url) as ws:
        first = validate_openai_stream(create(ws, body(input="Remember the word apple.", store=False)))
    with open_ws(server.url) as ws:
        (error,) = create(ws, body(input="Which word?", previous_response_id=first["id"], store=False))
        assert error["type"] == "error" and error["status"] == 400
        assert error["error"]["code"] == "previous_response_not_found"
        assert error["error"]["param"] == "previous_response_id"
        # The same socket takes the full context next.
        full = [{"role": "user", "content": "Remember the word apple."},
                *first["output"], {"role": "user", "content": "Which word?"}]
        assert validate_openai_stream(create(ws, body(input=full, store=False)))["status"] in ("completed", "incomplete")


def test_stored_response_continues_from_another_connection(server):
    with open_ws(server.url) as ws:
        first = validate_openai_stream(create(ws, body(input="Say yes.")))
    with open_ws(server.url) as ws:
        second = validate_openai_stream(create(ws, body(input="Again.", previous_response_id=first["id"])))
    assert second["previous_response_id"] == first["id"]
    # A store: true continuation of a connection's response stands on its own in the store.
    items = httpx.get(f"{server.url}/v1/responses/{second['id']}/input_items", timeout=30).json()["data"]
    assert items and items[0]["content"][0]["text"] == "Again."


def test_failed_continuation_evicts_the_response_it_named(server):
    with open_ws(server.url) as ws:
        first = validate_openai_stream(create(ws, body(input="Say hi.", store=False)))
        (error,) = create(ws, body(previous_response_id=first["id"], store=False,
                                   input=[{"type": "function_call_output", "call_id": "call_nowhere", "output": "1"}]))
        assert error["type"] == "error" and error["status"] == 400, error
        assert "call_nowhere" in error["error"]["message"]
        (again,) = create(ws, body(input="Hello?", previous_response_id=first["id"], store=False))
        assert again["error"]["code"] == "previous_response_not_found"
        # A stored response too: on this connection it is gone, although
        # the store still has it (another connection may continue it).
        stored = validate_openai_stream(create(ws, body(input="Say hi.")))
        (error,) = create(ws, body(previous_response_id=stored["id"],
                                   input=[{"type": "function_call_output", "call_id": "call_nowhere", "output": "1"}]))
        assert error["type"] == "error" and error["status"] == 400, error
        (again,) = create(ws, body(input="Hello?", previous_response_id=stored["id"]))
        assert again["error"]["code"] == "previous_response_not_found", again
    with open_ws(server.url) as ws:
        events = create(ws, body(input="Hello?", previous_response_id=stored["id"]))
        assert events[-1]["type"] == "response.completed", events[-1]


def test_generate_false_prefills_and_the_next_turn_appends_only_new_input(server):
    with open_ws(server.url) as ws:
        prompt = "You are a terse assistant. Here is a long context: " + "the sky is blue. " * 40
        warm_events = create(ws, {**body(input=[{"role": "user", "content": prompt}], store=False), "generate": False})
        warm = validate_openai_stream(warm_events)
        assert warm["status"] == "completed" and warm["output"] == []
        assert not [e for e in warm_events if e["type"].startswith("response.output")]
        warm_tokens = warm["usage"]["input_tokens"]
        turn = validate_openai_stream(create(ws, body(input="What colour is the sky?", previous_response_id=warm["id"],
                                                      store=False)))
        s = stats(server)
        assert s["last_cache_source"] == "connection", s
        assert turn["usage"]["input_tokens_details"]["cached_tokens"] == warm_tokens
        assert s["last_prefilled_tokens"] < 30 < warm_tokens, s


def test_a_warm_up_of_the_first_developer_message_is_the_prefix_of_the_turn(server):
    """Codex's startup prewarm: ``generate: false`` with its base instructions
    only (one developer message) and its tools; the turn then sends a second
    developer message and the user's. Leading developer messages join the
    system message ahead of the tool list, so the warm-up prefills only
    what the turn's prompt starts with: the turn continues it in place."""
    tools = [{"type": "function", "name": "exec_command", "description": "Run a shell command.",
              "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}]
    base = "You are a coding agent. Be precise and safe. " * 12
    with open_ws(server.url) as ws:
        warm = validate_openai_stream(create(ws, {**body(input=[{"role": "developer", "content": base}], tools=tools,
                                                         store=False), "generate": False}))
        assert warm["status"] == "completed" and warm["output"] == []
        turn = validate_openai_stream(create(ws, body(
            input=[{"role": "developer", "content": "<permissions>read-only</permissions>"},
                   {"role": "user", "content": "Say hello."}],
            tools=tools, previous_response_id=warm["id"], store=False)))
    s = stats(server)
    assert s["last_cache_source"] == "connection", s
    assert turn["usage"]["input_tokens_details"]["cached_tokens"] == warm["usage"]["input_tokens"] > 100, turn["usage"]
    # The tool list was not in the warm-up: the turn prefilled it.
    assert s["last_prefilled_tokens"] > 40, s

    # Codex's next session: the same warm-up, while a sequence still holds
    # the last session's whole prompt. The warm-up leaves it where it is
    # (copied into a sequence of its own, it would be what the turn
    # continues, prefilling the tool list again), and the turn reuses it all.
    with open_ws(server.url) as ws:
        before = stats(server)["generations"]
        again = validate_openai_stream(create(ws, {**body(input=[{"role": "developer", "content": base}], tools=tools,
                                                          store=False), "generate": False}))
        assert again["status"] == "completed" and stats(server)["generations"] == before, "nothing ran"
        assert again["usage"]["input_tokens_details"]["cached_tokens"] == again["usage"]["input_tokens"] - 1
        turn = validate_openai_stream(create(ws, body(
            input=[{"role": "developer", "content": "<permissions>read-only</permissions>"},
                   {"role": "user", "content": "Say hello."}],
            tools=tools, previous_response_id=again["id"], store=False)))
    assert stats(server)["last_prefilled_tokens"] < 5, stats(server)
    assert turn["usage"]["input_tokens_details"]["cached_tokens"] >= turn["usage"]["input_tokens"] - 5


def test_an_http_prewarm_prefills_and_the_next_turn_continues_it(server):
    """``prompt_cache_options.prewarm`` over HTTP: the turn prefills its
    input without generating (as ``generate: false`` on the WebSocket), and
    the next turn continuing it by ``previous_response_id`` prefills only
    what is new."""
    base = "You are a careful assistant for a team of gardeners. Answer briefly. " * 10
    before = stats(server)["generations"]
    r = httpx.post(server.url + "/v1/responses", timeout=120, json=body(
        input=[{"role": "developer", "content": base}], prompt_cache_options={"prewarm": True}))
    assert r.status_code == 200, r.text
    warm = r.json()
    assert warm["status"] == "completed" and warm["output"] == [] and warm["usage"]["output_tokens"] == 0
    assert warm["usage"]["input_tokens"] > 100
    r = httpx.post(server.url + "/v1/responses", timeout=120, json=body(
        input="When should I water tomatoes?", previous_response_id=warm["id"]))
    assert r.status_code == 200, r.text
    s = stats(server)
    assert s["generations"] > before
    assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] >= warm["usage"]["input_tokens"] - 1, r.json()
    assert s["last_prefilled_tokens"] < 30, s


def test_bad_frames_get_error_frames_and_the_connection_stays_usable(server):
    with open_ws(server.url) as ws:
        ws.send("this is not json")
        (e1,) = read_turn(ws)
        assert e1["type"] == "error" and e1["error"]["code"] == "invalid_json" and e1["status"] == 400
        ws.send(json.dumps({"type": "response.append", "input": []}))
        (e2,) = read_turn(ws)
        assert e2["error"]["param"] == "type" and "response.append" in e2["error"]["message"]
        # The socket is the stream: a create that asks otherwise is refused by name.
        (e3,) = create(ws, body(input="x", stream=False))
        assert e3["error"]["code"] == "unsupported_parameter" and e3["error"]["param"] == "stream"
        (e4,) = create(ws, body(input="x", background=True))
        assert e4["error"]["param"] == "background"
        # What agrees with it is what Codex sends on every frame.
        codex_like = create(ws, body(input="x", stream=True, stream_options={"include_obfuscation": False},
                                     background=False, client_metadata={"x-codex-turn": "1"}))
        assert validate_openai_stream(codex_like)["status"] in ("completed", "incomplete")
        # null is unset, as over HTTP.
        unset = create(ws, body(input="x", stream=None, background=None, generate=None))
        assert validate_openai_stream(unset)["status"] in ("completed", "incomplete")
        # Codex's acknowledgement is accepted without a reply.
        ws.send(json.dumps({"type": "response.processed", "response_id": "resp_x"}))
        # A second create while one runs: an error frame, not a second stream.
        ws.send(json.dumps({"type": "response.create", **body(input="Tell me a story.", max_output_tokens=40)}))
        ws.send(json.dumps({"type": "response.create", **body(input="And another.")}))
        frames = read_turn(ws)
        while frames[-1]["type"] == "error" or frames[-1]["type"] not in ("response.completed", "response.incomplete"):
            frames += read_turn(ws)
        errors = [f for f in frames if f["type"] == "error"]
        assert [e["error"]["code"] for e in errors] == ["concurrent_request"]
        validate_openai_stream([f for f in frames if f["type"] != "error"])
        # Still usable.
        assert validate_openai_stream(create(ws, body(input="Bye.")))["status"] in ("completed", "incomplete")


def _normalize(events: list[dict]) -> list[dict]:
    text = json.dumps(events)
    ids: dict[str, str] = {}
    text = re.sub(r"\b(resp|msg|fc|call|rs)_[0-9A-Za-z]+",
                  lambda m: ids.setdefault(m.group(0), f"{m.group(1)}_{len(ids)}"), text)
    text = re.sub(r'"(created_at|completed_at)": \d+', r'"\1": 0', text)
    return json.loads(text)


def test_sse_and_websocket_send_the_same_events(server):
    request = body(input="List three fruits.", max_output_tokens=20, store=False, extensions=NO_REUSE)
    with httpx.stream("POST", server.url + "/v1/responses", json={**request, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        frames = list(parse_frames(r.iter_lines()))
    assert frames[-1].data == "[DONE]"
    sse = [f.json() for f in frames[:-1]]
    assert all(f.event == e["type"] for f, e in zip(frames, sse, strict=False))
    with open_ws(server.url) as ws:
        wse = create(ws, request)
    assert _normalize(sse) == _normalize(wse)
    assert len(wse) > 6


@pytest.fixture(scope="module")
def keyed():
    srv = ServerProcess("--ctx", "1024", "--api-key", "sk-good", "--websocket-max-age-s", "10").start()
    yield srv
    srv.stop()


def test_bad_auth_is_refused_on_the_upgrade(keyed):
    for headers in ({}, {"Authorization": "Bearer sk-bad"}):
        with pytest.raises(InvalidStatus) as info:
            open_ws(keyed.url, headers)
        assert info.value.response.status_code == 401
        assert json.loads(info.value.response.body)["error"]["code"] == "unauthorized"
    for headers in ({"Authorization": "Bearer sk-good"}, {"x-api-key": "sk-good"}):
        with open_ws(keyed.url, {**headers, "OpenAI-Beta": "responses_websockets=2026-02-06",
                                 "session_id": "s1", "x-codex-turn-state": "t"}) as ws:
            # Accepted: the socket answers (an error frame needs no generation,
            # so the 10 s age limit of this server cannot get in the way).
            ws.send("{")
            (error,) = read_turn(ws, timeout=30)
            assert error["error"]["code"] == "invalid_json"


def test_connection_ends_at_its_age_limit(keyed):
    started = time.monotonic()
    with open_ws(keyed.url, {"Authorization": "Bearer sk-good"}) as ws:
        (error,) = read_turn(ws, timeout=30)
        assert error["error"]["code"] == "websocket_connection_limit_reached"
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    assert 9.5 <= time.monotonic() - started < 30


def test_client_leaving_mid_turn_stops_generation(server):
    ws = open_ws(server.url)
    ws.send(json.dumps({"type": "response.create", **body(input="Write a long essay.", max_output_tokens=1000)}))
    assert json.loads(ws.recv(timeout=60))["type"] == "response.created"
    ws.close()
    server.wait_idle(timeout=30)
    assert stats(server)["last_output_tokens"] < 1000


@pytest.fixture(scope="module")
def two_sequences():
    srv = ServerProcess("--ctx", "4096", "--parallel", "2").start()
    yield srv
    srv.stop()


def test_an_open_connection_keeps_its_sequence_while_other_sessions_come_and_go(two_sequences):
    """Two sequences, one held by an open connection, and three unrelated
    HTTP sessions after it: least-recently-used eviction alone would move
    the connection's session to RAM at the second of them; pinned, the
    HTTP sessions share the other sequence and the connection's next turn
    appends only its new input in place."""
    server = two_sequences
    with open_ws(server.url) as ws:
        first = validate_openai_stream(create(ws, body(input="Name a colour.", store=False)))
        for i in range(3):
            r = httpx.post(f"{server.url}/v1/responses", timeout=120, json=body(
                input=f"Unrelated session {i}: what is {i} plus {i}?", store=False))
            assert r.status_code == 200, r.text
        restores = stats(server)["cache"]["ram_restores"]
        second = validate_openai_stream(create(ws, body(input="Name another one.", previous_response_id=first["id"],
                                                        store=False)))
        s = stats(server)
        assert s["last_cache_source"] == "connection", s
        assert s["cache"]["ram_restores"] == restores, "the connection's session never left its sequence"
        assert second["usage"]["input_tokens_details"]["cached_tokens"] >= (
            first["usage"]["input_tokens"] + first["usage"]["output_tokens"])
    server.wait_for_log(rf"generation response={second['id']} seq=\d+ cache_source=connection")
