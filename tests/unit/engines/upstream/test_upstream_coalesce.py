"""The stream writer that joins back-to-back SSE chunks into one write, and
the service's early open of an upstream request."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from lmspd.core.conversation import Conversation, Message
from lmspd.core.errors import ApiError
from lmspd.core.events import Finished, TextDelta
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.engines.base import CancelToken, ModelInfo
from lmspd.service import Service
from lmspd.streaming.coalesce import CoalescingMiddleware


def body(data: bytes, more: bool = True) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


async def run_app(app_body, **options) -> list[dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope, receive, send_):
        await send_({"type": "http.response.start", "status": 200, "headers": []})
        await app_body(send_)
        await send_(body(b"", more=False))

    await CoalescingMiddleware(app, **options)({"type": "http"}, None, send)
    return sent


def bodies(sent: list[dict]) -> list[bytes]:
    return [m["body"] for m in sent if m["type"] == "http.response.body"]


def test_a_burst_becomes_one_write_and_order_is_kept():
    async def burst(send):
        for i in range(50):
            await send(body(b"%d," % i))

    sent = asyncio.run(run_app(burst, max_delay_s=10))
    assert sent[0]["type"] == "http.response.start"
    assert bodies(sent) == [b"".join(b"%d," % i for i in range(50)), b""]


def test_chunks_separated_by_a_pause_are_written_as_they_come():
    async def paced(send):
        for i in range(3):
            await send(body(b"%d" % i))
            await asyncio.sleep(0.01)

    sent = asyncio.run(run_app(paced, max_delay_s=10))
    assert bodies(sent) == [b"0", b"1", b"2", b""]


def test_a_long_burst_is_cut_by_size_and_by_time():
    async def big(send):
        for _ in range(10):
            await send(body(b"x" * 100))

    assert bodies(asyncio.run(run_app(big, max_bytes=300, max_delay_s=10)))[:3] == [b"x" * 300] * 3

    async def slow(send):
        for _ in range(3):
            await send(body(b"y"))
            for _ in range(200_000):  # busy, no yield: only the clock can cut
                pass

    assert len(bodies(asyncio.run(run_app(slow, max_delay_s=0.0)))) >= 3


def test_a_failed_write_reaches_the_handler():
    async def send(message):
        if message["type"] == "http.response.body" and message["body"]:
            raise OSError("client gone")

    async def app(scope, receive, send_):
        await send_({"type": "http.response.start", "status": 200, "headers": []})
        await send_(body(b"a"))
        await asyncio.sleep(0)  # the background write fails here
        await send_(body(b"b"))

    with pytest.raises(OSError):
        asyncio.run(CoalescingMiddleware(app)({"type": "http"}, None, send))


def test_other_scopes_pass_through():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    asyncio.run(CoalescingMiddleware(app)({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]


# -- Run: early open ---------------------------------------------------------------


class OpeningEngine:
    """Records the order of open, start events and generation."""

    def __init__(self, refuse: ApiError | None = None) -> None:
        self.info = ModelInfo(id="m", context_window=100, capabilities={"streaming": True}, max_concurrency=2)
        self.log: list[str] = []
        self.refuse = refuse

    def announce(self, conversation):
        return contextlib.nullcontext()

    def prepare(self, conversation, run=None):
        class P:
            input_tokens = 1
            response_id = None

        return P()

    opens_first = True

    async def open(self, prepared, cancel: CancelToken) -> None:
        self.log.append("open")
        if self.refuse:
            raise self.refuse

    async def discard(self, prepared) -> None:
        self.log.append("discard")

    async def generate(self, prepared, cancel, response_id=None):
        self.log.append("generate")
        yield TextDelta("hi")
        yield Finished("stop")

    async def aclose(self):
        pass


def events_of(engine: OpeningEngine) -> list[str]:
    from lmspd.dialects.openai_responses import OpenAIEncoder
    from lmspd.streaming.session import ResponseState, StreamSession

    async def go():
        service = Service(DEFAULT_LIMITS)
        service.add_engine(engine)
        run = await service.begin(Conversation(model="m", items=[Message(role="user", text="x")]))
        session = StreamSession(ResponseState(id="resp_1", model="m"), OpenAIEncoder())
        names = []
        async for _, name, _ in run.events(session):
            if name == "response.created":
                engine.log.append("created")
            names.append(name)
        assert service.models["m"].queue.running == 0
        return names

    return asyncio.run(go())


def test_the_upstream_request_goes_out_before_the_first_event():
    engine = OpeningEngine()
    names = events_of(engine)
    assert engine.log == ["open", "created", "generate"]
    assert names[0] == "response.created" and names[-1] == "response.completed"


def test_an_early_refusal_is_one_well_formed_failure():
    engine = OpeningEngine(refuse=ApiError("upstream_http_error", "The upstream provider returned HTTP 500."))
    names = events_of(engine)
    assert names == ["response.created", "response.in_progress", "response.failed"]
    assert engine.log == ["open", "created"]
