"""The body reader (lmspd.bodies.read_json_object): the media type first,
a declared Content-Length past the limit refused before reading, an
undeclared (chunked) body cut off as soon as it passes the limit, and
compressed bodies decoded within the same limit. (The JSON decoder itself:
tests/unit/test_strict_json.py.)"""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest
from starlette.requests import Request

from lmspd import bodies
from lmspd.bodies import read_json_object
from lmspd.core.errors import ApiError
from lmspd.core.limits import RequestLimits

LIMITS = RequestLimits(max_body_bytes=1024)


def read(chunks, *, content_type="application/json", length=None, encoding=None, limits=LIMITS, pulled=None):
    headers = [(b"content-type", content_type.encode())] if content_type else []
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    for line in [encoding] if isinstance(encoding, str) else encoding or []:
        headers.append((b"content-encoding", line.encode()))
    pulled = [] if pulled is None else pulled

    async def receive():
        if len(pulled) < len(chunks):
            pulled.append(chunks[len(pulled)])
            return {"type": "http.request", "body": pulled[-1], "more_body": len(pulled) < len(chunks)}
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers, "query_string": b""}

    async def go():
        return await read_json_object(Request(scope, receive), limits)

    return asyncio.run(go()), pulled


def refused(*args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        read(*args, **kwargs)
    return info.value


def test_a_body_in_pieces_is_one_object() -> None:
    body, _ = read([b'{"a": ', b'[1, 2', b"]}"])
    assert body == {"a": [1, 2]}


@pytest.mark.parametrize("media", ["application/json; charset=utf-8", "application/merge-patch+json",
                                   "APPLICATION/JSON"])
def test_json_media_types_are_accepted(media) -> None:
    assert read([b"{}"], content_type=media)[0] == {}


@pytest.mark.parametrize("media", ["text/plain", "", "application/x-www-form-urlencoded", "application/jsonx"])
def test_other_media_types_are_415_before_reading(media) -> None:
    with pytest.raises(ApiError) as info:
        read([b"{}"], content_type=media)
    assert info.value.code == "unsupported_media_type"


def test_a_declared_length_past_the_limit_is_413_without_reading() -> None:
    err = refused([b"{}"], length=2048)
    assert err.code == "request_too_large"


def test_a_bad_content_length_is_400() -> None:
    assert refused([b"{}"], length="many").code == "invalid_request"


def test_an_undeclared_body_stops_being_read_at_the_limit() -> None:
    chunks = [b'{"a":"' + b"x" * 500] * 10
    pulled: list[bytes] = []
    with pytest.raises(ApiError) as info:
        read(chunks, pulled=pulled)
    assert info.value.code == "request_too_large"
    assert len(pulled) == 3, "nothing is read past the chunk that crossed the limit"


def test_a_body_exactly_at_the_limit_is_read() -> None:
    raw = json.dumps({"a": "x" * (1024 - 9)}).encode()
    assert len(raw) == 1024
    assert read([raw])[0]["a"] == "x" * 1015


def test_gzip_is_decoded_and_its_output_bounded_by_the_same_limit() -> None:
    assert read([gzip.compress(b'{"a": 1}')], encoding="gzip")[0] == {"a": 1}
    bomb = gzip.compress(b'{"a":"' + b"x" * 100_000 + b'"}')
    assert len(bomb) < 1024
    with pytest.raises(ApiError) as info:
        read([bomb], encoding="gzip")
    assert info.value.status == 413


def test_not_an_object_is_400() -> None:
    assert refused([b"[1]"]).code == "invalid_json"


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
def test_members_are_bounded_and_each_must_end(coding) -> None:
    import zstandard

    def pack(data: bytes) -> bytes:
        return gzip.compress(data, mtime=0) if coding == "gzip" else zstandard.ZstdCompressor().compress(data)

    limits = RequestLimits(max_body_bytes=4096, max_body_members=4)
    # Several members in a row are one body (RFC 1952; zstd frames likewise).
    assert read([pack(b'{"a": ') + pack(b"") + pack(b"[1, 2]}")], encoding=coding, limits=limits)[0] == {"a": [1, 2]}
    many = refused([pack(b"") * 5 + pack(b"{}")], encoding=coding, limits=limits)
    assert many.status == 400 and f"more than 4 {coding}" in many.message
    cut = refused([pack(b'{"a": 1}')[:-2]], encoding=coding, limits=limits)
    assert cut.status == 400 and "ends early" in cut.message


SCOPE = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
         "headers": [(b"content-type", b"application/json")]}


def read_messages(receive, limits=LIMITS):
    """The body ``receive`` delivers (a coroutine function of no argument), read."""
    async def go():
        return await read_json_object(Request(SCOPE, receive), limits)

    return asyncio.run(asyncio.wait_for(go(), 10))


def test_a_body_that_stops_arriving_is_a_408_that_closes_the_connection() -> None:
    pieces = [{"type": "http.request", "body": b'{"a": ', "more_body": True}]

    async def receive():
        if pieces:
            return pieces.pop()
        await asyncio.sleep(3600)  # the rest never comes

    with pytest.raises(ApiError) as info:
        read_messages(receive, RequestLimits(body_timeout_s=0.05))
    assert info.value.status == 408 and "0.05 s" in info.value.message
    assert info.value.headers["Connection"] == "close"


def test_a_slow_body_that_keeps_coming_is_read() -> None:
    pieces = [b'{"a": ', b"[1, ", b"2]}"]

    async def receive():
        await asyncio.sleep(0.1)  # each piece within the pause allowed, all of them past it
        body = pieces.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(pieces)}

    assert read_messages(receive, RequestLimits(body_timeout_s=0.2)) == {"a": [1, 2]}


def test_a_client_that_leaves_mid_body_ends_the_request_as_a_499() -> None:
    # Not starlette's ClientDisconnect, which reached the edge as an
    # unhandled error and counted as a 500.
    messages = [{"type": "http.request", "body": b'{"a": ', "more_body": True}, {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0)

    with pytest.raises(ApiError) as info:
        read_messages(receive)
    assert info.value.status == 499 and info.value.code == "client_closed_request"


def test_bodies_in_flight_share_one_bound_and_give_their_bytes_back() -> None:
    """Slow bodies on many connections held max_connections x max_body_bytes
    together (8 GiB); now the bytes received and not yet decoded, over all
    of them, are bounded: one past it is a 503 that closes its connection,
    and a body that ends, however it ends, gives its bytes back."""
    limits = RequestLimits(max_body_bytes=1024, max_bodies_in_flight_bytes=1000)
    first_piece = b'{"a": "' + b"x" * 593  # 600 bytes, the first body's, held while it waits
    resume = asyncio.Event()

    async def first():
        pieces = [first_piece, b'"}']

        async def receive():
            if len(pieces) == 1:
                await resume.wait()
            return {"type": "http.request", "body": pieces.pop(0), "more_body": bool(pieces)}
        return await read_json_object(Request(SCOPE, receive), limits)

    def second(size: int):
        body = b'{"b": "' + b"y" * (size - 9) + b'"}'

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}
        return read_json_object(Request(SCOPE, receive), limits)

    async def go():
        reading = asyncio.create_task(first())
        await asyncio.sleep(0.01)
        assert bodies.IN_FLIGHT.bytes == 600
        assert (await second(400))["b"] == "y" * 391  # within what is left
        with pytest.raises(ApiError) as info:
            await second(401)
        resume.set()
        assert (await reading)["a"] == "x" * 593
        assert bodies.IN_FLIGHT.bytes == 0
        assert (await second(1000))["b"]  # the whole bound, once the first gave its bytes back
        return info.value

    err = asyncio.run(asyncio.wait_for(go(), 10))
    assert (err.status, err.code) == (503, "server_overloaded")
    assert err.headers == {"Retry-After": "1", "Connection": "close"}
    assert bodies.IN_FLIGHT.bytes == 0


@pytest.mark.parametrize("chunks, status", [
    ([b'{"a": 1'], 400),  # not JSON
    ([b'{"a": "' + b"x" * 1100 + b'"}'], 413),
    ([b'{"a":', None], 499),  # the client leaves
])
def test_a_body_refused_gives_its_bytes_back(chunks, status) -> None:
    messages = [{"type": "http.request", "body": c, "more_body": i + 1 < len(chunks)} if c is not None
                else {"type": "http.disconnect"} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0)

    with pytest.raises(ApiError) as info:
        read_messages(receive)
    assert info.value.status == status
    assert bodies.IN_FLIGHT.bytes == 0


def test_content_encoding_on_two_header_lines_is_one_list() -> None:
    """``Content-Encoding: gzip`` twice is ``gzip, gzip``; only the first
    line was read, and the body, decoded once, was a 400 invalid_json."""
    twice = gzip.compress(gzip.compress(b'{"a": 1}'))
    assert read([twice], encoding=["gzip", "gzip"])[0] == {"a": 1}
    assert read([twice], encoding="gzip, gzip")[0] == {"a": 1}
