"""Reading a request body: media type, size and JSON, each with its own 4xx."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from lmspd.core.errors import ApiError
from lmspd.core.limits import RequestLimits


async def read_json_object(request: Request, limits: RequestLimits) -> dict[str, Any]:
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise ApiError(
            "unsupported_media_type",
            f"Content-Type must be application/json, not {media or 'missing'!r}.",
        )
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limits.max_body_bytes:
                raise _too_large(limits)
        except ValueError:
            raise ApiError("invalid_request", "Content-Length is not a number.") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise _too_large(limits)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ApiError("invalid_json", "The JSON body is nested too deeply.") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError("invalid_json", f"The body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError("invalid_json", "The JSON body must be an object.")
    _check_depth(data, limits.max_json_depth)
    return data


def _too_large(limits: RequestLimits) -> ApiError:
    return ApiError("request_too_large", f"The request body exceeds {limits.max_body_bytes} bytes.")


def _check_depth(value: Any, limit: int) -> None:
    # Iterative, so that the check itself cannot hit the recursion limit.
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise ApiError("invalid_json", f"The JSON body is nested deeper than {limit} levels.")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
