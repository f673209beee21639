"""Retention: what ``Store.prune`` removes, the same in both backends.

Each kind of record goes by age first, then oldest first while its kind is
over its byte budget, in short write transactions of at most ``BATCH`` rows
so that a large prune never holds the writer long. Responses still running
are pinned; a task's event log goes before the task (a late reader then gets
410 and can still fetch the final result), and only finished tasks lose it.
"""

from __future__ import annotations

from typing import Callable

from lmspd.core.limits import Retention
from lmspd.store.sql import ACTIVE_SQL, TERMINAL_SQL, Connections, Sql, in_list

__all__ = ["BATCH", "prune"]

BATCH = 256


def _loop(db: Connections, step: Callable[[Sql], int]) -> int:
    """Run ``step`` in short write transactions until it removes nothing."""
    total = 0
    while True:
        with db.sql_write() as sql:
            n = step(sql)
        total += n
        if n == 0:
            return total


def _ids(sql: Sql, select: str, *args: object) -> list[str]:
    return [row["id"] for row in sql.rows(select + f" LIMIT {BATCH}", args)]


def _over_budget(sql: Sql, sum_sql: str, candidates_sql: str, budget: int) -> list[str]:
    """The oldest rows to remove until the kind fits its budget again;
    ``sum_sql`` selects the total as ``n``, ``candidates_sql`` ``id`` and
    ``bytes``, oldest first."""
    total_row = sql.first(sum_sql)
    total = int(total_row["n"]) if total_row is not None else 0
    if total <= budget:
        return []
    victims: list[str] = []
    for row in sql.rows(candidates_sql + f" LIMIT {BATCH}"):
        if total <= budget:
            break
        victims.append(row["id"])
        total -= row["bytes"]
    return victims


def _delete(sql: Sql, table: str, ids: list[str]) -> int:
    if ids:
        sql.run(f"DELETE FROM {table} WHERE id IN {in_list(ids)}", ids)
    return len(ids)


def _drop_logs(sql: Sql, ids: list[str]) -> int:
    if ids:
        sql.run(f"DELETE FROM task_events WHERE task_id IN {in_list(ids)}", ids)
        sql.run(f"UPDATE tasks SET events_bytes = 0, first_retained_seq = last_seq + 1 WHERE id IN {in_list(ids)}",
                ids)
    return len(ids)


def prune(db: Connections, r: Retention, now: float) -> dict[str, int]:
    """Remove what ``r`` no longer keeps at time ``now``; counts by kind."""
    order = db.insertion_order
    removed: dict[str, int] = {}

    settled = f"FROM responses WHERE status IS NULL OR status NOT IN {ACTIVE_SQL}"
    removed["responses"] = _loop(db, lambda s: _delete(s, "responses", _ids(
        s, f"SELECT id FROM responses WHERE created_at < ? AND (status IS NULL OR status NOT IN {ACTIVE_SQL})",
        now - r.response_ttl_s)))
    removed["responses"] += _loop(db, lambda s: _delete(s, "responses", _over_budget(
        s, "SELECT COALESCE(SUM(bytes), 0) AS n FROM responses",
        f"SELECT id, bytes {settled} ORDER BY created_at, {order}", r.max_response_bytes)))

    removed["conversations"] = _loop(db, lambda s: _delete(s, "conversations", _ids(
        s, "SELECT id FROM conversations WHERE updated_at < ?", now - r.conversation_ttl_s)))
    removed["conversations"] += _loop(db, lambda s: _delete(s, "conversations", _over_budget(
        s, "SELECT COALESCE(SUM(bytes), 0) AS n FROM conversations",
        f"SELECT id, bytes FROM conversations ORDER BY updated_at, {order}", r.max_conversation_bytes)))

    live_logs = f"FROM tasks WHERE status IN {TERMINAL_SQL} AND first_retained_seq <= last_seq"
    removed["event_logs"] = _loop(db, lambda s: _drop_logs(s, _ids(
        s, f"SELECT id {live_logs} AND finished_at < ?", now - r.event_ttl_s)))
    removed["event_logs"] += _loop(db, lambda s: _drop_logs(s, _over_budget(
        s, "SELECT COALESCE(SUM(events_bytes), 0) AS n FROM tasks",
        f"SELECT id, events_bytes AS bytes {live_logs} ORDER BY finished_at, {order}", r.max_event_bytes)))

    finished = f"FROM tasks WHERE status IN {TERMINAL_SQL}"
    removed["tasks"] = _loop(db, lambda s: _delete(s, "tasks", _ids(
        s, f"SELECT id {finished} AND finished_at < ?", now - r.task_ttl_s)))
    removed["tasks"] += _loop(db, lambda s: _delete(s, "tasks", _over_budget(
        s, "SELECT COALESCE(SUM(bytes), 0) AS n FROM tasks",
        f"SELECT id, bytes {finished} ORDER BY finished_at, {order}", r.max_task_bytes)))

    with db.sql_write() as sql:
        removed["idempotency_keys"] = sql.run("DELETE FROM idempotency_keys WHERE expires_at <= ?", (now,))
    return removed


# What the store holds, by table (``Store.stats``: /metrics and the console).
_STATS = {
    "responses": "SELECT COUNT(*) AS n FROM responses",
    "response_bytes": "SELECT COALESCE(SUM(bytes), 0) AS n FROM responses",
    "response_items": "SELECT COUNT(*) AS n FROM response_items",
    "conversations": "SELECT COUNT(*) AS n FROM conversations",
    "conversation_bytes": "SELECT COALESCE(SUM(bytes), 0) AS n FROM conversations",
    "conversation_items": "SELECT COUNT(*) AS n FROM conversation_items",
    "tasks": "SELECT COUNT(*) AS n FROM tasks",
    "task_bytes": "SELECT COALESCE(SUM(bytes), 0) AS n FROM tasks",
    "events": "SELECT COUNT(*) AS n FROM task_events",
    "event_bytes": "SELECT COALESCE(SUM(events_bytes), 0) AS n FROM tasks",
    "idempotency_keys": "SELECT COUNT(*) AS n FROM idempotency_keys",
    "idempotency_bytes": "SELECT COALESCE(SUM(bytes), 0) AS n FROM idempotency_keys",
}


def stats(sql: Sql) -> dict[str, int]:
    """Rows and bytes per table, in one read."""
    out = {}
    for name, query in _STATS.items():
        row = sql.first(query)
        out[name] = int(row["n"]) if row is not None else 0
    return out
