"""Service.begin tells the engine that an admitted request is on its way
(``announce``, optional in the Engine protocol) for as long as the request
waits for, and runs, its preparation: an engine that batches requests
arriving together (the llama scheduler's gather) counts it from admission,
not from when a preparing thread gets to it. Scripted engine."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

from lmspd.core.run import LOCAL
from support.inprocess import MODEL, ScriptedEngine, client, make_app


class Announcing(ScriptedEngine):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.log: list[str] = []
        self._lock = threading.Lock()

    @contextmanager
    def announce(self, conversation):
        with self._lock:
            self.log.append("announced")
        try:
            yield
        finally:
            with self._lock:
                self.log.append("ended")

    def prepare(self, conversation, run=LOCAL):
        with self._lock:
            self.log.append("prepare")
        return super().prepare(conversation, run)


def test_begin_announces_a_request_around_its_preparation(tmp_path) -> None:
    engine = Announcing(words=("a",) * 3)
    app, store = make_app(tmp_path, engine=engine)

    async def go() -> None:
        async with client(app) as c:
            r = await c.post("/v1/chat/completions",
                             json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
            r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [], "max_tokens": -1})
            assert r.status_code == 400

    asyncio.run(go())
    assert engine.log == ["announced", "prepare", "ended"], engine.log
    store.close()
