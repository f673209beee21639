"""A state's key (the hash of its owner and tokens) is computed once: at an
agent's context sizes it costs milliseconds (~1.5 ms at 10k tokens), and the
scheduler thread asks for it several times a placement."""

from __future__ import annotations

import lmspd.cache.state as state_module
from lmspd.cache.state import SessionState, state_key


def test_a_states_key_is_hashed_once_and_again_only_when_its_tokens_are_replaced(monkeypatch):
    calls = []

    def counted(owner, tokens):
        calls.append(len(tokens))
        return state_key(owner, tokens)

    monkeypatch.setattr(state_module, "state_key", counted)
    state = SessionState(tokens=list(range(10_000)), kv_text="", owner="o")
    first = state.key
    assert [state.key for _ in range(5)] == [first] * 5
    assert calls == [10_000]

    state.tokens = list(range(9_999))
    assert state.key == state_key("o", list(range(9_999))) != first
    assert calls == [10_000, 9_999]


def test_equal_states_compare_equal_whatever_keys_they_computed():
    a = SessionState(tokens=[1, 2, 3], kv_text="abc", owner="o")
    b = SessionState(tokens=[1, 2, 3], kv_text="abc", owner="o")
    assert a.key == state_key("o", [1, 2, 3])
    assert a == b
