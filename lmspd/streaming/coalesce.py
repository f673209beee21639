"""ASGI middleware: join stream body chunks produced back to back into one write.

A streaming handler sends one ``http.response.body`` message per SSE event.
When events come in bursts (a provider flushing many tokens at once, the
close of a response), each would cost its own HTTP framing and socket write
-- on this kind of machine a write costs tens of microseconds, more than
building the event. This layer holds body chunks only while the handler
keeps producing without yielding to the event loop, and writes them as one
chunk as soon as it yields. Nothing waits for more data: a lone event is
written on the next loop iteration, and a long burst is cut every
``max_delay_s`` or ``max_bytes`` so that its first events are not held back.

Back-pressure is kept: a write that the server pauses (slow client) makes
the next chunk wait for it, exactly as the plain ``send`` would.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CoalescingMiddleware"]


class _Coalescer:
    def __init__(self, send: Send, max_bytes: int, max_delay_s: float) -> None:
        self._send = send
        self._max_bytes = max_bytes
        self._max_delay_s = max_delay_s
        self._pending: list[bytes] = []
        self._size = 0
        self._since = 0.0
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    async def __call__(self, message: Message) -> None:
        if self._error is not None:
            raise self._error
        if message["type"] != "http.response.body" or not message.get("more_body"):
            await self.flush()
            await self._send(message)
            return
        body = message.get("body", b"")
        if not body:
            return
        if not self._pending:
            self._since = time.perf_counter()
        self._pending.append(body)
        self._size += len(body)
        if self._size >= self._max_bytes or time.perf_counter() - self._since >= self._max_delay_s:
            await self.flush()
        elif self._task is None:
            # Runs as soon as the handler yields to the loop.
            self._task = asyncio.get_running_loop().create_task(self._write_later())

    async def flush(self) -> None:
        task = self._task
        if task is not None:
            # Shielded: a cancelled handler must not tear a write in half.
            await asyncio.shield(task)
        if self._error is not None:
            raise self._error
        if self._pending:
            await self._write()

    async def _write(self) -> None:
        body = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending.clear()
        self._size = 0
        await self._send({"type": "http.response.body", "body": body, "more_body": True})

    async def _write_later(self) -> None:
        try:
            # What arrived while a write waited (a slow client) goes next:
            # no task is started for it while this one runs.
            while self._pending:
                await self._write()
        except Exception as exc:  # the client went away: the handler hears it next
            self._error = exc
        finally:
            self._task = None

    def abandon(self) -> None:
        if self._task is not None:
            self._task.cancel()


class CoalescingMiddleware:
    def __init__(self, app: ASGIApp, *, max_bytes: int = 64 * 1024, max_delay_s: float = 0.0005) -> None:
        self.app = app
        self._max_bytes = max_bytes
        self._max_delay_s = max_delay_s

    def __getattr__(self, name: str) -> Any:
        # ``app.state`` and friends stay reachable through the wrapper.
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        coalescer = _Coalescer(send, self._max_bytes, self._max_delay_s)
        try:
            await self.app(scope, receive, coalescer)
        except BaseException:
            coalescer.abandon()
            raise
        await coalescer.flush()
