"""The Chat Completions chunk decoder: strict types, provider values kept."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.engines.upstream.chunks import (
    DONE,
    ChatChunk,
    ChatChunkDecoder,
    ChatDelta,
    ChunkChoice,
    ChunkUsage,
    ProviderError,
    ToolCallFragment,
)
from lmspd.engines.upstream.credentials import Secret
from lmspd.engines.upstream.errors import (
    DataAfterDone,
    DuplicateTerminal,
    DuplicateToolIndex,
    InvalidToolIndex,
    MalformedChunk,
    SSETruncated,
    UpstreamError,
)

FAST = settings(max_examples=200, deadline=None)


def sse(payload, event: str | None = None) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return (head + f"data: {data}\n\n").encode()


def decode(raw: bytes) -> list:
    decoder = ChatChunkDecoder()
    return [*decoder.feed(raw), *decoder.close()]


def decode_one(payload):
    (item,) = decode(sse(payload))
    return item


def choice(delta: dict | None = None, finish: str | None = None, index: int = 0) -> dict:
    return {"index": index, "delta": delta or {}, "finish_reason": finish}


# -- shapes -------------------------------------------------------------------


def test_full_chunk_keeps_every_provider_value():
    item = decode_one(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": "m",
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "role": "assistant",
                        "content": "Hi",
                        "reasoning_content": "think",
                        "reasoning": "think",
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_x",
                                "type": "function",
                                "function": {"name": "look", "arguments": '{"q"'},
                            },
                            {"index": 2, "function": {"arguments": "1"}},
                        ],
                    },
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
    )
    assert item == ChatChunk(
        id="chatcmpl-1",
        model="m",
        created=1700000000,
        choices=(
            ChunkChoice(
                index=0,
                delta=ChatDelta(
                    role="assistant",
                    content="Hi",
                    reasoning_content="think",
                    reasoning="think",
                    tool_calls=(
                        ToolCallFragment(0, "call_x", "function", "look", '{"q"'),
                        ToolCallFragment(2, arguments="1"),
                    ),
                ),
            ),
        ),
    )


def test_usage_chunk():
    item = decode_one(
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": 5,
                "total_tokens": 15,
                "prompt_tokens_details": {"cached_tokens": 4},
                "completion_tokens_details": {"reasoning_tokens": 2},
            },
        }
    )
    assert item == ChatChunk(usage=ChunkUsage(10, 5, 15, cached_tokens=4, reasoning_tokens=2))


def test_finish_chunk_without_delta():
    assert decode_one({"choices": [{"index": 0, "finish_reason": "stop"}]}) == ChatChunk(
        choices=(ChunkChoice(0, ChatDelta(), "stop"),)
    )


@pytest.mark.parametrize(
    "payload, expected",
    [
        (
            {
                "error": {
                    "message": "bad key sk-123",
                    "type": "invalid_request_error",
                    "code": "invalid_api_key",
                }
            },
            ProviderError("bad key sk-123", "invalid_request_error", "invalid_api_key"),
        ),
        ({"error": {"message": "slow down", "code": 429}}, ProviderError("slow down", None, "429")),
        ({"error": "overloaded"}, ProviderError("overloaded")),
        (
            {"object": "error", "message": "boom", "type": "BadRequestError", "code": 400},
            ProviderError("boom", "BadRequestError", "400"),
        ),
    ],
)
def test_provider_error_shapes(payload, expected):
    assert decode_one(payload) == expected


def test_error_event_is_a_provider_error_even_without_json():
    assert decode(sse("upstream exploded", event="error")) == [ProviderError("upstream exploded")]


def test_provider_error_text_is_bounded():
    assert len(decode_one({"error": {"message": "x" * 10_000}}).message) == 1024


def test_provider_error_text_loses_the_key_before_it_is_cut():
    """Scrubbed first: a key that straddles the cut would leave its head,
    and one inside a non-string value is JSON-escaped (a backslash doubled)."""
    key = "sk-live-A1b2C3d4\\E5f6G7h8I9j0K1l2M3n4O5p6"
    said = "x" * 1000 + f" Bearer {key}"
    events = (sse({"error": {"message": said, "type": {"echo": key}, "code": key}})
              + sse(said, event="error") + sse({"error": said}))
    decoder = ChatChunkDecoder(secret=Secret(key))
    errors = decoder.feed(events)
    assert len(errors) == 3
    kept = [text for e in errors for text in (e.message, e.type, e.code) if text]
    assert kept[0].endswith("Bearer ****") and kept[1] == '{"echo": "****"}' and kept[2] == "****"
    assert not any(key[:12] in text or json.dumps(key)[1:13] in text for text in kept)


def test_done_keepalives_and_unknown_events():
    raw = b": ping\n\n" + b"data: \n\n" + sse({"x": 1}, event="ping") + b"data: [DONE]\n\n"
    assert decode(raw) == [DONE]


def test_a_chunk_of_too_many_values_is_refused_before_it_is_parsed(monkeypatch):
    """A chunk holds tens of JSON values; one of 2 M small integers took
    0.7 s of the event loop to parse (every other stream waiting), 17 times
    a stream before its byte bound. Counted first (``max_event_values``); a
    text full of commas is counted exactly and passes. So for an error event."""
    from lmspd.engines.upstream import chunks

    parsed: list[int] = []
    real = chunks.decode_json
    monkeypatch.setattr(chunks, "decode_json", lambda text: parsed.append(len(text)) or real(text))
    flood = {"id": "c", "model": "m", "choices": [choice({"content": "a"})], "x": [0] * 200_000}
    with pytest.raises(MalformedChunk, match="max_event_values"):
        decode(sse(flood))
    assert parsed == [], "refused without parsing"
    commas = {"id": "c", "model": "m", "choices": [choice({"content": ",[{" * 20_000})]}
    assert decode_one(commas).choices[0].delta.content == ",[{" * 20_000
    (error,) = decode(sse({"error": {"message": "m", "x": [0] * 200_000}}, event="error"))
    assert isinstance(error, ProviderError)


def test_second_done_when_drained():
    decoder = ChatChunkDecoder()
    assert decoder.feed(b"data: [DONE]\n\n") == [DONE]
    assert decoder.done_seen
    with pytest.raises(DuplicateTerminal) as info:
        decoder.feed(b"data: [DONE]\n\n")
    assert info.value.code == "upstream_duplicate_terminal"


def test_data_after_done_is_not_even_parsed():
    decoder = ChatChunkDecoder()
    decoder.feed(b"data: [DONE]\n\n")
    with pytest.raises(DataAfterDone):
        decoder.feed(b"data: {not json\n\n")


def test_truncated_event_at_close():
    decoder = ChatChunkDecoder()
    assert decoder.feed(b'data: {"choices": [') == []
    with pytest.raises(SSETruncated):
        decoder.close()


# -- strictness ---------------------------------------------------------------


def tool_delta(*calls) -> dict:
    return {"choices": [choice({"tool_calls": list(calls)})]}


@pytest.mark.parametrize(
    "payload, error",
    [
        ("{not json", MalformedChunk),
        ('{"choices": [], "usage": {"prompt_tokens": NaN}}', MalformedChunk),
        ("[1, 2]", MalformedChunk),
        ("[" * 100_000 + "]" * 100_000, MalformedChunk),
        ({"choices": {"index": 0}}, MalformedChunk),
        ({"choices": [choice({"content": 5})]}, MalformedChunk),
        ({"choices": [choice({"reasoning_content": ["a"]})]}, MalformedChunk),
        ({"choices": [choice(finish=1)]}, MalformedChunk),
        ({"choices": [{"delta": {}}]}, MalformedChunk),
        ({"choices": [{"index": -1, "delta": {}}]}, MalformedChunk),
        ({"choices": [{"index": True, "delta": {}}]}, MalformedChunk),
        ({"choices": [{"index": 0, "delta": "hi"}]}, MalformedChunk),
        ({"choices": [choice({"tool_calls": {"index": 0}})]}, MalformedChunk),
        ({"choices": [choice({"function_call": {"name": "f"}})]}, MalformedChunk),
        ({"id": 7, "choices": []}, MalformedChunk),
        ({"created": "now", "choices": []}, MalformedChunk),
        ({"choices": [], "usage": {"prompt_tokens": -1}}, MalformedChunk),
        ({"choices": [], "usage": {"prompt_tokens": "3"}}, MalformedChunk),
        ({"choices": [], "usage": []}, MalformedChunk),
        (tool_delta({"index": 0, "function": {"arguments": {"q": 1}}}), MalformedChunk),
        (tool_delta({"index": 0, "function": {"name": 3}}), MalformedChunk),
        (tool_delta({"index": 0, "type": "custom"}), MalformedChunk),
        (tool_delta({"index": 0, "function": "f"}), MalformedChunk),
        (tool_delta({"function": {"name": "f"}}), InvalidToolIndex),
        (tool_delta({"index": -1, "function": {"name": "f"}}), InvalidToolIndex),
        (tool_delta({"index": "0", "function": {"name": "f"}}), InvalidToolIndex),
        (tool_delta({"index": False}), InvalidToolIndex),
        (tool_delta({"index": 0}, {"index": 0}), DuplicateToolIndex),
        ({"choices": [choice(), choice()]}, DuplicateToolIndex),
    ],
)
def test_protocol_errors_are_typed(payload, error):
    with pytest.raises(error) as info:
        decode(sse(payload))
    assert info.value.code == error.code


def test_error_messages_never_echo_provider_bytes():
    with pytest.raises(UpstreamError) as info:
        decode(sse({"choices": [choice({"content": {"secret": "sk-live-123"}})]}))
    assert "sk-live" not in info.value.message


# -- any chunking ---------------------------------------------------------------

text = st.text(st.characters(codec="utf-8"), max_size=8)
fragment = st.builds(
    lambda index, id_, name, args: {
        "index": index,
        **({"id": id_} if id_ is not None else {}),
        "function": {**({"name": name} if name is not None else {}), "arguments": args},
    },
    st.integers(0, 3),
    st.none() | text,
    st.none() | text,
    text,
)
delta = st.fixed_dictionaries(
    {},
    optional={
        "content": st.none() | text,
        "reasoning_content": text,
        "reasoning": text,
        "tool_calls": st.lists(fragment, max_size=3, unique_by=lambda f: f["index"]),
    },
)
chunk = st.one_of(
    st.builds(
        lambda d, finish: {"id": "c", "choices": [{"index": 0, "delta": d, "finish_reason": finish}]},
        delta,
        st.sampled_from([None, "stop", "length", "tool_calls"]),
    ),
    st.builds(
        lambda p, c: {"choices": [], "usage": {"prompt_tokens": p, "completion_tokens": c}},
        st.integers(0, 10**6),
        st.integers(0, 10**6),
    ),
)


@st.composite
def chat_streams(draw) -> bytes:
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    out = []
    for payload in draw(st.lists(chunk, max_size=8)):
        body = json.dumps(payload, ensure_ascii=draw(st.booleans())).encode()
        out.append(b"data: " + body + eol + eol)
        if draw(st.booleans()):
            out.append(b": keep-alive" + eol)
    return b"".join(out) + b"data: [DONE]" + eol + eol


def run(chunks: list[bytes]):
    decoder = ChatChunkDecoder()
    items = []
    try:
        for piece in chunks:
            items.extend(decoder.iter_feed(piece))
        items.extend(decoder.close())
    except UpstreamError as exc:
        return items, type(exc)
    return items, None


@FAST
@given(st.data())
def test_any_chunking_yields_identical_items(data):
    raw = data.draw(chat_streams())
    expected = run([raw])
    assert expected[1] is None
    assert expected[0][-1] == DONE
    assert run([raw[i : i + 1] for i in range(len(raw))]) == expected
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(raw) - 1), max_size=10))))
    bounds = [0, *cuts, len(raw)]
    assert run([raw[a:b] for a, b in pairwise(bounds)]) == expected
