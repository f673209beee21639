"""One byte budget shared max-min fairly by its owners: what each may keep,
and whom an eviction takes from (the KV cache's RAM and disk tiers)."""

from __future__ import annotations

import pytest

from lmspd.core.fairness import fair_share, over_share


@pytest.mark.parametrize(("usage", "budget", "share", "over"), [
    ({"a": 10, "b": 20}, 30, None, set()),  # everything fits
    ({"a": 100, "b": 900}, 600, 500, {"b"}),  # a is under an even split: b gets what a leaves
    ({"a": 400, "b": 900}, 600, 300, {"a", "b"}),  # both over: an even split
    ({"a": 1, "b": 2, "c": 1000}, 10, 7, {"c"}),
    ({"a": 5}, 3, 3, {"a"}),  # one owner: its own oldest go, as without owners
])
def test_the_share_and_the_owners_over_it(usage: dict[str, int], budget: int, share: int | None,
                                          over: set[str]) -> None:
    assert fair_share(usage, budget) == share
    assert over_share(usage, budget) == over
