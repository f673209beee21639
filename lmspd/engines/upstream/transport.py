"""httpx transports tuned for many small streaming requests to one provider.

Two things httpx does not do by itself, each worth milliseconds per request:

- **One write per request.** httpcore writes the request head and body as
  two sends; with the provider's delayed ACKs (and costly syscalls) the
  second one adds latency before the provider even sees the request. The
  network stream here holds writes until the first read, then sends them
  as one. ``TCP_NODELAY`` is set for the same reason.
- **Small pools.** httpcore's pool re-checks every connection it holds (a
  syscall each) whenever a request starts or ends, which grows with the
  square of concurrent streams. ``ShardedClients`` spreads connections over
  several small pools instead.
"""

from __future__ import annotations

import math
import socket
import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

__all__ = ["ShardedClients"]

_SOCKET_OPTIONS = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
# Buffered request bytes beyond this are written at once (bodies are bounded
# JSON; this only keeps a huge one from sitting in memory twice).
_MAX_HELD_BYTES = 256 * 1024


class _OneWriteStream(httpcore.AsyncNetworkStream):
    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner
        self._held: list[bytes] = []
        self._held_bytes = 0

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._held.append(buffer)
        self._held_bytes += len(buffer)
        if self._held_bytes >= _MAX_HELD_BYTES:
            await self._flush(timeout)

    async def _flush(self, timeout: float | None) -> None:
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            self._held_bytes = 0
            await self._inner.write(data, timeout)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        await self._flush(timeout)
        return await self._inner.read(max_bytes, timeout)

    async def aclose(self) -> None:
        self._held.clear()
        await self._inner.aclose()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        await self._flush(timeout)
        return _OneWriteStream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _OneWriteBackend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        return _OneWriteStream(await self._inner.connect_tcp(host, port, timeout, local_address, socket_options))

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        return _OneWriteStream(await self._inner.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def _transport(connections: int, ssl_context: ssl.SSLContext | None = None) -> httpx.AsyncHTTPTransport:
    transport = httpx.AsyncHTTPTransport(
        # One context for every shard: building one loads the CA bundle.
        verify=ssl_context or httpx.create_ssl_context(),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        socket_options=_SOCKET_OPTIONS,
        trust_env=False,
    )
    # httpx has no parameter for the network backend; its pool does. (httpx
    # is pinned; this is the one private attribute lmspd touches.)
    old = transport._pool
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=old._ssl_context,
        max_connections=connections,
        max_keepalive_connections=connections,
        socket_options=_SOCKET_OPTIONS,
        network_backend=_OneWriteBackend(),
    )
    return transport


class ShardedClients:
    """``httpx.AsyncClient``s of at most ``shard_size`` connections each; a
    request takes the one with the fewest requests in flight."""

    def __init__(self, max_connections: int, *, shard_size: int = 8, **client_options: Any) -> None:
        shards = max(1, math.ceil(max_connections / shard_size))
        size = math.ceil(max_connections / shards)
        context = httpx.create_ssl_context()
        self.clients = [httpx.AsyncClient(transport=_transport(size, context), **client_options)
                        for _ in range(shards)]
        self.in_flight = [0] * shards

    def acquire(self) -> int:
        shard = min(range(len(self.clients)), key=self.in_flight.__getitem__)
        self.in_flight[shard] += 1
        return shard

    def release(self, shard: int) -> None:
        self.in_flight[shard] -= 1

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()
