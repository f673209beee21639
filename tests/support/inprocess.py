"""The lmspd ASGI app in this process, without a model: a scripted engine
stands in (for protocol-level tests only: scopes, errors, fuzzing, the edge).
Requests go through httpx's ASGITransport, every layer of the app included."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from lmspd.app import build_app
from lmspd.config import Settings
from lmspd.core.conversation import Conversation
from lmspd.core.events import Finished, TextDelta, Usage
from lmspd.core.limits import DEFAULT_LIMITS, Limits
from lmspd.engines.base import CancelToken, ModelInfo
from lmspd.service import Service
from lmspd.store.sqlite import SQLiteStore

MODEL = "scripted"


@dataclass
class ScriptedPrepared:
    conversation: Conversation
    input_tokens: int = 3
    response_id: str | None = None


class ScriptedEngine:
    """Answers every request with ``words``, ``delay_s`` apart."""

    def __init__(self, words: tuple[str, ...] = ("Hello", " there"), delay_s: float = 0.0) -> None:
        self.info = ModelInfo(id=MODEL, context_window=4096,
                              capabilities={"streaming": True, "tools": True, "structured_output": True})
        self.words = words
        self.delay_s = delay_s
        self.generations = 0
        self.prepared = 0

    opens_first = False  # the Engine protocol: nothing to reach before generating

    async def open(self, prepared, cancel) -> None:
        return None

    def prepare(self, conversation: Conversation) -> ScriptedPrepared:
        self.prepared += 1
        return ScriptedPrepared(conversation)

    async def generate(self, prepared: ScriptedPrepared, cancel: CancelToken, response_id: str | None = None):
        self.generations += 1
        for word in self.words:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            yield TextDelta(word)
        yield Finished("stop", Usage(input_tokens=3, output_tokens=len(self.words)))

    def count_tokens(self, conversation: Conversation) -> int:
        return 3

    def stats(self) -> dict[str, Any]:
        return {"generations": self.generations}

    async def aclose(self) -> None:
        pass


def make_app(data_dir: Path, *, keys: list[str] | None = None, engine: ScriptedEngine | None = None,
             store: SQLiteStore | None = None, limits: Limits = DEFAULT_LIMITS):
    settings = Settings(data_dir=Path(data_dir), api_keys=list(keys or []), limits=limits)
    service = Service(settings.limits)
    service.add_engine(engine or ScriptedEngine())
    store = store or SQLiteStore(Path(data_dir) / "lmspd.sqlite3")
    return build_app(settings, service, store), store


def client(app, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://lmspd.test", headers=headers or {}, timeout=30)


def with_queue(limits: Limits, max_pending: int) -> Limits:
    return replace(limits, queue=replace(limits.queue, max_pending=max_pending))


class ThreadedServer:
    """uvicorn, configured as ``lmspd serve`` configures it (lmspd.http11),
    serving an in-process app on a free port in a background thread."""

    def __init__(self, app, limits: Limits = DEFAULT_LIMITS) -> None:
        import threading

        import uvicorn

        from lmspd.http11 import uvicorn_options

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                **uvicorn_options(limits.request))
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        import time

        self._thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(10)
