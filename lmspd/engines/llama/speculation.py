"""Speculative decoding without a draft model: what a sequence proposes to
evaluate beyond its next token, and whether proposing pays.

Two sources, cheapest first:

- ``grammar``: the tokens the sequence's grammar forces next (llguidance's
  fast-forward tokens: ``"path": "``, ``*** Update File: ``): right unless
  the turn ends there;
- ``ngram``: the sequence's own tokens (the prompt and the output so far:
  everything its KV holds). The text's last few tokens propose what
  followed their latest earlier occurrence, token by token, each with the
  chance that it is right: how often that n-gram was followed by that
  token (``NgramIndex``, counts updated per accepted token), scaled by how
  the sequence's drafts have fared against those estimates
  (``SequenceSpeculation.calibration``).

The scheduler evaluates the draft in the same batch as every other
sequence's next token and the sampler picks at each position; a draft token
is kept while the pick equals it, so the output is exactly what decoding
without speculation produces, at any temperature (``Scheduler._verify``).

Whether to draft, and how much, is priced (``Planner``): a batch of ``n``
tokens costs ``DecodeCost.ms(n)`` (learned; on a 2-core CPU a batch of 8
costs ~4-5x a batch of 1), a draft whose positions are right with chances
``a1, a2, ...`` (each given the ones before) yields ``a1 + a1 a2 + ...``
extra tokens. A draft is made only as long as it raises the step's tokens
per millisecond (so it ends where the text it copies branches: the number
after ``store.items[`` in a file of numbered functions), and, while other
sequences decode or a prompt prefills in the same step, only as far as it
keeps the step within ``fair_slack`` of its cost without the draft (so that
nobody else's next token waits for it). A sequence whose drafts keep
failing stops drafting for a while (doubling), and starts again at once
where a long match shows the text has turned into a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

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


# One n-gram's record in ``NgramIndex``, in the smallest form that says it:
#
# - seen once: a plain int, where it ended (exclusive): it was followed by
#   ``tokens[end]`` once. Most n-grams of a long prompt or of free text are
#   seen once, and the index of a full window is mostly these: the key's
#   tuple and an int shared by every size's table, no object of its own;
# - seen again: ``[end, seen, follows]`` — where it last ended, how often it
#   occurred with a continuation, and ``follows``: while every occurrence
#   had the same continuation, that token (a plain int: its count is
#   ``seen``, since each occurrence with a continuation counts once in
#   both), and from the second distinct token on, {next token: how often}.
#
# A ``{token: 1}`` dict per entry was most of the index's memory (853 bytes
# per indexed token of text where every n-gram is new, bench/README.md);
# the forms are told apart by ``type(x) is int`` (cheaper than ``.__class__``).
# One probe of one table finds all of an entry (they were three tables keyed
# alike, the continuations keyed by a tuple one token longer, built for every
# token indexed and every draft position); a list, not an object: a repeated
# n-gram costs one small allocation, not an ``__init__``.
Entry = Any  # int | list[Any]
_END, _SEEN, _FOLLOWS = 0, 1, 2


class NgramIndex:
    """Every n-gram (``sizes``) of ``tokens``, a list the owner appends to
    (the sequence's evaluated tokens): where it last ended, how often it
    occurred with a continuation, and how often with each continuation
    (``Entry``). Caught up lazily, at most ``per_step`` positions a call, so
    that a long prompt's index is built over a few steps rather than
    stalling one (and mostly during the prefill steps, ``catch_up``); a
    prompt longer than ``window`` is indexed from its last ``window``
    tokens.

    A proposal walks the text token by token: at each position the longest
    n-gram of the context (and of the draft so far) proposes what followed
    its latest earlier occurrence, with an estimate that it is right
    (``Proposal.rates``): how often that n-gram was followed by that token,
    against how often it occurred. So a draft stops being worth its price
    where the text it copies branches (``store.items[`` followed by 0, 1, 2
    ... in a file): the latest continuation of an n-gram seen with many is
    a guess, that of one always followed by the same token is not. The
    occurrence's own match length (how far back the context agrees with
    it) firms the estimate up: a match of 16 tokens is a copy being made.

    A copy being made is followed where the latest occurrence would jump
    away from it: the index remembers how far back the text the last walk
    copied lies (``_offset``, context position minus source position), and
    a walk proposes that source's next token instead of the latest
    occurrence's wherever the source matches the context further back.
    Copying a module of numbered functions, the latest ``store.items[`` is
    in the function just written (its number is the wrong one); the source
    being copied has the right one. Such a position is priced as an n-gram
    seen once at that match length would be (its own, longer n-gram is).

    Most steps of free text match nothing: ``propose_or_none`` finds that
    with one probe (the context's shortest n-gram: a longer one ending at the
    same token is indexed only with it), before building anything."""

    def __init__(self, tokens: list[int], *, sizes: tuple[int, ...] = (6, 3), window: int = 16384,
                 per_step: int = 256) -> None:
        self.tokens = tokens
        self.sizes = sizes
        # Per size (in ``sizes``' order): n-gram -> its ``Entry`` (an int where seen once).
        self._maps: list[dict[tuple[int, ...], Entry]] = [{} for _ in sizes]
        self._tables = list(zip(sizes, self._maps, strict=True))
        self._shortest = min(range(len(sizes)), key=lambda i: sizes[i])
        self._longest = max(sizes)
        self._per_step = per_step
        # Every n-gram ending at or before ``_done`` (exclusive end) is in.
        self._done = max(0, len(tokens) - window)
        # The copy the last walk followed: a position of the context (with
        # its tail) less that of the token it copied (0: none).
        self._offset = 0

    def catch_up(self, budget: int) -> None:
        """Index up to ``budget`` more positions (a prefill step calls this
        with its chunk's size, so that decoding starts with the index whole)."""
        self._catch_up(len(self.tokens) - 1, budget)

    def _catch_up(self, upto: int, budget: int) -> None:
        toks = self.tokens
        start = self._done + 1
        end = min(upto, self._done + budget)
        longest = self._longest
        for e in range(start, end + 1):
            token = toks[e]
            # One tuple of the longest n-gram ending here; the shorter ones
            # are its tails (a tuple's whole slice is itself).
            ngram = tuple(toks[e - longest:e] if e >= longest else toks[:e])
            for size, table in self._tables:
                if e < size:
                    continue
                key = ngram[-size:]
                entry = table.get(key)
                if entry is None:
                    table[key] = e  # seen once: followed by toks[e]
                    continue
                if type(entry) is int:  # seen a second time
                    first = toks[entry]
                    table[key] = [e, 2, token if first == token else {first: 1, token: 1}]
                    continue
                entry[_END] = e
                seen = entry[_SEEN]
                entry[_SEEN] = seen + 1
                follows = entry[_FOLLOWS]
                if type(follows) is int:
                    if follows != token:  # the second distinct continuation
                        entry[_FOLLOWS] = {follows: seen, token: 1}
                else:
                    follows[token] = follows.get(token, 0) + 1
        self._done = max(self._done, end)

    def keep_up(self) -> None:
        """Index what a ``propose`` now would index first (at most
        ``per_step`` positions)."""
        n = len(self.tokens)
        if self._done == n - 1:  # the usual step: nothing new since the last call
            return
        if n < self._done:  # the list was cut back (never, while a sequence runs): start over
            for table in self._maps:
                table.clear()
            self._done = 0
            self._offset = 0
        # Only n-grams with a continuation inside ``tokens``.
        if self._done < n - 1:
            self._catch_up(n - 1, self._per_step)

    def propose(self, tail: list[int], k: int, *, floor: float = 0.02) -> "Proposal":
        """Up to ``k`` tokens that continue the context (``tokens`` +
        ``tail``) as its latest earlier occurrences did, each with the
        estimate that it is right given the ones before it; the walk stops
        where the chance that the whole draft so far is right falls below
        ``floor``."""
        return self.propose_or_none(tail, k, floor=floor) or Proposal([], [], 0)

    def propose_or_none(self, tail: list[int], k: int, *, floor: float = 0.02,
                        min_match: int = 0) -> "Proposal | None":
        """``propose``, or None where it would propose nothing or where its
        first position's occurrence matches fewer than ``min_match`` tokens
        (``Proposal.matched``: a resting sequence drafts only on a long
        match; it learns that without walking the draft)."""
        self.keep_up()
        if k <= 0 or not self._may_match(tail):
            return None
        toks = self.tokens
        cur = toks[-MATCH_CAP:] + tail if tail else toks[-MATCH_CAP:]
        draft: list[int] = []
        rates: list[float] = []
        matched = 0
        chance = 1.0
        e_prev = -2
        m = 0
        tables = self._tables
        longest = self._longest
        found: list[Entry] = []
        n = len(toks)
        pos = n + len(tail)  # the context position being proposed
        offset = self._offset
        for _ in range(k):
            # The longest n-gram found proposes what followed its latest occurrence.
            found.clear()
            e = -1
            ngram = tuple(cur[-longest:])  # the shorter n-grams are its tails
            for size, table in tables:
                if len(ngram) < size:
                    continue
                entry = table.get(ngram[-size:])
                if entry is not None:
                    if e < 0:
                        e = entry if type(entry) is int else entry[_END]
                    found.append(entry)
            if e < 0:
                break
            # How far back the context agrees with the occurrence: one more
            # than at the last position where the walk goes on along it.
            m_e = min(m + 1, MATCH_CAP) if e == e_prev + 1 else _match_length(toks, e, cur)
            c = pos - offset  # where the copy followed so far goes on
            copying = False
            if offset and c != e and 0 < c < n:
                m_c = min(m + 1, MATCH_CAP) if c == e_prev + 1 else _match_length(toks, c, cur)
                if m_c > m_e and m_c >= COPY_MATCH:
                    e, m_e, copying = c, m_c, True
            m = m_e
            token = toks[e]
            if not draft:
                if m < min_match:
                    return None
                matched = m
            # The chance that ``token`` comes next: how often it followed the
            # n-grams found (longest first) against how often they occurred,
            # the best of them (a shorter n-gram may have seen the fixed
            # text after an item's number more often than the longer one).
            # The pseudo-count shrinks that towards 0 by how far the
            # occurrence matched: a long match makes it small (a copy being
            # made), a short one large (a phrase that happens to recur).
            pseudo = 2.0 if m < 6 else 0.5 if m < 12 else 0.15
            # A copy followed past the latest occurrence: its own longer
            # n-gram, seen once, at this match length.
            rate = 1 / (1 + pseudo) if copying else 0.0
            for entry in found:
                if type(entry) is int:  # seen once, followed by toks[entry]
                    if toks[entry] != token:
                        continue
                    r = 1 / (1 + pseudo)
                else:
                    follows = entry[_FOLLOWS]
                    seen = entry[_SEEN]
                    if type(follows) is int:  # one continuation, ``seen`` times
                        if follows != token:
                            continue
                        r = seen / (seen + pseudo)
                    else:
                        r = follows.get(token, 0) / (seen + pseudo)
                if r > rate:
                    rate = r
            draft.append(token)
            rates.append(rate)
            cur.append(token)
            e_prev = e
            offset = pos - e
            pos += 1
            chance *= rate
            if chance < floor:
                break
        if draft:
            self._offset = offset
        return Proposal(draft, rates, matched) if draft else None

    def _may_match(self, tail: list[int]) -> bool:
        """Whether the context (``tokens`` + ``tail``) ends in an indexed
        n-gram of the shortest size: one probe. Where it does not, no longer
        one matches either (the n-grams ending at a position are indexed
        together), and the walk would find nothing."""
        size, table = self._tables[self._shortest]
        t = len(tail)
        if t >= size:
            key = tuple(tail[t - size:])
        elif len(self.tokens) + t < size:
            return False
        else:
            key = (*self.tokens[t - size:], *tail)
        return key in table


MATCH_CAP = 16
# A copy is followed past the latest occurrence only where it agrees with
# the context as far back as a match is measured (shorter: a model writing
# its own variant of a structure, bench/README.md).
COPY_MATCH = MATCH_CAP


def _match_length(toks: list[int], e: int, context: list[int], cap: int = MATCH_CAP) -> int:
    """How many tokens before ``toks[e]`` equal the end of ``context``."""
    m = 0
    n = len(context)
    while m < cap and m < e and m < n and toks[e - 1 - m] == context[-1 - m]:
        m += 1
    return m


@dataclass(slots=True)
class Proposal:
    tokens: list[int]
    # Per position: the chance it is right, given that those before it are.
    rates: list[float]
    # How many tokens the first position's occurrence matched (0: none).
    matched: int


class ForcedTokens(Protocol):
    def forced(self) -> list[int]: ...


@dataclass
class DecayingRatio:
    """Hits over trials, each an exponentially decaying sum (recent drafts
    weigh most), pulled towards ``prior`` by ``weight`` trials' worth."""

    prior: float
    weight: float
    decay: float = 0.85
    hits: float = 0.0
    trials: float = 0.0

    @property
    def value(self) -> float:
        return (self.hits + self.prior * self.weight) / (self.trials + self.weight)

    def add(self, hits: float, trials: float) -> None:
        self.hits = self.decay * self.hits + hits
        self.trials = self.decay * self.trials + trials

    def reset(self) -> None:
        self.hits = self.trials = 0.0


def positions_tried(drafted: int, accepted: int) -> int:
    """A draft's positions the sampler judged: every accepted one and the
    first rejected one (those after it were never in question)."""
    return min(drafted, accepted + 1)


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
    # Per position: the chance it is right, given that those before it are
    # (what the planner priced it at).
    rates: list[float] = field(default_factory=list)

    def cut(self, k: int) -> None:
        del self.tokens[k:]
        del self.rates[k:]


# No draft position is ever taken for certain: a sampler at temperature may
# pick anything, and a turn may end anywhere.
RATE_CAP = 0.97


# How far a sequence's record may scale the index's estimates
# (``SequenceSpeculation.calibration``).
CALIBRATION_BOUNDS = (0.25, 2.0)


class SequenceSpeculation:
    """One sequence's drafting state: its index, acceptance per source (and
    how the index's estimates compare with it), and whether it is resting
    after failed drafts."""

    def __init__(self, tokens: list[int], grammar: ForcedTokens | None) -> None:
        self.index = NgramIndex(tokens)
        self.grammar = grammar
        # Grammar drafts: accepted positions over positions tried (what
        # their draft positions are priced at).
        self.grammar_acceptance = DecayingRatio(prior=0.95, weight=4.0)
        # N-gram drafts: accepted positions over those the index's estimates
        # expected (``Proposal.rates``). Where a model copies a file it read
        # once (every n-gram seen once: a cautious estimate) it grows; where
        # it samples at temperature, or writes its own variant of the text,
        # it shrinks.
        self.calibration = DecayingRatio(prior=1.0, weight=2.0)
        self.stats = DecodeStats()
        self._failures = 0
        self._rest_until = 0  # output tokens
        self._rest = 16
        self.produced = 0  # output tokens taken so far

    def candidate(self, tail: list[int], k: int) -> Draft | None:
        """The draft this sequence would make now (at most ``k`` tokens),
        with the chance of each position (``Draft.rates``)."""
        if self.grammar is not None:
            forced = self.grammar.forced()
            if forced:
                tokens = forced[:k]
                return Draft("grammar", tokens, [self.grammar_acceptance.value] * len(tokens))
        resting = self.produced < self._rest_until
        # Resting, only a long match drafts: a shorter one is None at once.
        proposal = self.index.propose_or_none(tail, k, min_match=12 if resting else 0)
        if proposal is None:
            return None
        if resting:
            # A long match: the text has turned into a copy; try again now.
            self._rest_until = 0
            self.calibration.reset()
        factor = self.factor
        return Draft("ngram", proposal.tokens, [min(RATE_CAP, r * factor) for r in proposal.rates])

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

    @property
    def factor(self) -> float:
        """What this sequence's record scales the index's estimates by."""
        low, high = CALIBRATION_BOUNDS
        return min(high, max(low, self.calibration.value))

    def verified(self, draft: Draft, accepted: int) -> None:
        self.stats.add(draft.source, len(draft.tokens), accepted)
        tried = positions_tried(len(draft.tokens), accepted)
        if draft.source == "grammar":
            self.grammar_acceptance.add(accepted, tried)
            return
        factor = self.factor
        # The index's own estimates (the draft carries them calibrated).
        self.calibration.add(accepted, sum(min(1.0, r / factor) for r in draft.rates[:tried]))
        if accepted == 0:
            self._failures += 1
            if self._failures >= 3:
                # Drafts keep failing: rest, longer each time, then start afresh.
                self._rest_until = self.produced + self._rest
                self._rest = min(self._rest * 2, 1024)
                self._failures = 0
                self.calibration.reset()
        else:
            self._failures = 0
            if accepted == len(draft.tokens):
                self._rest = 16


@dataclass(frozen=True)
class Planner:
    """How many draft tokens a sequence gets in a step."""

    # The price decides the length (``length``); this only bounds a step's
    # work. On a GPU a batch of 32 or 64 costs about what one token does, and
    # a file being copied is kept 30-60 tokens at a time (llama.cpp's n-gram
    # drafts on one ran 35-48 tokens long): 16 left most of that untaken.
    # On a 2-core CPU too a copy kept whole pays past 16 (a batch of 24
    # costs ~9 single tokens at 1,000 tokens of context: drafts of ~23).
    max_draft: int = 64
    # With other work in the step: the most its cost may grow for a draft.
    fair_slack: float = 0.10

    def no_room(self, cost: DecodeCost, base_tokens: int) -> bool:
        """Whether, beside other work, one more token already costs more
        than ``fair_slack``: then ``length`` is 0 for any draft."""
        return cost.ms(base_tokens + 1) > cost.ms(base_tokens) * (1 + self.fair_slack)

    def room(self, cost: DecodeCost, limit: int, *, base_tokens: int, shared: bool) -> int:
        """The longest draft (at most ``limit``) that ``length`` could give:
        beside other work, it stops where the step would cost more than
        ``fair_slack`` more; alone, ``limit``. A sequence need not propose
        more (on a CPU beside other sequences: a few tokens of 16): each
        position walked costs a few µs of the step, and ``length`` gives
        the shorter draft what it gives the longer one."""
        limit = min(self.max_draft, limit)
        if not shared:
            return limit
        ceiling = cost.ms(base_tokens) * (1 + self.fair_slack)  # as ``length`` computes it
        k = 0
        while k < limit and cost.ms(base_tokens + k + 1) <= ceiling:
            k += 1
        return k

    def length(self, cost: DecodeCost, rate: float | Sequence[float], available: int, *, base_tokens: int,
               base_yield: int, shared: bool) -> int:
        """The draft length (0: none) that maximizes the step's expected
        tokens per millisecond. ``rate``: the chance that each position is
        right given those before it (one for all, or one per position);
        ``base_tokens``: the batch without this draft; ``base_yield``:
        tokens the step yields without it (one per decoding sequence);
        ``shared``: other sequences decode or prefill in this step."""
        limit = min(self.max_draft, available)
        rates = [rate] * limit if isinstance(rate, (int, float)) else list(rate[:limit])
        limit = len(rates)
        if limit <= 0 or rates[0] <= 0.0:
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
            p *= rates[k - 1]
            gained += p
            value = (base_yield + gained) / ms
            if value > best:
                best_k, best = k, value
        return best_k
