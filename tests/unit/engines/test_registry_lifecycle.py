"""The lazy model registry's life cycle with scripted engines: a model is
``unloading`` (its memory counted, nothing loaded in its place) until its
engine has closed, one load at a time, a failed load is remembered and
retried with a backoff, each model goes idle on its own clock; and a model
loaded on first use runs as many generations at once as its ``parallel``."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from lmspd.core.conversation import Conversation, Message
from lmspd.core.errors import ApiError
from lmspd.core.events import Finished, TextDelta
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.engines import registry as registry_module
from lmspd.engines.base import ModelInfo
from lmspd.engines.registry import LOADED, LOADING, UNLOADED, UNLOADING, ModelRegistry, lazy_llama_engine
from lmspd.service import Service
from lmspd.streaming.session import ResponseState, StreamSession

COST = 100
FAILED = "failed"


class Scripted:
    """A real engine stand-in; its close waits for ``release`` when given
    (the llama engine's close joins its scheduler and writes checkpoints)."""

    opens_first = False

    def __init__(self, name: str, live: list["Scripted"], release: asyncio.Event | None = None) -> None:
        self.name = name
        self.live = live
        self.release = release
        self.closed_here = False
        live.append(self)

    async def open(self, prepared: Any, cancel: Any) -> None:
        return None

    def announce(self, conversation: Any) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def prepare(self, conversation: Any, run: Any = None) -> Any:
        return SimpleNamespace(input_tokens=1, response_id=None, engine=self)

    async def generate(self, prepared: Any, cancel: Any, response_id: str | None = None) -> Any:
        assert prepared.engine is self, "generating on another instance than the one prepared on"
        assert not self.closed_here
        yield TextDelta(self.name)
        yield Finished("stop")

    def count_tokens(self, conversation: Any) -> int:
        return 7

    def stats(self) -> dict[str, Any]:
        return {"generations": 1}

    async def aclose(self) -> None:
        if self.release is not None:
            await self.release.wait()
        self.closed_here = True
        self.live.remove(self)


class World:
    """A registry and a service over scripted models; ``builds`` counts the
    engines built per model, ``live`` holds the ones not yet closed."""

    def __init__(self, names: tuple[str, ...], budget_models: int | None, *, idle_s: float | None = None,
                 gate: threading.Event | None = None) -> None:
        self.registry = ModelRegistry(max_bytes=None if budget_models is None else budget_models * COST,
                                      idle_unload_s=idle_s)
        self.service = Service(DEFAULT_LIMITS)
        self.live: list[Scripted] = []
        self.builds = {name: 0 for name in names}
        self.release: asyncio.Event | None = None
        self.gate = gate
        for name in names:
            self.service.add_engine(self.registry.add(
                ModelInfo(id=name, context_window=10, capabilities={"streaming": True}), self._build(name), COST))
        self.registry.bind(self.service)

    def _build(self, name: str) -> Any:
        def make() -> Scripted:
            self.builds[name] += 1
            if self.gate is not None:
                assert self.gate.wait(5)
            return Scripted(name, self.live, self.release)
        return make

    def model(self, name: str) -> Any:
        return self.registry.models[name]

    async def begin(self, name: str) -> Any:
        return await self.service.begin(Conversation(model=name, items=[Message(role="user", text="x")]))

    async def until_loaded(self, name: str) -> Any:
        """Ask as a client does (again after a 503) until the model answers."""
        for _ in range(500):
            try:
                return await self.begin(name)
            except ApiError as exc:
                assert exc.status == 503 and exc.code == "model_loading" and exc.headers["Retry-After"]
                self.check_budget()
                await asyncio.sleep(0.01)
        raise AssertionError(name + " never loaded")

    def check_budget(self) -> None:
        """Never more engines in memory than the budget holds."""
        if self.registry.max_bytes is not None:
            assert self.registry.held_bytes() <= self.registry.max_bytes
            assert len(self.live) * COST <= self.registry.max_bytes, [e.name for e in self.live]


async def drain(run: Any, name: str) -> list[str]:
    from lmspd.dialects.openai_responses import OpenAIEncoder

    session = StreamSession(ResponseState(id="resp_" + name, model=name), OpenAIEncoder())
    return [n async for _, n, _ in run.events(session)]


async def until(condition: Any, what: str, world: World | None = None, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if world is not None:
            world.check_budget()
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


# -- an unloading model ----------------------------------------------------------------


def test_a_model_asked_for_while_it_closes_loads_again_only_once_closed() -> None:
    async def go() -> None:
        world = World(("a",), budget_models=1)
        world.release = asyncio.Event()
        model = world.model("a")
        await drain(await world.until_loaded("a"), "a")
        first = model._engine
        world.registry.unload(model, reason="idle")
        await asyncio.sleep(0.02)
        # Its engine is still closing: the model is unloading, its memory counted.
        assert model.status == UNLOADING and world.registry.held_bytes() == COST
        for _ in range(3):
            with pytest.raises(ApiError) as refused:
                await world.begin("a")
            assert refused.value.status == 503 and refused.value.code == "model_loading"
            assert "being unloaded" in refused.value.message and refused.value.headers["Retry-After"]
        assert world.builds["a"] == 1 and model.status == UNLOADING, "a second copy beside the closing one"
        # The close ends: the load asked for meanwhile starts by itself.
        world.release.set()
        await until(lambda: model.status == LOADED, "a never loaded again after its close", world)
        assert first.closed_here and world.builds["a"] == 2 and world.live == [model._engine]
        second = model._engine
        run = await world.begin("a")
        await asyncio.sleep(0.05)
        # Nothing from the first copy's close touches the second.
        assert model.status == LOADED and model._engine is second and not second.closed_here
        assert (await drain(run, "a"))[-1] == "response.completed"
        await world.service.aclose()
        assert second.closed_here and model.status == UNLOADED and world.live == []

    asyncio.run(go())


def test_the_room_of_an_evicted_model_is_counted_until_its_engine_has_closed() -> None:
    async def go() -> None:
        world = World(("a", "b"), budget_models=1)
        world.release = asyncio.Event()
        await drain(await world.until_loaded("a"), "a")
        with pytest.raises(ApiError) as refused:
            await world.begin("b")  # evicts a, whose close takes a while
        assert refused.value.code == "model_loading"
        await asyncio.sleep(0.02)
        assert world.model("a").status == UNLOADING and world.model("b").status == UNLOADED
        for _ in range(3):
            with pytest.raises(ApiError):
                await world.begin("b")
            world.check_budget()
        assert world.builds["b"] == 0, "b loaded while a still held its memory"
        world.release.set()
        # The load b waited for starts when a's close ends.
        await until(lambda: world.model("b").status == LOADED, "b never loaded", world)
        assert world.model("a").status == UNLOADED and [e.name for e in world.live] == ["b"]
        assert (await drain(await world.begin("b"), "b"))[-1] == "response.completed"

    asyncio.run(go())


def test_models_closing_already_make_room_without_evicting_more() -> None:
    async def go() -> None:
        world = World(("a", "b", "c"), budget_models=2)
        world.release = asyncio.Event()
        await drain(await world.until_loaded("a"), "a")
        await drain(await world.until_loaded("b"), "b")
        world.registry.unload(world.model("a"), reason="idle")
        with pytest.raises(ApiError):
            await world.begin("c")  # a's room comes free: b, the only idle one, stays
        await asyncio.sleep(0.02)
        assert world.model("b").status == LOADED and world.model("c").status == UNLOADED
        world.release.set()
        await until(lambda: world.model("c").status == LOADED, "c never loaded", world)
        assert world.model("b").status == LOADED

    asyncio.run(go())


# -- one load at a time ------------------------------------------------------------------


def test_simultaneous_first_requests_build_one_engine() -> None:
    gate = threading.Event()

    async def go() -> World:
        world = World(("a",), budget_models=None, gate=gate)

        async def one() -> str:
            try:
                await world.begin("a")
            except ApiError as exc:
                return exc.code
            return "served"

        assert await asyncio.gather(*(one() for _ in range(4))) == ["model_loading"] * 4
        await asyncio.sleep(0.05)  # every load the requests asked for has been started or refused
        assert world.model("a").status == LOADING
        gate.set()
        for loader in [t for t in threading.enumerate() if t.name == "lmspd-load-a"]:
            loader.join(5)
        await until(lambda: world.model("a").status == LOADED, "a never loaded")
        return world

    world = asyncio.run(go())
    assert world.builds["a"] == 1 and len(world.live) == 1


# -- a failed load --------------------------------------------------------------------


async def listed_status(service: Service, data_dir: Any) -> dict[str, dict[str, Any]]:
    """Model "a" as /v1/models and /lmsp/v1/models list it."""
    import httpx

    from lmspd.app import build_app
    from lmspd.config import Settings
    from lmspd.store.sqlite import SQLiteStore

    store = SQLiteStore(data_dir / "lmspd.sqlite3")
    app = build_app(Settings(data_dir=data_dir), service, store)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
            openai = (await http.get("/v1/models")).json()["data"]
            lmsp = (await http.get("/lmsp/v1/models", headers={"LMSP-Version": "1.0"})).json()["data"]
    finally:
        store.close()
    return {"openai": next(m for m in openai if m["id"] == "a"), "lmsp": next(m for m in lmsp if m["id"] == "a")}


def test_a_failed_load_is_reported_and_retried_after_a_doubling_backoff(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(registry_module, "FAILED_RETRY_S", 10.0, raising=False)
    monkeypatch.setattr(registry_module, "FAILED_RETRY_MAX_S", 15.0, raising=False)
    outcomes = [RuntimeError("cannot read chat template t.jinja: No such file"), RuntimeError("still broken"), None]

    async def go() -> None:
        world = World(("a",), budget_models=1)
        model = world.model("a")
        make = model._build

        def build() -> Any:
            outcome = outcomes.pop(0)
            if outcome is not None:
                world.builds["a"] += 1
                raise outcome
            return make()

        model._build = build
        with pytest.raises(ApiError) as first:
            await world.begin("a")
        assert first.value.code == "model_loading"
        await until(lambda: model.status == FAILED, "the load never failed")
        # Until the retry is due every request hears the failure; none loads again.
        for _ in range(5):
            with pytest.raises(ApiError) as refused:
                await world.begin("a")
            assert refused.value.status == 500 and refused.value.code == "server_error"
            assert "failed to load" in refused.value.message and "t.jinja" in refused.value.message
            assert 1 <= int(refused.value.headers["Retry-After"]) <= 10
        with pytest.raises(ApiError, match="failed to load"):
            await world.service.count_tokens(Conversation(model="a", items=[Message(role="user", text="x")]))
        assert world.builds["a"] == 1
        stats = model.stats()
        assert stats["state"] == FAILED and "t.jinja" in stats["error"] and stats["failures"] == 1
        assert 0 < stats["retry_in_s"] <= 10
        assert 9 < model.retry_at - time.monotonic() <= 10
        # The model lists say why, as a request for it is told.
        for listed in (await listed_status(world.service, tmp_path)).values():
            assert listed["status"] == FAILED and "t.jinja" in listed["error"], listed
            assert 0 < listed["retry_in_s"] <= 10

        # Due: the next request tries again; a second failure waits twice as long (capped).
        model.retry_at = time.monotonic()
        with pytest.raises(ApiError) as again:
            await world.begin("a")
        assert again.value.code == "model_loading"
        await until(lambda: model.status == FAILED and model.failures == 2, "the second load never failed")
        assert world.builds["a"] == 2 and model.error == "still broken"
        assert 14 < model.retry_at - time.monotonic() <= 15

        # A load that succeeds clears the failure.
        model.retry_at = time.monotonic()
        await drain(await world.until_loaded("a"), "a")
        assert model.status == LOADED and model.error is None and model.failures == 0
        assert "error" not in model.stats()
        for listed in (await listed_status(world.service, tmp_path)).values():
            assert listed["status"] == LOADED and "error" not in listed, listed

    asyncio.run(go())


# -- idle models --------------------------------------------------------------------------


def test_an_idle_model_is_unloaded_on_time_while_another_is_busy() -> None:
    async def go() -> None:
        world = World(("a", "b"), budget_models=3)
        await drain(await world.until_loaded("b"), "b")
        await drain(await world.until_loaded("a"), "a")
        world.registry.idle_unload_s = 0.2
        world.registry._schedule_idle_check()
        b = world.model("b")
        # Steady traffic to a, more often than b's idle limit: b still goes.
        deadline = time.monotonic() + 3.0
        while b.status == LOADED:
            assert time.monotonic() < deadline, "b, idle, was never unloaded while a was in use"
            await drain(await world.begin("a"), "a")
            await asyncio.sleep(0.03)
        assert world.model("a").status == LOADED
        await until(lambda: b.status == UNLOADED, "b never closed")

    asyncio.run(go())


def test_a_request_never_pushes_back_the_idle_timer() -> None:
    async def go() -> None:
        world = World(("a", "b"), budget_models=3)
        await drain(await world.until_loaded("b"), "b")
        await drain(await world.until_loaded("a"), "a")
        registry = world.registry
        registry.idle_unload_s = 60.0
        world.model("b").last_used = time.monotonic() - 30.0
        registry._schedule_idle_check()
        loop = asyncio.get_running_loop()
        # Armed for b's deadline, 30 s from now.
        timer = registry._idle_timer
        assert timer is not None and timer.when() - loop.time() == pytest.approx(30.0, abs=1.0)
        registry.touch(world.model("a"))
        assert registry._idle_timer is timer and not timer.cancelled()
        registry._idle_timer.cancel()

    asyncio.run(go())


# -- a model built from a GGUF ----------------------------------------------------------


def test_a_lazy_model_runs_as_many_generations_at_once_as_its_parallel() -> None:
    from lmspd.engines.specs import LlamaSpec

    registry = ModelRegistry(max_bytes=8 << 30)
    engine = lazy_llama_engine(LlamaSpec(model=None, ctx=512, parallel=3), SimpleNamespace(models_dir=None), registry)
    assert engine.info.max_concurrency == 3
    service = Service(DEFAULT_LIMITS)
    service.add_engine(engine)
    queue = service.models[engine.info.id].queue

    async def admit_three() -> None:
        tickets = [queue.admit() for _ in range(3)]
        assert all(t.ready for t in tickets), "a generation waits while the model has sequences free"
        for ticket in tickets:
            ticket.release()

    asyncio.run(admit_three())


def test_a_lazy_models_unreadable_chat_template_fails_at_start(tmp_path) -> None:
    from lmspd.engines.specs import ConfigError, LlamaSpec

    registry = ModelRegistry(max_bytes=8 << 30)
    settings = SimpleNamespace(models_dir=None)
    with pytest.raises(ConfigError, match="cannot read chat template"):
        lazy_llama_engine(LlamaSpec(model=None, ctx=512, chat_template=str(tmp_path / "missing.jinja")),
                          settings, registry)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ConfigError, match="does not compile"):
        lazy_llama_engine(LlamaSpec(model=None, ctx=512, chat_template=str(broken)), settings, registry)
    good = tmp_path / "good.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert lazy_llama_engine(LlamaSpec(model=None, ctx=512, chat_template=str(good)), settings, registry)
    assert registry.models == {} or all(m.status == UNLOADED for m in registry.models.values())


def test_a_close_ending_at_shutdown_starts_no_load() -> None:
    """b waits for a's close to load; the server shuts down meanwhile. The
    close ending then must not start b's load on a server going down (its
    engine would never be closed)."""
    async def go() -> None:
        world = World(("a", "b"), budget_models=1)
        world.release = asyncio.Event()
        await drain(await world.until_loaded("a"), "a")
        with pytest.raises(ApiError):
            await world.begin("b")  # evicts a, whose close takes a while
        await asyncio.sleep(0.02)
        assert world.model("b").wanted_at is not None
        world.service.shutdown()
        asyncio.get_running_loop().call_later(0.05, world.release.set)
        await world.service.aclose()
        await asyncio.sleep(0.1)
        assert world.builds["b"] == 0 and world.live == []
        assert world.model("b").status == UNLOADED

    asyncio.run(go())
