"""The speculation planner's parts, without a model: the n-gram index over a
sequence's own tokens, the price of a draft (``Planner.length``) and the
fairness rule, and resting after failed drafts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.engines.llama.speculation import Draft, NgramIndex, Planner, Proposal, SequenceSpeculation
from lmspd.engines.llama.stepcost import DecodeCost, HostCost


def test_index_proposes_what_followed_the_latest_earlier_occurrence():
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2]
    index = NgramIndex(tokens, sizes=(3,))
    # The context ends "1 2" + pending "3": the latest earlier "1 2 3" is followed by 7 8.
    got = index.propose([3], 4)
    assert got.tokens == [7, 8, 1, 2]
    assert got.matched == 3


def test_index_is_updated_incrementally_as_tokens_are_appended():
    tokens = [5, 6, 7, 8]
    index = NgramIndex(tokens, sizes=(2,))
    assert index.propose([], 3).tokens == []
    tokens.extend([1, 5, 6])  # "5 6" now recurs: what followed its first occurrence is proposed
    got = index.propose([], 3, floor=0.0)
    assert (got.tokens, got.matched) == ([7, 8, 1], 2)


def test_index_builds_a_long_prompt_over_several_steps():
    tokens = list(range(1000)) + [10, 11, 12]
    index = NgramIndex(tokens, sizes=(3,), per_step=300)
    index.propose([], 2)
    # The first call indexed at most 300 positions, the rest comes later.
    assert index._done == 300
    for _ in range(4):
        index.propose([], 2)
    got = index.propose([], 2, floor=0.0)
    assert (got.tokens, got.matched) == ([13, 14], 3)


def test_a_prefill_step_indexes_what_it_evaluated():
    tokens = list(range(600)) + [10, 11, 12]
    index = NgramIndex(tokens, sizes=(3,), per_step=1)
    index.catch_up(1000)
    assert index.propose([], 2, floor=0.0).tokens == [13, 14]


@given(st.lists(st.integers(0, 5), min_size=0, max_size=60), st.lists(st.integers(0, 5), max_size=3),
       st.integers(1, 8))
def test_a_proposal_is_always_a_continuation_of_a_real_match(tokens, tail, k):
    index = NgramIndex(tokens, sizes=(4, 2))
    got = index.propose(tail, k, floor=0.0)
    draft, matched = got.tokens, got.matched
    context = tokens + tail
    if not draft:
        return
    assert 1 <= len(draft) <= k and matched >= 2 and len(got.rates) == len(draft)
    assert all(0.0 < r < 1.0 for r in got.rates)
    # Each token continues an earlier occurrence of the n-gram before it
    # (the context's end, then the draft's): the walk copies what was seen.
    walked = context + draft
    for i, token in enumerate(draft):
        at = len(context) + i
        assert any(tokens[e - 2:e] == walked[at - 2:at] and tokens[e] == token for e in range(2, len(tokens)))


class CpuCost(DecodeCost):
    """The issue's measured costs on this machine (1 token: 11 ms, 2: 18, 4: 27, 8: 46, 16: 71)."""

    def __init__(self) -> None:
        super().__init__()
        for n, ms in ((1, 11), (2, 18), (4, 27), (8, 46), (16, 71)):
            self.observe(n, ms)


def test_blind_drafting_does_not_pay_on_a_compute_bound_machine():
    planner, cost = Planner(), CpuCost()
    # A sequence alone: a 50 % draft never beats one token per 11 ms; a 90 % one does.
    assert planner.length(cost, 0.5, 16, base_tokens=1, base_yield=1, shared=False) == 0
    k = planner.length(cost, 0.9, 16, base_tokens=1, base_yield=1, shared=False)
    assert k >= 4
    # Its expected yield per millisecond beats the plain step's.
    gained = sum(0.9 ** i for i in range(1, k + 1))
    assert (1 + gained) / cost.ms(1 + k) > 1 / cost.ms(1)


def test_a_draft_where_batches_are_cheap_takes_the_whole_room():
    cost = DecodeCost()
    for n in (1, 2, 4, 8, 16, 32):
        cost.observe(n, 8.0)  # a GPU: a batch of 32 costs what one token costs
    assert Planner().length(cost, 0.4, 16, base_tokens=1, base_yield=1, shared=False) == 16


def test_a_copy_drafts_past_sixteen_tokens_where_batches_are_cheap():
    # A file read once (every n-gram of it seen once), 41 tokens of it written out again.
    source = list(range(1000, 1300))
    tokens = [1, 2, 3, *source, 4, 5, *source[:40]]
    spec = SequenceSpeculation(tokens, None)
    spec.index.catch_up(len(tokens))
    for _ in range(4):  # its drafts have all been kept
        spec.verified(Draft("ngram", source[:8], [0.8] * 8), 8)
    gpu = DecodeCost()
    for n in (1, 2, 4, 8, 16, 32, 64):
        gpu.observe(n, 8.0)
    planner = Planner()
    room = planner.room(gpu, 400, base_tokens=1, shared=False)
    draft = spec.candidate([source[40]], room)
    assert draft is not None
    k = planner.length(gpu, draft.rates, len(draft.tokens), base_tokens=1, base_yield=1, shared=False)
    assert k > 16 and draft.tokens[:k] == source[41:41 + k]
    # At the CPU costs (16 tokens 6.5x one, 32 taken at the prior's ~12x): no further.
    assert 1 <= planner.length(CpuCost(), draft.rates, len(draft.tokens), base_tokens=1, base_yield=1,
                               shared=False) <= 16


def test_fairness_a_draft_beside_other_work_keeps_the_step_within_its_slack():
    cost = CpuCost()
    planner = Planner(fair_slack=0.10)
    # Another sequence decodes in the step (2 tokens without the draft): 18 ms.
    # A 95 % draft would pay for the batch as a whole, but the other sequence's
    # next token would wait for it: at most 10 % more.
    alone = planner.length(cost, 0.95, 16, base_tokens=2, base_yield=2, shared=False)
    shared = planner.length(cost, 0.95, 16, base_tokens=2, base_yield=2, shared=True)
    assert alone > 0
    assert cost.ms(2 + shared) <= cost.ms(2) * 1.10
    assert shared < alone
    # A prefill chunk in the step (64 tokens): the draft is bounded the same way.
    k = planner.length(cost, 0.95, 16, base_tokens=65, base_yield=1, shared=True)
    assert cost.ms(65 + k) <= cost.ms(65) * 1.10


@given(st.integers(1, 80), st.floats(0.01, 1.0), st.integers(1, 16), st.sampled_from(["cpu", "gpu", "prior"]))
def test_no_room_says_exactly_when_no_draft_fits_beside_other_work(base, rate, available, machine):
    """The scheduler skips asking for candidates where ``no_room``: right
    only if every candidate would have been given 0."""
    cost = CpuCost() if machine == "cpu" else DecodeCost()
    if machine == "gpu":
        for n in (1, 2, 4, 8, 16, 32):
            cost.observe(n, 8.0 + n * 0.01)
    planner = Planner()
    k = planner.length(cost, rate, available, base_tokens=base, base_yield=base, shared=True)
    if planner.no_room(cost, base):
        assert k == 0


def test_no_room_on_a_cpu_beside_four_sequences_but_room_on_a_gpu():
    assert Planner().no_room(CpuCost(), 4)
    gpu = DecodeCost()
    for n in (1, 2, 4, 8, 16, 32):
        gpu.observe(n, 8.0)
    assert not Planner().no_room(gpu, 4)


def test_a_passed_step_leaves_the_index_as_asking_would():
    """Steps passed (``pass_step``) and steps searched leave the same index:
    the next proposal is the one searching every step would have made."""
    text = [7, 1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3] * 5
    asked_tokens: list[int] = []
    passed_tokens: list[int] = []
    asked = SequenceSpeculation(asked_tokens, None)
    passed = SequenceSpeculation(passed_tokens, None)
    for i, token in enumerate(text):
        asked_tokens.append(token)
        passed_tokens.append(token)
        asked.candidate([], 4)
        if i % 7 == 6:
            assert passed.candidate([], 4) == asked.candidate([], 4)
        else:
            assert passed.pass_step()
        assert passed.index._maps == asked.index._maps and passed.index._done == asked.index._done


def test_a_resting_sequence_is_asked_even_where_no_draft_fits():
    spec = SequenceSpeculation([1, 2, 3, 1, 2], None)
    spec._rest_until, spec.produced = 100, 5
    assert not spec.pass_step()


def test_failed_drafts_rest_then_a_long_match_resumes():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8] * 3
    spec = SequenceSpeculation(tokens, None)
    for _ in range(3):
        draft = spec.candidate([], 4)
        assert draft is not None
        spec.verified(draft, 0)
    spec.produced = 1
    # Resting: a short match proposes nothing.
    short = SequenceSpeculation([9, 9, 1, 2, 3, 5, 1, 2], None)
    short._rest_until, short.produced = 100, 0
    assert short.candidate([3], 4) is None
    # The text turned into a copy (a match of 12+ tokens): drafting again at once.
    assert spec.candidate([], 4) is not None


class Forcing:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def forced(self) -> list[int]:
        return self.tokens


def test_a_grammar_drafts_price_follows_its_outcomes():
    """Forced tokens are priced at the sequence's record with them: rejected
    ones (a turn that ended where the grammar allowed more) cheapen the
    next, kept ones restore it."""
    spec = SequenceSpeculation([1, 2, 3], Forcing([7, 8, 9]))
    first = spec.candidate([], 4)
    assert first is not None and first.source == "grammar" and first.tokens == [7, 8, 9]
    for _ in range(3):
        spec.verified(Draft("grammar", [7, 8, 9], list(first.rates)), 0)
    rejected = spec.candidate([], 4)
    assert rejected is not None and rejected.rates[0] < first.rates[0] * 0.65
    for _ in range(5):
        spec.verified(Draft("grammar", [7, 8, 9], list(rejected.rates)), 3)
    kept = spec.candidate([], 4)
    assert kept is not None and kept.rates[0] > rejected.rates[0] * 1.3
    assert spec.stats.as_json()["by_source"] == {"grammar": {"drafted": 24, "accepted": 15},
                                                 "ngram": {"drafted": 0, "accepted": 0}}


def test_ngram_drafts_that_keep_being_kept_are_priced_higher():
    spec = SequenceSpeculation([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5], None)
    spec.index.catch_up(100)
    before = spec.candidate([], 2)
    assert before is not None and before.source == "ngram"
    for _ in range(5):
        spec.verified(Draft("ngram", list(before.tokens), list(before.rates)), len(before.tokens))
    after = spec.candidate([], 2)
    assert after is not None and after.tokens == before.tokens and after.rates[0] > before.rates[0]
    assert spec.stats.as_json()["accepted"] == 5 * len(before.tokens)


def test_host_cost_histogram_is_cumulative():
    h = HostCost()
    for s in (0.0002, 0.0004, 0.003):
        h.observe(s, 4)
    snap = h.snapshot()
    buckets = dict(snap["buckets"])  # type: ignore[arg-type]
    assert buckets["0.00025"] == 1 and buckets["0.0005"] == 2 and buckets["0.005"] == 3 and buckets["+Inf"] == 3
    assert snap["mean_ms_by_sequences"] == {4: 1.2}


def _file_like(functions: int = 12) -> list[int]:
    """A module's tokens: the same lines for every function but for its
    number (``def restock_item_N(store, count): return store.items[N]``)."""
    out: list[int] = []
    for i in range(functions):
        out += [1, 2, 3, 100 + i, 4, 5, 6, 7, 8, 9, 10, 100 + i, 11, 12]
    return out


def test_a_draft_stops_where_the_copied_text_branches():
    """The n-gram before each function's number was followed by a different
    number every time: a draft through it is a guess. The old index gave
    every position one rate (the sequence's, or the match's) and drafted
    through the number; now the position after a branch is priced as the
    guess it is, and the draft ends just before it."""
    tokens = _file_like()
    # The model writes the module again and has reached "def restock_item_":
    # the number comes next, then the fixed rest of the line.
    tokens += [1, 2, 3]
    got = NgramIndex(tokens).propose([], 8, floor=0.0)
    assert got.tokens[0] == 100 + 11  # the latest occurrence's number: a guess
    assert got.rates[0] < 0.2
    # Past the number the line is the same every time.
    tokens += [100 + 5]
    got = NgramIndex(tokens).propose([], 8, floor=0.0)
    assert got.tokens[:7] == [4, 5, 6, 7, 8, 9, 10]
    assert min(got.rates[:7]) > 0.6
    assert min(got.rates[3:7]) > 0.9  # "4 5 6" has been followed by 7 every time
    # ... up to the next number: a guess again.
    assert got.rates[7] < 0.2
    spec = SequenceSpeculation(tokens, None)
    draft = spec.candidate([], 16)
    assert draft is not None
    k = Planner().length(CpuCost(), draft.rates, len(draft.tokens), base_tokens=1, base_yield=1, shared=False)
    assert 1 <= k <= 7  # never through the number
    # Once the sequence's drafts have been kept more often than estimated
    # (a model copying the file), the whole fixed run, still not the number.
    for _ in range(4):
        spec.verified(Draft("ngram", [4, 5, 6, 7], [0.6] * 4), 4)
    draft = spec.candidate([], 16)
    assert draft is not None
    assert Planner().length(CpuCost(), draft.rates, len(draft.tokens), base_tokens=1, base_yield=1,
                            shared=False) == 7


def test_a_copy_being_made_is_followed_past_the_latest_occurrence():
    """Copying a module it read, the model has written function 0 and is in
    function 1: before the number, the latest occurrence of the n-gram is in
    the function it has just written (its number, 100, is the wrong one);
    the function it is copying, which agrees with the context all the way
    back, has the right one. Once a walk has followed that copy, the next
    walk goes on along it, priced as an n-gram seen once."""
    source = _file_like(6)
    tokens = source + [300, 301] + source[:19]  # "... 12 | 1 2 3 101 4"
    index = NgramIndex(tokens)
    assert index.propose([], 4, floor=0.0).tokens == [5, 6, 7, 8]  # one place has "101 4": the copy
    tokens.extend(source[19:25])  # "... 101 4 5 6 7 8 9 10": the number comes next
    got = index.propose([], 3, floor=0.0)
    assert got.tokens == [101, 11, 12]
    assert got.rates[0] > 0.8
    # Without a copy followed: the latest occurrence's number, a guess.
    fresh = NgramIndex(list(tokens)).propose([], 3, floor=0.0)
    assert fresh.tokens[0] == 100 and fresh.rates[0] < 0.3


def test_a_copy_of_text_seen_once_drafts_long_once_it_is_confirmed():
    """Every n-gram of a file read once occurs once: alone, a cautious
    estimate. A model that copies it has every draft accepted, and the
    sequence's calibration lets the drafts grow to what the machine pays for."""
    prompt = [(i * 7919) % 5000 + 10 for i in range(400)]  # no n-gram repeats
    tokens = list(prompt)
    spec = SequenceSpeculation(tokens, None)
    spec.index.catch_up(10_000)
    cost, planner = CpuCost(), Planner()
    copied, lengths = 0, []
    tokens += prompt[:2]  # the copy begins
    copied = 2
    while copied < 200:
        draft = spec.candidate([prompt[copied]], 16)
        assert draft is not None
        k = planner.length(cost, draft.rates, len(draft.tokens), base_tokens=1, base_yield=1, shared=False)
        lengths.append(k)
        if k == 0:
            tokens.append(prompt[copied])
            copied += 1
            continue
        draft.cut(k)
        assert draft.tokens == prompt[copied + 1:copied + 1 + k]
        spec.verified(draft, k)
        tokens.extend(prompt[copied:copied + 1 + k])
        copied += 1 + k
    assert max(lengths[-3:]) >= 8


def test_a_sequence_whose_drafts_fail_more_than_estimated_drafts_less():
    tokens = _file_like() + [1, 2, 3, 100 + 5]
    spec = SequenceSpeculation(tokens, None)
    before = spec.candidate([], 8)
    assert before is not None
    for _ in range(2):  # sampled at temperature: the fixed run is not kept
        spec.verified(Draft("ngram", before.tokens[:4], before.rates[:4]), 0)
    after = spec.candidate([], 8)
    assert after is not None and after.rates[0] < before.rates[0] * 0.7


# -- the index's tables against a scan of the tokens themselves --------------------------------


class Scan:
    """What ``NgramIndex.propose`` must answer, found by scanning every
    earlier occurrence in ``tokens`` (no tables, nothing cached): at each
    position the longest n-gram of the context that occurred with a
    continuation proposes what followed its latest occurrence, at the best
    of each size's count of that continuation over its occurrences — unless
    the text the previous walk copied (``offset``: context position less
    source position, kept from call to call as the index keeps it) goes on
    agreeing with the context for a whole match (16 tokens) where the
    latest occurrence agrees less far: then that source's next token, at
    least at the rate of an n-gram seen once."""

    cap = 16

    def __init__(self) -> None:
        self.offset = 0

    def match(self, tokens: list[int], e: int, cur: list[int]) -> int:
        m = 0
        while m < self.cap and m < e and m < len(cur) and tokens[e - 1 - m] == cur[-1 - m]:
            m += 1
        return m

    def propose(self, tokens: list[int], tail: list[int], k: int, sizes: tuple[int, ...], floor: float) -> Proposal:
        cur = tokens[-self.cap:] + tail
        draft: list[int] = []
        rates: list[float] = []
        matched = 0
        chance = 1.0
        pos = len(tokens) + len(tail)
        offset = self.offset
        for _ in range(k):
            ends_by_size = []
            for size in sizes:
                if len(cur) < size:
                    continue
                ends = [e for e in range(size, len(tokens)) if tokens[e - size:e] == cur[-size:]]
                if ends:
                    ends_by_size.append(ends)
            if not ends_by_size:
                break
            e = ends_by_size[0][-1]
            m = self.match(tokens, e, cur)
            c = pos - offset
            copying = False
            if offset and c != e and 0 < c < len(tokens):
                m_c = self.match(tokens, c, cur)
                if m_c > m and m_c >= self.cap:
                    e, m, copying = c, m_c, True
            token = tokens[e]
            pseudo = 2.0 if m < 6 else 0.5 if m < 12 else 0.15
            rate = 1 / (1 + pseudo) if copying else 0.0
            for ends in ends_by_size:
                rate = max(rate, sum(1 for x in ends if tokens[x] == token) / (len(ends) + pseudo))
            if not draft:
                matched = m
            draft.append(token)
            rates.append(rate)
            cur.append(token)
            offset = pos - e
            pos += 1
            chance *= rate
            if chance < floor:
                break
        if draft:
            self.offset = offset
        return Proposal(draft, rates, matched)


def _scanned(tokens: list[int], tail: list[int], k: int, sizes: tuple[int, ...], floor: float) -> Proposal:
    """``Scan().propose``: no copy followed before."""
    return Scan().propose(tokens, tail, k, sizes, floor)


@settings(max_examples=300)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=80), st.lists(st.integers(1, 12), min_size=1, max_size=12),
       st.lists(st.integers(0, 4), max_size=2), st.integers(1, 8), st.sampled_from([0.0, 0.02, 0.3]))
def test_an_index_kept_up_step_by_step_proposes_what_a_scan_of_the_tokens_gives(text, chunks, tail, k, floor):
    """The index is updated in place as tokens arrive (a chunk at a prefill
    step, one at a decoding step, some steps asking nothing) and answers
    from its tables, after a probe that may answer 'no match' alone: after
    every arrival its proposal equals a scan of the tokens, and its tables
    those of an index built afresh. A table gone stale (a count, a latest
    end not moved on, a probe that misses) fails this."""
    sizes = (4, 2)
    tokens: list[int] = []
    index = NgramIndex(tokens, sizes=sizes)
    scan = Scan()
    at = 0
    for i, chunk in enumerate(chunks):
        tokens.extend(text[at:at + chunk])
        at += chunk
        if i % 3 == 2:
            index.keep_up()  # a step that drafts nothing (``pass_step``)
            continue
        want = scan.propose(tokens, tail, k, sizes, floor)
        assert index.propose(tail, k, floor=floor) == want
        got = index.propose_or_none(tail, k, floor=floor)  # the same walk: the same copy followed
        assert got == (want if want.tokens else None)
        fresh = NgramIndex(list(tokens), sizes=sizes)
        fresh.keep_up()
        assert index._maps == fresh._maps and index._done == fresh._done


@settings(max_examples=200)
@given(st.lists(st.integers(0, 3), min_size=20, max_size=60), st.lists(st.integers(1, 6), min_size=1, max_size=20),
       st.integers(1, 8))
def test_an_index_copying_its_own_text_proposes_what_the_scan_gives(source, steps, k):
    """A sequence writing out again a text it holds (a few-letter
    alphabet: its n-grams recur all over, the latest occurrence often not
    the place being copied): at every step the proposal, with the copy the
    previous walks followed, equals the scan's."""
    sizes = (6, 3)
    tokens = source + [9]
    index, scan = NgramIndex(tokens, sizes=sizes), Scan()
    at = 0
    for step in steps:
        tokens.extend(source[at:at + step])
        at += step
        assert index.propose([], k, floor=0.0) == scan.propose(tokens, [], k, sizes, 0.0)


def test_an_ngram_seen_once_then_with_one_continuation_then_with_another_rates_as_the_scan():
    """An n-gram's entry changes form as it recurs (``Entry``): its end
    alone while seen once, its one continuation inline while every
    occurrence had the same, a dict from the second distinct continuation
    on. At each form the rates equal the scan's, and the tables those of an
    index built afresh."""
    sizes = (3,)
    tokens: list[int] = []
    index = NgramIndex(tokens, sizes=sizes)
    scan = Scan()
    arrivals = [[1, 2, 3, 7]] + [[0, 1, 2, 3, 7]] * 3 + [[0, 1, 2, 3, 8]] + [[0, 1, 2, 3, 7]] * 2 + [[0, 1, 2, 3]]
    forms = []
    for chunk in arrivals:
        for token in chunk:
            tokens.append(token)
            for tail in ([], [1, 2, 3], [2, 3]):
                want = scan.propose(tokens, tail, 4, sizes, 0.0)
                assert index.propose(tail, 4, floor=0.0) == want
            fresh = NgramIndex(list(tokens), sizes=sizes)
            fresh.keep_up()
            assert index._maps == fresh._maps
        entry = index._maps[0].get((1, 2, 3))
        forms.append(entry if entry is None or isinstance(entry, int) else type(entry[2]).__name__)
    # Seen once (its end: 7 at 3), then 7 inline three times, then a dict from the 8 on.
    assert forms == [3, "int", "int", "int", "dict", "dict", "dict", "dict"]
    assert index._maps[0][(1, 2, 3)][1:] == [7, {7: 6, 8: 1}]
    # The context ends "1 2 3": 7 followed it 6 times of 7 (the latest occurrence was followed by 7).
    got = index.propose([], 1, floor=0.0)
    assert got.tokens == [7] and got.rates[0] == scan.propose(tokens, [], 1, sizes, 0.0).rates[0]


@given(st.lists(st.integers(0, 3), max_size=60), st.lists(st.integers(0, 3), max_size=2), st.integers(1, 8),
       st.integers(0, 14))
def test_a_resting_sequences_minimum_match_answers_as_the_whole_proposal_would(tokens, tail, k, min_match):
    """``propose_or_none(min_match=)`` stops at the first position where
    the match is too short: None exactly where the proposal is empty or its
    match shorter, the proposal itself otherwise."""
    index = NgramIndex(tokens, sizes=(6, 3))
    whole = index.propose(tail, k, floor=0.0)
    got = index.propose_or_none(tail, k, floor=0.0, min_match=min_match)
    assert got == (whole if whole.tokens and whole.matched >= min_match else None)


def test_a_cut_back_token_list_is_indexed_afresh():
    tokens = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    index = NgramIndex(tokens, sizes=(2,))
    assert index.propose([], 2, floor=0.0).tokens == [3, 5]
    del tokens[4:]
    tokens += [9, 9, 1, 2]
    assert index.propose([], 2, floor=0.0) == _scanned(tokens, [], 2, (2,), 0.0)
    fresh = NgramIndex(list(tokens), sizes=(2,))
    fresh.keep_up()
    assert index._maps == fresh._maps


@given(st.lists(st.tuples(st.integers(1, 40), st.floats(1.0, 500.0)), max_size=12), st.integers(1, 60))
def test_decode_cost_remembers_estimates_only_until_the_next_observation(observations, size):
    """``DecodeCost.ms`` keeps its answers between observations: after each
    observation every size is estimated as by a cost that never answered
    before."""
    cost = DecodeCost()
    seen: list[tuple[int, float]] = []
    for n, ms in observations:
        cost.ms(size)
        cost.ms(n)
        cost.observe(n, ms)
        seen.append((n, ms))
        fresh = DecodeCost()
        for m, v in seen:
            fresh.observe(m, v)
        assert cost.ms(size) == fresh.ms(size) and cost.ms(n) == fresh.ms(n)


@given(st.integers(1, 80), st.lists(st.floats(0.0, 1.0), min_size=1, max_size=16), st.integers(1, 16),
       st.booleans(), st.sampled_from(["cpu", "gpu", "prior", "noisy"]))
def test_a_draft_cut_to_the_steps_room_gets_the_length_the_whole_draft_gets(base, rates, limit, shared, machine):
    """The scheduler asks a sequence for at most ``Planner.room`` tokens:
    ``length`` never gives more, and gives the shorter draft what it gives
    the whole one (0 where the room is 0)."""
    cost = CpuCost() if machine == "cpu" else DecodeCost()
    if machine == "gpu":
        for n in (1, 2, 4, 8, 16, 32):
            cost.observe(n, 8.0 + n * 0.01)
    if machine == "noisy":  # a bigger batch measured cheaper than a smaller one
        for n, ms in ((1, 11), (4, 30), (5, 26), (16, 71), (200, 400)):
            cost.observe(n, ms)
    planner = Planner()
    available = min(limit, len(rates))
    whole = planner.length(cost, rates, available, base_tokens=base, base_yield=base, shared=shared)
    room = planner.room(cost, limit, base_tokens=base, shared=shared)
    assert whole <= room
    cut = planner.length(cost, rates[:room], min(room, available), base_tokens=base, base_yield=base, shared=shared)
    assert cut == whole
    if shared:
        assert (room == 0) == planner.no_room(cost, base)
