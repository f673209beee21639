"""Idempotency-Key on POSTs through the whole app (lmspd/idempotency.py):
a retry replays the first reply and never generates twice, a retry while
the first still runs is 409, another body or endpoint is 422, a failed
attempt releases the key, and background work is followed again."""

from __future__ import annotations

import threading
import uuid

from support.engine import MODEL, ScriptedEngine
from support.follow import openai_events, wait_for
from support.inprocess import serving
from support.sse import parse_frames
from support.validate import validate_lmsp_stream, validate_openai_stream


def key() -> dict[str, str]:
    return {"Idempotency-Key": f"test-{uuid.uuid4()}"}


def body(text: str = "What is 2+2?", **extra):
    return {"model": MODEL, "input": text, "temperature": 0, "max_output_tokens": 16, **extra}


def test_retry_returns_the_original_and_never_generates_twice(app, http):
    k = key()
    first = http.post("/v1/responses", json=body(), headers=k)
    again = http.post("/v1/responses", json=body(), headers=k)
    assert first.status_code == again.status_code == 200
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert app.generations() == 1

    # The same key with another body, or on another endpoint, is a conflict.
    r = http.post("/v1/responses", json=body("Something else."), headers=k)
    assert r.status_code == 422 and r.json()["error"]["code"] == "idempotency_conflict"
    r = http.post("/lmsp/v1/responses", json=body(), headers=k)
    assert r.status_code == 422 and r.json()["code"] == "idempotency_conflict"
    assert app.generations() == 1

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


def test_bad_keys_are_400_naming_the_header(http):
    for bad in ("", "x" * 256, "ключ".encode(), "tab\there"):
        r = http.post("/v1/responses", json=body(), headers={"Idempotency-Key": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "Idempotency-Key", (bad, r.text)


def test_retry_while_running_gets_409_then_the_same_stream(tmp_path):
    engine = ScriptedEngine(tuple(f" w{i}" for i in range(30)), delay_s=0.01)
    with serving(tmp_path, engine=engine) as app:
        http = app.http
        k = key()
        req = body(stream=True, max_output_tokens=30)
        with http.stream("POST", "/lmsp/v1/responses", json=req, headers=k) as r:
            lines = r.iter_lines()
            first = [next(lines) for _ in range(3)]
            busy = http.post("/lmsp/v1/responses", json=req, headers=k)
            assert busy.status_code == 409 and busy.json()["code"] == "idempotency_in_progress"
            assert int(busy.headers["retry-after"]) >= 1
            original = first + list(lines)
        frames = list(parse_frames(original))
        validate_lmsp_stream(frames)
        replay = http.post("/lmsp/v1/responses", json=req, headers=k)
        assert replay.status_code == 200 and replay.headers["content-type"].startswith("text/event-stream")
        assert [(f.id, f.event, f.data) for f in parse_frames(replay.text.splitlines())] == \
            [(f.id, f.event, f.data) for f in frames]
        assert app.generations() == 1


def test_background_and_task_retries_return_the_same_work(app, http):
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

    # A streamed task's retry says where the task is, as the first reply did
    # (its events name only the response, and /events needs the task id).
    k = key()
    with http.stream("POST", "/lmsp/v1/tasks", json=body(stream=True), headers=k) as r:
        where = r.headers["location"]
        r.read()
    with http.stream("POST", "/lmsp/v1/tasks", json=body(stream=True), headers=k) as r:
        assert r.headers["idempotent-replayed"] == "true" and r.headers.get("location") == where
        r.read()
    wait_for(lambda: http.get(task.headers["location"]).json()["finished_at"], timeout=10)
    wait_for(lambda: http.get(where).json()["finished_at"], timeout=10)
    assert app.generations() == 3


def test_concurrent_first_attempts_run_once(tmp_path):
    """Two retries racing for a fresh key: one runs, the other is told it is running."""
    # The first attempt runs 2 s: a thread started late still finds it running.
    engine = ScriptedEngine(tuple(f" w{i}" for i in range(20)), delay_s=0.1)
    with serving(tmp_path, engine=engine) as app:
        k = key()
        codes: list[int] = []

        def post() -> None:
            codes.append(app.http.post("/v1/responses", json=body(), headers=k).status_code)

        threads = [threading.Thread(target=post) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(codes) == [200, 409, 409, 409] and app.generations() == 1


def test_chat_completions_and_messages_keep_their_keys_too(app, http):
    """DESIGN: a POST with an Idempotency-Key runs at most once per key and
    credential. These two ignored the header: a client's retry generated
    again (a second reply, a second charge of the model's time)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    messages = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    for path, sent in (("/v1/chat/completions", chat), ("/v1/messages", messages)):
        before = app.generations()
        k = key()
        first = http.post(path, json=sent, headers=k)
        again = http.post(path, json=sent, headers=k)
        assert first.status_code == again.status_code == 200, first.text
        assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
        assert app.generations() == before + 1, path
        streamed = http.post(path, json={**sent, "stream": True}, headers=key())
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")


def test_a_compaction_keeps_its_key(app, http):
    """A compaction writes a summary (a generation): a retry with its key
    replays it instead of generating again, as every such POST does."""
    k = key()
    sent = {"model": MODEL, "input": "a long story"}
    before = app.generations()
    first = http.post("/v1/responses/compact", json=sent, headers=k)
    again = http.post("/v1/responses/compact", json=sent, headers=k)
    assert first.status_code == again.status_code == 200, first.text
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert app.generations() == before + 1
