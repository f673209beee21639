"""Background runs: a ``Run`` driven to its end by the server, not by a client.

Every wire event is written to the store before any reader sees it. A reader
subscribes to the live run first, then replays the log from the store, then
takes live events it has not seen yet (by seq): whether it joins at the
start, late, or after a dropped connection, it gets each event exactly once
and in order. No reader, and no reader leaving, changes what the run does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator

from lmspd.dialects.registry import Dialect
from lmspd.history import ResponseRecord
from lmspd.service import Run
from lmspd.store.base import JSON, Store, TaskEvent
from lmspd.streaming.session import ResponseState, StreamSession

log = logging.getLogger("lmspd.tasks")

TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "response.cancelled"})
# Events read from the store per query while replaying a log.
_BATCH = 512


def task_request(dialect: Dialect, model: str, body: JSON) -> JSON:
    """What a task row keeps of its request: enough to close its log after a
    crash (which dialect wrote it, which model) and the body, for the record."""
    return {"dialect": dialect.name, "model": model, "body": body}


class LiveTask:
    """A task running in this process, and the readers following it."""

    def __init__(self, task_id: str, owner: str, dialect: Dialect, run: Run, session: StreamSession,
                 record: ResponseRecord) -> None:
        self.id = task_id
        self.owner = owner
        self.dialect = dialect
        self.run = run
        self.session = session
        self.record = record
        self.done = asyncio.Event()
        self.runner: asyncio.Task[None] | None = None
        self.recorded = 0  # events written so far
        self._readers: set[asyncio.Queue[TaskEvent | None]] = set()

    @property
    def state(self) -> ResponseState:
        return self.session.state

    def subscribe(self) -> asyncio.Queue[TaskEvent | None]:
        queue: asyncio.Queue[TaskEvent | None] = asyncio.Queue()
        if self.done.is_set():
            queue.put_nowait(None)
        else:
            self._readers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[TaskEvent | None]) -> None:
        self._readers.discard(queue)

    def publish(self, event: TaskEvent) -> None:
        # Unbounded, but bounded by one response's events; a reader that
        # stops reading is dropped by its connection closing.
        for queue in self._readers:
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

    def live(self, task_id: str, owner: str) -> LiveTask | None:
        task = self._live.get(task_id)
        return task if task is not None and task.owner == owner else None

    # -- running -----------------------------------------------------------------

    def start(self, *, task_id: str, owner: str, dialect: Dialect, request: JSON, run: Run,
              session: StreamSession, record: ResponseRecord) -> LiveTask:
        """Persist the task and start driving its run; returns at once."""
        try:
            self.store.create_task(owner, task_id, request, status="queued", response_id=session.state.id,
                                   created_at=session.state.created_at)
            record.created(session.state)
        except BaseException:
            # No runner will ever release the run's place in the model queue.
            run.ticket.release()
            with contextlib.suppress(Exception):
                self.store.set_task_status(owner, task_id, "failed",
                                           error={"code": "server_error", "message": "The task could not start."})
            raise
        live = LiveTask(task_id, owner, dialect, run, session, record)
        self._live[task_id] = live
        live.runner = asyncio.create_task(self._drive(live), name=f"lmspd-task-{task_id}")
        live.runner.add_done_callback(lambda runner: self._finished(live, runner))
        return live

    async def _drive(self, live: LiveTask) -> None:
        async for seq, name, data in live.run.events(live.session, on_start=lambda: self._started(live)):
            self._record(live, seq, name, data)

    def _started(self, live: LiveTask) -> None:
        self.store.set_task_status(live.owner, live.id, "in_progress")
        live.record.started(live.state)

    def _record(self, live: LiveTask, seq: int, name: str, data: dict[str, Any]) -> None:
        event = TaskEvent(live.dialect.store_seq(seq), name, data)
        if name in TERMINAL_EVENTS:
            state = live.state
            try:
                # Before the terminal event: a reader that sees it and then
                # reads the response or the conversation finds them final.
                live.record.ended(state)
            except Exception:
                log.exception("task %s: could not store its response", live.id)
            self.store.set_task_status(live.owner, live.id, state.status, result=live.dialect.response_json(state),
                                       error=state.error, final_event=event)
        else:
            self.store.append_event(live.id, event.seq, event.event, event.data)
        live.recorded += 1
        live.publish(event)

    def _finished(self, live: LiveTask, runner: asyncio.Task[None]) -> None:
        """Whatever stopped the runner, the log ends with a terminal event."""
        try:
            session = live.session
            if not session.terminated:
                # Stopped before its first step: the log still starts with created.
                wires = session.start() if live.recorded == 0 else []
                if self._closing:
                    wires += session.fail("server_shutting_down", "The server is shutting down.")
                elif runner.cancelled():
                    wires += session.cancel()
                else:
                    exc = runner.exception()
                    log.error("task %s failed", live.id, exc_info=exc)
                    wires += session.fail("server_error", f"Internal error: {type(exc).__name__}")
                for seq, name, data in wires:
                    self._record(live, seq, name, data)
            elif not runner.cancelled() and runner.exception() is not None:
                log.error("task %s: storing its events failed", live.id, exc_info=runner.exception())
        except Exception:
            # The store itself is failing; the next start closes this task.
            log.exception("task %s: could not close its event log", live.id)
        finally:
            # A runner cancelled before its first step never entered the run,
            # so nothing else gives back its place in the model queue.
            live.run.ticket.release()
            self._live.pop(live.id, None)
            live.close()

    # -- control -----------------------------------------------------------------

    async def cancel(self, live: LiveTask, wait_s: float = 30.0) -> None:
        """End a running task with ``response.cancelled`` and wait for it."""
        live.run.cancel.cancel()
        if not live.run.started and live.runner is not None:
            # Still queued: the engine never polls the token there; leave the queue.
            live.runner.cancel()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(live.done.wait()), wait_s)

    async def drain(self, timeout_s: float) -> None:
        """At shutdown (``Service.shutdown`` already ended every generation):
        let the runs record their terminal events, then stop what is left."""
        self._closing = True
        runners = [t.runner for t in self._live.values() if t.runner is not None]
        if runners:
            await asyncio.wait(runners, timeout=timeout_s)
        left = [t.runner for t in self._live.values() if t.runner is not None and not t.runner.done()]
        for runner in left:
            runner.cancel()
        if left:
            await asyncio.wait(left, timeout=2.0)

    # -- reading -----------------------------------------------------------------

    def follow(self, owner: str, task_id: str, after: int) -> AsyncIterator[TaskEvent] | None:
        """The task's events after store seq ``after``, then its live ones
        until the terminal event. ``None`` if the task is not found; raises
        ``EventsExpired`` here, before any byte is sent, if they were pruned."""
        live = self.live(task_id, owner)
        queue = live.subscribe() if live is not None else None
        try:
            first = self.store.events_after(owner, task_id, after, limit=_BATCH)
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
                    live: LiveTask | None, queue: asyncio.Queue[TaskEvent | None] | None) -> AsyncIterator[TaskEvent]:
        last = after
        try:
            while batch:
                for event in batch:
                    yield event
                    last = event.seq
                    if event.event in TERMINAL_EVENTS:
                        return
                batch = self.store.events_after(owner, task_id, last, limit=_BATCH) or []
            if queue is None:
                return  # not running here: the stored log is all there is
            while True:
                event = await queue.get()
                if event is None:
                    # The run ended; anything we have not seen is stored.
                    for event in self.store.events_after(owner, task_id, last, limit=_BATCH) or []:
                        yield event
                    return
                if event.seq <= last:
                    continue  # already replayed from the store
                yield event
                last = event.seq
                if event.event in TERMINAL_EVENTS:
                    return
        finally:
            if live is not None and queue is not None:
                live.unsubscribe(queue)
