"""The connection manager both store backends share: statements written
once (``?`` placeholders, columns read by name), run on one connection in a
short read or write transaction.

The aggregate modules (``responses``, ``paging``, ``pruning``...) are written
against ``SqlBackend`` / ``Connections`` and ``Sql``, reads and writes alike;
each backend (``sqlite``, ``postgres``) says only how it opens a
transaction, which placeholder its driver takes, and the few words where
the two engines' SQL differs (``octets``, ``for_update``). SQL that only one
engine speaks (PostgreSQL's append function and ``SKIP LOCKED``, SQLite's
``PRAGMA``) stays in its backend.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol

from lmspd.core.lifecycle import ACTIVE_STATUSES, TERMINAL_STATUSES
from lmspd.core.limits import Retention

__all__ = ["ACTIVE_SQL", "TERMINAL_SQL", "Connections", "Sql", "SqlBackend", "dumps", "in_list", "loads_opt", "size"]

Row = Mapping[str, Any]


def _sql_set(values: Iterable[str]) -> str:
    return "(" + ", ".join(f"'{v}'" for v in sorted(values)) + ")"


# The status sets of lmspd.store.base as SQL lists (constants, never client text).
ACTIVE_SQL = _sql_set(ACTIVE_STATUSES)
TERMINAL_SQL = _sql_set(TERMINAL_STATUSES)


class Sql:
    """One connection inside a transaction. Statements use ``?``; a driver
    that wants ``%s`` (psycopg) gets them rewritten — the shared SQL holds no
    other ``?`` and no ``%``."""

    def __init__(self, conn: Any, paramstyle: Literal["qmark", "format"]) -> None:
        self.conn = conn
        self._format = paramstyle == "format"

    def _q(self, sql: str) -> str:
        return sql.replace("?", "%s") if self._format else sql

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        rows: list[Row] = self.conn.execute(self._q(sql), tuple(args)).fetchall()
        return rows

    def first(self, sql: str, args: Sequence[Any] = ()) -> Row | None:
        row: Row | None = self.conn.execute(self._q(sql), tuple(args)).fetchone()
        return row

    def returning(self, sql: str, args: Sequence[Any] = ()) -> Row | None:
        """The row an ``INSERT/UPDATE ... RETURNING`` of one row gives, if any:
        read to the end, so SQLite's statement is finished before the commit."""
        rows = self.rows(sql, args)
        return rows[0] if rows else None

    def run(self, sql: str, args: Sequence[Any] = ()) -> int:
        """Run a statement; the number of rows it changed."""
        count: int = self.conn.execute(self._q(sql), tuple(args)).rowcount
        return count

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """One statement for each of ``rows`` (a batch insert)."""
        if not rows:
            return
        # A cursor: psycopg's connection has no executemany (sqlite3's cursor has one too).
        cursor = self.conn.cursor()
        try:
            cursor.executemany(self._q(sql), rows)
        finally:
            cursor.close()


class Connections(Protocol):
    """What a backend gives the aggregate modules."""

    #: The column that orders rows by insertion among equal timestamps
    #: (``rowid`` in SQLite; PostgreSQL has none stable, ``id`` is unique).
    insertion_order: str

    def sql_write(self, *, durable: bool = False) -> AbstractContextManager[Sql]:
        """A write transaction: committed when the block ends, rolled back if
        it raises; ``durable`` where the backend would otherwise relax the flush."""
        ...

    def octets(self, column: str) -> str:
        """SQL for the byte length of a text column."""
        ...

    def sql_read(self) -> AbstractContextManager[Sql]:
        """A consistent read."""
        ...


class SqlBackend:
    """The base of both SQL backends: the aggregate mixins
    (``ResponseQueries``, ``ConversationQueries``, ``TaskQueries``,
    ``IdempotencyQueries``) are written against these methods, which each
    backend implements."""

    insertion_order: str
    # The longest previous_response_id chain read back (ResponseQueries._chain).
    max_chain_depth: int
    # Written on the rows this instance is running (its lease: store.base).
    instance_id: str
    retention: Retention
    lease_s: float
    _clock: Callable[[], float]
    #: What locks the rows a read-then-write reads: PostgreSQL's
    #: `` FOR UPDATE``; nothing in SQLite, whose writes hold the one writer lock.
    for_update: str = ""

    def _now(self, value: float | None = None) -> float:
        return self._clock() if value is None else value

    def _lease_now(self) -> float:
        """The clock leases are written and judged by (``_sync_lease_clock``)."""
        return self._clock()

    def _sync_lease_clock(self, sql: Sql) -> None:
        """In the transaction that renews this instance's lease: a store
        that several hosts share reads the database's clock here
        (``PostgresStore``); one host's store has one clock."""

    def sql_write(self, *, durable: bool = False) -> AbstractContextManager[Sql]:
        raise NotImplementedError

    def sql_read(self) -> AbstractContextManager[Sql]:
        raise NotImplementedError

    def sql_single(self) -> AbstractContextManager[Sql]:
        """For a read of one statement (PostgreSQL: autocommit, no BEGIN/COMMIT)."""
        return self.sql_read()

    def sql_snapshot(self) -> AbstractContextManager[Sql]:
        """A read of several statements that all see one snapshot (SQLite's
        read transaction is one; PostgreSQL's default, read committed, gives
        each statement its own)."""
        return self.sql_read()

    def octets(self, column: str) -> str:
        raise NotImplementedError


def in_list(values: Sequence[Any]) -> str:
    """``(?, ?, ...)`` for ``values`` (a bounded batch: never client-sized)."""
    return "(" + ", ".join("?" * len(values)) + ")"


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def size(text: str | bytes | None) -> int:
    if text is None:
        return 0
    return len(text) if isinstance(text, bytes) else len(text.encode("utf-8"))


def loads_opt(text: str | None) -> Any:
    return None if text is None else json.loads(text)
