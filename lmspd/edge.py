"""The HTTP edge: what every request meets before routing, and how every
error leaves in its dialect's shape.

- Request headers larger in total than ``limits.max_header_bytes`` are a 431
  in the dialect's shape (the HTTP server's own, much larger, bound only
  stops a flood from using memory; see ``lmspd.server``).
- An exception that escapes a handler is a 500 in the dialect's shape, after
  which the connection stays usable: Starlette's outermost middleware would
  reply and then re-raise, and uvicorn answers a re-raise by dropping the
  connection (without ``Connection: close``), so a keep-alive client's next
  request would fail.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from lmspd.core.errors import ApiError
from lmspd.core.limits import RequestLimits
from lmspd.dialects import lmsp
from lmspd.streaming.sse import dumps

log = logging.getLogger("lmspd.http")

LMSP_PREFIX = "/lmsp/"


def error_reply(path: str, exc: ApiError) -> Response:
    """``exc`` in the shape of the dialect that ``path`` belongs to."""
    headers = dict(exc.headers)
    if path.startswith(LMSP_PREFIX):
        headers["LMSP-Version"] = lmsp.VERSION
        return Response(dumps(exc.problem()), status_code=exc.status, headers=headers,
                        media_type="application/problem+json")
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        # Anthropic clients parse errors in Anthropic's shape (unknown
        # /v1/messages/* routes such as batches included).
        return Response(dumps(exc.anthropic()), status_code=exc.status, headers=headers,
                        media_type="application/json")
    return Response(dumps(exc.openai()), status_code=exc.status, headers=headers, media_type="application/json")


def header_bytes(headers: list[tuple[bytes, bytes]]) -> int:
    # As on the wire: "name: value\r\n".
    return sum(len(name) + len(value) + 4 for name, value in headers)


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        size = header_bytes(scope.get("headers", []))
        if size > self.limits.max_header_bytes:
            err = ApiError("headers_too_large", f"The request headers total {size} bytes; the limit is "
                           f"{self.limits.max_header_bytes}.")
            await error_reply(path, err)(scope, receive, send)
            return
        progress = {"started": False, "complete": False}

        async def tracked(message: Any) -> None:
            if message["type"] == "http.response.start":
                progress["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                progress["complete"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            if progress["started"]:
                # A stream cut off midway cannot be completed: dropping the
                # connection is how HTTP/1.1 says so.
                if progress["complete"]:
                    return
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), path)
            await error_reply(path, ApiError("server_error", "Internal server error."))(scope, receive, send)
