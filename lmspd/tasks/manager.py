"""Background runs: a run (``service.TurnRun``) driven to its end by the server, not by a client.

Every wire event is written to the store before any reader sees it. A reader
subscribes to the live run first, then replays the log from the store, then
takes live events it has not seen yet (by seq): whether it joins at the
start, late, or after a dropped connection, it gets each event exactly once
and in order. No reader, and no reader leaving, changes what the run does.

Writes leave the event loop: a task's events wait in a bounded queue (a run
that outpaces the store waits for it) and one writer per task stores what
has piled up in one transaction, on a small thread pool of its own. A
write that fails with a transient store error (busy, locked, a pool
timeout) is tried again; the writes that end a task (its response's end,
its final status) until they land or the server shuts down: a finished
run's result exists nowhere else.

Across instances (a shared store): a task running elsewhere is followed
through the store's notices (``Store.listen``) and read from the store by
seq, so the same exactly-once, in-order promise holds; a cancel is passed on
with ``Store.request_cancel`` and reaches the running instance by notice (or
by its next heartbeat, if the notice was lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, AsyncGenerator, AsyncIterator, Callable, TypeVar

from lmspd.core.lifecycle import TERMINAL_EVENT_NAMES
from lmspd.dialects.registry import Dialect
from lmspd.history import ResponseRecord
from lmspd.service import TurnRun
from lmspd.store.base import JSON, NoticeKind, SequenceError, Store, TaskEvent, TaskFinished
from lmspd.store.calls import backoff, retried
from lmspd.streaming import steps
from lmspd.streaming.session import Encoder, ResponseState, StreamSession
from lmspd.streaming.steps import Step
from lmspd.tasks.recovery import close_refused

log = logging.getLogger("lmspd.tasks")

T = TypeVar("T")

# Events read from the store per query while replaying a log.
_BATCH = 512
# Events of one task waiting for the store before its run waits too.
MAX_PENDING_EVENTS = 256
# Events stored per transaction at most.
MAX_WRITE_BATCH = 128
# Threads that store tasks' events and ends.
STORE_THREADS = 4
# Threads that read tasks' logs for their followers: a pool of their own, so
# that readers (one key replaying long logs over many connections) never
# queue ahead of the writes that keep every key's results.
READ_THREADS = 2
# Events queued for one follower of a live task: one that falls this far
# behind (its connection stopped reading) reads the rest from the store, by
# seq, instead of holding every later event of the task.
MAX_FOLLOWER_BACKLOG = 1024
# A reader of a task running elsewhere re-reads the log this often even
# without a notice: a lost notice costs latency, never the end of a stream.
REMOTE_POLL_S = 1.0

# A write of a task's events that fails with a transient store error
# (``lmspd.store.calls.transient``) is tried again after these waits, the
# run waiting meanwhile; then the task stops.
EVENT_WRITE_DELAYS_S: tuple[float, ...] = (0.05, 0.25)
# The writes that end a task (its response's end, its final status and
# terminal event) are tried until they land or the server shuts down,
# waiting this long at first, twice as long each time, up to the most.
FINAL_WRITE_FIRST_S = 0.05
FINAL_WRITE_MOST_S = 2.0

# Marks the end of a task's write queue.
_END = object()


@dataclass(frozen=True)
class _Started:
    """Marks, in a task's write queue, that the model took the task: its
    response as it was then, which the writer stores."""

    state: ResponseState


class StoreUnavailable(Exception):
    """A task could not be stored at its start (a full or broken disk)."""


class StoreRefused(RuntimeError):
    """A task's run stopped because its events could not be stored."""


class TaskEncoder:
    """A dialect's encoder for a background run: it writes no keep-alive
    events (``steps.Heartbeat``). Every event of a task is stored, and a
    keep-alive repeats the whole response object (instructions, tools,
    metadata: up to megabytes) every ``sse_keepalive_s`` for as long as the
    task waits, without bound; a task's followers hear SSE comments instead
    (``lmspd.http.SseResponse``). A step not written takes no sequence
    number, so the log stays contiguous for resuming."""

    def __init__(self, inner: Encoder) -> None:
        self._inner = inner
        self.first_sequence_number = inner.first_sequence_number

    def encode(self, step: Step, state: ResponseState, seq: int) -> tuple[str, dict[str, Any]] | None:
        if isinstance(step, steps.Heartbeat):
            return None
        return self._inner.encode(step, state, seq)


def snapshot(state: ResponseState) -> ResponseState:
    """``state`` as it is now, for a thread to read while the run goes on:
    a shallow copy with its own output list. Taken where every item in that
    list is done (a run's start, its creation), so none of them changes."""
    return replace(state, output=list(state.output))


def task_request(dialect: Dialect, model: str, body: JSON) -> JSON:
    """What a task row keeps of its request: enough to close its log after a
    crash (which dialect wrote it, which model) and the body, for the record."""
    return {"dialect": dialect.name, "model": model, "body": body}


class _Behind:
    """Marks, in a follower's queue, that it fell ``MAX_FOLLOWER_BACKLOG``
    events behind and was let go: it reads the rest from the store."""


BEHIND = _Behind()
# What a follower's queue holds: events, then None (the run ended) or BEHIND.
Followed = TaskEvent | None | _Behind


class LiveTask:
    """A task running in this process, and the readers following it."""

    def __init__(self, task_id: str, owner: str, dialect: Dialect, run: TurnRun, session: StreamSession,
                 record: ResponseRecord) -> None:
        self.id = task_id
        self.owner = owner
        self.dialect = dialect
        self.run = run
        self.session = session
        self.record = record
        self.done = asyncio.Event()
        self.runner: asyncio.Task[None] | None = None
        self.supervisor: asyncio.Task[None] | None = None
        self.writer: asyncio.Task[None] | None = None
        self.sent = 0  # events handed to the writer so far
        self.recorded = 0  # events written so far
        self.write_error: BaseException | None = None
        # What waits for the writer: the run's events, at most
        # ``MAX_PENDING_EVENTS`` of them (``room``: a run that outpaces the
        # store waits), and the writer's marks, which never wait and so are
        # never dropped (the start is marked from a plain callback).
        self.pending: asyncio.Queue[Any] = asyncio.Queue()
        self.room = asyncio.Semaphore(MAX_PENDING_EVENTS)
        self._readers: set[asyncio.Queue[Followed]] = set()

    @property
    def state(self) -> ResponseState:
        return self.session.state

    def subscribe(self) -> asyncio.Queue[Followed]:
        queue: asyncio.Queue[Followed] = asyncio.Queue()
        if self.done.is_set():
            queue.put_nowait(None)
        else:
            self._readers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Followed]) -> None:
        self._readers.discard(queue)

    def publish(self, event: TaskEvent) -> None:
        for queue in list(self._readers):
            if queue.qsize() >= MAX_FOLLOWER_BACKLOG:
                self._readers.discard(queue)
                queue.put_nowait(BEHIND)
            else:
                queue.put_nowait(event)

    def close(self) -> None:
        self.done.set()
        for queue in self._readers:
            queue.put_nowait(None)
        self._readers.clear()


class TaskManager:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._live: dict[str, LiveTask] = {}
        self._closing = False
        # Bounded: at most this many store calls for tasks at once; the rest
        # queue here, and their runs wait on their full write queues.
        self._io = ThreadPoolExecutor(max_workers=STORE_THREADS, thread_name_prefix="lmspd-store")
        self._reads = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="lmspd-store-read")
        # Readers of tasks that run elsewhere, woken by the store's notices.
        self._watchers: dict[str, set[asyncio.Event]] = {}
        self._unlisten: Callable[[], None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        # Set at shutdown, once the grace for tasks ran out: writes that
        # keep failing stop being tried again.
        self._giving_up = asyncio.Event()

    def live(self, task_id: str, owner: str) -> LiveTask | None:
        task = self._live.get(task_id)
        return task if task is not None and task.owner == owner else None

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._reads, fn, *args)

    # -- notices -------------------------------------------------------------------

    def attach(self) -> None:
        """Hear the store's notices (call once, on the serving event loop)."""
        loop = asyncio.get_running_loop()

        def heard(kind: NoticeKind, task_id: str) -> None:
            # A store thread: hand over to the loop (gone at shutdown: drop).
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._heard, kind, task_id)

        self._unlisten = self.store.listen(heard)

    def _heard(self, kind: NoticeKind, task_id: str) -> None:
        if kind == "cancel":
            self.cancel_requested([task_id])
            return
        targets = self._watchers.values() if kind == "resync" else [self._watchers.get(task_id, set())]
        for wakes in targets:
            for wake in wakes:
                wake.set()

    def cancel_requested(self, task_ids: list[str]) -> None:
        """Cancel those of ``task_ids`` that run here (another instance asked)."""
        for task_id in task_ids:
            live = self._live.get(task_id)
            if live is not None and not live.run.cancel.cancelled:
                log.info("task %s: cancel requested through another instance", task_id)
                job = asyncio.ensure_future(self.cancel(live))
                self._background.add(job)
                job.add_done_callback(self._background.discard)

    # -- running -----------------------------------------------------------------

    async def start(self, *, task_id: str, owner: str, dialect: Dialect, request: JSON, run: TurnRun,
                    session: StreamSession, record: ResponseRecord) -> LiveTask:
        """Persist the task (off the event loop) and start driving its run;
        returns once it is stored, before it runs. A task the store could
        not keep raises ``StoreUnavailable``: its id is never answered."""
        try:
            await self._off_loop(self._create, task_id, owner, request, session, record)
        except BaseException as exc:
            # No runner will ever release the run's place in the model queue.
            run.ticket.release()
            with contextlib.suppress(Exception):
                await self._off_loop(functools.partial(
                    self.store.set_task_status, owner, task_id, "failed",
                    error={"code": "server_error", "message": "The task could not start."}))
            if isinstance(exc, Exception):
                raise StoreUnavailable(f"Task {task_id!r} could not be stored, so it was not started; retry once "
                                       "the server's storage recovers.") from exc
            raise
        live = LiveTask(task_id, owner, dialect, run, session, record)
        self._live[task_id] = live
        live.writer = asyncio.create_task(self._write_loop(live), name=f"lmspd-task-{task_id}-writer")
        live.runner = asyncio.create_task(self._drive(live), name=f"lmspd-task-{task_id}")
        # The supervisor, not the runner, closes the log: a runner cancelled
        # before its first step never runs a line of its own.
        live.supervisor = asyncio.create_task(self._supervise(live), name=f"lmspd-task-{task_id}-end")
        return live

    async def _drive(self, live: LiveTask) -> None:
        async for seq, name, data in live.run.events(live.session, on_start=lambda: self._started(live)):
            await self._record(live, seq, name, data)

    @staticmethod
    def _started(live: LiveTask) -> None:
        # On the event loop: the writer stores the start (off it), queued
        # behind the events before it, so the status never runs ahead.
        live.pending.put_nowait(_Started(snapshot(live.state)))

    async def _record(self, live: LiveTask, seq: int, name: str, data: dict[str, Any]) -> None:
        if live.write_error is not None:
            # The store refused this task's events (a survivor closed it, or
            # the store is down): stop generating what cannot be kept.
            raise StoreRefused(f"task {live.id}: the store refused its events") from live.write_error
        await live.room.acquire()
        live.sent += 1
        live.pending.put_nowait(TaskEvent(live.dialect.store_seq(seq), name, data))

    async def _supervise(self, live: LiveTask) -> None:
        """Whatever stopped the runner, the log ends with a terminal event."""
        assert live.runner is not None and live.writer is not None
        runner = live.runner
        try:
            await asyncio.wait([runner])
            session = live.session
            if not session.terminated and live.write_error is None:
                # Stopped before its first step: the log still starts with created.
                wires = session.start() if live.sent == 0 else []
                if self._closing:
                    wires += session.fail("server_shutting_down", "The server is shutting down.")
                elif runner.cancelled():
                    wires += session.cancel()
                else:
                    exc = runner.exception()
                    log.error("task %s failed", live.id, exc_info=exc)
                    wires += session.fail("server_error", f"Internal error: {type(exc).__name__}")
                with contextlib.suppress(StoreRefused):  # closed below, as a refused log is
                    for seq, name, data in wires:
                        await self._record(live, seq, name, data)
            elif not runner.cancelled() and runner.exception() is not None:
                log.error("task %s: storing its events failed", live.id, exc_info=runner.exception())
            if not live.writer.done():
                live.pending.put_nowait(_END)
            await live.writer
            if live.write_error is not None and not isinstance(live.write_error, TaskFinished):
                await self._close_refused(live)
        except Exception:
            # The store itself is failing; recovery (here at the next start,
            # or a survivor on a shared store) closes this task.
            log.exception("task %s: could not close its event log", live.id)
        finally:
            if not live.writer.done():
                live.writer.cancel()
            # A runner cancelled before its first step never entered the run,
            # so nothing else gives back its place in the model queue.
            live.run.ticket.release()
            self._live.pop(live.id, None)
            live.close()

    async def _close_refused(self, live: LiveTask) -> None:
        """A task whose log the store cut short is closed here
        (``close_refused``), tried as an event write is. Where that fails
        too (the outage that refused its events is likely still on), its
        followers hear at once that its log is cut short, and the close goes
        on in the background until it lands (``_close_later``)."""
        try:
            await self._write(live, "its end", False, close_refused, self.store, live.id)
        except Exception as exc:
            log.error("task %s: could not close its event log (%s); trying again until the store takes it",
                      live.id, exc)
            job = asyncio.ensure_future(self._close_later(live.id))
            self._background.add(job)
            job.add_done_callback(self._background.discard)

    async def _close_later(self, task_id: str) -> None:
        """Close a task whose log the store cut short, tried as a task's end
        is, until it lands or the server gives up on its tasks. No sweep
        closes it meanwhile: one runs only for instances whose lease lapsed
        (or at the next start), so it said in_progress to every poll, for as
        long as this instance lived, and could not be cancelled. Given up
        on, a task on a shared store is released to recovery (the next sweep
        of any instance); on a store of its own, the next start closes it."""
        try:
            await retried(lambda: self._off_loop(close_refused, self.store, task_id),
                          backoff(FINAL_WRITE_FIRST_S, FINAL_WRITE_MOST_S), f"task {task_id}: closing its log",
                          wait=self._retry_wait)
            return
        except Exception as exc:
            log.error("task %s: could not close its event log (%s); %s", task_id, exc,
                      "releasing it to the other instances" if self.store.shared else "the next start does")
        if self.store.shared:
            with contextlib.suppress(Exception):
                await self._off_loop(self.store.release_task, task_id)

    async def _write_loop(self, live: LiveTask) -> None:
        """Store what the run produced, in order, in batches, then publish it."""
        while True:
            item = await live.pending.get()
            if item is _END:
                return
            batch = [item]
            ended = False
            while len(batch) < MAX_WRITE_BATCH:
                try:
                    item = live.pending.get_nowait()
                except asyncio.QueueEmpty:
                    break
                if item is _END:
                    ended = True
                    break
                batch.append(item)
            # Taken off the queue: the run may hand over as many more.
            for _ in range(sum(isinstance(item, TaskEvent) for item in batch)):
                live.room.release()
            if live.write_error is None:
                try:
                    await self._store_batch(live, batch)
                except Exception as exc:
                    live.write_error = exc
                    if isinstance(exc, TaskFinished):
                        log.warning("task %s: %s; stopping it", live.id, exc)
                    else:
                        log.error("task %s: the store refused its events (%s); stopping it", live.id, exc)
                    live.run.cancel.cancel()
            if ended:
                return

    async def _store_batch(self, live: LiveTask, batch: list[Any]) -> None:
        """One batch, in order, each run of events in one transaction
        (published once stored). A terminal event is always last (the
        session ends with it): the response's end, then the event with the
        task's final status. Those two writes keep a result that exists
        nowhere else: tried until they land or the server shuts down."""
        run: list[TaskEvent] = []
        for item in batch:
            if isinstance(item, _Started):
                await self._append(live, run)
                run = []
                await self._write(live, "its start", False, self.store.set_task_status, live.owner, live.id,
                                  "in_progress")
                try:
                    await self._write(live, "its response as started", False, live.record.started, item.state)
                except Exception:
                    # Its end overwrites it: the task goes on.
                    log.exception("task %s: could not store its response as started", live.id)
            elif item.event in TERMINAL_EVENT_NAMES:
                await self._append(live, run)
                run = []
                state = live.state  # final: nothing changes it after the terminal event
                if live.record.writes_at_end(state):
                    # Before the terminal event: a reader that sees it and then
                    # reads the response or the conversation finds them final.
                    try:
                        await self._write(live, "its response", True, live.record.ended, state)
                    except Exception:
                        # Not a store error that may pass (a bug, a row that
                        # cannot be written): the task's own end still is,
                        # with the result, or it would stay in_progress.
                        log.exception("task %s: could not store its response", live.id)
                ended = await self._write(live, "its final status", True, functools.partial(
                    self.store.set_task_status, live.owner, live.id, state.status,
                    result=live.dialect.response_json(state), error=state.error,
                    final_event=(item.seq, item.event, item.data)))
                if not ended:
                    # Closed meanwhile (a survivor that took this instance's
                    # lease for lapsed) with a terminal event of its own, or
                    # this one, whose commit's answer was lost: followers read
                    # whichever is stored once the task is closed here.
                    raise TaskFinished(f"task {live.id} was ended by another writer")
                self._published(live, [item])
            else:
                run.append(item)
        await self._append(live, run)

    async def _append(self, live: LiveTask, events: list[TaskEvent]) -> None:
        if events:
            await self._write(live, "its events", False, self._append_once, live,
                              [(e.seq, e.event, e.data) for e in events])
            self._published(live, events)

    def _append_once(self, live: LiveTask, events: list[tuple[int, str, JSON]]) -> None:
        """On a store thread: ``events`` appended, each once. A try whose
        commit landed but whose answer was lost (a connection dropped in
        COMMIT) is retried as a transient error, and the retry's seqs were
        then already taken: a SequenceError, which cancelled a healthy run.
        Only this task's own writer appends to a running task (a survivor
        that closes it makes it terminal: TaskFinished), so a seq the store
        already holds is one of these."""
        try:
            self.store.append_events(live.id, events)
        except SequenceError:
            task = self.store.get_task(live.owner, live.id)
            if task is None or task.last_seq < events[0][0]:
                raise
            rest = [event for event in events if event[0] > task.last_seq]
            if rest:
                self.store.append_events(live.id, rest)

    @staticmethod
    def _published(live: LiveTask, events: list[TaskEvent]) -> None:
        live.recorded += len(events)
        for event in events:
            live.publish(event)

    async def _write(self, live: LiveTask, what: str, final: bool, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a store thread, tried again while the store's
        error is transient: a write of the run's events a few times
        (``EVENT_WRITE_DELAYS_S``: the run waits meanwhile), a ``final``
        one until it lands or the server gives up on its tasks (``drain``)."""
        delays = backoff(FINAL_WRITE_FIRST_S, FINAL_WRITE_MOST_S) if final else EVENT_WRITE_DELAYS_S
        return await retried(lambda: self._off_loop(fn, *args), delays, f"task {live.id}: storing {what}",
                             wait=self._retry_wait)

    async def _retry_wait(self, delay: float) -> bool:
        """Wait ``delay`` before trying a store write again; False once the
        server gave up on its tasks' writes (then one last try)."""
        if self._giving_up.is_set():
            return False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._giving_up.wait(), delay)
        return not self._giving_up.is_set()

    def _create(self, task_id: str, owner: str, request: JSON, session: StreamSession,
                record: ResponseRecord) -> None:
        self.store.create_task(owner, task_id, request, status="queued", response_id=session.state.id,
                               created_at=session.state.created_at)
        record.created(session.state)

    # -- control -----------------------------------------------------------------

    async def cancel(self, live: LiveTask, wait_s: float = 30.0) -> None:
        """End a running task with ``response.cancelled`` and wait for it."""
        live.run.cancel.cancel()
        if not live.run.started and live.runner is not None:
            # Still queued: the engine never polls the token there; leave the queue.
            live.runner.cancel()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(live.done.wait()), wait_s)

    async def cancel_task(self, owner: str, task_id: str, wait_s: float = 30.0) -> None:
        """Cancel a task wherever it runs and wait (up to ``wait_s``) for it
        to end. A finished or unknown task is left as it is."""
        live = self.live(task_id, owner)
        if live is not None:
            await self.cancel(live, wait_s)
            return
        if not self.store.shared:
            return  # one process per store: not running here is not running at all
        if not await self._off_loop(self.store.request_cancel, owner, task_id):
            return
        deadline = time.monotonic() + wait_s
        wake = self._watch(task_id)
        try:
            while True:
                wake.clear()
                task = await self._read(functools.partial(self.store.get_task, owner, task_id, result=False))
                left = deadline - time.monotonic()
                if task is None or task.terminal or left <= 0:
                    return
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), min(left, REMOTE_POLL_S))
        finally:
            self._unwatch(task_id, wake)

    async def drain(self, timeout_s: float) -> None:
        """At shutdown (``Service.shutdown`` already ended every generation):
        let the runs record their terminal events, then stop what is left."""
        self._closing = True
        ends = [t.supervisor for t in self._live.values() if t.supervisor is not None]
        if ends:
            await asyncio.wait(ends, timeout=timeout_s)
        # Writes still retrying (a store down all along) try once more and
        # stop: recovery, at the next start, closes what they left.
        self._giving_up.set()
        left = [t for t in self._live.values() if t.supervisor is not None and not t.supervisor.done()]
        for live in left:
            if live.runner is not None:
                live.runner.cancel()
        ending = [t.supervisor for t in left if t.supervisor is not None] + list(self._background)
        if ending:
            await asyncio.wait(ending, timeout=2.0)

    def close(self) -> None:
        self._giving_up.set()
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        self._io.shutdown(wait=True)
        self._reads.shutdown(wait=True)

    # -- reading -----------------------------------------------------------------

    def _watch(self, task_id: str) -> asyncio.Event:
        wake = asyncio.Event()
        self._watchers.setdefault(task_id, set()).add(wake)
        return wake

    def _unwatch(self, task_id: str, wake: asyncio.Event) -> None:
        wakes = self._watchers.get(task_id)
        if wakes is not None:
            wakes.discard(wake)
            if not wakes:
                del self._watchers[task_id]

    async def follow(self, owner: str, task_id: str, after: int) -> AsyncGenerator[TaskEvent, None] | None:
        """The task's events after store seq ``after``, then its live ones
        until the terminal event. ``None`` if the task is not found; raises
        ``EventsExpired`` here, before any byte is sent, if they were pruned."""
        live = self.live(task_id, owner)
        queue = live.subscribe() if live is not None else None
        try:
            first = await self._read(self.store.events_after, owner, task_id, after, _BATCH)
        except BaseException:
            if live is not None and queue is not None:
                live.unsubscribe(queue)
            raise
        if first is None:
            if live is not None and queue is not None:
                live.unsubscribe(queue)
            return None
        return self._tail(owner, task_id, after, first, live, queue)

    async def _tail(self, owner: str, task_id: str, after: int, batch: list[TaskEvent],
                    live: LiveTask | None, queue: asyncio.Queue[Followed] | None) -> AsyncGenerator[TaskEvent, None]:
        last = after
        try:
            while batch:
                for event in batch:
                    yield event
                    last = event.seq
                    if event.event in TERMINAL_EVENT_NAMES:
                        return
                more = await self._read(self.store.events_after, owner, task_id, last, _BATCH)
                batch = more or []
            if queue is None:
                if not self.store.shared:
                    # One process owns an unshared store: not running here is
                    # not running at all, and a log without its terminal event
                    # was cut short (the next start's recovery closes it).
                    return
                # Not running here: it runs on another instance (or ran, and
                # a survivor is about to close it). Its log is all there is.
                async for event in self._tail_stored(owner, task_id, last):
                    yield event
                return
            while True:
                got = await queue.get()
                if got is None:
                    # The run ended; anything we have not seen is stored.
                    for event in await self._read(self.store.events_after, owner, task_id, last, _BATCH) or []:
                        yield event
                    return
                if got is BEHIND:
                    async for event in self._tail_stored(owner, task_id, last):
                        yield event
                    return
                assert isinstance(got, TaskEvent)
                event = got
                if event.seq <= last:
                    continue  # already replayed from the store
                yield event
                last = event.seq
                if event.event in TERMINAL_EVENT_NAMES:
                    return
        finally:
            if live is not None and queue is not None:
                live.unsubscribe(queue)

    async def _tail_stored(self, owner: str, task_id: str, last: int) -> AsyncIterator[TaskEvent]:
        """Events of a task this instance does not run, from the store, woken
        by its notices, until the terminal event. Read by seq, so a notice
        lost or repeated changes nothing but latency."""
        wake = self._watch(task_id)
        try:
            while True:
                wake.clear()
                batch = await self._read(self.store.events_after, owner, task_id, last, _BATCH)
                if batch is None:
                    return  # deleted meanwhile
                for event in batch:
                    yield event
                    last = event.seq
                    if event.event in TERMINAL_EVENT_NAMES:
                        return
                if len(batch) == _BATCH:
                    continue
                try:
                    await asyncio.wait_for(wake.wait(), REMOTE_POLL_S)
                except asyncio.TimeoutError:
                    # No notice for a while: if it ended without a terminal
                    # event (it could not start), stop following.
                    task = await self._read(functools.partial(self.store.get_task, owner, task_id, result=False))
                    if task is None or (task.terminal and task.last_seq <= last):
                        return
        finally:
            self._unwatch(task_id, wake)
