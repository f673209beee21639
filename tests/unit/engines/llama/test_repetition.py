"""The repetition guard against a plain reference: it trips exactly when the
last ``window`` tokens each equal the token one period before them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.engines.llama.repetition import RepetitionGuard


def reference(tokens: list[int], window: int, max_period: int) -> bool:
    n = len(tokens)
    for p in range(1, max_period + 1):
        if n - window - p < 0:
            continue
        if all(tokens[i] == tokens[i - p] for i in range(n - window, n)):
            return True
    return False


@settings(max_examples=300)
@given(tokens=st.lists(st.integers(0, 3), max_size=120), window=st.integers(1, 12), max_period=st.integers(1, 8))
def test_trips_exactly_when_the_tail_is_a_cycle(tokens, window, max_period):
    guard = RepetitionGuard(window, max_period)
    for n in range(1, len(tokens) + 1):
        assert guard.feed(tokens[n - 1]) == reference(tokens[:n], window, max_period), (n, tokens[:n])


@given(prefix=st.lists(st.integers(0, 50_000), max_size=40),
       cycle=st.lists(st.integers(0, 50_000), min_size=1, max_size=32))
def test_a_looping_tail_trips_within_a_window_and_two_periods(prefix, cycle):
    guard = RepetitionGuard(128, 32)
    fed = 0
    tripped = False
    for t in prefix:
        guard.feed(t)
    while fed < 128 + 2 * len(cycle) + 1 and not tripped:
        tripped = guard.feed(cycle[fed % len(cycle)])
        fed += 1
    assert tripped and fed <= 128 + len(cycle) + 1


@given(st.lists(st.integers(0, 50_000), min_size=1, max_size=400, unique=True))
def test_text_without_repeats_never_trips(tokens):
    guard = RepetitionGuard(128, 32)
    assert not any(guard.feed(t) for t in tokens)


def test_a_long_period_is_not_a_cycle():
    # A 40-token cycle is beyond max_period 32: the default ceiling bounds it.
    guard = RepetitionGuard(128, 32)
    assert not any(guard.feed(i % 40) for i in range(1000))
