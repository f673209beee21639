"""``sse_event``: one frame whose JSON reads back to the same data whatever
line reader splits it — an SSE one (CR and LF only) or one built on Python's
``str.splitlines`` (httpx's ``iter_lines``), which also ends lines at U+0085,
U+2028 and U+2029 that JSON leaves raw inside strings."""

from __future__ import annotations

import json

import httpx
from hypothesis import given
from hypothesis import strategies as st

from lmspd.streaming.sse import sse_event
from support.sse import parse_frames

TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)))


def read_with_httpx(frame: bytes) -> list[str]:
    """The lines httpx's streaming reader gives for ``frame`` sent in one chunk."""
    response = httpx.Response(200, content=frame)
    return list(response.iter_lines())


@given(TEXT, st.none() | st.integers(0, 10**6))
def test_a_frame_reads_back_whole_through_httpx_lines(text, event_id) -> None:
    data = {"type": "response.output_text.delta", "delta": text}
    frames = list(parse_frames(read_with_httpx(sse_event(data["type"], data, event_id))))
    assert len(frames) == 1
    assert frames[0].json() == data
    assert frames[0].event == data["type"]
    assert frames[0].id == (None if event_id is None else str(event_id))


def test_the_separators_a_model_writes_are_escaped_not_dropped() -> None:
    data = {"delta": "a\u2028b\u2029c\x85d"}
    frame = sse_event(None, data)
    assert frame == b'data: {"delta":"a\\u2028b\\u2029c\\u0085d"}\n\n'
    assert json.loads(frame[len(b"data: "):]) == data
