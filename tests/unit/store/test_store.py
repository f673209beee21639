"""The store behind stored responses, conversations, tasks with resumable
event logs, and idempotency keys: one suite, run against both backends
(SQLite, and PostgreSQL on a throwaway cluster), plus what only one of them
has (SQLite's file and pragmas)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lmspd.store.sqlite as sqlite_module
from lmspd.store import open_store, pruning
from lmspd.store.base import (
    BeginOutcome,
    ChainError,
    ClosedLog,
    Duplicate,
    DuplicateItem,
    EventsExpired,
    InvalidCursor,
    NotFound,
    Retention,
    SchemaTooNew,
    SequenceError,
    Store,
    StoreError,
    TaskFinished,
    TaskRecord,
)
from lmspd.store.sqlite import SQLiteStore

REPO_ROOT = Path(__file__).resolve().parents[3]


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Backend:
    """One test's database on one backend: ``open`` gives a new store object
    (a new instance) on the same data each time; ``sql`` runs raw SQL with
    ``?`` placeholders, to forge what the API cannot produce."""

    def __init__(self, name: str, target: str, module: Any) -> None:
        self.name = name
        self.target = target
        self.module = module  # the backend's module: its MIGRATIONS
        self._opened: list[Store] = []

    def open(self, **options: Any) -> Store:
        store = open_store(self.target, **options)
        self._opened.append(store)
        return store

    def sql(self, statement: str, params: tuple = ()) -> list[tuple]:
        if self.name == "sqlite":
            conn = sqlite3.connect(self.target)
            try:
                rows = conn.execute(statement, params).fetchall()
                conn.commit()
                return rows
            finally:
                conn.close()
        import psycopg

        with psycopg.connect(self.target, autocommit=True) as conn:
            cur = conn.execute(statement.replace("?", "%s"), params)
            return cur.fetchall() if cur.description else []

    def schema_version(self) -> int:
        if self.name == "sqlite":
            return self.sql("PRAGMA user_version")[0][0]
        return self.sql("SELECT version FROM lmspd_schema")[0][0]

    def set_schema_version(self, version: int) -> None:
        if self.name == "sqlite":
            self.sql(f"PRAGMA user_version = {version}")
        else:
            self.sql("UPDATE lmspd_schema SET version = ?", (version,))

    def columns(self, table: str) -> list[str]:
        if self.name == "sqlite":
            return [r[1] for r in self.sql(f"PRAGMA table_info({table})")]
        return [r[0] for r in self.sql(
            "SELECT column_name FROM information_schema.columns WHERE table_name = ? "
            "AND table_schema = current_schema()", (table,))]

    def table_exists(self, table: str) -> bool:
        if self.name == "sqlite":
            return bool(self.sql("SELECT 1 FROM sqlite_master WHERE name = ?", (table,)))
        return bool(self.sql("SELECT 1 FROM information_schema.tables WHERE table_name = ? "
                             "AND table_schema = current_schema()", (table,)))

    def integrity(self) -> str:
        """SQLite's own check of its file; PostgreSQL has no file of ours to check."""
        return integrity(Path(self.target)) if self.name == "sqlite" else "ok"

    def close_all(self) -> None:
        for store in self._opened:
            store.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "data" / "lmspd.db"


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, db_path: Path):
    if request.param == "sqlite":
        b = Backend("sqlite", str(db_path), sqlite_module)
    else:
        import lmspd.store.postgres as postgres_module

        b = Backend("postgresql", request.getfixturevalue("pg_database"), postgres_module)
    yield b
    b.close_all()


sqlite_only = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)


@pytest.fixture
def store(backend: Backend, clock: FakeClock):
    return backend.open(clock=clock)


def user_msg(text: str, item_id: str | None = None) -> dict:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    if item_id is not None:
        item["id"] = item_id
    return item


def response_obj(rid: str, status: str = "completed", text: str = "ok") -> dict:
    return {
        "id": rid,
        "object": "response",
        "status": status,
        "output": [
            {
                "id": f"msg_out_{rid}",
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text}],
            }
        ],
        "error": None,
    }


def integrity(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


# --- basics -----------------------------------------------------------------


def test_implements_store_protocol(store: Store, backend: Backend) -> None:
    assert isinstance(store, Store)
    assert store.stats()["schema_version"] == len(backend.module.MIGRATIONS)
    assert backend.schema_version() == len(backend.module.MIGRATIONS)
    # Same schema in both backends: the same tables with the same columns.
    for table in ("responses", "response_items", "conversations", "conversation_items", "tasks",
                  "task_events", "idempotency_keys", "instances"):
        assert sorted(backend.columns(table)) == sorted(SCHEMA_COLUMNS[table]), table


SCHEMA_COLUMNS = {
    "responses": ["id", "owner", "status", "previous_response_id", "conversation_id", "created_at",
                  "updated_at", "body", "bytes", "instance_id"],
    "response_items": ["response_id", "kind", "position", "item_id", "body"],
    "conversations": ["id", "owner", "created_at", "updated_at", "metadata", "bytes", "next_position"],
    "conversation_items": ["conversation_id", "position", "item_id", "body", "bytes"],
    "tasks": ["id", "owner", "status", "response_id", "request", "result", "error", "created_at",
              "updated_at", "finished_at", "last_seq", "first_retained_seq", "bytes", "events_bytes",
              "instance_id", "cancel_requested_at", "dialect", "model"],
    "task_events": ["task_id", "seq", "event", "data"],
    "idempotency_keys": ["owner", "key", "request_hash", "state", "status_code", "headers", "body",
                         "created_at", "expires_at", "bytes", "instance_id"],
    "instances": ["id", "started_at", "lease_until"],
}


@sqlite_only
def test_sqlite_pragmas(store: SQLiteStore, db_path: Path) -> None:
    conn = sqlite3.connect(db_path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == len(sqlite_module.MIGRATIONS)
    assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental
    conn.close()
    w = store._writer
    assert w.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert w.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL


def test_closed_store_refuses_calls(backend: Backend) -> None:
    s = backend.open()
    s.close()
    s.close()  # twice is fine
    with pytest.raises(StoreError):
        s.get_response("a", "resp_1")
    with pytest.raises(StoreError):
        s.put_response("a", "resp_1", {}, [])


@sqlite_only
def test_memory_store_works(backend: Backend) -> None:
    with SQLiteStore(":memory:") as s:
        s.put_response("a", "resp_1", response_obj("resp_1"), [user_msg("hi")])
        assert s.get_response("a", "resp_1")["id"] == "resp_1"
        assert len(s.list_input_items("a", "resp_1").items) == 1


# --- responses ---------------------------------------------------------------


def test_response_round_trip_and_item_ids(store: Store) -> None:
    resp = response_obj("resp_1", text="héllo ✓")
    stored = store.put_response(
        "alice", "resp_1", resp, [user_msg("a", "msg_given"), user_msg("b")], created_at=123
    )
    assert stored[0]["id"] == "msg_given"
    assert stored[1]["id"].startswith("msg_") and stored[1]["id"] != "msg_given"
    assert store.get_response("alice", "resp_1") == resp
    page = store.list_input_items("alice", "resp_1", order="asc")
    assert page.items == stored and page.has_more is False
    # The caller's dicts are not mutated by id assignment.
    original = [user_msg("c")]
    store.put_response("alice", "resp_2", response_obj("resp_2"), original)
    assert "id" not in original[0]


def test_put_response_duplicate_id(store: Store) -> None:
    store.put_response("alice", "resp_1", response_obj("resp_1"), [])
    with pytest.raises(Duplicate):
        store.put_response("alice", "resp_1", response_obj("resp_1"), [])
    with pytest.raises(Duplicate):
        store.put_response("bob", "resp_1", response_obj("resp_1"), [])
    assert store.get_response("bob", "resp_1") is None


def test_update_and_delete_response(store: Store) -> None:
    store.put_response("alice", "resp_1", {"id": "resp_1", "status": "queued"}, [user_msg("x")])
    assert store.get_response("alice", "resp_1")["status"] == "queued"
    assert store.response_chain("alice", "resp_1")[0].output_items == []
    final = response_obj("resp_1", text="done")
    assert store.update_response("alice", "resp_1", final) is True
    assert store.get_response("alice", "resp_1") == final
    assert store.response_chain("alice", "resp_1")[0].output_items == final["output"]
    assert store.find_item("alice", "msg_out_resp_1") == final["output"][0]
    before = store.stats()
    assert before["response_items"] == 2
    assert store.delete_response("alice", "resp_1") is True
    assert store.delete_response("alice", "resp_1") is False
    assert store.get_response("alice", "resp_1") is None
    after = store.stats()
    assert after["responses"] == 0 and after["response_items"] == 0 and after["response_bytes"] == 0


def test_deleting_a_background_response_deletes_its_task_and_log(store: Store) -> None:
    """Its task (same id) holds the request and the result, its log the
    output: none of it outlives the response. Another task is left alone."""
    store.put_response("alice", "resp_1", {"id": "resp_1", "status": "queued"}, [user_msg("private")])
    store.create_task("alice", "resp_1", {"body": "private"}, status="in_progress", response_id="resp_1")
    store.append_events("resp_1", [(1, "delta", {"text": "secret"})])
    store.set_task_status("alice", "resp_1", "completed", result={"output": "secret"},
                          final_event=(2, "response.completed", {}))
    store.create_task("alice", "task_1", {}, status="in_progress")
    assert store.delete_response("alice", "task_1") is False, "an LMSP task is no response"
    assert store.delete_response("bob", "resp_1") is False
    assert store.get_task("alice", "resp_1") is not None

    assert store.delete_response("alice", "resp_1") is True
    assert store.get_task("alice", "resp_1") is None
    assert store.events_after("alice", "resp_1", 0) is None
    assert store.stats()["events"] == 0
    assert store.get_task("alice", "task_1") is not None


def test_a_task_read_without_its_result_is_the_same_task(store: Store) -> None:
    """Routes that need a task's status or dialect alone (cancel, delete, a
    background stream's resume) and the followers' polls read it without
    its result: a finished OpenAI task's is the whole response, parsed
    holding the interpreter lock."""
    request = {"dialect": "openai", "model": "m", "body": {"input": "x"}}
    store.create_task("alice", "resp_1", request, status="in_progress", response_id="resp_1")
    store.set_task_status("alice", "resp_1", "completed", result={"output": "x" * 1000},
                          final_event=(1, "response.completed", {}))
    whole = store.get_task("alice", "resp_1")
    head = store.get_task("alice", "resp_1", result=False)
    assert whole is not None and head is not None
    assert whole.result == {"output": "x" * 1000} and head.result is None
    assert dataclasses.replace(whole, result=None) == head
    assert store.get_task("bob", "resp_1", result=False) is None


def test_response_owner_isolation(store: Store) -> None:
    store.put_response("alice", "resp_1", response_obj("resp_1"), [user_msg("secret", "msg_in")])
    assert store.get_response("mallory", "resp_1") is None
    assert store.list_input_items("mallory", "resp_1") is None
    assert store.response_chain("mallory", "resp_1") is None
    assert store.find_item("mallory", "msg_in") is None
    assert store.find_item("mallory", "msg_out_resp_1") is None
    assert store.update_response("mallory", "resp_1", {"status": "failed"}) is False
    assert store.delete_response("mallory", "resp_1") is False
    # Nothing changed for the owner.
    assert store.get_response("alice", "resp_1") == response_obj("resp_1")
    assert store.find_item("alice", "msg_in")["id"] == "msg_in"


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_input_items_pagination(store: Store, order: str) -> None:
    items = [user_msg(str(i), f"msg_{i}") for i in range(7)]
    store.put_response("alice", "resp_1", response_obj("resp_1"), items)
    expected = [it["id"] for it in (items if order == "asc" else items[::-1])]

    seen: list[str] = []
    after = None
    flags = []
    while True:
        page = store.list_input_items("alice", "resp_1", after=after, limit=3, order=order)
        seen += [it["id"] for it in page.items]
        flags.append(page.has_more)
        if not page.has_more:
            break
        after = page.items[-1]["id"]
    assert seen == expected
    assert flags == [True, True, False]
    # Cursor at the very end: an empty last page.
    end = store.list_input_items("alice", "resp_1", after=expected[-1], limit=3, order=order)
    assert end.items == [] and end.has_more is False
    # Exactly `limit` left: has_more is false.
    tail = store.list_input_items("alice", "resp_1", after=expected[3], limit=3, order=order)
    assert [it["id"] for it in tail.items] == expected[4:] and tail.has_more is False


def test_input_items_bad_arguments(store: Store) -> None:
    store.put_response("alice", "resp_1", response_obj("resp_1"), [user_msg("x", "msg_x")])
    with pytest.raises(InvalidCursor) as err:
        store.list_input_items("alice", "resp_1", after="msg_nope")
    assert err.value.after == "msg_nope"
    with pytest.raises(ValueError):
        store.list_input_items("alice", "resp_1", limit=0)
    with pytest.raises(ValueError):
        store.list_input_items("alice", "resp_1", order="sideways")  # type: ignore[arg-type]


def test_input_items_duplicate_ids_still_page_forward(store: Store) -> None:
    items = [user_msg("a", "m1"), user_msg("b", "dup"), user_msg("c", "dup"), user_msg("d", "m4")]
    store.put_response("alice", "resp_1", response_obj("resp_1"), items)
    # Resuming after "dup" continues past its furthest occurrence: the twin is
    # skipped, but paging never loops or repeats.
    expected = {"asc": [items[0], items[1], items[3]], "desc": [items[3], items[2], items[0]]}
    for order in ("asc", "desc"):
        out, after = [], None
        for _ in range(10):
            page = store.list_input_items("alice", "resp_1", after=after, limit=1, order=order)
            out += page.items
            if not page.has_more:
                break
            after = page.items[-1]["id"]
        assert out == expected[order]


_page_counter = iter(range(10**9))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.integers(min_value=0, max_value=25),
    limit=st.integers(min_value=1, max_value=30),
    order=st.sampled_from(["asc", "desc"]),
)
def test_pagination_property(store: Store, n: int, limit: int, order: str) -> None:
    rid = f"resp_p{next(_page_counter)}"
    items = [user_msg(str(i), f"msg_{rid}_{i}") for i in range(n)]
    store.put_response("alice", rid, response_obj(rid), items)
    expected = [it["id"] for it in (items if order == "asc" else items[::-1])]
    seen, after = [], None
    while True:
        page = store.list_input_items("alice", rid, after=after, limit=limit, order=order)
        assert len(page.items) <= limit
        seen += [it["id"] for it in page.items]
        if not page.has_more:
            break
        after = page.items[-1]["id"]
    assert seen == expected


# --- previous_response_id chains --------------------------------------------------


def _chain(store: Store, owner: str, n: int, prefix: str = "resp") -> list[str]:
    ids, prev = [], None
    for i in range(n):
        rid = f"{prefix}_{i}"
        store.put_response(
            owner, rid, response_obj(rid, text=f"answer {i}"), [user_msg(f"turn {i}", f"in_{rid}")],
            previous_response_id=prev,
        )
        ids.append(rid)
        prev = rid
    return ids


def test_response_chain_root_first(store: Store) -> None:
    ids = _chain(store, "alice", 3)
    chain = store.response_chain("alice", ids[-1])
    assert [link.input_items[0]["id"] for link in chain] == [f"in_{r}" for r in ids]
    assert [link.output_items[0]["content"][0]["text"] for link in chain] == [
        "answer 0", "answer 1", "answer 2",
    ]
    for inputs, outputs in chain:  # unpacks as (input_items, output_items)
        assert inputs and outputs
    assert len(store.response_chain("alice", ids[0])) == 1
    assert store.response_chain("alice", "resp_missing") is None


def test_response_chain_missing_ancestor(store: Store) -> None:
    ids = _chain(store, "alice", 3)
    store.delete_response("alice", ids[0])
    with pytest.raises(ChainError) as err:
        store.response_chain("alice", ids[2])
    assert err.value.problem == "missing" and err.value.response_id == ids[0]


def test_response_chain_does_not_cross_owners(store: Store) -> None:
    store.put_response("bob", "resp_b", response_obj("resp_b"), [user_msg("bob's secret")])
    store.put_response(
        "alice", "resp_a", response_obj("resp_a"), [user_msg("x")], previous_response_id="resp_b"
    )
    with pytest.raises(ChainError) as err:
        store.response_chain("alice", "resp_a")
    assert err.value.problem == "missing" and err.value.response_id == "resp_b"


def test_response_chain_too_deep(backend: Backend) -> None:
    with backend.open(max_chain_depth=3) as s:
        ids = _chain(s, "alice", 5)
        assert len(s.response_chain("alice", ids[2])) == 3
        with pytest.raises(ChainError) as err:
            s.response_chain("alice", ids[4])
        assert err.value.problem == "too_deep"


def test_response_chain_cycle(store: Store, backend: Backend) -> None:
    ids = _chain(store, "alice", 3)
    # Cannot happen through the API (a parent exists before its child); forge it.
    backend.sql("UPDATE responses SET previous_response_id = ? WHERE id = ?", (ids[2], ids[0]))
    with pytest.raises(ChainError) as err:
        store.response_chain("alice", ids[2])
    assert err.value.problem == "cycle"


def test_fail_interrupted_responses(backend: Backend) -> None:
    with backend.open() as stopped:
        stopped.put_response("alice", "resp_q", {"id": "resp_q", "status": "queued"}, [])
        stopped.put_response("alice", "resp_r", {"id": "resp_r", "status": "in_progress"}, [])
        stopped.put_response("alice", "resp_done", response_obj("resp_done"), [])
    store = backend.open()
    error = {"code": "server_restarted", "message": "lmspd restarted"}
    assert sorted(store.fail_interrupted_responses(error)) == ["resp_q", "resp_r"]
    failed = store.get_response("alice", "resp_r")
    assert failed == {"id": "resp_r", "status": "failed", "error": error}
    assert store.get_response("alice", "resp_done") == response_obj("resp_done")
    assert store.fail_interrupted_responses(error) == []


# --- conversations -----------------------------------------------------------------


def test_conversation_lifecycle(store: Store, clock: FakeClock) -> None:
    conv = store.create_conversation(
        "alice", "conv_1", metadata={"topic": "demo"}, items=[user_msg("hello", "msg_a")]
    )
    assert conv.id == "conv_1" and conv.metadata == {"topic": "demo"}
    assert conv.created_at == clock.now
    with pytest.raises(Duplicate):
        store.create_conversation("alice", "conv_1")
    appended = store.append_conversation_items(
        "alice", "conv_1", [{"type": "message", "role": "assistant", "content": []}, user_msg("b")]
    )
    assert all(it["id"] for it in appended)
    ids = ["msg_a"] + [it["id"] for it in appended]
    assert [it["id"] for it in store.conversation_items("alice", "conv_1")] == ids
    page = store.list_conversation_items("alice", "conv_1", limit=2)  # default order: desc
    assert [it["id"] for it in page.items] == ids[::-1][:2] and page.has_more
    page2 = store.list_conversation_items("alice", "conv_1", after=page.items[-1]["id"], limit=2)
    assert [it["id"] for it in page2.items] == [ids[0]] and not page2.has_more
    assert store.get_conversation_item("alice", "conv_1", "msg_a") == user_msg("hello", "msg_a")
    assert store.find_item("alice", "msg_a") == user_msg("hello", "msg_a")

    clock.advance(5)
    updated = store.update_conversation("alice", "conv_1", {"topic": "changed"})
    assert updated.metadata == {"topic": "changed"} and updated.updated_at == clock.now
    assert store.get_conversation("alice", "conv_1") == updated

    bytes_before = store.stats()["conversation_bytes"]
    assert store.delete_conversation_item("alice", "conv_1", "msg_a") is True
    assert store.delete_conversation_item("alice", "conv_1", "msg_a") is False
    assert store.get_conversation_item("alice", "conv_1", "msg_a") is None
    assert store.stats()["conversation_bytes"] < bytes_before

    assert store.delete_conversation("alice", "conv_1") is True
    assert store.get_conversation("alice", "conv_1") is None
    assert store.stats()["conversation_items"] == 0
    assert store.delete_conversation("alice", "conv_1") is False


def test_conversation_item_ids_stay_unique(store: Store) -> None:
    """Paging resumes after an item id: one id twice in a conversation made
    it skip items. A client's repeated id is refused; a turn's item whose
    id the conversation holds (a reference to one of its items) is kept
    under a new id; another conversation's ids are none of its business."""
    store.create_conversation("bob", "conv_b", items=[user_msg("b", "msg_b")])
    with pytest.raises(DuplicateItem) as err:
        store.create_conversation("alice", "conv_1", items=[user_msg("a", "msg_a"), user_msg("b", "msg_a")])
    assert (err.value.index, err.value.item_id, err.value.repeated) == (1, "msg_a", True)
    assert store.get_conversation("alice", "conv_1") is None, "refused whole"
    store.create_conversation("alice", "conv_1", items=[user_msg("a", "msg_a"), user_msg("b", "msg_b")])
    with pytest.raises(DuplicateItem) as err:
        store.append_conversation_items("alice", "conv_1", [user_msg("c"), user_msg("again", "msg_a")])
    assert (err.value.index, err.value.item_id, err.value.repeated) == (1, "msg_a", False)
    assert len(store.conversation_items("alice", "conv_1")) == 2, "refused whole"

    store.put_response("alice", "resp_1", {"id": "resp_1", "status": "in_progress"}, [user_msg("a", "msg_a")],
                       conversation_id="conv_1")
    turn = [user_msg("a", "msg_a"), user_msg("a", "msg_a"), response_obj("resp_1")["output"][0]]
    for _ in range(2):  # the second: a retry after a commit that landed
        assert store.end_turn("alice", "resp_1", response_obj("resp_1"), [user_msg("a", "msg_a")], new=False,
                              conversation_id="conv_1", conversation_items=turn) is True
    items = store.conversation_items("alice", "conv_1")
    ids = [i["id"] for i in items]
    assert len(ids) == len(set(ids)) == 5
    assert ids[:2] == ["msg_a", "msg_b"] and ids[2].startswith("msg_") and ids[4] == "msg_out_resp_1"
    assert [i["content"] for i in items[2:4]] == [user_msg("a")["content"]] * 2
    # The response's own input keeps the id it was sent with.
    assert [i["id"] for i in store.list_input_items("alice", "resp_1").items] == ["msg_a"]
    # A turn that ends with such an item (no output): not mistaken for one that landed already.
    store.put_response("alice", "resp_2", {"id": "resp_2", "status": "incomplete"}, [user_msg("b", "msg_b")],
                       conversation_id="conv_1")
    assert store.end_turn("alice", "resp_2", None, [user_msg("b", "msg_b")], new=False, conversation_id="conv_1",
                          conversation_items=[{**user_msg("b"), "id": "msg_b", "status": "completed"}]) is True
    ids = [i["id"] for i in store.conversation_items("alice", "conv_1")]
    assert len(ids) == len(set(ids)) == 6
    paged, after = [], None
    while True:
        page = store.list_conversation_items("alice", "conv_1", after=after, limit=1, order="asc")
        paged += [i["id"] for i in page.items]
        if not page.has_more:
            break
        after = page.items[-1]["id"]
    assert paged == ids


def test_conversation_owner_isolation(store: Store) -> None:
    store.create_conversation("alice", "conv_1", items=[user_msg("secret", "msg_s")])
    assert store.get_conversation("mallory", "conv_1") is None
    assert store.list_conversation_items("mallory", "conv_1") is None
    assert store.conversation_items("mallory", "conv_1") is None
    assert store.get_conversation_item("mallory", "conv_1", "msg_s") is None
    assert store.find_item("mallory", "msg_s") is None
    assert store.append_conversation_items("mallory", "conv_1", [user_msg("x")]) is None
    assert store.update_conversation("mallory", "conv_1", {"x": "y"}) is None
    assert store.delete_conversation_item("mallory", "conv_1", "msg_s") is False
    assert store.delete_conversation("mallory", "conv_1") is False
    assert store.conversation_items("alice", "conv_1") == [user_msg("secret", "msg_s")]
    assert store.get_conversation("alice", "conv_1").metadata == {}


# --- ids no store can hold -------------------------------------------------------------------


def test_an_id_holding_a_nul_names_nothing(store: Store) -> None:
    """PostgreSQL's text holds no NUL (psycopg refused the statement: a
    500); SQLite's does. Both answer a lookup by such an id, from a path or
    a body, as they answer an unknown id."""
    store.put_response("alice", "resp_1", response_obj("resp_1"), [user_msg("x", "msg_x")])
    store.create_conversation("alice", "conv_1", items=[user_msg("y", "msg_y")])
    store.create_task("alice", "task_1", {}, status="in_progress")
    for nul in ("resp_\x00", "conv_1\x00", "\x00"):
        assert store.get_response("alice", nul) is None
        assert store.delete_response("alice", nul) is False
        assert store.list_input_items("alice", nul) is None
        assert store.response_chain("alice", nul) is None
        with store.response_chain_pages("alice", nul) as chain:
            assert chain is None
        assert store.find_item("alice", nul) is None
        assert store.get_conversation("alice", nul) is None
        assert store.update_conversation("alice", nul, {}) is None
        assert store.delete_conversation("alice", nul) is False
        assert store.append_conversation_items("alice", nul, [user_msg("z")]) is None
        assert store.list_conversation_items("alice", nul) is None
        assert store.conversation_items("alice", nul) is None
        with store.conversation_item_pages("alice", nul) as pages:
            assert pages is None
        assert store.get_conversation_item("alice", nul, "msg_y") is None
        assert store.get_conversation_item("alice", "conv_1", nul) is None
        assert store.delete_conversation_item("alice", nul, "msg_y") is False
        assert store.delete_conversation_item("alice", "conv_1", nul) is False
        assert store.get_task("alice", nul) is None
        assert store.get_task_request("alice", nul) is None
        assert store.events_after("alice", nul, 0) is None
        assert store.first_retained_seq("alice", nul) is None
        assert store.request_cancel("alice", nul) is False
        # A cursor that names no item of the list.
        with pytest.raises(InvalidCursor):
            store.list_input_items("alice", "resp_1", after=nul)
        with pytest.raises(InvalidCursor):
            store.list_conversation_items("alice", "conv_1", after=nul)
    assert store.get_response("alice", "resp_1") == response_obj("resp_1")
    assert store.conversation_items("alice", "conv_1") == [user_msg("y", "msg_y")]


def test_a_client_item_id_holding_a_nul_is_replaced(store: Store) -> None:
    """A client's item id that PostgreSQL cannot hold gets a new one, as a
    missing id does (the response was generated: refusing it at the store
    loses it); a NUL inside stored JSON is JSON's ``\\u0000`` and stays."""
    text = "a\x00b"
    stored = store.put_response("alice", "resp_1", response_obj("resp_1", text=text), [user_msg(text, "msg_\x00")])
    assert stored[0]["id"].startswith("msg_") and "\x00" not in stored[0]["id"]
    assert store.list_input_items("alice", "resp_1").items == stored
    assert store.get_response("alice", "resp_1") == response_obj("resp_1", text=text)
    record = store.create_conversation("alice", "conv_1", metadata={"k\x00": "v\x00"},
                                       items=[user_msg(text, "\x00")])
    assert record.metadata == {"k\x00": "v\x00"}
    (added,) = store.append_conversation_items("alice", "conv_1", [user_msg(text, "m\x00")])
    items = store.conversation_items("alice", "conv_1")
    assert [i["content"] for i in items] == [user_msg(text)["content"]] * 2 and items[1] == added
    assert all(i["id"].startswith("msg_") and "\x00" not in i["id"] for i in items)
    assert store.get_conversation_item("alice", "conv_1", added["id"]) == added


# --- a request's history, read in pages (lmspd.history) ----------------------------------


def _sized(n: int, tag: str) -> dict:
    return {"type": "message", "role": "user", "content": tag + "x" * n}


def _check_pages(pages: list, page_bytes: int) -> None:
    """Each page holds at most ``page_bytes`` of stored JSON, or one item."""
    for p in pages:
        assert p.items, p
        assert len(p.items) == 1 or sum(len(json.dumps(i, separators=(",", ":")).encode()) for i in p.items) \
            <= page_bytes, [len(json.dumps(i)) for i in p.items]


def test_conversation_item_pages_are_the_items_in_bounded_pages(store: Store) -> None:
    sizes = [10, 3000, 500, 500, 500, 9000, 0, 200, 200, 200, 200, 4000, 1]
    store.create_conversation("alice", "conv_1", items=[_sized(n, f"m{i}") for i, n in enumerate(sizes)])
    store.delete_conversation_item("alice", "conv_1", store.conversation_items("alice", "conv_1")[2]["id"])
    whole = store.conversation_items("alice", "conv_1")
    for page_bytes in (1, 1000, 2500, 10**9):
        with store.conversation_item_pages("alice", "conv_1", page_bytes=page_bytes) as pages:
            read = list(pages)
        assert [i for p in read for i in p.items] == whole
        # ``start``: each page's place in the list; a conversation is one list.
        assert [p.start for p in read] == list(itertools.accumulate([0] + [len(p.items) for p in read[:-1]]))
        assert {(p.link, p.kind) for p in read} == {(0, "input")}
        _check_pages(read, page_bytes)
    assert len(read) == 1
    with store.conversation_item_pages("mallory", "conv_1") as pages:
        assert pages is None
    with store.conversation_item_pages("alice", "conv_missing") as pages:
        assert pages is None
    store.create_conversation("alice", "conv_empty")
    with store.conversation_item_pages("alice", "conv_empty") as pages:
        assert list(pages) == []


def test_conversation_item_pages_read_one_snapshot(store: Store) -> None:
    """Items appended or deleted while the pages are read change none of
    them, not even the pages still to come: what a request expands is the
    conversation as it was when the reading began."""
    store.create_conversation("alice", "conv_1", items=[_sized(100, f"m{i}") for i in range(6)])
    before = store.conversation_items("alice", "conv_1")

    def meanwhile() -> None:
        store.append_conversation_items("alice", "conv_1", [_sized(10, "late"), _sized(10, "later")])
        store.delete_conversation_item("alice", "conv_1", before[4]["id"])

    with store.conversation_item_pages("alice", "conv_1", page_bytes=1) as pages:
        first = next(pages)
        done = threading.Thread(target=meanwhile)
        done.start()
        done.join(30)
        rest = list(pages)
    assert [i for p in [first, *rest] for i in p.items] == before
    assert len(store.conversation_items("alice", "conv_1")) == len(before) + 1


def test_response_chain_pages_are_the_chain_in_bounded_pages(store: Store) -> None:
    prev = None
    for i, (n_in, n_out) in enumerate([(10, 10), (5000, 10), (10, 7000), (300, 300), (0, 0), (2000, 2000)]):
        rid = f"resp_{i}"
        response = response_obj(rid, text="o" * n_out)
        response["output"].append({"id": f"msg_out2_{rid}", "type": "message", "role": "assistant",
                                   "content": [{"type": "output_text", "text": "p" * n_out}]})
        store.put_response("alice", rid, response, [_sized(n_in, "a"), _sized(n_in, "b"), _sized(1, "c")],
                           previous_response_id=prev)
        prev = rid
    store.put_response("alice", "resp_bare", {"id": "resp_bare", "status": "queued"}, [],
                       previous_response_id=prev)
    chain = store.response_chain("alice", "resp_bare")
    for page_bytes in (1, 1000, 3000, 10**9):
        with store.response_chain_pages("alice", "resp_bare", page_bytes=page_bytes) as read:
            assert read.links == len(chain) and read.status == "queued"
            pages = list(read.pages)
        _check_pages(pages, page_bytes)
        rebuilt = [([], []) for _ in chain]
        for p in pages:
            items = rebuilt[p.link][0 if p.kind == "input" else 1]
            assert p.start == len(items)
            items += p.items
        assert [tuple(link) for link in chain] == rebuilt
        # Root first, each response's input then output.
        assert [(p.link, p.kind) for p in pages] == sorted((p.link, p.kind) for p in pages)
    with store.response_chain_pages("alice", "resp_missing") as read:
        assert read is None
    with store.response_chain_pages("mallory", "resp_bare") as read:
        assert read is None
    store.delete_response("alice", "resp_2")
    with pytest.raises(ChainError) as err, store.response_chain_pages("alice", "resp_bare"):
        pass
    assert err.value.problem == "missing" and err.value.response_id == "resp_2"


def test_response_chain_pages_read_one_snapshot(store: Store) -> None:
    ids = _chain(store, "alice", 4)
    chain = store.response_chain("alice", ids[-1])
    with store.response_chain_pages("alice", ids[-1], page_bytes=1) as read:
        first = next(read.pages)
        # Another instance's retention, between two pages.
        gone = threading.Thread(target=store.delete_response, args=("alice", ids[2]))
        gone.start()
        gone.join(30)
        rest = list(read.pages)
    assert [i for p in [first, *rest] for i in p.items] == [i for link in chain for part in link for i in part]


# --- tasks and event logs ---------------------------------------------------------------


def test_task_round_trip_and_events(store: Store) -> None:
    task = store.create_task("alice", "task_1", {"model": "m", "input": "hi"}, response_id="resp_t")
    assert isinstance(task, TaskRecord)
    assert (task.status, task.last_seq, task.first_retained_seq) == ("queued", 0, 1)
    assert not task.terminal
    assert store.set_task_status("alice", "task_1", "in_progress") is True
    store.append_event("task_1", 1, "response.created", {"response_id": "resp_t"})
    store.append_events("task_1", [(2, "response.output_text.delta", {"delta": "a"}),
                                   (3, "response.output_text.delta", {"delta": "b"})])
    events = store.events_after("alice", "task_1", 0)
    assert [(e.seq, e.event) for e in events] == [
        (1, "response.created"),
        (2, "response.output_text.delta"),
        (3, "response.output_text.delta"),
    ]
    assert events[1].data == {"delta": "a"}
    assert [e.seq for e in store.events_after("alice", "task_1", 1)] == [2, 3]
    assert [e.seq for e in store.events_after("alice", "task_1", 1, limit=1)] == [2]
    assert store.events_after("alice", "task_1", 3) == []

    result = {"id": "resp_t", "status": "completed"}
    assert store.set_task_status(
        "alice", "task_1", "completed", result=result,
        final_event=(4, "response.completed", {"response_id": "resp_t", "status": "completed"}),
    ) is True
    done = store.get_task("alice", "task_1")
    assert done.status == "completed" and done.result == result and done.last_seq == 4
    assert done.finished_at is not None and done.terminal
    assert done.request == {"model": "m"} and done.response_id == "resp_t"
    assert store.get_task_request("alice", "task_1") == {"model": "m", "input": "hi"}
    # First terminal write wins; a late cancel changes nothing.
    assert store.set_task_status("alice", "task_1", "cancelled") is False
    assert store.get_task("alice", "task_1").status == "completed"
    with pytest.raises(TaskFinished):
        store.append_event("task_1", 5, "response.output_text.delta", {})


def test_reading_a_task_leaves_its_request_unparsed(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A poll of a task (its state, its result) parsed its whole request:
    megabytes of tools, holding the interpreter lock each time. Its
    dialect and model are kept beside it; the rest is read on demand."""
    tools = [{"type": "function", "name": f"f{i}", "parameters": {"p": "x" * 1000}} for i in range(1000)]
    request = {"dialect": "lmsp", "model": "m", "body": {"input": "hi", "tools": tools}}
    parsed: list[int] = []
    loads = json.loads

    def counting(text: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(len(text))
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counting)
    created = store.create_task("alice", "task_1", request, status="in_progress", response_id="resp_1")
    store.append_event("task_1", 1, "response.created", {})
    store.set_task_status("alice", "task_1", "completed", result={"id": "resp_1", "status": "completed"},
                          final_event=(2, "response.completed", {}))
    assert store.request_cancel("alice", "task_1") is False
    done = store.get_task("alice", "task_1")
    assert max(parsed) < 1000, "only small values were parsed"
    assert created.request == done.request == {"dialect": "lmsp", "model": "m"}
    assert done.result == {"id": "resp_1", "status": "completed"} and done.last_seq == 2
    assert store.get_task_request("alice", "task_1") == request
    assert max(parsed) > 1_000_000


def test_task_duplicate_and_invalid_status(store: Store) -> None:
    store.create_task("alice", "task_1", {})
    with pytest.raises(Duplicate):
        store.create_task("alice", "task_1", {})
    with pytest.raises(ValueError):
        store.create_task("alice", "task_2", {}, status="completed")
    with pytest.raises(ValueError):
        store.set_task_status("alice", "task_1", "exploded")


def test_event_seq_strictly_increasing(store: Store) -> None:
    store.create_task("alice", "task_1", {}, status="in_progress")
    with pytest.raises(SequenceError):
        store.append_event("task_1", 0, "x", {})
    store.append_event("task_1", 1, "x", {})
    for bad in (1, 0, -3, True, 1.5):
        with pytest.raises(SequenceError):
            store.append_event("task_1", bad, "x", {})  # type: ignore[arg-type]
    # A batch is all-or-nothing.
    with pytest.raises(SequenceError):
        store.append_events("task_1", [(2, "x", {}), (3, "x", {}), (3, "x", {})])
    assert store.get_task("alice", "task_1").last_seq == 1
    store.append_event("task_1", 5, "x", {})  # strictly increasing, gaps allowed
    assert [e.seq for e in store.events_after("alice", "task_1")] == [1, 5]
    with pytest.raises(NotFound):
        store.append_event("task_nope", 1, "x", {})
    # A bad final event rolls the status change back.
    with pytest.raises(SequenceError):
        store.set_task_status(
            "alice", "task_1", "completed", final_event=(5, "response.completed", {})
        )
    assert store.get_task("alice", "task_1").status == "in_progress"
    with pytest.raises(ValueError):
        store.events_after("alice", "task_1", -1)


def test_task_owner_isolation(store: Store) -> None:
    store.create_task("alice", "task_1", {"secret": True}, status="in_progress")
    store.append_event("task_1", 1, "response.created", {})
    assert store.get_task("mallory", "task_1") is None
    assert store.events_after("mallory", "task_1", 0) is None
    assert store.first_retained_seq("mallory", "task_1") is None
    assert store.set_task_status("mallory", "task_1", "cancelled",
                                 final_event=(2, "response.cancelled", {})) is False
    task = store.get_task("alice", "task_1")
    assert task.status == "in_progress" and task.last_seq == 1


def test_event_log_retention_gives_410_but_keeps_result(backend: Backend, clock: FakeClock) -> None:
    retention = Retention(event_ttl_s=60, task_ttl_s=3600)
    with backend.open(clock=clock, retention=retention) as s:
        s.create_task("alice", "task_1", {}, status="in_progress")
        s.append_events("task_1", [(i, "delta", {"i": i}) for i in range(1, 6)])
        s.set_task_status("alice", "task_1", "completed", result={"ok": True},
                          final_event=(6, "response.completed", {}))
        clock.advance(59)
        assert s.prune()["event_logs"] == 0
        assert s.first_retained_seq("alice", "task_1") == 1
        assert len(s.events_after("alice", "task_1", 0)) == 6

        clock.advance(2)
        assert s.prune()["event_logs"] == 1
        assert s.first_retained_seq("alice", "task_1") == 7
        with pytest.raises(EventsExpired) as err:
            s.events_after("alice", "task_1", 3)
        assert err.value.first_retained_seq == 7 and err.value.after_seq == 3
        assert err.value.last_seq == 6 and err.value.first_kept is None  # the whole log went
        # A reader that already saw everything is told "nothing more", not 410.
        assert s.events_after("alice", "task_1", 6) == []
        task = s.get_task("alice", "task_1")
        assert task.result == {"ok": True} and task.first_retained_seq == 7
        assert s.stats()["events"] == 0 and s.stats()["event_bytes"] == 0

        clock.advance(3600)
        assert s.prune()["tasks"] == 1
        assert s.get_task("alice", "task_1") is None


def test_running_tasks_and_responses_are_never_pruned(backend: Backend, clock: FakeClock) -> None:
    tiny = Retention(response_ttl_s=1, task_ttl_s=1, event_ttl_s=1, max_response_bytes=0,
                     max_task_bytes=0, max_event_bytes=0)
    with backend.open(clock=clock, retention=tiny) as s:
        s.create_task("alice", "task_run", {"big": "x" * 1000}, status="in_progress")
        s.append_events("task_run", [(i, "delta", {"d": "y" * 100}) for i in range(1, 20)])
        s.create_task("alice", "task_q", {})
        s.put_response(
            "alice", "resp_bg", {"id": "resp_bg", "status": "in_progress"}, [user_msg("x")]
        )
        s.put_response("alice", "resp_done", response_obj("resp_done"), [])
        clock.advance(10**6)
        removed = s.prune()
        assert removed["tasks"] == 0 and removed["event_logs"] == 0 and removed["responses"] == 1
        assert s.get_task("alice", "task_run").last_seq == 19
        assert len(s.events_after("alice", "task_run", 0)) == 19
        assert s.get_task("alice", "task_q") is not None
        assert s.get_response("alice", "resp_bg") is not None
        assert s.get_response("alice", "resp_done") is None


def test_prune_by_age(backend: Backend, clock: FakeClock) -> None:
    retention = Retention(response_ttl_s=100, conversation_ttl_s=100)
    with backend.open(clock=clock, retention=retention) as s:
        s.put_response("alice", "resp_old", response_obj("resp_old"), [user_msg("x")])
        s.create_conversation("alice", "conv_old")
        s.create_conversation("alice", "conv_used")
        clock.advance(60)
        s.put_response("alice", "resp_new", response_obj("resp_new"), [user_msg("y")])
        s.append_conversation_items("alice", "conv_used", [user_msg("still here")])
        clock.advance(41)
        removed = s.prune()
        assert removed["responses"] == 1 and removed["conversations"] == 1
        assert s.get_response("alice", "resp_old") is None
        assert s.get_response("alice", "resp_new") is not None
        assert s.get_conversation("alice", "conv_old") is None
        assert s.get_conversation("alice", "conv_used") is not None  # ages from its last change
        assert s.stats()["response_items"] == 2  # resp_old's items went with it
        assert s.prune(now=clock.now + 1000)["responses"] == 1


def test_prune_by_bytes_oldest_first(backend: Backend, clock: FakeClock) -> None:
    with backend.open(clock=clock) as probe:
        probe.put_response("a", "resp_probe", response_obj("resp_probe"), [user_msg("z" * 1000)])
        one = probe.stats()["response_bytes"]
        probe.delete_response("a", "resp_probe")
    budget = int(one * 3.5)
    with backend.open(clock=clock, retention=Retention(max_response_bytes=budget)) as s:
        for i in range(10):
            rid = f"resp_{i:03d}"
            s.put_response("a", rid, response_obj(rid), [user_msg("z" * 1000)])
            clock.advance(1)
        assert s.stats()["response_bytes"] > budget
        assert s.prune()["responses"] == 7
        assert s.stats()["response_bytes"] <= budget
        kept = [i for i in range(10) if s.get_response("a", f"resp_{i:03d}")]
        assert kept == [7, 8, 9]


def test_prune_event_and_task_budgets(backend: Backend, clock: FakeClock) -> None:
    retention = Retention(max_event_bytes=3000, max_task_bytes=2500)
    with backend.open(clock=clock, retention=retention) as s:
        for i in range(4):
            tid = f"task_{i}"
            s.create_task("a", tid, {"pad": "r" * 500}, status="in_progress")
            s.append_events(tid, [(n, "delta", {"d": "e" * 90}) for n in range(1, 11)])
            s.set_task_status("a", tid, "completed", result={"pad": "s" * 200})
            clock.advance(1)
        s.create_task("a", "task_live", {}, status="in_progress")
        s.append_events("task_live", [(n, "delta", {"d": "e" * 90}) for n in range(1, 11)])
        before = s.stats()
        assert before["event_bytes"] > 3000 and before["task_bytes"] > 2500
        removed = s.prune()
        after = s.stats()
        assert after["event_bytes"] <= 3000 and after["task_bytes"] <= 2500
        assert removed["event_logs"] >= 1 and removed["tasks"] >= 1
        # Oldest went first; the live task kept its whole log.
        assert s.get_task("a", "task_0") is None
        assert s.get_task("a", "task_3") is not None
        assert len(s.events_after("a", "task_live", 0)) == 10
        # Any finished task whose log was dropped answers 410, never a partial log.
        for i in range(4):
            t = s.get_task("a", f"task_{i}")
            if t is not None and t.first_retained_seq > 1:
                with pytest.raises(EventsExpired):
                    s.events_after("a", t.id, 0)


def test_prune_conversation_budget(backend: Backend, clock: FakeClock) -> None:
    with backend.open(clock=clock, retention=Retention(max_conversation_bytes=2500)) as s:
        for i in range(5):
            s.create_conversation("a", f"conv_{i}", items=[user_msg("c" * 900)])
            clock.advance(1)
        s.prune()
        assert s.stats()["conversation_bytes"] <= 2500
        assert [i for i in range(5) if s.get_conversation("a", f"conv_{i}")] == [3, 4]


@sqlite_only
def test_prune_returns_space_to_the_file(backend: Backend, clock: FakeClock) -> None:
    with backend.open(clock=clock, retention=Retention(response_ttl_s=10)) as s:
        for i in range(50):
            s.put_response("a", f"resp_{i}", response_obj(f"resp_{i}"), [user_msg("q" * 4000)])
        clock.advance(11)
        assert s.prune()["responses"] == 50
        assert s._writer.execute("PRAGMA freelist_count").fetchone()[0] == 0


@pytest.mark.parametrize(("usage", "budget", "share"), [
    ({"a": 10, "b": 20}, 30, None),  # everything fits
    ({"a": 100, "b": 900}, 600, 500),  # a is under an even split: b gets what a leaves
    ({"a": 400, "b": 900}, 600, 300),  # both over: an even split
    ({"a": 1, "b": 2, "c": 1000}, 10, 7),
    ({"a": 5}, 3, 3),
])
def test_fair_share(usage: dict[str, int], budget: int, share: int | None) -> None:
    assert pruning.fair_share(usage, budget) == share
    if share is not None:
        assert sum(min(used, share) for used in usage.values()) <= budget
        assert share >= budget // len(usage)


def owner_bytes(backend: Backend, table: str, column: str = "bytes") -> dict[str, int]:
    return {owner: int(n) for owner, n in backend.sql(f"SELECT owner, SUM({column}) FROM {table} GROUP BY owner")}


def test_one_owners_writes_cannot_prune_anothers(backend: Backend, clock: FakeClock) -> None:
    """Every byte budget is shared fairly between owners: a credential that
    floods one kind loses its own oldest records, never those of a
    credential within its share, however much older they are."""
    budget = 20_000
    retention = Retention(max_response_bytes=budget, max_conversation_bytes=budget, max_task_bytes=budget,
                          max_event_bytes=budget, max_idempotency_bytes=budget)

    def write(s: Store, owner: str, i: int) -> None:
        s.put_response(owner, f"resp_{owner}_{i}", response_obj(f"resp_{owner}_{i}"), [user_msg("r" * 1000)])
        s.create_conversation(owner, f"conv_{owner}_{i}", items=[user_msg("c" * 1000)])
        tid = f"task_{owner}_{i}"
        s.create_task(owner, tid, {"pad": "t" * 1000}, status="in_progress")
        s.append_events(tid, [(n, "delta", {"d": "e" * 100}) for n in range(1, 11)])
        s.set_task_status(owner, tid, "completed", result={"ok": True})
        s.idempotency_begin(owner, f"key_{i}", "h")
        assert s.idempotency_finish(owner, f"key_{i}", 200, b"i" * 1000, {})
        clock.advance(1)

    with backend.open(clock=clock, retention=retention) as s:
        for i in range(3):  # alice's, the oldest of all: ~3 KB of each kind, well within half the budget
            write(s, "alice", i)
        for i in range(60):  # mallory's: three times the whole budget of each kind
            write(s, "mallory", i)
        removed = s.prune()
        for i in range(3):
            assert s.get_conversation("alice", f"conv_alice_{i}") is not None
            assert s.get_response("alice", f"resp_alice_{i}") is not None
            assert len(s.events_after("alice", f"task_alice_{i}", 0)) == 10
            assert s.idempotency_begin("alice", f"key_{i}", "h").outcome is BeginOutcome.REPLAY
        assert all(removed[kind] > 0 for kind in ("responses", "conversations", "event_logs", "tasks",
                                                   "idempotency_keys")), removed
        # Mallory lost its oldest, kept its newest, and everything fits again.
        assert s.get_conversation("mallory", "conv_mallory_0") is None
        assert s.get_conversation("mallory", "conv_mallory_59") is not None
        assert s.idempotency_begin("mallory", "key_59", "h").outcome is BeginOutcome.REPLAY
        for table, column in (("responses", "bytes"), ("conversations", "bytes"), ("tasks", "bytes"),
                              ("tasks", "events_bytes"), ("idempotency_keys", "bytes")):
            held = owner_bytes(backend, table, column)
            assert sum(held.values()) <= budget, (table, column, held)
            assert held["mallory"] > budget // 2, (table, column, held)  # what alice leaves is mallory's


def test_idempotency_replies_have_a_byte_budget(backend: Backend, clock: FakeClock) -> None:
    with backend.open(clock=clock, retention=Retention(max_idempotency_bytes=5_000)) as s:
        for i in range(10):
            s.idempotency_begin("a", f"key_{i}", "h")
            assert s.idempotency_finish("a", f"key_{i}", 200, b"x" * 1000, {})
            clock.advance(1)
        s.idempotency_begin("a", "running", "h")  # in progress: guards a run, never pruned
        assert s.stats()["idempotency_bytes"] > 10_000
        assert s.prune()["idempotency_keys"] == 6
        assert s.stats()["idempotency_bytes"] <= 5_000
        kept = [i for i in range(10) if s.idempotency_begin("a", f"key_{i}", "h").outcome is BeginOutcome.REPLAY]
        assert kept == [6, 7, 8, 9]
        assert s.idempotency_begin("a", "running", "h").outcome is BeginOutcome.IN_PROGRESS


# --- idempotency -------------------------------------------------------------------------


def test_idempotency_states(store: Store) -> None:
    assert store.idempotency_begin("alice", "key1", "h1").outcome is BeginOutcome.NEW
    assert store.idempotency_begin("alice", "key1", "h1").outcome is BeginOutcome.IN_PROGRESS
    assert store.idempotency_begin("alice", "key1", "h2").outcome is BeginOutcome.CONFLICT
    # Keys are per credential.
    assert store.idempotency_begin("bob", "key1", "h2").outcome is BeginOutcome.NEW
    assert store.idempotency_finish("mallory", "key1", 200, b"x", {}) is False

    body = b'{"id":"resp_1","status":"completed"}'
    headers = {"content-type": "application/json"}
    assert store.idempotency_finish("alice", "key1", 200, body, headers)
    assert store.idempotency_finish("alice", "key1", 500, b"again", {}) is False  # only once
    replay = store.idempotency_begin("alice", "key1", "h1")
    assert replay.outcome is BeginOutcome.REPLAY
    assert (replay.status_code, replay.body, replay.headers) == (
        200, body, {"content-type": "application/json"},
    )
    assert store.idempotency_begin("alice", "key1", "h2").outcome is BeginOutcome.CONFLICT
    # A finished key cannot be abandoned (that would allow a second run).
    assert store.idempotency_abandon("alice", "key1") is False
    assert store.idempotency_begin("alice", "key1", "h1").outcome is BeginOutcome.REPLAY


def test_idempotency_abandon_allows_retry(store: Store) -> None:
    assert store.idempotency_begin("alice", "k", "h").outcome is BeginOutcome.NEW
    assert store.idempotency_abandon("mallory", "k") is False
    assert store.idempotency_abandon("alice", "k") is True
    assert store.idempotency_abandon("alice", "k") is False
    assert store.idempotency_begin("alice", "k", "other").outcome is BeginOutcome.NEW


def test_idempotency_expiry(backend: Backend, clock: FakeClock) -> None:
    with backend.open(clock=clock, retention=Retention(idempotency_ttl_s=100)) as s:
        s.idempotency_begin("a", "done", "h")
        s.idempotency_finish("a", "done", 201, b"body", {})
        s.idempotency_begin("a", "stuck", "h")
        clock.advance(99)
        assert s.idempotency_begin("a", "done", "h").outcome is BeginOutcome.REPLAY
        assert s.idempotency_finish("a", "stuck", 200, b"", {}) is True
        s.idempotency_begin("a", "late", "h")
        clock.advance(2)
        assert s.idempotency_finish("a", "late", 200, b"", {}) is True  # 2 s old
        # Expired: a fresh run with any body.
        assert s.idempotency_begin("a", "done", "other").outcome is BeginOutcome.NEW
        assert s.prune()["idempotency_keys"] == 1  # "stuck"; "done" was renewed by begin
        clock.advance(200)
        assert s.idempotency_finish("a", "done", 200, b"", {}) is False  # expired meanwhile
        assert s.prune()["idempotency_keys"] == 2
        assert s.stats()["idempotency_keys"] == 0


def test_idempotency_begin_race_single_store(store: Store) -> None:
    n = 16
    barrier = threading.Barrier(n)
    outcomes: list[BeginOutcome] = []
    lock = threading.Lock()

    def worker() -> None:
        barrier.wait()
        out = store.idempotency_begin("alice", "race", "h").outcome
        with lock:
            outcomes.append(out)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count(BeginOutcome.NEW) == 1
    assert outcomes.count(BeginOutcome.IN_PROGRESS) == n - 1


def test_idempotency_begin_race_two_connections(backend: Backend) -> None:
    # Two store objects = two writer connections (as two processes would have):
    # SQLite's own write lock must still let exactly one insert win.
    stores = [backend.open(), backend.open()]
    try:
        n = 16
        barrier = threading.Barrier(n)
        outcomes: list[BeginOutcome] = []
        lock = threading.Lock()

        def worker(i: int) -> None:
            barrier.wait()
            out = stores[i % 2].idempotency_begin("alice", "race", "h").outcome
            with lock:
                outcomes.append(out)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert outcomes.count(BeginOutcome.NEW) == 1
        assert outcomes.count(BeginOutcome.IN_PROGRESS) == n - 1
    finally:
        for s in stores:
            s.close()


def test_concurrent_writers_and_readers(store: Store) -> None:
    tasks = [f"task_{i}" for i in range(4)]
    for tid in tasks:
        store.create_task("a", tid, {}, status="in_progress")
    errors: list[BaseException] = []

    def writer(tid: str) -> None:
        try:
            for seq in range(1, 101):
                store.append_event(tid, seq, "delta", {"seq": seq})
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(200):
                for tid in tasks:
                    seqs = [e.seq for e in store.events_after("a", tid, 0)]
                    assert seqs == list(range(1, len(seqs) + 1))  # never a gap mid-read
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in tasks]
    threads += [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(store.get_task("a", t).last_seq == 100 for t in tasks)


# --- crash recovery ---------------------------------------------------------------------

_CRASHING_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, sys.argv[2])
    from lmspd.store import open_store, pruning

    # A short lease: on a shared store, the survivor may take over soon.
    s = open_store(sys.argv[1], lease_s=0.3)
    s.create_task("alice", "task_done", {"n": 1}, status="in_progress", response_id="resp_done")
    s.append_events("task_done", [(1, "response.created", {}), (2, "delta", {"d": "x"})])
    s.set_task_status("alice", "task_done", "completed", result={"id": "resp_done"},
                      final_event=(3, "response.completed", {"response_id": "resp_done"}))
    s.put_response("alice", "resp_done", {"id": "resp_done", "status": "completed"}, [])
    s.create_task("alice", "task_run", {"n": 2}, status="in_progress", response_id="resp_run")
    s.append_events("task_run", [(1, "response.created", {}), (2, "delta", {"d": "a"}),
                                 (3, "delta", {"d": "b"})])
    s.put_response("alice", "resp_run", {"id": "resp_run", "status": "in_progress"}, [])
    s.create_task("bob", "task_queued", {"n": 3})
    s.idempotency_begin("alice", "key_run", "h")
    s.idempotency_begin("alice", "key_done", "h")
    s.idempotency_finish("alice", "key_done", 200, b"{}", {})
    print("ready", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no checkpoint
    """
)


def test_crash_recovery_after_kill_9(backend: Backend) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHING_CHILD, backend.target, str(REPO_ROOT)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.strip() == "ready"
    if backend.name == "sqlite":
        assert Path(backend.target + "-wal").exists()  # the committed data lives in the WAL
    else:
        time.sleep(0.5)  # the dead instance's lease runs out

    with backend.open() as s:
        assert backend.integrity() == "ok"
        failed = s.fail_interrupted_tasks("lmspd restarted while the task ran")
        assert sorted(t.id for t in failed) == ["task_queued", "task_run"]
        run = s.get_task("alice", "task_run")
        assert run.status == "failed" and run.finished_at is not None
        assert run.error == {
            "code": "server_restarted", "message": "lmspd restarted while the task ran"
        }
        events = s.events_after("alice", "task_run", 0)
        assert [e.seq for e in events] == [1, 2, 3, 4]
        assert events[-1].event == "response.failed"
        assert events[-1].data == {
            "response_id": "resp_run", "status": "failed", "error": run.error
        }
        queued = s.get_task("bob", "task_queued")
        assert queued.status == "failed" and queued.last_seq == 1
        assert s.events_after("bob", "task_queued", 0)[0].data["response_id"] == "task_queued"

        done = s.get_task("alice", "task_done")
        assert done.status == "completed" and done.result == {"id": "resp_done"}
        done_events = s.events_after("alice", "task_done", 0)
        assert done_events[-1].event == "response.completed"
        assert s.get_response("alice", "resp_done") == {"id": "resp_done", "status": "completed"}

        assert s.fail_interrupted_responses({"code": "server_restarted"}) == ["resp_run"]
        assert s.abandon_interrupted_idempotency() == 1
        assert s.idempotency_begin("alice", "key_run", "h").outcome is BeginOutcome.NEW
        assert s.idempotency_begin("alice", "key_done", "h").outcome is BeginOutcome.REPLAY
        # Recovery is idempotent.
        assert s.fail_interrupted_tasks("again") == []
    assert backend.integrity() == "ok"


def test_recovery_after_close_without_finishing_custom_event(backend: Backend) -> None:
    s = backend.open()
    s.create_task("alice", "task_1", {}, status="in_progress")
    s.append_events("task_1", [(1, "response.created", {}), (2, "delta", {})])
    s.create_task("alice", "task_2", {}, status="in_progress")
    s.set_task_status("alice", "task_2", "cancelled", final_event=(1, "response.cancelled", {}))
    s.close()

    seen: list[tuple[str, int]] = []

    def openai_failed(task: TaskRecord, seq: int) -> tuple[str, dict]:
        seen.append((task.status, seq))
        return "response.failed", {
            "type": "response.failed",
            "sequence_number": seq - 1,
            "response": {"id": task.id, "status": "failed", "error": task.error},
        }

    with backend.open() as s:
        failed = s.fail_interrupted_tasks("restarted", terminal_event=openai_failed)
        assert [t.id for t in failed] == ["task_1"] and failed[0].last_seq == 3
        assert seen == [("failed", 3)]
        last = s.events_after("alice", "task_1", 2)
        assert last[0].data["sequence_number"] == 2
        assert s.get_task("alice", "task_2").status == "cancelled"
    assert backend.integrity() == "ok"


def test_recovery_close_log_sees_the_log_and_sets_the_result(backend: Backend) -> None:
    s = backend.open()
    s.create_task("alice", "task_1", {"dialect": "x"}, status="in_progress", response_id="resp_1")
    s.append_events("task_1", [(1, "response.created", {"n": 1}), (2, "delta", {"n": 2})])
    s.close()

    seen: list[tuple[str, int, list[int]]] = []

    def close(task: TaskRecord, seq: int, log: list) -> ClosedLog:
        seen.append((task.status, seq, [e.seq for e in log]))
        return ClosedLog([("item.done", {"n": seq}), ("response.failed", {"n": seq + 1})], {"id": "resp_1"})

    with backend.open() as s:
        (failed,) = s.fail_interrupted_tasks("restarted", close_log=close)
        assert seen == [("failed", 3, [1, 2])]
        assert failed.last_seq == 4 and failed.result == {"id": "resp_1"}
        events = s.events_after("alice", "task_1", 2)
        assert [(e.seq, e.event) for e in events] == [(3, "item.done"), (4, "response.failed")]
        assert s.get_task("alice", "task_1").result == {"id": "resp_1"}
        assert s.fail_interrupted_tasks("again", close_log=close) == []
    assert backend.integrity() == "ok"


# --- migrations and reopening --------------------------------------------------------------


def test_data_survives_reopen_and_migrations_are_idempotent(backend: Backend) -> None:
    with backend.open() as s:
        s.put_response("alice", "resp_1", response_obj("resp_1"), [user_msg("x", "msg_x")])
        s.create_conversation("alice", "conv_1", items=[user_msg("y", "msg_y")])
        s.create_task("alice", "task_1", {"q": 1})
        s.idempotency_begin("alice", "k", "h")
        s.idempotency_finish("alice", "k", 200, b"ok", {"x-a": "b"})
        stats = s.stats()
    for _ in range(2):
        with backend.open() as s:
            assert s.stats() == stats
            assert s.get_response("alice", "resp_1") == response_obj("resp_1")
            assert s.list_input_items("alice", "resp_1").items == [user_msg("x", "msg_x")]
            assert s.conversation_items("alice", "conv_1") == [user_msg("y", "msg_y")]
            assert s.get_task_request("alice", "task_1") == {"q": 1}
            assert s.idempotency_begin("alice", "k", "h").body == b"ok"
    assert backend.integrity() == "ok"


def test_new_migration_applies_once(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    backend.open().close()
    calls: list[int] = []
    shipped = len(backend.module.MIGRATIONS)

    def m_next(conn: Any) -> None:
        calls.append(1)
        conn.execute("ALTER TABLE responses ADD COLUMN note TEXT")

    monkeypatch.setattr(backend.module, "MIGRATIONS", [*backend.module.MIGRATIONS, m_next])
    for _ in range(2):
        with backend.open() as s:
            assert s.stats()["schema_version"] == shipped + 1
    assert calls == [1]
    assert "note" in backend.columns("responses")


def test_tasks_stored_before_their_request_columns_get_them(backend: Backend,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Schema 3 keeps a task's dialect and model beside its request
    (``TaskRecord.request``); the tasks of an existing database get theirs
    from the requests they were stored with, and so does one that an older
    instance, still running on a shared store, writes afterwards."""
    shipped = backend.module.MIGRATIONS
    monkeypatch.setattr(backend.module, "MIGRATIONS", shipped[:shipped.index(backend.module._m3_request_heads)])
    backend.open().close()
    assert "dialect" not in backend.columns("tasks")
    requests = {"task_1": {"dialect": "openai", "model": "m1", "body": {"input": "x" * 10_000}},
                "task_2": {"model": 7}, "task_3": {"dialect": "lmsp"}, "task_4": {"dialect": "lmsp", "model": "m4"}}

    def insert_as_before(task_id: str) -> None:
        backend.sql("INSERT INTO tasks (id, owner, status, request, created_at, updated_at, bytes) "
                    "VALUES (?, 'alice', 'completed', ?, 1, 1, 0)", (task_id, json.dumps(requests[task_id])))

    for task_id in ("task_1", "task_2", "task_3"):
        insert_as_before(task_id)
    monkeypatch.setattr(backend.module, "MIGRATIONS", shipped)
    with backend.open() as s:
        assert s.stats()["schema_version"] == len(shipped)
        insert_as_before("task_4")
        assert s.get_task("alice", "task_1").request == {"dialect": "openai", "model": "m1"}
        assert s.get_task("alice", "task_2").request == {}
        assert s.get_task("alice", "task_3").request == {"dialect": "lmsp"}
        assert s.get_task("alice", "task_4").request == {"dialect": "lmsp", "model": "m4"}
        assert s.get_task_request("alice", "task_1") == requests["task_1"]
    assert backend.sql("SELECT id FROM tasks WHERE dialect IS NOT NULL ORDER BY id") == [("task_1",), ("task_3",)]


def test_failed_migration_rolls_back(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    backend.open().close()
    shipped = len(backend.module.MIGRATIONS)

    def broken(conn: Any) -> None:
        conn.execute("CREATE TABLE half_done (x TEXT)")
        raise RuntimeError("boom")

    monkeypatch.setattr(backend.module, "MIGRATIONS", [*backend.module.MIGRATIONS, broken])
    with pytest.raises(RuntimeError):
        backend.open()
    assert backend.schema_version() == shipped
    assert not backend.table_exists("half_done")


def test_refuses_newer_schema(backend: Backend) -> None:
    backend.open().close()
    backend.set_schema_version(99)
    with pytest.raises(SchemaTooNew):
        backend.open()


@sqlite_only
def test_fresh_database_in_new_directory(backend: Backend, tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "state.db"
    with SQLiteStore(path) as s:
        assert s.stats()["schema_version"] == len(sqlite_module.MIGRATIONS)
    assert path.exists()


# --- instances: leases, cancel requests, notices ----------------------------------------------


def test_cancel_request_reaches_the_running_instance(backend: Backend, clock: FakeClock) -> None:
    runner = backend.open(clock=clock)
    other = backend.open(clock=clock)
    runner.create_task("alice", "task_1", {}, status="in_progress")
    runner.create_task("alice", "task_2", {}, status="queued")
    assert runner.heartbeat() == []
    assert other.request_cancel("mallory", "task_1") is False  # not hers: not found
    assert other.request_cancel("alice", "task_nope") is False
    assert other.request_cancel("alice", "task_1") is True
    assert runner.heartbeat() == ["task_1"]
    assert other.heartbeat() == []  # it does not run task_1
    runner.set_task_status("alice", "task_1", "cancelled", final_event=(1, "response.cancelled", {}))
    assert runner.heartbeat() == []
    assert other.request_cancel("alice", "task_1") is False  # already finished


def test_notices_follow_commits(backend: Backend) -> None:
    writer = backend.open()
    # Shared: another instance hears it; unshared: the store's own process.
    reader = backend.open() if writer.shared else writer
    got: list[tuple[str, str]] = []
    cond = threading.Condition()

    def heard(kind: str, task_id: str) -> None:
        with cond:
            got.append((kind, task_id))
            cond.notify_all()

    def wait_for(n: int) -> list[tuple[str, str]]:
        with cond:
            cond.wait_for(lambda: len(got) >= n, timeout=10)
            return list(got)

    remove = reader.listen(heard)
    writer.create_task("alice", "task_1", {}, status="in_progress")  # no events: no notice
    writer.append_events("task_1", [(1, "response.created", {}), (2, "delta", {})])
    assert writer.request_cancel("alice", "task_1")
    writer.set_task_status("alice", "task_1", "cancelled", final_event=(3, "response.cancelled", {}))
    assert wait_for(3) == [("events", "task_1"), ("cancel", "task_1"), ("events", "task_1")]
    # A write that fails sends nothing; a removed callback hears nothing.
    with pytest.raises(TaskFinished):
        writer.append_event("task_1", 4, "delta", {})
    remove()
    writer.create_task("alice", "task_2", {}, status="in_progress")
    writer.append_event("task_2", 1, "delta", {})
    probe: list[str] = []
    reader.listen(lambda kind, task_id: probe.append(task_id))
    writer.append_event("task_2", 2, "delta", {})
    deadline = time.monotonic() + 10
    while "task_2" not in probe and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "task_2" in probe
    assert len(got) == 3


def test_interrupted_means_written_by_a_gone_instance(backend: Backend, clock: FakeClock) -> None:
    a = backend.open(clock=clock, lease_s=10)
    b = backend.open(clock=clock, lease_s=10)
    a.create_task("alice", "task_a", {}, status="in_progress")
    a.append_event("task_a", 1, "response.created", {})
    a.put_response("alice", "resp_a", {"id": "resp_a", "status": "in_progress"}, [])
    assert a.idempotency_begin("alice", "key_a", "h").outcome is BeginOutcome.NEW
    if b.shared:
        # A live instance's running rows are left alone, however old.
        assert b.fail_interrupted_tasks("gone") == []
        assert b.fail_interrupted_responses({"code": "server_restarted"}) == []
        assert b.abandon_interrupted_idempotency() == 0
        clock.advance(8)
        a.heartbeat()
        clock.advance(8)  # 16 s after start, 8 s after the renewal
        assert b.fail_interrupted_tasks("gone") == []
        clock.advance(3)  # a's lease ran out
    # (Unshared: one process per file, so whatever another instance left
    # running was interrupted.)
    (failed,) = b.fail_interrupted_tasks("gone")
    assert failed.id == "task_a" and failed.status == "failed" and failed.last_seq == 2
    assert b.fail_interrupted_responses({"code": "server_restarted"}) == ["resp_a"]
    assert b.abandon_interrupted_idempotency() == 1
    assert b.idempotency_begin("alice", "key_a", "h").outcome is BeginOutcome.NEW
    # The dead instance, were it only slow, finds its task closed.
    with pytest.raises(TaskFinished):
        a.append_event("task_a", 2, "delta", {})
    if b.shared:
        b.create_task("alice", "task_b", {}, status="in_progress")
        clock.advance(1000)  # b's own lease lapsed too, but b is alive: it is asking
        assert b.fail_interrupted_tasks("gone") == []


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("off_by", [20.0, -20.0], ids=["ahead", "behind"])
def test_leases_go_by_the_databases_clock_not_the_hosts(backend: Backend, off_by: float) -> None:
    """Two instances on hosts whose clocks disagree by 20 s (more than a
    lease). By their own clocks, the one ahead took the other's live task
    for a dead one's and failed it (``ahead``), and the other took its
    renewed lease for lapsed (``behind``)."""
    steady = backend.open(lease_s=10)
    steady.create_task("alice", "task_steady", {}, status="in_progress")
    steady.append_event("task_steady", 1, "response.created", {})

    def host_clock() -> float:
        return time.time() + off_by

    skewed = backend.open(lease_s=10, clock=host_clock)
    skewed._wall = host_clock  # type: ignore[attr-defined]  # the host's clock is off, its wall clock too
    skewed.heartbeat()
    skewed.create_task("alice", "task_skewed", {}, status="in_progress")
    skewed.append_event("task_skewed", 1, "response.created", {})
    # Each is alive by the other's judgement, whichever way the clock is off.
    assert skewed.fail_interrupted_tasks("gone") == []
    assert steady.fail_interrupted_tasks("gone") == []
    assert steady.fail_interrupted_responses({"code": "server_restarted"}) == []
    assert [e.seq for e in steady.events_after("alice", "task_skewed", 0)] == [1]


def test_two_survivors_close_each_log_once(backend: Backend, clock: FakeClock) -> None:
    dead = backend.open(clock=clock, lease_s=5)
    for i in range(20):
        dead.create_task("alice", f"task_{i}", {}, status="in_progress")
        dead.append_event(f"task_{i}", 1, "response.created", {})
    clock.advance(6)
    survivors = [backend.open(clock=clock, lease_s=5) for _ in range(2)]
    results: list[list[str]] = [[], []]
    barrier = threading.Barrier(2)

    def reap(i: int) -> None:
        barrier.wait()
        results[i] = [t.id for t in survivors[i].fail_interrupted_tasks("gone")]

    threads = [threading.Thread(target=reap, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results[0] + results[1]) == sorted(f"task_{i}" for i in range(20))
    for i in range(20):
        events = survivors[0].events_after("alice", f"task_{i}", 0)
        assert [(e.seq, e.event) for e in events] == [(1, "response.created"), (2, "response.failed")]


def test_a_released_task_is_interrupted_even_for_its_own_instance(backend: Backend, clock: FakeClock) -> None:
    # Its writes failed: whoever sweeps next (itself included) closes it.
    me = backend.open(clock=clock)
    me.create_task("alice", "task_1", {}, status="in_progress")
    me.create_task("alice", "task_2", {}, status="in_progress")
    me.append_event("task_1", 1, "response.created", {})
    assert me.release_task("task_1") is True
    failed = me.fail_interrupted_tasks("its writes failed")
    expected = ["task_1"] if me.shared else ["task_1", "task_2"]  # unshared: all, at start
    assert [t.id for t in failed] == expected
    assert me.events_after("alice", "task_1", 0)[-1].event == "response.failed"
    assert me.release_task("task_1") is False  # finished: nothing to release


def test_close_task_ends_one_running_task_and_leaves_the_others(backend: Backend, clock: FakeClock) -> None:
    """Its writer could not end it (the store refused its events): closed
    with the error given, the next seq, as a crash's would be; once."""
    me = backend.open(clock=clock)
    me.create_task("alice", "task_1", {}, status="in_progress")
    me.create_task("alice", "task_2", {}, status="in_progress")
    me.append_event("task_1", 1, "response.created", {})
    closed = me.close_task("task_1", {"code": "store_unavailable", "message": "refused"})
    assert closed is not None and closed.status == "failed" and closed.error["code"] == "store_unavailable"
    assert [(e.seq, e.event) for e in me.events_after("alice", "task_1", 0)] == [
        (1, "response.created"), (2, "response.failed")]
    assert me.get_task("alice", "task_2").status == "in_progress"
    assert me.close_task("task_1", {"code": "store_unavailable", "message": "refused"}) is None
