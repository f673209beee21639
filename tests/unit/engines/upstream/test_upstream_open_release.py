"""A provider request ``Run.open`` sent before the turn's events is given
back on every path where no generation takes it: the events dropped at
``response.created`` or before their first step, the run dropped without
its events ever read, an error inside ``open`` after the request went out,
a WebSocket turn cancelled while its outbox is full. The provider sees the
disconnect, the endpoint's in-flight count and the queue slot come back."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from pathlib import Path

import pytest
from starlette.websockets import WebSocketState

from lmspd.core.conversation import Conversation, Message
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.dialects.registry import OPENAI
from lmspd.engines.upstream.engine import UpstreamEngine, UpstreamSpec
from lmspd.routes import websocket
from lmspd.routes.websocket import Connection
from lmspd.service import Service
from lmspd.streaming.session import ResponseState, StreamSession
from support.inprocess import make_app
from support.provider import Reply, text_chunk

# The provider keeps streaming for far longer than any test takes.
TICKS = [text_chunk("tick")] * 400


@pytest.fixture(autouse=True)
def _clean(provider):
    provider.clear()


def engine(url: str) -> UpstreamEngine:
    return UpstreamEngine(UpstreamSpec(served_model="up", upstream_model="m", urls=[url]))


def session() -> StreamSession:
    return StreamSession(ResponseState(id="resp_1", model="up", status="in_progress", created_at=1), OPENAI.encoder())


async def opened(eng: UpstreamEngine) -> tuple[Service, object]:
    service = Service(DEFAULT_LIMITS)
    service.add_engine(eng)
    run = await service.begin(Conversation(model="up", items=[Message(role="user", text="hi")]))
    await run.open()  # as the routes do for an engine that opens first
    assert eng.pool.endpoints[0].outstanding == 1
    return service, run


def given_back(eng: UpstreamEngine, service: Service) -> tuple[int, int]:
    return eng.pool.endpoints[0].outstanding, service.models["up"].queue.running


@pytest.mark.parametrize("taken", [0, 1], ids=["no-event-taken", "response.created-taken"])
def test_events_closed_before_the_generation_starts_close_the_provider_request(provider, taken):
    (reply,) = provider.push(Reply(parts=TICKS, pace_s=0.05))

    async def go():
        eng = engine(provider.url)
        try:
            service, run = await opened(eng)
            events = run.events(session())
            names = [(await events.__anext__())[1] for _ in range(taken)]
            await events.aclose()
            return names, given_back(eng, service)
        finally:
            await eng.aclose()

    names, (outstanding, running) = asyncio.run(go())
    assert names == ["response.created"][:taken]
    assert (outstanding, running) == (0, 0)
    assert reply.disconnected.wait(5), "the provider must see the request closed"


def test_a_consumer_cancelled_at_response_created_closes_the_provider_request(provider):
    """The WebSocket case at the Run's level: the consumer took
    ``response.created`` and is cancelled while it waits to deliver it."""
    (reply,) = provider.push(Reply(parts=TICKS, pace_s=0.05))

    async def go():
        eng = engine(provider.url)
        try:
            service, run = await opened(eng)
            took = asyncio.Event()

            async def consume():
                async with contextlib.aclosing(run.events(session())) as events:
                    async for _ in events:
                        took.set()
                        await asyncio.Event().wait()  # a full outbox

            task = asyncio.create_task(consume())
            await took.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return given_back(eng, service)
        finally:
            await eng.aclose()

    assert asyncio.run(go()) == (0, 0)
    assert reply.disconnected.wait(5)


def test_a_run_dropped_after_open_without_reading_its_events_gives_back_what_it_held(provider):
    (reply,) = provider.push(Reply(parts=TICKS, pace_s=0.05))

    async def go():
        eng = engine(provider.url)
        try:
            service, run = await opened(eng)
            events = run.events(session())  # never iterated: nothing of it ever runs
            del events, run
            gc.collect()
            for _ in range(3):  # the give-back runs on the loop
                await asyncio.sleep(0)
            return given_back(eng, service)
        finally:
            await eng.aclose()

    assert asyncio.run(go()) == (0, 0)
    assert reply.disconnected.wait(5)


def test_an_error_in_open_after_the_request_went_out_closes_it(provider, monkeypatch):
    (reply,) = provider.push(Reply(parts=TICKS, pace_s=0.05))

    async def go():
        eng = engine(provider.url)

        def broken(*args, **kwargs):
            raise RuntimeError("routing bookkeeping failed")

        monkeypatch.setattr(eng.router, "served", broken)
        service = Service(DEFAULT_LIMITS)
        service.add_engine(eng)
        try:
            run = await service.begin(Conversation(model="up", items=[Message(role="user", text="hi")]))
            with pytest.raises(RuntimeError):
                await run.open()
            return given_back(eng, service)
        finally:
            await eng.aclose()

    assert asyncio.run(go()) == (0, 0)
    assert reply.disconnected.wait(5)


def test_a_finished_generation_is_not_given_back_twice(provider):
    """After generate took the request and ended cleanly, the run's
    give-back finds nothing: the count comes back once, not twice."""
    provider.push(Reply(parts=[text_chunk("hi"), b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
                               b"data: [DONE]\n\n"]))

    async def go():
        eng = engine(provider.url)
        try:
            service, run = await opened(eng)
            names = [name async for _, name, _ in run.events(session())]
            await asyncio.sleep(0.1)  # the clean end's drain
            return names, given_back(eng, service), eng.stats()["outcomes"]
        finally:
            await eng.aclose()

    names, counts, outcomes = asyncio.run(go())
    assert names[-1] == "response.completed"
    assert counts == (0, 0) and outcomes == {"stop": 1}


class StuckSocket:
    """A client that stopped reading: the first frame's write never returns."""

    def __init__(self) -> None:
        self.client_state = WebSocketState.CONNECTED
        self.headers: dict[str, str] = {}
        self.incoming: asyncio.Queue = asyncio.Queue()

    async def receive(self) -> dict:
        return await self.incoming.get()

    async def send_text(self, text: str) -> None:
        await asyncio.Event().wait()

    async def close(self, code: int = 1000) -> None:
        self.client_state = WebSocketState.DISCONNECTED


def test_a_websocket_turn_cancelled_with_a_full_outbox_closes_its_provider_request(provider, tmp_path: Path):
    (reply,) = provider.push(Reply(parts=TICKS, pace_s=0.05))
    eng = engine(provider.url)
    app, _ = make_app(tmp_path, engine=eng)

    async def go():
        ws = StuckSocket()
        conn = Connection(app.state.lmspd, "local", ws)  # type: ignore[arg-type]
        serving = asyncio.create_task(conn.serve())
        try:
            # One frame stuck in the write, the outbox full behind it.
            for _ in range(websocket._OUTBOX_FRAMES + 1):
                ws.incoming.put_nowait({"type": "websocket.receive", "text": json.dumps({"type": "nope"})})
            ws.incoming.put_nowait({"type": "websocket.receive", "text": json.dumps(
                {"type": "response.create", "model": "up", "input": "hi", "store": False})})
            async with asyncio.timeout(10):
                while not (eng.pool.endpoints[0].outstanding == 1 and conn._turn is not None):
                    await asyncio.sleep(0.01)
                # The turn waits to queue response.created.
                while not conn._frames.full() or conn._turn.done():
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert not conn._turn.done()
            ws.incoming.put_nowait({"type": "websocket.disconnect"})
            await asyncio.wait_for(serving, 10)
            return given_back(eng, app.state.lmspd.service)
        finally:
            serving.cancel()
            with contextlib.suppress(BaseException):
                await serving
            await eng.aclose()

    assert asyncio.run(go()) == (0, 0)
    assert reply.disconnected.wait(5)
