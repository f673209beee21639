"""A bounded, incremental, push-based Server-Sent Events decoder.

Follows the WHATWG event-stream parsing rules: one optional UTF-8 BOM at the
start, lines ended by CRLF, LF or CR, ``field: value`` lines, ``:`` comments,
multi-line data joined by ``\\n``, dispatch on a blank line, and an
incomplete event at end of stream is never dispatched (here: it is an error,
because for a provider stream it means we lost output).

The decoder holds no reader: the caller pushes whatever bytes it got, split
anywhere, and gets back the events those bytes completed. Splitting at line
boundaries is done on bytes (CR and LF never occur inside a UTF-8 sequence),
and text is decoded only per complete line, so chunks that cut a ``\\r\\n`` or
a multi-byte character in two change nothing.

Limits are checked at the byte where they are crossed, not at the chunk that
happened to carry it, so the events produced before a limit error are the
same for every chunking of the same bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from lmspd.core.limits import UpstreamStreamLimits

from .errors import (
    SSEAggregateExceeded,
    SSEBufferExceeded,
    SSEEventTooLarge,
    SSELineTooLong,
    SSETruncated,
    UpstreamLimitExceeded,
    UpstreamProtocolError,
)

__all__ = ["SSEDecoder", "SSEEvent"]

_EOL = re.compile(rb"\r\n?|\n")
_BOM = b"\xef\xbb\xbf"
_CR = 0x0D
_LF = 0x0A
# ``retry`` is advisory; a longer digit string is garbage, not a delay (and
# int() refuses very long ones anyway).
_MAX_RETRY_DIGITS = 12


@dataclass(frozen=True, slots=True)
class SSEEvent:
    data: str
    event: str = "message"
    # The last event id seen so far (it persists across events, per spec).
    id: str = ""
    # The reconnection time last set by a ``retry`` field, if any.
    retry: int | None = None


def _split_field(line: bytes) -> tuple[bytes, bytes]:
    colon = line.find(b":")
    if colon < 0:
        return line, b""
    value = line[colon + 1 :]
    if value[:1] == b" ":
        value = value[1:]
    return line[:colon], value


class SSEDecoder:
    """Feed bytes in, get complete ``SSEEvent``s out.

    ``feed`` returns the events the bytes completed; ``close`` marks the end
    of the stream and raises ``SSETruncated`` if an event with data was cut
    off. Any limit error is raised at the offending byte and is sticky: the
    decoder raises it again on every later call.
    """

    def __init__(self, limits: UpstreamStreamLimits | None = None) -> None:
        self._limits = limits or UpstreamStreamLimits()
        self._partial = bytearray()  # the current, unterminated line
        self._skip_lf = False  # the last chunk ended in CR; a leading LF belongs to it
        self._bom_head: bytes | None = b""  # None once we know whether a BOM is there
        self._offset = 0  # stream bytes consumed: terminated lines, terminators, BOM
        # The event's data, each line followed by LF, in one buffer: a list
        # of lines would cost an object per line, ~15 times what tiny lines
        # weigh against max_event_bytes.
        self._data = bytearray()
        self._event_type = b""
        self._last_id = ""
        self._retry: int | None = None
        self._error: UpstreamProtocolError | None = None
        self._closed = False

    @property
    def bytes_consumed(self) -> int:
        """Stream bytes decoded so far (excluding an unterminated last line)."""
        return self._offset

    def feed(self, data: bytes) -> list[SSEEvent]:
        return list(self.iter_feed(data))

    def iter_feed(self, data: bytes) -> Iterator[SSEEvent]:
        """Like ``feed`` but lazy: bytes after the event the caller stops at are
        never parsed, and events before an error are delivered before it."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError("SSEDecoder.feed() after close()")
        try:
            yield from self._feed(bytes(data))
        except UpstreamProtocolError as exc:
            self._error = exc
            raise

    def close(self) -> list[SSEEvent]:
        if self._error is not None:
            raise self._error
        if self._closed:
            return []
        try:
            if self._bom_head:
                # A stream shorter than a BOM: its bytes are ordinary content.
                head, self._bom_head = self._bom_head, None
                for _ in self._feed(head):
                    pass  # no line terminator in it, so nothing is dispatched
            self._closed = True
            partial_data = bool(self._partial) and _split_field(bytes(self._partial))[0] == b"data"
            if not partial_data and bytes(self._data) == b"[DONE]\n":
                # A provider's closing [DONE] line without the blank line
                # that dispatches it (openai-node delivers it too): the end
                # of a finished stream, not a cut one.
                event = self._dispatch()
                return [] if event is None else [event]
            if self._data or partial_data:
                raise SSETruncated()
        except UpstreamProtocolError as exc:
            self._error = exc
            raise
        return []

    # -- internals ---------------------------------------------------------

    def _feed(self, data: bytes) -> Iterator[SSEEvent]:
        if self._bom_head is not None:
            head = self._bom_head + data
            if len(head) < len(_BOM) and _BOM.startswith(head):
                self._bom_head = head  # could still become a BOM
                return
            self._bom_head = None
            if head.startswith(_BOM):
                head = head[len(_BOM) :]
                self._consume(len(_BOM))
            data = head

        pos, end = 0, len(data)
        if self._skip_lf and end:
            self._skip_lf = False
            if data[0] == _LF:
                pos = 1
                self._consume(1)

        while pos < end:
            match = _EOL.search(data, pos)
            if match is None:
                self._partial += data[pos:]
                self._check_line(len(self._partial), terminated=False)
                return
            line = data[pos : match.start()]
            if self._partial:
                self._partial += line
                line = bytes(self._partial)
                self._partial.clear()
            self._check_line(len(line), terminated=True)
            self._offset += len(line) + 1
            event = self._process(line)
            if event is not None:
                yield event
            if match.end() - match.start() == 2:
                self._consume(1)  # the LF of a CRLF, after its line, as if split
            elif match.end() == end and data[match.start()] == _CR:
                self._skip_lf = True
            pos = match.end()

    def _consume(self, n: int) -> None:
        self._offset += n
        if self._offset > self._limits.max_aggregate_bytes:
            raise SSEAggregateExceeded(self._limits.max_aggregate_bytes)

    def _check_line(self, length: int, *, terminated: bool) -> None:
        # Each limit is crossed at one byte position; the error is the one
        # whose position comes first, whichever chunk revealed it.
        limits = self._limits
        start = self._offset
        crossed: list[tuple[int, UpstreamLimitExceeded]] = []
        if length > limits.max_line_bytes:
            crossed.append((start + limits.max_line_bytes, SSELineTooLong(limits.max_line_bytes)))
        room = max(limits.max_buffered_bytes - len(self._data), 0)
        if length > room:
            crossed.append((start + room, SSEBufferExceeded(limits.max_buffered_bytes)))
        if start + length + terminated > limits.max_aggregate_bytes:
            crossed.append((limits.max_aggregate_bytes, SSEAggregateExceeded(limits.max_aggregate_bytes)))
        if crossed:
            raise min(crossed, key=lambda pair: pair[0])[1]

    def _process(self, line: bytes) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        if line[0] == 0x3A:  # ":" comment, e.g. a keep-alive
            return None
        name, value = _split_field(line)
        if name == b"data":
            if len(self._data) + len(value) + 1 > self._limits.max_event_bytes:
                raise SSEEventTooLarge(self._limits.max_event_bytes)
            self._data += value
            self._data += b"\n"
        elif name == b"event":
            self._event_type = value
        elif name == b"id":
            if b"\0" not in value:
                self._last_id = value.decode("utf-8", "replace")
        elif name == b"retry":
            if value.isdigit() and len(value) <= _MAX_RETRY_DIGITS:
                self._retry = int(value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event_type = self._data, self._event_type
        self._data, self._event_type = bytearray(), b""
        if not data:
            return None
        return SSEEvent(
            # Without the last line's LF; decoded in place, not copied first.
            data=str(memoryview(data)[:-1], "utf-8", "replace"),
            event=event_type.decode("utf-8", "replace") if event_type else "message",
            id=self._last_id,
            retry=self._retry,
        )
