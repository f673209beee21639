"""The lmspd ASGI app in this process, without a model: a scripted engine
stands in (for protocol-level tests only: scopes, errors, fuzzing, the edge).
Requests go through httpx's ASGITransport, every layer of the app included."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from starlette.testclient import TestClient

from lmspd.app import build_app
from lmspd.config import Settings
from lmspd.core.limits import DEFAULT_LIMITS, Limits
from lmspd.service import Service
from lmspd.store.sqlite import SQLiteStore
from support.engine import MODEL, ScriptedEngine

# One scripted engine for all in-process tests (re-exported here, where the
# app helpers are).
__all__ = ["MODEL", "InProcess", "ScriptedEngine", "ThreadedServer", "client", "make_app", "serving", "with_queue"]


def make_app(data_dir: Path, *, keys: list[str] | None = None, engine: ScriptedEngine | None = None,
             store: SQLiteStore | None = None, limits: Limits = DEFAULT_LIMITS, **settings: Any):
    """The whole app over ``engine`` (a fresh ScriptedEngine by default) and
    a real SQLite store; ``settings`` are more Settings fields (retention,
    prune_interval_s, ...)."""
    settings_ = Settings(data_dir=Path(data_dir), api_keys=list(keys or []), limits=limits, **settings)
    service = Service(settings_.limits)
    service.add_engine(engine or ScriptedEngine())
    store = store or SQLiteStore(Path(data_dir) / "lmspd.sqlite3", retention=settings_.retention)
    return build_app(settings_, service, store), store


@dataclass
class InProcess:
    """An app being served in this process (its lifespan running: recovery,
    pruning, task drain at the end), a synchronous client on it, and the
    scripted engine and store behind it."""

    http: TestClient
    engine: ScriptedEngine
    store: SQLiteStore
    app: Any

    def generations(self) -> int:
        return self.engine.generations

    def as_(self, key: str | None) -> TestClient:
        """Another client on the same app, with ``key`` as its bearer token."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return TestClient(self.app, base_url="http://localhost", headers=headers)


@contextmanager
def serving(data_dir: Path, *, engine: ScriptedEngine | None = None, keys: list[str] | None = None,
            key: str | None = None, **settings: Any) -> Iterator[InProcess]:
    """``with serving(tmp_path) as app: app.http.post(...)``: the app, started
    and stopped as ``lmspd serve`` starts and stops it."""
    engine = engine or ScriptedEngine()
    app, store = make_app(data_dir, keys=keys, engine=engine, **settings)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with TestClient(app, base_url="http://localhost", headers=headers) as http:
        yield InProcess(http, engine, store, app)


def client(app, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://localhost", headers=headers or {}, timeout=30)


def with_queue(limits: Limits, max_pending: int) -> Limits:
    return replace(limits, queue=replace(limits.queue, max_pending=max_pending))


class ThreadedServer:
    """uvicorn, configured as ``lmspd serve`` configures it (lmspd.http11,
    the app's lifespan on), serving an in-process app on a free port in a
    background thread. Leaving it shuts the app down as ``lmspd serve``
    does: its engines (an upstream engine's HTTP session), store calls and
    store are closed (closing the store again afterwards is harmless)."""

    def __init__(self, app, limits: Limits = DEFAULT_LIMITS) -> None:
        import threading

        import uvicorn

        from lmspd.http11 import uvicorn_options

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
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
