"""Reading an async iterator with a deadline that does not end it.

A stream must say something at least every ``sse_keepalive_s`` (Codex
counts only events on its idle timer), also between two engine events: a
long tool call whose arguments are not streamed, a provider that stalls.
``asyncio.wait_for`` on ``anext()`` cannot do that: a timeout cancels the
step, and a cancelled async generator is finished. A task per step could,
at a task switch per token. ``Paced`` instead steps the iterator by hand in
the caller's own task, as a task would: when the step waits on a future, the
caller waits on that future with the deadline, and on a timeout leaves the
step suspended, to be resumed by the next call. Events that are already
there cost no timer at all; a timer exists only while the source is silent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


class _Idle:
    def __repr__(self) -> str:
        return "IDLE"


# What ``Paced.next`` returns when the deadline passed first.
IDLE: Any = _Idle()


class Paced(Generic[T]):
    """``await paced.next(timeout)``: the source's next value, or ``IDLE``
    if none came within ``timeout`` seconds (None: wait as long as it
    takes); ``StopAsyncIteration`` at its end. ``aclose()`` ends a step left
    suspended (the source hears a ``CancelledError`` where it waits, as it
    would from a cancelled task)."""

    def __init__(self, source: AsyncIterator[T]) -> None:
        self._source = source
        # The step in progress, and the future it waits on.
        self._step: Coroutine[Any, Any, T] | None = None
        self._waiting: asyncio.Future[Any] | None = None
        self._value: Any = None

    async def next(self, timeout: float | None) -> T:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        if self._step is None:
            self._step = cast("Coroutine[Any, Any, T]", self._source.__anext__())
            self._advance(None)
        while self._step is not None:
            waiting = self._waiting
            try:
                if waiting is None:
                    # A bare yield (``asyncio.sleep(0)``): the loop gets its turn.
                    await asyncio.sleep(0)
                elif not waiting.done():
                    left = None if deadline is None else deadline - loop.time()
                    if left is not None and left <= 0:
                        return cast(T, IDLE)
                    await asyncio.wait({waiting}, timeout=left)
                    if not waiting.done():
                        return cast(T, IDLE)
            except asyncio.CancelledError as exc:
                # As a task does: the step hears the cancellation where it
                # waits (the upstream engine interrupts its own read so, and
                # goes on to its terminal event).
                if waiting is not None and waiting.cancel():
                    self._advance(None)
                else:
                    self._advance(exc)
                continue
            self._advance(None)
        return cast(T, self._value)

    def _advance(self, exc: BaseException | None) -> None:
        """One step of the suspended coroutine: it finishes (``_step`` is
        cleared, ``_value`` holds its result) or waits on a future again."""
        step = self._step
        assert step is not None
        try:
            yielded = step.send(None) if exc is None else step.throw(exc)
        except StopIteration as stop:
            self._step, self._waiting, self._value = None, None, stop.value
            return
        except BaseException:
            self._step = self._waiting = None
            raise
        if yielded is not None:
            # What a task does with a future its coroutine yields.
            yielded._asyncio_future_blocking = False
        self._waiting = yielded

    async def aclose(self) -> None:
        if self._step is None:
            return
        try:
            self._advance(asyncio.CancelledError())
            # Its cleanup may wait (an upstream stream closing): see it through.
            while self._step is not None:
                if self._waiting is not None:
                    await asyncio.wait({self._waiting})
                else:
                    await asyncio.sleep(0)
                self._advance(None)
        except (asyncio.CancelledError, StopAsyncIteration):
            pass
