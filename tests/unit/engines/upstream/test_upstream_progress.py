"""A provider stream that keeps sending bytes but no output (``:`` comments,
empty deltas) fails after ``progress_timeout_s`` with the idle timeout's
code, and its request is closed; output (text, reasoning, tool-call bytes,
usage, a finish) starts the time again. The bound is set like the idle
timeout: flag, config key, spec."""

from __future__ import annotations

import asyncio
import json

import pytest

from lmspd.config import Settings
from lmspd.core.conversation import Conversation, Message
from lmspd.core.events import Failed, Finished, TextDelta
from lmspd.core.limits import UpstreamStreamLimits
from lmspd.engines.base import CancelToken
from lmspd.engines.specs import load_config_file, specs_from_settings
from lmspd.engines.upstream.bridge import BridgeDecoder
from lmspd.engines.upstream.engine import UpstreamEngine, UpstreamSpec
from support.provider import DONE, Reply, ScriptedProvider, chunk, finish_chunk, text_chunk, tool_chunk, usage_chunk

KEEPALIVES = [b": still prefilling\n\n", chunk({})]


@pytest.fixture(autouse=True)
def _clean(provider):
    provider.clear()


def generate(provider: ScriptedProvider, progress_s: float) -> list:
    """The events of one generation; the idle timeout is far off, so only
    the progress bound can end a stream that says nothing."""
    eng = UpstreamEngine(UpstreamSpec(served_model="up", upstream_model="m", urls=[provider.url],
                                      idle_timeout_s=60, progress_timeout_s=progress_s))

    async def go() -> list:
        try:
            prepared = eng.prepare(Conversation(model="up", items=[Message(role="user", text="hi")]))
            async with asyncio.timeout(20):  # a hang is a failure, not a wait
                return [e async for e in eng.generate(prepared, CancelToken())]
        finally:
            await eng.aclose()

    return asyncio.run(go())


def test_keepalives_without_output_fail_as_a_timeout_and_close_the_request(provider):
    (reply,) = provider.push(Reply(parts=[chunk({"role": "assistant", "content": ""})] + KEEPALIVES * 2000,
                                   pace_s=0.01, stall_s=60))

    events = generate(provider, progress_s=0.3)

    assert events == [Failed("upstream_timeout", "The upstream provider sent no output for 0.3 s.")]
    assert reply.disconnected.wait(5), "the provider must see the request closed"


def test_output_after_keepalives_fails_once_the_output_stops(provider):
    (reply,) = provider.push(Reply(parts=[text_chunk("partial")] + KEEPALIVES * 2000, pace_s=0.01, stall_s=60))

    events = generate(provider, progress_s=0.3)

    assert events[0] == TextDelta("partial")
    assert isinstance(events[-1], Failed) and events[-1].code == "upstream_timeout"
    assert reply.disconnected.wait(5)


def test_output_starts_the_time_again(provider):
    """Each piece of text comes well within the bound, the whole stream
    takes several times it: it completes."""
    parts: list[bytes | float] = [chunk({"role": "assistant", "content": ""})]
    for i in range(12):
        parts += [0.05, *KEEPALIVES, 0.05, text_chunk(f"{i} ")]
    (reply,) = provider.push(Reply(parts=[*parts, finish_chunk("stop"), DONE]))

    events = generate(provider, progress_s=0.5)

    assert isinstance(events[-1], Finished) and events[-1].reason == "stop"
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "".join(f"{i} " for i in range(12))


def feed(bridge: BridgeDecoder, *parts: bytes) -> int:
    before = bridge.progress
    for part in parts:
        bridge.feed(part)
    return bridge.progress - before


def test_what_counts_as_output():
    bridge = BridgeDecoder(["lookup"])
    assert feed(bridge, b": still prefilling\n\n", chunk({}), chunk({"role": "assistant", "content": ""}),
                chunk({"content": None}), tool_chunk(0, args="")) == 0
    assert feed(bridge, text_chunk("a")) == 1
    assert feed(bridge, chunk({"reasoning_content": "r"})) == 1
    assert feed(bridge, tool_chunk(1, id="call_1", name="look")) == 2
    # A repeated id, or the whole name again once arguments flow, is nothing new.
    assert feed(bridge, tool_chunk(1, args="{")) == 1
    assert feed(bridge, tool_chunk(1, id="call_1", name="look")) == 0
    assert feed(bridge, tool_chunk(1, args="}")) == 1
    assert feed(bridge, usage_chunk(3, 1)) == 1
    assert feed(bridge, usage_chunk(3, 1)) == 0, "the same usage again says nothing"
    # Nor another prompt count, or less output: a provider that alternated
    # them held its request open with no output at all.
    assert feed(bridge, usage_chunk(4, 1), usage_chunk(3, 1), usage_chunk(4, 0)) == 0
    assert feed(bridge, usage_chunk(4, 2)) == 1, "more output is"
    assert feed(bridge, finish_chunk("tool_calls")) == 1
    assert feed(bridge, finish_chunk("tool_calls")) == 0, "nor does the same finish"


def test_the_default_and_how_it_is_set(tmp_path):
    assert UpstreamStreamLimits().progress_timeout_s >= 300, "a slow prefill of a long prompt must not hit it"
    cfg = tmp_path / "models.toml"
    cfg.write_text('[models.r]\nengine = "upstream"\nurl = "http://h/v1"\nupstream_model = "m"\n'
                   "progress_timeout_s = 90\n")
    (spec,) = load_config_file(cfg)
    assert spec.progress_timeout_s == 90
    settings = Settings(engine="upstream", upstream_urls=["http://h/v1"], upstream_model="m",
                        upstream_progress_timeout_s=45)
    (spec,) = specs_from_settings(settings)
    assert spec.progress_timeout_s == 45
    assert UpstreamEngine(spec).client.timeouts.progress_s == 45
    with pytest.raises(ValueError, match="progress_timeout_s"):
        UpstreamSpec(served_model="r", upstream_model="m", urls=["http://h/v1"], progress_timeout_s=0)


def test_a_provider_error_is_unaffected(provider):
    """Sanity: the bound changes nothing for a stream that ends itself."""
    provider.push(Reply(parts=[b"data: " + json.dumps({"error": {"message": "boom", "type": "server_error"}}).encode()
                               + b"\n\n"]))
    events = generate(provider, progress_s=0.3)
    assert isinstance(events[-1], Failed) and events[-1].code != "upstream_timeout"
