"""From a decoded conversation to wire events: model lookup, validation,
queueing, generation and the one terminal event — shared by every dialect
(and by background tasks), so that none of them repeats it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Protocol, TypeVar

from lmspd.core.conversation import Conversation
from lmspd.core.errors import ApiError, RequestField
from lmspd.core.events import EngineEvent
from lmspd.core.limits import Limits
from lmspd.core.run import LOCAL, RunContext
from lmspd.engines.base import CancelToken, Engine, ModelQueue, Prepared, QueueTicket
from lmspd.metrics import Metrics
from lmspd.streaming.idle import IDLE, Paced
from lmspd.streaming.session import StreamSession, WireEvent

log = logging.getLogger("lmspd.service")

T = TypeVar("T")


@dataclass
class ServedModel:
    engine: Engine
    queue: ModelQueue


class Service:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.models: dict[str, ServedModel] = {}
        self.shutting_down = False
        self._active: set[CancelToken] = set()
        # Where requests are prepared: off the event loop, a few at a time.
        self._preparing = ThreadPoolExecutor(max_workers=limits.prepare_workers,
                                             thread_name_prefix="lmspd-prepare", initializer=_yield_cpu)
        # Where a request is decoded and the stored history it names is read
        # and expanded (store reads, JSON, work proportional to that
        # history): off the event loop, and beside the preparing threads so
        # that a long prepare does not hold up the next request's decoding.
        # At the normal priority: it is bounded (max_expanded_chars), mostly
        # Python under the GIL (a lower priority would not spare the streams),
        # and every request waits for it, a refusal included.
        self._decoding = ThreadPoolExecutor(max_workers=limits.prepare_workers, thread_name_prefix="lmspd-decode")
        self.metrics = Metrics()
        self.metrics.bind(self)

    def add_engine(self, engine: Engine) -> None:
        queue = ModelQueue(self.limits.queue, concurrency=getattr(engine.info, "max_concurrency", 1))
        self.models[engine.info.id] = ServedModel(engine, queue)

    def model(self, model_id: str) -> ServedModel:
        served = self.models.get(model_id)
        if served is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise ApiError("model_not_found", f"The model {model_id!r} does not exist. Served models: {known}.",
                           path=(RequestField.MODEL,))
        return served

    async def begin(self, conversation: Conversation, run: RunContext = LOCAL) -> "Run":
        """Everything that can refuse a request, done before any byte is sent.

        Cheap checks first, then admission (an overloaded server answers 503
        without doing the request's work), then the engine's ``prepare``
        (render, tokenize, schemas, grammars: work proportional to the
        request) in a worker thread under ``limits.prepare_timeout_s``, so
        that no request stalls the event loop and the streams it serves.
        ``run`` (who the run is for, how it runs) goes to the engine beside
        the conversation; neither is written here."""
        if self.shutting_down:
            raise ApiError("server_shutting_down", "The server is shutting down.", headers={"Retry-After": "5"})
        served = self.model(conversation.model)
        caps = served.engine.info.capabilities
        if conversation.tools and conversation.tool_choice.mode != "none" and not caps.get("tools"):
            raise ApiError("unsupported_capability", f"Model {conversation.model!r} does not support tools.",
                           path=(RequestField.TOOLS,))
        if conversation.output_format.type != "text" and not caps.get("structured_output"):
            raise ApiError("unsupported_capability",
                           f"Model {conversation.model!r} does not support structured output.",
                           path=(RequestField.OUTPUT_FORMAT,))
        ticket = served.queue.admit()
        # The engine hears at once that this request is on its way: its
        # preparation may wait behind others' in the pool.
        try:
            with served.engine.announce(conversation):
                prepared = await self.off_loop(lambda c: served.engine.prepare(c, run), conversation)
        except BaseException:
            ticket.release()
            raise
        return Run(self, served.engine, prepared, ticket)

    async def count_tokens(self, conversation: Conversation) -> int:
        """The prompt size of ``conversation``, rendered off the event loop."""
        return await self.off_loop(self.model(conversation.model).engine.count_tokens, conversation)

    async def off_loop(self, work: Callable[[Conversation], T], conversation: Conversation) -> T:
        """Run ``work`` in the preparing pool, bounded in time. A thread cannot
        be stopped: one that overruns finishes in the pool, whose size bounds
        how many such overruns run at once, while its client is answered."""
        return await self._bounded(self._preparing, functools.partial(work, conversation),
                                   "Preparing this request (rendering, tokenizing, compiling its grammar)",
                                   "send a smaller input or a simpler schema")

    async def decode(self, work: Callable[[], T]) -> T:
        """Run ``work`` (decoding a request and expanding the stored history
        it names) in the decoding pool, bounded in time like ``off_loop``."""
        return await self._bounded(self._decoding, work, "Reading this request and the stored history it names",
                                   "send less history")

    async def _bounded(self, pool: ThreadPoolExecutor, work: Callable[[], T], what: str, advice: str) -> T:
        loop = asyncio.get_running_loop()
        # Engines whose prepare must reach back to the loop (the model
        # registry starts loads there) find it here.
        self.loop = loop
        bound = self.limits.prepare_timeout_s
        future = loop.run_in_executor(pool, work)
        try:
            return await asyncio.wait_for(future, bound)
        except asyncio.TimeoutError:
            raise ApiError(
                "prepare_timeout",
                f"{what} took longer than {bound:g} s; {advice}, or retry when the server is less busy.",
                headers={"Retry-After": str(self.limits.queue.retry_after_s)},
            ) from None

    def shutdown(self) -> None:
        """Stop taking work and end every running generation with a terminal event."""
        self.shutting_down = True
        for token in list(self._active):
            token.cancel("shutdown")

    async def aclose(self) -> None:
        # A prepare or a token count still running (one that overran its
        # client's bound goes on in its thread) is inside a model: the
        # engines are closed once it has ended, not under it.
        loop = asyncio.get_running_loop()
        for pool in (self._decoding, self._preparing):
            await loop.run_in_executor(None, functools.partial(pool.shutdown, wait=True, cancel_futures=True))
        for served in self.models.values():
            await served.engine.aclose()


def _yield_cpu() -> None:
    """A preparing thread runs at a lower CPU priority than generation (Linux
    schedules threads by their own nice value): a huge prompt being
    tokenized must not slow the tokens of streams already running."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class Run:
    """One admitted generation: waits its turn, then streams."""

    def __init__(self, service: Service, engine: Engine, prepared: Prepared, ticket: QueueTicket) -> None:
        self._service = service
        self.engine = engine
        self.prepared = prepared
        self.ticket = ticket
        self.cancel = CancelToken()
        # True once the model is ours: before that, a cancel must leave the
        # queue (nothing would ever poll the token while we wait there).
        self.started = False
        self._opened = False
        # ``open`` reached the model: ``_settle`` gives back what it reached
        # unless a generation read to its end took it.
        self._reached = False
        self._settled = False
        # Should this run be dropped without its events ever being read (a
        # client gone before its stream's first byte: an async generator that
        # never started runs no ``finally``), the collector gives back its
        # queue slot and whatever ``open`` reached; ``_settle`` turns it off.
        self._unsettled: weakref.finalize | None = weakref.finalize(
            self, _dropped, asyncio.get_running_loop(), engine, prepared, ticket)
        self._unsettled.atexit = False

    @property
    def opens_first(self) -> bool:
        """Whether ``open`` has work to do (the upstream engine's provider request)."""
        return not self._opened and self.engine.opens_first

    async def open(self) -> None:
        """Reach the model before any response byte is sent, for engines that
        must: the upstream engine checks its provider's status and content
        type here, so that a refusal is still an HTTP error reply (an
        ``ApiError``), not a broken stream. Takes the queue slot first. A
        no-op for engines that do not open first; ``events`` calls it when
        the handler did not (a refusal then becomes ``response.failed``)."""
        if not self.opens_first:
            return
        self._opened = True
        try:
            await self.ticket.wait()
            await self.engine.open(self.prepared, self.cancel)
        except BaseException:
            self.ticket.release()  # an engine's open that fails leaves nothing open
            raise
        self._reached = True

    async def _settle(self, generated: bool = False) -> None:
        """The run is over for its consumer: what ``open`` reached and no
        generation took (the events dropped before it started, at
        ``response.created`` or in the queue, or never read) is given back,
        then the queue slot. ``generated``: a generation read to its end
        took it. Once: later calls find nothing to do."""
        if self._settled:
            return
        self._settled = True
        if self._unsettled is not None:
            self._unsettled.detach()
            self._unsettled = None
        try:
            if self._reached and not generated:
                await self.engine.discard(self.prepared)
        finally:
            self.ticket.release()

    def _quiet(self, work: "asyncio.Future[Any]", session: StreamSession) -> AsyncGenerator[WireEvent, None]:
        return quiet(work, session, self._service.limits.sse_keepalive_s)

    async def _paced(self, events: AsyncIterator[Any], session: StreamSession) -> AsyncIterator[WireEvent]:
        """``events`` through ``session``, and its heartbeat each time
        nothing was sent for ``sse_keepalive_s`` (``lmspd.streaming.idle``:
        a timer only while the engine is silent, no task per event)."""
        every = self._service.limits.sse_keepalive_s
        loop = asyncio.get_running_loop()
        paced = Paced(events)
        last = loop.time()
        try:
            while True:
                try:
                    event = await paced.next(last + every - loop.time() if every > 0 else None)
                except StopAsyncIteration:
                    return
                wires = session.heartbeat() if event is IDLE else session.handle(event)
                if event is IDLE or wires:
                    last = loop.time()
                for wire in wires:
                    yield wire
        finally:
            await paced.aclose()

    def _generate(self, session: StreamSession) -> AsyncIterator[EngineEvent]:
        # The engine remembers which response its KV state belongs to
        # (previous_response_id continues from it).
        start = time.perf_counter()
        generation = self.engine.generate(self.prepared, self.cancel, response_id=session.state.id)
        return self._service.metrics.observe(self.engine, lambda: session.state.id, generation, start)

    def events(self, session: StreamSession, on_start: Callable[[], None] | None = None) -> "RunEvents":
        """The whole lifecycle; always ends with the session's terminal event
        unless the consumer itself goes away (then generation stops).
        ``on_start`` runs when the queue lets this run reach the model (a
        background task records that it is no longer queued). Closing them
        (``aclose``), read or not, ends the run."""
        return RunEvents(self, self._events(session, on_start))

    async def _events(
        self, session: StreamSession, on_start: Callable[[], None] | None
    ) -> AsyncGenerator[WireEvent, None]:
        service = self._service
        service._active.add(self.cancel)
        generation: AsyncIterator[EngineEvent] | None = None
        drained = False
        try:
            # An error before the first event: raised once response.created is out.
            deferred: Exception | None = None
            if self.ticket.ready and self.opens_first:
                # The model has room: send the provider its request before
                # building any event, so the first bytes wait on it, not on us.
                try:
                    await self.open()
                except ApiError as exc:
                    deferred = exc
            elif self.ticket.ready and not service.shutting_down:
                # The model has room and is in this process: its prompt
                # evaluates while response.created goes out.
                try:
                    generation = self._generate(session)
                except Exception as exc:
                    deferred = exc
            for wire in session.start():
                yield wire
            if deferred is not None:
                raise deferred
            if not self.ticket.ready:
                # Queued: the client hears that the response is alive.
                admitted = asyncio.ensure_future(self.ticket.wait())
                # Closed here, not when collected: its clean-up stops the wait.
                async with contextlib.aclosing(self._quiet(admitted, session)) as heartbeats:
                    async for wire in heartbeats:
                        yield wire
                admitted.result()
            async with self.ticket:
                self.started = True
                if service.shutting_down:
                    self.cancel.cancel("shutdown")
                if self.cancel.cancelled and self.cancel.reason == "shutdown":
                    for wire in session.fail("server_shutting_down", "The server is shutting down."):
                        yield wire
                    return
                progress = session.begin_progress() if session.state.status == "queued" else []
                if on_start is not None:
                    on_start()
                for wire in progress:
                    yield wire
                await self.open()
                if generation is None:
                    generation = self._generate(session)
                # Whenever the engine has been silent for a while (the
                # prompt evaluating, a call's arguments held back, a stalled
                # provider), the client hears that the response is alive.
                async for wire in self._paced(generation, session):
                    yield wire
                drained = True
        except asyncio.CancelledError:
            self.cancel.cancel()
            raise
        except ApiError as exc:
            for wire in session.fail(exc.code, exc.message):
                yield wire
        except Exception as exc:  # a bug must still end the stream properly
            log.exception("response %s failed", session.state.id)
            for wire in session.fail("server_error", f"Internal error: {type(exc).__name__}"):
                yield wire
        finally:
            if generation is not None and not drained:
                # Started but not read to its end (a shutdown, a consumer
                # gone before the first event): nobody will read the rest.
                self.cancel.cancel()
            service._active.discard(self.cancel)
            await self._settle(generated=drained)
        if not session.terminated:
            for wire in session.fail("server_error", "The generation ended without a result."):
                yield wire


class Settles(Protocol):
    async def _settle(self) -> None: ...


class Releasable(Protocol):
    def release(self) -> None: ...


class RunStream(Protocol):
    """A run's wire events; ``aclose`` ends the run, read or not. (Spelled
    out: Python 3.11's Protocol cannot extend ``AsyncIterator``.)"""

    def __aiter__(self) -> AsyncIterator[WireEvent]: ...

    def __anext__(self) -> Awaitable[WireEvent]: ...

    def aclose(self) -> Awaitable[None]: ...


class TurnRun(Protocol):
    """What a route or a task drives: the service's ``Run``, or a run that
    acts as one (``compaction.CompactingRun``: a summary, then the run on
    the reduced window; ``compaction.FinishedRun``: nothing to generate)."""

    @property
    def cancel(self) -> CancelToken: ...

    @property
    def ticket(self) -> Releasable: ...

    @property
    def opens_first(self) -> bool: ...

    @property
    def started(self) -> bool: ...

    async def open(self) -> None: ...

    def events(self, session: StreamSession, on_start: Callable[[], None] | None = None) -> RunStream: ...


class RunEvents:
    """``Run.events`` (and a compacting turn's, ``compaction.CompactingRun``):
    the run's wire events, and ``aclose``, which ends the run and gives back
    what it holds even where its events were never read (an async generator
    that never started runs no ``finally``)."""

    __slots__ = ("_run", "_events")

    def __init__(self, run: Settles, events: AsyncGenerator[WireEvent, None]) -> None:
        self._run = run
        self._events = events

    def __aiter__(self) -> "RunEvents":
        return self

    def __anext__(self) -> Awaitable[WireEvent]:
        return self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()
        await self._run._settle()


def _dropped(loop: asyncio.AbstractEventLoop, engine: Engine, prepared: Prepared, ticket: QueueTicket) -> None:
    """A run collected without its events ever being read (a client gone
    before the first byte, after ``open`` or without it): nothing else gives
    back its queue slot and what ``open`` reached (``discard`` finds nothing
    where nothing was opened). Called by the garbage collector, on whichever
    thread: the work goes to the loop."""

    def settle() -> None:
        ticket.release()
        task = loop.create_task(engine.discard(prepared))
        _settling.add(task)
        task.add_done_callback(_settling.discard)

    if not loop.is_closed():
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(settle)


# The give-backs of dropped runs still under way (a task nothing else holds may be collected).
_settling: set[asyncio.Task[None]] = set()


async def quiet(work: "asyncio.Future[Any]", session: StreamSession, every: float) -> AsyncGenerator[WireEvent, None]:
    """The session's heartbeat every ``every`` seconds (``sse_keepalive_s``;
    0: none) until ``work`` is done (cancelled with this generator if it is
    not): a run waiting for its model, or a compacting turn for its summary."""
    try:
        while not work.done():
            await asyncio.wait({work}, timeout=every if every > 0 else None)
            if not work.done():
                for wire in session.heartbeat():
                    yield wire
    finally:
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
