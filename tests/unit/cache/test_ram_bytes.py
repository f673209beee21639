"""The RAM tier's byte count is kept as states come and go, not summed over
every state at each capture (linear in the states, on the scheduler thread):
it must equal that sum through keeping, re-keeping, spilling and forgetting,
and the budget must hold exactly as before."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.cache.state import SessionState
from lmspd.cache.tiers import CacheStats, Tiers


def state(n: int, owner: str = "o", kv: int = 100) -> SessionState:
    return SessionState(tokens=list(range(n)), kv_text="x" * n, owner=owner, kv=b"k" * kv)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["keep", "forget"]), st.integers(1, 12), st.integers(0, 400)),
                max_size=40),
       st.integers(300, 3000))
def test_the_ram_bytes_are_the_sum_of_the_kept_states(ops, budget) -> None:
    tiers = Tiers(CacheStats(), budget_bytes=budget)
    made: dict[int, SessionState] = {}
    for op, n, kv in ops:
        if op == "keep":
            # The same tokens again: a state kept anew under the same key.
            made[n] = state(n, kv=kv)
            tiers.remember(made[n])
        elif n in made:
            tiers.forget(made[n])
        total = sum(s.nbytes for s in tiers.ram.values())
        assert tiers.ram.nbytes == total == tiers.stats.ram_bytes
        assert total <= budget
        assert tiers.stats.ram_sessions == len(tiers.ram)


def test_room_for_counts_what_ram_holds() -> None:
    tiers = Tiers(CacheStats(), budget_bytes=1000)
    tiers.remember(state(10, kv=500))
    held = tiers.ram.nbytes
    assert tiers.room_for(1000 - held) and not tiers.room_for(1000 - held + 1)
