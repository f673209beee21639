"""Reading a request body: media type, encoding, size and JSON, each with its own 4xx.

Every route reads its body through ``read_json_object``, so every route
parses JSON the same strict way (``lmspd.core.strict_json``: duplicate keys,
non-finite numbers and lone surrogates are 400s naming the JSON path).

Bodies may be sent ``Content-Encoding: gzip`` or ``zstd``; the size limit
applies to the decompressed bytes too, and decompression stops as soon as it
is passed (a zip bomb costs one limit's worth of memory, then a 413), and
the body is walked by offset with a bound on its members (a body of many
empty members is refused after ``max_body_members``, never copied once per
member). The JSON's values are counted before it is parsed, and a body
of more than ``max_json_values`` is refused unparsed: the parser holds the
interpreter lock throughout, so what it costs every other stream must stay
small whatever thread it runs in. A body must make progress: a pause
longer than ``body_timeout_s`` between two of its pieces is a 408, and a
client that leaves mid-body ends the request as a 499 (as the metrics
count it; nothing failed, so nothing is logged). Decoding a large body runs in a small pool of its own
(``decode_off_loop``; WebSocket messages use it too): the event loop only
reads the bytes, and slow bodies wait for each other, never for the default
executor's other work. So does decoding the request a large body holds
(``decoded``); a small one's is decoded on the loop, as its JSON was. The
bytes of every body being received or decoded count against one bound for
the process (``max_bodies_in_flight_bytes``), so that slow bodies on many
connections cannot hold the memory of all of them at once.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from starlette.requests import Request

from lmspd.core.errors import ApiError
from lmspd.core.limits import BODY_DECODE_WORKERS, RequestLimits
from lmspd.core.strict_json import count_values, decode_json, json_path, value_bound

__all__ = ["INLINE_BYTES", "JsonBody", "content_encodings", "decode_body", "decode_json", "decode_off_loop", "decoded",
           "json_path", "parse_json_object", "read_json_body", "read_json_object"]

# Bodies up to this size are parsed on the event loop, and the requests they
# hold decoded there (a thread hop costs more than either); larger ones in
# a worker thread.
INLINE_BYTES = 64 * 1024
_ENCODINGS = ("gzip", "x-gzip", "zstd", "identity")
_T = TypeVar("_T")
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


async def decode_off_loop(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` in the decoding pool (``BODY_DECODE_WORKERS`` threads,
    shared by every app in the process)."""
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(BODY_DECODE_WORKERS, thread_name_prefix="lmspd-decode")
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(fn, *args))


class _BodiesInFlight:
    """The bytes of bodies received and not yet decoded, over every app in
    the process (tests run several, each on its own thread's loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0

    def take(self, n: int, limit: int) -> bool:
        with self._lock:
            if self.bytes + n > limit:
                return False
            self.bytes += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.bytes -= n


IN_FLIGHT = _BodiesInFlight()


class _Held:
    """What one body holds of ``IN_FLIGHT``: given back whatever ends it."""

    def __init__(self, limits: RequestLimits) -> None:
        self._limits = limits
        self.bytes = 0

    def add(self, n: int) -> None:
        limit = self._limits.max_bodies_in_flight_bytes
        if not IN_FLIGHT.take(n, limit):
            raise ApiError("server_overloaded", f"Request bodies being received take the server's bound "
                           f"({limit // (1024 * 1024)} MiB together); retry shortly.",
                           headers={"Retry-After": "1", "Connection": "close"})
        self.bytes += n

    def release(self) -> None:
        IN_FLIGHT.give(self.bytes)
        self.bytes = 0


@dataclass(frozen=True)
class JsonBody:
    """A request body's JSON object; ``small``: it was sent uncompressed
    and within ``INLINE_BYTES``, so the event loop parsed it and may decode
    the request it holds (``decoded``)."""

    value: dict[str, Any]
    small: bool


async def decoded(body: JsonBody, decode: Callable[[dict[str, Any]], _T]) -> _T:
    """``decode(body.value)``: on the event loop for a small body, else in
    the decoding pool (work proportional to the body never runs on the loop)."""
    if body.small:
        return decode(body.value)
    return await decode_off_loop(decode, body.value)


async def read_json_object(request: Request, limits: RequestLimits) -> dict[str, Any]:
    return (await read_json_body(request, limits)).value


async def read_json_body(request: Request, limits: RequestLimits) -> JsonBody:
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise ApiError(
            "unsupported_media_type",
            f"Content-Type must be application/json, not {media or 'missing'!r}.",
        )
    # Each header line of it, in order: two lines are one list (RFC 9110 §5.3).
    encodings = content_encodings(", ".join(request.headers.getlist("content-encoding")), limits)
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limits.max_body_bytes:
                raise _too_large(limits)
        except ValueError:
            raise ApiError("invalid_request", "Content-Length is not a number.") from None
    held = _Held(limits)
    try:
        raw = await _read_bytes(request, limits, held)
        if not encodings and len(raw) <= INLINE_BYTES:
            return JsonBody(decode_body(raw, encodings, limits), small=True)
        return JsonBody(await decode_off_loop(decode_body, raw, encodings, limits), small=False)
    finally:
        held.release()


async def _read_bytes(request: Request, limits: RequestLimits, held: _Held) -> bytes:
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        try:
            async with asyncio.timeout(limits.body_timeout_s):
                message = await request.receive()
        except TimeoutError:
            # The rest of the body may never come: the connection goes too.
            raise ApiError("request_timeout", f"The request body stopped arriving: nothing came for "
                           f"{limits.body_timeout_s:g} s.", headers={"Connection": "close"}) from None
        if message["type"] == "http.disconnect":
            # The client left: nobody reads the reply, and nothing failed here.
            raise ApiError("client_closed_request", "The client closed the connection during its request body.",
                           status=499)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise _too_large(limits)
        held.add(len(chunk))
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


def content_encodings(header: str, limits: RequestLimits) -> list[str]:
    """The codings applied to the body, in the order they were applied."""
    codings = [c.strip().lower() for c in header.split(",") if c.strip()]
    for coding in codings:
        if coding not in _ENCODINGS:
            raise ApiError("unsupported_media_type",
                           f"Content-Encoding {coding!r} is not supported; send gzip, zstd or identity.",
                           headers={"Accept-Encoding": "gzip, zstd"})
    applied = [c for c in codings if c != "identity"]
    if len(applied) > limits.max_body_codings:
        # Refused before a byte is read: each layer may inflate to the body limit.
        raise ApiError("unsupported_media_type",
                       f"Content-Encoding lists {len(applied)} codings; the limit is {limits.max_body_codings}.",
                       headers={"Accept-Encoding": "gzip, zstd"})
    return applied


def decode_body(raw: bytes, encodings: list[str], limits: RequestLimits) -> dict[str, Any]:
    for coding in reversed(encodings):
        raw = _decompress(raw, coding, limits)
    _check_values(raw, limits, "body")
    data = decode_json(raw, max_depth=limits.max_json_depth)
    if not isinstance(data, dict):
        raise ApiError("invalid_json", "The JSON body must be an object.")
    return data


# -- decompression ---------------------------------------------------------------

# Compressed input is fed to a decoder this much at a time: what a decoder
# copies at the end of a member (its ``unused_data``) is at most this, not
# the rest of the body, so a body of many tiny members costs linear time.
_FEED_BYTES = 64 * 1024
# zstd's decoder has no output bound (see _unzstd): 128 blocks of 128 KiB at most.
_ZSTD_FEED_BYTES = 512


def _decompress(raw: bytes, coding: str, limits: RequestLimits) -> bytes:
    limit = limits.max_body_bytes
    try:
        if coding in ("gzip", "x-gzip"):
            out = _gunzip(raw, limit, limits.max_body_members)
        else:
            out = _unzstd(raw, limit, limits.max_body_members)
    except ApiError:
        raise
    except Exception as exc:  # zlib.error, zstd.ZstdError: the client's bytes are bad
        raise ApiError("invalid_request", f"The body is not valid {coding} data: {exc}") from None
    return out


def _gunzip(raw: bytes, limit: int, max_members: int) -> bytes:
    out = bytearray()
    view = memoryview(raw)
    pos = 0
    members = 0
    while pos < len(view):
        # One gzip member at a time (RFC 1952 allows several in a row).
        members += 1
        if members > max_members:
            raise _too_many("gzip members", max_members)
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        while not inflater.eof:
            if pos >= len(view):
                raise ApiError("invalid_request", "The body is not valid gzip data: it ends early.")
            piece = view[pos:pos + _FEED_BYTES]
            out += inflater.decompress(piece, limit + 1 - len(out))
            if len(out) > limit:
                raise _too_large_decoded(limit)
            pos += len(piece) - len(inflater.unconsumed_tail) - len(inflater.unused_data)
    return bytes(out)


def _unzstd(raw: bytes, limit: int, max_frames: int) -> bytes:
    import zstandard

    # A zstd decoder takes no output bound, and one block of three bytes
    # may stand for 128 KiB: fed a small piece at a time, the output of one
    # call stays small (a few MiB) and the limit is checked after each.
    view = memoryview(raw)
    out = bytearray()
    pos = 0
    frames = 0
    decompressor = zstandard.ZstdDecompressor()
    while pos < len(view):
        frames += 1
        if frames > max_frames:
            raise _too_many("zstd frames", max_frames)
        frame = decompressor.decompressobj()
        while not frame.eof:
            if pos >= len(view):
                raise ApiError("invalid_request", "The body is not valid zstd data: it ends early.")
            piece = view[pos:pos + _ZSTD_FEED_BYTES]
            out += frame.decompress(piece)
            if len(out) > limit:
                raise _too_large_decoded(limit)
            pos += len(piece) - len(frame.unused_data)
    return bytes(out)


def _check_values(raw: bytes | str, limits: RequestLimits, what: str) -> None:
    """Refuses JSON of more than ``max_json_values`` values before it is
    parsed. Nearly every body passes on the bound alone (three counts at
    memory speed); only one whose strings are full of commas and brackets,
    source code say, is counted exactly, outside its strings."""
    limit = limits.max_json_values
    if value_bound(raw) <= limit:
        return
    text = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    if count_values(text, limit) > limit:
        raise ApiError("request_too_large", f"The JSON {what} holds more than {limit} values (each object, array, "
                       f"string, number, true, false and null is one); the limit is {limit} (max_json_values).")


def _too_many(what: str, limit: int) -> ApiError:
    return ApiError("invalid_request", f"The body has more than {limit} {what}; send it as one.")


def _too_large(limits: RequestLimits) -> ApiError:
    return ApiError("request_too_large", f"The request body exceeds {limits.max_body_bytes} bytes.")


def _too_large_decoded(limit: int) -> ApiError:
    return ApiError("request_too_large", f"The decompressed request body exceeds {limit} bytes.")


def parse_json_object(raw: str | bytes, limits: RequestLimits) -> dict[str, Any]:
    """A JSON object that arrived other than as an HTTP body (a WebSocket
    text frame): the same size bound and the same strict decoder (duplicate
    keys, non-finite numbers, lone surrogates, depth) as a body, the same
    errors."""
    if len(raw) > limits.max_body_bytes:
        raise ApiError("request_too_large", f"The message exceeds {limits.max_body_bytes} bytes.")
    _check_values(raw, limits, "message")
    data = decode_json(raw, max_depth=limits.max_json_depth)
    if not isinstance(data, dict):
        raise ApiError("invalid_json", "The message must be a JSON object.")
    return data
