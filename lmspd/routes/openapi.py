"""``GET /openapi.json`` (lmspd.openapi builds it from the app's routes).

Open without a key, like ``/health``: it describes the API, it holds no data.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from lmspd.http import json_reply
from lmspd.openapi import build_spec


async def openapi_json(request: Request) -> Response:
    state = request.app.state
    spec = getattr(state, "openapi", None)
    if spec is None:
        # Built once per app: the route table does not change while serving.
        spec = state.openapi = build_spec(request.app.routes)
    return json_reply(spec)
