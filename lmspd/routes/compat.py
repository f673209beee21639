"""HTTP handlers for the two message-list dialects: Chat Completions
(``/v1/chat/completions``) and Anthropic Messages (``/v1/messages``,
``/v1/messages/count_tokens``).

Each handler is the Responses handler's shape: decode into a neutral
conversation, ``Service.begin`` (every refusal before any byte is sent),
then a ``StreamSession`` with the dialect's encoder, streamed as SSE or
drained into one JSON reply.
"""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lmspd import idempotency
from lmspd.bodies import JsonBody, decoded, read_json_body
from lmspd.core.conversation import Conversation
from lmspd.core.errors import ApiError
from lmspd.core.ids import new_id
from lmspd.core.run import RunContext
from lmspd.dialects import anthropic_messages, chat_completions
from lmspd.dialects.fields import FieldNames
from lmspd.dialects.session import agent_lineage, session_key
from lmspd.http import LmspdApp, app_state, json_reply, principal, run_to_end, sse_reply, unless_disconnected
from lmspd.idempotency import Reply
from lmspd.service import Run, RunStream, Service
from lmspd.streaming.session import ResponseState, StreamSession
from lmspd.streaming.sse import SSE_DONE, dumps, sse_event

log = logging.getLogger("lmspd.http")


async def _begin(service: Service, conversation: Conversation, run: RunContext, names: FieldNames) -> Run:
    try:
        return await service.begin(conversation, run)
    except ApiError as exc:
        raise names.name(exc) from None


async def _open(request: Request, run: Run, names: FieldNames) -> bool:
    """Reach the model before any byte is sent, so that a provider's refusal
    is still an HTTP error reply (see responses.py); False if the client left."""
    if not run.opens_first:
        return True
    try:
        return await unless_disconnected(request, run.open())
    except ApiError as exc:
        raise names.name(exc) from None


def _raise_unless_answered(state: ResponseState) -> None:
    """These dialects have no reply shape for a failed or cancelled
    generation (their finish/stop reason would be null): an error reply."""
    if state.status == "failed" and state.error:
        raise ApiError(state.error["code"], state.error["message"])
    if state.status not in ("completed", "incomplete"):
        raise ApiError("server_shutting_down" if state.status == "cancelled" else "server_error",
                       "The generation was stopped before it finished.")


Frame = Callable[[str, dict], bytes]


async def _frames(events: RunStream, frame: Frame,
                  trailer: Callable[[], list[tuple[str, dict]]], done: bytes = b"") -> AsyncIterator[bytes]:
    """The run's events as SSE frames, then the dialect's closing frames,
    which depend on how the run ended (so they are computed only once it has).
    Closing this closes the run's events (they give back what they hold)."""
    async with contextlib.aclosing(events):
        async for _seq, name, data in events:
            yield frame(name, data)
    for name, data in trailer():
        yield frame(name, data)
    if done:
        yield done


# -- Chat Completions ------------------------------------------------------------


async def chat_create(request: Request) -> Response:
    app = app_state(request)
    who = principal(request, "responses:write")
    body = await read_json_body(request, app.limits)
    # At most once per Idempotency-Key and credential, as every POST that
    # generates (a retry replays the first reply); the header was ignored here.
    return await idempotency.once(app.store, app.calls, who.owner, request, body.value,
                                  lambda: _chat(request, app, who.owner, body))


async def _chat(request: Request, app: LmspdApp, owner: str, body: JsonBody) -> Reply:
    req = await decoded(body, lambda raw: chat_completions.decode_request(raw, app.limits))
    # The client's session header (``lmspd.dialects.session``): cache affinity.
    run_context = RunContext(owner=owner, session_key=session_key(request.headers))
    run = await _begin(app.service, req.conversation, run_context, req.field_names)
    state = ResponseState(id=new_id("chatcmpl"), model=req.conversation.model)
    encoder = chat_completions.ChatEncoder(include_usage=req.include_usage)
    session = StreamSession(state, encoder)
    if not await _open(request, run, req.field_names):
        return Reply(Response(status_code=499))
    if req.stream:
        # Chat Completions streams are data-only frames.
        return Reply(sse_reply(_frames(run.events(session), lambda name, data: sse_event(None, data),
                                       lambda: encoder.trailer(state), SSE_DONE),
                               keepalive_s=app.settings.limits.sse_keepalive_s))
    if not await run_to_end(request, run.events(session)):
        return Reply(Response(status_code=499))
    _raise_unless_answered(state)
    return Reply(json_reply(chat_completions.completion_json(state)))


# -- Anthropic Messages ----------------------------------------------------------


def _anthropic(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Every failure on an Anthropic route in Anthropic's error shape — also
    a wrong method, which Starlette would otherwise answer in OpenAI's."""

    async def endpoint(request: Request) -> Response:
        try:
            if request.method != "POST":
                raise ApiError("method_not_allowed", f"{request.method} is not allowed on {request.url.path}.",
                               headers={"Allow": "POST"})
            return await handler(request)
        except ApiError as exc:
            return anthropic_error(exc)
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.url.path)
            return anthropic_error(ApiError("server_error", "Internal server error."))

    return endpoint


def anthropic_error(exc: ApiError) -> Response:
    return Response(dumps(exc.anthropic()), status_code=exc.status, headers=dict(exc.headers),
                    media_type="application/json")


async def messages_create(request: Request) -> Response:
    app = app_state(request)
    who = principal(request, "responses:write")
    body = await read_json_body(request, app.limits)
    return await idempotency.once(app.store, app.calls, who.owner, request, body.value,
                                  lambda: _messages(request, app, who.owner, body))


async def _messages(request: Request, app: LmspdApp, owner: str, body: JsonBody) -> Reply:
    req = await decoded(body, lambda raw: anthropic_messages.decode_request(raw, app.limits))
    # The client's session and agent (``lmspd.dialects.session``): cache affinity.
    agent, parent = agent_lineage(request.headers)
    run_context = RunContext(owner=owner, session_key=session_key(request.headers), agent_id=agent,
                             parent_agent_id=parent)
    run = await _begin(app.service, req.conversation, run_context, req.field_names)
    # message_start reports the prompt size before the prefill says how much was reused.
    state = ResponseState(id=new_id("msg"), model=req.conversation.model,
                          echo={"input_tokens": run.prepared.input_tokens})
    encoder = anthropic_messages.AnthropicEncoder()
    session = StreamSession(state, encoder)
    if not await _open(request, run, req.field_names):
        return Reply(Response(status_code=499))
    if req.stream:
        return Reply(sse_reply(_frames(run.events(session), sse_event, lambda: encoder.trailer(state)),
                               keepalive_s=app.settings.limits.sse_keepalive_s))
    if not await run_to_end(request, run.events(session)):
        return Reply(Response(status_code=499))
    _raise_unless_answered(state)
    return Reply(json_reply(anthropic_messages.message_json(state)))


async def messages_count_tokens(request: Request) -> Response:
    app = app_state(request)
    # Counting creates nothing; a read credential may do it (a count reads
    # no remembered state: no owner reaches the engine).
    principal(request, "responses:read")
    body = await read_json_body(request, app.limits)
    conversation: Conversation = (await decoded(
        body, lambda raw: anthropic_messages.decode_count_tokens(raw, app.limits))).conversation
    engine = app.service.model(conversation.model).engine
    # The count must be of a prompt the model could run: a create with these
    # tools would be refused, so the count is too (rather than counting a
    # prompt without them).
    if conversation.tools and conversation.tool_choice.mode != "none" and not engine.info.capabilities.get("tools"):
        raise ApiError("unsupported_capability", f"Model {conversation.model!r} does not support tools.",
                       param="tools")
    return json_reply({"input_tokens": await app.service.count_tokens(conversation)})


# Every method reaches the Anthropic wrapper, which answers a wrong one in
# Anthropic's shape (Starlette's own 405 would be rendered as OpenAI's).
_ANY_METHOD = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", chat_create, methods=["POST"]),
        Route("/v1/messages", _anthropic(messages_create), methods=_ANY_METHOD),
        Route("/v1/messages/count_tokens", _anthropic(messages_count_tokens), methods=_ANY_METHOD),
    ]
