"""The one SSE writer."""

from __future__ import annotations

import json
from typing import Any

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse_event(name: str | None, data: dict[str, Any], event_id: int | None = None) -> bytes:
    """One frame; ``name=None`` writes no ``event:`` line (Chat Completions
    streams are data-only, and some of their clients reject named events)."""
    # json.dumps never emits a raw newline, so one data: line always suffices.
    head = f"id: {event_id}\n" if event_id is not None else ""
    if name is not None:
        head += f"event: {name}\n"
    return f"{head}data: {_dumps(data)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
# A comment line: every SSE parser skips it (WHATWG: a line starting with
# ":"); it only tells the client and the proxies between that the stream lives.
SSE_KEEPALIVE = b": keep-alive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def dumps(data: Any) -> str:
    return _dumps(data)
