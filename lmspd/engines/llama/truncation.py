"""``truncation: auto``: drop the fewest oldest items that make a prompt fit.

The search is guided by an estimate, not a bisection over the whole
history (the cost is one render of everything plus a few of what is kept):
bisecting rendered and tokenized half the conversation, then a
quarter..., O(log n) times the size of what is kept, and tokenizing a long
prompt costs more than linear time (llama.cpp splits it at every control
token). Here each droppable group gets an estimated token cost from the one
render the request already made (its characters, plus its share of the
template's wrapping, at the prompt's tokens-per-character); the first
measurement is where the estimate says the prompt fits, the next one item
fewer, which proves the fewest. A measurement that disagrees with the
estimate re-aims from what it measured; a few misses in a row fall back to
bisection between what is known to fit and what is known not to, so the
worst case stays O(log n).

What is dropped comes in groups (``core.conversation.drop_groups``, which
a WebSocket connection's remembered history drops by too): a tool call
goes with the outputs that answer it, and the call answered by the last
item (never dropped) stays.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from lmspd.core.conversation import Item, drop_groups, item_chars

# Measurements aimed by the estimate before the search bisects instead.
_GUIDED_PROBES = 4


@dataclass
class Fit:
    items: list[Item]
    text: str
    tokens: list[int]


def fewest_dropped(items: list[Item], whole: Fit, budget: int, *, render: Callable[[list[Item]], str],
                   tokenize: Callable[[str], list[int]]) -> Fit:
    """The prompt of ``items`` without the fewest oldest groups (``drop_groups``)
    that make it fit ``budget`` tokens; ``whole`` is the prompt of all of them
    (which does not fit). Without them all when nothing fits."""
    groups = drop_groups(items)
    n = len(groups)
    if n == 0:
        return whole

    def kept(k: int) -> list[Item]:
        gone = {i for group in groups[:k] for i in group}
        return [item for i, item in enumerate(items) if i not in gone]

    measured: dict[int, Fit] = {0: whole}

    def measure(k: int) -> Fit:
        if k not in measured:
            left = kept(k)
            text = render(left)
            measured[k] = Fit(left, text, tokenize(text))
        return measured[k]

    # Without every group (small: what is never dropped).
    shortest = measure(n)
    if len(shortest.tokens) > budget:
        return shortest
    # Estimated tokens of each group: the tokens all groups take, shared by
    # their characters and their part of the template's wrapping (what the
    # prompt without them is shorter by, beyond their characters).
    chars = [sum(item_chars(items[i]) for i in group) for group in groups]
    wrapping = max(0, len(whole.text) - len(shortest.text) - sum(chars)) / sum(map(len, groups))
    weights = [size + wrapping * len(group) for group, size in zip(groups, chars, strict=True)]
    per_weight = (len(whole.tokens) - len(shortest.tokens)) / max(1.0, sum(weights))
    # cost[k] = the estimated tokens of the first k groups.
    cost = [0.0]
    for weight in weights:
        cost.append(cost[-1] + per_weight * weight)

    # lo never fits, hi fits (both measured).
    lo, hi = 0, n
    at = 0
    probes = 0
    while hi - lo > 1:
        if probes < _GUIDED_PROBES:
            # The fewest groups whose estimated cost, counted from the latest
            # measurement, brings the prompt within budget.
            need = len(measured[at].tokens) - budget + cost[at]
            k = bisect.bisect_left(cost, need)
        else:
            k = (lo + hi) // 2
        k = min(max(k, lo + 1), hi - 1)
        probes += 1
        at = k
        if len(measure(k).tokens) <= budget:
            hi = k
        else:
            lo = k
    return measured[hi]
