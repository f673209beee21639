"""A provider read that waits is bounded and interrupted on its own, never by
cancelling whichever task happens to step the generator: ``Paced`` leaves a
silent step suspended while its consumer writes a keep-alive, and a deadline
or a cancel aimed at the consumer's task landed in that write instead (the
stream stopped with no terminal event, and the provider request stayed open
after the events were closed). Through ``Service`` and ``Run.events``, as
every transport consumes a run, over a scripted provider that stalls."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from lmspd.core.conversation import Conversation, Message
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.dialects.registry import OPENAI
from lmspd.engines.upstream.engine import UpstreamEngine, UpstreamSpec
from lmspd.service import Service
from lmspd.streaming.session import ResponseState, StreamSession
from support.provider import Reply, text_chunk


@pytest.fixture(autouse=True)
def _clean(provider):
    provider.clear()


async def consume(provider, *, cancel_at_write: bool) -> tuple[list[str], dict, int, list[str]]:
    """The wire events of one run whose provider sends a word and stalls,
    its consumer's keep-alive writes slow (0.3 s: a client that reads
    slowly, a full WebSocket outbox). ``cancel_at_write``: the run is
    cancelled (its token, as a task cancel or shutdown does) during such a
    write; else the provider's idle timeout (1 s) ends it."""
    engine = UpstreamEngine(UpstreamSpec(served_model="up", upstream_model="m", urls=[provider.url],
                                         idle_timeout_s=60 if cancel_at_write else 1.0))
    service = Service(dataclasses.replace(DEFAULT_LIMITS, sse_keepalive_s=0.25))
    service.add_engine(engine)
    names: list[str] = []
    last: dict = {}
    troubles: list[str] = []
    try:
        run = await service.begin(Conversation(model="up", items=[Message(role="user", text="hi")]))
        await run.open()
        session = StreamSession(ResponseState(id="resp_1", model="up", status="in_progress", created_at=1),
                                OPENAI.encoder())
        try:
            async with asyncio.timeout(20), contextlib.aclosing(run.events(session)) as events:
                async for _, name, data in events:
                    names.append(name)
                    last = data
                    if name == "response.in_progress" and names.count(name) >= 3:
                        if cancel_at_write:
                            run.cancel.cancel()
                        await asyncio.sleep(0.3)  # the keep-alive's write is slow
        except asyncio.CancelledError:
            troubles.append("CancelledError in the consumer's write")
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
        outstanding = engine.pool.endpoints[0].outstanding  # right after the events were closed
    finally:
        await engine.aclose()
    return names, last, outstanding, troubles


def test_the_idle_timeout_ends_a_stall_whose_keep_alive_writes_are_slow(provider):
    (reply,) = provider.push(Reply(parts=[text_chunk("hello")], stall_s=30))
    names, last, outstanding, troubles = asyncio.run(consume(provider, cancel_at_write=False))
    assert troubles == []
    assert names[-1] == "response.failed" and last["response"]["error"]["code"] == "upstream_timeout", names
    assert outstanding == 0, "the provider request is closed with the events"
    assert reply.disconnected.wait(5)


def test_a_cancel_during_a_slow_keep_alive_write_ends_the_stream_with_its_terminal_event(provider):
    (reply,) = provider.push(Reply(parts=[text_chunk("hello")], stall_s=30))
    names, last, outstanding, troubles = asyncio.run(consume(provider, cancel_at_write=True))
    assert troubles == []
    assert names[-1] in ("response.failed", "response.incomplete", "response.completed"), names
    assert last["response"]["status"] in ("cancelled", "failed", "incomplete"), last["response"]["status"]
    assert outstanding == 0
    assert reply.disconnected.wait(5)
