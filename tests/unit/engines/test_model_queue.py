"""The service queue (lmspd.engines.base.ModelQueue): ``concurrency``
generations at once, the rest FIFO up to ``max_pending``, an overloaded
queue refusing synchronously (503 before any byte), and a waiter whose
client left never running nor losing a slot."""

from __future__ import annotations

import asyncio

import pytest

from lmspd.core.errors import ApiError
from lmspd.core.limits import QueueLimits
from lmspd.engines.base import ModelQueue


def queue(concurrency: int = 1, pending: int = 2) -> ModelQueue:
    return ModelQueue(QueueLimits(max_pending=pending, retry_after_s=7), concurrency=concurrency)


def test_runs_concurrency_at_once_then_fifo() -> None:
    async def go() -> list[str]:
        q = queue(concurrency=2, pending=4)
        order: list[str] = []
        gates = {n: asyncio.Event() for n in "abcd"}

        async def work(name: str) -> None:
            async with q.admit():
                order.append(name)
                await gates[name].wait()

        tasks = [asyncio.ensure_future(work(n)) for n in "abcd"]
        await asyncio.sleep(0.01)
        assert order == ["a", "b"] and q.running == 2 and q.pending == 2 and q.busy
        gates["b"].set()
        await asyncio.sleep(0.01)
        assert order == ["a", "b", "c"] and q.running == 2 and q.pending == 1
        for g in gates.values():
            g.set()
        await asyncio.gather(*tasks)
        assert q.running == 0 and q.pending == 0 and not q.busy
        return order

    assert asyncio.run(go()) == ["a", "b", "c", "d"]


def test_a_full_queue_refuses_synchronously_with_retry_after() -> None:
    async def go() -> None:
        q = queue(concurrency=1, pending=1)
        first = q.admit()
        assert first.ready
        second = q.admit()
        assert not second.ready and q.pending == 1
        with pytest.raises(ApiError) as info:
            q.admit()
        assert info.value.code == "server_overloaded" and info.value.headers["Retry-After"] == "7"
        assert q.pending == 1, "a refusal takes no place in the queue"
        first.release()
        await second.wait()
        second.release()
        assert q.running == 0

    asyncio.run(go())


def test_a_cancelled_waiter_leaves_without_running_and_the_next_one_gets_the_slot() -> None:
    async def go() -> None:
        q = queue(concurrency=1, pending=3)
        holder = q.admit()
        left = q.admit()
        stays = q.admit()
        leaving = asyncio.ensure_future(left.wait())
        staying = asyncio.ensure_future(stays.wait())
        await asyncio.sleep(0)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert q.pending == 1
        holder.release()
        await asyncio.wait_for(staying, 1)
        assert q.running == 1
        stays.release()
        left.release()  # releasing a ticket that never ran frees nothing twice
        assert q.running == 0 and q.pending == 0

    asyncio.run(go())


def test_a_turn_that_arrives_as_its_waiter_is_cancelled_passes_on() -> None:
    async def go() -> None:
        q = queue(concurrency=1, pending=3)
        holder = q.admit()
        unlucky, next_one = q.admit(), q.admit()
        waiting = asyncio.ensure_future(unlucky.wait())
        after = asyncio.ensure_future(next_one.wait())
        await asyncio.sleep(0)
        holder.release()  # resolves unlucky's future...
        waiting.cancel()  # ...just as its task is cancelled
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(after, 1)
        assert q.running == 1
        next_one.release()
        assert q.running == 0

    asyncio.run(go())


def test_release_is_idempotent() -> None:
    async def go() -> None:
        q = queue(concurrency=1)
        t = q.admit()
        t.release()
        t.release()
        assert q.running == 0
        assert q.admit().ready

    asyncio.run(go())


def test_a_waiter_released_as_its_turn_arrives_passes_the_slot_on() -> None:
    """The slot is handed to a queued run, and in the same instant its client
    goes: the run's clean-up releases the ticket before the wait resumes.
    The slot was lost for good (``running`` stayed 1 with nothing running:
    at --parallel 1 every later request queued until refused)."""
    async def go() -> None:
        q = queue(concurrency=1, pending=3)
        holder = q.admit()
        gone, next_one = q.admit(), q.admit()
        waiting = asyncio.ensure_future(gone.wait())
        after = asyncio.ensure_future(next_one.wait())
        await asyncio.sleep(0)
        holder.release()  # hands the slot to ``gone``...
        gone.release()  # ...whose client leaves before its wait resumes
        with pytest.raises(asyncio.CancelledError):
            await waiting  # it must not go on to run without a slot
        await asyncio.wait_for(after, 1)
        assert q.running == 1
        next_one.release()
        assert q.running == 0 and q.admit().ready

    asyncio.run(go())


def test_a_ticket_released_before_it_was_ever_waited_on_gives_its_handed_slot_back() -> None:
    async def go() -> None:
        q = queue(concurrency=1, pending=2)
        holder, queued = q.admit(), q.admit()
        holder.release()  # the slot goes to ``queued``, never waited on
        queued.release()
        assert q.running == 0 and q.pending == 0 and q.admit().ready

    asyncio.run(go())
