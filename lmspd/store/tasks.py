"""Tasks, read the same in both SQL backends (appending events and the
status transitions stay in each backend: PostgreSQL appends in one
server-side function, SQLite under its writer lock)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from lmspd.store.base import TaskRecord
from lmspd.store.sql import SqlBackend, loads_opt

__all__ = ["TaskQueries", "task_record"]


def task_record(row: Mapping[str, Any]) -> TaskRecord:
    return TaskRecord(
        id=row["id"],
        owner=row["owner"],
        status=row["status"],
        request=json.loads(row["request"]),
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
    def get_task(self, owner: str, task_id: str) -> TaskRecord | None:
        with self.sql_single() as sql:
            row = sql.first("SELECT * FROM tasks WHERE id = ? AND owner = ?", (task_id, owner))
        return None if row is None else task_record(row)

    def first_retained_seq(self, owner: str, task_id: str) -> int | None:
        with self.sql_single() as sql:
            row = sql.first("SELECT first_retained_seq FROM tasks WHERE id = ? AND owner = ?", (task_id, owner))
        return None if row is None else int(row["first_retained_seq"])
