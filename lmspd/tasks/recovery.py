"""Crash safety and bounds: what the store needs at start and while serving.

At start, before the first request: tasks and background responses that a
crash (or ``kill -9``) left running end as ``failed``, each log closed the
way its own stream session would have closed it (open items done as
incomplete, then one ``response.failed``), and idempotency keys whose
attempt died are released. While serving, the store is pruned on a timer.
"""

from __future__ import annotations

import asyncio
import logging

from lmspd.dialects.registry import DIALECTS
from lmspd.store.base import ClosedLog, Store, TaskEvent, TaskRecord, default_terminal_event
from lmspd.streaming.session import StreamSession

log = logging.getLogger("lmspd.recovery")

RESTART_MESSAGE = "lmspd stopped while this response was running (crash or restart); it did not finish."


def close_interrupted(task: TaskRecord, seq: int, events: list[TaskEvent]) -> ClosedLog:
    """``LogCloser``: rebuild the response from its log, then let a stream
    session fail it, so the closing events are exactly what a live failure
    would have sent."""
    dialect = DIALECTS.get(str(task.request.get("dialect")))
    error = task.error or {"code": "server_restarted", "message": RESTART_MESSAGE}
    if dialect is None or not events:
        name, data = default_terminal_event(task, seq)
        return ClosedLog([(name, data)])
    try:
        state, open_index = dialect.rebuild([(e.event, e.data) for e in events],
                                            str(task.request.get("model", "")), int(task.created_at))
    except Exception:
        log.exception("task %s: its log cannot be replayed; closing it with a bare failure", task.id)
        name, data = default_terminal_event(task, seq)
        return ClosedLog([(name, data)])
    session = StreamSession.resume(state, dialect.encoder(), next_seq=dialect.wire_seq(seq), open_index=open_index)
    wires = session.fail(error["code"], error["message"])
    return ClosedLog([(name, data) for _, name, data in wires], dialect.response_json(state))


def recover(store: Store) -> None:
    failed = store.fail_interrupted_tasks(RESTART_MESSAGE, close_log=close_interrupted)
    for task in failed:
        # A background response is the task's result: store the closed one,
        # output and all, rather than a bare status flip.
        if task.request.get("dialect") == "openai" and task.response_id and task.result is not None:
            store.update_response(task.owner, task.response_id, task.result)
    responses = store.fail_interrupted_responses({"code": "server_restarted", "message": RESTART_MESSAGE})
    keys = store.abandon_interrupted_idempotency()
    if failed or responses or keys:
        log.warning("recovered from an unclean stop: %d task(s) and %d response(s) marked failed, "
                    "%d idempotency key(s) released", len(failed), len(responses), keys)
    store.prune()


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
