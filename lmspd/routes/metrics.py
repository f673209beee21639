"""``GET /metrics``: the service's Prometheus metrics (lmspd.metrics).

Behind the same credential check as every other route, with the ``admin``
scope: counters name models and upstream endpoints.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from lmspd.http import app_state, principal
from lmspd.metrics import CONTENT_TYPE


async def metrics(request: Request) -> Response:
    principal(request, "admin")
    service = app_state(request).service
    # Rendering walks every label set: off the event loop.
    body = await asyncio.to_thread(service.metrics.render)
    return Response(body, media_type=CONTENT_TYPE)
