"""Idempotency keys (``Store.idempotency_*``), the same in both backends.

A key is claimed by an insert that the primary key (owner, key) decides:
between two instances on a shared store, the loser's insert waits for the
winner's commit and then does nothing, and it reads the winner's row.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from lmspd.store.base import BeginOutcome, IdempotencyBegin
from lmspd.store.sql import Connections, SqlBackend, dumps, size

__all__ = ["IdempotencyQueries", "abandon", "begin", "finish"]


class IdempotencyQueries(SqlBackend):
    """``Store.idempotency_*`` for both SQL backends (closing the keys a
    crash left in progress differs: only the shared store asks whose lease
    ran out)."""

    def idempotency_begin(self, owner: str, key: str, request_hash: str) -> IdempotencyBegin:
        return begin(self, owner, key, request_hash, now=self._clock(), ttl_s=self.retention.idempotency_ttl_s,
                     instance_id=self.instance_id)

    def idempotency_finish(self, owner: str, key: str, status_code: int, body: bytes,
                           headers: Mapping[str, str]) -> bool:
        return finish(self, owner, key, status_code, body, headers, now=self._clock())

    def idempotency_abandon(self, owner: str, key: str) -> bool:
        return abandon(self, owner, key)


def begin(db: Connections, owner: str, key: str, request_hash: str, *, now: float, ttl_s: float,
          instance_id: str | None) -> IdempotencyBegin:
    while True:
        with db.sql_write() as sql:
            sql.run("DELETE FROM idempotency_keys WHERE owner = ? AND key = ? AND expires_at <= ?", (owner, key, now))
            inserted = sql.run(
                "INSERT INTO idempotency_keys (owner, key, request_hash, state, created_at, "
                "expires_at, bytes, instance_id) VALUES (?, ?, ?, 'in_progress', ?, ?, ?, ?) "
                "ON CONFLICT (owner, key) DO NOTHING",
                (owner, key, request_hash, now, now + ttl_s, size(key) + size(request_hash), instance_id),
            )
            if inserted:
                return IdempotencyBegin(BeginOutcome.NEW)
            row = sql.first(
                "SELECT request_hash, state, status_code, headers, body FROM idempotency_keys "
                "WHERE owner = ? AND key = ?",
                (owner, key),
            )
        if row is not None:
            break
        # Abandoned between the insert and the read: it is free again.
    # A different body wins over "still running": the client reused a key by
    # mistake, and waiting would not help it.
    if row["request_hash"] != request_hash:
        return IdempotencyBegin(BeginOutcome.CONFLICT)
    if row["state"] == "in_progress":
        return IdempotencyBegin(BeginOutcome.IN_PROGRESS)
    return IdempotencyBegin(
        BeginOutcome.REPLAY,
        status_code=row["status_code"],
        body=bytes(row["body"]) if row["body"] is not None else b"",
        headers=json.loads(row["headers"]) if row["headers"] else {},
    )


def finish(db: Connections, owner: str, key: str, status_code: int, body: bytes, headers: Mapping[str, str], *,
           now: float) -> bool:
    """Record the reply; False if the key is no longer this attempt's (expired or abandoned)."""
    headers_text = dumps(dict(headers))
    # Durable (SQLite: synchronous=FULL for this commit): it is what retries replay.
    with db.sql_write(durable=True) as sql:
        return sql.run(
            "UPDATE idempotency_keys SET state = 'done', status_code = ?, headers = ?, body = ?, "
            f"bytes = {db.octets('key')} + {db.octets('request_hash')} + ? "
            "WHERE owner = ? AND key = ? AND state = 'in_progress' AND expires_at > ?",
            (status_code, headers_text, bytes(body), size(headers_text) + len(body), owner, key, now),
        ) == 1


def abandon(db: Connections, owner: str, key: str) -> bool:
    with db.sql_write() as sql:
        return sql.run(
            "DELETE FROM idempotency_keys WHERE owner = ? AND key = ? AND state = 'in_progress'", (owner, key)
        ) == 1
