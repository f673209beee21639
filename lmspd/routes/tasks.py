"""LMSP tasks (``/lmsp/v1/tasks``): a response request run in the background,
its state and final result, its resumable events, and cancel.

``POST /lmsp/v1/tasks`` shares the create flow of ``/lmsp/v1/responses``
(``lmspd.routes.responses``); with ``"stream": true`` its reply follows the
task's events, and unlike a plain stream, leaving does not stop the task.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from lmspd.core.errors import ApiError, invalid
from lmspd.dialects.registry import LMSP
from lmspd.http import LmspdApp, app_state, json_reply, lmsp_request, query_int
from lmspd.routes.responses import lmsp_create_task
from lmspd.routes.task_wire import check_after, follow_reply, task_json
from lmspd.store.base import TaskRecord

__all__ = ["lmsp_create_task", "get_task", "task_events", "cancel_task"]


def not_found(task_id: str) -> ApiError:
    return ApiError("task_not_found", f"Task {task_id!r} not found.")


async def _task(app: LmspdApp, owner: str, task_id: str) -> TaskRecord:
    task = await app.calls(app.store.get_task, owner, task_id)
    # OpenAI background responses run on the same machinery; they are read
    # through /v1/responses, in their own event shapes.
    if task is None or task.request.get("dialect") != LMSP.name:
        raise not_found(task_id)
    return task


async def get_task(request: Request) -> Response:
    app = app_state(request)
    owner = lmsp_request(request, "tasks:read").owner
    task_id = request.path_params["task_id"]
    task = await _task(app, owner, task_id)
    return json_reply(task_json(task, app.tasks.live(task_id, owner)), headers=LMSP.headers)


async def task_events(request: Request) -> Response:
    """Events after ``?after=N`` or, without it, ``Last-Event-ID: N`` (LMSP
    §6.4: ``after`` wins); from the first event without either."""
    app = app_state(request)
    owner = lmsp_request(request, "tasks:read").owner
    task_id = request.path_params["task_id"]
    task = await _task(app, owner, task_id)
    after = query_int(request, "after", minimum=0)
    param = "after"
    if after is None:
        after, param = _last_event_id(request), "Last-Event-ID"
    check_after(task, after, LMSP, param)
    return await follow_reply(app, owner, LMSP, task_id, after, not_found(task_id))


async def cancel_task(request: Request) -> Response:
    app = app_state(request)
    owner = lmsp_request(request, "responses:write").owner
    task_id = request.path_params["task_id"]
    await _task(app, owner, task_id)
    # Wherever it runs: another instance on a shared store gets the request.
    await app.tasks.cancel_task(owner, task_id)
    # A finished task is returned as it is: cancelling twice is harmless.
    return json_reply(task_json(await _task(app, owner, task_id), app.tasks.live(task_id, owner)), headers=LMSP.headers)


def _last_event_id(request: Request) -> int:
    raw = request.headers.get("last-event-id")
    if raw is None or raw.strip() == "":
        return 0
    try:
        value = int(raw.strip())
    except ValueError:
        raise invalid(f"Last-Event-ID must be an event id (an integer), not {raw!r}.", "Last-Event-ID") from None
    if value < 0:
        raise invalid("Last-Event-ID must not be negative.", "Last-Event-ID")
    return value
