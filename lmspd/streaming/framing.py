"""Framing a stream's events without encoding a large response on the event loop.

The lifecycle events of an OpenAI stream (response.created, in_progress,
completed, failed, and a keep-alive in_progress every ``sse_keepalive_s``)
each carry the whole Response object, which echoes the request: its
instructions and tools, up to megabytes. Encoded with each event on the
event loop, that stalled every other stream ~100 ms an event (8 MB).

A stream's ``Framer`` encodes the large values of the first response object
it frames once, off the loop (``sse.encode_large``), and splices their JSON
into that frame and every later one holding the same values
(``sse.Spliced``): what is left to encode per event is the small rest.
Events without a response object, the deltas, are framed as before, and so
is every event of a response with nothing large (known from the request's
size, or found out once).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from lmspd.streaming.sse import Encoded, Spliced, encode_large

T = TypeVar("T")

# Runs a function in a worker thread; the route gives its pool.
OffLoop = Callable[[Callable[[], dict[str, Encoded]]], Awaitable[dict[str, Encoded]]]


class Framer(Generic[T]):
    """Frames one stream's wire events with ``frame`` (SSE, or a WebSocket's
    text): ``await framer(seq, name, data)``. ``small``: the request was
    small (``lmspd.bodies.INLINE_BYTES``), so no echo of it is large and no
    event needs more than ``frame``."""

    def __init__(self, frame: Callable[[int, str, dict[str, Any]], T], off_loop: OffLoop, *,
                 small: bool = False) -> None:
        self._frame = frame
        self._off_loop = off_loop
        self._small = small
        # The large values of the response, encoded; None until its first
        # response object is framed.
        self._parts: dict[str, Encoded] | None = None

    async def __call__(self, seq: int, name: str, data: dict[str, Any]) -> T:
        response = data.get("response")
        if self._small or not isinstance(response, dict):
            return self._frame(seq, name, data)
        parts = self._parts
        if parts is None or not any(response.get(key) is part.value for key, part in parts.items()):
            # The response's first object, or one read back from the store
            # (a task's log: not the objects encoded before).
            parts = await self._off_loop(lambda: encode_large(response))
            if self._parts is None and not parts:
                self._small = True  # it echoes nothing large: its next objects neither
            self._parts = parts
        if not parts:
            return self._frame(seq, name, data)
        return self._frame(seq, name, Spliced(data, parts))
