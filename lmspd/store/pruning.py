"""Retention: what ``Store.prune`` removes, the same in both backends.

Each kind of record goes by age first, then, while its kind is over its
byte budget, oldest first from the owners over their fair share of it, in
short write transactions of at most ``BATCH`` rows so that a large prune
never holds the writer long. Responses still running are pinned (and
idempotency keys still in progress); a task's event log goes before the
task (a late reader then gets 410 and can still fetch the final result),
and only finished tasks lose it.

Fair share (max-min): owners who hold less than an equal split of the
budget keep all of it, and what they leave is split evenly among the rest
(``fair_share``). So one credential that writes without end only ever
prunes its own oldest records: another one within its share, at least the
budget divided by the owners holding that kind, loses nothing.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from lmspd.core.fairness import fair_share
from lmspd.core.limits import Retention
from lmspd.store.sql import ACTIVE_SQL, TERMINAL_SQL, Connections, Sql, in_list

__all__ = ["BATCH", "fair_share", "prune"]

BATCH = 256

# Rows to remove, as (owner, id): ``id`` is the key column within an owner.
Victims = list[tuple[str, str]]


def _loop(db: Connections, step: Callable[[Sql], int]) -> int:
    """Run ``step`` in short write transactions until it removes nothing."""
    total = 0
    while True:
        with db.sql_write() as sql:
            n = step(sql)
        total += n
        if n == 0:
            return total


def _expired(sql: Sql, select: str, *args: object) -> Victims:
    """``select`` names ``owner`` and ``id``."""
    return [(row["owner"], row["id"]) for row in sql.rows(select + f" LIMIT {BATCH}", args)]


def _over_budget(sql: Sql, usage_sql: str, candidates_sql: str, budget: int) -> Victims:
    """The oldest rows to remove until every owner fits its fair share of
    ``budget``: ``usage_sql`` selects each ``owner`` and its total ``n``;
    ``candidates_sql`` one owner's (its one ``?``) removable rows, ``id`` and
    ``bytes``, oldest first."""
    usage = {row["owner"]: int(row["n"]) for row in sql.rows(usage_sql)}
    share = fair_share(usage, budget)
    victims: Victims = []
    if share is None:
        return victims
    for owner, used in sorted(usage.items()):
        if used <= share:
            continue
        for row in sql.rows(candidates_sql + f" LIMIT {BATCH - len(victims)}", (owner,)):
            if used <= share:
                break
            victims.append((owner, row["id"]))
            used -= int(row["bytes"])
        if len(victims) >= BATCH:
            break
    return victims


def _by_owner(victims: Victims) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = defaultdict(list)
    for owner, key in victims:
        grouped[owner].append(key)
    return grouped


def _delete(sql: Sql, table: str, victims: Victims, column: str = "id") -> int:
    for owner, keys in _by_owner(victims).items():
        sql.run(f"DELETE FROM {table} WHERE owner = ? AND {column} IN {in_list(keys)}", [owner, *keys])
    return len(victims)


def _drop_logs(sql: Sql, victims: Victims) -> int:
    ids = [task_id for _, task_id in victims]
    if ids:
        sql.run(f"DELETE FROM task_events WHERE task_id IN {in_list(ids)}", ids)
        sql.run(f"UPDATE tasks SET events_bytes = 0, first_retained_seq = last_seq + 1 WHERE id IN {in_list(ids)}",
                ids)
    return len(ids)


def _usage(column: str, table: str) -> str:
    return f"SELECT owner, COALESCE(SUM({column}), 0) AS n FROM {table} GROUP BY owner"


def prune(db: Connections, r: Retention, now: float) -> dict[str, int]:
    """Remove what ``r`` no longer keeps at time ``now``; counts by kind."""
    order = db.insertion_order
    removed: dict[str, int] = {}

    settled = f"FROM responses WHERE (status IS NULL OR status NOT IN {ACTIVE_SQL})"
    removed["responses"] = _loop(db, lambda s: _delete(s, "responses", _expired(
        s, f"SELECT owner, id {settled} AND created_at < ?", now - r.response_ttl_s)))
    removed["responses"] += _loop(db, lambda s: _delete(s, "responses", _over_budget(
        s, _usage("bytes", "responses"),
        f"SELECT id, bytes {settled} AND owner = ? ORDER BY created_at, {order}", r.max_response_bytes)))

    removed["conversations"] = _loop(db, lambda s: _delete(s, "conversations", _expired(
        s, "SELECT owner, id FROM conversations WHERE updated_at < ?", now - r.conversation_ttl_s)))
    removed["conversations"] += _loop(db, lambda s: _delete(s, "conversations", _over_budget(
        s, _usage("bytes", "conversations"),
        f"SELECT id, bytes FROM conversations WHERE owner = ? ORDER BY updated_at, {order}",
        r.max_conversation_bytes)))

    live_logs = f"FROM tasks WHERE status IN {TERMINAL_SQL} AND first_retained_seq <= last_seq"
    removed["event_logs"] = _loop(db, lambda s: _drop_logs(s, _expired(
        s, f"SELECT owner, id {live_logs} AND finished_at < ?", now - r.event_ttl_s)))
    removed["event_logs"] += _loop(db, lambda s: _drop_logs(s, _over_budget(
        s, _usage("events_bytes", "tasks"),
        f"SELECT id, events_bytes AS bytes {live_logs} AND owner = ? ORDER BY finished_at, {order}",
        r.max_event_bytes)))

    finished = f"FROM tasks WHERE status IN {TERMINAL_SQL}"
    removed["tasks"] = _loop(db, lambda s: _delete(s, "tasks", _expired(
        s, f"SELECT owner, id {finished} AND finished_at < ?", now - r.task_ttl_s)))
    removed["tasks"] += _loop(db, lambda s: _delete(s, "tasks", _over_budget(
        s, _usage("bytes", "tasks"),
        f"SELECT id, bytes {finished} AND owner = ? ORDER BY finished_at, {order}", r.max_task_bytes)))

    with db.sql_write() as sql:
        removed["idempotency_keys"] = sql.run("DELETE FROM idempotency_keys WHERE expires_at <= ?", (now,))
    # Only kept replies: a key still in progress guards a run that has not answered yet.
    removed["idempotency_keys"] += _loop(db, lambda s: _delete(s, "idempotency_keys", _over_budget(
        s, _usage("bytes", "idempotency_keys"),
        "SELECT key AS id, bytes FROM idempotency_keys WHERE owner = ? AND state = 'done' ORDER BY created_at, key",
        r.max_idempotency_bytes), column="key"))
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
