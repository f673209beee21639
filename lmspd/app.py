"""HTTP assembly: the route table, error rendering per dialect, lifespan.

Handlers live in ``lmspd.routes``; what they share (the application state,
credentials, JSON and SSE replies) in ``lmspd.http``. This module wires them
up with the service and the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from lmspd.config import Settings
from lmspd.core.errors import ApiError
from lmspd.edge import EdgeMiddleware, error_reply
from lmspd.http import LmspdApp
from lmspd.http11 import quiet_accept_errors
from lmspd.metrics import RequestMetrics
from lmspd.origins import BrowserGuard, split_origins
from lmspd.routes import console as console_routes
from lmspd.routes import conversations, engine_view, responses, stored, websocket
from lmspd.routes import health as health_routes
from lmspd.routes import metrics as metrics_routes
from lmspd.routes import models as model_routes
from lmspd.routes import openapi as openapi_routes
from lmspd.routes import tasks as task_routes
from lmspd.service import Service
from lmspd.store.base import Store
from lmspd.tasks.recovery import LeaseKeeper, prune_forever, reap_forever, recover

log = logging.getLogger("lmspd.http")

# -- errors ----------------------------------------------------------------------


def error_response(request: Request, exc: ApiError) -> Response:
    return error_reply(request.url.path, exc)


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


# -- assembly --------------------------------------------------------------------


def state_routes() -> list[BaseRoute]:
    """Responses (both dialects), stored state, conversations and tasks."""
    rid = "/{response_id}"
    cid = "/v1/conversations/{conversation_id}"
    tid = "/lmsp/v1/tasks/{task_id}"
    return [
        Route("/v1/responses", responses.openai_create_response, methods=["POST"]),
        # The same path, WebSocket mode (Codex tries it first).
        WebSocketRoute("/v1/responses", websocket.openai_responses_websocket),
        Route("/v1/responses/compact", responses.openai_compact, methods=["POST"]),
        Route("/v1/responses/input_tokens", responses.openai_input_tokens, methods=["POST"]),
        Route("/v1/responses" + rid, stored.openai_get_response, methods=["GET"]),
        Route("/v1/responses" + rid, stored.openai_delete_response, methods=["DELETE"]),
        Route("/v1/responses" + rid + "/cancel", stored.openai_cancel_response, methods=["POST"]),
        Route("/v1/responses" + rid + "/input_items", stored.openai_input_items, methods=["GET"]),
        Route("/v1/conversations", conversations.create_conversation, methods=["POST"]),
        Route(cid, conversations.get_conversation, methods=["GET"]),
        Route(cid, conversations.update_conversation, methods=["POST"]),
        Route(cid, conversations.delete_conversation, methods=["DELETE"]),
        Route(cid + "/items", conversations.add_items, methods=["POST"]),
        Route(cid + "/items", conversations.list_items, methods=["GET"]),
        Route(cid + "/items/{item_id}", conversations.get_item, methods=["GET"]),
        Route(cid + "/items/{item_id}", conversations.delete_item, methods=["DELETE"]),
        Route("/lmsp/v1/responses", responses.lmsp_create_response, methods=["POST"]),
        Route("/lmsp/v1/responses" + rid, stored.lmsp_get_response, methods=["GET"]),
        Route("/lmsp/v1/tasks", task_routes.lmsp_create_task, methods=["POST"]),
        Route(tid, task_routes.get_task, methods=["GET"]),
        Route(tid + "/events", task_routes.task_events, methods=["GET"]),
        Route(tid + "/cancel", task_routes.cancel_task, methods=["POST"]),
    ]


def build_app(settings: Settings, service: Service, store: Store) -> Starlette:
    """The app owns ``store`` from here on: it recovers it at start, prunes
    it while serving and closes it at shutdown."""
    from lmspd.routes.compat import routes as compat_routes

    routes = [
        *compat_routes(),  # /v1/chat/completions, /v1/messages (issue 7)
        Route("/health", health_routes.health, methods=["GET"]),
        Route("/v1/models", model_routes.openai_models, methods=["GET"]),
        Route("/lmsp/v1/models", model_routes.lmsp_models, methods=["GET"]),
        Route("/metrics", metrics_routes.metrics, methods=["GET"]),
        Route("/openapi.json", openapi_routes.openapi_json, methods=["GET"]),
        Route("/lmsp/v1/engine", engine_view.engine_view, methods=["GET"]),
        *console_routes.routes(),  # the web console at /
        *state_routes(),
    ]
    store = service.metrics.timed_store(store)
    state = LmspdApp(settings, service, store)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        quiet_accept_errors(asyncio.get_running_loop())
        # Before the first request: nothing a crash left running may look alive.
        recover(store)
        state.tasks.attach()
        pruner = asyncio.create_task(prune_forever(store, settings.prune_interval_s))
        lease = LeaseKeeper(store, state.tasks.cancel_requested)
        lease.start()
        reaper = asyncio.create_task(reap_forever(store))
        try:
            yield
        finally:
            pruner.cancel()
            service.shutdown()
            # Tasks have no connection for uvicorn to wait on: let them write
            # their terminal events before the store closes.
            await state.tasks.drain(settings.limits.shutdown_grace_s)
            reaper.cancel()
            lease.stop()
            await service.aclose()
            state.tasks.close()
            state.calls.close()
            store.close()

    app = Starlette(
        routes=routes,
        # The edge sees every request first (header limits, keep-alive after
        # errors); metrics count what reaches the routes.
        middleware=[Middleware(EdgeMiddleware, limits=settings.limits.request),
                    Middleware(RequestMetrics, metrics=service.metrics, routes=routes),
                    # Web pages are refused before any route (Origin, and Host on loopback).
                    Middleware(BrowserGuard, allowed_origins=split_origins(settings.allowed_origins),
                               bound_host=settings.host, check_host=settings.loopback)],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.lmspd = state
    return app
