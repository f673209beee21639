"""What a finished turn leaves, on both backends: ``end_turn`` stores the
response and its conversation items in one transaction (both or neither),
and closing an interrupted task whose response row is already final ends
the task as that response did, never as failed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lmspd.store import open_store
from lmspd.store.base import ClosedLog, Store, TaskRecord
from lmspd.store.sql import Sql


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "lmspd.db")
    return str(request.getfixturevalue("pg_database"))


@pytest.fixture
def opened(target: str):
    stores: list[Store] = []

    def open_() -> Store:
        store = open_store(target)
        stores.append(store)
        return store

    yield open_
    for store in stores:
        store.close()


def message(text: str, role: str = "user") -> dict:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def response(rid: str, status: str) -> dict:
    return {"id": rid, "object": "response", "status": status, "error": None,
            "output": [{"id": f"msg_{rid}", "type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": "ok"}]}]}


def test_a_turn_is_stored_whole(opened) -> None:
    s = opened()
    s.create_conversation("alice", "conv_1")
    assert s.end_turn("alice", "resp_1", response("resp_1", "completed"), [message("hi")], new=True,
                      conversation_id="conv_1", conversation_items=[message("hi"), message("ok", "assistant")])
    assert s.get_response("alice", "resp_1")["status"] == "completed"
    assert [i["role"] for i in s.conversation_items("alice", "conv_1")] == ["user", "assistant"]
    assert [i["content"][0]["text"] for i in s.list_input_items("alice", "resp_1").items] == ["hi"]

    # An update of a response stored earlier (a background one), and a turn
    # that stores no response (store: false) but still joins the conversation.
    s.put_response("alice", "resp_2", response("resp_2", "in_progress"), [message("again")],
                   conversation_id="conv_1")
    assert s.end_turn("alice", "resp_2", response("resp_2", "completed"), [], new=False,
                      conversation_id="conv_1", conversation_items=[message("again")])
    assert s.get_response("alice", "resp_2")["status"] == "completed"
    assert s.end_turn("alice", "resp_3", None, [], new=True, conversation_id="conv_1",
                      conversation_items=[message("unstored")])
    assert s.get_response("alice", "resp_3") is None
    assert len(s.conversation_items("alice", "conv_1")) == 4


def test_a_turn_whose_conversation_write_fails_stores_nothing(opened, monkeypatch) -> None:
    s = opened()
    s.create_conversation("alice", "conv_1")
    original = Sql.many

    def many(sql: Sql, statement: str, rows: Any) -> None:
        if "INSERT INTO conversation_items" in statement and rows:
            raise RuntimeError("the disk broke")
        original(sql, statement, rows)

    monkeypatch.setattr(Sql, "many", many)
    with pytest.raises(RuntimeError):
        s.end_turn("alice", "resp_1", response("resp_1", "completed"), [message("hi")], new=True,
                   conversation_id="conv_1", conversation_items=[message("hi")])
    assert s.get_response("alice", "resp_1") is None, "the response outlived its failed turn"
    assert s.conversation_items("alice", "conv_1") == []
    monkeypatch.setattr(Sql, "many", original)
    # Tried again whole: stored once.
    assert s.end_turn("alice", "resp_1", response("resp_1", "completed"), [message("hi")], new=True,
                      conversation_id="conv_1", conversation_items=[message("hi")])
    assert len(s.conversation_items("alice", "conv_1")) == 1


def test_a_turn_whose_conversation_is_gone_keeps_its_response(opened) -> None:
    s = opened()
    assert not s.end_turn("alice", "resp_1", response("resp_1", "completed"), [message("hi")], new=True,
                          conversation_id="conv_gone", conversation_items=[message("hi")])
    assert s.get_response("alice", "resp_1")["status"] == "completed"
    s.create_conversation("bob", "conv_bob")
    assert not s.end_turn("alice", "resp_2", None, [], new=True, conversation_id="conv_bob",
                          conversation_items=[message("not yours")])
    assert s.conversation_items("bob", "conv_bob") == []


def test_an_interrupted_task_whose_response_is_final_ends_as_its_response(opened) -> None:
    s = opened()
    s.create_task("alice", "task_1", {"dialect": "x"}, status="in_progress", response_id="resp_1")
    s.append_events("task_1", [(1, "response.created", {"n": 1}), (2, "delta", {"n": 2})])
    s.put_response("alice", "resp_1", response("resp_1", "completed"), [message("hi")])
    s.create_task("alice", "task_2", {"dialect": "x"}, status="in_progress", response_id="resp_2")
    s.put_response("alice", "resp_2", response("resp_2", "in_progress"), [message("hi")])
    s.close()

    seen: dict[str, tuple[str, Any]] = {}

    def close(task: TaskRecord, seq: int, log: list) -> ClosedLog:
        seen[task.id] = (task.status, task.result)
        name = "response.completed" if task.status == "completed" else "response.failed"
        return ClosedLog([(name, {"n": seq})], {"id": task.response_id, "status": task.status})

    s = opened()
    closed = {t.id: t for t in s.fail_interrupted_tasks("restarted", close_log=close)}
    assert seen["task_1"] == ("completed", response("resp_1", "completed"))
    assert seen["task_2"][0] == "failed"
    done = closed["task_1"]
    assert done.status == "completed" and done.error is None and done.finished_at is not None
    assert done.result == {"id": "resp_1", "status": "completed"}
    assert [(e.seq, e.event) for e in s.events_after("alice", "task_1", 2)] == [(3, "response.completed")]
    assert closed["task_2"].status == "failed" and closed["task_2"].error["code"] == "server_restarted"
    # The response rows are the store's to keep as they are: the final one untouched.
    assert s.get_response("alice", "resp_1")["status"] == "completed"
    assert s.fail_interrupted_tasks("again", close_log=close) == []


def test_a_turn_written_again_after_it_landed_changes_nothing(opened) -> None:
    """A commit that landed but reported an error (a connection lost during
    COMMIT) is tried again: the response is updated, not inserted twice
    (Duplicate), and the turn's items, which keep their ids across tries,
    are not appended a second time."""
    s = opened()
    s.create_conversation("alice", "conv_1")
    items = [{**message("hi"), "id": "msg_in"}, {**message("ok", "assistant"), "id": "msg_out"}]
    for new in (True, True, False):
        assert s.end_turn("alice", "resp_1", response("resp_1", "completed"), [items[0]], new=new,
                          conversation_id="conv_1", conversation_items=items)
    assert [i["id"] for i in s.conversation_items("alice", "conv_1")] == ["msg_in", "msg_out"]
    assert s.get_response("alice", "resp_1")["status"] == "completed"
