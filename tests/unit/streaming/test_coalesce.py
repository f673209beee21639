"""The write coalescer (lmspd.streaming.coalesce): chunks produced back to
back go out as one write, and none is held back once the handler yields."""

from __future__ import annotations

import asyncio
import time

from lmspd.streaming.coalesce import CoalescingMiddleware


def _serve(app, send) -> None:
    asyncio.run(asyncio.wait_for(CoalescingMiddleware(app)({"type": "http"}, None, send), 10))


def _chunk(body: bytes, more: bool = True) -> dict:
    return {"type": "http.response.body", "body": body, "more_body": more}


def test_a_burst_is_one_write() -> None:
    written: list[bytes] = []

    async def send(message):
        if message["type"] == "http.response.body":
            written.append(message["body"])

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for piece in (b"a", b"b", b"c"):
            await send(_chunk(piece))
        await asyncio.sleep(0)
        await send(_chunk(b"", more=False))

    _serve(app, send)
    assert written == [b"abc", b""]


def test_a_chunk_sent_while_a_write_waits_on_a_slow_client_follows_it() -> None:
    # A, written by the coalescer's task, waits 0.1 s for the socket to
    # drain; B arrives meanwhile, then the model is quiet for a while. B
    # goes out right after A, not with the next event.
    written: list[tuple[float, bytes]] = []
    start = time.perf_counter()
    drained = asyncio.Event()

    async def send(message):
        if message["type"] != "http.response.body":
            return
        if message["body"] == b"A":
            await drained.wait()
        written.append((time.perf_counter() - start, message["body"]))

    async def app(scope, receive, send):
        asyncio.get_running_loop().call_later(0.1, drained.set)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send(_chunk(b"A"))
        await asyncio.sleep(0)  # the coalescer's task starts writing A
        await send(_chunk(b"B"))
        await asyncio.sleep(1.0)
        await send(_chunk(b"C"))
        await send(_chunk(b"", more=False))

    _serve(app, send)
    assert [body for _, body in written] == [b"A", b"B", b"C", b""]
    assert written[1][0] < 0.5, written
