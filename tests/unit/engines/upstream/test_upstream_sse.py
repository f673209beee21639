"""The bounded SSE decoder: WHATWG parsing, any chunking, limits at the byte."""

from __future__ import annotations

import re
import tracemalloc
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.core.limits import UpstreamStreamLimits
from lmspd.engines.upstream.errors import (
    SSEAggregateExceeded,
    SSEBufferExceeded,
    SSEEventTooLarge,
    SSELineTooLong,
    SSETruncated,
    UpstreamError,
)
from lmspd.engines.upstream.sse import SSEDecoder, SSEEvent

BOM = b"\xef\xbb\xbf"
FAST = settings(max_examples=200, deadline=None)


# -- helpers ------------------------------------------------------------------


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(set(cuts)), len(data)]
    return [data[a:b] for a, b in pairwise(bounds)]


def run(chunks: list[bytes], limits: UpstreamStreamLimits | None = None):
    """Events produced before any error, and the error's type (or None)."""
    decoder = SSEDecoder(limits)
    events: list[SSEEvent] = []
    try:
        for chunk in chunks:
            events.extend(decoder.iter_feed(chunk))
        events.extend(decoder.close())
    except UpstreamError as exc:
        return events, type(exc)
    return events, None


def whole(data: bytes, limits: UpstreamStreamLimits | None = None):
    return run([data], limits)


def bytewise(data: bytes, limits: UpstreamStreamLimits | None = None):
    return run([data[i : i + 1] for i in range(len(data))], limits)


def reference(raw: bytes):
    """A deliberately naive, whole-buffer reading of the WHATWG algorithm."""
    if raw.startswith(BOM):
        raw = raw[3:]
    *lines, tail = re.split(rb"\r\n|\r|\n", raw)
    events, data, event_type, last_id, retry = [], [], b"", "", None
    for line in lines:
        if line == b"":
            if data:
                events.append(
                    SSEEvent(
                        b"\n".join(data).decode("utf-8", "replace"),
                        event_type.decode("utf-8", "replace") or "message",
                        last_id,
                        retry,
                    )
                )
            data, event_type = [], b""
            continue
        if line.startswith(b":"):
            continue
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            event_type = value
        elif name == b"id" and b"\0" not in value:
            last_id = value.decode("utf-8", "replace")
        elif name == b"retry" and value.isdigit() and len(value) <= 12:
            retry = int(value)
    partial_data = tail.partition(b":")[0] == b"data"
    if data == [b"[DONE]"] and not partial_data:
        # lmspd's one departure from WHATWG: a closing [DONE] without its blank line is delivered.
        events.append(SSEEvent("[DONE]", event_type.decode("utf-8", "replace") or "message", last_id, retry))
        data = []
    truncated = bool(data) or partial_data
    return events, (SSETruncated if truncated else None)


# -- strategies ---------------------------------------------------------------

text = st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=12)
line = st.one_of(
    text.map(lambda t: "data: " + t),
    text.map(lambda t: "data:" + t),
    st.just("data"),
    text.map(lambda t: "event: " + t),
    text.map(lambda t: "id: " + t),
    st.sampled_from(["retry: 3000", "retry: x1", "id: a\0b"]),
    text.map(lambda t: ":" + t),
    text,
    st.just(""),
)
eol = st.sampled_from(["\n", "\r", "\r\n"])


@st.composite
def sse_streams(draw) -> bytes:
    lines = draw(st.lists(st.tuples(line, eol), max_size=20))
    body = "".join(content + end for content, end in lines) + draw(eol)
    raw = body.encode("utf-8")
    return (BOM if draw(st.booleans()) else b"") + raw


@st.composite
def split_points(draw, data: bytes) -> list[int]:
    if len(data) < 2:
        return []
    return draw(st.lists(st.integers(1, len(data) - 1), max_size=12))


# -- properties ---------------------------------------------------------------


@FAST
@given(st.data())
def test_any_chunking_matches_the_reference_parser(data):
    raw = data.draw(sse_streams())
    expected = reference(raw)
    assert whole(raw) == expected
    assert bytewise(raw) == expected
    assert run(split_at(raw, data.draw(split_points(raw)))) == expected


# Line endings, split UTF-8 and long runs, glued at random.
NASTY_PIECES = [b"data: x", b"\r", b"\n", b"\xe2\x82", b"\xac", b":", b"y" * 9]

SMALL = UpstreamStreamLimits(
    max_line_bytes=24, max_event_bytes=40, max_buffered_bytes=48, max_aggregate_bytes=200
)
# One limit at a time tight, so each is the one that fires now and then.
TIGHT = [
    SMALL,
    UpstreamStreamLimits(max_aggregate_bytes=64),
    UpstreamStreamLimits(max_event_bytes=20),
    UpstreamStreamLimits(max_buffered_bytes=30),
]


@FAST
@given(st.data())
def test_any_chunking_of_arbitrary_bytes_gives_the_same_outcome(data):
    # Errors included: the events before a limit error, and which error,
    # depend only on the bytes.
    raw = data.draw(
        st.one_of(
            st.binary(max_size=300),
            sse_streams(),
            st.lists(st.sampled_from(NASTY_PIECES), max_size=60).map(b"".join),
        )
    )
    for limits in (None, *TIGHT):
        expected = whole(raw, limits)
        assert bytewise(raw, limits) == expected
        assert run(split_at(raw, data.draw(split_points(raw))), limits) == expected


def test_every_single_cut_of_a_mixed_stream():
    raw = BOM + "data: héllo €\r\ndata: 𝄞\r\nevent: e\r\nid: 7\r\n\r\n: ping\rdata: two\r\r".encode()
    expected = whole(raw)
    assert expected == (
        [SSEEvent("héllo €\n𝄞", "e", "7"), SSEEvent("two", "message", "7")],
        None,
    )
    for cut in range(1, len(raw)):
        assert run([raw[:cut], raw[cut:]]) == expected, cut


# -- parsing rules ------------------------------------------------------------


def test_crlf_split_between_chunks_is_one_line_ending():
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    # If the LF were a second line ending, this would dispatch "a" early.
    assert decoder.feed(b"\ndata: b\r") == []
    assert decoder.feed(b"\n\r\n") == [SSEEvent("a\nb")]


def test_lone_cr_terminates_lines():
    assert SSEDecoder().feed(b"data: a\r\rdata: b\r\r") == [SSEEvent("a"), SSEEvent("b")]


def test_multibyte_character_split_across_chunks():
    decoder = SSEDecoder()
    encoded = "data: €\n\n".encode()
    assert decoder.feed(encoded[:7]) == []
    assert decoder.feed(encoded[7:]) == [SSEEvent("€")]


def test_bom_split_across_chunks_is_stripped_once():
    decoder = SSEDecoder()
    assert decoder.feed(BOM[:1]) == []
    assert decoder.feed(BOM[1:2]) == []
    assert decoder.feed(BOM[2:] + b"data: x\n\n") == [SSEEvent("x")]
    # A later BOM is content: here it makes an unknown field name.
    assert decoder.feed(BOM + b"data: y\n\n") == []


def test_not_a_bom_prefix_is_kept():
    decoder = SSEDecoder()
    assert decoder.feed(b"\xef") == []
    assert decoder.feed(b"\n" + b"data: z\n\n") == [SSEEvent("z")]


def test_fields_comments_and_multiline_data():
    raw = (
        b": keep-alive\n"
        b"event: delta\n"
        b"id: 42\n"
        b"retry: 1500\n"
        b"data: first\n"
        b"data:second\n"
        b"data\n"
        b"ignored: field\n"
        b"\n"
    )
    assert SSEDecoder().feed(raw) == [SSEEvent("first\nsecond\n", "delta", "42", 1500)]


def test_event_without_data_is_not_dispatched_and_resets_type():
    decoder = SSEDecoder()
    assert decoder.feed(b"event: lonely\nid: 1\n\ndata: x\n\n") == [SSEEvent("x", "message", "1")]


def test_empty_data_line_dispatches_empty_event():
    assert SSEDecoder().feed(b"data:\n\n") == [SSEEvent("")]


def test_id_with_nul_is_ignored_and_id_persists():
    decoder = SSEDecoder()
    assert decoder.feed(b"id: 1\ndata: a\n\nid: x\0y\ndata: b\n\n") == [
        SSEEvent("a", id="1"),
        SSEEvent("b", id="1"),
    ]


def test_invalid_utf8_is_replaced_not_fatal():
    assert SSEDecoder().feed(b"data: \xff\xfe\n\n") == [SSEEvent("\ufffd\ufffd")]


def test_huge_retry_is_ignored():
    assert SSEDecoder().feed(b"retry: " + b"9" * 5000 + b"\ndata: a\n\n") == [SSEEvent("a")]


# -- end of stream ------------------------------------------------------------


def test_close_with_pending_data_is_truncation():
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"partial": \n') == []
    with pytest.raises(SSETruncated) as info:
        decoder.close()
    assert info.value.code == "upstream_sse_truncated"


def test_close_with_unterminated_data_line_is_truncation():
    decoder = SSEDecoder()
    decoder.feed(b"data: [DONE]")
    with pytest.raises(SSETruncated):
        decoder.close()


def test_a_closing_done_without_its_blank_line_ends_the_stream():
    """``data: [DONE]\\n`` then EOF: a finished stream read as truncated
    (upstream_sse_truncated after all its text had streamed)."""
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"a": 1}\n\ndata: [DONE]\n') == [SSEEvent('{"a": 1}')]
    assert decoder.close() == [SSEEvent("[DONE]")]


def test_close_without_pending_data_is_clean():
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\n\nevent: x\nid: 3\n: comment") == [SSEEvent("a")]
    assert decoder.close() == []
    assert decoder.close() == []


def test_feed_after_close_is_a_bug():
    decoder = SSEDecoder()
    decoder.close()
    with pytest.raises(RuntimeError):
        decoder.feed(b"data: a\n\n")


# -- limits -------------------------------------------------------------------


def test_line_at_the_limit_passes_and_one_more_byte_fails():
    limits = UpstreamStreamLimits(max_line_bytes=10)
    assert SSEDecoder(limits).feed(b"data: 1234\n\n") == [SSEEvent("1234")]
    with pytest.raises(SSELineTooLong) as info:
        SSEDecoder(limits).feed(b"data: 12345\n\n")
    assert info.value.code == "upstream_sse_line_too_long"


def test_unterminated_line_fails_as_soon_as_it_is_too_long():
    # A provider that never sends a newline must not make us buffer forever.
    decoder = SSEDecoder(UpstreamStreamLimits(max_line_bytes=10))
    decoder.feed(b"data: 1234")
    with pytest.raises(SSELineTooLong):
        decoder.feed(b"5")


def test_comment_lines_count_against_the_line_limit():
    with pytest.raises(SSELineTooLong):
        SSEDecoder(UpstreamStreamLimits(max_line_bytes=8)).feed(b":" + b"x" * 8 + b"\n")


def test_event_too_large():
    limits = UpstreamStreamLimits(max_event_bytes=8)
    assert SSEDecoder(limits).feed(b"data: 123\ndata: 123\n\n") == [SSEEvent("123\n123")]
    with pytest.raises(SSEEventTooLarge) as info:
        SSEDecoder(limits).feed(b"data: 123\ndata: 1234\n\n")
    assert info.value.code == "upstream_sse_event_too_large"


def test_an_event_of_tiny_lines_holds_about_its_size_not_an_object_per_line():
    """max_event_bytes bounds memory too: 3 bytes a line once cost ~44
    (a bytes object and a list slot each), 15 times the limit."""
    limits = UpstreamStreamLimits(max_event_bytes=64 * 1024)
    lines = b"data:xy\n" * (limits.max_event_bytes // 3)
    decoder = SSEDecoder(limits)
    tracemalloc.start()
    try:
        assert decoder.feed(lines) == []
        held = tracemalloc.get_traced_memory()[0]
        (event,) = decoder.feed(b"\n")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert event.data == "\n".join(["xy"] * (limits.max_event_bytes // 3))
    assert held < 1.5 * limits.max_event_bytes and peak < 3 * limits.max_event_bytes


def test_buffered_bytes_count_pending_event_and_partial_line():
    decoder = SSEDecoder(UpstreamStreamLimits(max_buffered_bytes=16))
    decoder.feed(b"data: 12345678\n")  # 9 bytes pending
    decoder.feed(b"data: 1")  # 7 bytes of partial line: 16 in all
    with pytest.raises(SSEBufferExceeded) as info:
        decoder.feed(b"2")
    assert info.value.code == "upstream_sse_buffer_exceeded"


def test_aggregate_bytes_bound_the_whole_stream():
    decoder = SSEDecoder(UpstreamStreamLimits(max_aggregate_bytes=20))
    assert decoder.feed(b"data: a\n\n") == [SSEEvent("a")]  # 9 bytes
    assert decoder.feed(b": 12345678\n") == []  # 20 bytes
    with pytest.raises(SSEAggregateExceeded) as info:
        decoder.feed(b"\n")
    assert info.value.code == "upstream_aggregate_exceeded"


def test_events_before_a_limit_error_are_delivered_lazily():
    decoder = SSEDecoder(UpstreamStreamLimits(max_line_bytes=10))
    events = decoder.iter_feed(b"data: a\n\ndata: 123456789\n\n")
    assert next(events) == SSEEvent("a")
    with pytest.raises(SSELineTooLong):
        next(events)


def test_errors_are_sticky():
    decoder = SSEDecoder(UpstreamStreamLimits(max_line_bytes=4))
    with pytest.raises(SSELineTooLong):
        decoder.feed(b"data: long\n")
    with pytest.raises(SSELineTooLong):
        decoder.feed(b"\n")
    with pytest.raises(SSELineTooLong):
        decoder.close()


def test_the_limit_crossed_first_wins_whatever_the_chunking():
    # Line 2 starts at byte 8: the aggregate bound is crossed at byte 15, the
    # line bound only at byte 18. A partial read sees only the first.
    limits = UpstreamStreamLimits(max_line_bytes=10, max_aggregate_bytes=15)
    raw = b"data: 1\n" + b"data: 123456789\n\n"
    assert whole(raw, limits) == ([], SSEAggregateExceeded)
    assert bytewise(raw, limits) == ([], SSEAggregateExceeded)


@pytest.mark.parametrize("chunks", [[b"data: a\r\n"], [b"data: a\r", b"\n"]])
def test_the_lf_of_a_crlf_counts_against_the_aggregate(chunks):
    decoder = SSEDecoder(UpstreamStreamLimits(max_aggregate_bytes=8))
    with pytest.raises(SSEAggregateExceeded):
        for chunk in chunks:
            decoder.feed(chunk)
