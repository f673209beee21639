"""The one SSE writer, and the JSON it writes: in pieces, or with values
encoded once spliced in (``Spliced``)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

# Line ends to Python's str.splitlines (so to httpx's iter_lines and readers
# built on it) though not to SSE, and which JSON leaves raw inside strings:
# a model that writes one would cut its own event in two for such a reader.
# Written as \u escapes they decode to the same text for every reader.
_LINE_ENDS_TO_SOME = re.compile("[\u0085\u2028\u2029]")
_ESCAPED = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}
# The same in UTF-8 (which no other character's bytes contain).
_ESCAPED_UTF8 = tuple((chr(c).encode(), e.encode()) for c, e in _ESCAPED.items())


def sse_event(name: str | None, data: dict[str, Any], event_id: int | None = None) -> bytes:
    """One frame; ``name=None`` writes no ``event:`` line (Chat Completions
    streams are data-only, and some of their clients reject named events)."""
    # json.dumps never emits a raw newline, so one data: line always suffices.
    head = f"id: {event_id}\n" if event_id is not None else ""
    if name is not None:
        head += f"event: {name}\n"
    if type(data) is Spliced:
        return data.utf8(prefix=f"{head}data: ".encode(), suffix=b"\n\n")
    return f"{head}data: {_escape_line_ends(_dumps(data))}\n\n".encode()


def _escape_line_ends(text: str) -> str:
    # isascii() is a flag read: most events have none of the three to look for.
    if text.isascii() or not _LINE_ENDS_TO_SOME.search(text):
        return text
    return text.translate(_ESCAPED)


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
    member on its own, down to ``depth`` levels; a long string a slice at a
    time), so that the interpreter lock is let go between them. One call of
    the C encoder holds it throughout: off the event loop but in one call, a
    39 MB page of stored items still stalled the loop ~300 ms."""
    if isinstance(data, str) and len(data) > _PIECE_CHARS:
        # Escaping is per character: the slices' JSON, unquoted, joined.
        return b'"' + b"".join(_dumps(data[at:at + _PIECE_CHARS])[1:-1].encode()
                               for at in range(0, len(data), _PIECE_CHARS)) + b'"'
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


# -- values encoded once ------------------------------------------------------------
#
# OpenAI's lifecycle events (response.created, in_progress, completed,
# failed, and every keep-alive in_progress) each carry the whole Response
# object, which echoes the request: its instructions and tools, megabytes at
# worst, the same objects in every event of the response. Each large one is
# encoded once, off the event loop (``encode_large``), and its JSON spliced
# into every frame after (``Spliced``); the rest of the object is encoded
# with its event, as before (``lmspd.streaming.framing``).

# A value whose JSON is this long or longer is encoded once and spliced.
# Measured: encoding (and scanning) 16 KiB of tool schemas takes about as
# long as the thread hop that finds out what a response holds (~0.1 ms).
SPLICE_MIN_BYTES = 16 * 1024


class Encoded:
    """One value and its JSON (line ends escaped, as ``sse_event`` writes them)."""

    __slots__ = ("value", "utf8", "_text")

    def __init__(self, value: Any, utf8: bytes) -> None:
        self.value = value
        self.utf8 = utf8
        self._text: str | None = None

    @property
    def text(self) -> str:
        # For a WebSocket text frame: decoded once, on its first use.
        if self._text is None:
            self._text = self.utf8.decode()
        return self._text


def encode_large(obj: Mapping[str, Any]) -> dict[str, Encoded]:
    """``obj``'s values whose JSON is at least ``SPLICE_MIN_BYTES``, encoded
    in pieces (proportional to them: run it off the event loop)."""
    out: dict[str, Encoded] = {}
    for key, value in obj.items():
        if not isinstance(value, (str, list, dict)):
            continue
        utf8 = dumps_in_pieces(value)
        if len(utf8) < SPLICE_MIN_BYTES:
            continue
        for raw, escaped in _ESCAPED_UTF8:
            if raw in utf8:
                utf8 = utf8.replace(raw, escaped)
        out[key] = Encoded(value, utf8)
    return out


class Spliced(dict[str, Any]):
    """An event whose ``response`` object holds values already encoded
    (``parts``, from ``encode_large``): ``sse_event`` and the WebSocket's
    ``event_frame`` splice their JSON in where the object still holds that
    very value (one that was replaced is encoded with the event), rather
    than encode it again. Anything else reading it sees the event's dict."""

    __slots__ = ("parts",)

    def __init__(self, data: Mapping[str, Any], parts: Mapping[str, Encoded]) -> None:
        super().__init__(data)
        self.parts = parts

    def utf8(self, prefix: bytes = b"", suffix: bytes = b"") -> bytes:
        head, spliced = self._layout(None)
        pieces = [prefix, head.encode()]
        for key, part in spliced:
            pieces += (key.encode(), part.utf8)
        pieces += (b"}}", suffix)
        return b"".join(pieces)

    def text(self, **more: Any) -> str:
        """The event's JSON with ``more`` members (a WebSocket's ``stream_id``)."""
        head, spliced = self._layout(more)
        return "".join([head, *(piece for key, part in spliced for piece in (key, part.text)), "}}"])

    def _layout(self, more: dict[str, Any] | None) -> tuple[str, list[tuple[str, Encoded]]]:
        """The JSON up to the first spliced value (the event's members, its
        ``response`` last, and the members of that not spliced), then each
        spliced value with the text before it (a comma and its key); what
        follows them is ``}}``."""
        response = self["response"]
        spliced = [(key, part) for key, part in self.parts.items() if response.get(key) is part.value]
        names = {key for key, _ in spliced}
        outer = {key: value for key, value in self.items() if key != "response"}
        if more:
            outer.update(more)
        members = _members(outer)
        head = "{" + members + ("," if members else "") + '"response":{'
        inline = _members({key: value for key, value in response.items() if key not in names})
        head += inline
        keyed = [(("," if inline or n else "") + _escape_line_ends(_dumps(key)) + ":", part)
                 for n, (key, part) in enumerate(spliced)]
        return head, keyed


def _members(obj: dict[str, Any]) -> str:
    """An object's JSON members, without its braces."""
    return _escape_line_ends(_dumps(obj))[1:-1]
