"""uvicorn's HTTP/1.1 protocol for lmspd: httptools, with a bounded head,
a head timeout and a cap on connections, each refused like lmspd refuses.

httptools (llhttp, in C) rather than h11: h11 parses each request head
and frames each response chunk in Python, ~0.1-0.2 ms a request and tens
of µs a streamed chunk, on the event loop every stream shares.

httptools keeps no bound on a request head: this protocol counts the bytes
received while a head is incomplete, and past ``limits.max_header_bytes``
(plus room for the request line) answers 431 in the shape of the dialect
the request line names. The count can run one read past the bound (a head
that starts behind the previous request's body, in the same read, is
counted from the next); headers under the bound but over the limit are
answered by ``lmspd.edge`` with the same 431. A request httptools cannot
parse (Content-Length beside Transfer-Encoding, two Content-Lengths, a bad
chunk size) is a 400 in the same shape naming the fault, not uvicorn's
text/plain.

Nor does uvicorn bound time: its keep-alive timer, armed after a response
only, ends when a request's first byte arrives. Here a new connection that
sends nothing is closed after the same keep-alive timeout, and a head must
be complete ``head_timeout_s`` after its first byte (else a 408), as must
the rest of a body that no handler read once the response has ended. No
timer runs while a response is being sent, so a stream is never cut; a
body's own pace, while its handler reads it, is ``lmspd.bodies``' to judge.

Past ``max_connections`` open connections (at most half the process's
file descriptors), a new one is answered 503 as soon as its request line
arrives, and closed. Should the descriptors run out all the same (other
files, a burst faster than refusals close), asyncio stops accepting for a
second and says so with a traceback each time; ``quiet_accept_errors``
makes that one warning a minute naming the limit.

Each refusal is written by hand (no request reached the app), after the
response in progress on the connection if there is one (a pipelined
request); then the socket's write side is closed and what the client
still sends is read and dropped for a moment, so that the reply arrives
before the connection ends.
"""

from __future__ import annotations

import asyncio
import http
import logging
import time
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from lmspd.core.errors import ApiError
from lmspd.core.limits import RequestLimits
from lmspd.edge import error_reply

log = logging.getLogger("lmspd.connections")

# Room for the request line (method, target, version) beyond the headers.
REQUEST_LINE_BYTES = 8 * 1024
# How long a refused client may go on sending before the socket closes.
_LINGER_S = 2.0
# How long a connection past the cap may take to send its request line
# (which says the dialect of its 503): it holds a file descriptor meanwhile.
_REQUEST_LINE_S = 0.5


def max_head_bytes(limits: RequestLimits) -> int:
    return limits.max_header_bytes + REQUEST_LINE_BYTES


class LmspdHttpToolsProtocol(HttpToolsProtocol):
    #: The request head's bound in bytes, its time bound, and the open
    #: connections past which a new one is refused (``uvicorn_options``
    #: sets them).
    head_limit = 0
    head_timeout_s = 30.0
    max_connections = 0
    _draining = False
    # Bytes received since the current request head began (before the
    # first request, and after each one, a head is what comes next).
    _in_head = True
    _head_bytes = 0
    _head_timer: asyncio.TimerHandle | None = None
    # A refusal waiting for the response being sent to end.
    _refusal: bytes | None = None
    # Past the cap: the request line read so far, or None.
    _over_cap: bytes | None = None
    # Bytes received after a request's head that moved none of its body:
    # chunk framing and the trailer section, bounded as a head is.
    _framing = 0
    _body_moved = False
    # How long the client may read nothing of a response (``pause_writing``).
    write_stall_s = 120.0
    _stall_timer: asyncio.TimerHandle | None = None
    # The request whose handler runs (self.cycle is the last one parsed,
    # which may wait behind it, pipelined).
    _running: Any = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections and len(self.connections) > self.max_connections:
            self._over_cap = b""
            self._arm(_REQUEST_LINE_S)
        else:
            # Until a request begins, the connection is idle: uvicorn's
            # keep-alive timeout, which it only arms after a response.
            self._arm(self.timeout_keep_alive)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.write_stall_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _write_stalled(self) -> None:
        # Every other timer waits while a response is being sent; one that
        # the client has read nothing of for so long is not being sent.
        self._stall_timer = None
        self.logger.info("Dropping a connection whose client read nothing for %g s", self.write_stall_s)
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._draining:
            return  # the refused request's remaining bytes
        if self._over_cap is not None:
            self._read_request_line(data)
            return
        after_head = not self._in_head
        if self._in_head:
            if not self._head_bytes and not self._sending():
                self._arm(self.head_timeout_s)  # a head begins
            self._head_bytes += len(data)
        self._body_moved = False
        self._feed(data)
        if self._draining or self.transport.is_closing():
            return
        limit = self.head_limit
        if self._in_head and self._head_bytes > limit:
            self._refuse(ApiError("headers_too_large", f"The request head exceeds {limit} bytes; the header limit "
                                  f"is {limit - REQUEST_LINE_BYTES} bytes."))
        elif after_head and not self._in_head and not self._body_moved:
            # Framing or trailers alone (the body's own bounds count only
            # its bytes): an endless trailer section, before any key was
            # checked, grew the request's headers without bound.
            self._framing += len(data)
            if self._framing > limit:
                self._refuse(ApiError("headers_too_large", f"The request's chunk framing and trailer section "
                                      f"exceed {limit} bytes without any of its body."))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_head:
            super().on_header(name, value)
        # Else a trailer field: dropped (ASGI has no request trailers;
        # uvicorn appended it to the headers of the request being handled).

    def on_body(self, body: bytes) -> None:
        self._body_moved = True
        self._framing = 0
        super().on_body(body)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_head = False
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True
        self._framing = 0

    def on_response_complete(self) -> None:
        # A pipelined request starts now, or the connection waits for the next.
        super().on_response_complete()
        if self.transport.is_closing() or self._sending():
            return
        if self._refusal is not None:
            refusal, self._refusal = self._refusal, None
            self._send_refusal(refusal)
        elif not self._draining and (self._head_bytes or not self._in_head):
            # A head that waited behind the response, or the rest of a body
            # no handler read: from now on they are timed. (An idle
            # connection is uvicorn's keep-alive timer's.)
            self._arm(self.head_timeout_s)

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def _feed(self, data: bytes) -> None:
        # uvicorn's data_received, but a request httptools refuses is
        # answered in the dialect's shape, naming what is wrong with it.
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:
            self.logger.warning("Invalid HTTP request received: %s", exc)
            self._refuse(ApiError("invalid_request", f"The request is not valid HTTP/1.1: {exc}."))

    # -- bounds ------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(seconds, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._draining or self._sending():
            return  # never a response being sent
        if self._over_cap is not None:
            self._refuse_over_cap(b"")
        elif self._in_head and self._head_bytes:
            self._refuse(ApiError("request_timeout", f"The request head did not arrive within "
                                  f"{self.head_timeout_s:g} s."))
        else:
            # Nothing of a request came (or only the rest of a body that no
            # handler read): nobody waits for an answer.
            self.transport.close()

    def _read_request_line(self, data: bytes) -> None:
        line = self._over_cap + data if self._over_cap else data
        if b"\n" in line or len(line) > REQUEST_LINE_BYTES:
            self._refuse_over_cap(line.split(b"\n", 1)[0])
        else:
            self._over_cap = line

    def _refuse_over_cap(self, request_line: bytes) -> None:
        parts = request_line.split(b" ")
        target = parts[1] if len(parts) > 2 else b""
        self._refuse(ApiError("server_overloaded", f"The server has {self.max_connections} connections open, its "
                              "limit; retry shortly.", headers={"Retry-After": "1"}), target, linger=False)

    def _refuse(self, err: ApiError, target: bytes | None = None, linger: bool = True) -> None:
        """Answers ``err`` in the shape of the dialect the request names,
        once the response in progress (if any) has ended, then closes
        (``linger``: after reading what the client still sends for a
        moment; not past the connection cap, where the moment's file
        descriptor is what is short)."""
        self._draining = True
        self._disarm()
        if not self._in_head and self.cycle is not None:
            # The request whose body was being read is the one refused.
            if self.cycle.response_complete:
                self.transport.close()
                return
            if self.cycle.response_started:
                # Its answer is going out: the connection ends after it.
                self.cycle.keep_alive = False
                return
            self._abandon(self.cycle)
        if target is None:
            target = getattr(self, "url", b"") if self._head_bytes or not self._in_head else b""
        reply = error_reply(_target_path(target), err)
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]
        headers.append((b"connection", b"close"))
        refusal = _head(err.status, headers) + reply.body
        if self._sending():
            # Never into a response still going out (a pipelined head):
            # this one follows it.
            self._refusal = refusal
            return
        self._send_refusal(refusal, linger)

    def _abandon(self, cycle: Any) -> None:
        # Its handler hears that the client left, and what it sends is dropped.
        queued = [entry for entry in self.pipeline if entry[0] is cycle]
        for entry in queued:
            self.pipeline.remove(entry)
        cycle.disconnected = True
        cycle.message_event.set()

    def _sending(self) -> bool:
        """Whether a response is (or will be) sent on this connection before
        anything else may be written."""
        cycle = self._running
        return bool(self.pipeline) or (cycle is not None and not cycle.response_complete and not cycle.disconnected)

    def _send_refusal(self, refusal: bytes, linger: bool = True) -> None:
        self.transport.write(refusal)
        if not linger:
            self.transport.close()  # once the reply is written
            return
        try:
            self.transport.write_eof()
        except (NotImplementedError, OSError, RuntimeError):
            self.transport.close()
            return
        self.loop.call_later(_LINGER_S, self.transport.close)


def _target_path(target: bytes) -> str:
    return target.split(b"?", 1)[0].decode("latin-1") or "/"


def _head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    lines = [b"HTTP/1.1 %d %s" % (status, http.HTTPStatus(status).phrase.encode())]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


# A WebSocket message may exceed the body limit by this much and still be
# read, so that its refusal is an error frame naming the limit (413), not a
# close; a larger one closes the connection (1009) as it arrives.
WEBSOCKET_MESSAGE_SLACK = 64 * 1024


def connection_cap(limits: RequestLimits) -> int:
    """``limits.max_connections``, within half the file descriptors the
    process may open (each connection holds one)."""
    soft = _nofile()
    if soft is None:
        return limits.max_connections
    return max(1, min(limits.max_connections, soft // 2))


def _nofile() -> int | None:
    """The process's file descriptor limit (``ulimit -n``); None where it
    has none or the platform does not say (not a Unix)."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


# asyncio's report of a failed accept (EMFILE, ENFILE, ENOBUFS, ENOMEM);
# it then stops accepting for a second (asyncio.selector_events).
_ACCEPT_FAILED = "socket.accept() out of system resource"
_ACCEPT_WARNING_EVERY_S = 60.0


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """A failed accept is logged as one warning a minute naming the file
    descriptor limit, not asyncio's traceback for every failed accept
    (hundreds a second); anything else goes to the handler that was there."""
    previous = loop.get_exception_handler()
    warned_at = [-_ACCEPT_WARNING_EVERY_S]

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if context.get("message") == _ACCEPT_FAILED and isinstance(exc, OSError):
            now = time.monotonic()
            if now - warned_at[0] >= _ACCEPT_WARNING_EVERY_S:
                warned_at[0] = now
                log.warning("cannot accept connections: %s (ulimit -n is %s); new connections wait a second each "
                            "time (raise the limit, or lower max_connections)", exc.strerror or exc,
                            _nofile() or "unlimited")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)


def uvicorn_options(limits: RequestLimits) -> dict[str, Any]:
    protocol = type("LmspdHttpProtocol", (LmspdHttpToolsProtocol,), {
        "head_limit": max_head_bytes(limits), "head_timeout_s": limits.head_timeout_s,
        "write_stall_s": limits.write_stall_s, "max_connections": connection_cap(limits)})
    return {"http": protocol,
            # Not uvicorn's 16 MiB: the body limit bounds a message too.
            "ws_max_size": limits.max_body_bytes + WEBSOCKET_MESSAGE_SLACK,
            # permessage-deflate would inflate every message on the event
            # loop; clients (Codex, the SDKs) send plain frames without it.
            "ws_per_message_deflate": False}
