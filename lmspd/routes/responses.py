"""Creating a response, in either Responses dialect: ``POST /v1/responses``,
``POST /lmsp/v1/responses`` and ``POST /lmsp/v1/tasks``; and its
neighbours ``POST /v1/responses/compact`` and ``/v1/responses/input_tokens``.
``begin_turn`` and ``turn_events`` are shared with the WebSocket route.

One flow for all three: credential, body, idempotency key, decoding with the
stored context (``previous_response_id``, ``conversation``,
``item_reference``), ``Service.begin`` (every refusal before any byte is
sent or any row is written), then one of three deliveries: a JSON reply, a
stream owned by this connection, or a background task that outlives it.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, replace
from typing import Any, AsyncGenerator, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from lmspd import compaction, idempotency
from lmspd.bodies import decode_off_loop, read_json_body, read_json_object
from lmspd.core.conversation import Item, SamplingDefaults
from lmspd.core.errors import ApiError, invalid
from lmspd.core.ids import new_id
from lmspd.core.lifecycle import TERMINAL_EVENT_NAMES
from lmspd.core.run import RunContext
from lmspd.dialects.decoded import ResponsesRequest
from lmspd.dialects.registry import LMSP, OPENAI, Dialect
from lmspd.dialects.responses_items import additional_tools_item
from lmspd.dialects.session import agent_lineage, session_key
from lmspd.history import NeedsStore, OnLoop, ResponseRecord, StoredContext
from lmspd.http import (
    LmspdApp,
    app_state,
    json_reply,
    json_reply_off_loop,
    lmsp_request,
    principal,
    run_to_end,
    sse_reply,
    unless_disconnected,
)
from lmspd.idempotency import Reply
from lmspd.routes.task_wire import follow_reply, live_task_json, task_json
from lmspd.service import TurnRun
from lmspd.store.calls import FINAL_WRITE_DELAYS_S, StoreCalls, retried
from lmspd.streaming.framing import Framer
from lmspd.streaming.session import ResponseState, StreamSession, WireEvent
from lmspd.tasks.manager import StoreUnavailable, TaskEncoder, snapshot, task_request

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
    body = await read_json_body(request, app.limits)
    raw = body.value
    return await idempotency.once(
        app.store, app.calls, who.owner, request, raw,
        lambda: _run(request, app, who.owner, dialect, raw, as_task=as_task, small=body.small),
        follow=lambda task_id: _follow(app, who.owner, dialect, task_id),
    )


async def _run(request: Request, app: LmspdApp, owner: str, dialect: Dialect, raw: dict,
               *, as_task: bool, small: bool = False) -> Reply:
    # Who this run is for and which client session and agent sent it
    # (``lmspd.dialects.session``: cache affinity).
    agent, parent = agent_lineage(request.headers)
    run_context = RunContext(owner=owner, session_key=session_key(request.headers), agent_id=agent,
                             parent_agent_id=parent)
    turn = await begin_turn(app, run_context, dialect, raw, context=StoredContext(app.store, owner, app.sealer),
                            queued=as_task or bool(raw.get("background")), small=small)
    req, run, session, record = turn.req, turn.run, turn.session, turn.record
    if turn.background:
        return await _start_task(app, owner, dialect, raw, req.stream, run, session, record, as_task=as_task)
    # An engine that must reach its provider first does it now, so that a
    # refusal is still an HTTP error (a no-op for the embedded engine).
    try:
        if run.opens_first and not await unless_disconnected(request, run.open()):
            return Reply(Response(status_code=499))
    except ApiError as exc:
        raise dialect.names(req, turn.window).name(exc) from None
    if req.stream:
        return Reply(sse_reply(_stream(dialect, turn, small), headers=dialect.headers,
                               keepalive_s=app.settings.limits.sse_keepalive_s))
    if not await run_to_end(request, turn_events(turn)):
        return Reply(Response(status_code=499))
    state = session.state
    stored = turn.stored
    if state.status == "failed" and state.error is not None:
        raise ApiError(state.error["code"], state.error["message"])
    if not stored:
        # Never a 200 that claims store: true for a response nobody can read back.
        raise ApiError("store_unavailable", f"The response {state.id!r} was generated but could not be stored, "
                       "so it cannot be retrieved or continued from; retry once the server's storage recovers, "
                       "or send store: false.", headers={"Retry-After": "5"})
    return Reply(await json_reply_off_loop(lambda: dialect.response_json(state), headers=dialect.headers))


@dataclass
class Turn:
    """One response on its way: the decoded request, its admitted run, the
    stream session that numbers its events and what it leaves in the store.
    Transport-neutral: SSE, JSON, a task and a WebSocket all deliver one."""

    dialect: Dialect
    req: ResponsesRequest
    run: TurnRun
    session: StreamSession
    record: ResponseRecord
    background: bool
    # Where the record's writes run (off the event loop).
    calls: StoreCalls
    # The window the model continues from (history + input), before the
    # engine prepared it: a WebSocket connection keeps it as its latest state.
    # A turn that compacts replaces it with the reduced window once the
    # summary is written (``compaction.CompactingRun``).
    window: list[Item] = field(default_factory=list)
    # False once storing the final state failed (``turn_events``).
    stored: bool = True


async def begin_turn(app: LmspdApp, run_context: RunContext, dialect: Dialect, raw: dict, *, context: Any,
                     queued: bool = False, small: bool = False) -> Turn:
    """Decode and admit (every refusal before any byte is sent).

    ``run_context`` is who the turn runs for and how (its owner, the
    client's session and agent, a ``generate: false`` warm-up, a WebSocket
    connection's pin): the engine gets it beside the decoded conversation,
    which nothing here writes.

    ``context`` resolves ``previous_response_id``; a WebSocket connection's
    context sets ``continued`` when it continued its own latest response
    (``routes.websocket.Latest``). Such a response may exist only in that
    connection (``store: false``): this one then stores that history with
    its own input, so that it stands on its own in the store."""
    req = await _decode(app, dialect, raw, context, small)
    if getattr(req, "prewarm", False) and not run_context.prefill_only:
        run_context = replace(run_context, prefill_only=True)
    continued = getattr(context, "continued", None)
    background = queued or req.background
    if req.background and not req.store:
        raise invalid("Background responses are stored: 'background: true' needs 'store: true' (the default).",
                      "background")
    owner = run_context.owner
    conversation = req.conversation
    model = conversation.model
    # An OpenAI background response says it is queued until the model takes
    # it; LMSP has no such status (its task object does).
    status = "queued" if background and dialect is OPENAI else "in_progress"
    served = app.service.models.get(model)
    sampling = served.engine.info.sampling if served is not None else SamplingDefaults()
    state = ResponseState(id=new_id("resp"), model=model, echo=dialect.echo(req, sampling), status=status)
    window = list(conversation.items)
    try:
        # A turn that compacts writes its summary once its events have started.
        compacting = await compaction.before_turn(app, run_context, req, window) if dialect is OPENAI else None
        # The service's Run, or one that acts as it (``TurnRun``: compaction's).
        run: TurnRun = compacting or await compaction.begin_run(app, conversation, run_context)
    except ApiError as exc:
        # The core names neutral fields; the client hears its own.
        raise dialect.names(req, conversation.items).name(exc) from None
    # A background run's events are all stored: none of its keep-alives.
    encoder = TaskEncoder(dialect.encoder()) if background else dialect.encoder()
    session = StreamSession(state, encoder)
    previous = req.previous_response_id
    input_items = req.input_items
    tool_items = list(getattr(req, "tool_items", []))
    if continued is not None and not continued.stored:
        input_items, previous = list(continued.items) + input_items, None
        if not tool_items and continued.tools:
            # The record stands alone, without the response whose item
            # declared the tools this turn keeps: it declares them itself.
            tool_items = [additional_tools_item(continued.tools)]
    record = ResponseRecord(app.store, owner, input_items, keep=req.store, previous_response_id=previous,
                            conversation_id=req.conversation_id, tool_items=tool_items)
    return Turn(dialect, req, run, session, record, background, app.calls, window)


async def _decode(app: LmspdApp, dialect: Dialect, raw: dict, context: Any, small: bool) -> Any:
    """The decoded request. The stored history it names is read and expanded
    off the event loop; a small body that names none is decoded on the loop
    (lmspd.bodies: a thread hop costs more than that)."""
    if small:
        try:
            return dialect.decode(raw, app.limits, context=OnLoop(context))
        except NeedsStore:
            pass
    return await app.service.decode(lambda: dialect.decode(raw, app.limits, context=context))


async def turn_events(turn: Turn) -> AsyncGenerator[WireEvent, None]:
    """The turn's wire events, the same on every transport; the response is
    stored before its terminal event leaves (a GET right after finds it);
    if that fails the terminal event says ``store: false``. Closing it
    closes the run's events at once (the run gives back what it holds,
    read or not)."""
    async with contextlib.aclosing(turn.run.events(turn.session)) as events:
        async for wire in events:
            if wire[1] in TERMINAL_EVENT_NAMES and not await _ended(turn, turn.session.state):
                # The output is already whole: the end says it is not stored.
                turn.stored = False
                _mark_unstored(wire[2])
            yield wire


async def _start_task(app: LmspdApp, owner: str, dialect: Dialect, raw: dict, stream: bool, run: TurnRun,
                session: StreamSession, record: ResponseRecord, *, as_task: bool) -> Reply:
    state = session.state
    # OpenAI addresses a background response by its response id, so the task
    # that runs it has the same id.
    task_id = new_id("task") if as_task else state.id
    try:
        live = await app.tasks.start(task_id=task_id, owner=owner, dialect=dialect,
                                     request=task_request(dialect, state.model, raw), run=run, session=session,
                                     record=record)
    except StoreUnavailable as exc:
        # Never an id the client cannot read back: nothing ran, nothing was answered.
        raise ApiError("store_unavailable", str(exc), headers={"Retry-After": "5"}) from None
    location = {"Location": f"/lmsp/v1/tasks/{task_id}"} if as_task else {}
    if stream:
        # Where to resume from, should this connection drop.
        reply = await _follow(app, owner, dialect, task_id)
        reply.headers.update(location)
        return Reply(reply, follow_task=task_id)
    if not as_task:
        # The queued response as it is now (it starts running meanwhile): no
        # output yet, but it echoes the request (instructions, tools: megabytes).
        queued = snapshot(state)
        return Reply(await json_reply_off_loop(lambda: dialect.response_json(queued), headers=dialect.headers))
    # The task runs from here on: its id reaches the client whatever the
    # store does now. Refused (a full store queue) or failed, this answered
    # 503 or 500, the idempotency key was released, and the client's retry
    # started a second task beside the first, unseen.
    try:
        task = await retried(lambda: app.calls.unrefused(app.store.get_task, owner, task_id), FINAL_WRITE_DELAYS_S,
                             f"task {task_id}: reading it back")
    except Exception:
        log.exception("task %s: could not read it back; answering from its live state", task_id)
        task = None
    body = task_json(task, live) if task is not None else live_task_json(live)
    return Reply(json_reply(body, status=202, headers={**dialect.headers, **location}))


async def _follow(app: LmspdApp, owner: str, dialect: Dialect, task_id: str) -> Response:
    code = "task_not_found" if dialect is LMSP else "response_not_found"
    return await follow_reply(app, owner, dialect, task_id, 0, ApiError(code, f"{task_id!r} not found."))


async def _stream(dialect: Dialect, turn: Turn, small: bool) -> AsyncIterator[bytes]:
    """A stream owned by this connection: if the client leaves, generation
    stops (LMSP §6.3) and nothing is stored. A large request's echo in its
    lifecycle events is encoded off the event loop, once (``Framer``)."""
    frame = Framer(dialect.frame, decode_off_loop, small=small)
    async with contextlib.aclosing(turn_events(turn)) as events:
        async for seq, name, data in events:
            yield await frame(seq, name, data)
    if dialect.trailer is not None:
        yield dialect.trailer


async def _ended(turn: Turn, state: ResponseState) -> bool:
    """Store the final state; False if that failed (a full or broken disk).

    The generation is done: its write is never refused for a full store
    queue (it waits its turn, ``StoreCalls.unrefused``), and a transient
    store error (busy, locked, a pool timeout) is tried again a few times
    (``FINAL_WRITE_DELAYS_S``) before the client hears it was not stored."""
    if not turn.record.writes_at_end(state):
        return True  # nothing to write: no queue behind a busy store
    try:
        await retried(lambda: turn.calls.unrefused(turn.record.ended, state), FINAL_WRITE_DELAYS_S,
                      f"storing response {state.id}")
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


# -- the neighbours: compaction and token counting ------------------------------------


async def openai_compact(request: Request) -> Response:
    """``POST /v1/responses/compact`` (``lmspd.compaction``)."""
    app = app_state(request)
    who = principal(request, "responses:write")
    raw = await read_json_object(request, app.limits)

    async def compact() -> Reply:
        body = await compaction.compact(app, who.owner, OPENAI, raw, StoredContext(app.store, who.owner, app.sealer))
        return Reply(await json_reply_off_loop(lambda: body))

    # At most once per Idempotency-Key and credential, as every POST that
    # generates (the summary is a generation); the header was ignored here.
    return await idempotency.once(app.store, app.calls, who.owner, request, raw, compact)


async def openai_input_tokens(request: Request) -> Response:
    """``POST /v1/responses/input_tokens``: what a create body's input
    renders to, in the model's own tokens (tools and instructions included)."""
    app = app_state(request)
    who = principal(request, "responses:read")
    raw = await read_json_object(request, app.limits)
    if "model" not in raw and len(app.service.models) == 1:
        raw = {**raw, "model": next(iter(app.service.models))}
    body = {k: v for k, v in raw.items() if k not in ("stream", "stream_options", "background")}
    context = StoredContext(app.store, who.owner, app.sealer)
    req = await app.service.decode(lambda: OPENAI.decode({**body, "store": False}, app.limits, context=context))
    # Rendering and tokenizing are proportional to the input: off the event loop.
    return json_reply({"object": "response.input_tokens",
                       "input_tokens": await app.service.count_tokens(req.conversation)})
