"""The lazy model registry with scripted engines: load on first use, 503
while loading, eviction of the least recently used idle model, never past
the budget, never a busy model."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from lmspd.core.conversation import Conversation, Message
from lmspd.core.errors import ApiError
from lmspd.core.events import Finished, TextDelta
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.engines.base import ModelInfo
from lmspd.engines.registry import LOADED, UNLOADED, ModelRegistry
from lmspd.service import Service
from lmspd.streaming.session import ResponseState, StreamSession


class Real:
    closed = 0

    def __init__(self, name: str) -> None:
        self.name = name

    opens_first = False  # the Engine protocol: nothing to reach before generating

    async def open(self, prepared, cancel) -> None:
        return None

    def announce(self, conversation):
        return contextlib.nullcontext()

    def prepare(self, conversation, run=None):
        class P:
            input_tokens = 1
            response_id = None

        return P()

    async def generate(self, prepared, cancel, response_id=None):
        yield TextDelta(self.name)
        yield Finished("stop")

    # Set by a test: count_tokens waits for it (a count in flight).
    counting: threading.Event | None = None
    counted = threading.Event()

    def count_tokens(self, conversation):
        Real.counted.set()
        if Real.counting is not None:
            assert Real.counting.wait(5)
        assert not self.closed_here, "counted in a closed model"
        return 7

    closed_here = False

    def stats(self):
        return {"generations": 1}

    async def aclose(self):
        Real.closed += 1
        self.closed_here = True


def conv(model: str) -> Conversation:
    return Conversation(model=model, items=[Message(role="user", text="x")])


def setup(budget_models: int, names=("a", "b", "c"), gate: threading.Event | None = None):
    registry = ModelRegistry(max_bytes=budget_models * 100)
    service = Service(DEFAULT_LIMITS)

    def build(name):
        def make():
            if gate is not None:
                gate.wait(5)
            return Real(name)
        return make

    for name in names:
        service.add_engine(registry.add(ModelInfo(id=name, context_window=10, capabilities={"streaming": True}),
                                        build(name), 100))
    registry.bind(service)
    return registry, service


async def until_loaded(service, name, registry):
    for _ in range(500):
        try:
            return await service.begin(conv(name))
        except ApiError as exc:
            assert exc.code == "model_loading" and exc.status == 503 and exc.headers["Retry-After"]
            assert registry.held_bytes() <= registry.max_bytes
            await asyncio.sleep(0.01)
    raise AssertionError(name + " never loaded")


async def drain(run, name):
    session = StreamSession(ResponseState(id="resp_" + name, model=name), _encoder())
    return [n async for _, n, _ in run.events(session)]


def _encoder():
    from lmspd.dialects.openai_responses import OpenAIEncoder

    return OpenAIEncoder()


def test_models_load_on_first_use_and_evict_the_least_recently_used():
    async def go():
        registry, service = setup(budget_models=2)
        for name in ("a", "b"):
            run = await until_loaded(service, name, registry)
            assert (await drain(run, name))[-1] == "response.completed"
        assert [m.status for m in registry.models.values()] == [LOADED, LOADED, UNLOADED]
        # "a" is the least recently used: "c" takes its room.
        await until_loaded(service, "c", registry)
        await asyncio.sleep(0.05)
        assert {k: m.status for k, m in registry.models.items()} == {"a": UNLOADED, "b": LOADED, "c": LOADED}

    asyncio.run(go())


def test_a_busy_model_is_never_evicted():
    async def go():
        registry, service = setup(budget_models=1, names=("a", "b"))
        held = await until_loaded(service, "a", registry)  # admitted, not yet run: it holds "a"
        with pytest.raises(ApiError) as refused:
            await service.begin(conv("b"))
        assert refused.value.code == "model_loading" and "waiting for memory" in refused.value.message
        assert registry.models["a"].status == LOADED and registry.models["b"].status == UNLOADED
        await drain(held, "a")
        await until_loaded(service, "b", registry)
        assert registry.models["a"].status != LOADED

    asyncio.run(go())


def test_while_loading_every_request_is_refused_with_retry_after():
    gate = threading.Event()

    async def go():
        registry, service = setup(budget_models=1, names=("a",), gate=gate)
        for _ in range(3):
            with pytest.raises(ApiError) as exc:
                await service.begin(conv("a"))
            assert exc.value.status == 503 and "loading" in exc.value.message
        assert registry.models["a"].stats()["state"] == "loading"
        gate.set()
        run = await until_loaded(service, "a", registry)
        assert (await drain(run, "a"))[-1] == "response.completed"

    asyncio.run(go())


def test_a_model_larger_than_the_budget_is_refused_at_start():
    registry = ModelRegistry(max_bytes=50)
    with pytest.raises(ValueError, match="models-max-mem"):
        registry.add(ModelInfo(id="big", context_window=1, capabilities={}), lambda: None, 100)


def test_a_load_that_ends_after_the_server_stopped_is_quiet(monkeypatch):
    """The loop a load reports back to may be closed by then (the server
    stopped while the model loaded): that is no error in the load thread."""
    gate = threading.Event()
    registry, service = setup(budget_models=1, names=("a",), gate=gate)
    failures: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))

    async def ask() -> None:
        with pytest.raises(ApiError):
            await service.begin(conv("a"))  # starts the load: 503 while it runs

    asyncio.run(ask())  # the loop is closed when this returns
    (loader,) = [t for t in threading.enumerate() if t.name == "lmspd-load-a"]
    gate.set()
    loader.join(5)
    assert not loader.is_alive() and failures == []
    assert registry.models["a"].status == LOADED


def test_a_model_is_not_freed_under_a_token_count():
    """Token counts hold no queue slot: the use count keeps the model they
    are in from an idle unload, and an unload that begins anyway (to make
    room) frees the model only once they have ended; meanwhile nothing new
    starts in it."""
    Real.counting = threading.Event()
    Real.counted.clear()

    async def go():
        registry, service = setup(budget_models=1, names=("a",))
        await drain(await until_loaded(service, "a", registry), "a")
        registry.idle_unload_s = 0.0  # idle from now on, but for the count
        model = registry.models["a"]
        count = asyncio.ensure_future(service.count_tokens(conv("a")))
        while not Real.counted.is_set():
            await asyncio.sleep(0.005)
        registry._unload_idle()
        assert model.status == LOADED and model.in_use, "in use: not idle"
        registry.unload(model, reason="to make room")
        with pytest.raises(ApiError) as refused:
            await service.count_tokens(conv("a"))
        assert refused.value.code == "model_loading" and "being unloaded" in refused.value.message
        await asyncio.sleep(0.1)
        engine = model._engine
        assert engine is not None and not engine.closed_here, "freed under the count"
        Real.counting.set()
        assert await count == 7
        for _ in range(100):
            if model.status == UNLOADED:
                break
            await asyncio.sleep(0.01)
        assert model.status == UNLOADED and engine.closed_here
        await service.aclose()

    try:
        asyncio.run(go())
    finally:
        Real.counting = None


def test_closing_the_service_waits_for_a_count_in_flight():
    Real.counting = threading.Event()
    Real.counted.clear()

    async def go():
        registry, service = setup(budget_models=1, names=("a",))
        await drain(await until_loaded(service, "a", registry), "a")
        engine = registry.models["a"]._engine
        count = asyncio.ensure_future(service.count_tokens(conv("a")))
        while not Real.counted.is_set():
            await asyncio.sleep(0.005)
        closing = asyncio.ensure_future(service.aclose())
        await asyncio.sleep(0.1)
        assert not engine.closed_here and not closing.done()
        Real.counting.set()
        assert await count == 7
        await closing
        assert engine.closed_here

    try:
        asyncio.run(go())
    finally:
        Real.counting = None
