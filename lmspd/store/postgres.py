"""The shared store: one PostgreSQL database that several lmspd instances use
at once (``--store postgresql://...``).

Same tables, columns and migrations as the SQLite store
(``lmspd.store.sqlite``), in PostgreSQL types; payloads stay JSON text, so a
stored dict comes back equal, key order included.

Concurrency: a small connection pool (psycopg 3, synchronous: the ``Store``
interface is synchronous and is called from worker threads). Read-then-write
sequences lock the row they depend on (``SELECT ... FOR UPDATE``), so two
instances appending to one task, ending it, or taking one idempotency key
serialize in the database, not in a process.

Across instances: every commit that appends a task's events or ends it also
sends ``NOTIFY lmspd, 'events:<task id>'`` (delivered at commit, in commit
order); a cancel request sends ``'cancel:<task id>'``. One listener thread per
store turns them into ``listen`` callbacks. A notice only says that something
changed: readers read the events by seq, so a lost or duplicated notice costs
latency, never a gap or a repeat.

Durability, as in the SQLite store: per-token event appends commit with
``synchronous_commit = off`` (a database crash may lose the last few
hundred milliseconds of them, never corrupt anything, and a restarted log
is closed by recovery anyway); everything else, a task's terminal status and
a finished idempotency key included, waits for the WAL flush as the server
is configured to.

Liveness: each instance holds a lease in ``instances`` and renews it with
``heartbeat``; running rows carry the instance that wrote them. A survivor's
``fail_interrupted_*`` calls take only the rows of instances whose lease ran
out (``FOR UPDATE SKIP LOCKED``: two survivors never close one log twice).
Leases are written and judged by the database's clock, read at every
renewal (``_sync_lease_clock``): the instances' own clocks need not agree
(one running 11 s ahead failed another's live tasks and released its
idempotency keys).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from typing import Any, Callable, Iterator, Literal, Sequence

try:
    import psycopg
    from psycopg.rows import dict_row
    from psycopg_pool import ConnectionPool
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "the PostgreSQL store needs psycopg 3: pip install 'lmspd[postgresql]'"
    ) from exc

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
    SequenceError,
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
from lmspd.store.tasks import TaskQueries, fill_request_heads

log = logging.getLogger("lmspd.store")

Conn = psycopg.Connection[dict[str, Any]]

CHANNEL = "lmspd"

# --- schema (the SQLite store's, in PostgreSQL types) --------------------------

_SCHEMA_V1 = (
    """CREATE TABLE responses (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        status TEXT,
        previous_response_id TEXT,
        conversation_id TEXT,
        created_at DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL,
        body TEXT NOT NULL,
        bytes BIGINT NOT NULL
    )""",
    "CREATE INDEX responses_by_age ON responses(created_at)",
    "CREATE INDEX responses_by_status ON responses(status)",
    """CREATE TABLE response_items (
        response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
        kind TEXT NOT NULL CHECK (kind IN ('input', 'output')),
        position INTEGER NOT NULL,
        item_id TEXT,
        body TEXT NOT NULL,
        PRIMARY KEY (response_id, kind, position)
    )""",
    "CREATE INDEX response_items_by_item ON response_items(item_id)",
    """CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL,
        metadata TEXT NOT NULL,
        bytes BIGINT NOT NULL,
        next_position INTEGER NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX conversations_by_age ON conversations(updated_at)",
    """CREATE TABLE conversation_items (
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        item_id TEXT NOT NULL,
        body TEXT NOT NULL,
        bytes BIGINT NOT NULL,
        PRIMARY KEY (conversation_id, position)
    )""",
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
        created_at DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL,
        finished_at DOUBLE PRECISION,
        last_seq BIGINT NOT NULL DEFAULT 0,
        first_retained_seq BIGINT NOT NULL DEFAULT 1,
        bytes BIGINT NOT NULL,
        events_bytes BIGINT NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX tasks_by_status ON tasks(status)",
    "CREATE INDEX tasks_by_finish ON tasks(finished_at)",
    """CREATE TABLE task_events (
        task_id TEXT NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
        seq BIGINT NOT NULL,
        event TEXT NOT NULL,
        data TEXT NOT NULL,
        PRIMARY KEY (task_id, seq)
    )""",
    """CREATE TABLE idempotency_keys (
        owner TEXT NOT NULL,
        key TEXT NOT NULL,
        request_hash TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('in_progress', 'done')),
        status_code INTEGER,
        headers TEXT,
        body BYTEA,
        created_at DOUBLE PRECISION NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL,
        bytes BIGINT NOT NULL DEFAULT 0,
        PRIMARY KEY (owner, key)
    )""",
    "CREATE INDEX idempotency_by_expiry ON idempotency_keys(expires_at)",
)

_SCHEMA_V2 = (
    """CREATE TABLE instances (
        id TEXT PRIMARY KEY,
        started_at DOUBLE PRECISION NOT NULL,
        lease_until DOUBLE PRECISION NOT NULL
    )""",
    "ALTER TABLE tasks ADD COLUMN instance_id TEXT",
    "ALTER TABLE tasks ADD COLUMN cancel_requested_at DOUBLE PRECISION",
    "ALTER TABLE responses ADD COLUMN instance_id TEXT",
    "ALTER TABLE idempotency_keys ADD COLUMN instance_id TEXT",
)


def _m1_initial(conn: Conn) -> None:
    for statement in _SCHEMA_V1:
        conn.execute(statement)


def _m2_instances(conn: Conn) -> None:
    for statement in _SCHEMA_V2:
        conn.execute(statement)


_SCHEMA_V3 = (
    "ALTER TABLE tasks ADD COLUMN dialect TEXT",
    "ALTER TABLE tasks ADD COLUMN model TEXT",
)


def _m3_request_heads(conn: Conn) -> None:
    for statement in _SCHEMA_V3:
        conn.execute(statement)
    fill_request_heads(Sql(conn, "format"))


# Append-only, one for one with lmspd.store.sqlite.MIGRATIONS.
MIGRATIONS: list[Callable[[Conn], None]] = [_m1_initial, _m2_instances, _m3_request_heads]

# Any constant: it only has to be the same in every instance.
_MIGRATION_LOCK = 0x6C6D7370


# A task's events appended in one round trip (the hot path: every token of
# every running task): lock the task, check it, insert, bump last_seq,
# notify. Errors carry their own SQLSTATEs (class "LM"), mapped back to
# NotFound / TaskFinished / SequenceError.
_APPEND_FUNCTION = """
CREATE OR REPLACE FUNCTION lmspd_append_events(
    p_task TEXT, p_seqs BIGINT[], p_events TEXT[], p_datas TEXT[], p_bytes BIGINT
) RETURNS VOID LANGUAGE plpgsql AS $fn$
DECLARE
    t_status TEXT;
    t_last BIGINT;
BEGIN
    -- Per-token appends need not wait for the WAL flush (see the module doc).
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT status, last_seq INTO t_status, t_last FROM tasks WHERE id = p_task FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'task % not found', quote_literal(p_task) USING ERRCODE = 'LM404';
    END IF;
    IF t_status IN ('completed', 'failed', 'cancelled', 'incomplete') THEN
        RAISE EXCEPTION 'task % is already %', quote_literal(p_task), t_status USING ERRCODE = 'LM409';
    END IF;
    IF p_seqs[1] <= t_last THEN
        RAISE EXCEPTION 'event seq % for task % must be an integer above %', p_seqs[1],
            quote_literal(p_task), t_last USING ERRCODE = 'LM400';
    END IF;
    INSERT INTO task_events (task_id, seq, event, data)
        SELECT p_task, u.s, u.e, u.d FROM unnest(p_seqs, p_events, p_datas) AS u(s, e, d);
    UPDATE tasks SET last_seq = p_seqs[array_length(p_seqs, 1)], events_bytes = events_bytes + p_bytes
        WHERE id = p_task;
    PERFORM pg_notify('lmspd', 'events:' || p_task);
END
$fn$
"""

_APPEND_ERRORS: dict[str, type[StoreError]] = {
    "LM404": NotFound,
    "LM409": TaskFinished,
    "LM400": SequenceError,
}


def _notify(conn: Conn, kind: str, task_id: str) -> None:
    # Sent at commit, and only if the transaction commits.
    conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"{kind}:{task_id}"))


class PostgresStore(ResponseQueries, ConversationQueries, TaskQueries, IdempotencyQueries):
    """``Store`` on a PostgreSQL database, shared by every instance that opens it."""

    shared = True

    def __init__(
        self,
        dsn: str,
        *,
        clock: Callable[[], float] = time.time,
        retention: Retention = Retention(),
        max_chain_depth: int = 4096,
        instance_id: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        pool_size: int = 8,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self._dsn = dsn
        self._clock = clock
        self.retention = retention
        self.max_chain_depth = max_chain_depth
        self.instance_id = instance_id or new_instance_id()
        self.lease_s = lease_s
        self._notices = Notices()
        self._closed = False
        self._listener: threading.Thread | None = None
        self._listen_lock = threading.Lock()
        self._stop = threading.Event()
        # The lease's own connection (``heartbeat``): a pool that every
        # request has emptied, or a row lock, must not let the lease lapse.
        self._lease_lock = threading.Lock()
        self._lease_conn: Any = None
        self._connect_timeout_s = connect_timeout_s
        try:
            self._pool = ConnectionPool(
                dsn,
                min_size=1,
                max_size=pool_size,
                # Autocommit: a lone statement is its own transaction (one round
                # trip); several run inside ``conn.transaction()``.
                kwargs={"row_factory": dict_row, "connect_timeout": int(connect_timeout_s),
                        "autocommit": True},
                timeout=connect_timeout_s,
                open=False,
                name="lmspd",
            )
            self._pool.open(wait=True, timeout=connect_timeout_s)
        except Exception as exc:
            raise StoreError(f"cannot connect to PostgreSQL: {exc}") from exc
        try:
            self._migrate()
            self._register()
        except BaseException:
            self._pool.close()
            raise

    # --- connections and transactions ---------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("store is closed")

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Conn]:
        """One transaction: committed when the block ends, rolled back if it raises."""
        self._check_open()
        with self._pool.connection() as conn, conn.transaction():
            yield conn  # type: ignore[misc]  # the pool's row_factory is dict_row

    @contextlib.contextmanager
    def _single(self) -> Iterator[Conn]:
        """A connection for one statement (autocommit: no BEGIN/COMMIT round trips)."""
        self._check_open()
        with self._pool.connection() as conn:
            yield conn  # type: ignore[misc]  # the pool's row_factory is dict_row

    _write = _tx
    _read = _tx

    # The connection manager the shared aggregate modules use (lmspd.store.sql).
    insertion_order = "id"
    for_update = " FOR UPDATE"

    @contextlib.contextmanager
    def sql_write(self, *, durable: bool = False) -> Iterator[Sql]:
        # Every commit here waits for the WAL flush (only event appends relax it).
        with self._tx() as conn:
            yield Sql(conn, "format")

    @contextlib.contextmanager
    def sql_read(self) -> Iterator[Sql]:
        with self._tx() as conn:
            yield Sql(conn, "format")

    @contextlib.contextmanager
    def sql_snapshot(self) -> Iterator[Sql]:
        with self._tx() as conn:
            # Before any statement of the transaction: its snapshot is then the first statement's.
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            yield Sql(conn, "format")

    @contextlib.contextmanager
    def sql_single(self) -> Iterator[Sql]:
        with self._single() as conn:
            yield Sql(conn, "format")

    @staticmethod
    def octets(column: str) -> str:
        return f"octet_length({column})"

    def heartbeat(self) -> list[str]:
        """On a connection of its own, never the pool's (see ``__init__``);
        reconnected after a failure."""
        with self._lease_lock:
            self._check_open()
            if self._lease_conn is None or self._lease_conn.closed:
                self._lease_conn = psycopg.connect(self._dsn, autocommit=True, row_factory=dict_row,
                                                   connect_timeout=int(self._connect_timeout_s))
            conn = self._lease_conn
            try:
                with conn.transaction():
                    return self._heartbeat_in(Sql(conn, "format"))
            except psycopg.Error:
                conn.close()
                self._lease_conn = None
                raise

    def _migrate(self) -> None:
        with self._tx() as conn:
            # Two instances starting at once: one migrates, the other waits.
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS lmspd_schema (version INTEGER NOT NULL)")
            row = conn.execute("SELECT version FROM lmspd_schema").fetchone()
            version = 0 if row is None else row["version"]
            if version > len(MIGRATIONS):
                raise SchemaTooNew(
                    f"the database has schema version {version}; this lmspd knows "
                    f"versions up to {len(MIGRATIONS)}"
                )
            for migration in MIGRATIONS[version:]:
                migration(conn)
            if row is None:
                conn.execute("INSERT INTO lmspd_schema (version) VALUES (%s)", (len(MIGRATIONS),))
            elif version != len(MIGRATIONS):
                conn.execute("UPDATE lmspd_schema SET version = %s", (len(MIGRATIONS),))
            # Code, not data: replaced by every start, so it always matches
            # this lmspd (under the lock, so two starts never race on it).
            conn.execute(_APPEND_FUNCTION)

    def close(self) -> None:
        if self._closed:
            return
        with contextlib.suppress(Exception):
            with self._tx() as conn:
                # A clean stop ends this instance's lease at once.
                conn.execute("DELETE FROM instances WHERE id = %s", (self.instance_id,))
        self._closed = True
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=5)
        with self._lease_lock:
            if self._lease_conn is not None:
                self._lease_conn.close()
                self._lease_conn = None
        self._pool.close()

    def __enter__(self) -> PostgresStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _now(self, value: float | None = None) -> float:
        return self._clock() if value is None else value

    # --- instances, leases and notices -----------------------------------------

    # The database's clock less this host's, at the last renewal; the host's
    # wall clock, which it is measured against (replaced in tests to play a
    # host whose clock is off).
    _skew = 0.0
    _wall: Callable[[], float] = staticmethod(time.time)

    def _sync_lease_clock(self, sql: Sql) -> None:
        row = sql.first("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8 AS t")
        assert row is not None
        self._skew = float(row["t"]) - self._wall()

    def _lease_now(self) -> float:
        """The database's time, as of the host's clock (``clock``: a test's
        own clock moves it, as it moves every other time here)."""
        return self._clock() + self._skew

    # _register, heartbeat, request_cancel, release_task: lmspd.store.tasks (shared).

    def listen(self, callback: NoticeCallback) -> Callable[[], None]:
        remove = self._notices.add(callback)
        with self._listen_lock:
            if self._listener is None and not self._closed:
                ready = threading.Event()
                self._listener = threading.Thread(
                    target=self._listen_loop, args=(ready,), name="lmspd-pg-listen", daemon=True
                )
                self._listener.start()
                # Notices sent after listen() returns are not missed.
                ready.wait(10)
        return remove

    def _listen_loop(self, ready: threading.Event) -> None:
        backoff = 0.1
        first = True
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._dsn, autocommit=True, connect_timeout=10) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    ready.set()
                    if not first:
                        # Notices sent while we were away are gone: re-check all.
                        self._notices.send("resync", "")
                    first = False
                    backoff = 0.1
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            kind, _, task_id = note.payload.partition(":")
                            if kind in ("events", "cancel"):
                                self._notices.send(kind, task_id)  # type: ignore[arg-type]
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.warning("PostgreSQL notice listener lost its connection (%s); reconnecting", exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        ready.set()

    def _gone_sql(self, column: str) -> str:
        """Rows whose writer is not this instance and holds no live lease."""
        return (
            f"({column} IS NULL OR ({column} <> %(me)s AND NOT EXISTS ("
            f"SELECT 1 FROM instances i WHERE i.id = {column} AND i.lease_until > %(now)s)))"
        )

    # --- responses -------------------------------------------------------------

    # put_response, update_response: lmspd.store.responses (shared).

    def fail_interrupted_responses(self, error: JSON) -> list[str]:
        failed: list[str] = []
        now = self._lease_now()
        with self._write() as conn:
            rows = conn.execute(
                f"SELECT id, body FROM responses WHERE status IN {_ACTIVE_SQL} AND "
                f"{self._gone_sql('instance_id')} FOR UPDATE SKIP LOCKED",
                {"me": self.instance_id, "now": now},
            ).fetchall()
            for row in rows:
                response = json.loads(row["body"])
                response["status"] = "failed"
                response["error"] = error
                body = _dumps(response)
                conn.execute(
                    "UPDATE responses SET body = %s, status = 'failed', updated_at = %s, "
                    "bytes = bytes - %s + %s WHERE id = %s",
                    (body, self._clock(), _size(row["body"]), _size(body), row["id"]),
                )
                failed.append(row["id"])
        return failed

    # --- conversations -----------------------------------------------------------

    # Conversation writes: lmspd.store.conversations (shared).

    # --- tasks -------------------------------------------------------------------

    # create_task, set_task_status: lmspd.store.tasks (shared).

    def _notice_in(self, sql: Sql, kind: Literal["events", "cancel"], task_id: str) -> None:
        _notify(sql.conn, kind, task_id)

    def append_event(self, task_id: str, seq: int, event: str, data: JSON) -> None:
        self.append_events(task_id, [(seq, event, data)])

    def append_events(self, task_id: str, events: Sequence[tuple[int, str, JSON]]) -> None:
        if not events:
            return
        seqs: list[int] = []
        names: list[str] = []
        bodies: list[str] = []
        added = 0
        for seq, name, data in events:
            # Within the batch here; against the stored log in the function.
            if not isinstance(seq, int) or isinstance(seq, bool) or (seqs and seq <= seqs[-1]):
                above = seqs[-1] if seqs else "the task's last seq"
                raise SequenceError(
                    f"event seq {seq!r} for task {task_id!r} must be an integer above {above}"
                )
            body = _dumps(data)
            added += _size(name) + _size(body)
            seqs.append(seq)
            names.append(name)
            bodies.append(body)
        try:
            with self._single() as conn:
                conn.execute(
                    "SELECT lmspd_append_events(%s, %s::bigint[], %s::text[], %s::text[], %s)",
                    (task_id, seqs, names, bodies, added),
                )
        except psycopg.Error as exc:
            mapped = _APPEND_ERRORS.get(exc.sqlstate or "")
            if mapped is None:
                raise
            raise mapped(exc.diag.message_primary or str(exc)) from None

    def events_after(
        self, owner: str, task_id: str, after_seq: int = 0, limit: int = 1000
    ) -> list[TaskEvent] | None:
        if after_seq < 0:
            raise ValueError(f"after_seq must be at least 0, got {after_seq}")
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        if unstorable(task_id):
            return None
        # One statement (one round trip, one snapshot): every reader of every
        # task runs this once per notice.
        with self._single() as conn:
            rows = conn.execute(
                "SELECT t.first_retained_seq, t.last_seq, e.seq, e.event, e.data FROM tasks t "
                "LEFT JOIN LATERAL (SELECT seq, event, data FROM task_events "
                "WHERE task_id = t.id AND seq > %s ORDER BY seq LIMIT %s) e ON true "
                "WHERE t.id = %s AND t.owner = %s ORDER BY e.seq",
                (after_seq, limit, task_id, owner),
            ).fetchall()
        if not rows:
            return None
        first_retained = rows[0]["first_retained_seq"]
        if after_seq + 1 < first_retained:
            raise EventsExpired(task_id, after_seq, first_retained, rows[0]["last_seq"])
        return [
            TaskEvent(r["seq"], r["event"], json.loads(r["data"]))
            for r in rows
            if r["seq"] is not None  # the task row alone: no events after after_seq
        ]

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
        with self._read() as conn:
            ids = [
                r["id"]
                for r in conn.execute(
                    f"SELECT id FROM tasks WHERE status IN {_ACTIVE_SQL} AND "
                    f"{self._gone_sql('instance_id')} ORDER BY created_at, id",
                    {"me": self.instance_id, "now": self._lease_now()},
                )
            ]
        # One transaction per task: a long backlog never holds many locks.
        for task_id in ids:
            with self._write() as conn:
                row = conn.execute(
                    f"SELECT id FROM tasks WHERE id = %(id)s AND status IN {_ACTIVE_SQL} AND "
                    f"{self._gone_sql('instance_id')} FOR UPDATE SKIP LOCKED",
                    {"id": task_id, "me": self.instance_id, "now": self._lease_now()},
                ).fetchone()
                if row is None:
                    continue  # finished meanwhile, or another survivor has it
                failed.append(self._fail_interrupted(Sql(conn, "format"), task_id, error, build, close_log))
        return failed

    # --- idempotency keys -------------------------------------------------------------

    # idempotency_begin/finish/abandon: lmspd.store.idempotency (shared).

    def abandon_interrupted_idempotency(self) -> int:
        with self._write() as conn:
            return conn.execute(
                f"DELETE FROM idempotency_keys WHERE state = 'in_progress' AND "
                f"{self._gone_sql('instance_id')}",
                {"me": self.instance_id, "now": self._lease_now()},
            ).rowcount

    # --- bounds ------------------------------------------------------------------------

    def prune(self, now: float | None = None) -> dict[str, int]:
        now = self._now(now)
        removed = pruning.prune(self, self.retention, now)
        with self._write() as conn:
            # Instances that stopped long ago: their rows are failed by now.
            conn.execute(
                "DELETE FROM instances WHERE lease_until < %s", (now - 10 * self.lease_s,)
            )
        return removed

    def stats(self) -> dict[str, int]:
        with self.sql_read() as sql:
            row = sql.first("SELECT version AS n FROM lmspd_schema")
            return {"schema_version": int(row["n"]) if row is not None else 0, **pruning.stats(sql)}

