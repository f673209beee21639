"""What every engine offers the core, and the model queue that admits
``concurrency`` generations at a time (a llama engine's ``--parallel``).

An engine turns a neutral ``Conversation`` and its run's ``RunContext`` (who
it runs for, how) into neutral events. It never knows which dialect asked,
and the dialects never see an engine's internals.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol

from lmspd.core.conversation import Conversation, SamplingDefaults
from lmspd.core.errors import ApiError
from lmspd.core.events import EngineEvent
from lmspd.core.limits import QueueLimits
from lmspd.core.run import RunContext

CAPABILITIES = ("streaming", "tools", "structured_output", "conversations", "reasoning", "tasks")


@dataclass
class ModelInfo:
    id: str
    context_window: int
    capabilities: dict[str, bool]
    created: int = field(default_factory=lambda: int(time.time()))
    owned_by: str = "lmspd"
    # Where the weights live or which provider serves them (never a secret).
    source: str = ""
    # Generations the engine runs at once: the embedded model's sequences
    # (--parallel); a remote provider batches requests itself, so the
    # upstream engine takes many.
    max_concurrency: int = 1
    # The model's own sampling settings, for what a request leaves unset
    # (none for a remote provider: it applies its own).
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)


class CancelToken:
    """Set by the request side; polled by the engine between tokens."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str = "cancelled"
        self._callbacks: list[Callable[[], object]] = []

    def cancel(self, reason: str = "cancelled") -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()
            for callback in list(self._callbacks):
                callback()

    def on_cancel(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call ``callback`` (on the cancelling thread) when cancelled, for an
        engine that waits on I/O rather than polling; returns its remover."""
        self._callbacks.append(callback)

        def remove() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        return remove

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()


class Prepared(Protocol):
    """An engine's ready-to-run form of a conversation (prompt rendered,
    tokens counted, limits checked) — made before any byte is sent."""

    input_tokens: int


class Engine(Protocol):
    info: ModelInfo
    @property
    def opens_first(self) -> bool:
        """Whether ``open`` has work to do: reaching the model before the
        first response byte (the upstream engine's provider request), so that
        a refusal is still an HTTP error reply, not a broken stream."""

    def announce(self, conversation: Conversation) -> AbstractContextManager[None]:
        """Held by the service around an admitted request's wait for a
        preparing thread (``Service.begin``): an engine that batches requests
        arriving together may wait for it. ``contextlib.nullcontext()``
        where nothing does."""

    def prepare(self, conversation: Conversation, run: RunContext) -> Prepared:
        """Validate and render; raise ``ApiError`` for anything the client got wrong.
        Neither ``conversation`` nor ``run`` is written: a prepared form that
        differs (repaired, truncated) holds its own copy."""

    async def open(self, prepared: Prepared, cancel: CancelToken) -> None:
        """Reach the model (``opens_first``); a no-op for engines in this
        process. Called at most once, with the queue slot held; one that
        raises leaves nothing open."""

    async def discard(self, prepared: Prepared) -> None:
        """Give back what ``open`` reached when no generation will take it
        (the run's events were dropped, or never read, before ``generate``
        started): the provider request is closed and its endpoint's count
        returned. Safe to call again, and after ``generate`` started (which
        then owns it): nothing is left to give back. A no-op for engines in
        this process."""

    def generate(self, prepared: Prepared, cancel: CancelToken,
                 response_id: str | None = None) -> AsyncIterator[EngineEvent]:
        """Run one generation; ends with exactly one ``Finished`` or ``Failed``.
        ``response_id`` names the response it produces. It may start at the
        call, before the events are read (the embedded engine does): a
        caller that stops reading before the end cancels ``cancel``."""

    def count_tokens(self, conversation: Conversation) -> int:
        ...

    def stats(self) -> dict[str, Any]:
        ...

    async def aclose(self) -> None:
        ...


class ModelQueue:
    """FIFO admission to a model that runs ``concurrency`` generations at a
    time (an embedded model's sequences; while one is free a request starts
    at once, whatever else is generating).

    ``admit()`` is synchronous so that an overloaded server answers 503
    before any response header is sent; the returned ticket then waits for
    its turn. A waiter whose task is cancelled (its client went away) leaves
    the queue without ever running.
    """

    def __init__(self, limits: QueueLimits, concurrency: int = 1) -> None:
        self._limits = limits
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._concurrency = max(1, concurrency)
        self._running = 0

    @property
    def pending(self) -> int:
        return len(self._waiters)

    @property
    def busy(self) -> bool:
        """Something is generating (not: no room left)."""
        return self._running > 0

    @property
    def running(self) -> int:
        return self._running

    @property
    def _full(self) -> bool:
        return self._running >= self._concurrency

    def admit(self) -> "QueueTicket":
        if self._full and len(self._waiters) >= self._limits.max_pending:
            raise ApiError(
                "server_overloaded",
                f"The model is busy and {self.pending} requests are already waiting; retry later.",
                headers={"Retry-After": str(self._limits.retry_after_s)},
            )
        ticket = QueueTicket(self)
        if self._full:
            ticket._future = asyncio.get_running_loop().create_future()
            self._waiters.append(ticket._future)
        else:
            self._running += 1
            ticket._holding = True
        return ticket

    def _release(self) -> None:
        # The slot passes straight to the next waiter, if any.
        while self._waiters:
            nxt = self._waiters.popleft()
            if not nxt.done():
                nxt.set_result(None)
                return
        self._running -= 1


class QueueTicket:
    def __init__(self, queue: ModelQueue) -> None:
        self._queue = queue
        self._future: asyncio.Future[None] | None = None
        self._holding = False
        self._released = False

    @property
    def ready(self) -> bool:
        """Admitted straight away: ``wait()`` will not wait."""
        return self._holding and not self._released

    async def wait(self) -> None:
        if self._holding:
            return
        assert self._future is not None
        try:
            await self._future
            if self._released:
                # Released while its turn came (``release`` passed the slot on):
                # whoever waits must not run without one.
                raise asyncio.CancelledError
        except asyncio.CancelledError:
            if self._future.done() and not self._future.cancelled():
                # Our turn came just as we were cancelled: pass it on.
                self._holding = True
                self.release()
            else:
                self._future.cancel()
                try:
                    self._queue._waiters.remove(self._future)
                except ValueError:
                    pass
                self._released = True
            raise
        self._holding = True

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._holding:
            self._queue._release()
        elif self._future is not None:
            if self._future.done() and not self._future.cancelled():
                # The slot was handed over and ``wait`` has not resumed to
                # take it (a client gone in that instant): pass it on, or
                # the model keeps one slot fewer for good.
                self._queue._release()
                return
            self._future.cancel()
            try:
                self._queue._waiters.remove(self._future)
            except ValueError:
                pass

    async def __aenter__(self) -> "QueueTicket":
        await self.wait()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()
