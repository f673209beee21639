"""A streaming client that leaves while a write of its stream is paused (a
slow reader's socket full, then gone): the run ends at once and gives back
what it holds. starlette never closes a streaming body, and the client's
leaving cancelled the response task in the write, outside the event
generators, which stayed suspended with their run (queue slot, generation)
until the garbage collector happened to find them."""

from __future__ import annotations

import asyncio
import gc
import json

import pytest

from lmspd.streaming.coalesce import CoalescingMiddleware
from support.engine import MODEL, ScriptedEngine
from support.inprocess import make_app

BODIES = {
    "/v1/responses": {"model": MODEL, "input": "hi", "stream": True, "store": False},
    "/lmsp/v1/responses": {"model": MODEL, "input": "hi", "stream": True, "store": False},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    "/v1/messages": {"model": MODEL, "max_tokens": 500, "messages": [{"role": "user", "content": "hi"}],
                     "stream": True},
}


@pytest.mark.parametrize("key", [None, b"once"], ids=["", "idempotency-key"])
@pytest.mark.parametrize("path", list(BODIES))
def test_a_client_gone_during_a_paused_write_ends_its_run_at_once(tmp_path, path, key):
    async def go() -> int:
        engine = ScriptedEngine(tuple(f"w{i} " for i in range(400)), delay_s=0.01)
        built, _ = make_app(tmp_path, engine=engine)
        app = CoalescingMiddleware(built)
        body = json.dumps(BODIES[path]).encode()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": [(b"content-type", b"application/json"), (b"host", b"127.0.0.1"),
                             (b"anthropic-version", b"2023-06-01"),
                             *([(b"idempotency-key", key)] if key else [])],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8080), "root_path": "", "state": {}}
        asked = False
        gone = asyncio.Event()
        writes = 0

        async def receive() -> dict:
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            nonlocal writes
            if message["type"] == "http.response.body":
                writes += 1
                if writes == 3:
                    # This write is paused (the client reads nothing), and
                    # the client goes away meanwhile: uvicorn then resumes
                    # the write, which returns, and the disconnect cancels.
                    asyncio.get_running_loop().call_later(0.05, gone.set)
                    await gone.wait()
                    await asyncio.sleep(0.01)

        service = built.state.lmspd.service
        await asyncio.wait_for(app(scope, receive, send), 10)
        for _ in range(20):
            if not service._active:
                break
            await asyncio.sleep(0.05)
        return len(service._active)

    gc.disable()  # what is tested is the close, not the collector's luck
    try:
        assert asyncio.run(go()) == 0
    finally:
        gc.enable()
