"""Handing the scheduler thread's events to the event loops that wait for
them: once per step, not once per event, and without giving the GIL away
in the middle of a step (``Outbox``)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import weakref
from collections import deque
from typing import Callable

from lmspd.core.events import EngineEvent


class Outbox:
    """Events the scheduler thread produced, handed to the event loop once
    per step rather than once per event. ``emit`` is called on the
    scheduler thread only.

    The hand-over must not give the GIL away. ``call_soon_threadsafe``
    writes the loop's self-pipe through ``socket.send``, which releases the
    GIL: the loop thread, woken by that very write, takes it first and keeps
    it for up to the switch interval (5 ms) while the scheduler waits to
    return from ``send`` — measured ~4 ms per step on the loaded 2-core
    machine, ten times the rest of the step's host work. So each loop gets a
    pipe of our own (``_Waker``) that the scheduler writes with the GIL
    held, right before ``llama_decode`` releases it (``Scheduler._step``):
    the loop wakes, and does its share of the work during the decode."""

    __slots__ = ("_pending", "_wakers")

    def __init__(self) -> None:
        self._pending: list[tuple[_Waker | asyncio.AbstractEventLoop, Callable[[EngineEvent], None],
                                  EngineEvent]] = []
        self._wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Waker | None] = (
            weakref.WeakKeyDictionary())

    def sender(self, loop: asyncio.AbstractEventLoop,
               put: Callable[[EngineEvent], None]) -> Callable[[EngineEvent], None]:
        """Called on ``loop``'s thread (its waker is registered there)."""
        try:
            waker = self._wakers[loop]
        except KeyError:
            waker = self._wakers[loop] = _Waker.attach(loop)
        target: _Waker | asyncio.AbstractEventLoop = loop if waker is None else waker
        pending = self._pending

        def emit(event: EngineEvent) -> None:
            pending.append((target, put, event))
        return emit

    def flush(self, *, yield_gil: bool = False) -> None:
        """``yield_gil``: let the loop take the GIL now, as it wakes (a
        first token: its client waits, the scheduler's next step can)."""
        if not self._pending:
            return
        batch = self._pending[:]
        self._pending.clear()
        target = batch[0][0]
        if all(item[0] is target for item in batch):
            _hand_over(target, batch, yield_gil)
            return
        by_target: dict[_Waker | asyncio.AbstractEventLoop, list] = {}
        for item in batch:
            by_target.setdefault(item[0], []).append(item)
        for target, items in by_target.items():
            _hand_over(target, items, yield_gil)


def _hand_over(target: "_Waker | asyncio.AbstractEventLoop", items: list, yield_gil: bool) -> None:
    if isinstance(target, _Waker):
        target.post(items, yield_gil)
        return
    try:
        target.call_soon_threadsafe(_deliver, items)
    except RuntimeError:  # that loop is closed: nobody is listening
        pass


def _deliver(items: list) -> None:
    for _, put, event in items:
        put(event)


def _gil_holding_write() -> Callable[[int, bytes, int], int] | None:
    """libc's ``write`` called with the GIL held (``ctypes.PyDLL``), or None
    where there is none to be found."""
    try:
        write = ctypes.PyDLL(None).write
    except (AttributeError, OSError, TypeError):
        return None
    write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    write.restype = ctypes.c_ssize_t
    return write


_WRITE = _gil_holding_write()


class _Waker:
    """A pipe whose read end the loop watches (``add_reader``) and a queue
    of event batches: ``post`` (scheduler thread) queues a batch and writes
    a byte, without releasing the GIL (the write end does not block: a full
    pipe already has the loop awake); ``_drain`` (the loop) delivers every
    batch queued, in order."""

    __slots__ = ("_batches", "_r", "_w", "_loop", "__weakref__")

    def __init__(self, r: int, w: int, loop: asyncio.AbstractEventLoop) -> None:
        self._batches: deque[list] = deque()
        self._r, self._w = r, w
        # Weak: the loop holds the waker (its reader), and a closed loop must be freed with it.
        self._loop = weakref.ref(loop)

    @classmethod
    def attach(cls, loop: asyncio.AbstractEventLoop) -> "_Waker | None":
        """A waker on ``loop`` (called on its thread), or None where the loop
        cannot watch a pipe (Windows' proactor) or no GIL-holding write exists."""
        if _WRITE is None:
            return None
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        waker = cls(r, w, loop)
        try:
            loop.add_reader(r, waker._drain)
        except (NotImplementedError, RuntimeError):
            os.close(r)
            os.close(w)
            return None
        # The loop holds the waker (its reader); the pipe goes with the waker.
        weakref.finalize(waker, _close_pipe, r, w)
        return waker

    def post(self, items: list, yield_gil: bool = False) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return  # nobody is listening
        self._batches.append(items)
        if yield_gil:
            try:
                os.write(self._w, b"\0")  # releases the GIL: the loop, woken, takes it
            except BlockingIOError:  # a full pipe: the loop is awake already
                pass
            return
        _WRITE(self._w, b"\0", 1)  # type: ignore[misc]  # -1 (EAGAIN) on a full pipe: the loop is awake already

    def _drain(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        batches = self._batches
        while batches:
            _deliver(batches.popleft())


def _close_pipe(r: int, w: int) -> None:
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass
