"""The final write of a finished foreground generation (``store: true``,
a JSON reply): never refused for a full store queue, tried again after a
transient store error, and, in a conversation, one transaction, so that a
503 "could not be stored" is the truth and an idempotent retry runs once.

The whole app in this process over the scripted engine and a real SQLite
store; faults are injected into the store's SQL."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from starlette.testclient import TestClient

from lmspd.store.calls import StoreCalls
from support.engine import ScriptedEngine
from support.faults import FailingOnce
from support.inprocess import MODEL, make_app


def engine() -> ScriptedEngine:
    return ScriptedEngine(("Hello", " there"), delay_s=0.001)


def stored_responses(store: Any) -> list[tuple[str, str]]:
    with store.sql_read() as sql:
        return [(r["id"], r["status"]) for r in sql.rows("SELECT id, status FROM responses ORDER BY created_at")]


def test_a_finished_generation_is_stored_even_when_the_store_queue_is_full(tmp_path: Path) -> None:
    app, store = make_app(tmp_path, engine=engine())
    with TestClient(app, base_url="http://localhost") as http:
        # One store thread, no room to wait: a call that holds the thread
        # fills the queue (the stand-in for 4 threads and 512 waiting).
        calls = StoreCalls(threads=1, max_waiting=0)
        app.state.lmspd.calls = calls
        hold = threading.Event()
        http.portal.start_task_soon(calls, hold.wait)
        deadline = time.monotonic() + 10
        while calls.outstanding < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        got: dict[str, Any] = {}
        post = threading.Thread(target=lambda: got.setdefault(
            "r", http.post("/v1/responses", json={"model": MODEL, "input": "hi", "store": True})))
        post.start()
        # The final write waits behind the held call (or, refused, the reply is out).
        while calls.outstanding < 2 and post.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        hold.set()
        post.join(10)
        r = got["r"]
        assert r.status_code == 200, r.text
        assert r.json()["output"][0]["content"][0]["text"] == "Hello there"
        app.state.lmspd.calls = StoreCalls()
        assert http.get(f"/v1/responses/{r.json()['id']}").json()["status"] == "completed"
        assert engine_generations(app) == 1
        calls.close()
    store.close()


def engine_generations(app: Any) -> int:
    return app.state.lmspd.service.models[MODEL].engine.generations


def test_a_transient_error_in_the_final_write_is_tried_again(tmp_path: Path, monkeypatch) -> None:
    app, store = make_app(tmp_path, engine=engine())
    with TestClient(app, base_url="http://localhost") as http:
        fault = FailingOnce(monkeypatch, "INSERT INTO response_items", sqlite3.OperationalError("database is locked"))
        r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "store": True})
        assert fault.left == 0, "the fault was never hit"
        assert r.status_code == 200, r.text
        assert http.get(f"/v1/responses/{r.json()['id']}").json()["status"] == "completed"
        assert engine_generations(app) == 1
    store.close()


def test_a_conversation_turn_is_stored_whole_or_not_at_all(tmp_path: Path) -> None:
    """The conversation's append fails (not transiently): the 503 says the
    response was not stored, and it was not; the idempotent retry then runs
    and stores one response and one turn."""
    app, store = make_app(tmp_path, engine=engine())
    with TestClient(app, base_url="http://localhost") as http:
        conv = http.post("/v1/conversations", json={}).json()["id"]
        with store.sql_write() as sql:
            sql.run("CREATE TRIGGER broken BEFORE INSERT ON conversation_items "
                    "BEGIN SELECT RAISE(ABORT, 'the disk broke'); END")
        body = {"model": MODEL, "input": "hi", "conversation": conv, "store": True}
        r = http.post("/v1/responses", json=body, headers={"Idempotency-Key": "k1"})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "store_unavailable"
        assert "could not be stored" in r.json()["error"]["message"]
        assert stored_responses(store) == [], "a 503 'not stored' over a stored response"
        assert http.get(f"/v1/conversations/{conv}/items").json()["data"] == []

        with store.sql_write() as sql:
            sql.run("DROP TRIGGER broken")
        r = http.post("/v1/responses", json=body, headers={"Idempotency-Key": "k1"})
        assert r.status_code == 200, r.text
        assert stored_responses(store) == [(r.json()["id"], "completed")]
        items = http.get(f"/v1/conversations/{conv}/items", params={"order": "asc"}).json()["data"]
        assert [i["role"] for i in items] == ["user", "assistant"]
        assert engine_generations(app) == 2  # the first attempt's output was never stored
    store.close()


def test_a_conversation_turn_whose_write_fails_once_is_stored_once(tmp_path: Path, monkeypatch) -> None:
    app, store = make_app(tmp_path, engine=engine())
    with TestClient(app, base_url="http://localhost") as http:
        conv = http.post("/v1/conversations", json={}).json()["id"]
        fault = FailingOnce(monkeypatch, "INSERT INTO conversation_items",
                            sqlite3.OperationalError("database is locked"))
        r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "conversation": conv, "store": True},
                      headers={"Idempotency-Key": "k1"})
        assert fault.left == 0, "the fault was never hit"
        assert r.status_code == 200, r.text
        assert stored_responses(store) == [(r.json()["id"], "completed")]
        items = http.get(f"/v1/conversations/{conv}/items", params={"order": "asc"}).json()["data"]
        assert [i["role"] for i in items] == ["user", "assistant"]
        assert engine_generations(app) == 1
    store.close()
