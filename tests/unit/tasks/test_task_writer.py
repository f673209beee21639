"""How a background task's events reach the store: never written on the event
loop's thread, batched when the store is slower than the run, bounded (a run
that outpaces the store waits), and still seen by readers exactly once, in
order. A scripted engine stands in for the model; the store is a real
SQLite store, wrapped to observe its calls."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lmspd.core.conversation import Conversation, Message
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.dialects.registry import LMSP
from lmspd.history import ResponseRecord
from lmspd.service import Service
from lmspd.store.sqlite import SQLiteStore
from lmspd.streaming.session import ResponseState, StreamSession
from lmspd.tasks import manager as manager_module
from lmspd.tasks.manager import LiveTask, TaskManager, task_request
from support.engine import ScriptedEngine


def CountingEngine(n: int, delay_s: float = 0.0) -> ScriptedEngine:
    """Emits ``n`` text deltas as fast as the consumer takes them (or
    ``delay_s`` apart)."""
    return ScriptedEngine(tuple(f"t{i} " for i in range(n)), delay_s, model="m", context_window=100,
                          max_concurrency=4, capabilities={"streaming": True})


class WatchedStore:
    """A real store; notes the thread and size of every event write, and can
    be made slow."""

    def __init__(self, inner: SQLiteStore, delay_s: float = 0.0) -> None:
        self._inner = inner
        self.delay_s = delay_s
        self.write_threads: set[int] = set()
        self.batches: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def append_events(self, task_id, events):
        self.write_threads.add(threading.get_ident())
        self.batches.append(len(events))
        time.sleep(self.delay_s)
        return self._inner.append_events(task_id, events)

    def append_event(self, task_id, seq, event, data):
        return self.append_events(task_id, [(seq, event, data)])

    def set_task_status(self, *args, **kwargs):
        if kwargs.get("final_event") is not None:
            self.write_threads.add(threading.get_ident())
        return self._inner.set_task_status(*args, **kwargs)


async def start_task(tasks: TaskManager, service: Service, store: Any) -> LiveTask:
    """Alice's task ``task_1`` on ``service``'s model."""
    run = await service.begin(Conversation(model="m", items=[Message(role="user", text="x")]))
    session = StreamSession(ResponseState(id="resp_1", model="m", status="in_progress"), LMSP.encoder())
    return await tasks.start(task_id="task_1", owner="alice", dialect=LMSP, request=task_request(LMSP, "m", {}),
                             run=run, session=session, record=ResponseRecord(store, "alice", [], keep=False))


async def run_task(store: WatchedStore, n: int, *, watch_queue: bool = False) -> dict[str, Any]:
    service = Service(DEFAULT_LIMITS)
    service.add_engine(CountingEngine(n))
    tasks = TaskManager(store)  # type: ignore[arg-type]
    tasks.attach()
    live = await start_task(tasks, service, store)
    most_pending = 0
    followed: list[int] = []
    events: list[str] = []

    async def reader() -> None:
        stream = await tasks.follow("alice", "task_1", 0)
        assert stream is not None
        async for event in stream:
            followed.append(event.seq)
            events.append(event.event)

    follower = asyncio.create_task(reader())
    while not live.done.is_set():
        most_pending = max(most_pending, live.pending.qsize())
        await asyncio.sleep(0.001)
    await follower
    tasks.close()
    await service.aclose()
    return {"loop_thread": threading.get_ident(), "most_pending": most_pending, "followed": followed,
            "events": events}


def test_events_are_written_off_the_loop_and_read_exactly_once(tmp_path: Path) -> None:
    store = WatchedStore(SQLiteStore(tmp_path / "s.db"))
    out = asyncio.run(run_task(store, 40))
    assert out["loop_thread"] not in store.write_threads, "a store write ran on the event loop"
    stored = store.events_after("alice", "task_1", 0)
    assert [e.seq for e in stored] == list(range(1, len(stored) + 1))
    assert stored[-1].event == "response.completed"
    assert out["followed"] == [e.seq for e in stored], "the reader saw every event once, in order"
    assert store.get_task("alice", "task_1").status == "completed"
    store.close()


def test_a_slow_store_gets_batches_and_the_run_waits_for_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(manager_module, "MAX_PENDING_EVENTS", 16)
    store = WatchedStore(SQLiteStore(tmp_path / "s.db"), delay_s=0.02)
    n = 300
    out = asyncio.run(run_task(store, n))
    # Far fewer transactions than events: what piled up went in together ...
    assert sum(store.batches) >= n and len(store.batches) < n / 4, store.batches
    assert max(store.batches) <= manager_module.MAX_WRITE_BATCH
    # ... and no more than the bound ever waited (the run waited instead).
    assert out["most_pending"] <= 16
    stored = store.events_after("alice", "task_1", 0)
    assert out["followed"] == [e.seq for e in stored] == list(range(1, len(stored) + 1))
    store.close()


def test_a_reader_on_another_instance_gets_every_event_even_without_notices(tmp_path: Path, monkeypatch) -> None:
    # Two store objects on one SQLite file: B never hears A's notices (they
    # stay in A's store), so B's reader lives on its re-reads alone, the
    # fallback for a lost notice on a shared store.
    monkeypatch.setattr(manager_module, "REMOTE_POLL_S", 0.05)

    async def go() -> tuple[list[int], list[int], str, bool]:
        store_a = WatchedStore(SQLiteStore(tmp_path / "s.db"), delay_s=0.005)
        store_b = SQLiteStore(tmp_path / "s.db")
        # Two managers on one SQLite file stand for two instances on a shared
        # store (on an unshared one, a task not running here has ended).
        store_b.shared = True  # type: ignore[misc]
        service = Service(DEFAULT_LIMITS)
        # Paced, so that the task is still running when B starts following.
        service.add_engine(CountingEngine(60, delay_s=0.002))
        on_a, on_b = TaskManager(store_a), TaskManager(store_b)  # type: ignore[arg-type]
        on_a.attach()
        on_b.attach()
        run = await service.begin(Conversation(model="m", items=[Message(role="user", text="x")]))
        session = StreamSession(ResponseState(id="resp_1", model="m", status="in_progress"), LMSP.encoder())
        live = await on_a.start(task_id="task_1", owner="alice", dialect=LMSP, request=task_request(LMSP, "m", {}),
                          run=run, session=session, record=ResponseRecord(store_a, "alice", [], keep=False))
        while live.recorded < 2:
            await asyncio.sleep(0.005)
        assert on_b.live("task_1", "alice") is None, "B does not run it"
        running_when_followed = not live.done.is_set()
        stream = await on_b.follow("alice", "task_1", 1)
        assert stream is not None
        seen = [event.seq async for event in stream]
        await live.done.wait()
        stored = [e.seq for e in store_b.events_after("alice", "task_1", 0)]
        last = store_b.events_after("alice", "task_1", stored[-1] - 1)[0].event
        on_a.close()
        on_b.close()
        await service.aclose()
        store_a.close()
        store_b.close()
        return seen, stored, last, running_when_followed

    seen, stored, last, running_when_followed = asyncio.run(go())
    assert running_when_followed, "B followed a task still running on A"
    assert last == "response.completed"
    assert seen == stored[1:], "from after seq 1 to the terminal event, once each, in order"


class RefusingStore(WatchedStore):
    """Refuses the run's second batch of events, as a full disk does."""

    def append_events(self, task_id, events):
        if len(self.batches) == 1:
            self.batches.append(0)
            raise RuntimeError("database or disk is full")
        return super().append_events(task_id, events)


def test_a_task_whose_events_the_store_refused_ends_failed_while_serving(tmp_path: Path) -> None:
    """On a store of its own (SQLite) no sweep runs while serving: the task
    was handed to "recovery", and until the next start every poll said
    in_progress and a cancel could not reach it."""
    store = RefusingStore(SQLiteStore(tmp_path / "s.db"), delay_s=0.01)
    asyncio.run(run_task(store, 200))
    task = store.get_task("alice", "task_1")
    assert task.status == "failed"
    assert task.error["code"] == "store_unavailable"
    stored = store.events_after("alice", "task_1", 0)
    assert stored[-1].event == "response.failed"
    assert [e.seq for e in stored] == list(range(1, len(stored) + 1))
    store.close()


class AnswerLostOnce(WatchedStore):
    """The run's second batch of events is stored, and then the answer is
    lost (a connection dropped in COMMIT): the writer tries it again."""

    def append_events(self, task_id, events):
        result = super().append_events(task_id, events)
        if len(self.batches) == 2:
            raise sqlite3.OperationalError("disk I/O error")
        return result


def test_events_whose_commit_landed_but_whose_answer_was_lost_are_stored_once(tmp_path: Path) -> None:
    """The retry's seqs were taken by its own first try: SequenceError, not
    transient, which cancelled a healthy run and left it failed."""
    store = AnswerLostOnce(SQLiteStore(tmp_path / "s.db"), delay_s=0.01)
    out = asyncio.run(run_task(store, 60))
    assert store.get_task("alice", "task_1").status == "completed"
    stored = store.events_after("alice", "task_1", 0)
    assert [e.seq for e in stored] == list(range(1, len(stored) + 1)) == out["followed"]
    assert stored[-1].event == "response.completed"
    store.close()


class Outage(WatchedStore):
    """Unreachable while ``down`` (every write a transient error, as a lost
    PostgreSQL connection gives), once the run has stored a few batches."""

    down = False

    def _check(self) -> None:
        if self.down:
            raise sqlite3.OperationalError("disk I/O error")

    def append_events(self, task_id, events):
        self._check()
        return super().append_events(task_id, events)

    def close_task(self, *args, **kwargs):
        self._check()
        return self._inner.close_task(*args, **kwargs)

    def release_task(self, task_id):
        self._check()
        return self._inner.release_task(task_id)


@pytest.mark.parametrize("shared", [False, True])
def test_a_task_cut_off_by_a_store_outage_is_closed_once_the_store_is_back(tmp_path: Path, shared: bool) -> None:
    """The store goes away for a second while a task runs: its event writes
    give up (a few tries) and its run stops. Closing its log was tried as
    long (a shared store: one release to recovery), in the same outage, and
    then given up: the task stayed in_progress, claimed by an instance that
    lives on (no sweep closes those), to every poll, unreachable by a
    cancel. Its follower hears at once that the log is cut short; the close
    is tried as a task's end is, until it lands."""

    async def go() -> tuple[str, list[str], float]:
        inner = SQLiteStore(tmp_path / "s.db")
        inner.shared = shared  # type: ignore[misc]
        store = Outage(inner, delay_s=0.002)
        service = Service(DEFAULT_LIMITS)
        service.add_engine(CountingEngine(2000, delay_s=0.002))
        tasks = TaskManager(store)  # type: ignore[arg-type]
        tasks.attach()
        live = await start_task(tasks, service, store)
        stream = await tasks.follow("alice", "task_1", 0)
        assert stream is not None
        while live.recorded < 20:
            await asyncio.sleep(0.005)
        store.down = True
        followed = [event.event async for event in stream]  # cut short, told at once
        await asyncio.sleep(1.0)  # longer than an event write's tries
        store.down = False
        back = time.monotonic()
        while store.get_task("alice", "task_1").status == "in_progress" and time.monotonic() - back < 10:
            await asyncio.sleep(0.05)
        status = store.get_task("alice", "task_1").status
        log = [e.event for e in store.events_after("alice", "task_1", 0)]
        tasks.close()
        await service.aclose()
        inner.close()
        return status, followed, log

    status, followed, log = asyncio.run(asyncio.wait_for(go(), 30))
    assert followed and followed[-1] not in ("response.completed", "response.failed")
    assert status == "failed", "closed by this instance, which lives on, once the store took it"
    assert log[-1] == "response.failed" and log[:len(followed)] == followed


class ClosedBySurvivor(WatchedStore):
    """Just before the task's own end is written, another instance closes it
    (one that took this instance's lease for lapsed), with its own terminal
    event: the end is then refused (``set_task_status`` False)."""

    def set_task_status(self, owner, task_id, status, **kwargs):
        if kwargs.get("final_event") is not None:
            from lmspd.tasks.recovery import close_interrupted

            self._inner.close_task(task_id, {"code": "server_restarted", "message": "gone"},
                                   close_log=close_interrupted)
        return super().set_task_status(owner, task_id, status, **kwargs)


def test_a_terminal_event_the_store_refused_is_not_published(tmp_path: Path) -> None:
    """A follower was handed the run's own terminal event although the store
    kept another (the survivor's): what it read was not the task's log."""
    store = ClosedBySurvivor(SQLiteStore(tmp_path / "s.db"))
    out = asyncio.run(run_task(store, 30))
    stored = store.events_after("alice", "task_1", 0)
    assert stored[-1].event == "response.failed"
    assert out["followed"] == [e.seq for e in stored]
    assert out["events"] == [e.event for e in stored], "the follower read the stored log"
    store.close()
