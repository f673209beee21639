"""``Framer``: a stream's lifecycle events carry the whole response object,
which echoes the request (instructions, tools: megabytes at worst). Its
large values are encoded once, off the event loop, and spliced into every
frame that holds them; the deltas are framed as they always were."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.streaming import sse
from lmspd.streaming.framing import Framer
from lmspd.streaming.sse import SPLICE_MIN_BYTES, Spliced, encode_large, sse_event
from lmspd.streaming.websocket import event_frame
from support.sse import parse_frames

TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
LARGE = "tools\u2028and\x85more " * (SPLICE_MIN_BYTES // 8)


def lifecycle(name: str, seq: int, echo: dict[str, Any], **state: Any) -> dict[str, Any]:
    return {"type": name, "sequence_number": seq, "response": {"id": "resp_1", **state, **echo}}


@settings(max_examples=50)
@given(TEXT, TEXT, st.none() | st.integers(0, 99), st.none() | TEXT)
def test_a_spliced_frame_reads_back_as_the_event(small: str, extra: str, event_id, lane) -> None:
    echo = {"instructions": LARGE + extra, "tools": [{"name": small, "schema": LARGE}], "user": small}
    data = lifecycle("response.created", 3, echo, output=[{"text": small}], store=True)
    parts = encode_large(echo)
    assert set(parts) == {"instructions", "tools"}
    spliced = Spliced(data, parts)
    frame = sse_event(data["type"], spliced, event_id)
    # Whole through a line reader that splits at U+2028 and U+0085 too.
    lines = list(httpx.Response(200, content=frame).iter_lines())
    (read,) = parse_frames(lines)
    assert read.json() == data and read.event == data["type"]
    assert read.id == (None if event_id is None else str(event_id))
    assert json.loads(event_frame(spliced, lane)) == (data if lane is None else {**data, "stream_id": lane})


def test_a_value_no_longer_the_one_encoded_is_encoded_with_its_event() -> None:
    echo = {"instructions": LARGE, "tools": [LARGE]}
    parts = encode_large(echo)
    data = lifecycle("response.failed", 9, echo, store=True)
    data["response"]["tools"] = ["replaced"]
    for spliced in (Spliced(data, parts), Spliced(lifecycle("x", 1, {}), parts)):
        assert json.loads(sse_event(None, spliced)[len(b"data: "):]) == dict(spliced)


class OffLoop:
    """Runs the work at once, counting how often it was sent off the loop."""

    def __init__(self) -> None:
        self.hops = 0

    async def __call__(self, work):
        self.hops += 1
        return work()


def frames(framer: Framer, events: list[dict[str, Any]]) -> list[bytes]:
    async def main() -> list[bytes]:
        return [await framer(e["sequence_number"], e["type"], e) for e in events]

    return asyncio.run(main())


def a_stream(echo: dict[str, Any]) -> list[dict[str, Any]]:
    """A live stream's events: each response object holds the echo's very values."""
    delta = {"type": "response.output_text.delta", "sequence_number": 2, "delta": "hi"}
    return [lifecycle("response.created", 0, echo, status="in_progress"),
            lifecycle("response.in_progress", 1, echo, status="in_progress"), delta,
            lifecycle("response.in_progress", 3, echo, status="in_progress"),
            lifecycle("response.completed", 4, echo, status="completed", output=[{"text": "hi"}])]


def test_a_large_echo_is_encoded_once_per_stream(monkeypatch) -> None:
    encoded: list[int] = []
    encode = sse._dumps

    def spy(value):
        out = encode(value)
        encoded.append(len(out))
        return out

    echo = {"instructions": LARGE, "tools": [{"type": "function", "name": "f"}], "store": True}
    events = a_stream(echo)
    off_loop = OffLoop()
    monkeypatch.setattr(sse, "_dumps", spy)
    out = frames(Framer(lambda seq, name, data: sse_event(name, data), off_loop), events)
    monkeypatch.undo()
    assert off_loop.hops == 1
    assert [json.loads(f.split(b"data: ", 1)[1]) for f in out] == events
    # The instructions, once; every other encoding small.
    assert [n for n in encoded if n > 1000] == [len(sse.dumps(LARGE))]


def test_events_read_back_from_a_log_are_encoded_off_the_loop_each() -> None:
    """A task's follower reads its events from the store: equal values, not
    the same objects; each response object is encoded off the loop."""
    off_loop = OffLoop()
    logged = [json.loads(json.dumps(e)) for e in a_stream({"instructions": LARGE})]
    out = frames(Framer(lambda seq, name, data: sse_event(name, data, seq), off_loop), logged)
    assert off_loop.hops == 4
    assert [json.loads(f.split(b"data: ", 1)[1]) for f in out] == logged


def test_a_small_response_is_framed_without_a_thread_hop() -> None:
    small_echo = {"instructions": "be brief", "tools": [{"type": "function", "name": "f"}]}
    # Known from the request's size: never a hop.
    off_loop = OffLoop()
    frames(Framer(lambda seq, name, data: sse_event(name, data), off_loop, small=True), a_stream(small_echo))
    assert off_loop.hops == 0
    # Found out once, for a request whose size did not tell.
    frames(Framer(lambda seq, name, data: sse_event(name, data), off_loop), a_stream(small_echo))
    assert off_loop.hops == 1
    # A delta is never held up.
    delta = a_stream(small_echo)[2]
    frames(Framer(lambda seq, name, data: sse_event(name, data), off_loop), [delta] * 3)
    assert off_loop.hops == 1
