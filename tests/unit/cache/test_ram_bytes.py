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
@given(st.lists(st.tuples(st.sampled_from(["keep", "forget"]), st.integers(1, 12), st.integers(0, 400),
                          st.sampled_from(["alice", "bob"])),
                max_size=40),
       st.integers(300, 3000))
def test_the_ram_bytes_are_the_sum_of_the_kept_states(ops, budget) -> None:
    tiers = Tiers(CacheStats(), budget_bytes=budget)
    made: dict[tuple[int, str], SessionState] = {}
    for op, n, kv, owner in ops:
        if op == "keep":
            # The same tokens again: a state kept anew under the same key.
            made[n, owner] = state(n, owner, kv=kv)
            tiers.remember(made[n, owner])
        elif (n, owner) in made:
            tiers.forget(made[n, owner])
        total = sum(s.nbytes for s in tiers.ram.values())
        assert tiers.ram.nbytes == total == tiers.stats.ram_bytes
        assert total <= budget
        assert tiers.stats.ram_sessions == len(tiers.ram)
        by_owner = {o: sum(s.nbytes for s in tiers.ram.values() if s.owner == o) for o in ("alice", "bob")}
        assert tiers.ram.owner_bytes == {o: n for o, n in by_owner.items() if n}


def test_a_key_within_its_fair_share_keeps_its_state_while_another_floods() -> None:
    """The budget is shared max-min fairly (lmspd.core.fairness): bob's ten
    states push out only bob's oldest, never alice's one, which is within
    an equal split of the budget. Alone, bob's oldest go as before."""
    tiers = Tiers(CacheStats(), budget_bytes=3000)
    alice = state(10, "alice", kv=500)
    tiers.remember(alice)
    bobs = [state(n, "bob", kv=500) for n in range(20, 30)]
    for bob in bobs:
        tiers.remember(bob)
    assert alice.key in tiers.ram
    assert tiers.ram.nbytes <= 3000
    kept = [bob for bob in bobs if bob.key in tiers.ram]
    assert kept == bobs[-len(kept):] and len(kept) >= 3, "bob's most recent states stay"
    assert tiers.evictions.longest(alice.tokens, "alice") is None
    assert tiers.evictions.longest(bobs[0].tokens, "bob") is not None


def test_room_for_counts_what_ram_holds() -> None:
    tiers = Tiers(CacheStats(), budget_bytes=1000)
    tiers.remember(state(10, kv=500))
    held = tiers.ram.nbytes
    assert tiers.room_for(1000 - held) and not tiers.room_for(1000 - held + 1)
