"""Store calls from the event loop, run on a small pool of their own.

Every ``Store`` method is synchronous and may wait: SQLite commits with a
full sync, PostgreSQL waits for a pooled connection or a row lock, and a
write of an 8 MiB idempotency reply takes as long as the disk does. Run on
the event loop, any of them freezes every stream of the instance; on the
default thread pool, they would queue behind body decoding and WebSocket
frames. ``StoreCalls`` runs them on threads nothing else uses, and refuses
(503 ``server_overloaded``) once too many are waiting rather than queue
without a bound.

Order: a handler awaits each call before it goes on, so what one request
writes happens in the order it wrote it (a response is stored before its
id is answered; an idempotency key is claimed before the work it guards).
A task's events keep their own ordered writer (``lmspd.tasks.manager``).

What is never refused: the write that keeps work already done (the final
state of a finished generation, ``StoreCalls.unrefused``). Admission exists
so that new work waits for the store rather than piling up; a result that
exists only in memory is not new work, and refusing its write loses it.
Those writes are bounded anyway, by the generations running at once. A
store error that may pass (``transient``: SQLite busy or I/O, PostgreSQL's
pool or connection) is retried with backoff (``retried``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import sqlite3
import sys
import threading
from collections.abc import Awaitable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, ParamSpec, TypeVar

from lmspd.core.errors import ApiError
from lmspd.core.limits import STORE_CALL_THREADS, STORE_CALLS_WAITING

P = ParamSpec("P")
T = TypeVar("T")

__all__ = ["FINAL_WRITE_DELAYS_S", "StoreCalls", "backoff", "retried", "transient"]

log = logging.getLogger("lmspd.store")

# Waits between the tries of a finished foreground generation's final write
# (a client waits for its reply meanwhile): under a second in all, beside
# the waits inside the store (SQLite's busy timeout, the pool's).
FINAL_WRITE_DELAYS_S = (0.05, 0.2, 0.5)


# SQLite's errors that pass: another writer holds the lock, or the disk
# failed or filled (and may be freed). Not "no such table", "readonly
# database", "too many SQL variables": those stay, and a retry until
# shutdown would only hold a task in_progress.
_SQLITE_PASSING = ("database is locked", "database table is locked", "database is busy", "disk i/o error",
                   "database or disk is full")
# PostgreSQL's SQLSTATE classes that pass: connection exceptions (08),
# transaction rollbacks (40: serialization failures, deadlocks), insufficient
# resources (53), operator intervention (57: a restart, a cancelled query).
_PG_PASSING_CLASSES = ("08", "40", "53", "57")


def transient(exc: BaseException) -> bool:
    """Whether a store call that raised ``exc`` may succeed if tried again:
    SQLite busy, locked, I/O or full; PostgreSQL's lost connections (no
    SQLSTATE: the client's own error), pool timeouts, and the SQLSTATE
    classes above. Not: a closed store, a bug (``Duplicate``,
    ``SequenceError``, a constraint), a task someone else ended."""
    if isinstance(exc, sqlite3.OperationalError):
        message = str(exc).lower()
        return any(text in message for text in _SQLITE_PASSING)
    psycopg = sys.modules.get("psycopg")  # loaded only by the PostgreSQL store
    if psycopg is None:
        return False
    pool = sys.modules.get("psycopg_pool")
    if pool is not None and isinstance(exc, pool.PoolTimeout):
        return True
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = getattr(exc, "sqlstate", None)
    return state is None or str(state)[:2] in _PG_PASSING_CLASSES


def backoff(first_s: float = 0.05, most_s: float = 2.0) -> Iterator[float]:
    """Endless waits, doubling from ``first_s`` up to ``most_s``."""
    delay = first_s
    while True:
        yield delay
        delay = min(delay * 2, most_s)


async def retried(attempt: Callable[[], Awaitable[T]], delays: Iterable[float], what: str,
                  *, wait: Callable[[float], Awaitable[bool]] | None = None) -> T:
    """``await attempt()``, tried again after each of ``delays`` while it
    raises a ``transient`` error; the last error is raised. ``wait(delay)``
    (default: sleep) returns False to stop trying early (a server shutting
    down)."""
    for delay in delays:
        try:
            return await attempt()
        except Exception as exc:
            if not transient(exc):
                raise
            log.warning("%s failed (%s: %s); trying again in %.2f s", what, type(exc).__name__, exc, delay)
        if wait is None:
            await asyncio.sleep(delay)
        elif not await wait(delay):
            break
    return await attempt()


class StoreCalls:
    """``await calls(store.get_response, owner, rid)``: ``fn(*args)`` on a
    store thread; 503 while ``max_waiting`` calls are already queued."""

    def __init__(self, threads: int = STORE_CALL_THREADS, max_waiting: int = STORE_CALLS_WAITING) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lmspd-store-call")
        self._max_waiting = max_waiting
        self._outstanding = 0
        self._lock = threading.Lock()
        self._threads = threads

    @property
    def outstanding(self) -> int:
        return self._outstanding

    async def __call__(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._run(True, functools.partial(fn, *args, **kwargs))

    async def unrefused(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """As ``self(fn, ...)``, but never refused for a full queue: for the
        write that keeps a finished generation (it waits its turn instead;
        such writes are as many as the generations running at once)."""
        return await self._run(False, functools.partial(fn, *args, **kwargs))

    async def _run(self, admit: bool, call: Callable[[], T]) -> T:
        with self._lock:
            if admit and self._outstanding >= self._threads + self._max_waiting:
                raise ApiError("server_overloaded",
                               f"The store has {self._outstanding} calls in progress or waiting (at most "
                               f"{self._threads + self._max_waiting}); retry shortly.",
                               headers={"Retry-After": "1"})
            self._outstanding += 1
        try:
            in_context = functools.partial(contextvars.copy_context().run, call)
            return await asyncio.get_running_loop().run_in_executor(self._pool, in_context)
        finally:
            with self._lock:
                self._outstanding -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=True)
