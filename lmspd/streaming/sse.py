"""The one SSE writer."""

from __future__ import annotations

import json
from typing import Any

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse_event(name: str, data: dict[str, Any], event_id: int | None = None) -> bytes:
    # json.dumps never emits a raw newline, so one data: line always suffices.
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {name}\ndata: {_dumps(data)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def dumps(data: Any) -> str:
    return _dumps(data)
