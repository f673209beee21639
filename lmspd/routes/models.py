"""``GET /v1/models``: the served models, then the GGUF models found on this
machine (lmspd.engines.llama.discovery) that are not served.

A found model is listed with ``"served": false``: ``lmspd serve --model
NAME`` serves it. Found models never show a filesystem path over HTTP.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from lmspd.routes.common import app_state, json_reply, principal


def _found(settings: Any) -> list[dict[str, Any]]:
    from lmspd.engines.llama.discovery import Roots, discover

    return [m.public() for m in discover(Roots.default(settings.models_dir)) if m.error is None]


async def openai_models(request: Request) -> Response:
    principal(request, "responses:read")
    app = app_state(request)
    data: list[dict[str, Any]] = []
    for m in app.service.models.values():
        info = m.engine.info
        data.append({"id": info.id, "object": "model", "created": info.created, "owned_by": info.owned_by,
                     "served": True, "context_window": info.context_window,
                     "status": getattr(m.engine, "status", "loaded")})
    served = {d["id"].lower() for d in data}
    # Directory walks and header reads: off the event loop.
    for found in await asyncio.to_thread(_found, app.settings):
        if found["name"].lower() in served:
            continue
        data.append({"id": found["name"], "object": "model", "created": 0, "owned_by": found["source"],
                     "served": False, "context_window": found["context_length"], "gguf": found})
    return json_reply({"object": "list", "data": data})
