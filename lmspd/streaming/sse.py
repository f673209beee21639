"""The one SSE writer."""

from __future__ import annotations

import json
import re
from typing import Any

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

# Line ends to Python's str.splitlines (so to httpx's iter_lines and readers
# built on it) though not to SSE, and which JSON leaves raw inside strings:
# a model that writes one would cut its own event in two for such a reader.
# Written as \u escapes they decode to the same text for every reader.
_LINE_ENDS_TO_SOME = re.compile("[\u0085\u2028\u2029]")
_ESCAPED = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def sse_event(name: str | None, data: dict[str, Any], event_id: int | None = None) -> bytes:
    """One frame; ``name=None`` writes no ``event:`` line (Chat Completions
    streams are data-only, and some of their clients reject named events)."""
    # json.dumps never emits a raw newline, so one data: line always suffices.
    head = f"id: {event_id}\n" if event_id is not None else ""
    if name is not None:
        head += f"event: {name}\n"
    text = _dumps(data)
    if _LINE_ENDS_TO_SOME.search(text):
        text = text.translate(_ESCAPED)
    return f"{head}data: {text}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
# A comment line: every SSE parser skips it (WHATWG: a line starting with
# ":"); it only tells the client and the proxies between that the stream lives.
SSE_KEEPALIVE = b": keep-alive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def dumps(data: Any) -> str:
    return _dumps(data)


def dumps_in_pieces(data: Any, depth: int = 3) -> bytes:
    """``dumps(data).encode()``, built from pieces of about ``_PIECE_CHARS``
    (a list's members a run at a time, sized by the run before; a large
    member on its own, down to ``depth`` levels), so that the interpreter
    lock is let go between them. One call of the C encoder holds it
    throughout: off the event loop but in one call, a 39 MB page of stored
    items still stalled the loop ~300 ms."""
    if depth > 0 and isinstance(data, list):
        pieces: list[bytes] = []
        at, run = 0, 1
        while at < len(data):
            if run == 1:
                piece = dumps_in_pieces(data[at], depth - 1)
            else:
                piece = _dumps(data[at:at + run])[1:-1].encode()
            pieces.append(piece)
            at += run
            run = max(1, min(_MAX_RUN, _PIECE_CHARS * run // max(1, len(piece))))
        return b"[" + b",".join(pieces) + b"]"
    if depth > 0 and isinstance(data, dict) and all(type(k) is str for k in data):
        return b"{" + b",".join(_dumps(k).encode() + b":" + dumps_in_pieces(v, depth - 1)
                                for k, v in data.items()) + b"}"
    return _dumps(data).encode()


# What one call of the encoder writes at most, where members allow: ~0.5 ms.
_PIECE_CHARS = 256 * 1024
_MAX_RUN = 4096
