"""HTTP assembly: routes, error rendering per dialect, lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lmspd import __version__
from lmspd.auth import Authenticator, Principal
from lmspd.bodies import read_json_object
from lmspd.config import Settings
from lmspd.core.errors import ApiError
from lmspd.core.ids import new_id
from lmspd.dialects import lmsp, openai_responses
from lmspd.service import Service
from lmspd.streaming.session import ResponseState, StreamSession
from lmspd.streaming.sse import SSE_DONE, SSE_HEADERS, dumps, sse_event

log = logging.getLogger("lmspd.http")

LMSP_PREFIX = "/lmsp/"


class LmspdApp:
    """The application state every handler needs."""

    def __init__(self, settings: Settings, service: Service) -> None:
        self.settings = settings
        self.service = service
        self.auth = Authenticator(settings.api_keys)

    @property
    def limits(self):  # noqa: ANN201 - a RequestLimits
        return self.settings.limits.request


# -- errors ----------------------------------------------------------------------


def error_response(request: Request, exc: ApiError) -> Response:
    headers = dict(exc.headers)
    if request.url.path.startswith(LMSP_PREFIX):
        headers["LMSP-Version"] = lmsp.VERSION
        return Response(dumps(exc.problem()), status_code=exc.status, headers=headers,
                        media_type="application/problem+json")
    return Response(dumps(exc.openai()), status_code=exc.status, headers=headers, media_type="application/json")


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(request, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        err = ApiError("method_not_allowed", f"{request.method} is not allowed on {request.url.path}.")
    elif exc.status_code == 404:
        err = ApiError("not_found", f"No route for {request.method} {request.url.path}.")
    else:
        err = ApiError("invalid_request", str(exc.detail), status=exc.status_code)
    return error_response(request, err)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(request, ApiError("server_error", "Internal server error."))


# -- handlers --------------------------------------------------------------------


def _state(request: Request) -> LmspdApp:
    return request.app.state.lmspd


def _principal(request: Request, scope: str) -> Principal:
    principal = _state(request).auth.authenticate(request)
    principal.require(scope)
    return principal


async def health(request: Request) -> Response:
    app = _state(request)
    status = "shutting_down" if app.service.shutting_down else "ok"
    models = {
        mid: {"busy": m.queue.busy, "pending": m.queue.pending, **m.engine.stats()}
        for mid, m in app.service.models.items()
    }
    return JSONResponse({"status": status, "version": __version__, "models": models},
                        status_code=503 if app.service.shutting_down else 200)


async def openai_models(request: Request) -> Response:
    _principal(request, "responses:read")
    data = [
        {"id": m.engine.info.id, "object": "model", "created": m.engine.info.created, "owned_by": m.engine.info.owned_by}
        for m in _state(request).service.models.values()
    ]
    return JSONResponse({"object": "list", "data": data})


async def lmsp_models(request: Request) -> Response:
    lmsp.check_version(request.headers.get("lmsp-version"))
    _principal(request, "responses:read")
    data = []
    for m in _state(request).service.models.values():
        info = m.engine.info
        caps = {"streaming": True, "conversations": False, "tasks": False, **info.capabilities}
        data.append({"id": info.id, "object": "model", "context_window": info.context_window, "capabilities": caps})
    return JSONResponse({"object": "list", "data": data}, headers={"LMSP-Version": lmsp.VERSION})


async def openai_create_response(request: Request) -> Response:
    app = _state(request)
    _principal(request, "responses:write")
    raw = await read_json_object(request, app.limits)
    req = openai_responses.decode_request(raw, app.limits)
    body = req.body
    if body.background:
        raise ApiError("unsupported_parameter", "Background responses are not supported yet.", param="background")
    if body.previous_response_id is not None:
        raise ApiError("response_not_found", f"Previous response {body.previous_response_id!r} not found.",
                       param="previous_response_id")
    if body.conversation is not None:
        raise ApiError("conversation_not_found", "Conversations are not supported yet.", param="conversation")
    run = app.service.begin(req.conversation)
    state = ResponseState(id=new_id("resp"), model=req.conversation.model,
                          echo=openai_responses.echo_fields(req))
    session = StreamSession(state, openai_responses.OpenAIEncoder())
    if req.stream:
        return _sse(run.events(session), lambda seq, name, data: sse_event(name, data), done=SSE_DONE)
    if not await _run_to_end(request, run.events(session)):
        return Response(status_code=499)
    if state.status == "failed":
        raise ApiError(state.error["code"], state.error["message"])
    return JSONResponse(openai_responses.response_json(state))


async def lmsp_create_response(request: Request) -> Response:
    app = _state(request)
    lmsp.check_version(request.headers.get("lmsp-version"))
    _principal(request, "responses:write")
    raw = await read_json_object(request, app.limits)
    req = lmsp.decode_request(raw, app.limits)
    if req.body.previous_response_id is not None:
        raise ApiError("response_not_found", f"Previous response {req.body.previous_response_id!r} not found.",
                       param="previous_response_id")
    run = app.service.begin(req.conversation)
    state = ResponseState(id=new_id("resp"), model=req.conversation.model)
    session = StreamSession(state, lmsp.LmspEncoder())
    headers = {"LMSP-Version": lmsp.VERSION}
    if req.stream:
        return _sse(run.events(session), lambda seq, name, data: sse_event(name, data, seq), headers=headers)
    if not await _run_to_end(request, run.events(session)):
        return Response(status_code=499)
    if state.status == "failed":
        raise ApiError(state.error["code"], state.error["message"])
    return JSONResponse(lmsp.response_json(state), headers=headers)


def _sse(
    events: AsyncIterator[tuple[int, str, dict]],
    frame: Callable[[int, str, dict], bytes],
    *,
    done: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        async for seq, name, data in events:
            yield frame(seq, name, data)
        if done is not None:
            yield done

    return StreamingResponse(body(), media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})


async def _run_to_end(request: Request, events: AsyncIterator[Any]) -> bool:
    """Drain a generation for a JSON reply, stopping it if the client leaves
    (then return False: there is nobody to answer)."""

    async def drain() -> None:
        async for _ in events:
            pass

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        return False
    work.result()
    return True


# -- assembly --------------------------------------------------------------------


def build_app(settings: Settings, service: Service) -> Starlette:
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", openai_models, methods=["GET"]),
        Route("/v1/responses", openai_create_response, methods=["POST"]),
        Route("/lmsp/v1/models", lmsp_models, methods=["GET"]),
        Route("/lmsp/v1/responses", lmsp_create_response, methods=["POST"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        service.shutdown()
        await service.aclose()

    app = Starlette(
        routes=routes,
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.lmspd = LmspdApp(settings, service)
    return app
