"""What a background task's followers may cost: one that stops reading holds
a bounded backlog and catches up from the store; readers, however many,
never queue ahead of the writes that keep every task's result. A scripted
engine stands in for the model; the store is a real SQLite store."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from test_task_writer import CountingEngine, WatchedStore, start_task

from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.service import Service
from lmspd.store.sqlite import SQLiteStore
from lmspd.tasks import manager as manager_module
from lmspd.tasks.manager import TaskManager


def test_a_follower_that_stops_reading_holds_a_bounded_backlog_and_catches_up(tmp_path: Path, monkeypatch) -> None:
    """Each follower of a live task had a queue without bound: one whose
    connection stopped reading was handed every later event of the task
    (5003 queued for a 5000-token task, up to 1024 such connections). Let go
    at the bound, it reads the rest from the store, by seq: nothing lost."""
    monkeypatch.setattr(manager_module, "MAX_FOLLOWER_BACKLOG", 50, raising=False)

    async def go() -> tuple[int, list[int], list[int]]:
        store = WatchedStore(SQLiteStore(tmp_path / "s.db"))
        service = Service(DEFAULT_LIMITS)
        service.add_engine(CountingEngine(600))
        tasks = TaskManager(store)  # type: ignore[arg-type]
        tasks.attach()
        live = await start_task(tasks, service, store)
        stream = await tasks.follow("alice", "task_1", 0)
        assert stream is not None
        (queue,) = live._readers
        first = await anext(stream)  # then it stops reading
        backlog = 0
        while not live.done.is_set():
            backlog = max(backlog, queue.qsize())
            await asyncio.sleep(0.001)
        followed = [first.seq] + [event.seq async for event in stream]
        stored = [e.seq for e in store.events_after("alice", "task_1", 0)]
        tasks.close()
        await service.aclose()
        store.close()
        return backlog, followed, stored

    backlog, followed, stored = asyncio.run(asyncio.wait_for(go(), 30))
    assert len(stored) > 600
    assert 50 <= backlog <= 51, "filled to the bound (and the mark that it was let go), no further"
    assert followed == stored, "every event once, in order, to the terminal event"


class BlockedReads(WatchedStore):
    """Every read of a task's log waits until ``reads_open`` is set."""

    def __init__(self, inner: SQLiteStore) -> None:
        super().__init__(inner)
        self.reads_open = threading.Event()
        self.reading = 0

    def events_after(self, *args, **kwargs):
        self.reading += 1
        self.reads_open.wait(30)
        return self._inner.events_after(*args, **kwargs)


def test_readers_never_queue_ahead_of_the_writes(tmp_path: Path) -> None:
    """Followers' reads ran on the task writers' threads (4, first come,
    first served, never refused): one key replaying its logs over many
    connections queued ahead of every task's writes, and the runs waited on
    their full write queues. Here reads of one task's log hang; another
    task still runs to its end."""

    async def go() -> str:
        store = BlockedReads(SQLiteStore(tmp_path / "s.db"))
        service = Service(DEFAULT_LIMITS)
        service.add_engine(CountingEngine(300))
        tasks = TaskManager(store)  # type: ignore[arg-type]
        tasks.attach()
        readers = [asyncio.create_task(tasks.follow("alice", "task_0", 0)) for _ in range(8)]
        while store.reading < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # every reader that gets a thread has it
        try:
            live = await asyncio.wait_for(start_task(tasks, service, store), 5)
            await asyncio.wait_for(live.done.wait(), 5)
            status = store.get_task("alice", "task_1").status
        except asyncio.TimeoutError:
            status = "waiting behind the readers"
        finally:
            store.reads_open.set()
            await asyncio.gather(*readers)
        tasks.close()
        await service.aclose()
        store.close()
        return status

    assert asyncio.run(go()) == "completed"
