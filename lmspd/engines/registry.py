"""Several local models, loaded on first use and unloaded to make room.

Each configured model is a :class:`LazyEngine`: it answers the ``Engine``
protocol at once (its ``info`` comes from the GGUF header, nothing loaded)
and loads the real engine in a thread on the first request. While it loads,
requests are refused with ``503 model_loading`` and ``Retry-After`` — never
queued behind a load of unknown length, never an out-of-memory.

:class:`ModelRegistry` holds them and a memory budget (``--models-max-mem``):
a model's cost is its GGUF file size (weights are mapped as they are stored)
plus its KV budget estimate. Before one loads, the least recently used idle
models are unloaded until it fits; one that cannot fit beside busy models
waits (503). A model idle for ``idle_unload_s`` is unloaded too.

Eviction runs on the event loop only: ``Service.begin`` admits a request to
its model's queue before it awaits ``prepare``, so a model being prepared
for is already counted by its queue before any eviction can look at it.
The queue does not see everything that uses a model, though: token counts
(``/v1/messages/count_tokens``, ``/v1/responses/input_tokens``, the
compaction threshold) hold no queue slot, and a prepare that overran
``prepare_timeout_s`` goes on in its thread after its ticket was released.
So every call into the real engine holds a use count (``LazyEngine.using``):
a model in use is busy to eviction, and unloading one marks it
``unloading`` (no new use) and then waits for the uses in flight to end
before freeing it (llama.cpp would otherwise free the model under them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from contextlib import AbstractContextManager
from typing import Any, Callable

from lmspd.core.errors import ApiError
from lmspd.engines.base import ModelInfo

log = logging.getLogger("lmspd.models")

RETRY_AFTER_S = 2
UNLOADED, LOADING, LOADED, UNLOADING = "unloaded", "loading", "loaded", "unloading"


class LazyEngine:
    """An engine that exists on first use; ``build`` makes the real one."""

    def __init__(self, info: ModelInfo, build: Callable[[], Any], cost_bytes: int,
                 registry: "ModelRegistry") -> None:
        self.info = info
        self.cost_bytes = cost_bytes
        self._build = build
        self._registry = registry
        self._engine: Any = None
        self.status = UNLOADED
        self.error: str | None = None
        self.last_used = 0.0
        self.load_started = 0.0
        # Calls into the real engine in flight (preparing threads), and the
        # lock under which a use starts only while the model is loaded.
        self._uses = 0
        self._uses_lock = threading.Lock()

    @property
    def in_use(self) -> bool:
        return self._uses > 0

    @contextlib.contextmanager
    def using(self) -> Any:
        """The real engine, held loaded until the block ends (None when it
        is not loaded: nothing is held)."""
        with self._uses_lock:
            engine = self._engine if self.status == LOADED else None
            if engine is not None:
                self._uses += 1
        if engine is None:
            yield None
            return
        try:
            yield engine
        finally:
            with self._uses_lock:
                self._uses -= 1
            self.last_used = time.monotonic()

    def stop_using(self) -> None:
        """No new use from now on (event loop: the model is about to be unloaded)."""
        with self._uses_lock:
            if self.status == LOADED:
                self.status = UNLOADING

    # -- the Engine protocol ---------------------------------------------------------

    def prepare(self, conversation: Any, run: Any) -> Any:
        return self._use(lambda engine: engine.prepare(conversation, run))

    def count_tokens(self, conversation: Any) -> int:
        return int(self._use(lambda engine: engine.count_tokens(conversation)))

    def announce(self, conversation: Any) -> AbstractContextManager[None]:
        engine = self._engine if self.status == LOADED else None
        return contextlib.nullcontext() if engine is None else engine.announce(conversation)

    def _use(self, work: Callable[[Any], Any]) -> Any:
        """``work(engine)`` while the model is held loaded (preparing threads);
        an unloaded model starts loading and the caller hears 503."""
        self.last_used = time.monotonic()
        with self.using() as engine:
            if engine is not None:
                self._registry.on_loop(self._registry.touch, self)
                return work(engine)
        if self.status == UNLOADED and not self._registry.on_loop(self._registry.request_load, self):
            # The load starts on the loop in a moment (the budget may still refuse it then).
            return self._refuse("is loading (or waiting for memory)")
        raise self._busy()

    def generate(self, prepared: Any, cancel: Any, response_id: str | None = None) -> Any:
        engine = self._engine
        if engine is None:  # unloaded under an admitted request: cannot happen (see module doc)
            raise self._busy()
        return engine.generate(prepared, cancel, response_id=response_id)

    @property
    def opens_first(self) -> bool:
        return bool(self._engine is not None and self._engine.opens_first)

    async def open(self, prepared: Any, cancel: Any) -> None:
        if self._engine is not None:
            await self._engine.open(prepared, cancel)

    async def discard(self, prepared: Any) -> None:
        if self._engine is not None:
            await self._engine.discard(prepared)

    @property
    def supports_prefill(self) -> bool:
        return bool(getattr(self._engine, "supports_prefill", False))

    def stats(self) -> dict[str, Any]:
        if self._engine is not None and self.status == LOADED:
            return {**self._engine.stats(), "state": self.status}
        out: dict[str, Any] = {"state": self.status, "generations": 0}
        if self.error:
            out["error"] = self.error
        return out

    def last_output_token_ids(self) -> list[int]:
        return self._engine.last_output_token_ids() if self._engine is not None else []

    async def aclose(self) -> None:
        self.stop_using()
        # A count or an overrun prepare may still be in the model: it is
        # freed after them (a prepare is bounded, though not stoppable).
        while self._uses:
            await asyncio.sleep(0.02)
        engine, self._engine = self._engine, None
        self.status = UNLOADED
        if engine is not None:
            await engine.aclose()

    # -- loading -----------------------------------------------------------------------

    def _refuse(self, what: str) -> Any:
        raise ApiError("model_loading", f"Model {self.info.id!r} {what}; retry shortly.",
                       headers={"Retry-After": str(RETRY_AFTER_S)})

    def _busy(self) -> ApiError:
        if self.status == UNLOADING:
            what = "is being unloaded"
        elif self.status == LOADING:
            what = f"is loading ({time.monotonic() - self.load_started:.0f} s so far)"
        else:
            what = "is waiting for memory (other models are busy or still closing)"
            if self.error:
                what = f"failed to load ({self.error}); retrying"
        return ApiError("model_loading", f"Model {self.info.id!r} {what}; retry shortly.",
                        headers={"Retry-After": str(RETRY_AFTER_S)})

    def _load_in_thread(self, done: Callable[[], object]) -> None:
        self.status = LOADING
        self.error = None
        self.load_started = time.monotonic()

        def run() -> None:
            progress = _Progress(self)
            try:
                engine = self._build()
            except Exception as exc:  # a bad file must not take the server down
                log.error("could not load %s: %s", self.info.id, exc)
                self.error = str(exc)[:300]
                self.status = UNLOADED
                progress.stop(ok=False)
            else:
                self._engine = engine
                self.status = LOADED
                self.last_used = time.monotonic()
                progress.stop(ok=True)
            done()

        threading.Thread(target=run, name=f"lmspd-load-{self.info.id}", daemon=True).start()


class _Progress:
    """One terminal line while a model loads (rewritten in place on a tty)."""

    def __init__(self, model: LazyEngine) -> None:
        self._model = model
        self._stop = threading.Event()
        self._tty = sys.stderr.isatty()
        print(f"lmspd: loading {model.info.id} ({model.cost_bytes / 2**20:.0f} MiB)…", file=sys.stderr, flush=True)
        if self._tty:
            threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            spent = time.monotonic() - self._model.load_started
            print(f"\r\033[Klmspd: loading {self._model.info.id}… {spent:.1f} s", end="", file=sys.stderr, flush=True)

    def stop(self, *, ok: bool) -> None:
        self._stop.set()
        spent = time.monotonic() - self._model.load_started
        head = "\r\033[K" if self._tty else ""
        word = "loaded" if ok else "failed to load"
        print(f"{head}lmspd: {word} {self._model.info.id} in {spent:.1f} s", file=sys.stderr, flush=True)


class ModelRegistry:
    def __init__(self, max_bytes: int | None = None, idle_unload_s: float | None = None) -> None:
        self.max_bytes = max_bytes
        self.idle_unload_s = idle_unload_s
        self.models: dict[str, LazyEngine] = {}
        self._busy: Callable[[str], bool] = lambda model_id: False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle_timer: asyncio.TimerHandle | None = None

    def add(self, info: ModelInfo, build: Callable[[], Any], cost_bytes: int) -> LazyEngine:
        if self.max_bytes is not None and cost_bytes > self.max_bytes:
            raise ValueError(f"model {info.id!r} needs about {cost_bytes >> 20} MiB, more than "
                             f"--models-max-mem ({self.max_bytes >> 20} MiB)")
        engine = LazyEngine(info, build, cost_bytes, self)
        self.models[info.id] = engine
        return engine

    def bind(self, service: Any) -> None:
        """Ask ``service``'s queues whether a model is in use."""

        def busy(model_id: str) -> bool:
            served = service.models.get(model_id)
            model = self.models.get(model_id)
            return (served is not None and (served.queue.running > 0 or served.queue.pending > 0)) or (
                model is not None and model.in_use)

        self._busy = busy
        self._service = service

    def on_loop(self, call: Callable[[LazyEngine], None], model: LazyEngine) -> bool:
        """Run ``call(model)`` on the event loop: ``prepare`` runs in the
        service's preparing threads, but loads and idle timers belong to the loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            loop = self._loop or getattr(getattr(self, "_service", None), "loop", None)
            if loop is None:
                raise
            loop.call_soon_threadsafe(call, model)
            return False
        call(model)
        return True

    def held_bytes(self) -> int:
        return sum(m.cost_bytes for m in self.models.values() if m.status != UNLOADED)

    def touch(self, model: LazyEngine) -> None:
        self._schedule_idle_check()

    def request_load(self, model: LazyEngine) -> None:
        """Start loading ``model`` if the budget allows, unloading idle ones first (event loop only)."""
        self._loop = asyncio.get_running_loop()
        if self.max_bytes is not None:
            # A model being unloaded still holds its memory until it is closed.
            need = self.held_bytes() + model.cost_bytes - self.max_bytes
            for victim in self._eviction_order(exclude=model):
                if need <= 0:
                    break
                self.unload(victim, reason="to make room for " + model.info.id)
                need -= victim.cost_bytes
            if self.held_bytes() + model.cost_bytes > self.max_bytes:
                return  # still closing, or busy models hold the room: the caller answers 503
        loop = self._loop

        def loaded() -> None:
            # The server may have stopped (its loop closed) while the model loaded.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._schedule_idle_check)

        model._load_in_thread(loaded)

    def _eviction_order(self, exclude: LazyEngine) -> list[LazyEngine]:
        idle = [m for m in self.models.values()
                if m is not exclude and m.status == LOADED and not self._busy(m.info.id)]
        return sorted(idle, key=lambda m: m.last_used)

    def unload(self, model: LazyEngine, reason: str) -> None:
        log.info("unloading %s (%s)", model.info.id, reason)
        print(f"lmspd: unloading {model.info.id} ({reason})", file=sys.stderr, flush=True)
        model.stop_using()

        async def close() -> None:
            try:
                await model.aclose()
            finally:
                model.status = UNLOADED

        asyncio.get_running_loop().create_task(close())

    def _schedule_idle_check(self) -> None:
        if self.idle_unload_s is None:
            return
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = loop.call_later(min(self.idle_unload_s, 5.0), self._unload_idle)

    def _unload_idle(self) -> None:
        self._idle_timer = None
        now = time.monotonic()
        waiting = False
        for model in list(self.models.values()):
            if model.status != LOADED:
                continue
            if self._busy(model.info.id):
                model.last_used = now
                waiting = True
            elif now - model.last_used >= self.idle_unload_s:  # type: ignore[operator]
                self.unload(model, reason=f"idle for {self.idle_unload_s:.0f} s")
            else:
                waiting = True
        if waiting:
            self._schedule_idle_check()


def lazy_llama_engine(spec: Any, settings: Any, registry: ModelRegistry) -> LazyEngine:
    """A local GGUF as a lazy engine: its info from the header, its placement
    planned now (lmspd.engines.llama.placement: the same arithmetic the engine
    loads with, within ``--models-max-mem``), its cost the file plus the KV
    of all its ``parallel`` windows and its compute buffers."""
    from lmspd.engines.llama.discovery import Roots
    from lmspd.engines.llama.gguf import GGUFError, read_gguf, sampling_defaults
    from lmspd.engines.llama.models import resolve_model
    from lmspd.engines.specs import build_engine, plan_llama, spec_sampling

    model_id, path = resolve_model(spec.model, Roots.default(getattr(settings, "models_dir", None)))
    served = spec.served_model or model_id
    try:
        header = read_gguf(path)
    except GGUFError as exc:
        raise ValueError(f"{path}: {exc}") from None
    placement = plan_llama(spec, path, settings, budget=registry.max_bytes)
    info = ModelInfo(id=served, context_window=placement.window, source=str(path), capabilities={
        # What the llama engine offers (tools and structured output by grammar).
        "streaming": True, "tools": True, "structured_output": True,
        "reasoning": header.capabilities["reasoning"]},
        sampling=sampling_defaults(header.metadata).under(spec_sampling(spec, settings)))
    return registry.add(info, lambda: build_engine(spec, settings, placement), placement.cost_bytes)
