"""uvicorn's h11 protocol, with a header bound that answers like lmspd.

h11 buffers an incomplete request head up to a size limit, then uvicorn
replies with a plain-text 400 and closes the socket at once (a client still
sending its headers then often sees a reset, not the reply). Here the limit
is ``limits.max_header_bytes`` (plus room for the request line), and passing
it gets a 431 in the shape of the dialect the request line names; then the
socket's write side is closed and what the client still sends is read and
dropped for a moment, so that the reply arrives before the connection ends.
Headers under h11's bound but over the limit are answered by
``lmspd.edge`` with the same 431.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from lmspd.core.errors import ApiError
from lmspd.core.limits import RequestLimits
from lmspd.edge import error_reply

# Room for the request line (method, target, version) beyond the headers.
REQUEST_LINE_BYTES = 8 * 1024
# How long a refused client may go on sending before the socket closes.
_LINGER_S = 2.0


def max_head_bytes(limits: RequestLimits) -> int:
    return limits.max_header_bytes + REQUEST_LINE_BYTES


class LmspdH11Protocol(H11Protocol):
    _draining = False

    def data_received(self, data: bytes) -> None:
        if self._draining:
            return  # the refused request's remaining bytes
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        buffered, _ = self.conn.trailing_data
        limit = self.config.h11_max_incomplete_event_size
        if limit is None or len(buffered) <= limit:
            super().send_400_response(msg)
            return
        err = ApiError("headers_too_large", f"The request head exceeds {limit} bytes; the header limit is "
                       f"{limit - REQUEST_LINE_BYTES} bytes.", headers={"Connection": "close"})
        reply = error_reply(_target_path(buffered), err)
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]
        self.transport.write(_head(431, headers) + reply.body)
        self._draining = True
        try:
            self.transport.write_eof()
        except (NotImplementedError, OSError, RuntimeError):
            self.transport.close()
            return
        asyncio.get_running_loop().call_later(_LINGER_S, self.transport.close)


def _target_path(buffered: bytes) -> str:
    line = buffered.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) < 2:
        return "/"
    return parts[1].split(b"?", 1)[0].decode("latin-1")


def _head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    # Written by hand: h11's connection is in its error state by now.
    lines = [b"HTTP/1.1 %d Request Header Fields Too Large" % status]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


# A WebSocket message may exceed the body limit by this much and still be
# read, so that its refusal is an error frame naming the limit (413), not a
# close; a larger one closes the connection (1009) as it arrives.
WEBSOCKET_MESSAGE_SLACK = 64 * 1024


def uvicorn_options(limits: RequestLimits) -> dict[str, Any]:
    return {"http": LmspdH11Protocol, "h11_max_incomplete_event_size": max_head_bytes(limits),
            # Not uvicorn's 16 MiB: the body limit bounds a message too.
            "ws_max_size": limits.max_body_bytes + WEBSOCKET_MESSAGE_SLACK,
            # permessage-deflate would inflate every message on the event
            # loop; clients (Codex, the SDKs) send plain frames without it.
            "ws_per_message_deflate": False}

