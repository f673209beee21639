"""What every HTTP handler in ``lmspd.routes`` shares: the application
state, credentials, query parameters, and the two ways a reply leaves
(JSON or SSE)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Send

from lmspd.auth import Authenticator, Principal
from lmspd.config import Settings
from lmspd.connections import ConnectionSlots
from lmspd.core.errors import invalid
from lmspd.core.limits import REPLY_ENCODE_WORKERS, RequestLimits
from lmspd.core.sealing import Sealer
from lmspd.dialects import lmsp
from lmspd.service import Service
from lmspd.store.base import Store
from lmspd.store.calls import StoreCalls
from lmspd.streaming.sse import SSE_HEADERS, SSE_KEEPALIVE, dumps, dumps_in_pieces
from lmspd.tasks.manager import TaskManager

log = logging.getLogger("lmspd.http")


class LmspdApp:
    """The application state every handler needs."""

    def __init__(self, settings: Settings, service: Service, store: Store) -> None:
        self.settings = settings
        self.service = service
        self.store = store
        # Handlers reach the store through this: off the event loop.
        self.calls = StoreCalls()
        self.tasks = TaskManager(store)
        self.auth = Authenticator(settings.api_keys)
        # The server key (the engine seals reasoning with the same one):
        # compaction items are sealed and opened here.
        self.sealer = Sealer.from_data_dir(Path(settings.data_dir))
        self.websocket_slots = ConnectionSlots(settings.limits)

    @property
    def limits(self) -> RequestLimits:
        return self.settings.limits.request


def app_state(request: Request) -> LmspdApp:
    return request.app.state.lmspd


def principal(request: Request, scope: str) -> Principal:
    who = app_state(request).auth.authenticate(request)
    who.require(scope)
    return who


def lmsp_request(request: Request, scope: str) -> Principal:
    """An LMSP route's preamble: version, then credential."""
    lmsp.check_version(request.headers.get("lmsp-version"))
    return principal(request, scope)


def json_reply(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(body), status_code=status, headers=headers, media_type="application/json")


async def json_reply_off_loop(build: Callable[[], Any], status: int = 200,
                             headers: dict[str, str] | None = None) -> Response:
    """A JSON reply whose size follows stored or generated data (a page of
    history, a stored or finished response, a compacted window: megabytes at
    worst): ``build()`` and its serialization run in a pool of their own
    (``REPLY_ENCODE_WORKERS``), encoded member by member
    (``dumps_in_pieces``: a thread in one long call of the encoder stalls
    the loop as surely as the loop itself), so that one such reply never
    stalls the other streams. Not the store's pool, which refuses when busy:
    a finished generation's answer must not be lost to a 503. ``build`` runs
    later, in that thread: it must read only what no longer changes (a
    finished response, not a running one's live state)."""
    def encode() -> Response:
        return Response(dumps_in_pieces(build()), status_code=status, headers=headers, media_type="application/json")

    return await asyncio.get_running_loop().run_in_executor(_reply_pool(), encode)


@functools.cache
def _reply_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(REPLY_ENCODE_WORKERS, thread_name_prefix="lmspd-reply")


def sse_reply(chunks: AsyncIterator[bytes], headers: dict[str, str] | None = None, *,
              keepalive_s: float) -> StreamingResponse:
    return SseResponse(chunks, headers={**SSE_HEADERS, **(headers or {})}, keepalive_s=keepalive_s)


class SseResponse(StreamingResponse):
    """An SSE stream that writes a comment line (``SSE_KEEPALIVE``) whenever
    it has sent nothing for ``keepalive_s``. One timer task per stream, not
    per event: an event costs an uncontended lock and a clock read."""

    def __init__(self, chunks: AsyncIterator[bytes], *, headers: dict[str, str], keepalive_s: float) -> None:
        super().__init__(chunks, media_type="text/event-stream", headers=headers)
        self.keepalive_s = keepalive_s

    async def stream_response(self, send: Send) -> None:
        try:
            await self._write_stream(send)
        finally:
            # Closed here, not when collected: starlette never closes the
            # body. A client that left while a write was paused cancels this
            # task there, outside the generator, which stayed suspended with
            # its run, its queue slot and the generation going on until the
            # garbage collector found it. Closing it runs its clean-up now.
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception:
                    log.exception("closing an event stream failed")

    async def _write_stream(self, send: Send) -> None:
        every = self.keepalive_s
        if every <= 0:
            await super().stream_response(send)
            return
        loop = asyncio.get_running_loop()
        # One writer at a time: an event and a keep-alive never interleave.
        lock = asyncio.Lock()
        last = loop.time()

        async def keep_alive() -> None:
            nonlocal last
            while True:
                await asyncio.sleep(max(0.0, last + every - loop.time()))
                if loop.time() - last < every:
                    continue
                async with lock:
                    try:
                        await send({"type": "http.response.body", "body": SSE_KEEPALIVE, "more_body": True})
                    except Exception:  # the client left: the stream's own next write hears it
                        return
                    last = loop.time()

        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ticker = loop.create_task(keep_alive())
        try:
            async for chunk in self.body_iterator:
                async with lock:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    last = loop.time()
        finally:
            # Not awaited: this task may itself be cancelled (the client
            # left); a cancelled ticker ends at its next step on its own.
            ticker.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def query_int(request: Request, name: str, *, minimum: int = 0, maximum: int | None = None) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise invalid(f"Query parameter {name!r} must be an integer, not {raw!r}.", name) from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise invalid(f"Query parameter {name!r} must be {bound}.", name)
    return value


def query_bool(request: Request, name: str) -> bool:
    raw = request.query_params.get(name, "").lower()
    if raw in ("", "false", "0"):
        return False
    if raw in ("true", "1"):
        return True
    raise invalid(f"Query parameter {name!r} must be true or false, not {raw!r}.", name)


def query_choice(request: Request, name: str, choices: Iterable[str], default: str) -> str:
    raw = request.query_params.get(name) or default
    if raw not in choices:
        raise invalid(f"Query parameter {name!r} must be one of {', '.join(choices)}.", name)
    return raw


async def run_to_end(request: Request, events: AsyncIterator[Any]) -> bool:
    """Drain a generation for a JSON reply, stopping it if the client leaves
    (then return False: there is nobody to answer)."""

    async def drain() -> None:
        async for _ in events:
            pass

    return await unless_disconnected(request, drain())


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> bool:
    """Await ``work`` unless the client leaves first: then cancel it (a
    queued generation leaves the queue, a provider request is closed) and
    return False."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False
    task.result()
    return True
