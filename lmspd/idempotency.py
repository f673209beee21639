"""``Idempotency-Key`` on POSTs: executed at most once per key and credential.

The first request with a key owns it until its reply is complete; then the
reply (status, body, the headers that describe it) is kept and every retry
with the same request gets it back, across restarts, until the key expires.
A retry while the first still runs gets 409 with Retry-After; the same key
with another request gets 422. A failed attempt (any error reply) releases
the key, so a retry runs again.

A reply that follows a background task's events is not kept as bytes (the
task may still be running): the key remembers the task, and a retry follows
its events again from the start.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from lmspd.core.errors import ApiError, invalid
from lmspd.core.limits import MAX_IDEMPOTENCY_KEY_CHARS
from lmspd.store.base import BeginOutcome, IdempotencyBegin, Store
from lmspd.store.calls import StoreCalls

log = logging.getLogger("lmspd.idempotency")

HEADER = "Idempotency-Key"
REPLAYED = "Idempotent-Replayed"
# Stored with a reply, never sent: the task whose events a retry follows.
FOLLOW = "x-lmspd-follow-task"
# Headers of the first reply a replay repeats (the rest are per-connection).
_KEPT_HEADERS = ("content-type", "lmsp-version", "location")
RETRY_AFTER_S = 1


def request_hash(request: Request, body: dict[str, Any]) -> str:
    # The path is part of the request: one key on two endpoints is a conflict.
    digest = hashlib.sha256(f"{request.method} {request.url.path}\n".encode())
    _feed_canonical(digest, body)
    return digest.hexdigest()


_scalar = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _feed_canonical(digest: Any, value: Any) -> None:
    """The bytes of ``json.dumps(value, sort_keys=True, separators=(",", ":"),
    ensure_ascii=False)``, fed to ``digest`` one value at a time: one call
    that encodes an 8 MiB body holds the interpreter lock (and so the event
    loop) for its whole length; this holds it for one string at most."""
    if isinstance(value, dict):
        digest.update(b"{")
        for i, key in enumerate(sorted(value)):
            digest.update(("," if i else "").encode() + _scalar(key).encode() + b":")
            _feed_canonical(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, list):
        digest.update(b"[")
        for i, item in enumerate(value):
            if i:
                digest.update(b",")
            _feed_canonical(digest, item)
        digest.update(b"]")
    else:
        digest.update(_scalar(value).encode())


@dataclass
class Attempt:
    """One request holding (or replaying) an idempotency key."""

    store: Store
    calls: StoreCalls
    owner: str
    key: str
    replay: IdempotencyBegin | None = None

    @property
    def follow_task(self) -> str | None:
        return (self.replay.headers or {}).get(FOLLOW) if self.replay is not None else None

    def replayed(self) -> Response:
        assert self.replay is not None
        headers = {k: v for k, v in (self.replay.headers or {}).items() if k != FOLLOW}
        headers[REPLAYED] = "true"
        media = headers.pop("content-type", None)
        return Response(self.replay.body or b"", status_code=self.replay.status_code or 200, headers=headers,
                        media_type=media)

    async def abandon(self) -> None:
        """Release the key, so that a retry runs again. If the store cannot
        (a full disk), the reply that failed still goes out as it is; the
        key stays in progress until the next start releases it or it expires."""
        try:
            await self.calls(self.store.idempotency_abandon, self.owner, self.key)
        except Exception:
            log.exception("could not release %s %r", HEADER, self.key)

    async def seal(self, response: Response, follow_task: str | None = None) -> Response:
        """Keep ``response`` as this key's reply (a stream: once it has been
        sent whole), or release the key if it is not a success."""
        if response.status_code >= 400:
            await self.abandon()
            return response
        headers = {k: v for k, v in response.headers.items() if k in _KEPT_HEADERS}
        if follow_task is not None:
            await self._finish(response.status_code, b"", {**headers, FOLLOW: follow_task})
            return response
        if isinstance(response, StreamingResponse):
            response.body_iterator = self._recorded(response.body_iterator, response.status_code, headers)
            return response
        await self._finish(response.status_code, bytes(response.body), headers)
        return response

    async def _finish(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        """Keep the reply; if the store cannot, the work is done all the same
        (and stored where it was asked to be): the reply still goes out, and
        the key is released so that a retry is not refused with 409 for a day."""
        try:
            await self.calls(self.store.idempotency_finish, self.owner, self.key, status, body, headers)
        except Exception:
            log.exception("could not keep the reply of %s %r; releasing the key", HEADER, self.key)
            await self.abandon()

    async def _recorded(self, chunks: AsyncIterable[Any], status: int, headers: dict[str, str]) -> AsyncIterator[bytes]:
        sent: list[bytes] = []
        complete = False
        try:
            async for chunk in chunks:
                data = chunk if isinstance(chunk, bytes) else str(chunk).encode()
                sent.append(data)
                yield data
            complete = True
        finally:
            close = getattr(chunks, "aclose", None)
            if not complete and close is not None:
                # Closed with this one (a client gone mid-stream): the stream
                # it wraps gives back its run now, not when collected.
                await close()
            # A stream the client left half-way was not a reply: release the key.
            if complete:
                await self._finish(status, b"".join(sent), headers)
            else:
                await self.abandon()


@dataclass
class Reply:
    """What a guarded handler produced: its response and, when that response
    follows a background task's events, the task (a retry follows it too)."""

    response: Response
    follow_task: str | None = None


async def once(store: Store, calls: StoreCalls, owner: str, request: Request, body: dict[str, Any],
               work: Callable[[], Awaitable[Reply]],
               follow: Callable[[str], Awaitable[Response]] | None = None) -> Response:
    """Run ``work`` unless this key already has a reply; ``follow(task_id)``
    replays a reply that followed a task."""
    attempt = await begin(store, calls, owner, request, body)
    if attempt is not None and attempt.replay is not None:
        if attempt.follow_task is None or follow is None:
            return attempt.replayed()
        reply = await follow(attempt.follow_task)
        # The first reply's own headers (Location: where the task is).
        for name, value in (attempt.replay.headers or {}).items():
            if name not in (FOLLOW, "content-type"):
                reply.headers[name] = value
        reply.headers[REPLAYED] = "true"
        return reply
    try:
        done = await work()
    except BaseException:
        if attempt is not None:
            await attempt.abandon()
        raise
    if attempt is None:
        return done.response
    return await attempt.seal(done.response, done.follow_task)


async def begin(store: Store, calls: StoreCalls, owner: str, request: Request,
                body: dict[str, Any]) -> Attempt | None:
    """``None`` without the header; raises 409/422 for a key in use."""
    key = request.headers.get(HEADER)
    if key is None:
        return None
    if not key or len(key) > MAX_IDEMPOTENCY_KEY_CHARS or not key.isascii() or not key.isprintable():
        raise invalid(f"{HEADER} must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII characters.", HEADER)
    # Hashing an 8 MiB body and claiming the key: off the event loop.
    digest = await calls(request_hash, request, body)
    try:
        outcome = await calls(store.idempotency_begin, owner, key, digest)
    except ApiError:
        raise
    except Exception:
        # Nothing ran: the request cannot be guarded, so it is not run either.
        log.exception("could not record %s %r", HEADER, key)
        raise ApiError("store_unavailable", f"{HEADER} {key!r} could not be recorded, so the request was not run; "
                       "retry once the server's storage recovers.", headers={"Retry-After": "5"}) from None
    if outcome.outcome is BeginOutcome.CONFLICT:
        raise ApiError("idempotency_conflict",
                       f"{HEADER} {key!r} was already used with a different request; use a new key for a new "
                       "request.", param=HEADER)
    if outcome.outcome is BeginOutcome.IN_PROGRESS:
        raise ApiError("idempotency_in_progress",
                       f"A request with {HEADER} {key!r} is still running; retry once it has finished.",
                       param=HEADER, headers={"Retry-After": str(RETRY_AFTER_S)})
    return Attempt(store, calls, owner, key, outcome if outcome.outcome is BeginOutcome.REPLAY else None)
