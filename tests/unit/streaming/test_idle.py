"""``Paced``: an async iterator read with a deadline that leaves it running
(``lmspd.streaming.idle``), stepped in the caller's own task."""

from __future__ import annotations

import asyncio

import pytest

from lmspd.streaming.idle import IDLE, Paced


def test_a_silent_source_is_idle_and_then_goes_on_where_it_was():
    log: list[str] = []

    async def source():
        log.append("start")
        await asyncio.sleep(0.3)
        yield "a"
        yield "b"  # already there: no waiting at all
        await asyncio.sleep(0)
        yield "c"

    async def main():
        paced = Paced(source())
        got = []
        idles = 0
        while True:
            try:
                value = await paced.next(0.02)
            except StopAsyncIteration:
                break
            if value is IDLE:
                idles += 1
            else:
                got.append(value)
        return got, idles

    got, idles = asyncio.run(main())
    assert got == ["a", "b", "c"]
    assert log == ["start"]  # one run of the source, never restarted
    assert idles >= 2  # the 0.3 s before "a" came in 0.02 s slices


def test_no_task_is_made_per_step():
    async def source():
        for i in range(50):
            await asyncio.sleep(0)
            yield i

    async def main():
        paced = Paced(source())
        before = len(asyncio.all_tasks())
        most = before
        values = []
        while True:
            try:
                value = await paced.next(1.0)
            except StopAsyncIteration:
                break
            most = max(most, len(asyncio.all_tasks()))
            values.append(value)
        return values, before, most

    values, before, most = asyncio.run(main())
    assert values == list(range(50))
    assert most == before


def test_aclose_cancels_the_source_where_it_waits():
    heard: list[str] = []

    async def source():
        try:
            await asyncio.sleep(10)
            yield "never"
        except asyncio.CancelledError:
            heard.append("cancelled")
            await asyncio.sleep(0.01)  # cleanup that itself waits
            heard.append("cleaned up")
            raise

    async def main():
        paced = Paced(source())
        assert await paced.next(0.01) is IDLE
        await paced.aclose()

    asyncio.run(main())
    assert heard == ["cancelled", "cleaned up"]


def test_errors_of_the_source_reach_the_reader():
    async def source():
        await asyncio.sleep(0.01)
        raise ValueError("boom")
        yield  # pragma: no cover

    async def main():
        await Paced(source()).next(None)

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(main())


def test_a_cancel_of_the_reading_task_reaches_the_source_where_it_waits():
    """As under a task of its own: the upstream engine interrupts its read by
    cancelling the task it runs in, catches that where it awaits, and ends
    with its terminal event; the reader gets that event, not the error."""
    async def source():
        me = asyncio.current_task()
        asyncio.get_running_loop().call_later(0.05, me.cancel)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            me.uncancel()
            yield "stopped"
            return
        yield "never"

    async def main():
        paced = Paced(source())
        seen = []
        while True:
            try:
                seen.append(await paced.next(0.01))
            except StopAsyncIteration:
                return seen

    seen = asyncio.run(main())
    assert seen[-1] == "stopped" and set(seen[:-1]) == {IDLE}
