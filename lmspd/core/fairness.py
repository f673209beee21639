"""One byte budget shared by several owners (API keys), max-min fair.

Owners who hold less than an equal split of the budget keep all of it, and
what they leave is split evenly among the rest. Whatever must go to bring
the total within the budget comes from the owners over that share, so one
owner that writes without end only ever loses its own: another one within
its share, at least the budget divided by the owners, loses nothing. The
store's retention (lmspd.store.pruning) and the KV cache's RAM and disk
tiers (lmspd.cache.tiers, lmspd.cache.disk) apply it.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["fair_share", "over_share"]


def fair_share(usage: Mapping[str, int], budget: int) -> int | None:
    """The most bytes each owner may keep so that all of ``usage`` fits
    ``budget``, or None when it fits already. Max-min fair: an owner under
    the share keeps everything, the others are cut to the share, which is
    never below ``budget // len(usage)``."""
    if sum(usage.values()) <= budget:
        return None
    left, held = budget, sorted(usage.values())
    for i, used in enumerate(held):
        share = left // (len(held) - i)
        if used > share:
            return share
        left -= used
    return 0  # not reached: the largest holder is over the share when the sum is over the budget


def over_share(usage: Mapping[str, int], budget: int) -> set[str]:
    """The owners to take from while ``usage`` is over ``budget``: those
    over their fair share (never none then: the largest holder is); none
    when it fits."""
    share = fair_share(usage, budget)
    if share is None:
        return set()
    return {owner for owner, used in usage.items() if used > share}
