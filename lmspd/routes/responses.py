"""Creating a response, in either Responses dialect: ``POST /v1/responses``,
``POST /lmsp/v1/responses`` and ``POST /lmsp/v1/tasks``.

One flow for all three: credential, body, idempotency key, decoding with the
stored context (``previous_response_id``, ``conversation``,
``item_reference``), ``Service.begin`` (every refusal before any byte is
sent or any row is written), then one of three deliveries: a JSON reply, a
stream owned by this connection, or a background task that outlives it.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from lmspd import idempotency
from lmspd.idempotency import Reply
from lmspd.bodies import read_json_object
from lmspd.core.errors import ApiError, invalid
from lmspd.core.ids import new_id
from lmspd.dialects.registry import LMSP, OPENAI, Dialect
from lmspd.dialects.session import session_key
from lmspd.history import ResponseRecord, StoredContext
from lmspd.routes.common import (
    LmspdApp,
    app_state,
    json_reply,
    lmsp_request,
    principal,
    run_to_end,
    sse_reply,
    unless_disconnected,
)
from lmspd.service import Run
from lmspd.streaming.session import ResponseState, StreamSession
from lmspd.tasks.manager import TERMINAL_EVENTS, task_request
from lmspd.tasks.wire import follow_reply, task_json

log = logging.getLogger("lmspd.http")


async def openai_create_response(request: Request) -> Response:
    return await _create(request, OPENAI)


async def lmsp_create_response(request: Request) -> Response:
    return await _create(request, LMSP)


async def lmsp_create_task(request: Request) -> Response:
    return await _create(request, LMSP, as_task=True)


async def _create(request: Request, dialect: Dialect, *, as_task: bool = False) -> Response:
    app = app_state(request)
    who = lmsp_request(request, "responses:write") if dialect is LMSP else principal(request, "responses:write")
    raw = await read_json_object(request, app.limits)
    return await idempotency.once(
        app.store, who.owner, request, raw,
        lambda: _run(request, app, who.owner, dialect, raw, as_task=as_task),
        follow=lambda task_id: _follow(app, who.owner, dialect, task_id),
    )


async def _run(request: Request, app: LmspdApp, owner: str, dialect: Dialect, raw: dict,
               *, as_task: bool) -> Reply:
    req = dialect.decode(raw, app.limits, context=StoredContext(app.store, owner))
    req.conversation.session_key = session_key(request.headers)
    background = as_task or req.background
    if req.background and not req.store:
        raise invalid("Background responses are stored: 'background: true' needs 'store: true' (the default).",
                      "background")
    model = req.conversation.model
    # An OpenAI background response says it is queued until the model takes
    # it; LMSP has no such status (its task object does).
    status = "queued" if background and dialect is OPENAI else "in_progress"
    state = ResponseState(id=new_id("resp"), model=model, echo=dialect.echo(req), status=status)
    run = await app.service.begin(req.conversation, owner)
    session = StreamSession(state, dialect.encoder())
    record = ResponseRecord(app.store, owner, req.input_items, keep=req.store,
                            previous_response_id=req.previous_response_id, conversation_id=req.conversation_id)
    if background:
        return _start_task(app, owner, dialect, raw, req.stream, run, session, record, as_task=as_task)
    # An engine that must reach its provider first does it now, so that a
    # refusal is still an HTTP error (a no-op for the embedded engine).
    if run.opens_first and not await unless_disconnected(request, run.open()):
        return Reply(Response(status_code=499))
    if req.stream:
        return Reply(sse_reply(_stream(dialect, run, session, record), headers=dialect.headers))
    if not await run_to_end(request, run.events(session)):
        return Reply(Response(status_code=499))
    stored = _ended(record, state)
    if state.status == "failed":
        raise ApiError(state.error["code"], state.error["message"])
    if not stored:
        # Never a 200 that claims store: true for a response nobody can read back.
        raise ApiError("store_unavailable", f"The response {state.id!r} was generated but could not be stored, "
                       "so it cannot be retrieved or continued from; retry once the server's storage recovers, "
                       "or send store: false.", headers={"Retry-After": "5"})
    return Reply(json_reply(dialect.response_json(state), headers=dialect.headers))


def _start_task(app: LmspdApp, owner: str, dialect: Dialect, raw: dict, stream: bool, run: Run,
                session: StreamSession, record: ResponseRecord, *, as_task: bool) -> Reply:
    state = session.state
    # OpenAI addresses a background response by its response id, so the task
    # that runs it has the same id.
    task_id = new_id("task") if as_task else state.id
    live = app.tasks.start(task_id=task_id, owner=owner, dialect=dialect,
                           request=task_request(dialect, state.model, raw), run=run, session=session, record=record)
    location = {"Location": f"/lmsp/v1/tasks/{task_id}"} if as_task else {}
    if stream:
        # Where to resume from, should this connection drop.
        reply = _follow(app, owner, dialect, task_id)
        reply.headers.update(location)
        return Reply(reply, follow_task=task_id)
    if not as_task:
        return Reply(json_reply(dialect.response_json(state), headers=dialect.headers))
    task = app.store.get_task(owner, task_id)
    assert task is not None
    return Reply(json_reply(task_json(task, live), status=202, headers={**dialect.headers, **location}))


def _follow(app: LmspdApp, owner: str, dialect: Dialect, task_id: str) -> Response:
    code = "task_not_found" if dialect is LMSP else "response_not_found"
    return follow_reply(app, owner, dialect, task_id, 0, ApiError(code, f"{task_id!r} not found."))


async def _stream(dialect: Dialect, run: Run, session: StreamSession, record: ResponseRecord) -> AsyncIterator[bytes]:
    """A stream owned by this connection: if the client leaves, generation
    stops (LMSP §6.3) and nothing is stored."""
    async for seq, name, data in run.events(session):
        if name in TERMINAL_EVENTS:
            # Stored before the client reads the end: a GET right after finds it.
            if not _ended(record, session.state):
                _mark_unstored(data)
        yield dialect.frame(seq, name, data)
    if dialect.trailer is not None:
        yield dialect.trailer


def _ended(record: ResponseRecord, state: ResponseState) -> bool:
    """Store the final state; False if that failed (a full or broken disk)."""
    try:
        record.ended(state)
    except Exception:
        log.exception("could not store response %s", state.id)
        return False
    return True


def _mark_unstored(data: dict) -> None:
    """A stream's output is already with the client when storing fails: the
    terminal event says ``store: false`` (in the Response object on /v1, on
    the event itself on LMSP) rather than failing an answer that is whole."""
    response = data.get("response")
    (response if isinstance(response, dict) else data)["store"] = False
