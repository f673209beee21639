"""A response that could not be stored says so (never ``store: true`` over a
lost write), in every shape: a 503 for JSON replies, ``store: false`` on a
stream's terminal event."""

from __future__ import annotations

import asyncio
import json
import sqlite3

from lmspd.store.sqlite import SQLiteStore
from support.inprocess import MODEL, client, make_app


class FullDisk(SQLiteStore):
    """Every write of a response fails as SQLite does on a full disk."""

    def put_response(self, *args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")

    def update_response(self, *args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")


def frames(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines and lines["data"] != "[DONE]":
            out.append((lines.get("event", ""), json.loads(lines["data"])))
    return out


def test_unstored_responses_say_so(tmp_path) -> None:
    app, store = make_app(tmp_path, store=FullDisk(tmp_path / "lmspd.sqlite3"))
    body = {"model": MODEL, "input": "hi", "store": True}

    async def go() -> None:
        async with client(app) as c:
            r = await c.post("/v1/responses", json=body)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "store_unavailable" and "Retry-After" in r.headers
            r = await c.post("/lmsp/v1/responses", json=body, headers={"LMSP-Version": "1.0"})
            assert r.status_code == 503 and r.headers["content-type"].startswith("application/problem+json")
            assert r.json()["code"] == "store_unavailable"

            r = await c.post("/v1/responses", json={**body, "stream": True})
            assert r.status_code == 200
            events = frames(r.text)
            name, data = events[-1]
            assert name == "response.completed" and data["response"]["store"] is False
            assert data["response"]["output"][0]["content"][0]["text"] == "Hello there"
            assert (await c.get(f"/v1/responses/{data['response']['id']}")).status_code == 404

            r = await c.post("/lmsp/v1/responses", json={**body, "stream": True}, headers={"LMSP-Version": "1.0"})
            name, data = frames(r.text)[-1]
            assert name == "response.completed" and data["store"] is False

            # Not asked to store: nothing to fail.
            r = await c.post("/v1/responses", json={**body, "store": False})
            assert r.status_code == 200 and r.json()["store"] is False

    asyncio.run(go())
    store.close()


class KeysFail(FullDisk):
    """Not even an idempotency key can be recorded (while ``begin_fails``), nor released."""

    begin_fails = True

    def idempotency_begin(self, *args, **kwargs):
        if self.begin_fails:
            raise sqlite3.OperationalError("disk I/O error")
        return super().idempotency_begin(*args, **kwargs)

    def idempotency_abandon(self, *args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")


def test_an_idempotency_key_on_a_failing_store(tmp_path) -> None:
    """A key that cannot be recorded is a 503 before anything runs; a
    response that cannot be stored stays a 503 when releasing its key fails
    too (not an internal error in its place)."""
    store = KeysFail(tmp_path / "lmspd.sqlite3")
    app, _ = make_app(tmp_path, store=store)
    body = {"model": MODEL, "input": "hi", "store": True}

    async def go() -> None:
        async with client(app) as c:
            r = await c.post("/v1/responses", json=body, headers={"Idempotency-Key": "k1"})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "store_unavailable" and "Retry-After" in r.headers
            assert "not run" in r.json()["error"]["message"]
            store.begin_fails = False
            r = await c.post("/v1/responses", json=body, headers={"Idempotency-Key": "k2"})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "store_unavailable"
            assert "generated but could not be stored" in r.json()["error"]["message"]

    asyncio.run(go())
    store.close()


def test_stored_responses_still_say_store_true(tmp_path) -> None:
    app, store = make_app(tmp_path)

    async def go() -> None:
        async with client(app) as c:
            r = await c.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True})
            name, data = frames(r.text)[-1]
            assert data["response"]["store"] is True
            assert (await c.get(f"/v1/responses/{data['response']['id']}")).status_code == 200
            r = await c.post("/lmsp/v1/responses", json={"model": MODEL, "input": "hi", "stream": True,
                                                          "store": True}, headers={"LMSP-Version": "1.0"})
            assert "store" not in frames(r.text)[-1][1]

    asyncio.run(go())
    store.close()


class FailingWhileSet(SQLiteStore):
    """Every write of a response fails while ``failing`` is set."""

    failing = False

    def put_response(self, *args, **kwargs):
        if self.failing:
            raise sqlite3.OperationalError("disk I/O error")
        return super().put_response(*args, **kwargs)

    def update_response(self, *args, **kwargs):
        if self.failing:
            raise sqlite3.OperationalError("disk I/O error")
        return super().update_response(*args, **kwargs)


def test_a_websocket_turn_after_an_unstored_one_is_stored_whole(tmp_path) -> None:
    """The connection still continues a response whose write failed (it holds
    it in memory), and the next stored response carries that history itself:
    it must not name a predecessor the store does not have."""
    from starlette.testclient import TestClient

    from support.ws import TERMINAL

    store = FailingWhileSet(tmp_path / "lmspd.sqlite3")
    app, _ = make_app(tmp_path, store=store)

    def turn(ws, body: dict) -> dict:
        ws.send_text(json.dumps({"type": "response.create", "model": MODEL, **body}))
        while (event := json.loads(ws.receive_text()))["type"] not in TERMINAL:
            pass
        return event

    with TestClient(app, base_url="http://localhost") as http:
        with http.websocket_connect("ws://localhost/v1/responses") as ws:
            store.failing = True
            first = turn(ws, {"input": "one"})
            assert first["type"] == "response.completed" and first["response"]["store"] is False
            store.failing = False
            second = turn(ws, {"input": "two", "previous_response_id": first["response"]["id"]})
            assert second["type"] == "response.completed" and second["response"]["store"] is True
        second_id = second["response"]["id"]
        items = http.get(f"/v1/responses/{second_id}/input_items", params={"order": "asc"}).json()["data"]
        texts = [part.get("text") for item in items for part in item.get("content", [])]
        assert texts[0] == "one" and texts[-1] == "two", texts
        # And it continues over HTTP, from another connection.
        r = http.post("/v1/responses", json={"model": MODEL, "input": "three", "previous_response_id": second_id})
        assert r.status_code == 200, r.text
    store.close()


class EventsFailAfter(SQLiteStore):
    """Stores the first ``keep`` events of a task, then refuses to store more
    (the run's own, and the failure that would close its log)."""

    keep = 4

    def append_events(self, task_id, events):
        if events and events[-1][0] > self.keep:
            raise sqlite3.OperationalError("disk I/O error")
        return super().append_events(task_id, events)

    def close_task(self, task_id, error, *, close_log=None):
        raise sqlite3.OperationalError("disk I/O error")


def test_a_follower_of_a_task_whose_log_is_cut_short_gets_an_error_event(tmp_path) -> None:
    """LMSP §6.3: a problem after which the stream cannot go on is an
    ``error`` event; a stream that just ended would be read as a dropped
    connection and resumed forever."""
    from starlette.testclient import TestClient

    from support.engine import ScriptedEngine
    from support.follow import follow
    from support.sse import parse_frames

    store = EventsFailAfter(tmp_path / "lmspd.sqlite3")
    engine = ScriptedEngine(tuple(f" w{i}" for i in range(400)), delay_s=0.01)
    app, _ = make_app(tmp_path, store=store, engine=engine)
    with TestClient(app, base_url="http://localhost") as http:
        r = http.post("/lmsp/v1/tasks", json={"model": MODEL, "input": "hi"})
        assert r.status_code == 202, r.text
        status, got, _ = follow(http, f"/lmsp/v1/tasks/{r.json()['id']}/events")
        assert status == 200
        *events, last = got
        assert [f.id for f in events] == [str(i) for i in range(1, len(events) + 1)]
        assert last.event == "error" and last.id is None, "not one of the response's numbered events"
        problem = last.json()["error"]
        assert problem["code"] == "store_unavailable" and problem["status"] == 503

        # OpenAI's background stream: its own error event, numbered next.
        r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True, "store": True})
        assert r.status_code == 200, r.text
        with http.stream("GET", f"/v1/responses/{r.json()['id']}", params={"stream": "true"}) as reply:
            frames = list(parse_frames(reply.iter_lines()))
        data = [json.loads(f.data) for f in frames]
        assert frames[-1].event == "error" and data[-1]["type"] == "error", "no [DONE] after an error"
        assert data[-1]["code"] == "store_unavailable" and data[-1]["param"] is None
        assert [d["sequence_number"] for d in data] == list(range(len(data)))
    store.close()
