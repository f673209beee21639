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
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, ParamSpec, TypeVar

from lmspd.core.errors import ApiError
from lmspd.core.limits import STORE_CALL_THREADS, STORE_CALLS_WAITING

P = ParamSpec("P")
T = TypeVar("T")

__all__ = ["StoreCalls"]


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
        with self._lock:
            if self._outstanding >= self._threads + self._max_waiting:
                raise ApiError("server_overloaded",
                               f"The store has {self._outstanding} calls in progress or waiting (at most "
                               f"{self._threads + self._max_waiting}); retry shortly.",
                               headers={"Retry-After": "1"})
            self._outstanding += 1
        try:
            call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
            return await asyncio.get_running_loop().run_in_executor(self._pool, call)
        finally:
            with self._lock:
                self._outstanding -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=True)
