"""How tasks look on the wire: the LMSP task object, and a task's events
followed as SSE (LMSP task events, OpenAI background streams)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator

from starlette.responses import StreamingResponse

from lmspd.bodies import decode_off_loop
from lmspd.core.errors import ApiError, invalid
from lmspd.core.lifecycle import TERMINAL_EVENT_NAMES
from lmspd.dialects.registry import LMSP, Dialect
from lmspd.http import LmspdApp, sse_reply
from lmspd.store.base import EventsExpired, TaskRecord
from lmspd.streaming.framing import Framer
from lmspd.tasks.manager import LiveTask

log = logging.getLogger(__name__)


def task_json(task: TaskRecord, live: LiveTask | None) -> dict[str, Any]:
    result = task.result
    if result is None and live is not None:
        result = LMSP.response_json(live.state)  # as it stands so far
    error = None
    if task.error is not None:
        error = ApiError(task.error.get("code", "server_error"), task.error.get("message", "")).problem()
    return {
        "id": task.id,
        "object": "task",
        "status": task.status,
        "response_id": task.response_id,
        "created_at": int(task.created_at),
        "updated_at": int(task.updated_at),
        "finished_at": None if task.finished_at is None else int(task.finished_at),
        # Resume with Last-Event-ID / ?after= up to this id; events before
        # the first retained one are gone (410).
        "last_event_id": task.last_seq,
        "first_retained_event_id": task.first_retained_seq,
        "result": result,
        "error": error,
    }


def live_task_json(live: LiveTask) -> dict[str, Any]:
    """``task_json`` of a task just started, from its live state alone (its
    stored record could not be read back)."""
    state = live.state
    return {
        "id": live.id,
        "object": "task",
        "status": state.status,
        "response_id": state.id,
        "created_at": int(state.created_at),
        "updated_at": int(state.created_at),
        "finished_at": None,
        "last_event_id": live.recorded,
        "first_retained_event_id": 1,
        "result": LMSP.response_json(state),
        "error": None,
    }


def check_after(task: TaskRecord, after: int, dialect: Dialect, param: str) -> None:
    """Every event is stored before anyone sees it, so an id past the stored
    log was never sent: a client mistake, not something to wait for."""
    if after > task.last_seq:
        raise invalid(f"No event {dialect.wire_seq(after)} has been sent yet; the last one is "
                      f"{dialect.wire_seq(task.last_seq)}.", param)


def cut_short(task_id: str) -> ApiError:
    """Why a task's events ended before its terminal event, the task still there."""
    return ApiError("store_unavailable", f"The events of {task_id!r} could not all be stored; read it for its "
                    "final state.")


def history_expired(task_id: str, dialect: Dialect, after: int = 0, first_kept: int | None = None) -> ApiError:
    """410: the events asked for (those after store seq ``after``) were
    pruned; ``first_kept``: the earliest event still kept, if any is."""
    asked = f"Events after {dialect.wire_seq(after)} of {task_id!r}" if after else f"The events of {task_id!r}"
    kept = "" if first_kept is None else f" (the earliest kept is {dialect.wire_seq(first_kept)})"
    return ApiError("event_history_expired", f"{asked} are no longer kept{kept}; read the final result instead.")


async def follow_reply(app: LmspdApp, owner: str, dialect: Dialect, task_id: str, after: int,
                 not_found: ApiError) -> StreamingResponse:
    """The task's events after store seq ``after`` as SSE, live until its
    terminal event. 404/410 are raised here, before the stream starts."""
    try:
        events = await app.tasks.follow(owner, task_id, after)
    except EventsExpired as exc:
        raise history_expired(task_id, dialect, exc.after_seq, exc.first_kept) from None
    if events is None:
        raise not_found

    async def frames() -> AsyncIterator[bytes]:
        ended, last = False, after
        # A response object read back from the log is encoded off the loop where it is large.
        frame = Framer(dialect.frame, decode_off_loop)
        try:
            # aclosing: a reader that leaves unsubscribes at once, not at GC.
            async with contextlib.aclosing(events) as stream:
                async for event in stream:
                    yield await frame(dialect.wire_seq(event.seq), event.event, event.data)
                    ended, last = event.event in TERMINAL_EVENT_NAMES, event.seq
        except EventsExpired as exc:  # retention dropped the log while it was being read
            yield dialect.stream_error(history_expired(task_id, dialect, exc.after_seq, exc.first_kept),
                                       dialect.wire_seq(last + 1))
            return
        except Exception:  # reading the log failed (the store is down)
            log.exception("following %s", task_id)
            yield dialect.stream_error(cut_short(task_id), dialect.wire_seq(last + 1))
            return
        if ended:
            if dialect.trailer is not None:
                yield dialect.trailer
            return
        try:
            task = await app.calls(app.store.get_task, owner, task_id)
        except Exception:  # the store failing is one way to get here
            cause = cut_short(task_id)
        else:
            if task is not None and task.terminal and task.last_seq <= last:
                return  # asked for what comes after the last event: nothing
            cause = not_found if task is None else cut_short(task_id)
        # The log stopped short of its terminal event: the stream says why
        # instead of just ending, which a client would read as a dropped
        # connection and retry forever.
        yield dialect.stream_error(cause, dialect.wire_seq(last + 1))

    return sse_reply(frames(), headers=dialect.headers, keepalive_s=app.settings.limits.sse_keepalive_s)
