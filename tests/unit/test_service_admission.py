"""Service.begin: admission before the request's work, the work off the
event loop and bounded in time (scripted engine; the real model's version of
the stall test is tests/e2e/test_hardening.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import httpx
import pytest

from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.core.run import LOCAL
from support.inprocess import MODEL, ScriptedEngine, ThreadedServer, client, make_app, with_queue


class SlowPrepare(ScriptedEngine):
    """Preparing a request whose input says "slow" takes ``prepare_s`` of
    CPU-bound work that holds no await (like rendering a huge prompt)."""

    def __init__(self, prepare_s: float, **kw) -> None:
        super().__init__(**kw)
        self.prepare_s = prepare_s

    def prepare(self, conversation, run=LOCAL):
        if any("slow" in getattr(i, "text", "") for i in conversation.items):
            deadline = time.monotonic() + self.prepare_s
            while time.monotonic() < deadline:
                sum(range(1000))
        return super().prepare(conversation, run)


def test_an_overloaded_server_refuses_before_preparing(tmp_path) -> None:
    engine = ScriptedEngine(words=("a",) * 40, delay_s=0.02)
    app, store = make_app(tmp_path, engine=engine, limits=with_queue(DEFAULT_LIMITS, 1))
    queue = app.state.lmspd.service.models[MODEL].queue
    body = {"model": MODEL, "input": "hi", "stream": True, "store": False}

    async def go() -> None:
        async with client(app) as c:
            running = asyncio.ensure_future(c.post("/v1/responses", json=body))
            waiting = asyncio.ensure_future(c.post("/v1/responses", json=body))
            # Admission is synchronous, preparing runs later in a pool
            # thread: wait for both earlier requests' prepares to be done
            # before counting, or the waiting one's lands after the count.
            while not (queue.busy and queue.pending == 1 and engine.prepared == 2):
                await asyncio.sleep(0.005)
            prepared = engine.prepared
            r = await c.post("/v1/responses", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
            assert r.headers["Retry-After"] == "2"
            assert engine.prepared == prepared, "a refused request must not be prepared"
            assert (await running).status_code == 200 and (await waiting).status_code == 200

    asyncio.run(go())
    assert queue.running == 0 and queue.pending == 0
    store.close()


def test_a_prepare_past_its_bound_is_a_503_and_frees_its_slot(tmp_path) -> None:
    engine = SlowPrepare(prepare_s=1.0)
    limits = replace(DEFAULT_LIMITS, prepare_timeout_s=0.2)
    app, store = make_app(tmp_path, engine=engine, limits=limits)
    queue = app.state.lmspd.service.models[MODEL].queue

    async def go() -> None:
        async with client(app) as c:
            started = time.monotonic()
            r = await c.post("/v1/responses", json={"model": MODEL, "input": "slow", "store": False})
            assert time.monotonic() - started < 0.9
            assert r.status_code == 503 and r.json()["error"]["code"] == "prepare_timeout"
            assert "took longer than 0.2 s" in r.json()["error"]["message"]
            assert queue.running == 0 and queue.pending == 0
            r = await c.post("/v1/responses", json={"model": MODEL, "input": "quick", "store": False})
            assert r.status_code == 200

    asyncio.run(go())
    store.close()


@pytest.mark.alone
def test_preparing_a_big_request_does_not_stall_running_streams(tmp_path) -> None:
    engine = SlowPrepare(prepare_s=1.5, words=tuple(f"w{i} " for i in range(60)), delay_s=0.05)
    app, store = make_app(tmp_path, engine=engine)
    # The upstream-style engine runs many at once, so the slow one is prepared while the stream runs.
    engine.info.max_concurrency = 4
    app.state.lmspd.service.models.clear()
    app.state.lmspd.service.add_engine(engine)
    with ThreadedServer(app) as url:
        gaps: list[float] = []
        first_delta = threading.Event()

        def stream() -> None:
            body = {"model": MODEL, "input": "stream", "stream": True, "store": False}
            with httpx.stream("POST", url + "/v1/responses", json=body, timeout=30) as r:
                last = None
                for line in r.iter_lines():
                    if line.startswith("data: ") and "output_text.delta" in line:
                        now = time.monotonic()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                        first_delta.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_delta.wait(10)
        r = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "slow", "store": False}, timeout=30)
        assert r.status_code == 200
        reader.join(30)
    assert len(gaps) == 59
    assert max(gaps) < 0.5, f"a delta waited {max(gaps):.2f} s while another request was prepared"
    store.close()
