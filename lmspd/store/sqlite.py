"""The embedded store: one SQLite file in WAL mode.

Concurrency: one writer connection behind a lock (SQLite allows one writer
anyway; serializing in-process keeps lock waits out of SQLite's busy loop and
makes check-then-insert sequences such as ``idempotency_begin`` atomic), and a
small pool of reader connections that WAL lets run beside the writer.

Durability: ``synchronous=NORMAL`` in WAL mode survives a process crash
(``kill -9``) with every committed transaction intact; only an OS crash or
power loss can drop the most recent commits. For the writes a client relies
on across such a loss (a finished idempotency key, a task's terminal status)
the commit runs with ``synchronous=FULL``; syncing the WAL there also makes
every earlier commit durable. Per-token event appends stay cheap.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Literal, Sequence

from lmspd.core.files import private_dir, private_file
from lmspd.core.lifecycle import TERMINAL_STATUSES
from lmspd.core.limits import DEFAULT_LEASE_S, Retention
from lmspd.store import pruning
from lmspd.store.base import (
    JSON,
    EventsExpired,
    LogCloser,
    NotFound,
    NoticeCallback,
    Notices,
    SchemaTooNew,
    StoreError,
    TaskEvent,
    TaskFinished,
    TaskRecord,
    TerminalEventBuilder,
    default_terminal_event,
    new_instance_id,
    unstorable,
)
from lmspd.store.conversations import ConversationQueries
from lmspd.store.idempotency import IdempotencyQueries
from lmspd.store.responses import ResponseQueries
from lmspd.store.sql import ACTIVE_SQL as _ACTIVE_SQL
from lmspd.store.sql import Sql
from lmspd.store.sql import dumps as _dumps
from lmspd.store.sql import size as _size
from lmspd.store.tasks import TaskQueries, fill_request_heads, insert_events

# --- schema -----------------------------------------------------------------

_SCHEMA_V1 = (
    # previous_response_id has no foreign key on purpose: an ancestor may be
    # deleted or expire, and the chain walk reports that clearly.
    """CREATE TABLE responses (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        status TEXT,
        previous_response_id TEXT,
        conversation_id TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        body TEXT NOT NULL,
        bytes INTEGER NOT NULL
    )""",
    "CREATE INDEX responses_by_age ON responses(created_at)",
    "CREATE INDEX responses_by_status ON responses(status)",
    # Output items are indexed here too (besides the response body) so that
    # item_reference lookups and chain walks need no JSON parsing in SQL.
    """CREATE TABLE response_items (
        response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
        kind TEXT NOT NULL CHECK (kind IN ('input', 'output')),
        position INTEGER NOT NULL,
        item_id TEXT,
        body TEXT NOT NULL,
        PRIMARY KEY (response_id, kind, position)
    ) WITHOUT ROWID""",
    "CREATE INDEX response_items_by_item ON response_items(item_id)",
    """CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        metadata TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        next_position INTEGER NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX conversations_by_age ON conversations(updated_at)",
    """CREATE TABLE conversation_items (
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        item_id TEXT NOT NULL,
        body TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        PRIMARY KEY (conversation_id, position)
    ) WITHOUT ROWID""",
    "CREATE INDEX conversation_items_by_item ON conversation_items(item_id)",
    """CREATE TABLE tasks (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN
            ('queued', 'in_progress', 'completed', 'failed', 'cancelled', 'incomplete')),
        response_id TEXT,
        request TEXT NOT NULL,
        result TEXT,
        error TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        finished_at REAL,
        last_seq INTEGER NOT NULL DEFAULT 0,
        first_retained_seq INTEGER NOT NULL DEFAULT 1,
        bytes INTEGER NOT NULL,
        events_bytes INTEGER NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX tasks_by_status ON tasks(status)",
    "CREATE INDEX tasks_by_finish ON tasks(finished_at)",
    """CREATE TABLE task_events (
        task_id TEXT NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        event TEXT NOT NULL,
        data TEXT NOT NULL,
        PRIMARY KEY (task_id, seq)
    ) WITHOUT ROWID""",
    """CREATE TABLE idempotency_keys (
        owner TEXT NOT NULL,
        key TEXT NOT NULL,
        request_hash TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('in_progress', 'done')),
        status_code INTEGER,
        headers TEXT,
        body BLOB,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        bytes INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (owner, key)
    ) WITHOUT ROWID""",
    "CREATE INDEX idempotency_by_expiry ON idempotency_keys(expires_at)",
)


def _m1_initial(conn: sqlite3.Connection) -> None:
    for statement in _SCHEMA_V1:
        conn.execute(statement)


def _m2_instances(conn: sqlite3.Connection) -> None:
    for statement in _SCHEMA_V2:
        conn.execute(statement)


# Version 2: which lmspd instance wrote a running row, and that instance's
# lease, so that on a shared store a survivor can tell a dead instance's
# tasks (fail them) from a live one's (leave them). Kept identical in both
# backends (lmspd.store.postgres).
_SCHEMA_V2 = (
    """CREATE TABLE instances (
        id TEXT PRIMARY KEY,
        started_at REAL NOT NULL,
        lease_until REAL NOT NULL
    )""",
    "ALTER TABLE tasks ADD COLUMN instance_id TEXT",
    "ALTER TABLE tasks ADD COLUMN cancel_requested_at REAL",
    "ALTER TABLE responses ADD COLUMN instance_id TEXT",
    "ALTER TABLE idempotency_keys ADD COLUMN instance_id TEXT",
)

# Version 3: a task's dialect and model beside its request, so that reading
# the task's state never parses the request (``TaskRecord.request``).
_SCHEMA_V3 = (
    "ALTER TABLE tasks ADD COLUMN dialect TEXT",
    "ALTER TABLE tasks ADD COLUMN model TEXT",
)


def _m3_request_heads(conn: sqlite3.Connection) -> None:
    for statement in _SCHEMA_V3:
        conn.execute(statement)
    fill_request_heads(Sql(conn, "qmark"))


# Append-only: migration i moves the schema from version i to i + 1. Never
# edit a shipped one; add the next. Each runs inside the open transaction
# (no executescript: it would commit half-way).
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_m1_initial, _m2_instances, _m3_request_heads]

# Rows deleted per write transaction while pruning, so request handlers never
# wait long for the writer lock.


class SQLiteStore(ResponseQueries, ConversationQueries, TaskQueries, IdempotencyQueries):
    """``Store`` on one SQLite file. ``path`` may be ``":memory:"`` (tests):
    then reads share the writer connection."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.time,
        retention: Retention = Retention(),
        max_chain_depth: int = 4096,
        max_idle_readers: int = 8,
        busy_timeout_s: float = 10.0,
        instance_id: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        if sqlite3.sqlite_version_info < (3, 35):
            # The shared writes (lmspd.store.sql) use RETURNING and upserts.
            raise StoreError(f"SQLite {sqlite3.sqlite_version} is too old: lmspd needs 3.35 or later")
        self._path = os.fspath(path)
        self.instance_id = instance_id or new_instance_id()
        self.lease_s = lease_s
        self._notices = Notices()
        self._clock = clock
        self.retention = retention
        self.max_chain_depth = max_chain_depth
        self._max_idle_readers = max_idle_readers
        self._busy_timeout_s = busy_timeout_s
        self._memory = self._path == ":memory:"
        self._lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._idle_readers: list[sqlite3.Connection] = []
        self._closed = False
        if not self._memory:
            # 0600 before SQLite opens it: its -wal and -shm take the database's mode.
            private_dir(os.path.dirname(os.path.abspath(self._path)))
            private_file(self._path)
            for side in ("-wal", "-shm"):
                if os.path.exists(self._path + side):
                    private_file(self._path + side)
        self._writer = self._connect()
        # Before any table exists, so freed pages can be given back to the OS
        # after pruning; on an existing database this is a no-op.
        self._writer.execute("PRAGMA auto_vacuum=INCREMENTAL")
        mode = self._writer.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if not self._memory and str(mode).lower() != "wal":
            self._writer.close()
            raise StoreError(f"could not put {self._path} in WAL mode (got {mode!r})")
        try:
            self._migrate()
            self._register()
        except BaseException:
            self._writer.close()
            raise

    # --- connections and transactions ---------------------------------------

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self._path,
            timeout=self._busy_timeout_s,
            isolation_level=None,  # we issue BEGIN/COMMIT ourselves
            check_same_thread=False,  # guarded by our lock / pool
        )
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("store is closed")

    @contextmanager
    def _write(self, *, durable: bool = False) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._check_open()
            conn = self._writer
            if durable:
                conn.execute("PRAGMA synchronous=FULL")
            try:
                # IMMEDIATE takes the write lock up front, so a read-then-write
                # sequence cannot be invalidated by another process's write.
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            finally:
                if durable:
                    conn.execute("PRAGMA synchronous=NORMAL")

    # The connection manager the shared aggregate modules use (lmspd.store.sql).
    insertion_order = "rowid"

    @contextmanager
    def sql_write(self, *, durable: bool = False) -> Iterator[Sql]:
        with self._write(durable=durable) as conn:
            yield Sql(conn, "qmark")

    @staticmethod
    def octets(column: str) -> str:
        return f"LENGTH(CAST({column} AS BLOB))"

    @contextmanager
    def sql_read(self) -> Iterator[Sql]:
        with self._read() as conn:
            yield Sql(conn, "qmark")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        if self._memory:
            with self._lock:
                self._check_open()
                yield self._writer
            return
        self._check_open()
        conn = self._acquire_reader()
        reusable = False
        try:
            # One snapshot for multi-statement reads (page + has_more, chains).
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                conn.execute("ROLLBACK")
                reusable = True
        finally:
            self._release_reader(conn, reusable=reusable)

    def _acquire_reader(self) -> sqlite3.Connection:
        with self._pool_lock:
            if self._idle_readers:
                return self._idle_readers.pop()
        return self._connect()

    def _release_reader(self, conn: sqlite3.Connection, *, reusable: bool) -> None:
        with self._pool_lock:
            if reusable and not self._closed and len(self._idle_readers) < self._max_idle_readers:
                self._idle_readers.append(conn)
                return
        conn.close()

    def _migrate(self) -> None:
        with self._write() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > len(MIGRATIONS):
                raise SchemaTooNew(
                    f"{self._path} has schema version {version}; this lmspd knows "
                    f"versions up to {len(MIGRATIONS)}"
                )
            for migration in MIGRATIONS[version:]:
                migration(conn)
            if version != len(MIGRATIONS):
                conn.execute(f"PRAGMA user_version={len(MIGRATIONS)}")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            # Best effort: a clean stop ends this instance's lease at once.
            with contextlib.suppress(sqlite3.Error):
                self._writer.execute("DELETE FROM instances WHERE id = ?", (self.instance_id,))
            self._closed = True
            self._writer.close()
        with self._pool_lock:
            idle, self._idle_readers = self._idle_readers, []
        for conn in idle:
            conn.close()

    def __enter__(self) -> SQLiteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _now(self, value: float | None = None) -> float:
        return self._clock() if value is None else value

    # --- instances, leases and notices -----------------------------------------
    # One process owns a SQLite file (``shared`` is false): at start every
    # running row is interrupted, whoever wrote it, and notices never leave
    # the process. The lease is kept anyway, so both backends share a schema.

    shared = False

    # _register, heartbeat, request_cancel, release_task: lmspd.store.tasks (shared).

    def listen(self, callback: NoticeCallback) -> Callable[[], None]:
        return self._notices.add(callback)

    # --- responses -------------------------------------------------------------

    # put_response, update_response: lmspd.store.responses (shared).

    def fail_interrupted_responses(self, error: JSON) -> list[str]:
        failed: list[str] = []
        with self._write(durable=True) as conn:
            rows = conn.execute(
                f"SELECT id, body FROM responses WHERE status IN {_ACTIVE_SQL}"
            ).fetchall()
            for row in rows:
                response = json.loads(row["body"])
                response["status"] = "failed"
                response["error"] = error
                body = _dumps(response)
                conn.execute(
                    "UPDATE responses SET body = ?, status = 'failed', updated_at = ?, "
                    "bytes = bytes - ? + ? WHERE id = ?",
                    (body, self._clock(), _size(row["body"]), _size(body), row["id"]),
                )
                failed.append(row["id"])
        return failed

    # --- conversations -----------------------------------------------------------

    # Conversation writes: lmspd.store.conversations (shared).

    # --- tasks -------------------------------------------------------------------

    # create_task, set_task_status: lmspd.store.tasks (shared).

    def _notice_after(self, kind: Literal["events", "cancel"], task_id: str) -> None:
        self._notices.send(kind, task_id)

    def append_event(self, task_id: str, seq: int, event: str, data: JSON) -> None:
        self.append_events(task_id, [(seq, event, data)])

    def append_events(self, task_id: str, events: Sequence[tuple[int, str, JSON]]) -> None:
        if not events:
            return
        with self._write() as conn:
            row = conn.execute(
                "SELECT status, last_seq FROM tasks WHERE id = ?", (task_id,)
            ).fetchone()
            if row is None:
                raise NotFound(f"task {task_id!r} not found")
            if row["status"] in TERMINAL_STATUSES:
                raise TaskFinished(f"task {task_id!r} is already {row['status']}")
            insert_events(Sql(conn, "qmark"), task_id, row["last_seq"], events)
        self._notices.send("events", task_id)

    def events_after(
        self, owner: str, task_id: str, after_seq: int = 0, limit: int = 1000
    ) -> list[TaskEvent] | None:
        if after_seq < 0:
            raise ValueError(f"after_seq must be at least 0, got {after_seq}")
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        if unstorable(task_id):
            return None
        with self._read() as conn:
            row = conn.execute(
                "SELECT first_retained_seq, last_seq FROM tasks WHERE id = ? AND owner = ?", (task_id, owner)
            ).fetchone()
            if row is None:
                return None
            if after_seq + 1 < row["first_retained_seq"]:
                raise EventsExpired(task_id, after_seq, row["first_retained_seq"], row["last_seq"])
            rows = conn.execute(
                "SELECT seq, event, data FROM task_events WHERE task_id = ? AND seq > ? "
                "ORDER BY seq LIMIT ?",
                (task_id, after_seq, limit),
            ).fetchall()
        return [TaskEvent(r["seq"], r["event"], json.loads(r["data"])) for r in rows]

    def fail_interrupted_tasks(
        self,
        message: str,
        *,
        terminal_event: TerminalEventBuilder | None = None,
        close_log: LogCloser | None = None,
    ) -> list[TaskRecord]:
        build = terminal_event or default_terminal_event
        error = _dumps({"code": "server_restarted", "message": message})
        failed: list[TaskRecord] = []
        with self._write(durable=True) as conn:
            ids = [
                r["id"]
                for r in conn.execute(
                    f"SELECT id FROM tasks WHERE status IN {_ACTIVE_SQL} ORDER BY created_at"
                )
            ]
            sql = Sql(conn, "qmark")
            for task_id in ids:
                failed.append(self._fail_interrupted(sql, task_id, error, build, close_log))
        for task in failed:
            self._notices.send("events", task.id)
        return failed

    # --- idempotency keys -------------------------------------------------------------

    # idempotency_begin/finish/abandon: lmspd.store.idempotency (shared).

    def abandon_interrupted_idempotency(self) -> int:
        with self._write() as conn:
            return conn.execute(
                "DELETE FROM idempotency_keys WHERE state = 'in_progress'"
            ).rowcount

    # --- bounds ------------------------------------------------------------------------

    def prune(self, now: float | None = None) -> dict[str, int]:
        removed = pruning.prune(self, self.retention, self._now(now))
        if any(removed.values()) and not self._memory:
            # Return freed pages to the file system so the file shrinks with
            # the budgets instead of staying at its high-water mark.
            with self._lock:
                self._check_open()
                # executescript steps the pragma to completion; execute()
                # would free a single page.
                self._writer.executescript("PRAGMA incremental_vacuum;")
        return removed

    def stats(self) -> dict[str, int]:
        with self.sql_read() as sql:
            row = sql.conn.execute("PRAGMA user_version").fetchone()
            return {"schema_version": int(row[0]), **pruning.stats(sql)}

