"""Crash safety and bounds: what the store needs at start and while serving.

At start, before the first request: tasks and background responses that a
crash (or ``kill -9``) left running end as ``failed``, each log closed the
way its own stream session would have closed it (open items done as
incomplete, then one ``response.failed``); but a task whose response's end
was stored ends as that response did (a result once stored is never failed
afterwards). Idempotency keys whose
attempt died are released. While serving, the store is pruned on a timer,
and this instance renews its lease; on a shared store (PostgreSQL) it also
does the above for instances whose lease ran out (they died), so their tasks
end as ``failed`` within one lease instead of looking alive forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Callable

from lmspd.dialects import openai_responses
from lmspd.dialects.registry import DIALECTS, Dialect
from lmspd.store.base import ClosedLog, Store, TaskEvent, TaskRecord, default_terminal_event, is_terminal
from lmspd.streaming import steps
from lmspd.streaming.session import ResponseState, StreamSession

log = logging.getLogger("lmspd.recovery")

RESTART_MESSAGE = "lmspd stopped while this response was running (crash or restart); it did not finish."


def close_interrupted(task: TaskRecord, seq: int, events: list[TaskEvent]) -> ClosedLog:
    """``LogCloser``: rebuild the response from its log, then let a stream
    session fail it, so the closing events are exactly what a live failure
    would have sent."""
    dialect = DIALECTS.get(str(task.request.get("dialect")))
    if task.status != "failed" and task.result is not None and dialect is not None:
        finished = _finished_from_response(task, seq, dialect)
        if finished is not None:
            return finished
    error = task.error or {"code": "server_restarted", "message": RESTART_MESSAGE}
    if dialect is None:
        name, data = default_terminal_event(task, seq)
        return ClosedLog([(name, data)])
    model = str(task.request.get("model", ""))
    rebuilt: tuple[ResponseState, int | None] | None = None
    if events:
        try:
            rebuilt = dialect.rebuild([(e.event, e.data) for e in events], model, int(task.created_at))
        except Exception:
            log.exception("task %s: its log cannot be replayed; closing it with a bare failure", task.id)
    # With nothing to replay, still the dialect's own failure event (LMSP's
    # carries a problem object), for a response of which nothing is known.
    state, open_index = rebuilt or (
        ResponseState(id=task.response_id or task.id, model=model, created_at=int(task.created_at)), None)
    session = StreamSession.resume(state, dialect.encoder(), next_seq=dialect.wire_seq(seq), open_index=open_index)
    wires = session.fail(error["code"], error["message"])
    return ClosedLog([(name, data) for _, name, data in wires], dialect.response_json(state))


_TERMINAL_STEPS: dict[str, steps.TerminalStep] = {
    "completed": steps.ResponseCompleted(), "incomplete": steps.ResponseIncomplete(),
    "failed": steps.ResponseFailed(), "cancelled": steps.ResponseCancelled(),
}


def _finished_from_response(task: TaskRecord, seq: int, dialect: Dialect) -> ClosedLog | None:
    """The end of a task whose response was stored final (``task.result``)
    while its own terminal write was cut off: the terminal event that
    response's session sent, in the task's dialect. Its log holds every
    event before that one (the writer stores a terminal write only after
    all that came before it), so nothing else is left open."""
    assert task.result is not None
    try:
        state = openai_responses.state_from_json(task.result)
        step = _TERMINAL_STEPS[state.status]
        encoded = dialect.encoder().encode(step, state, dialect.wire_seq(seq))
    except Exception:
        log.exception("task %s: its stored response cannot be read back; closing it as failed", task.id)
        return None
    if encoded is None:
        return None
    return ClosedLog([encoded], dialect.response_json(state))


def reap(store: Store) -> int:
    """Fail what interrupted instances left running; returns how many rows changed.

    A response whose end was stored is never failed afterwards: its task
    ends as the response did (``close_interrupted``), and its row is left
    as it is."""
    closed = store.fail_interrupted_tasks(RESTART_MESSAGE, close_log=close_interrupted)
    failed = [task for task in closed if task.status == "failed"]
    for task in failed:
        _store_failed_response(store, task)
    responses = store.fail_interrupted_responses({"code": "server_restarted", "message": RESTART_MESSAGE})
    keys = store.abandon_interrupted_idempotency()
    if closed or responses or keys:
        log.warning("recovered from an unclean stop: %d task(s) and %d response(s) marked failed, %d task(s) "
                    "ended as their stored responses had, %d idempotency key(s) released", len(failed),
                    len(responses), len(closed) - len(failed), keys)
    return len(closed) + len(responses) + keys


def _store_failed_response(store: Store, task: TaskRecord) -> None:
    """The failed task's response row, never over one final already. An
    OpenAI background response is the task's result: the closed one is
    stored, output and all, rather than a bare status flip. Another
    dialect's result is in its own shape, not the row's: the row is marked
    failed with the task's error (an LMSP task's row said in_progress for
    good where its task was closed while its instance lived, and a
    continuation from it was refused as still running)."""
    if not task.response_id:
        return
    stored = store.get_response(task.owner, task.response_id)
    if stored is not None and is_terminal(stored.get("status")):
        return
    if task.request.get("dialect") == "openai":
        if task.result is not None:
            store.update_response(task.owner, task.response_id, task.result)
    elif stored is not None:
        store.update_response(task.owner, task.response_id, {**stored, "status": "failed", "error": task.error})


# A running task whose events the store refused (a full disk, a store down
# longer than the event writes wait).
STORE_REFUSED = {"code": "store_unavailable",
                 "message": "The store refused this response's events; it did not finish."}


def close_refused(store: Store, task_id: str) -> TaskRecord | None:
    """End a running task of this instance whose writer the store refused,
    as ``reap`` ends one a crash left (``Store.close_task``): on a store of
    its own no sweep runs while it serves, and until the next start the task
    said in_progress to every poll and could not be cancelled."""
    task = store.close_task(task_id, STORE_REFUSED, close_log=close_interrupted)
    if task is not None and task.status == "failed":
        _store_failed_response(store, task)
    return task


def recover(store: Store) -> None:
    reap(store)
    store.prune()


class LeaseKeeper:
    """Renews this instance's lease from a thread of its own, a few times
    per lease, and passes on the cancel requests the heartbeat reports
    (``on_cancel``, called on the event loop). A thread, not a coroutine: an
    event loop that stalls longer than the lease (a long store write, a
    decode) must not let another instance take this one for dead, fail its
    live tasks and release its idempotency keys, so that retried work runs
    twice. A heartbeat every quarter lease: a dead instance's lease runs out
    at most 3/4 of a lease after its death."""

    def __init__(self, store: Store, on_cancel: Callable[[list[str]], None]) -> None:
        self._store = store
        self._on_cancel = on_cancel
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Call on the serving event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="lmspd-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        interval = max(self._store.lease_s / 4, 0.05)
        while not self._stop.wait(interval):
            try:
                cancels = self._store.heartbeat()
            except Exception:
                log.exception("store heartbeat failed")
                continue
            if cancels and self._loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop is gone: shutting down
                    self._loop.call_soon_threadsafe(self._on_cancel, cancels)


async def reap_forever(store: Store) -> None:
    """On a shared store, fail what dead instances left running, a few
    times per lease (off the event loop)."""
    if not store.shared:
        return
    interval = max(store.lease_s / 4, 0.05)
    while True:
        await asyncio.sleep(interval)
        try:
            await asyncio.to_thread(reap, store)
        except Exception:
            log.exception("reaping interrupted work failed")


async def prune_forever(store: Store, interval_s: float) -> None:
    """Expire by age and by size, off the event loop (a prune deletes in
    small batches, so requests wait at most one batch for the writer)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            removed = await asyncio.to_thread(store.prune)
            if any(removed.values()):
                log.info("pruned %s", ", ".join(f"{n} {k}" for k, n in removed.items() if n))
        except Exception:
            log.exception("pruning the store failed")
