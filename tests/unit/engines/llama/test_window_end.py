"""A generation that fills the context window before any lower limit ends
as ``context_window``, one that reaches the request's own limit as
``length``: Anthropic's clients compact on the first
(``model_context_window_exceeded``) and raise the limit on the second. The
bundled model, in process, on a 256-token window."""

from __future__ import annotations

import asyncio
import json

import pytest

from lmspd.core.conversation import (
    Conversation,
    FunctionTool,
    Message,
    Sampling,
    ToolCall,
    ToolChoice,
    ToolOutput,
)
from lmspd.core.events import Finished, ToolCallDone, ToolCallStarted
from lmspd.engines.base import CancelToken
from support.llama_engine import bundled_engine

COUNT = "Count from 1 to 1000, separated by commas: 1, 2, 3, 4,"


@pytest.fixture(scope="module")
def engine():
    with bundled_engine(n_ctx=256, parallel=1) as eng:
        yield eng


def finished(engine, **conversation) -> Finished:
    conv = Conversation(model="m", items=[Message("user", COUNT)], sampling=Sampling(temperature=0), **conversation)

    async def go() -> list:
        return [ev async for ev in engine.generate(engine.prepare(conv), CancelToken())]
    (end,) = [ev for ev in asyncio.run(go()) if isinstance(ev, Finished)]
    return end


def test_no_limit_runs_to_the_window_and_says_so(engine):
    end = finished(engine)
    assert end.reason == "context_window", end
    assert end.usage.input_tokens + end.usage.output_tokens == engine.info.context_window


def test_a_ceiling_past_the_room_is_the_window(engine):
    """Anthropic's ``max_tokens`` is a ceiling: lowered to the room left."""
    end = finished(engine, max_output_tokens=100_000, max_output_tokens_is_ceiling=True)
    assert end.reason == "context_window", end


def test_the_requests_own_limit_is_length(engine):
    end = finished(engine, max_output_tokens=12)
    assert (end.reason, end.usage.output_tokens) == ("length", 12)
    end = finished(engine, max_output_tokens=12, max_output_tokens_is_ceiling=True)
    assert (end.reason, end.usage.output_tokens) == ("length", 12)


WEATHER = FunctionTool("get_weather", "Get the weather for a city.",
                       {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                        "additionalProperties": False}, strict=True)


@pytest.fixture(scope="module")
def tool_engine():
    with bundled_engine(n_ctx=512, parallel=1) as eng:
        yield eng


def run(engine, conv) -> list:
    async def go() -> list:
        return [ev async for ev in engine.generate(engine.prepare(conv), CancelToken(), response_id="resp_1")]
    return asyncio.run(asyncio.wait_for(go(), 120))


def called(engine) -> tuple[list, Finished]:
    """A turn that calls get_weather, and the replay a client sends back
    (no max_output_tokens, as Codex and the agent SDKs send): SmolLM2
    samples the arguments as ``{\n    "city": "Oslo"\n}``, which a replay
    renders as ``{"city": "Oslo"}``, so the KV holds more than the replay."""
    items = [Message("user", "What is the weather in Oslo?")]
    events = run(engine, Conversation(model="m", items=items, tools=[WEATHER], tool_choice=ToolChoice("required"),
                                      parallel_tool_calls=False, sampling=Sampling(temperature=0)))
    [started] = [e for e in events if isinstance(e, ToolCallStarted)]
    [done] = [e for e in events if isinstance(e, ToolCallDone)]
    [end] = [e for e in events if isinstance(e, Finished)]
    replayed = json.dumps(json.loads(done.payload))
    assert replayed != done.payload
    return [*items, ToolCall(started.call_id, started.name, replayed)], end


def test_a_tool_loop_without_an_output_limit_continues_the_call_turn(tool_engine):
    items, first = called(tool_engine)
    state = tool_engine.cache.residents[0].state  # the call turn (one sequence)
    assert state is not None and state.visible is not None
    result = ToolOutput(items[-1].call_id, "sunny")
    end = finished_conversation(tool_engine, Conversation(model="m", items=[*items, result], tools=[WEATHER],
                                                          sampling=Sampling(temperature=0)))
    assert end.usage.cache_source == "tool-output-ids", end.usage
    assert end.usage.cached_tokens == len(state.tokens) >= first.usage.input_tokens + first.usage.output_tokens


@pytest.mark.parametrize("ceiling", [False, True])
def test_a_continuation_longer_than_its_replay_ends_at_the_window(tool_engine, ceiling):
    """The call turn's KV leaves less room than the replay alone would: the
    generation continues it and ends where the window does, as
    ``context_window``, not past it. So does one whose limit is only a
    ceiling (Anthropic's ``max_tokens``), here all the room the replay
    alone would leave."""
    items, _ = called(tool_engine)
    state = tool_engine.cache.residents[0].state  # the call turn (one sequence)
    assert state is not None and state.visible is not None
    window = tool_engine.info.context_window

    def conversation(output: str, limit: int | None = None) -> Conversation:
        return Conversation(model="m", items=[*items, ToolOutput(items[-1].call_id, output)], tools=[WEATHER],
                            sampling=Sampling(temperature=0), max_output_tokens=limit,
                            max_output_tokens_is_ceiling=limit is not None)

    def continued(output: str) -> int:
        text = tool_engine.prepare(conversation(output)).text
        return len(state.tokens) + len(tool_engine.tokenize(text[len(state.visible):]))

    # A tool result that leaves two tokens of room after the call turn's KV.
    output = "sunny" + " ." * (window - 2 - continued("sunny"))
    assert continued(output) == window - 2
    replay = len(tool_engine.prepare(conversation(output)).tokens)
    assert replay < window - 2, "the replay alone leaves more room than the continuation"
    end = finished_conversation(tool_engine, conversation(output, window - replay if ceiling else None))
    assert (end.usage.cache_source, end.usage.cached_tokens) == ("tool-output-ids", len(state.tokens)), end.usage
    assert end.reason == "context_window", end
    assert end.usage.input_tokens + end.usage.output_tokens == window


def finished_conversation(engine, conv) -> Finished:
    [end] = [ev for ev in run(engine, conv) if isinstance(ev, Finished)]
    return end
