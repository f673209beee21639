"""uvicorn's HTTP/1.1 protocol for lmspd: httptools, with a bounded head
that is refused like lmspd refuses.

httptools (llhttp, in C) rather than h11: h11 parses each request head
and frames each response chunk in Python, ~0.1-0.2 ms a request and tens
of µs a streamed chunk, on the event loop every stream shares.

httptools keeps no bound on a request head: this protocol counts the bytes
received while a head is incomplete, and past ``limits.max_header_bytes``
(plus room for the request line) answers 431 in the shape of the dialect
the request line names; then the socket's write side is closed and what
the client still sends is read and dropped for a moment, so that the reply
arrives before the connection ends. The count can run one read past the
bound (a head that starts behind the previous request's body, in the same
read, is counted from the next); headers under the bound but over the
limit are answered by ``lmspd.edge`` with the same 431.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from lmspd.core.errors import ApiError
from lmspd.core.limits import RequestLimits
from lmspd.edge import error_reply

# Room for the request line (method, target, version) beyond the headers.
REQUEST_LINE_BYTES = 8 * 1024
# How long a refused client may go on sending before the socket closes.
_LINGER_S = 2.0


def max_head_bytes(limits: RequestLimits) -> int:
    return limits.max_header_bytes + REQUEST_LINE_BYTES


class LmspdHttpToolsProtocol(HttpToolsProtocol):
    #: The request head's bound in bytes (``uvicorn_options`` sets it).
    head_limit = 0
    _draining = False
    # Bytes received since the current request head began (before the
    # first request, and after each one, a head is what comes next).
    _in_head = True
    _head_bytes = 0

    def data_received(self, data: bytes) -> None:
        if self._draining:
            return  # the refused request's remaining bytes
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.head_limit and not self.transport.is_closing():
            self._refuse()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True

    def _refuse(self) -> None:
        limit = self.head_limit
        err = ApiError("headers_too_large", f"The request head exceeds {limit} bytes; the header limit is "
                       f"{limit - REQUEST_LINE_BYTES} bytes.", headers={"Connection": "close"})
        reply = error_reply(_target_path(getattr(self, "url", b"")), err)
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]
        self.transport.write(_head(431, headers) + reply.body)
        self._draining = True
        try:
            self.transport.write_eof()
        except (NotImplementedError, OSError, RuntimeError):
            self.transport.close()
            return
        asyncio.get_running_loop().call_later(_LINGER_S, self.transport.close)


def _target_path(target: bytes) -> str:
    return target.split(b"?", 1)[0].decode("latin-1") or "/"


def _head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    # Written by hand: the request was never handed to the app.
    lines = [b"HTTP/1.1 %d Request Header Fields Too Large" % status]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


# A WebSocket message may exceed the body limit by this much and still be
# read, so that its refusal is an error frame naming the limit (413), not a
# close; a larger one closes the connection (1009) as it arrives.
WEBSOCKET_MESSAGE_SLACK = 64 * 1024


def uvicorn_options(limits: RequestLimits) -> dict[str, Any]:
    protocol = type("LmspdHttpProtocol", (LmspdHttpToolsProtocol,), {"head_limit": max_head_bytes(limits)})
    return {"http": protocol,
            # Not uvicorn's 16 MiB: the body limit bounds a message too.
            "ws_max_size": limits.max_body_bytes + WEBSOCKET_MESSAGE_SLACK,
            # permessage-deflate would inflate every message on the event
            # loop; clients (Codex, the SDKs) send plain frames without it.
            "ws_per_message_deflate": False}

