"""Real providers' habits the bridge must accept (or refuse) precisely.

Captured from llama-cpp-python's server (``--chat_format
chatml-function-calling``): each tool fragment repeats the whole name, and
a legacy ``function_call`` mirror rides next to ``tool_calls``.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.core.events import Failed, Finished, ToolCallDelta, ToolCallDone, ToolCallStarted
from lmspd.engines.upstream.bridge import BridgeDecoder

DONE = b"data: [DONE]\n\n"


def sse(payload) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def llama_cpp_fragment(name: str, args: str) -> bytes:
    # Verbatim shape of llama-cpp-python 0.3.36's streamed tool call chunks.
    return sse({"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "smol", "choices": [{
        "index": 0, "finish_reason": None, "logprobs": None, "delta": {
            "role": None, "content": None, "function_call": {"name": name, "arguments": args},
            "tool_calls": [{"index": 0, "id": "call__0_get_weather_cmpl-x", "type": "function",
                            "function": {"name": name, "arguments": args}}]}}]})


def finish(reason: str) -> bytes:
    return sse({"id": "chatcmpl-x", "choices": [{"index": 0, "delta": {
        "role": None, "content": None, "function_call": None, "tool_calls": None}, "finish_reason": reason}]})


LLAMA_CPP_STREAM = b"".join(
    [llama_cpp_fragment("get_weather", a) for a in ("{", ' "', "city", '":', ' "', "Paris", '"', " }", "")]
) + finish("tool_calls") + DONE


def events_of(raw: bytes, allowed=("get_weather",), chunk_size: int | None = None) -> list:
    bridge = BridgeDecoder(allowed)
    out = []
    step = chunk_size or len(raw) or 1
    for i in range(0, len(raw), step):
        out += bridge.feed(raw[i:i + step])
    return out + bridge.close()


def test_repeated_whole_name_with_each_fragment_is_one_call():
    args = '{ "city": "Paris" }'
    assert events_of(LLAMA_CPP_STREAM) == [
        ToolCallStarted(0, "call__0_get_weather_cmpl-x", "get_weather"),
        ToolCallDelta(0, args),
        ToolCallDone(0, args),
        Finished("tool_calls"),
    ]


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=64))
def test_repeated_name_under_any_chunking(size):
    assert events_of(LLAMA_CPP_STREAM, chunk_size=size)[0].name == "get_weather"


def test_a_different_name_after_arguments_still_appends_and_fails():
    raw = llama_cpp_fragment("get_weather", "{") + llama_cpp_fragment("Evil", "}") + finish("tool_calls") + DONE
    (failed,) = events_of(raw, allowed=("get_weather", "Evil"))
    assert isinstance(failed, Failed) and failed.code == "undeclared_tool"


def test_a_repeat_before_any_arguments_is_not_trusted():
    # Without an arguments field the name may still be growing: appended.
    call = {"index": 0, "id": "c", "type": "function", "function": {"name": "lookup"}}
    raw = sse({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}) * 2 + finish("tool_calls") + DONE
    (failed,) = events_of(raw, allowed=("lookup",))
    assert failed.code == "undeclared_tool"


def test_legacy_function_call_alone_is_still_refused():
    raw = sse({"choices": [{"index": 0, "delta": {"function_call": {"name": "f", "arguments": "{}"}}}]}) + DONE
    (failed,) = events_of(raw, allowed=("f",))
    assert failed.code == "upstream_malformed_chunk"


def test_a_provider_that_never_sends_usage_gets_an_estimate_not_zeros():
    """Some providers ignore ``stream_options.include_usage`` (or close before
    that chunk): zeros read as real counts, and a client that compacts by
    the usage it is told never would. A bridge told the request's estimated
    size (the engine's) reports an estimate; the provider's own usage,
    when sent, is reported as it is."""
    text = sse({"choices": [{"index": 0, "delta": {"content": "x" * 400}, "finish_reason": "stop"}]})
    bridge = BridgeDecoder((), input_tokens=900)
    finished = (bridge.feed(text + DONE) + bridge.close())[-1]
    assert isinstance(finished, Finished)
    assert (finished.usage.input_tokens, finished.usage.output_tokens) == (900, 100)

    told = sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}})
    bridge = BridgeDecoder((), input_tokens=900)
    finished = (bridge.feed(text + told + DONE) + bridge.close())[-1]
    assert (finished.usage.input_tokens, finished.usage.output_tokens) == (7, 3)
