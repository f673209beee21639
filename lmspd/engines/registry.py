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

A model stays ``unloading`` — counted against the budget, not loadable —
until its engine has really closed (the llama engine's close joins its
scheduler and writes KV checkpoints: seconds); a request for it meanwhile
hears 503 and its load starts once the close has ended. One load at a time
per model: a load starts only from ``unloaded`` (or ``failed``, once its
backoff has passed). A load that fails leaves the model ``failed`` with its
error: requests are answered with that error (``500 server_error``, with
``Retry-After``) until the next try is due, ``FAILED_RETRY_S`` after the
first failure, doubling up to ``FAILED_RETRY_MAX_S``. Each loaded model is
unloaded ``idle_unload_s`` after its own last use, whatever the others do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import threading
import time
from contextlib import AbstractContextManager
from typing import Any, Callable

from lmspd.core.errors import ApiError
from lmspd.engines.base import ModelInfo

log = logging.getLogger("lmspd.models")

RETRY_AFTER_S = 2
# A model whose load failed is tried again on a request this long after the
# failure, doubling with each failure in a row, up to the cap.
FAILED_RETRY_S = 5.0
FAILED_RETRY_MAX_S = 300.0
# A load asked for while the room (or the model itself) is still closing
# starts when a close ends, if it was asked for this recently.
WANTED_S = 30.0
UNLOADED, LOADING, LOADED, UNLOADING, FAILED = "unloaded", "loading", "loaded", "unloading", "failed"
# The states in which a model holds (or is about to hold) its memory.
HOLDING = (LOADING, LOADED, UNLOADING)


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
        # The last load's failure (kept until a load succeeds), how many
        # failed in a row, and when a request may try again.
        self.error: str | None = None
        self.failures = 0
        self.retry_at = 0.0
        self.last_used = 0.0
        self.load_started = 0.0
        # When a request last asked for a load that had to wait for a close
        # (of this model, or of those making room for it); None: not waiting.
        self.wanted_at: float | None = None
        # Calls into the real engine in flight (preparing threads), and the
        # lock under which a use starts only while the model is loaded.
        self._uses = 0
        self._uses_lock = threading.Lock()
        # Bumped by every load and every unload: a state change that ends one
        # of them applies only if no other began since.
        self._epoch = 0
        self._closing: asyncio.Future[None] | None = None

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

    def may_load(self, now: float) -> bool:
        """Whether a load may start now: only from ``unloaded``, or from
        ``failed`` once its retry is due (one load at a time)."""
        return self.status == UNLOADED or (self.status == FAILED and now >= self.retry_at)

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
        an unloaded model starts loading (an unloading one once it has
        closed) and the caller hears 503; a failed one, its failure."""
        self.last_used = time.monotonic()
        with self.using() as engine:
            if engine is not None:
                self._registry.on_loop(self._registry.touch, self)
                return work(engine)
        status = self.status
        if status == FAILED and time.monotonic() < self.retry_at:
            raise self._failed()
        if status in (UNLOADED, FAILED, UNLOADING) and not self._registry.on_loop(self._registry.request_load, self):
            # The load starts on the loop in a moment (the budget may still refuse it then).
            if status == UNLOADING:
                raise self._busy()
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
        if self.status == FAILED:
            out["failures"] = self.failures
            out["retry_in_s"] = max(0, math.ceil(self.retry_at - time.monotonic()))
        return out

    def last_output_token_ids(self) -> list[int]:
        return self._engine.last_output_token_ids() if self._engine is not None else []

    def begin_close(self) -> asyncio.Future[None]:
        """(event loop) Start freeing the real engine — or the close already
        under way. The model is ``unloading`` until the engine has closed."""
        if self._closing is None:
            self.stop_using()
            self._epoch += 1
            self._closing = asyncio.ensure_future(self._close(self._epoch))
        return self._closing

    async def aclose(self) -> None:
        """(shutdown) Free the engine; from now on no model of the registry
        starts a load (a close ending would otherwise start the loads that
        waited for it, on a server going down)."""
        self._registry.shutting_down = True
        if self._closing is None and self.status != LOADED:
            # Nothing loaded (a load under way at shutdown ends in its thread).
            return
        await asyncio.shield(self.begin_close())

    async def _close(self, epoch: int) -> None:
        try:
            # A count or an overrun prepare may still be in the model: it is
            # freed after them (a prepare is bounded, though not stoppable).
            while self._uses:
                await asyncio.sleep(0.02)
            with self._uses_lock:
                engine, self._engine = self._engine, None
            if engine is not None:
                await engine.aclose()
        except Exception:  # a failed close must not leave the model unloading for good
            log.exception("closing %s failed", self.info.id)
        finally:
            # Only the unload that began this close ends it (never a load that began since).
            with self._uses_lock:
                if self._epoch == epoch and self.status == UNLOADING:
                    self.status = UNLOADED
            self._closing = None
        self._registry.closed(self)

    # -- loading -----------------------------------------------------------------------

    def _refuse(self, what: str) -> Any:
        raise ApiError("model_loading", f"Model {self.info.id!r} {what}; retry shortly.",
                       headers={"Retry-After": str(RETRY_AFTER_S)})

    def _busy(self) -> ApiError:
        if self.status == FAILED and time.monotonic() < self.retry_at:
            return self._failed()
        if self.status == UNLOADING:
            what = "is being unloaded (it loads again once its memory is freed)"
        elif self.status == LOADING:
            what = f"is loading ({time.monotonic() - self.load_started:.0f} s so far)"
        else:
            what = "is waiting for memory (other models are busy or still closing)"
        return ApiError("model_loading", f"Model {self.info.id!r} {what}; retry shortly.",
                        headers={"Retry-After": str(RETRY_AFTER_S)})

    def _failed(self) -> ApiError:
        """A failed model's answer until its next try is due: the failure,
        as a server error (retrying sooner cannot help; the operator can)."""
        wait = max(1, math.ceil(self.retry_at - time.monotonic()))
        times = "once" if self.failures == 1 else f"{self.failures} times in a row"
        return ApiError("server_error", f"Model {self.info.id!r} failed to load ({times}): {self.error}. "
                                        f"It is tried again on a request in {wait} s.",
                        headers={"Retry-After": str(wait)})

    def _load_in_thread(self, done: Callable[[], object]) -> None:
        with self._uses_lock:
            self._epoch += 1
            epoch = self._epoch
            self.status = LOADING
            self.wanted_at = None
            self.load_started = time.monotonic()

        def run() -> None:
            progress = _Progress(self)
            try:
                engine = self._build()
            except Exception as exc:  # a bad file must not take the server down
                with self._uses_lock:
                    self.error = str(exc)[:300] or type(exc).__name__
                    self.failures += 1
                    backoff = min(FAILED_RETRY_MAX_S, FAILED_RETRY_S * 2 ** min(self.failures - 1, 16))
                    self.retry_at = time.monotonic() + backoff
                    if self._epoch == epoch:
                        self.status = FAILED
                log.error("could not load %s: %s (tried again on a request in %.0f s)", self.info.id, exc, backoff)
                progress.stop(ok=False)
            else:
                with self._uses_lock:
                    self._engine = engine
                    self.status = LOADED
                    self.error = None
                    self.failures = 0
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
        # One timer, armed for the earliest deadline of any loaded model.
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_due = 0.0
        # Set once the server closes its models: nothing loads after that.
        self.shutting_down = False

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
        """The memory of the models loading, loaded or still closing."""
        return sum(m.cost_bytes for m in self.models.values() if m.status in HOLDING)

    def touch(self, model: LazyEngine) -> None:
        self._schedule_idle_check()

    def request_load(self, model: LazyEngine) -> None:
        """Start loading ``model`` if the budget allows, unloading idle ones first (event loop only)."""
        self._loop = asyncio.get_running_loop()
        if self.shutting_down:
            return
        now = time.monotonic()
        if model.status in (LOADING, LOADED):
            model.wanted_at = None
            return  # one load at a time
        if model.status == UNLOADING:
            model.wanted_at = now  # it loads again once its engine has closed (closed())
            return
        if not model.may_load(now):
            return  # failed, and its next try is not due yet
        if self.max_bytes is not None:
            # A model being unloaded still holds its memory until it is
            # closed; the room it frees then needs no further eviction.
            closing = sum(m.cost_bytes for m in self.models.values() if m.status == UNLOADING)
            need = self.held_bytes() + model.cost_bytes - self.max_bytes - closing
            for victim in self._eviction_order(exclude=model):
                if need <= 0:
                    break
                self.unload(victim, reason="to make room for " + model.info.id)
                need -= victim.cost_bytes
            if self.held_bytes() + model.cost_bytes > self.max_bytes:
                # Still closing, or busy models hold the room: the caller
                # answers 503; a close that ends soon starts the load.
                model.wanted_at = now
                return
        loop = self._loop

        def loaded() -> None:
            # The server may have stopped (its loop closed) while the model loaded.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._schedule_idle_check)

        model._load_in_thread(loaded)

    def closed(self, model: LazyEngine) -> None:
        """(event loop) ``model``'s engine has closed: its memory is free, so
        the loads that waited for a close (asked for lately) start now, the
        longest waiting first."""
        if self.shutting_down:
            return
        now = time.monotonic()
        waiting = sorted((m for m in self.models.values() if m.wanted_at is not None),
                         key=lambda m: m.wanted_at or 0.0)
        for waiter in waiting:
            if waiter.wanted_at is not None and now - waiter.wanted_at > WANTED_S:
                waiter.wanted_at = None  # its client gave up: load nothing for it
            else:
                self.request_load(waiter)

    def _eviction_order(self, exclude: LazyEngine) -> list[LazyEngine]:
        idle = [m for m in self.models.values()
                if m is not exclude and m.status == LOADED and not self._busy(m.info.id)]
        return sorted(idle, key=lambda m: m.last_used)

    def unload(self, model: LazyEngine, reason: str) -> None:
        """Start freeing ``model`` (event loop): ``unloading``, its memory
        counted, until its engine has closed."""
        if model.status != LOADED:
            return
        log.info("unloading %s (%s)", model.info.id, reason)
        print(f"lmspd: unloading {model.info.id} ({reason})", file=sys.stderr, flush=True)
        model.begin_close()

    def _schedule_idle_check(self, due: float | None = None) -> None:
        """Arm the idle timer for the earliest deadline of a loaded model
        (its last use plus ``idle_unload_s``), or ``due`` if sooner. A timer
        already armed no later stays: one model's traffic never pushes back
        another's unload."""
        if self.idle_unload_s is None:
            return
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        deadlines = [m.last_used + self.idle_unload_s for m in self.models.values() if m.status == LOADED]
        if due is not None:
            deadlines.append(due)
        if not deadlines:
            return
        when = min(deadlines)
        if self._idle_timer is not None:
            if self._idle_due <= when:
                return
            self._idle_timer.cancel()
        self._idle_due = when
        self._idle_timer = loop.call_later(max(0.0, when - time.monotonic()), self._unload_idle)

    def _unload_idle(self) -> None:
        self._idle_timer = None
        if self.idle_unload_s is None:
            return
        now = time.monotonic()
        recheck = None
        for model in list(self.models.values()):
            if model.status != LOADED:
                continue
            if self._busy(model.info.id):
                # Idle from when it is seen free: looked at again soon.
                model.last_used = now
                recheck = now + min(self.idle_unload_s, 5.0)
            elif now - model.last_used >= self.idle_unload_s:
                self.unload(model, reason=f"idle for {self.idle_unload_s:.0f} s")
        self._schedule_idle_check(recheck)


def lazy_llama_engine(spec: Any, settings: Any, registry: ModelRegistry) -> LazyEngine:
    """A local GGUF as a lazy engine: its info from the header, its placement
    planned now (lmspd.engines.llama.placement: the same arithmetic the engine
    loads with, within ``--models-max-mem``), its cost the file plus the KV
    of all its ``parallel`` windows and its compute buffers."""
    from lmspd.engines.llama.discovery import Roots
    from lmspd.engines.llama.gguf import GGUFError, read_gguf, sampling_defaults
    from lmspd.engines.llama.models import resolve_model
    from lmspd.engines.llama.template import ChatTemplate, read_template_file
    from lmspd.engines.specs import ConfigError, build_engine, plan_llama, spec_sampling

    model_id, path = resolve_model(spec.model, Roots.default(getattr(settings, "models_dir", None)))
    served = spec.served_model or model_id
    try:
        header = read_gguf(path)
    except GGUFError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if spec.chat_template:
        # What can be checked without loading fails at start, as it does for
        # a single model: a template file that cannot be read or compiled.
        try:
            ChatTemplate(read_template_file(spec.chat_template))
        except ValueError as exc:
            raise ConfigError(f"model {served}: {exc}") from None
    placement = plan_llama(spec, path, settings, budget=registry.max_bytes)
    info = ModelInfo(id=served, context_window=placement.window, source=str(path), capabilities={
        # What the llama engine offers (tools and structured output by grammar).
        "streaming": True, "tools": True, "structured_output": True,
        "reasoning": header.capabilities["reasoning"]},
        # As the loaded engine says (LlamaEngine.info): its queue runs
        # ``parallel`` generations at once.
        max_concurrency=placement.parallel,
        sampling=sampling_defaults(header.metadata).under(spec_sampling(spec, settings)))
    return registry.add(info, lambda: build_engine(spec, settings, placement), placement.cost_bytes)
