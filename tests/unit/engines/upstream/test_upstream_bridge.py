"""The bridge: hostile provider streams -> exactly the neutral events we expect.

Every adversarial stream is checked under every single cut point and byte
by byte, so "fragments split at every byte" holds for each case, not one.
"""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.core.events import (
    Failed,
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStarted,
    Usage,
)
from lmspd.core.limits import UpstreamStreamLimits
from lmspd.engines.upstream.bridge import BridgeDecoder
from lmspd.engines.upstream.chunks import DONE as DONE_ITEM
from lmspd.engines.upstream.chunks import ChatChunk, ChatDelta, ChunkChoice, ProviderError, ToolCallFragment
from lmspd.engines.upstream.errors import UpstreamCancelled, UpstreamTimeout

FAST = settings(max_examples=200, deadline=None)
DONE = b"data: [DONE]\n\n"
PATCH = "__lmspd_custom_apply_patch"


# -- stream builders ------------------------------------------------------------


def sse(payload) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def chunk(delta: dict | None = None, finish: str | None = None, index: int = 0) -> bytes:
    return sse(
        {
            "id": "chatcmpl-private",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "provider-model",
            "choices": [{"index": index, "delta": delta or {}, "finish_reason": finish}],
        }
    )


def text(t: str) -> bytes:
    return chunk({"content": t})


def tool(
    index: int, id: str | None = None, name: str | None = None, args: str | None = None, choice: int = 0
) -> bytes:
    call: dict = {"index": index}
    if id is not None:
        call["id"] = id
        call["type"] = "function"
    function = {}
    if name is not None:
        function["name"] = name
    if args is not None:
        function["arguments"] = args
    call["function"] = function
    return chunk({"tool_calls": [call]}, index=choice)


def finish(reason: str) -> bytes:
    return chunk(finish=reason)


def usage(prompt: int, completion: int, cached: int = 0, reasoning: int = 0) -> bytes:
    return sse(
        {
            "choices": [],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
                "completion_tokens_details": {"reasoning_tokens": reasoning},
            },
        }
    )


# -- running --------------------------------------------------------------------


def F(code: str) -> tuple[str, str]:
    """Expected Failed, compared by code (messages are checked separately)."""
    return ("Failed", code)


def shape(events: list) -> list:
    return [("Failed", e.code) if isinstance(e, Failed) else e for e in events]


def feed_all(chunks: list[bytes], **options) -> list:
    bridge = BridgeDecoder(
        options.get("allowed", ("lookup", "search")),
        options.get("wrappers", {PATCH: "apply_patch"}),
        options.get("limits"),
    )
    events = []
    for piece in chunks:
        events.extend(bridge.feed(piece))
    events.extend(bridge.close())
    # The contract every stream keeps: exactly one terminal, last, then silence.
    terminals = [e for e in events if isinstance(e, Finished | Failed)]
    assert len(terminals) == 1 and events[-1] is terminals[0]
    assert bridge.done
    assert bridge.feed(b"data: [DONE]\n\n") == [] and bridge.close() == []
    return events


def bridge_events(raw: bytes, **options) -> list:
    """Events for ``raw`` — asserted identical under every chunking tried."""
    events = feed_all([raw], **options)
    assert feed_all([raw[i : i + 1] for i in range(len(raw))], **options) == events
    for cut in range(1, len(raw)):
        assert feed_all([raw[:cut], raw[cut:]], **options) == events, cut
    return shape(events)


def released_names(events: list) -> set[str]:
    return {e.name for e in events if isinstance(e, ToolCallStarted)}


# -- the allowlist ----------------------------------------------------------------


def test_name_growing_from_lookup_into_lookupEvil_fails_and_releases_nothing():
    raw = (
        text("Let me check.")
        + tool(0, id="call_1", name="lookup", args='{"q":')
        + tool(0, args='"x"}')
        + tool(0, name="Evil")
        + finish("tool_calls")
        + DONE
    )
    events = bridge_events(raw)
    assert events == [TextDelta("Let me check."), F("undeclared_tool")]
    assert not released_names(events)


def test_one_undeclared_call_fails_the_allowed_ones_too():
    raw = (
        tool(0, id="call_a", name="lookup", args="{}")
        + tool(1, id="call_b", name="lookupEvil", args="{}")
        + finish("tool_calls")
        + DONE
    )
    assert bridge_events(raw) == [F("undeclared_tool")]


def test_undeclared_message_does_not_echo_the_name():
    raw = tool(0, id="c", name="rm_rf_everything", args="{}") + finish("tool_calls") + DONE
    (failed,) = feed_all([raw])
    assert failed.code == "undeclared_tool" and "rm_rf" not in failed.message


def test_synthetic_wrapper_name_is_allowed_only_as_a_wrapper():
    raw = tool(0, id="c", name="apply_patch", args='{"input": "x"}') + finish("tool_calls") + DONE
    assert bridge_events(raw, allowed=()) == [F("undeclared_tool")]


def test_tool_call_without_a_name_fails():
    raw = tool(0, id="call_a", args="{}") + finish("tool_calls") + DONE
    assert bridge_events(raw) == [F("upstream_missing_tool_name")]


# -- releasing tool calls ---------------------------------------------------------


def test_fragmented_call_is_released_whole_at_done():
    raw = (
        tool(0, id="call_abc", name="loo")
        + tool(0, name="kup", args='{"city"')
        + tool(0, args=': "Paris"}')
        + finish("tool_calls")
        + DONE
    )
    assert bridge_events(raw) == [
        ToolCallStarted(0, "call_abc", "lookup"),
        ToolCallDelta(0, '{"city": "Paris"}'),
        ToolCallDone(0, '{"city": "Paris"}'),
        Finished("tool_calls"),
    ]


def test_parallel_tool_calls_across_indexes():
    raw = (
        tool(0, id="call_a", name="lookup", args='{"a"')
        + tool(1, id="call_b", name="search", args='{"b"')
        + tool(0, args=": 1}")
        + tool(1, args=": 2}")
        + finish("tool_calls")
        + DONE
    )
    assert bridge_events(raw) == [
        ToolCallStarted(0, "call_a", "lookup"),
        ToolCallDelta(0, '{"a": 1}'),
        ToolCallDone(0, '{"a": 1}'),
        ToolCallStarted(1, "call_b", "search"),
        ToolCallDelta(1, '{"b": 2}'),
        ToolCallDone(1, '{"b": 2}'),
        Finished("tool_calls"),
    ]


def test_parallel_calls_all_sent_at_index_0_stay_separate_calls():
    """Ollama (and LiteLLM's bridge, some gateways) send every parallel call
    at index 0, each with its own id: they were merged into one call with
    id ``call_1call_2`` and arguments ``{"q": 1}{"q": 2}``, or, of two
    functions, one named ``lookupsearch`` that failed as undeclared."""
    raw = (
        tool(0, id="call_1", name="lookup", args='{"q": 1}')
        + tool(0, id="call_2", name="lookup", args='{"q"')
        + tool(0, args=": 2}")
        + tool(0, id="call_3", name="search", args="{}")
        + finish("tool_calls")
        + DONE
    )
    assert bridge_events(raw) == [
        ToolCallStarted(0, "call_1", "lookup"),
        ToolCallDelta(0, '{"q": 1}'),
        ToolCallDone(0, '{"q": 1}'),
        ToolCallStarted(1, "call_2", "lookup"),
        ToolCallDelta(1, '{"q": 2}'),
        ToolCallDone(1, '{"q": 2}'),
        ToolCallStarted(2, "call_3", "search"),
        ToolCallDelta(2, "{}"),
        ToolCallDone(2, "{}"),
        Finished("tool_calls"),
    ]


def test_a_provider_index_that_a_moved_call_took_is_a_call_of_its_own():
    raw = (
        tool(0, id="call_1", name="lookup", args="{}")
        + tool(0, id="call_2", name="search", args="{}")  # moved past 0: to 1
        + tool(1, id="call_3", name="lookup", args='{"x": 1}')  # the provider's own index 1
        + finish("tool_calls")
        + DONE
    )
    events = bridge_events(raw)
    started = [e for e in events if isinstance(e, ToolCallStarted)]
    assert [(e.call_id, e.name) for e in started] == [("call_1", "lookup"), ("call_2", "search"),
                                                      ("call_3", "lookup")]
    assert [e.payload for e in events if isinstance(e, ToolCallDone)] == ["{}", "{}", '{"x": 1}']


def test_missing_call_id_becomes_call_choice_tool():
    raw = (
        tool(0, id="call_real", name="lookup", args="{}")
        + tool(1, name="search", args='{"q": 1}')
        + finish("tool_calls")
        + DONE
    )
    assert bridge_events(raw) == [
        ToolCallStarted(0, "call_real", "lookup"),
        ToolCallDelta(0, "{}"),
        ToolCallDone(0, "{}"),
        ToolCallStarted(1, "call_0_1", "search"),
        ToolCallDelta(1, '{"q": 1}'),
        ToolCallDone(1, '{"q": 1}'),
        Finished("tool_calls"),
    ]


def test_sparse_provider_indexes_become_dense_event_indexes():
    raw = tool(3, name="lookup", args="{}") + finish("tool_calls") + DONE
    assert bridge_events(raw)[0] == ToolCallStarted(0, "call_0_3", "lookup")


def test_unsafe_provider_call_id_is_not_made_public():
    raw = tool(0, id="call <script>", name="lookup", args="{}") + finish("tool_calls") + DONE
    assert bridge_events(raw)[0] == ToolCallStarted(0, "call_0_0", "lookup")


def test_repeated_and_fragmented_call_ids():
    raw = (
        tool(0, id="call_", name="lookup")
        + tool(0, id="xyz", args="{}")
        + tool(1, id="call_r", name="search")
        + tool(1, id="call_r", args="{}")  # a provider resending the whole id
        + finish("tool_calls")
        + DONE
    )
    events = bridge_events(raw)
    assert [e.call_id for e in events if isinstance(e, ToolCallStarted)] == ["call_xyz", "call_r"]


def test_duplicate_call_ids_fail():
    raw = (
        tool(0, id="call_same", name="lookup", args="{}")
        + tool(1, id="call_same", name="search", args="{}")
        + finish("tool_calls")
        + DONE
    )
    assert bridge_events(raw) == [F("upstream_duplicate_call_id")]


def test_a_stand_in_id_never_collides_with_a_provider_id():
    # The provider did nothing wrong: its own id happens to look like the
    # stand-in for the call whose id it left out.
    raw = (
        tool(0, id="call_0_1", name="lookup", args="{}")
        + tool(1, name="search", args="{}")
        + finish("tool_calls")
        + DONE
    )
    events = bridge_events(raw)
    assert [e.call_id for e in events if isinstance(e, ToolCallStarted)] == ["call_0_1", "call_0_1_1"]


def test_no_argument_call_gets_empty_object():
    raw = tool(0, id="call_a", name="lookup") + finish("tool_calls") + DONE
    assert bridge_events(raw)[:3] == [
        ToolCallStarted(0, "call_a", "lookup"),
        ToolCallDelta(0, "{}"),
        ToolCallDone(0, "{}"),
    ]


def test_stop_with_tool_calls_still_reports_tool_calls():
    # Several local servers report "stop" after a tool call.
    raw = tool(0, id="call_a", name="lookup", args="{}") + finish("stop") + DONE
    assert bridge_events(raw)[-1] == Finished("tool_calls")


# -- custom tools -----------------------------------------------------------------

PATCH_TEXT = '*** Begin Patch\n*** Add File: a.txt\n+hé "quoted" \\ end\n*** End Patch\n'


def test_custom_tool_wrapper_is_unwrapped_once_complete():
    wrapped = json.dumps({"input": PATCH_TEXT})
    pieces = [wrapped[i : i + 7] for i in range(0, len(wrapped), 7)]
    raw = (
        tool(0, id="call_p", name=PATCH[:9])
        + tool(0, name=PATCH[9:])
        + b"".join(tool(0, args=p) for p in pieces)
        + finish("tool_calls")
        + DONE
    )
    events = bridge_events(raw)
    assert events == [
        ToolCallStarted(0, "call_p", "apply_patch", kind="custom"),
        ToolCallDelta(0, PATCH_TEXT),
        ToolCallDone(0, PATCH_TEXT),
        Finished("tool_calls"),
    ]
    assert PATCH not in repr(events)


@pytest.mark.parametrize(
    "arguments",
    [
        '{"input": "unterminated',
        '{"input": 5}',
        '{"input": "x", "extra": 1}',
        '{"input": "A", "input": "B"}',  # no one input (json.loads took the last)
        '{"input": "x\\ud800"}',  # half a character
        '{"patch": "x"}',
        '["x"]',
        '"x"',
        "",
    ],
)
def test_malformed_custom_tool_wrapper_fails(arguments):
    raw = tool(0, id="call_p", name=PATCH, args=arguments) + finish("tool_calls") + DONE
    events = bridge_events(raw)
    assert events == [F("upstream_malformed_custom_tool_input")]
    assert PATCH not in repr(feed_all([raw]))


def test_custom_and_function_calls_together():
    raw = (
        tool(0, id="call_f", name="lookup", args="{}")
        + tool(1, id="call_c", name=PATCH, args='{"input": "raw"}')
        + finish("tool_calls")
        + DONE
    )
    assert bridge_events(raw) == [
        ToolCallStarted(0, "call_f", "lookup"),
        ToolCallDelta(0, "{}"),
        ToolCallDone(0, "{}"),
        ToolCallStarted(1, "call_c", "apply_patch", kind="custom"),
        ToolCallDelta(1, "raw"),
        ToolCallDone(1, "raw"),
        Finished("tool_calls"),
    ]


# -- text, reasoning, usage, finish ---------------------------------------------------


def test_text_and_reasoning_stream_immediately():
    bridge = BridgeDecoder(["lookup"])
    assert bridge.feed(chunk({"reasoning_content": "Think"})) == [ReasoningDelta("Think")]
    assert bridge.feed(chunk({"reasoning": " more"})) == [ReasoningDelta(" more")]
    assert bridge.feed(text("Hel")) == [TextDelta("Hel")]
    assert bridge.feed(text("lo")[:-5]) == []
    assert bridge.feed(text("lo")[-5:]) == [TextDelta("lo")]


def test_reasoning_sent_in_both_fields_is_emitted_once():
    raw = chunk({"reasoning_content": "r", "reasoning": "r", "content": "t"}) + finish("stop") + DONE
    assert bridge_events(raw) == [ReasoningDelta("r"), TextDelta("t"), Finished("stop")]


def test_usage_from_the_final_usage_chunk():
    raw = text("Hi") + finish("stop") + usage(12, 3, cached=8, reasoning=1) + DONE
    assert bridge_events(raw) == [
        TextDelta("Hi"),
        Finished("stop", Usage(input_tokens=12, output_tokens=3, cached_tokens=8, reasoning_tokens=1)),
    ]


def test_length_finish_is_incomplete_and_releases_no_cut_off_call():
    raw = text("Hi") + tool(0, id="call_a", name="lookup", args='{"q": "tru') + finish("length") + DONE
    assert bridge_events(raw) == [TextDelta("Hi"), Finished("length")]


def test_content_filter_is_incomplete_and_releases_no_call():
    raw = text("a") + tool(0, id="call_a", name="lookup", args="{}") + finish("content_filter") + DONE
    assert bridge_events(raw) == [TextDelta("a"), Finished("content_filter")]


def test_unknown_finish_reason_fails():
    assert bridge_events(finish("eos") + DONE) == [F("upstream_malformed_chunk")]


def test_finish_without_done_then_eof_completes():
    assert bridge_events(text("a") + finish("stop")) == [TextDelta("a"), Finished("stop")]


def test_a_closing_done_without_its_blank_line_completes():
    """A provider ending on ``data: [DONE]\\n`` and EOF: the stream failed as
    truncated after all of it had arrived."""
    assert bridge_events(text("a") + finish("stop") + b"data: [DONE]\n") == [TextDelta("a"), Finished("stop")]


def test_done_without_finish_reason_completes():
    # A common provider quirk: text, then [DONE] with no finish reason.
    assert bridge_events(text("a") + DONE) == [TextDelta("a"), Finished("stop")]


def test_done_without_finish_reason_after_a_call_began_fails():
    # The arguments may be cut off: the call is never released as complete.
    raw = tool(0, id="call_a", name="lookup", args='{"q": "ab') + DONE
    assert bridge_events(raw) == [("Failed", "upstream_truncated")]


def test_done_with_no_choice_at_all_fails():
    assert bridge_events(DONE) == [("Failed", "upstream_truncated")]


def test_empty_strings_are_not_events():
    raw = (
        chunk({"role": "assistant", "content": ""}) + text("a") + chunk({"content": ""}, finish="stop") + DONE
    )
    assert bridge_events(raw) == [TextDelta("a"), Finished("stop")]


def test_provider_metadata_stays_private():
    bridge = BridgeDecoder(["lookup"])
    events = bridge.feed(text("a") + finish("stop") + DONE)
    assert (bridge.provider_response_id, bridge.provider_model, bridge.provider_created) == (
        "chatcmpl-private",
        "provider-model",
        1,
    )
    assert "chatcmpl-private" not in repr(events)


# -- terminal markers ---------------------------------------------------------------


def test_second_done_is_never_read():
    raw = text("a") + finish("stop") + DONE + DONE
    assert bridge_events(raw) == [TextDelta("a"), Finished("stop")]


def test_bytes_after_done_are_not_parsed():
    # An oversized line and garbage after [DONE], in the same read: no failure,
    # because the bridge stops parsing at the first terminal marker.
    limits = UpstreamStreamLimits(max_line_bytes=200)
    raw = text("a") + DONE + b"data: " + b"x" * 500 + b"\n\n" + b"data: {broken\n\n"
    bridge = BridgeDecoder(["lookup"], limits=limits)
    assert bridge.feed(raw) == [TextDelta("a"), Finished("stop")]
    assert bridge.done
    assert bridge.feed(b"more") == [] and bridge.close() == []


def test_truncated_event_fails():
    raw = text("a") + b'data: {"choices": [{"index": 0, "delta": {"content": "b'
    assert bridge_events(raw) == [TextDelta("a"), F("upstream_sse_truncated")]


def test_eof_before_any_finish_fails_truncated():
    assert bridge_events(text("a")) == [TextDelta("a"), F("upstream_truncated")]
    assert bridge_events(b"") == [F("upstream_truncated")]
    assert bridge_events(b": keep-alive\n\n") == [F("upstream_truncated")]


def test_eof_with_a_pending_tool_call_and_no_finish_fails():
    raw = tool(0, id="call_a", name="lookup", args="{}")
    assert bridge_events(raw) == [F("upstream_truncated")]


# -- incoherent streams ---------------------------------------------------------------


@pytest.mark.parametrize(
    "after",
    [
        text("late"),
        chunk({"reasoning_content": "late"}),
        chunk({"refusal": "late"}),
    ],
)
def test_deltas_after_finish_fail(after):
    raw = text("a") + finish("stop") + after + DONE
    assert bridge_events(raw) == [TextDelta("a"), F("upstream_delta_after_finish")]


def test_trailing_argument_fragments_after_tool_calls_finish_are_kept():
    raw = (
        tool(0, id="call_a", name="lookup", args='{"q"')
        + finish("tool_calls")
        + tool(0, id="call_a", args=": 1}")
        + DONE
    )
    assert bridge_events(raw) == [
        ToolCallStarted(0, "call_a", "lookup"),
        ToolCallDelta(0, '{"q": 1}'),
        ToolCallDone(0, '{"q": 1}'),
        Finished("tool_calls"),
    ]


@pytest.mark.parametrize(
    "finish_reason, after",
    [
        ("tool_calls", tool(1, id="call_b", name="search", args="{}")),  # a new index
        ("tool_calls", tool(0, name="Evil")),  # a name fragment
        ("tool_calls", tool(0, id="call_other")),  # an id change
        ("stop", tool(0, args="}")),  # arguments after a non-tool finish
    ],
)
def test_tool_fragments_after_finish_that_are_not_trailing_arguments_fail(finish_reason, after):
    raw = tool(0, id="call_a", name="lookup", args="{") + finish(finish_reason) + after + DONE
    assert bridge_events(raw) == [F("upstream_delta_after_finish")]


def test_contradictory_finish_reasons_fail():
    raw = text("a") + finish("stop") + finish("length") + DONE
    assert bridge_events(raw) == [TextDelta("a"), F("upstream_contradictory_finish")]


def test_repeated_identical_finish_is_fine():
    raw = text("a") + finish("stop") + finish("stop") + DONE
    assert bridge_events(raw) == [TextDelta("a"), Finished("stop")]


def test_missing_tool_index_fails():
    raw = text("a") + chunk({"tool_calls": [{"id": "call_a", "function": {"name": "lookup"}}]}) + DONE
    assert bridge_events(raw) == [TextDelta("a"), F("upstream_invalid_tool_index")]


def test_negative_tool_index_fails():
    raw = chunk({"tool_calls": [{"index": -1, "id": "call_a", "function": {"name": "lookup"}}]}) + DONE
    assert bridge_events(raw) == [F("upstream_invalid_tool_index")]


def test_repeated_tool_index_within_one_chunk_fails():
    calls = [{"index": 0, "function": {"name": "lookup"}}, {"index": 0, "function": {"name": "Evil"}}]
    assert bridge_events(chunk({"tool_calls": calls}) + DONE) == [F("upstream_duplicate_tool_index")]


def test_malformed_json_fails():
    assert bridge_events(text("a") + b"data: {nope\n\n" + DONE) == [
        TextDelta("a"),
        F("upstream_malformed_chunk"),
    ]


# -- provider errors ------------------------------------------------------------------


def test_provider_error_payload_fails_sanitized():
    raw = (
        text("partial")
        + sse(
            {
                "error": {
                    "message": "Incorrect API key: sk-live-SECRET",
                    "type": "auth",
                    "code": "invalid_api_key",
                }
            }
        )
        + DONE
    )
    assert bridge_events(raw) == [TextDelta("partial"), F("upstream_provider_error")]
    failed = feed_all([raw])[-1]
    assert failed.message == "The upstream provider reported an error (invalid_api_key)."
    assert "SECRET" not in failed.message


def test_provider_error_with_unsafe_code_gets_the_generic_message():
    raw = sse({"error": {"message": "x", "code": "<b>sk-live-SECRET with spaces</b>"}})
    (failed,) = feed_all([raw])
    assert failed == Failed("upstream_provider_error", "The upstream provider reported an error.")


def test_an_in_stream_context_overflow_is_named_by_its_code_only():
    raw = sse({"object": "error", "message": "The input (4476 tokens) is longer than the model's context length "
               "(4096 tokens).", "type": "BadRequestError", "param": None, "code": 400})
    (failed,) = feed_all([raw])
    assert failed == Failed("upstream_provider_error",
                            "The upstream provider reported an error (context_length_exceeded).")


def test_error_event_fails():
    raw = text("a") + b"event: error\ndata: upstream exploded\n\n"
    assert bridge_events(raw) == [TextDelta("a"), F("upstream_provider_error")]


def test_usage_seen_before_a_failure_is_kept():
    raw = usage(5, 1) + sse({"error": "boom"})
    (failed,) = feed_all([raw])
    assert failed.usage == Usage(input_tokens=5, output_tokens=1)


# -- limits ---------------------------------------------------------------------------


def test_oversized_line_fails():
    limits = UpstreamStreamLimits(max_line_bytes=200)
    raw = text("ok") + text("x" * 300) + DONE
    assert bridge_events(raw, limits=limits) == [TextDelta("ok"), F("upstream_sse_line_too_long")]


def test_too_many_choices_fails():
    raw = text("a") + chunk({"content": "b"}, index=1) + DONE
    assert bridge_events(raw) == [TextDelta("a"), F("upstream_limit_exceeded")]


@pytest.mark.parametrize(
    "limits, raw",
    [
        (UpstreamStreamLimits(max_tool_calls=2), tool(2, name="lookup")),
        (  # the count is across choices, not per choice
            UpstreamStreamLimits(max_tool_calls=2, max_choices=2),
            tool(0, name="lookup") + tool(1, name="lookup") + tool(0, name="lookup", choice=1),
        ),
        (UpstreamStreamLimits(max_tool_name_chars=8), tool(0, name="lookup") + tool(0, name="Evil")),
        (UpstreamStreamLimits(max_tool_call_id_chars=8), tool(0, id="call_", name="x") + tool(0, id="1234")),
        (
            UpstreamStreamLimits(max_tool_argument_bytes=10),
            tool(0, name="lookup", args='{"a": 1') + tool(0, args="2345}"),
        ),
        (UpstreamStreamLimits(max_tool_argument_bytes=10), tool(0, name="lookup", args="é" * 6)),
        (
            UpstreamStreamLimits(max_aggregate_bytes=800),
            b"".join(tool(i, name="lookup", args="x" * 100) for i in range(5)),
        ),
    ],
)
def test_reconstruction_limits_fail(limits, raw):
    events = bridge_events(raw + finish("tool_calls") + DONE, limits=limits)
    assert events[-1][1] in ("upstream_limit_exceeded", "upstream_aggregate_exceeded")
    assert not released_names(events)


def test_retained_bytes_are_charged_even_for_pushed_items():
    # push() bypasses the byte-level aggregate, so reconstruction charges its own.
    bridge = BridgeDecoder(["lookup"], limits=UpstreamStreamLimits(max_aggregate_bytes=100))
    fragment = ToolCallFragment(0, name="lookup", arguments="x" * 90)
    assert bridge.push(ChatChunk(choices=(ChunkChoice(0, ChatDelta(tool_calls=(fragment,))),))) == []
    more = ToolCallFragment(0, arguments="y" * 10)
    (failed,) = bridge.push(ChatChunk(choices=(ChunkChoice(0, ChatDelta(tool_calls=(more,))),)))
    assert failed.code == "upstream_limit_exceeded" and "max_aggregate_bytes" in failed.message


def test_limit_error_names_the_limit():
    raw = tool(0, name="lookup") + tool(0, name="Evil")
    (failed,) = feed_all([raw], limits=UpstreamStreamLimits(max_tool_name_chars=8))
    assert failed == Failed("upstream_limit_exceeded", "The upstream stream exceeded max_tool_name_chars=8.")


# -- the API around it ----------------------------------------------------------------


def test_fail_from_transport_and_after_done():
    bridge = BridgeDecoder(["lookup"])
    assert bridge.feed(text("a")) == [TextDelta("a")]
    assert shape(bridge.fail(UpstreamTimeout())) == [F("upstream_timeout")]
    assert bridge.fail(UpstreamCancelled()) == []
    assert bridge.feed(text("b")) == [] and bridge.close() == []


def test_push_decoded_items():
    bridge = BridgeDecoder(["lookup"])
    assert bridge.push(ChatChunk(choices=(ChunkChoice(0, ChatDelta(content="hi")),))) == [TextDelta("hi")]
    assert bridge.push(DONE_ITEM) == [Finished("stop")]
    assert bridge.push(ProviderError("late")) == []


# -- properties -----------------------------------------------------------------------

piece = st.text(st.characters(codec="utf-8"), min_size=1, max_size=6)


@st.composite
def tool_call_plans(draw, index: int):
    name = draw(st.sampled_from(["lookup", "search", PATCH]))
    if name == PATCH:
        raw = draw(st.text(st.characters(codec="utf-8"), max_size=20))
        arguments = json.dumps({"input": raw}, ensure_ascii=draw(st.booleans()))
        expected_payload, public_name, kind = raw, "apply_patch", "custom"
    else:
        arguments = json.dumps({"q": draw(st.text(max_size=10))})
        expected_payload, public_name, kind = arguments, name, "function"
    call_id = draw(st.none() | st.from_regex(r"call_[A-Za-z0-9]{4,8}", fullmatch=True))

    def cut(s: str) -> list[str]:
        points = sorted(set(draw(st.lists(st.integers(1, max(len(s) - 1, 1)), max_size=4))))
        bounds = [0, *[p for p in points if p < len(s)], len(s)]
        return [s[a:b] for a, b in pairwise(bounds)]

    fragments = []
    for i, name_part in enumerate(cut(name)):
        id_field = {"id": call_id} if i == 0 and call_id else {}
        fragments.append({"index": index, **id_field, "function": {"name": name_part}})
    for arg_part in cut(arguments):
        fragments.append({"index": index, "function": {"arguments": arg_part}})
    return fragments, (call_id or f"call_0_{index}", public_name, kind, expected_payload)


@st.composite
def plans(draw):
    reasoning = draw(st.lists(piece, max_size=3))
    texts = draw(st.lists(piece, max_size=3))
    n_calls = draw(st.integers(0, 3))
    calls = [draw(tool_call_plans(i)) for i in range(n_calls)]
    ids = [c[1][0] for c in calls]
    if len(set(ids)) != len(ids):
        calls = calls[:1]
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))

    def frame(payload) -> bytes:
        return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + eol + eol

    def one(delta=None, finish=None) -> bytes:
        return frame({"id": "p", "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]})

    out = [one({"reasoning_content": r}) for r in reasoning]
    out += [one({"content": t}) for t in texts]
    # Interleave the calls' fragments, keeping each call's own order.
    queues = [list(fragments) for fragments, _ in calls]
    while any(queues):
        q = draw(st.sampled_from([q for q in queues if q]))
        out.append(one({"tool_calls": [q.pop(0)]}))
    out.append(one(finish="tool_calls" if calls else "stop"))
    out.append(frame({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}))
    out.append(b"data: [DONE]" + eol + eol)

    expected = [ReasoningDelta(r) for r in reasoning] + [TextDelta(t) for t in texts]
    for i, (_, (call_id, name, kind, payload)) in enumerate(calls):
        expected.append(ToolCallStarted(i, call_id, name, kind=kind))
        if payload:
            expected.append(ToolCallDelta(i, payload))
        expected.append(ToolCallDone(i, payload))
    expected.append(Finished("tool_calls" if calls else "stop", Usage(input_tokens=7, output_tokens=2)))
    return b"".join(out), expected


@FAST
@given(st.data())
def test_any_chunking_of_a_valid_stream_yields_the_planned_events(data):
    raw, expected = data.draw(plans())
    assert feed_all([raw]) == expected
    assert feed_all([raw[i : i + 1] for i in range(len(raw))]) == expected
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(raw) - 1), max_size=12))))
    bounds = [0, *cuts, len(raw)]
    assert feed_all([raw[a:b] for a, b in pairwise(bounds)]) == expected


@FAST
@given(st.data())
def test_any_bytes_any_chunking_end_in_exactly_one_terminal(data):
    # Mutated valid streams and plain noise: the bridge never raises, always
    # ends with one terminal event, and the outcome ignores chunk boundaries.
    raw, _ = data.draw(plans())
    raw = bytearray(raw)
    for _ in range(data.draw(st.integers(0, 4))):
        if not raw:
            break
        at = data.draw(st.integers(0, len(raw) - 1))
        action = data.draw(st.sampled_from(["flip", "cut", "dup"]))
        if action == "flip":
            raw[at] = data.draw(st.integers(0, 255))
        elif action == "cut":
            del raw[at:]
        else:
            raw[at:at] = raw[at : at + data.draw(st.integers(1, 40))]
    raw = bytes(raw) if data.draw(st.booleans()) else data.draw(st.binary(max_size=200))
    tight = UpstreamStreamLimits(max_line_bytes=80, max_tool_argument_bytes=16)
    limits = data.draw(st.sampled_from([None, tight]))
    expected = feed_all([raw], limits=limits)  # asserts the one-terminal contract
    assert feed_all([raw[i : i + 1] for i in range(len(raw))], limits=limits) == expected
    if len(raw) > 1:
        cuts = sorted(set(data.draw(st.lists(st.integers(1, len(raw) - 1), max_size=8))))
        bounds = [0, *cuts, len(raw)]
        assert feed_all([raw[a:b] for a, b in pairwise(bounds)], limits=limits) == expected
    assert not released_names(expected) - {"lookup", "search", "apply_patch"}
