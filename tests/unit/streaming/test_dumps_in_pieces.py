"""``dumps_in_pieces``: the bytes of ``dumps``, encoded a member at a time,
so that a thread encoding a large reply lets the event loop run between
members (one call of the C encoder holds the interpreter lock throughout)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

import lmspd.streaming.sse as sse

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(blacklist_categories=("Cs",))),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=5),
    max_leaves=30)


@given(JSON)
def test_the_bytes_are_those_of_one_call(value) -> None:
    assert sse.dumps_in_pieces(value) == sse.dumps(value).encode()


def test_no_single_call_of_the_encoder_spans_the_page(monkeypatch) -> None:
    """A page of stored items as the routes reply with it: the encoder runs
    a few items at a time (about ``_PIECE_CHARS``), never the whole page."""
    calls: list[int] = []
    encode = sse._dumps

    def counted(value):
        out = encode(value)
        calls.append(len(out))
        return out

    monkeypatch.setattr(sse, "_dumps", counted)
    item = {"id": "msg_1", "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "x" * 100_000}]}
    page = {"object": "list", "data": [item] * 50, "first_id": "msg_1", "last_id": "msg_1", "has_more": False}
    out = sse.dumps_in_pieces(page)
    assert len(out) > 5_000_000 and max(calls) < sse._PIECE_CHARS + 100_100


def test_a_long_string_is_encoded_a_slice_at_a_time(monkeypatch) -> None:
    """Instructions of 8 MB are one string: encoded in one call, it held
    the lock ~25 ms."""
    calls: list[int] = []
    encode = sse._dumps

    def counted(value):
        out = encode(value)
        calls.append(len(out))
        return out

    text = 'é\u2028"\\\n\x00x' * 150_000
    monkeypatch.setattr(sse, "_dumps", counted)
    out = sse.dumps_in_pieces({"instructions": text})
    monkeypatch.undo()
    assert out == sse.dumps({"instructions": text}).encode()
    # Each character escapes to six at most.
    assert len(calls) > 4 and max(calls) <= 6 * sse._PIECE_CHARS + 2
