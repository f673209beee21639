"""The provider HTTP client: one POST per generation, checked before use.

``open`` sends the request and returns only once the provider's status line
and headers are in and acceptable (2xx, ``text/event-stream``, no content
encoding) — so a refusal can still become an HTTP error reply downstream.
The returned ``ProviderStream`` yields raw body bytes and turns aiohttp's
exceptions into typed transport errors:

    connect refused / reset, all endpoints   UpstreamUnavailable
    closed with no answer, kept-alive conn.  tried once more at the same endpoint
                                             (the keep-alive reuse race), then
                                             UpstreamConnectionLost
    closed with no answer, new connection    UpstreamConnectionLost (a proxy may
                                             have passed the request on)
    closed inside its status line or headers UpstreamConnectionLost (it had the
                                             request: no second generation)
    connect or header wait too slow          UpstreamTimeout
    no byte for ``idle_s`` mid-stream        UpstreamTimeout (the idle watchdog)
    no output for ``progress_s``             UpstreamTimeout (the progress bound)
    connection dropped mid-stream            UpstreamConnectionLost
    non-2xx, wrong content type              UpstreamHTTPError

The idle watchdog bounds the wait for each read (headers included), which
is exactly "nothing arrived for idle_s": aiohttp's socket read timeout,
and lmspd's own clock around every body read besides. A provider's ``:``
keep-alive comments count as life; they are how some providers say "still
prefilling". They are not output, though: the engine tells the stream when
output came (``progressed``), and a read still waiting ``progress_s`` after
the last output (or after the headers) fails however many bytes came
meanwhile (core/limits.py's ``progress_timeout_s``).

aiohttp rather than httpx because this is the hot path of every upstream
token: its C parser hands over a whole burst of chunked events in one read,
where httpx spends about 10 µs per HTTP chunk and half a millisecond more
per request (``bench/gateway.py`` measured both).

The key goes into one header and nowhere else: not into URLs, logs,
exception messages or ``stats()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import aiohttp
import anyio
from aiohttp.http import RawResponseMessage

from lmspd import __version__
from lmspd.core.limits import UpstreamStreamLimits

from .credentials import Secret
from .errors import (
    UpstreamConnectionLost,
    UpstreamHTTPError,
    UpstreamTimeout,
    UpstreamUnavailable,
    private_text,
    provider_error_code,
)
from .pool import Endpoint, EndpointPool

__all__ = ["ProviderClient", "ProviderStream", "Timeouts"]

log = logging.getLogger("lmspd.upstream")

# An error body is read for its code and logs only; this much is plenty.
_MAX_ERROR_BODY = 64 * 1024
_ERROR_BODY_S = 5.0
# The media types a wrong answer is named by (a proxy's HTML page, a JSON
# error with a 200): any other is "an unexpected type". Not a pattern: a
# provider or proxy that echoes the Authorization header into Content-Type
# passed one (a hex or UUID key is a valid-looking "type/subtype").
_NAMED_MEDIA = frozenset({"application/json", "application/problem+json", "application/x-ndjson",
                          "application/octet-stream", "application/xml", "text/html", "text/plain",
                          "text/xml", ""})
_MAX_RETRY_AFTER_S = 3600
# What may follow [DONE] before the connection is given up rather than reused.
_MAX_DRAIN_BYTES = 64 * 1024
_MAX_DRAIN_S = 2.0
# How long an idle connection is kept for the next request: under uvicorn's
# 5 s default (vLLM, SGLang, llama_cpp.server), so that lmspd closes it first
# instead of racing the provider's close with a new request.
_KEEPALIVE_S = 4.0


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 10.0
    # Stream idle: the longest wait for the next byte (headers included).
    idle_s: float = UpstreamStreamLimits.idle_timeout_s
    # The longest time without output, bytes or not (``ProviderStream.progressed``).
    progress_s: float = UpstreamStreamLimits.progress_timeout_s
    health_s: float = 5.0


class ReadInterrupted(Exception):
    """A read of the provider's stream ended by ``ProviderStream.interrupt``."""


def _retrieved(read: "asyncio.Task[bytes]") -> None:
    """A read's outcome is taken even where nobody waits for it any more (it
    failed as it was cancelled): no "exception was never retrieved"."""
    if not read.cancelled():
        read.exception()


class ProviderStream:
    """An accepted provider response: ``next_chunk()`` until it raises
    ``StopAsyncIteration``, then ``aclose()`` (or ``drain()`` after a clean
    end, to keep the connection)."""

    def __init__(self, response: aiohttp.ClientResponse, endpoint: Endpoint, idle_s: float,
                 progress_s: float = UpstreamStreamLimits.progress_timeout_s) -> None:
        self.response = response
        self.endpoint = endpoint
        self._idle_s = idle_s
        self._progress_s = progress_s
        self._loop = asyncio.get_running_loop()
        # When a read still waiting fails for want of output.
        self._progress_by = self._loop.time() + progress_s
        self._closed = False
        # The read waiting on the provider, if one does (``interrupt``).
        self._read: asyncio.Task[bytes] | None = None
        self._interrupted = False

    def progressed(self) -> None:
        """The provider sent output: the time without it starts again."""
        self._progress_by = self._loop.time() + self._progress_s

    def interrupt(self) -> None:
        """End the read waiting on the provider, and refuse any later one:
        ``next_chunk`` raises ``ReadInterrupted`` (the request's cancel
        token: a client gone, a cancel, shutdown)."""
        self._interrupted = True
        if self._read is not None:
            self._read.cancel()

    async def next_chunk(self) -> bytes:
        """The provider's next bytes. A read that waits runs as a task of its
        own, bounded by a plain timeout: the step that calls this may run in
        the consumer's task while it does other things (``Paced`` leaves a
        silent step suspended while the consumer writes a keep-alive), and a
        deadline or an interrupt that cancelled the current task would land
        in that write, with no terminal event."""
        if self._interrupted:
            raise ReadInterrupted
        content = self.response.content
        try:
            # Bytes already here are returned even past the deadline.
            data = content.read_nowait()
        except Exception:
            raise UpstreamConnectionLost() from None
        if data:
            return data
        if content.at_eof():
            raise StopAsyncIteration
        idle_by = self._loop.time() + self._idle_s
        progress_by = self._progress_by
        read = self._read = self._loop.create_task(content.readany())
        read.add_done_callback(_retrieved)
        try:
            # Our own clock as well as aiohttp's socket timeout: on some
            # framing errors aiohttp drops its read timer and never wakes
            # the reader.
            done, _ = await asyncio.wait({read}, timeout=max(0.0, min(idle_by, progress_by) - self._loop.time()))
        except BaseException:
            read.cancel()
            raise
        finally:
            self._read = None
        if read.cancelled():
            raise ReadInterrupted
        # aiohttp's read timeout (the same idle bound) is a TimeoutError too.
        if not done or isinstance(read.exception(), TimeoutError):
            read.cancel()
            if progress_by < idle_by:
                raise UpstreamTimeout(f"The upstream provider sent no output for {self._progress_s:g} s.")
            raise UpstreamTimeout(f"The upstream provider sent nothing for {self._idle_s:g} s.")
        if read.exception() is not None:
            # A truncated or malformed chunked body, a reset: aiohttp says so
            # with ClientError, OSError or a bare RuntimeError.
            raise UpstreamConnectionLost()
        data = read.result()
        if not data:
            raise StopAsyncIteration
        return data

    async def drain(self, max_bytes: int = _MAX_DRAIN_BYTES, max_s: float = _MAX_DRAIN_S) -> None:
        """After the terminal marker: let the rest of the body go by unread
        (its bytes are never decoded) so that the keep-alive connection can
        serve the next request; a provider that keeps talking, or stalls,
        gets its connection closed instead."""
        seen = 0
        complete = False
        try:
            with anyio.fail_after(max_s):
                while piece := await self.response.content.readany():
                    seen += len(piece)
                    if seen > max_bytes:
                        break
                else:
                    complete = True
        except (Exception, anyio.get_cancelled_exc_class()):
            pass
        finally:
            await self._finish(keep=complete)

    async def aclose(self) -> None:
        """Close the body (and with it the connection, if it is mid-stream:
        the provider sees the disconnect and stops generating)."""
        await self._finish(keep=False)

    async def _finish(self, *, keep: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self.endpoint.outstanding -= 1
        if keep:
            # Back to the pool: the body was read to its end.
            self.response.release()
        else:
            self.response.close()


class ProviderClient:
    def __init__(
        self,
        pool: EndpointPool,
        *,
        key: Secret | None = None,
        timeouts: Timeouts = Timeouts(),
        max_connections: int = 256,
        health_interval_s: float = 10.0,
    ) -> None:
        self.pool = pool
        self.timeouts = timeouts
        self._headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            # Bounds are checked on the bytes we decode; a compressed body
            # would let a few bytes on the wire become many in memory.
            "Accept-Encoding": "identity",
            "User-Agent": f"lmspd/{__version__}",
        }
        self._key = key
        if key is not None:
            self._headers["Authorization"] = f"Bearer {key.reveal()}"
        self._max_connections = max_connections
        self._request_timeout = aiohttp.ClientTimeout(
            total=None, connect=timeouts.connect_s, sock_connect=timeouts.connect_s, sock_read=timeouts.idle_s)
        self._health_interval_s = health_interval_s
        self._http: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._drains: dict[asyncio.Task[None], ProviderStream] = {}

    def release(self, stream: ProviderStream) -> None:
        """Drain a cleanly finished stream in the background (the client has
        its terminal event already), keeping the connection for reuse."""
        task = asyncio.get_running_loop().create_task(stream.drain())
        self._drains[task] = stream
        task.add_done_callback(lambda done: self._drains.pop(done, None))

    def _session(self) -> aiohttp.ClientSession:
        # An aiohttp session belongs to a running loop, so it starts with the
        # first request (and so does the health loop).
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(
                # Twice the model's concurrency: connections still draining
                # after [DONE] must not make the next request wait for one.
                connector=aiohttp.TCPConnector(limit=2 * self._max_connections, limit_per_host=0,
                                               keepalive_timeout=_KEEPALIVE_S),
                headers=self._headers,
                trace_configs=[_REUSE_SEEN],
                # The bridge decodes the body; nothing else may touch it.
                auto_decompress=False,
                trust_env=False,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        if self._health_task is None and len(self.pool.endpoints) > 1 and self._health_interval_s > 0:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
        return self._http

    async def open(self, body: bytes,
                   choose: Callable[[Sequence[int]], Endpoint | None] | None = None) -> ProviderStream:
        """POST ``body`` to ``choose(tried)`` (the router's choice; by default
        the least loaded); an endpoint that cannot be reached is marked down
        and ``choose`` asked again without it."""
        if choose is None:
            choose = self._least_loaded
        session = self._session()
        tried: list[int] = []
        last: Exception | None = None
        while True:
            endpoint = choose(tried)
            if endpoint is None:
                if isinstance(last, UpstreamTimeout):
                    raise last
                raise UpstreamUnavailable()
            tried.append(endpoint.index)
            try:
                attempt = _Attempt()
                try:
                    return await self._open_at(session, endpoint, body, attempt)
                except aiohttp.ServerDisconnectedError as exc:
                    if isinstance(exc.message, RawResponseMessage) or not attempt.reused:
                        # Closed after the first bytes of an answer, or on a
                        # connection opened for this request (a proxy that
                        # read it and hung up): the provider may have it,
                        # and sending it again would start a second
                        # generation.
                        raise
                    # Closed with no answer on a kept-alive connection: the
                    # provider shut it just as it was reused, before reading
                    # the request. Once more (on another connection) before
                    # calling the endpoint down (which would move every
                    # session pinned to it).
                    return await self._open_at(session, endpoint, body, _Attempt())
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                # Nothing was sent: the next endpoint may take it.
                self.pool.mark_down(endpoint)
                log.warning("upstream %s unreachable (%s)", endpoint.label, type(exc).__name__)
                last = (UpstreamTimeout("Connecting to the upstream provider timed out.")
                        if isinstance(exc, aiohttp.ConnectionTimeoutError) else UpstreamUnavailable())
            except asyncio.TimeoutError:
                raise UpstreamTimeout(
                    f"The upstream provider did not answer within {self.timeouts.idle_s:g} s.") from None
            except (aiohttp.ClientError, OSError):
                self.pool.mark_down(endpoint)
                raise UpstreamConnectionLost() from None

    def _least_loaded(self, tried: Sequence[int]) -> Endpoint | None:
        return min(self.pool.live(tried), key=lambda e: e.outstanding, default=None)

    async def _open_at(self, session: aiohttp.ClientSession, endpoint: Endpoint, body: bytes,
                       attempt: _Attempt) -> ProviderStream:
        endpoint.outstanding += 1
        endpoint.requests += 1
        try:
            # Never follow a redirect with the key to somewhere else.
            response = await session.post(endpoint.url("/chat/completions"), data=body, allow_redirects=False,
                                          timeout=self._request_timeout, trace_request_ctx=attempt)
        except BaseException:
            endpoint.outstanding -= 1
            raise
        self.pool.mark_up(endpoint)
        stream = ProviderStream(response, endpoint, self.timeouts.idle_s, self.timeouts.progress_s)
        try:
            await self._check(response)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            raise
        return stream

    async def _check(self, response: aiohttp.ClientResponse) -> None:
        status = response.status
        if not 200 <= status < 300:
            detail, code = await _error_body(response)
            raise UpstreamHTTPError(
                status,
                f"The upstream provider returned HTTP {status}" + (f" ({code})." if code else "."),
                # The key out before the cut (a provider may echo the header).
                detail=private_text(detail, self._key),
                provider_code=code,
                retry_after=_retry_after(response.headers.get("retry-after")),
            )
        media = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "text/event-stream":
            shown = (media or "no content type") if media in _NAMED_MEDIA else "an unexpected type"
            raise UpstreamHTTPError(status, f"The upstream provider answered with {shown} instead of an event stream.")
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise UpstreamHTTPError(status, "The upstream provider compressed its event stream; lmspd asked it not to.")

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            await asyncio.gather(*(self.probe(e) for e in self.pool.endpoints), return_exceptions=True)

    async def probe(self, endpoint: Endpoint) -> bool:
        """``GET <base>/models``: reachable and not failing is healthy (a 401
        or 404 still means the server is up; requests will say the rest)."""
        try:
            async with self._session().get(endpoint.url("/models"), allow_redirects=False,
                                           timeout=aiohttp.ClientTimeout(total=self.timeouts.health_s)) as response:
                healthy = response.status < 500
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            healthy = False
        if healthy:
            self.pool.mark_up(endpoint)
        else:
            if endpoint.healthy:
                log.warning("upstream %s failed its health check", endpoint.label)
            # Every failed probe pushes the next try further out, so that a
            # dead endpoint is not handed real requests between probes.
            self.pool.mark_down(endpoint)
        return healthy

    async def aclose(self) -> None:
        drains = dict(self._drains)
        for task in drains:
            task.cancel()
        await asyncio.gather(*drains, return_exceptions=True)
        # A drain cancelled before it ran never reached its own close.
        for stream in drains.values():
            await stream.aclose()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._http is not None:
            await self._http.close()


async def _error_body(response: aiohttp.ClientResponse) -> tuple[str | None, str | None]:
    """(message for logs, safe code for the client) from an error reply."""
    raw = bytearray()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_ERROR_BODY_S):
            while len(raw) < _MAX_ERROR_BODY and (piece := await response.content.readany()):
                raw += piece
    text = bytes(raw[:_MAX_ERROR_BODY]).decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):  # a body nested past the parser's depth is no error object either
        return text or None, None
    error = body.get("error", body) if isinstance(body, dict) else None
    if isinstance(error, str):
        return error, provider_error_code(None, None, error)
    if not isinstance(error, dict):
        return text, None
    message = error.get("message")
    message = message if isinstance(message, str) else None
    code, type_ = (None if v is None else str(v) for v in (error.get("code"), error.get("type")))
    return (message or text), provider_error_code(code, type_, message)


@dataclass
class _Attempt:
    """One POST's ``trace_request_ctx``: whether it went out on a kept-alive
    connection (``_REUSE_SEEN``)."""

    reused: bool = False


async def _on_reuse(_session: aiohttp.ClientSession, context: SimpleNamespace,
                    _params: aiohttp.TraceConnectionReuseconnParams) -> None:
    if isinstance(context.trace_request_ctx, _Attempt):
        context.trace_request_ctx.reused = True


_REUSE_SEEN = aiohttp.TraceConfig()
_REUSE_SEEN.on_connection_reuseconn.append(_on_reuse)
_REUSE_SEEN.freeze()


def _retry_after(value: str | None) -> int | None:
    if value is None or not value.strip().isdigit():
        return None
    return min(int(value.strip()), _MAX_RETRY_AFTER_S)
