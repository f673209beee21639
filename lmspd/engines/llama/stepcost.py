"""What a scheduler step costs: the host's share (everything outside
``llama_decode``: planning and filling the batch, sampling, the parsers,
the hand-over of events) as a histogram, and the decode's own cost by batch
size, which the speculation planner reads to decide whether a draft pays.

Both are written by the scheduler thread only; readers (``/metrics``, the
bench) take a snapshot of plain numbers.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Seconds; the host's share of a step is expected well under a millisecond.
HOST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0015, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


@dataclass
class HostCost:
    """A histogram of the host time per step (Prometheus-style cumulative on read)."""

    buckets: tuple[float, ...] = HOST_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(HOST_BUCKETS) + 1))
    sum_s: float = 0.0
    count: int = 0
    # Per number of decoding sequences in the step: (count, total seconds).
    by_sequences: dict[int, list[float]] = field(default_factory=dict)

    def observe(self, seconds: float, sequences: int) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum_s += seconds
        self.count += 1
        slot = self.by_sequences.get(sequences)
        if slot is None:
            self.by_sequences[sequences] = [1, seconds]
        else:
            slot[0] += 1
            slot[1] += seconds

    def snapshot(self) -> dict[str, object]:
        cumulative: list[tuple[str, int]] = []
        total = 0
        for bound, n in zip(self.buckets, self.counts, strict=False):
            total += n
            cumulative.append((repr(bound), total))
        cumulative.append(("+Inf", self.count))
        return {
            "buckets": cumulative,
            "sum_s": self.sum_s,
            "count": self.count,
            "mean_ms_by_sequences": {k: round(v[1] / v[0] * 1000, 3) for k, v in sorted(self.by_sequences.items())},
        }


# The decode's cost relative to one token, by batch size, before anything is
# measured: the bundled model on 2 CPU threads (1: 11 ms, 2: 18, 4: 27, 8: 46,
# 16: 71). Pessimistic for a GPU, where measurements soon replace it.
_PRIOR = ((1, 1.0), (2, 1.64), (4, 2.45), (8, 4.2), (16, 6.45), (32, 12.0), (64, 23.0))


def _prior(n: int) -> float:
    """The prior cost of ``n`` tokens, in one-token steps (interpolated)."""
    prev = _PRIOR[0]
    for size, ratio in _PRIOR:
        if size >= n:
            if size == prev[0]:
                return ratio
            return prev[1] + (ratio - prev[1]) * (n - prev[0]) / (size - prev[0])
        prev = (size, ratio)
    return _PRIOR[-1][1] * n / _PRIOR[-1][0]


class DecodeCost:
    """The decode's time by batch size: an exponential average per size
    seen, interpolated between sizes seen, and scaled by the prior's shape
    beyond them (or entirely from it, in one-token units, before any step)."""

    def __init__(self, decay: float = 0.9, max_tokens: int = 4096) -> None:
        self._decay = decay
        self._max = max_tokens
        self._ms: dict[int, float] = {}
        self._sizes: list[int] = []
        # ``ms`` by batch size since the last ``observe``: a step asks for
        # the same sizes once per sequence that may draft (the planner's
        # every draft length), and the estimate only moves when a decode is
        # observed (once a step).
        self._memo: dict[int, float] = {}

    def observe(self, n_tokens: int, ms: float) -> None:
        if not 0 < n_tokens <= self._max:
            return
        self._memo.clear()
        old = self._ms.get(n_tokens)
        if old is None:
            bisect.insort(self._sizes, n_tokens)
            self._ms[n_tokens] = ms
        else:
            self._ms[n_tokens] = self._decay * old + (1 - self._decay) * ms

    def ms(self, n_tokens: int) -> float:
        """The expected decode time of a batch of ``n_tokens``."""
        got = self._memo.get(n_tokens)
        if got is None:
            got = self._memo[n_tokens] = self._estimate(n_tokens)
        return got

    def _estimate(self, n_tokens: int) -> float:
        n = max(1, n_tokens)
        got = self._ms.get(n)
        if got is not None:
            return got
        sizes = self._sizes
        if not sizes:
            return _prior(n)
        i = bisect.bisect_left(sizes, n)
        if 0 < i < len(sizes):
            lo, hi = sizes[i - 1], sizes[i]
            a, b = self._ms[lo], self._ms[hi]
            return a + (b - a) * (n - lo) / (hi - lo)
        near = sizes[i - 1] if i else sizes[0]
        return self._ms[near] * _prior(n) / _prior(near)
