"""The repetition guard: ends a generation caught in a short loop.

A small model at temperature 0 often falls into a cycle ("I am a bot. I am a
bot. ...") and would hold its sequence until the output ceiling. The guard
sees every sampled token once and trips when each of the last ``window``
tokens equals the token ``p`` positions before it, for one period
``p <= max_period`` -- the tail is that many tokens of a repeated cycle.

Per token it does ``max_period`` comparisons over preallocated lists (a
ring of the last ``max_period`` tokens, one run counter per period):
constant time and memory, nothing grows with the output.
"""

from __future__ import annotations


class RepetitionGuard:
    __slots__ = ("window", "max_period", "_ring", "_runs", "_n")

    def __init__(self, window: int, max_period: int) -> None:
        self.window = window
        self.max_period = max_period
        self._ring = [-1] * max(1, max_period)
        # _runs[p - 1]: how many of the latest tokens in a row equal the
        # token p before them.
        self._runs = [0] * max(1, max_period)
        self._n = 0

    @property
    def enabled(self) -> bool:
        return self.window > 0 and self.max_period > 0

    def feed(self, token: int) -> bool:
        """Take the next token; True once the tail is a repeated cycle."""
        ring, runs, n, size = self._ring, self._runs, self._n, self.max_period
        tripped = False
        window = self.window
        for p in range(1, (n if n < size else size) + 1):
            if ring[(n - p) % size] == token:
                run = runs[p - 1] + 1
                runs[p - 1] = run
                if run >= window:
                    tripped = True
            else:
                runs[p - 1] = 0
        ring[n % size] = token
        self._n = n + 1
        return tripped
