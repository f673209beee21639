"""A finished background run's result is never lost to one failed write.

The writes that end a task (its response row's end, its conversation
append, its final status with the terminal event) keep a result that exists
nowhere else: a transient store error (SQLite "database is locked", a
PostgreSQL pool timeout) is tried again until the write lands, never
swallowed, never turned into a failed task. And a task whose response row
was stored final before its own terminal write was cut off is not failed
by recovery at the next start: it ends as its response did.

The whole app in this process over the scripted engine and a real SQLite
store; faults are injected by wrapping the store (or its SQL) for one call.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from starlette.testclient import TestClient

from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.store.sqlite import SQLiteStore
from support.engine import ScriptedEngine
from support.faults import FailingOnce
from support.inprocess import MODEL, make_app
from support.sse import parse_frames
from support.validate import validate_lmsp_stream, validate_openai_stream

LMSP = {"LMSP-Version": "1.0"}
FINAL = ("completed", "incomplete", "failed", "cancelled")


def engine() -> ScriptedEngine:
    return ScriptedEngine(("Hello", " there"), delay_s=0.001)


def wait_final(read: Any, deadline_s: float = 10.0) -> dict:
    """Poll ``read()`` (a JSON object with a status) until it is final."""
    end = time.monotonic() + deadline_s
    while True:
        body = read()
        if body["status"] in FINAL or time.monotonic() > end:
            return body
        time.sleep(0.01)


def openai_replay(http: TestClient, rid: str) -> list[tuple[str | None, dict]]:
    with http.stream("GET", f"/v1/responses/{rid}", params={"stream": "true"}) as reply:
        frames = list(parse_frames(reply.iter_lines()))
    return [(f.event, json.loads(f.data)) for f in frames if f.data and f.data != "[DONE]"]


def lmsp_replay(http: TestClient, task_id: str) -> list:
    with http.stream("GET", f"/lmsp/v1/tasks/{task_id}/events", headers=LMSP) as reply:
        return list(parse_frames(reply.iter_lines()))


class FlakyStatus(SQLiteStore):
    """The terminal ``set_task_status`` raises ``error`` ``fails`` times."""

    fails = 0
    error: Exception = sqlite3.OperationalError("database is locked")

    def set_task_status(self, owner, task_id, status, **kwargs):
        if self.fails and status in FINAL:
            self.fails -= 1
            raise self.error
        return super().set_task_status(owner, task_id, status, **kwargs)


def test_a_final_status_write_that_fails_is_tried_until_it_lands(tmp_path: Path) -> None:
    store = FlakyStatus(tmp_path / "lmspd.sqlite3")
    store.fails = 4  # two for each task below (the write is the same for both)
    app, _ = make_app(tmp_path, store=store, engine=engine())
    with TestClient(app, base_url="http://localhost") as http:
        rid = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True}).json()["id"]
        task_id = http.post("/lmsp/v1/tasks", json={"model": MODEL, "input": "hi", "store": True},
                            headers=LMSP).json()["id"]
        task = wait_final(lambda: http.get(f"/lmsp/v1/tasks/{task_id}", headers=LMSP).json())
        assert task["status"] == "completed" and task["result"]["output"], task
        assert wait_final(lambda: http.get(f"/v1/responses/{rid}").json())["status"] == "completed"
        events = openai_replay(http, rid)
        assert events[-1][0] == "response.completed", events[-1]
        assert validate_openai_stream([data for _, data in events])["status"] == "completed"
        assert lmsp_replay(http, task_id)[-1].event == "response.completed"
        assert store.fails == 0
    store.close()
    # And after a restart: nothing for recovery to fail.
    app, store2 = make_app(tmp_path)
    with TestClient(app, base_url="http://localhost") as http:
        assert http.get(f"/v1/responses/{rid}").json()["status"] == "completed"
        assert http.get(f"/lmsp/v1/tasks/{task_id}", headers=LMSP).json()["status"] == "completed"
    store2.close()


def test_a_background_response_end_that_fails_once_is_tried_again(tmp_path: Path, monkeypatch) -> None:
    """The response row's end (its output items) fails once: not swallowed
    (a row in_progress forever, a chain that cannot be continued)."""
    app, store = make_app(tmp_path, engine=engine())
    with TestClient(app, base_url="http://localhost") as http:
        fault = FailingOnce(monkeypatch, "VALUES (?, 'output', ?, ?, ?)", sqlite3.OperationalError("disk I/O error"))
        rid = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True}).json()["id"]
        # The replay ends with the terminal event, stored after the response's end.
        assert openai_replay(http, rid)[-1][0] == "response.completed"
        assert fault.left == 0, "the fault was never hit"
        got = http.get(f"/v1/responses/{rid}").json()
        assert got["status"] == "completed"
        assert got["output"][0]["content"][0]["text"] == "Hello there"
        r = http.post("/v1/responses", json={"model": MODEL, "input": "next", "previous_response_id": rid})
        assert r.status_code == 200, r.text
    store.close()


def test_a_background_turn_whose_conversation_append_fails_once_keeps_the_turn(tmp_path: Path,
                                                                                monkeypatch) -> None:
    app, store = make_app(tmp_path, engine=engine())
    with TestClient(app, base_url="http://localhost") as http:
        conv = http.post("/v1/conversations", json={}).json()["id"]
        fault = FailingOnce(monkeypatch, "INSERT INTO conversation_items",
                            sqlite3.OperationalError("database is locked"))
        rid = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True,
                                               "conversation": conv}).json()["id"]
        assert openai_replay(http, rid)[-1][0] == "response.completed"
        assert http.get(f"/v1/responses/{rid}").json()["status"] == "completed"
        assert fault.left == 0, "the fault was never hit"
        items = http.get(f"/v1/conversations/{conv}/items", params={"order": "asc"}).json()["data"]
        assert [i["role"] for i in items] == ["user", "assistant"], items
    store.close()


def test_recovery_never_fails_a_response_whose_end_was_stored(tmp_path: Path) -> None:
    """The response row is final, the task's terminal write never landed
    (a store error that is not transient, so the run gave up): at the next
    start the task ends as its response did, and the row stays as it is."""
    store = FlakyStatus(tmp_path / "lmspd.sqlite3")
    store.fails = 2
    store.error = RuntimeError("the store broke")
    app, _ = make_app(tmp_path, store=store, engine=engine())
    with TestClient(app, base_url="http://localhost") as http:
        rid = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True}).json()["id"]
        task_id = http.post("/lmsp/v1/tasks", json={"model": MODEL, "input": "hi", "store": True},
                            headers=LMSP).json()["id"]
        lmsp_rid = http.get(f"/lmsp/v1/tasks/{task_id}", headers=LMSP).json()["response_id"]
        deadline = time.monotonic() + 10
        while store.fails and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.fails == 0
        assert wait_final(lambda: http.get(f"/v1/responses/{rid}").json())["status"] == "completed"
        assert wait_final(lambda: http.get(f"/lmsp/v1/responses/{lmsp_rid}", headers=LMSP).json())["status"] \
            == "completed"
    store.close()
    app, store2 = make_app(tmp_path)
    with TestClient(app, base_url="http://localhost") as http:
        got = http.get(f"/v1/responses/{rid}").json()
        assert got["status"] == "completed" and got["error"] is None, got
        assert got["output"][0]["content"][0]["text"] == "Hello there"
        events = openai_replay(http, rid)
        assert events[-1][0] == "response.completed"
        final = validate_openai_stream([data for _, data in events])
        assert final["status"] == "completed" and final["output"] == got["output"]

        task = http.get(f"/lmsp/v1/tasks/{task_id}", headers=LMSP).json()
        assert task["status"] == "completed" and task["error"] is None, task
        assert task["result"]["output"][0]["content"][0]["text"] == "Hello there"
        assert http.get(f"/lmsp/v1/responses/{lmsp_rid}", headers=LMSP).json()["status"] == "completed"
        frames = lmsp_replay(http, task_id)
        summary = validate_lmsp_stream(frames)
        assert summary["terminal"] == "response.completed"
    store2.close()


def test_a_final_write_that_never_lands_gives_up_at_shutdown_and_recovery_keeps_the_result(tmp_path: Path) -> None:
    """A store that stays busy: the task's final status is tried until the
    server shuts down (within its grace, not forever), and the next start
    ends the task as its stored response did."""
    store = FlakyStatus(tmp_path / "lmspd.sqlite3")
    store.fails = 10**9
    limits = dataclasses.replace(DEFAULT_LIMITS, shutdown_grace_s=0.2)
    app, _ = make_app(tmp_path, store=store, engine=engine(), limits=limits)
    with TestClient(app, base_url="http://localhost") as http:
        rid = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True}).json()["id"]
        deadline = time.monotonic() + 10
        while store.fails > 10**9 - 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.fails <= 10**9 - 3, "the final write was not tried again"
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 5, "shutdown waited on a write that cannot land"
    store.close()
    app, store2 = make_app(tmp_path)
    with TestClient(app, base_url="http://localhost") as http:
        got = http.get(f"/v1/responses/{rid}").json()
        assert got["status"] == "completed" and got["output"][0]["content"][0]["text"] == "Hello there"
        assert openai_replay(http, rid)[-1][0] == "response.completed"
    store2.close()


def test_a_response_end_that_cannot_be_written_still_ends_the_task(tmp_path: Path) -> None:
    """An error that is not the store's passing kind (a bug, a constraint)
    on the response's end is not retried, and does not keep the task's own
    end from being written: the task completes with its result, followers
    see the terminal event (it stayed in_progress, with no end, until a
    restart)."""

    class BadEnd(SQLiteStore):
        def update_response(self, owner: str, rid: str, response: Any) -> Any:
            if response.get("status") in FINAL:
                raise sqlite3.IntegrityError("not a passing error")
            return super().update_response(owner, rid, response)

    store = BadEnd(tmp_path / "lmspd.sqlite3")
    app, _ = make_app(tmp_path, store=store, engine=engine())
    with TestClient(app, base_url="http://localhost") as http:
        rid = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True}).json()["id"]
        task = wait_final(lambda: dict(store._writer.execute(
            "SELECT status FROM tasks WHERE id = ?", (rid,)).fetchone()))
        assert task["status"] == "completed"
        events = openai_replay(http, rid)
        assert events[-1][0] == "response.completed"
