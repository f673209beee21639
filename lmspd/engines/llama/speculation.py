"""Speculative decoding without a draft model: what a sequence proposes to
evaluate beyond its next token, and whether proposing pays.

Two sources, cheapest first:

- ``grammar``: the tokens the sequence's grammar forces next (llguidance's
  fast-forward tokens: ``"path": "``, ``*** Update File: ``): right unless
  the turn ends there;
- ``ngram``: the sequence's own tokens (the prompt and the output so far:
  everything its KV holds). The longest recent earlier occurrence of the
  text's last few tokens proposes what followed it. ``NgramIndex`` keeps a
  hash from n-grams to their last end, updated per accepted token.

The scheduler evaluates the draft in the same batch as every other
sequence's next token and the sampler picks at each position; a draft token
is kept while the pick equals it, so the output is exactly what decoding
without speculation produces, at any temperature (``Scheduler._verify``).

Whether to draft, and how much, is priced (``Planner``): a batch of ``n``
tokens costs ``DecodeCost.ms(n)`` (learned; on a 2-core CPU a batch of 8
costs ~4x a batch of 1), a draft of ``k`` tokens at per-position acceptance
``a`` yields ``a + a^2 + ... + a^k`` extra tokens. A draft is made only when
it raises the step's tokens per millisecond, and, while other sequences
decode or a prompt prefills in the same step, only as far as it keeps the
step within ``fair_slack`` of its cost without the draft (so that nobody
else's next token waits for it). A sequence whose drafts keep failing stops
drafting for a while (doubling), and starts again at once where a long
match shows the text has turned into a copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from .stepcost import DecodeCost

if TYPE_CHECKING:
    from .kv import SequenceKv

SOURCES = ("grammar", "ngram")


def speculation_mode(requested: str, kv: "SequenceKv") -> str:
    """``auto`` or ``off``: what ``--speculative`` gives on this KV. A
    rejected draft leaves positions that must be dropped from the KV; a
    sliding-window KV (unless full-size) prunes cells as it advances and a
    recurrent state has no positions to drop, so there it is ``off``."""
    if requested not in ("auto", "off"):
        raise ValueError(f"speculative must be 'auto' or 'off', not {requested!r}")
    return requested if kv.trimmable else "off"


class NgramIndex:
    """The last end of every n-gram (``sizes``) in ``tokens``, a list the
    owner appends to (the sequence's evaluated tokens). Caught up lazily, at
    most ``per_step`` positions a call, so that a long prompt's index is
    built over a few steps rather than stalling one (and mostly during the
    prefill steps, ``catch_up``); a prompt longer than ``window`` is indexed
    from its last ``window`` tokens."""

    def __init__(self, tokens: list[int], *, sizes: tuple[int, ...] = (6, 3), window: int = 16384,
                 per_step: int = 256) -> None:
        self.tokens = tokens
        self.sizes = sizes
        self._maps: list[dict[tuple[int, ...], int]] = [{} for _ in sizes]
        self._per_step = per_step
        # Every n-gram ending at or before ``_done`` (exclusive end) is in.
        self._done = max(0, len(tokens) - window)

    def catch_up(self, budget: int) -> None:
        """Index up to ``budget`` more positions (a prefill step calls this
        with its chunk's size, so that decoding starts with the index whole)."""
        self._catch_up(len(self.tokens) - 1, budget)

    def _catch_up(self, upto: int, budget: int) -> None:
        toks = self.tokens
        end = min(upto, self._done + budget)
        for size, table in zip(self.sizes, self._maps, strict=True):
            for e in range(max(self._done + 1, size), end + 1):
                table[tuple(toks[e - size:e])] = e
        self._done = max(self._done, end)

    def keep_up(self) -> None:
        """Index what a ``propose`` now would index first (at most
        ``per_step`` positions)."""
        n = len(self.tokens)
        if n < self._done:  # the list was cut back (never, while a sequence runs): start over
            self._maps = [{} for _ in self.sizes]
            self._done = 0
        # Only n-grams with a continuation inside ``tokens``.
        if self._done < n - 1:
            self._catch_up(n - 1, self._per_step)

    def propose(self, tail: list[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of
        the context's end (``tokens`` + ``tail``), and how many tokens that
        occurrence matched (0: none)."""
        self.keep_up()
        toks = self.tokens
        context = toks[-16:] + tail if tail else toks[-16:]
        for size, table in zip(self.sizes, self._maps, strict=True):
            if len(context) < size:
                continue
            e = table.get(tuple(context[-size:]))
            if e is None:
                continue
            draft = list(toks[e:e + k])
            if not draft:
                continue
            return draft, self._match_length(e, context)
        return [], 0

    def _match_length(self, e: int, context: list[int], cap: int = 16) -> int:
        toks = self.tokens
        m = 0
        while m < cap and m < e and m < len(context) and toks[e - 1 - m] == context[-1 - m]:
            m += 1
        return m


class ForcedTokens(Protocol):
    def forced(self) -> list[int]: ...


@dataclass
class Acceptance:
    """Per-position acceptance of one source's drafts, an exponentially
    decaying count with a prior."""

    prior: float
    weight: float = 4.0
    decay: float = 0.85
    hits: float = 0.0
    tries: float = 0.0

    @property
    def rate(self) -> float:
        return self.rate_with(self.prior)

    def rate_with(self, prior: float) -> float:
        return (self.hits + prior * self.weight) / (self.tries + self.weight)

    def observe(self, drafted: int, accepted: int) -> None:
        # Positions tried: every accepted one and the first rejected one.
        tried = min(drafted, accepted + 1)
        self.hits = self.decay * self.hits + accepted
        self.tries = self.decay * self.tries + tried

    def reset(self) -> None:
        self.hits = self.tries = 0.0


@dataclass
class DecodeStats:
    """Drafted and accepted tokens by source: one generation's, or a whole engine's."""

    drafted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    steps_with_draft: int = 0

    def add(self, source: str, drafted: int, accepted: int) -> None:
        self.drafted[source] += drafted
        self.accepted[source] += accepted
        self.steps_with_draft += 1

    def as_json(self) -> dict[str, object]:
        drafted = sum(self.drafted.values())
        accepted = sum(self.accepted.values())
        return {
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "by_source": {s: {"drafted": self.drafted[s], "accepted": self.accepted[s]} for s in SOURCES},
        }

    def log_text(self) -> str:
        return " ".join(f"{s}={self.accepted[s]}/{self.drafted[s]}" for s in SOURCES)


@dataclass
class Draft:
    source: str
    tokens: list[int]


class SequenceSpeculation:
    """One sequence's drafting state: its index, acceptance per source, and
    whether it is resting after failed drafts."""

    def __init__(self, tokens: list[int], grammar: ForcedTokens | None) -> None:
        self.index = NgramIndex(tokens)
        self.grammar = grammar
        self.acceptance = {"grammar": Acceptance(prior=0.95), "ngram": Acceptance(prior=0.5)}
        self.stats = DecodeStats()
        self._failures = 0
        self._rest_until = 0  # output tokens
        self._rest = 16
        self.produced = 0  # output tokens taken so far

    def candidate(self, tail: list[int], k: int) -> tuple[Draft | None, float]:
        """The draft this sequence would make now (at most ``k`` tokens) and
        its per-position acceptance estimate."""
        if self.grammar is not None:
            forced = self.grammar.forced()
            if forced:
                return Draft("grammar", forced[:k]), self.acceptance["grammar"].rate
        tokens, matched = self.index.propose(tail, k)
        if not tokens:
            return None, 0.0
        acc = self.acceptance["ngram"]
        if self.produced < self._rest_until:
            if matched < 12:
                return None, 0.0
            # A long match: the text has turned into a copy; try again now.
            self._rest_until = 0
            acc.reset()
        return Draft("ngram", tokens), acc.rate_with(_match_prior(matched))

    def pass_step(self) -> bool:
        """A step that can take no draft of this sequence's, whatever it
        proposed: keep up what ``candidate`` keeps (the index, which it would
        bring up to date now or at the next search: the same tables), without
        asking the grammar or searching. False for a resting sequence:
        its candidate may end the rest (a long match), so it is asked anyway,
        and the drafts it makes later are the same."""
        if self.produced < self._rest_until:
            return False
        self.index.keep_up()
        return True

    def verified(self, draft: Draft, accepted: int) -> None:
        self.stats.add(draft.source, len(draft.tokens), accepted)
        self.acceptance[draft.source].observe(len(draft.tokens), accepted)
        if draft.source != "ngram":
            return
        if accepted == 0:
            self._failures += 1
            if self._failures >= 3:
                # Drafts keep failing: rest, longer each time, then start afresh.
                self._rest_until = self.produced + self._rest
                self._rest = min(self._rest * 2, 1024)
                self._failures = 0
                self.acceptance["ngram"].reset()
        else:
            self._failures = 0
            if accepted == len(draft.tokens):
                self._rest = 16


def _match_prior(matched: int) -> float:
    """Acceptance to expect, before any draft is verified, from how long the
    match is: a long one means the text is being copied."""
    if matched >= 12:
        return 0.9
    if matched >= 6:
        return 0.75
    return 0.4


@dataclass(frozen=True)
class Planner:
    """How many draft tokens a sequence gets in a step."""

    max_draft: int = 16
    # With other work in the step: the most its cost may grow for a draft.
    fair_slack: float = 0.10

    def no_room(self, cost: DecodeCost, base_tokens: int) -> bool:
        """Whether, beside other work, one more token already costs more
        than ``fair_slack``: then ``length`` is 0 for any draft."""
        return cost.ms(base_tokens + 1) > cost.ms(base_tokens) * (1 + self.fair_slack)

    def length(self, cost: DecodeCost, rate: float, available: int, *, base_tokens: int, base_yield: int,
               shared: bool) -> int:
        """The draft length (0: none) that maximizes the step's expected
        tokens per millisecond. ``base_tokens``: the batch without this
        draft; ``base_yield``: tokens the step yields without it (one per
        decoding sequence); ``shared``: other sequences decode or prefill
        in this step."""
        limit = min(self.max_draft, available)
        if limit <= 0 or rate <= 0.0:
            return 0
        base_ms = cost.ms(base_tokens)
        best_k, best = 0, base_yield / base_ms
        ceiling = base_ms * (1 + self.fair_slack) if shared else float("inf")
        gained = 0.0
        p = 1.0
        for k in range(1, limit + 1):
            ms = cost.ms(base_tokens + k)
            if ms > ceiling:
                break
            p *= rate
            gained += p
            value = (base_yield + gained) / ms
            if value > best:
                best_k, best = k, value
        return best_k
