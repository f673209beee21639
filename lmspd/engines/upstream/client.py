"""The provider HTTP client: one POST per generation, checked before use.

``open`` sends the request and returns only once the provider's status line
and headers are in and acceptable (2xx, ``text/event-stream``, no content
encoding) — so a refusal can still become an HTTP error reply downstream.
The returned ``ProviderStream`` yields raw body bytes and turns httpx's
exceptions into typed transport errors:

    connect refused / reset, all endpoints   UpstreamUnavailable
    connect or header wait too slow          UpstreamTimeout
    no byte for ``idle_s`` mid-stream        UpstreamTimeout (the idle watchdog)
    connection dropped mid-stream            UpstreamConnectionLost
    non-2xx, wrong content type              UpstreamHTTPError

The idle watchdog is httpx's read timeout: it bounds the wait for each
socket read, which is exactly "nothing arrived for idle_s". A provider's
``:`` keep-alive comments count as life; they are how some providers say
"still prefilling".

The key goes into one header and nowhere else: not into URLs, logs,
exception messages or ``stats()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import httpx

from lmspd import __version__

from .credentials import Secret
from .errors import (
    UpstreamConnectionLost,
    UpstreamHTTPError,
    UpstreamTimeout,
    UpstreamUnavailable,
    public_provider_code,
)
from .pool import Endpoint, EndpointPool
from .transport import ShardedClients

__all__ = ["ProviderClient", "ProviderStream", "Timeouts"]

log = logging.getLogger("lmspd.upstream")
# httpx logs every request at INFO; lmspd logs its own line per generation.
logging.getLogger("httpx").setLevel(logging.WARNING)

# An error body is read for its code and logs only; this much is plenty.
_MAX_ERROR_BODY = 64 * 1024
_SAFE_MEDIA = re.compile(r"[A-Za-z0-9.+\-]{1,40}/[A-Za-z0-9.+\-]{1,60}\Z")
_MAX_RETRY_AFTER_S = 3600
# What may follow [DONE] before the connection is given up rather than reused.
_MAX_DRAIN_BYTES = 64 * 1024
_MAX_DRAIN_S = 2.0


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 10.0
    # Stream idle: the longest wait for the next byte (headers included).
    idle_s: float = 120.0
    health_s: float = 5.0


class ProviderStream:
    """An accepted provider response: ``next_chunk()`` until it raises
    ``StopAsyncIteration``, then ``aclose()`` (or ``drain()`` after a clean
    end, to keep the connection)."""

    def __init__(self, response: httpx.Response, endpoint: Endpoint, idle_s: float,
                 on_close: Callable[[], None] = lambda: None) -> None:
        self.response = response
        self.endpoint = endpoint
        self._idle_s = idle_s
        self._raw = response.aiter_raw()
        self._on_close = on_close
        self._closed = False

    async def next_chunk(self) -> bytes:
        try:
            return await self._raw.__anext__()
        except httpx.ReadTimeout:
            raise UpstreamTimeout(f"The upstream provider sent nothing for {self._idle_s:g} s.") from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.NetworkError):
            raise UpstreamConnectionLost() from None
        except httpx.TimeoutException:
            raise UpstreamTimeout() from None

    async def drain(self, max_bytes: int = _MAX_DRAIN_BYTES, max_s: float = _MAX_DRAIN_S) -> None:
        """After the terminal marker: let the rest of the body go by unread
        (its bytes are never decoded) so that the keep-alive connection can
        serve the next request; a provider that keeps talking, or stalls,
        gets its connection closed instead."""
        seen = 0
        try:
            with anyio.fail_after(max_s):
                async for piece in self._raw:
                    seen += len(piece)
                    if seen > max_bytes:
                        break
        except (Exception, anyio.get_cancelled_exc_class()):
            pass
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Close the body (and with it the connection, if it is mid-stream:
        the provider sees the disconnect and stops generating)."""
        if self._closed:
            return
        self._closed = True
        self.endpoint.outstanding -= 1
        self._on_close()
        with contextlib.suppress(Exception), anyio.CancelScope(shield=True):
            await self.response.aclose()


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
        if key is not None:
            self._headers["Authorization"] = f"Bearer {key.reveal()}"
        t = timeouts
        self._http = ShardedClients(
            max_connections,
            timeout=httpx.Timeout(connect=t.connect_s, read=t.idle_s, write=t.connect_s, pool=t.connect_s),
            headers=self._headers,
            # Never follow a redirect with the key to somewhere else.
            follow_redirects=False,
            trust_env=False,
        )
        self._health_interval_s = health_interval_s
        self._health_task: asyncio.Task[None] | None = None
        self._drains: set[asyncio.Task[None]] = set()

    def release(self, stream: ProviderStream) -> None:
        """Drain a cleanly finished stream in the background (the client has
        its terminal event already), keeping the connection for reuse."""
        task = asyncio.get_running_loop().create_task(stream.drain())
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    def _clients(self) -> ShardedClients:
        # The health loop needs a running loop, so it starts with the first request.
        if self._health_task is None and len(self.pool.endpoints) > 1 and self._health_interval_s > 0:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
        return self._http

    async def open(self, body: bytes, affinity: str | None = None) -> ProviderStream:
        clients = self._clients()
        tried: list[int] = []
        last: Exception | None = None
        while True:
            endpoint = self.pool.pick(affinity, exclude=tried)
            if endpoint is None:
                if isinstance(last, UpstreamTimeout):
                    raise last
                raise UpstreamUnavailable()
            tried.append(endpoint.index)
            try:
                return await self._open_at(clients, endpoint, body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # Nothing was sent: the next endpoint may take it.
                self.pool.mark_down(endpoint)
                log.warning("upstream %s unreachable (%s)", endpoint.label, type(exc).__name__)
                last = (UpstreamTimeout("Connecting to the upstream provider timed out.")
                        if isinstance(exc, httpx.ConnectTimeout) else UpstreamUnavailable())
            except httpx.TimeoutException:
                raise UpstreamTimeout(
                    f"The upstream provider did not answer within {self.timeouts.idle_s:g} s.") from None
            except httpx.TransportError:
                self.pool.mark_down(endpoint)
                raise UpstreamConnectionLost() from None

    async def _open_at(self, clients: ShardedClients, endpoint: Endpoint, body: bytes) -> ProviderStream:
        endpoint.outstanding += 1
        endpoint.requests += 1
        shard = clients.acquire()
        http = clients.clients[shard]
        try:
            request = http.build_request("POST", endpoint.url("/chat/completions"), content=body)
            response = await http.send(request, stream=True)
        except BaseException:
            endpoint.outstanding -= 1
            clients.release(shard)
            raise
        self.pool.mark_up(endpoint)
        stream = ProviderStream(response, endpoint, self.timeouts.idle_s, on_close=lambda: clients.release(shard))
        try:
            await self._check(response)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            raise
        return stream

    async def _check(self, response: httpx.Response) -> None:
        status = response.status_code
        if not 200 <= status < 300:
            detail, code = await _error_body(response)
            raise UpstreamHTTPError(
                status,
                f"The upstream provider returned HTTP {status}" + (f" ({code})." if code else "."),
                detail=detail,
                provider_code=code,
                retry_after=_retry_after(response.headers.get("retry-after")),
            )
        media = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "text/event-stream":
            shown = media if _SAFE_MEDIA.match(media) else "an unexpected type"
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
            response = await self._clients().clients[0].get(endpoint.url("/models"), timeout=self.timeouts.health_s)
            healthy = response.status_code < 500
        except httpx.HTTPError:
            healthy = False
        if healthy:
            self.pool.mark_up(endpoint)
        elif endpoint.healthy:
            self.pool.mark_down(endpoint)
            log.warning("upstream %s failed its health check", endpoint.label)
        return healthy

    async def aclose(self) -> None:
        for task in list(self._drains):
            task.cancel()
        if self._drains:
            await asyncio.gather(*self._drains, return_exceptions=True)
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self._http.aclose()


async def _error_body(response: httpx.Response) -> tuple[str | None, str | None]:
    """(message for logs, safe code for the client) from an error reply."""
    raw = bytearray()
    with contextlib.suppress(httpx.HTTPError):
        async for piece in response.aiter_raw():
            raw += piece
            if len(raw) >= _MAX_ERROR_BODY:
                break
    text = bytes(raw[:_MAX_ERROR_BODY]).decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except ValueError:
        return text or None, None
    error = body.get("error", body) if isinstance(body, dict) else None
    if isinstance(error, str):
        return error, None
    if not isinstance(error, dict):
        return text, None
    message = error.get("message")
    code = public_provider_code(*(str(c) for c in (error.get("code"), error.get("type")) if c is not None))
    return (message if isinstance(message, str) else text), code


def _retry_after(value: str | None) -> int | None:
    if value is None or not value.strip().isdigit():
        return None
    return min(int(value.strip()), _MAX_RETRY_AFTER_S)
