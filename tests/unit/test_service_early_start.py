"""Run.events asks the engine for the generation before it hands out
``response.created`` when the model has room: the embedded engine submits
the job at that call, so the prompt evaluates while the first events are
encoded and written (issue 30: the time before the first token). A queued
run still asks only once admitted, and a run whose consumer leaves before
reading the generation cancels it. Scripted engine."""

from __future__ import annotations

import asyncio

from lmspd.core.conversation import Conversation, Message
from lmspd.core.errors import ApiError
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.dialects.registry import OPENAI
from lmspd.service import Service
from lmspd.streaming.session import ResponseState, StreamSession
from support.inprocess import MODEL, ScriptedEngine


class Recording(ScriptedEngine):
    """Logs when a generation is asked for, and keeps its cancel token."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.log: list[str] = []
        self.tokens = []

    def generate(self, prepared, cancel, response_id=None):
        self.log.append(f"generate {response_id}")
        self.tokens.append(cancel)
        return super().generate(prepared, cancel, response_id)


def conversation() -> Conversation:
    return Conversation(model=MODEL, items=[Message("user", "hi")])


def session(rid: str) -> StreamSession:
    return StreamSession(ResponseState(id=rid, model=MODEL, created_at=1), OPENAI.encoder())


def test_a_run_with_room_asks_for_its_generation_before_response_created() -> None:
    engine = Recording(words=("a", "b"))
    service = Service(DEFAULT_LIMITS)
    service.add_engine(engine)

    async def go() -> list[str]:
        run = await service.begin(conversation())
        events = run.events(session("resp_1"))
        first = await events.__anext__()
        assert first[1] == "response.created"
        assert engine.log == ["generate resp_1"], "the prompt runs while response.created goes out"
        names = [first[1]] + [name async for _, name, _ in events]
        return names

    names = asyncio.run(go())
    assert names[-1] == "response.completed" and names.count("response.output_text.delta") == 2
    assert not engine.tokens[0].cancelled, "read to its end: nothing to cancel"


def test_a_queued_run_asks_for_its_generation_only_once_admitted() -> None:
    engine = Recording(words=("a",), delay_s=0.05)  # one generation at a time
    service = Service(DEFAULT_LIMITS)
    service.add_engine(engine)

    async def go() -> None:
        first = await service.begin(conversation())
        second = await service.begin(conversation())
        assert not second.ticket.ready
        one = first.events(session("resp_1"))
        two = second.events(session("resp_2"))
        assert (await one.__anext__())[1] == "response.created"
        assert (await two.__anext__())[1] == "response.created"
        assert engine.log == ["generate resp_1"], "the queued run waits for its turn"
        [_ async for _ in one]
        [_ async for _ in two]
        assert engine.log == ["generate resp_1", "generate resp_2"]

    asyncio.run(go())


def test_a_consumer_gone_before_the_generation_is_read_cancels_it() -> None:
    engine = Recording(words=("a",) * 50, delay_s=0.01)
    service = Service(DEFAULT_LIMITS)
    service.add_engine(engine)

    async def go() -> None:
        run = await service.begin(conversation())
        events = run.events(session("resp_1"))
        assert (await events.__anext__())[1] == "response.created"
        await events.aclose()
        assert engine.tokens[0].cancelled, "asked for but never read: the engine must stop it"
        assert run.ticket._released, "and its place in the queue is free"

    asyncio.run(go())


def test_an_engine_refusing_at_the_call_still_gets_a_stream_that_starts_with_response_created() -> None:
    class Refusing(ScriptedEngine):
        def generate(self, prepared, cancel, response_id=None):
            raise ApiError("server_overloaded", "No room after all.")

    service = Service(DEFAULT_LIMITS)
    service.add_engine(Refusing())

    async def go() -> list[str]:
        run = await service.begin(conversation())
        return [name async for _, name, _ in run.events(session("resp_1"))]

    names = asyncio.run(go())
    assert names[0] == "response.created" and names[-1] == "response.failed", names


def test_a_run_dropped_before_its_events_start_gives_back_its_queue_slot() -> None:
    """A client gone before its stream's first byte (Starlette never starts
    the body's generator when the disconnect is already there): the run's
    events never start, so no ``finally`` of theirs runs. The queue slot
    came back only if someone iterated them; now the collector gives it back
    (a model with one slot stayed full for good)."""
    import gc

    async def go() -> tuple[int, int, str]:
        service = Service(DEFAULT_LIMITS)
        service.add_engine(ScriptedEngine(max_concurrency=1))
        queue = service.models[MODEL].queue
        run = await service.begin(conversation())
        events = run.events(session("resp_dropped"))  # made, never iterated
        held = queue.running
        del events, run
        gc.collect()
        for _ in range(3):  # the give-back runs on the loop
            await asyncio.sleep(0)
        after = queue.running
        # The slot serves the next request at once.
        nxt = await service.begin(conversation())
        async with asyncio.timeout(5):
            last = [wire async for wire in nxt.events(session("resp_next"))][-1][1]
        return held, after, last

    assert asyncio.run(go()) == (1, 0, "response.completed")
