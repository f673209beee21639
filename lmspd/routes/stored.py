"""Stored responses: ``GET``/``DELETE /v1/responses/{id}`` (``?stream=true``
resumes a background response's events), ``POST /v1/responses/{id}/cancel``,
``GET /v1/responses/{id}/input_items`` and ``GET /lmsp/v1/responses/{id}``.

Another credential's response is exactly as absent as one that never
existed: the same 404, the same message.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from lmspd.core.errors import ApiError, invalid
from lmspd.dialects import lmsp, openai_responses
from lmspd.dialects.registry import OPENAI
from lmspd.http import (
    LmspdApp,
    app_state,
    json_reply,
    json_reply_off_loop,
    lmsp_request,
    principal,
    query_bool,
    query_choice,
    query_int,
)
from lmspd.routes.task_wire import check_after, follow_reply, history_expired
from lmspd.store.base import InvalidCursor, Page, TaskRecord


def not_found(response_id: str) -> ApiError:
    return ApiError("response_not_found", f"Response {response_id!r} not found.")


async def _stored(app: LmspdApp, owner: str, response_id: str) -> dict[str, Any]:
    live = app.tasks.live(response_id, owner)
    if live is not None and live.dialect is OPENAI:
        # Running in the background here: the live state has the output so
        # far, and the stored body (as large as the request's echo, parsed
        # holding the interpreter lock) is older; a client polls this.
        return openai_responses.response_json(live.state)
    body = await app.calls(app.store.get_response, owner, response_id)
    if body is None:
        raise not_found(response_id)
    return body


async def _openai_task(app: LmspdApp, owner: str, response_id: str) -> TaskRecord | None:
    """The task that runs (or ran) background response ``response_id``; an
    LMSP task is no response of /v1's, whatever id it is asked by."""
    task = await app.calls(app.store.get_task, owner, response_id, result=False)
    return task if task is not None and task.request.get("dialect") == OPENAI.name else None


async def _background_task(app: LmspdApp, owner: str, response_id: str, body: dict[str, Any]) -> TaskRecord | None:
    """The task of a background response; ``None`` once it expired (tasks
    are kept for less time than responses: ``Retention``)."""
    task = await _openai_task(app, owner, response_id)
    if task is None and body.get("background") is not True:
        raise invalid(f"Response {response_id!r} was not created with 'background: true'; only background "
                      "responses can be streamed again or cancelled.", "response_id")
    return task


async def openai_get_response(request: Request) -> Response:
    app = app_state(request)
    owner = principal(request, "responses:read").owner
    response_id = request.path_params["response_id"]
    body = await _stored(app, owner, response_id)
    if not query_bool(request, "stream"):
        return await json_reply_off_loop(lambda: body)
    task = await _background_task(app, owner, response_id, body)
    if task is None:
        raise history_expired(response_id, OPENAI)
    starting_after = query_int(request, "starting_after", minimum=0)
    # sequence_number N is store seq N + 1; "after N" means store seq > N + 1.
    after = 0 if starting_after is None else OPENAI.store_seq(starting_after)
    check_after(task, after, OPENAI, "starting_after")
    return await follow_reply(app, owner, OPENAI, response_id, after, not_found(response_id))


async def openai_delete_response(request: Request) -> Response:
    app = app_state(request)
    owner = principal(request, "responses:write").owner
    response_id = request.path_params["response_id"]
    # Stopped first, so that nothing writes it again once deleted.
    if await _openai_task(app, owner, response_id) is not None:
        await app.tasks.cancel_task(owner, response_id)
    if not await app.calls(app.store.delete_response, owner, response_id):
        raise not_found(response_id)
    return json_reply({"id": response_id, "object": "response.deleted", "deleted": True})


async def openai_cancel_response(request: Request) -> Response:
    app = app_state(request)
    owner = principal(request, "responses:write").owner
    response_id = request.path_params["response_id"]
    body = await _stored(app, owner, response_id)
    if await _background_task(app, owner, response_id, body) is not None:
        await app.tasks.cancel_task(owner, response_id)
        body = await _stored(app, owner, response_id)
    # Already finished (its task expired, too): returned as it is (cancelling twice is harmless).
    return await json_reply_off_loop(lambda: body)


async def openai_input_items(request: Request) -> Response:
    app = app_state(request)
    owner = principal(request, "responses:read").owner
    response_id = request.path_params["response_id"]
    after, limit, order = page_params(request)
    try:
        page = await app.calls(app.store.list_input_items, owner, response_id, after=after, limit=limit,
                               order=order)  # type: ignore[arg-type]
    except InvalidCursor:
        raise invalid(f"'after' names item {after!r}, which is not in this list.", "after") from None
    if page is None:
        raise not_found(response_id)
    return await json_reply_off_loop(lambda: list_json(page))


async def lmsp_get_response(request: Request) -> Response:
    app = app_state(request)
    owner = lmsp_request(request, "responses:read").owner
    response_id = request.path_params["response_id"]
    body = await _stored(app, owner, response_id)
    return await json_reply_off_loop(lambda: lmsp.response_json(openai_responses.state_from_json(body)),
                                         headers={"LMSP-Version": lmsp.VERSION})


# -- lists -----------------------------------------------------------------------


def page_params(request: Request) -> tuple[str | None, int, str]:
    """OpenAI's list parameters: ``after`` (an item id), ``limit`` (1-100,
    default 20), ``order`` (``asc``/``desc``, default ``desc``)."""
    after = request.query_params.get("after") or None
    limit = query_int(request, "limit", minimum=1, maximum=100)
    order = query_choice(request, "order", ("asc", "desc"), "desc")
    return after, 20 if limit is None else limit, order


def list_json(page: Page) -> dict[str, Any]:
    items = page.items
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": page.has_more,
    }
