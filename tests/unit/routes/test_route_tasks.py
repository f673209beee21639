"""Background work through the whole app: LMSP tasks and OpenAI background
responses — followed, dropped and resumed, several readers, cancel while
running and while queued, 410 after the events expire (the task manager and
its recovery; crashes and a second instance need real processes:
tests/e2e/test_crash.py, test_multi_instance.py)."""

from __future__ import annotations

import threading
import time

from openai import OpenAI

from lmspd.core.limits import Retention
from support.engine import MODEL, ScriptedEngine
from support.follow import follow, openai_events, wait_for
from support.inprocess import serving
from support.sse import parse_frames
from support.validate import validate_lmsp_stream, validate_openai_stream

# Long enough to be cancelled while it runs, short enough to wait for.
LONG = tuple(f" w{i}" for i in range(2000))


def task_body(**extra):
    return {"model": MODEL, "input": "What is 2+2?", "temperature": 0, "max_output_tokens": 24, **extra}


def finished(http, task_id):
    task = http.get(f"/lmsp/v1/tasks/{task_id}").json()
    return task if task["finished_at"] is not None else None


def sdk(app) -> OpenAI:
    # The openai SDK over the in-process app (TestClient is an httpx.Client).
    return OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=app.http, max_retries=0)


def test_task_followed_dropped_and_resumed(app, http):
    r = http.post("/lmsp/v1/tasks", json=task_body())
    assert r.status_code == 202, r.text
    task = r.json()
    assert r.headers["location"] == f"/lmsp/v1/tasks/{task['id']}" and r.headers["lmsp-version"] == "1.0"
    assert task["object"] == "task" and task["status"] in ("queued", "in_progress")
    events = f"/lmsp/v1/tasks/{task['id']}/events"

    # A second reader follows the whole task while the first one drops.
    whole: dict = {}
    other = threading.Thread(target=lambda: whole.update(frames=follow(http, events)[1]))
    other.start()

    status, head, _ = follow(http, events, stop_after=3)
    assert status == 200 and [f.id for f in head] == ["1", "2", "3"]
    # Resumed three ways: the header, the query, and both (after wins).
    _, by_header, _ = follow(http, events, headers={"Last-Event-ID": "3"})
    _, by_query, _ = follow(http, events, params={"after": 3})
    _, by_both, _ = follow(http, events, params={"after": 3}, headers={"Last-Event-ID": "1"})
    other.join(60)

    full = whole["frames"]
    validate_lmsp_stream(full)
    for resumed in (by_header, by_query, by_both):
        assert resumed[0].id == "4", "exactly the events after 3: no gap, no duplicate"
        assert [(f.id, f.event, f.data) for f in head + resumed] == [(f.id, f.event, f.data) for f in full]
        validate_lmsp_stream(head + resumed)

    done = wait_for(lambda: finished(http, task["id"]), timeout=10)
    assert done["status"] == full[-1].json()["status"] and done["last_event_id"] == len(full)
    assert done["result"]["output"] == validate_lmsp_stream(full)["output"]
    assert app.generations() == 1, "readers never start or stop the task"
    # After the last event there is nothing more, and the stream just ends.
    status, rest, _ = follow(http, events, params={"after": len(full)})
    assert status == 200 and rest == []
    # An id that was never sent is a mistake, not something to wait for.
    r = http.get(events, params={"after": len(full) + 1})
    assert r.status_code == 400 and r.json()["param"] == "after"
    r = http.get(events, headers={"Last-Event-ID": "x"})
    assert r.status_code == 400 and r.json()["param"] == "Last-Event-ID"


def test_task_created_with_stream_true_survives_its_client(http):
    with http.stream("POST", "/lmsp/v1/tasks", json=task_body(stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        location = r.headers["location"]
        head = []
        for frame in parse_frames(r.iter_lines()):
            head.append(frame)
            if len(head) == 2:
                break  # the client goes away; the task does not
    _, rest, _ = follow(http, location + "/events", headers={"Last-Event-ID": "2"})
    summary = validate_lmsp_stream(head + rest)
    task = wait_for(lambda: finished(http, location.rsplit("/", 1)[1]), timeout=10)
    assert task["result"]["output"] == summary["output"]


def test_task_cancel_running_and_queued(tmp_path):
    parallel = 2
    engine = ScriptedEngine(LONG, delay_s=0.005, max_concurrency=parallel)
    with serving(tmp_path, engine=engine) as app:
        http = app.http
        running = [http.post("/lmsp/v1/tasks", json=task_body(max_output_tokens=4000)).json()
                   for _ in range(parallel)]
        queued = http.post("/lmsp/v1/tasks", json=task_body(max_output_tokens=4000)).json()
        for task in running:
            follow(http, f"/lmsp/v1/tasks/{task['id']}/events", stop_after=3)
        assert http.get(f"/lmsp/v1/tasks/{queued['id']}").json()["status"] == "queued"

        r = http.post(f"/lmsp/v1/tasks/{queued['id']}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        for task in running:
            r = http.post(f"/lmsp/v1/tasks/{task['id']}/cancel")
            assert r.status_code == 200 and r.json()["status"] == "cancelled"
            assert r.json()["result"]["status"] == "cancelled"

        for task in (*running, queued):
            _, frames, _ = follow(http, f"/lmsp/v1/tasks/{task['id']}/events")
            summary = validate_lmsp_stream(frames)
            assert summary["terminal"] == "response.cancelled"
        assert http.post(f"/lmsp/v1/tasks/{running[0]['id']}/cancel").json()["status"] == "cancelled"
        assert app.generations() == parallel, "a task cancelled while queued never reaches the model"
        assert engine.cancelled == parallel


def test_openai_background_poll_resume_and_cancel(tmp_path):
    engine = ScriptedEngine(tuple(f" w{i}" for i in range(8)), delay_s=0.002)
    with serving(tmp_path, engine=engine) as app:
        http, openai_client = app.http, sdk(app)
        resp = openai_client.responses.create(**task_body(), background=True)
        assert resp.status == "queued" and resp.background is True
        done = wait_for(lambda: (r := openai_client.responses.retrieve(resp.id)).status
                        not in ("queued", "in_progress") and r, timeout=10)
        assert done.status in ("completed", "incomplete")

        # The whole stream from the start, then resumed after sequence number 2.
        _, frames, _ = follow(http, f"/v1/responses/{resp.id}", params={"stream": "true"})
        events = openai_events(frames)
        final = validate_openai_stream(events)
        assert events[0]["response"]["status"] == "queued" and events[1]["type"] == "response.in_progress"
        assert final == http.get(f"/v1/responses/{resp.id}").json()
        _, frames, _ = follow(http, f"/v1/responses/{resp.id}", params={"stream": "true", "starting_after": 2})
        assert openai_events(frames) == events[3:]
        resumed = list(openai_client.responses.retrieve(resp.id, stream=True, starting_after=2))
        assert [(e.type, e.sequence_number) for e in resumed] == \
            [(e["type"], e["sequence_number"]) for e in events[3:]]

        # Cancel a long one; polling then shows it cancelled, its stream ends.
        engine.words, engine.delay_s = LONG, 0.005
        long = openai_client.responses.create(**task_body(max_output_tokens=4000), background=True)
        wait_for(lambda: openai_client.responses.retrieve(long.id).status == "in_progress", timeout=10)
        cancelled = openai_client.responses.cancel(long.id)
        assert cancelled.status == "cancelled"
        assert openai_client.responses.retrieve(long.id).status == "cancelled"
        _, frames, _ = follow(http, f"/v1/responses/{long.id}", params={"stream": "true"})
        events = openai_events(frames)
        assert validate_openai_stream(events)["status"] == "cancelled"
        assert openai_client.responses.cancel(long.id).status == "cancelled"


def test_openai_background_stream_and_rules(app, http):
    events = [e.model_dump(mode="json") for e in
              sdk(app).responses.create(**task_body(), background=True, stream=True)]
    final = validate_openai_stream(events)
    assert events[0]["response"]["status"] == "queued" and final["background"] is True

    r = http.post("/v1/responses", json=task_body(background=True, store=False))
    assert r.status_code == 400 and r.json()["error"]["param"] == "background"
    plain = http.post("/v1/responses", json=task_body()).json()
    r = http.get(f"/v1/responses/{plain['id']}", params={"stream": "true"})
    assert r.status_code == 400 and "background" in r.json()["error"]["message"]
    assert http.post(f"/v1/responses/{plain['id']}/cancel").status_code == 400
    r = http.get("/lmsp/v1/tasks/task_nope/events")
    assert r.status_code == 404 and r.json()["code"] == "task_not_found"
    r = http.get(f"/lmsp/v1/tasks/{plain['id']}")
    assert r.status_code == 404, "an OpenAI background response is not an LMSP task"


def test_events_expire_with_410_but_the_result_stays(tmp_path):
    with serving(tmp_path, retention=Retention(event_ttl_s=0.5), prune_interval_s=0.2) as app:
        http = app.http
        task = http.post("/lmsp/v1/tasks", json=task_body()).json()
        _, full, _ = follow(http, f"/lmsp/v1/tasks/{task['id']}/events")
        validate_lmsp_stream(full)
        gone = wait_for(lambda: finished(http, task["id"]) and
                        http.get(f"/lmsp/v1/tasks/{task['id']}").json()["first_retained_event_id"] > len(full)
                        and True, timeout=10)
        assert gone
        for params, headers in (({"after": 0}, {}), ({}, {"Last-Event-ID": "3"})):
            r = http.get(f"/lmsp/v1/tasks/{task['id']}/events", params=params, headers=headers)
            assert r.status_code == 410
            assert r.json()["code"] == "event_history_expired"
            assert r.headers["content-type"].startswith("application/problem+json")
            asked = "Events after 3 of" if headers else "The events of"
            assert r.json()["detail"] == f"{asked} {task['id']!r} are no longer kept; read the final result instead."
        result = http.get(f"/lmsp/v1/tasks/{task['id']}").json()
        assert result["result"]["output"] == validate_lmsp_stream(full)["output"]

        bg = http.post("/v1/responses", json=task_body(background=True)).json()
        wait_for(lambda: http.get(f"/v1/responses/{bg['id']}").json()["status"] not in ("queued", "in_progress"),
                 timeout=10)
        # Expired half a second after it finished, at the next prune pass.
        r = wait_for(lambda: (r := http.get(f"/v1/responses/{bg['id']}",
                                            params={"stream": "true", "starting_after": 0})).status_code == 410 and r,
                     timeout=10)
        assert r.json()["error"]["code"] == "event_history_expired"
        assert r.json()["error"]["message"] == (f"Events after 0 of {bg['id']!r} are no longer kept; "
                                                "read the final result instead.")
        # Without starting_after: no "events after -1", nor an earliest kept one past the last.
        r = http.get(f"/v1/responses/{bg['id']}", params={"stream": "true"})
        assert r.status_code == 410 and r.json()["error"]["message"] == (
            f"The events of {bg['id']!r} are no longer kept; read the final result instead.")


def test_a_queued_background_response_stores_no_keep_alives(tmp_path):
    """A keep-alive event repeats the whole response (its instructions,
    tools, metadata); stored, a response waiting in the queue grew its log
    by that much every interval, without bound. Its followers hear SSE
    comments instead, and its log stays numbered without gaps."""
    import dataclasses

    from lmspd.core.limits import DEFAULT_LIMITS
    from lmspd.streaming.sse import SSE_KEEPALIVE

    every = 0.05
    engine = ScriptedEngine(LONG, delay_s=0.005)  # one at a time: the second waits
    limits = dataclasses.replace(DEFAULT_LIMITS, sse_keepalive_s=every)
    with serving(tmp_path, engine=engine, limits=limits) as app:
        http = app.http
        first = http.post("/v1/responses", json=task_body(max_output_tokens=4000, background=True)).json()
        wait_for(lambda: http.get(f"/v1/responses/{first['id']}").json()["status"] == "in_progress", timeout=10)
        waiting = http.post("/v1/responses", json=task_body(background=True, instructions="x" * 100_000)).json()
        assert waiting["status"] == "queued"

        def stored_log() -> list[tuple[int, str, int]]:
            events = app.store.events_after("local", waiting["id"], 0) or []
            return [(e.seq, e.event, len(str(e.data))) for e in events]

        before = wait_for(stored_log, timeout=10)
        # A follower meanwhile: comments, no events, for several intervals.
        with http.stream("GET", f"/v1/responses/{waiting['id']}", params={"stream": "true",
                                                                          "starting_after": 0}) as r:
            lines = (line for line in r.iter_lines() if line)
            heard = [next(lines) for _ in range(3)]
        assert heard == [SSE_KEEPALIVE.decode().strip()] * 3, heard
        time.sleep(10 * every)
        assert http.get(f"/v1/responses/{waiting['id']}").json()["status"] == "queued"
        assert stored_log() == before, "a waiting response's stored log grew"
        assert [name for _, name, _ in before] == ["response.created"]

        assert http.post(f"/v1/responses/{first['id']}/cancel").status_code == 200
        _, frames, _ = follow(http, f"/v1/responses/{waiting['id']}", params={"stream": "true"})
        events = openai_events(frames)
    final = validate_openai_stream(events)  # sequence numbers 0, 1, 2, ... without a gap
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert final["status"] == "incomplete" and final["output"]  # its 24 tokens


def test_a_log_pruned_while_it_is_read_ends_the_stream_with_410s_code(tmp_path, caplog):
    """Retention may drop a finished task's log between two batches of one
    reader (512 events each): its stream ends saying so, as a fresh reader
    is told, not as if the store had failed (store_unavailable, and a
    traceback at ERROR)."""
    import json

    engine = ScriptedEngine(LONG[:700])
    with serving(tmp_path, engine=engine) as app:
        http = app.http
        task = http.post("/lmsp/v1/tasks", json=task_body(max_output_tokens=2000)).json()
        done = wait_for(lambda: finished(http, task["id"]), timeout=30)
        assert done["last_event_id"] > 600
        store, read = app.store, app.store.events_after
        reads = []

        def events_after(*args, **kwargs):
            out = read(*args, **kwargs)
            reads.append(len(out or []))
            if len(reads) == 1:  # after the first batch: the log goes (a day after it ended)
                store.prune(now=time.time() + 2 * 86400)
            return out

        store.events_after = events_after
        try:
            status, frames, _ = follow(http, f"/lmsp/v1/tasks/{task['id']}/events")
        finally:
            store.events_after = read
    assert status == 200 and reads[0] == 512 and len(frames) == 513
    error = json.loads(frames[-1].data)
    assert frames[-1].event == "error" and error["error"]["code"] == "event_history_expired", error
    assert error["error"]["detail"] == (f"Events after 512 of {task['id']!r} are no longer kept; "
                                        "read the final result instead.")
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_polling_a_task_leaves_its_request_unparsed(app, http, monkeypatch):
    """A poll of a task (702 bytes of reply) parsed the whole stored
    request in a store thread, megabytes of tools, holding the interpreter
    lock and stalling every stream each time; so did its cancel."""
    import json

    tools = [{"type": "function", "name": f"f{i}",
              "parameters": {"type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(100)}}}
             for i in range(64)]
    sent = json.dumps(task_body(tools=tools))
    task = http.post("/lmsp/v1/tasks", content=sent, headers={"content-type": "application/json"}).json()
    wait_for(lambda: finished(http, task["id"]), timeout=30)
    parsed: list[int] = []
    loads = json.loads

    def counting(text, *args, **kwargs):
        parsed.append(len(text))
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counting)
    for _ in range(3):
        r = http.get(f"/lmsp/v1/tasks/{task['id']}")
        assert r.status_code == 200 and r.json()["status"] == "completed"
    assert http.post(f"/lmsp/v1/tasks/{task['id']}/cancel").json()["status"] == "completed"
    assert parsed and max(parsed) < len(sent) / 10, (len(sent), sorted(parsed)[-3:])


def test_a_task_whose_record_cannot_be_read_back_is_answered_with_its_id(app, http, monkeypatch):
    """Once the task runs, its id reaches the client. Reading its record back
    could be refused (a full store queue: 503) or fail (500): the client
    never learnt the id, its idempotency key was released, and its retry
    started a second task beside the first."""
    import sqlite3

    store = app.app.state.lmspd.store

    def locked(owner, task_id):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(store, "get_task", locked)
    r = http.post("/lmsp/v1/tasks", json=task_body(), headers={"Idempotency-Key": "once"})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["object"] == "task" and body["status"] in ("queued", "in_progress", "completed")
    assert r.headers["Location"] == f"/lmsp/v1/tasks/{body['id']}"
    monkeypatch.undo()
    assert wait_for(lambda: finished(http, body["id"]), timeout=30)["status"] == "completed"
    again = http.post("/lmsp/v1/tasks", json=task_body(), headers={"Idempotency-Key": "once"})
    assert again.json()["id"] == body["id"], "the key's retry is the same task"
