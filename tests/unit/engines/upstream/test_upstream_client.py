"""The provider HTTP client against raw sockets: whatever a provider does to
its HTTP framing, a read ends with a typed transport error within the idle
timeout (never a hang, never an untyped exception)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from lmspd.engines.upstream.client import ProviderClient, Timeouts
from lmspd.engines.upstream.errors import UpstreamConnectionLost, UpstreamHTTPError, UpstreamTimeout
from lmspd.engines.upstream.pool import EndpointPool

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENT = b'data: {"choices":[]}\n\n'
GOOD_CHUNK = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)

BODIES = {
    "chunk size line that is not hex": b"zz\r\nhello\r\n",
    "chunk longer than its size": b"5\r\ndata:\r\nZZZ\r\nhello\r\n",
    "body cut inside a chunk": b"40\r\ndata: {}",
}


async def _serve(head: bytes, body: bytes, *, close: bool):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await reader.read(65536)
            writer.write(head + GOOD_CHUNK)
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(body)
            await writer.drain()
            if not close:
                await asyncio.sleep(30)
        finally:
            # A silent one is cancelled when the test's loop ends: its socket
            # is closed here, not by the garbage collector later.
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize("close", [True, False], ids=["then-closed", "then-silent"])
@pytest.mark.parametrize("body", list(BODIES.values()), ids=list(BODIES))
def test_broken_framing_is_a_typed_error_within_the_idle_timeout(body: bytes, close: bool) -> None:
    async def go() -> tuple[type[BaseException], float]:
        server = await _serve(HEAD, body, close=close)
        port = server.sockets[0].getsockname()[1]
        client = ProviderClient(EndpointPool([f"http://127.0.0.1:{port}/v1"]),
                                timeouts=Timeouts(connect_s=2, idle_s=1))
        stream = await client.open(b"{}")
        started = time.monotonic()
        try:
            assert await stream.next_chunk() == EVENT
            while True:
                await asyncio.wait_for(stream.next_chunk(), 10)
        except BaseException as exc:  # noqa: BLE001 - the type is the assertion
            return type(exc), time.monotonic() - started
        finally:
            await stream.aclose()
            await client.aclose()
            server.close()

    kind, elapsed = asyncio.run(go())
    assert kind in (UpstreamConnectionLost, UpstreamTimeout)
    assert elapsed < 3


def test_error_reply_with_broken_framing_is_still_an_http_error() -> None:
    async def go() -> UpstreamHTTPError:
        head = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        server = await _serve(head, b"zz\r\n", close=False)
        port = server.sockets[0].getsockname()[1]
        client = ProviderClient(EndpointPool([f"http://127.0.0.1:{port}/v1"]),
                                timeouts=Timeouts(connect_s=2, idle_s=1))
        try:
            with pytest.raises(UpstreamHTTPError) as info:
                await asyncio.wait_for(client.open(b"{}"), 10)
            return info.value
        finally:
            await client.aclose()
            server.close()

    assert asyncio.run(go()).status == 503


def _answer(writer: asyncio.StreamWriter) -> None:
    from support.provider import text_stream

    body = b"".join(text_stream("ok"))
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s"
                 % (len(body), body))


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    return head + await reader.readexactly(length)


async def _read_all(stream) -> bytes:
    data = b""
    with contextlib.suppress(StopAsyncIteration):
        while True:
            data += await stream.next_chunk()
    return data


def test_a_kept_alive_connection_closed_without_an_answer_is_tried_once_more():
    """The keep-alive race: the provider shut an idle connection just as the
    next request went out on it, before reading it. Sent again, on a new
    connection."""
    connections: list[asyncio.StreamWriter] = []
    requests: list[bytes] = []

    async def flaky(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        try:
            while True:
                requests.append(await _read_request(reader))
                if len(requests) == 2:
                    return  # the second request, on the kept-alive connection: closed, nothing answered
                _answer(writer)
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()

    async def go():
        server = await asyncio.start_server(flaky, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = EndpointPool([f"http://127.0.0.1:{port}/v1"])
        client = ProviderClient(pool, health_interval_s=0)
        try:
            first = await client.open(b"{}")
            assert b"[DONE]" in await _read_all(first)
            await first.drain()  # read to its end: the connection goes back to the pool
            second = await client.open(b"{}")
            data = await _read_all(second)
            await second.aclose()
            return data, pool.endpoints[0]
        finally:
            await client.aclose()
            server.close()

    data, endpoint = asyncio.run(go())
    assert b"[DONE]" in data and len(requests) == 3 and len(connections) == 2
    assert endpoint.healthy and endpoint.outstanding == 0


def _open_is_lost(handle) -> None:
    """One ``open`` against a provider served by ``handle`` fails as
    ``UpstreamConnectionLost``."""
    async def go():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = ProviderClient(EndpointPool([f"http://127.0.0.1:{port}/v1"]), health_interval_s=0)
        try:
            with pytest.raises(UpstreamConnectionLost):
                await client.open(b"{}")
        finally:
            await client.aclose()
            server.close()

    asyncio.run(go())


def test_a_new_connection_closed_without_an_answer_is_not_sent_again():
    """A connection opened for the request, read and hung up on (a proxy
    that passed it on, then failed): the provider may be generating, so a
    second try would be a second generation."""
    requests: list[bytes] = []

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await _read_request(reader))
        writer.close()

    _open_is_lost(hang_up)
    assert len(requests) == 1


@pytest.mark.parametrize("answered", [b"HTTP/1.1 200 OK\r\n",
                                      b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"],
                         ids=["status-line", "partial-headers"])
def test_a_connection_closed_inside_the_answer_is_not_sent_again(answered: bytes):
    """The provider had the request (it began answering): a second try
    would be a second generation, so the first close is the failure."""
    requests = []

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(answered)
        await writer.drain()
        writer.close()

    _open_is_lost(cut)
    assert len(requests) == 1


def test_closing_the_client_closes_a_stream_whose_drain_had_not_started():
    """A stream handed back for draining just before the client closes (the
    server shutting down right after a turn): cancelling its drain before it
    ran must still close it, not leave its connection to the collector."""

    async def go():
        # First chunk, then a body that ends only much later: the drain
        # would wait for it.
        server = await _serve(HEAD, b"0\r\n\r\n", close=False)
        port = server.sockets[0].getsockname()[1]
        pool = EndpointPool([f"http://127.0.0.1:{port}/v1"])
        client = ProviderClient(pool, health_interval_s=0)
        try:
            stream = await client.open(b"{}")
            assert await stream.next_chunk() == EVENT
            client.release(stream)  # its drain is scheduled, not yet run
        finally:
            await client.aclose()
            server.close()
        return stream, pool.endpoints[0]

    stream, endpoint = asyncio.run(go())
    assert endpoint.outstanding == 0
    assert stream.response.connection is None  # released or closed, not left open


def _answer_once(head: bytes, body: bytes) -> UpstreamHTTPError:
    """What ``open`` raises against a provider that answers ``head`` and ``body``."""
    from lmspd.engines.upstream.credentials import Secret

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head + body)
        await writer.drain()
        writer.close()

    async def go() -> UpstreamHTTPError:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = ProviderClient(EndpointPool([f"http://127.0.0.1:{port}/v1"]),
                                timeouts=Timeouts(connect_s=2, idle_s=1), key=Secret(KEY))
        try:
            with pytest.raises(UpstreamHTTPError) as info:
                await asyncio.wait_for(client.open(b"{}"), 10)
            return info.value
        finally:
            await client.aclose()
            server.close()

    return asyncio.run(go())


KEY = "123e4567-e89b-12d3-a456-426614174000"


def test_a_content_type_echoing_the_key_is_not_shown():
    """A 200 that is no event stream names its media type, unless it is not
    a common one: a proxy echoing the Authorization header into it handed
    the key (a UUID key is a valid-looking type/subtype) to the client."""
    echoed = _answer_once(b"HTTP/1.1 200 OK\r\ncontent-type: %s/x\r\ncontent-length: 2\r\n\r\n" % KEY.encode(), b"{}")
    assert KEY not in str(echoed) and KEY not in echoed.message
    assert "an unexpected type instead of an event stream" in echoed.message
    html = _answer_once(b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 2\r\n\r\n", b"<p")
    assert "answered with text/html instead of an event stream" in html.message


def test_an_error_body_nested_past_the_parsers_depth_is_still_an_http_error():
    """``json.loads`` raises RecursionError, not ValueError, on 60 KB of
    ``[``: it escaped ``open`` untyped (a generic 500, nothing counted)."""
    body = b"[" * 60000
    error = _answer_once(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % len(body), body)
    assert error.status == 500
