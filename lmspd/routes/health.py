"""``GET /health``: liveness for anyone (load balancers send no key); the
engines' internals (queue depth, cache statistics) only for ``admin``."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from lmspd import __version__
from lmspd.core.errors import ApiError
from lmspd.http import app_state
from lmspd.routes.engine_view import without_owners


async def health(request: Request) -> Response:
    app = app_state(request)
    status = "shutting_down" if app.service.shutting_down else "ok"
    body: dict[str, Any] = {"status": status, "version": __version__}
    try:
        details = app.auth.authenticate(request).allows("admin")
    except ApiError:
        details = False
    if details:
        body["models"] = {
            # Owners as the engine view shows them: tags, never credential-derived ids.
            mid: {"context_window": m.engine.info.context_window, "busy": m.queue.busy, "pending": m.queue.pending,
                  **without_owners(m.engine.stats())}
            for mid, m in app.service.models.items()
        }
    return JSONResponse(body, status_code=503 if app.service.shutting_down else 200)
