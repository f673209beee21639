"""Tasks, written and read the same in both SQL backends: creating one,
its status transitions, the event rows. Where they differ, hooks:
who hears that a task's log changed (PostgreSQL's ``NOTIFY`` inside the
transaction, SQLite's in-process notice after it). The per-token append
stays in each backend (PostgreSQL: one server-side function; SQLite:
under its writer lock), and so does closing what a crash left running."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

from lmspd.core.lifecycle import ACTIVE_STATUSES, TERMINAL_STATUSES
from lmspd.store.base import (
    JSON,
    TASK_STATUSES,
    Duplicate,
    LogCloser,
    SequenceError,
    TaskEvent,
    TaskRecord,
    TerminalEventBuilder,
    default_terminal_event,
    unstorable,
)
from lmspd.store.sql import ACTIVE_SQL, TERMINAL_SQL, Sql, SqlBackend, dumps, loads_opt, size

__all__ = ["TaskQueries", "fill_request_heads", "task_record"]

# What a task's readers need of its request, kept in columns of their own
# (``TaskRecord.request``): its body is never read to answer a poll.
_HEAD = ("dialect", "model")

# A task's state: every column but its request, which only a row without a
# dialect gives (``unsplit``): one an instance older than schema 3 wrote
# to a shared store after the migration (a rolling upgrade).
_STATE = ("id, owner, status, dialect, model, result, error, response_id, created_at, updated_at, finished_at, "
          "last_seq, first_retained_seq, CASE WHEN dialect IS NULL THEN request END AS unsplit")

# The same without the result: a finished OpenAI task's is the whole
# response, echo and all, parsed holding the interpreter lock.
_HEAD_STATE = _STATE.replace(" result,", " NULL AS result,")
assert _HEAD_STATE != _STATE


def task_record(row: Mapping[str, Any]) -> TaskRecord:
    """A row of ``_STATE``'s columns as a record."""
    head = (row["dialect"], row["model"]) if row["unsplit"] is None else _head_of(row["unsplit"])
    return TaskRecord(
        id=row["id"],
        owner=row["owner"],
        status=row["status"],
        request={key: value for key, value in zip(_HEAD, head, strict=True) if value is not None},
        result=loads_opt(row["result"]),
        error=loads_opt(row["error"]),
        response_id=row["response_id"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        finished_at=row["finished_at"],
        last_seq=row["last_seq"],
        first_retained_seq=row["first_retained_seq"],
    )


class TaskQueries(SqlBackend):
    def _notice_in(self, sql: Sql, kind: Literal["events", "cancel"], task_id: str) -> None:
        """In the transaction that changed a task's log or status, or asked it to stop."""

    def _notice_after(self, kind: Literal["events", "cancel"], task_id: str) -> None:
        """After that transaction committed."""

    # -- this instance's lease, and what others asked of its tasks -------------

    def _register(self) -> None:
        with self.sql_write() as sql:
            self._sync_lease_clock(sql)
            now = self._lease_now()
            _renew(sql, self.instance_id, now, now + self.lease_s)

    def heartbeat(self) -> list[str]:
        with self.sql_write() as sql:
            return self._heartbeat_in(sql)

    def _heartbeat_in(self, sql: Sql) -> list[str]:
        """Renew the lease inside ``sql``'s transaction; the cancels asked of this instance."""
        self._sync_lease_clock(sql)
        now = self._lease_now()
        _renew(sql, self.instance_id, now, now + self.lease_s)
        rows = sql.rows(f"SELECT id FROM tasks WHERE instance_id = ? AND cancel_requested_at IS NOT NULL "
                        f"AND status IN {ACTIVE_SQL}", (self.instance_id,))
        return [r["id"] for r in rows]

    def request_cancel(self, owner: str, task_id: str) -> bool:
        if unstorable(task_id):
            return False
        with self.sql_write() as sql:
            changed = sql.run(f"UPDATE tasks SET cancel_requested_at = ? WHERE id = ? AND owner = ? "
                              f"AND status IN {ACTIVE_SQL}", (self._clock(), task_id, owner))
            if changed:
                self._notice_in(sql, "cancel", task_id)
        if changed:
            self._notice_after("cancel", task_id)
        return changed == 1

    def release_task(self, task_id: str) -> bool:
        with self.sql_write() as sql:
            return sql.run(f"UPDATE tasks SET instance_id = NULL WHERE id = ? AND status IN {ACTIVE_SQL}",
                           (task_id,)) == 1

    def close_task(self, task_id: str, error: JSON, *, close_log: LogCloser | None = None) -> TaskRecord | None:
        with self.sql_write() as sql:
            if sql.first(f"SELECT id FROM tasks WHERE id = ? AND status IN {ACTIVE_SQL}" + self.for_update,
                         (task_id,)) is None:
                return None  # ended meanwhile (its final write landed after all, or a sweep closed it)
            task = self._fail_interrupted(sql, task_id, dumps(error), default_terminal_event, close_log)
        self._notice_after("events", task_id)
        return task

    # -- the tasks ------------------------------------------------------------------

    def _fail_interrupted(self, sql: Sql, task_id: str, error: str, build: TerminalEventBuilder,
                          close_log: LogCloser | None) -> TaskRecord:
        """Fail one task a crash left running and close its log (the caller
        chose and holds the task's row; the backends choose differently).
        With ``close_log``, a task whose response row is already final
        ends as that response did, never as failed (``LogCloser``)."""
        now = self._clock()
        final = self._final_response(sql, task_id) if close_log is not None else None
        status = "failed"
        error_text: str | None = error
        if final is not None:
            status = str(final["status"])
            error_text = None if final.get("error") is None else dumps(final["error"])
        row = sql.returning(
            f"UPDATE tasks SET status = ?, error = ?, updated_at = ?, finished_at = ?, "
            f"bytes = {self.octets('request')} + COALESCE({self.octets('result')}, 0) + ? WHERE id = ? "
            f"RETURNING {_STATE}",
            (status, error_text, now, now, size(error_text), task_id))
        assert row is not None  # the caller holds the row
        task = task_record(row)
        seq = task.last_seq + 1
        if close_log is None:
            name, data = build(task, seq)
            insert_events(sql, task_id, task.last_seq, [(seq, name, data)])
        else:
            # This transaction's own view of the log (SQLite: through the
            # writer, no second connection waiting on its lock).
            log = [TaskEvent(r["seq"], r["event"], json.loads(r["data"]))
                   for r in sql.rows("SELECT seq, event, data FROM task_events WHERE task_id = ? ORDER BY seq",
                                     (task_id,))]
            closed = close_log(task if final is None else replace(task, result=final), seq, log)
            if not closed.events:
                raise ValueError(f"close_log returned no events for task {task_id!r}")
            insert_events(sql, task_id, task.last_seq,
                          [(seq + i, name, data) for i, (name, data) in enumerate(closed.events)])
            if closed.result is not None:
                result = dumps(closed.result)
                sql.run(f"UPDATE tasks SET result = ?, bytes = {self.octets('request')} + ? "
                        f"+ COALESCE({self.octets('error')}, 0) WHERE id = ?", (result, size(result), task_id))
        self._notice_in(sql, "events", task_id)
        row = sql.first(f"SELECT {_STATE} FROM tasks WHERE id = ?", (task_id,))
        assert row is not None  # the row just written
        return task_record(row)

    def _final_response(self, sql: Sql, task_id: str) -> JSON | None:
        """The task's stored response if its status is final (its end was
        stored before the task's own terminal write was cut off)."""
        row = sql.first(f"SELECT r.body FROM tasks t JOIN responses r ON r.id = t.response_id AND r.owner = t.owner "
                        f"WHERE t.id = ? AND r.status IN {TERMINAL_SQL}", (task_id,))
        if row is None:
            return None
        body = json.loads(row["body"])
        return body if isinstance(body, dict) and body.get("status") in TERMINAL_STATUSES else None

    def create_task(self, owner: str, task_id: str, request: JSON, *, status: str = "queued",
                    response_id: str | None = None, created_at: float | None = None) -> TaskRecord:
        if status not in ACTIVE_STATUSES:
            raise ValueError(f"a new task is queued or in_progress, not {status!r}")
        body = dumps(request)
        created = self._now(created_at)
        with self.sql_write() as sql:
            row = sql.returning(
                "INSERT INTO tasks (id, owner, status, response_id, request, dialect, model, created_at, "
                "updated_at, bytes, instance_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                f"ON CONFLICT (id) DO NOTHING RETURNING {_STATE}",
                (task_id, owner, status, response_id, body, *request_head(request), created, self._clock(),
                 size(body), self.instance_id),
            )
        if row is None:
            raise Duplicate(f"task {task_id!r} already exists")
        return task_record(row)

    def set_task_status(self, owner: str, task_id: str, status: str, *, result: JSON | None = None,
                        error: JSON | None = None, final_event: tuple[int, str, JSON] | None = None) -> bool:
        if status not in TASK_STATUSES:
            raise ValueError(f"unknown task status {status!r}")
        terminal = status in TERMINAL_STATUSES
        result_text = None if result is None else dumps(result)
        error_text = None if error is None else dumps(error)
        # A terminal status waits for the flush wherever a backend relaxes it.
        with self.sql_write(durable=terminal) as sql:
            row = sql.first("SELECT status, last_seq, result, error FROM tasks WHERE id = ? AND owner = ?"
                            + self.for_update, (task_id, owner))
            if row is None or row["status"] in TERMINAL_STATUSES:
                return False
            if final_event is not None:
                insert_events(sql, task_id, row["last_seq"], [final_event])
            new_result = result_text if result_text is not None else row["result"]
            new_error = error_text if error_text is not None else row["error"]
            now = self._clock()
            sql.run(f"UPDATE tasks SET status = ?, result = ?, error = ?, updated_at = ?, finished_at = ?, "
                    f"bytes = {self.octets('request')} + ? WHERE id = ?",
                    (status, new_result, new_error, now, now if terminal else None,
                     size(new_result) + size(new_error), task_id))
            if final_event is not None or terminal:
                self._notice_in(sql, "events", task_id)
        if final_event is not None or terminal:
            self._notice_after("events", task_id)
        return True

    def get_task(self, owner: str, task_id: str, *, result: bool = True) -> TaskRecord | None:
        if unstorable(task_id):
            return None
        columns = _STATE if result else _HEAD_STATE
        with self.sql_single() as sql:
            row = sql.first(f"SELECT {columns} FROM tasks WHERE id = ? AND owner = ?", (task_id, owner))
        return None if row is None else task_record(row)

    def get_task_request(self, owner: str, task_id: str) -> JSON | None:
        if unstorable(task_id):
            return None
        with self.sql_single() as sql:
            row = sql.first("SELECT request FROM tasks WHERE id = ? AND owner = ?", (task_id, owner))
        return None if row is None else dict(json.loads(row["request"]))

    def first_retained_seq(self, owner: str, task_id: str) -> int | None:
        if unstorable(task_id):
            return None
        with self.sql_single() as sql:
            row = sql.first("SELECT first_retained_seq FROM tasks WHERE id = ? AND owner = ?", (task_id, owner))
        return None if row is None else int(row["first_retained_seq"])


def request_head(request: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The ``_HEAD`` of a task's request (``dialect``, ``model``), as its columns keep it."""

    def kept(value: Any) -> str | None:
        return value if isinstance(value, str) and not unstorable(value) else None

    return kept(request.get("dialect")), kept(request.get("model"))


def _head_of(stored: str) -> tuple[str | None, str | None]:
    request = json.loads(stored)
    return request_head(request) if isinstance(request, dict) else (None, None)


def fill_request_heads(sql: Sql) -> None:
    """Migration: the ``_HEAD`` columns of the tasks stored before them, one
    request parsed at a time (each may be megabytes)."""
    for task in sql.rows("SELECT id FROM tasks"):
        row = sql.first("SELECT request FROM tasks WHERE id = ?", (task["id"],))
        assert row is not None  # in the migration's transaction
        sql.run("UPDATE tasks SET dialect = ?, model = ? WHERE id = ?", (*_head_of(row["request"]), task["id"]))


def insert_events(sql: Sql, task_id: str, last_seq: int, events: Sequence[tuple[int, str, JSON]]) -> None:
    """Add ``events`` to a task's log (seqs above ``last_seq``, rising) and
    move its ``last_seq`` and size; the caller holds the task's row."""
    rows = []
    added = 0
    for seq, name, data in events:
        if not isinstance(seq, int) or isinstance(seq, bool) or seq <= last_seq:
            raise SequenceError(f"event seq {seq!r} for task {task_id!r} must be an integer above {last_seq}")
        body = dumps(data)
        added += size(name) + size(body)
        rows.append((task_id, seq, name, body))
        last_seq = seq
    sql.many("INSERT INTO task_events (task_id, seq, event, data) VALUES (?, ?, ?, ?)", rows)
    sql.run("UPDATE tasks SET last_seq = ?, events_bytes = events_bytes + ? WHERE id = ?",
            (last_seq, added, task_id))


def _renew(sql: Sql, instance_id: str, now: float, until: float) -> None:
    sql.run("INSERT INTO instances (id, started_at, lease_until) VALUES (?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET lease_until = excluded.lease_until", (instance_id, now, until))
