"""The RAM tier's index (lmspd.cache.index): a plan examines only the RAM
states that can matter to it, however many the tier holds, and plans
exactly as a scan of every state would."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lmspd.cache.planner as planner_module
from lmspd.cache.index import RamStates
from lmspd.cache.planner import MIN_COPY_TOKENS, CachePlan, CacheRequest, Planner, cold
from lmspd.cache.state import Resident, SessionState, common_prefix
from support.cache_rig import INSTRUCTIONS, request, turn

# -- the rig's cache, the real tokenizer, many states --------------------------------------


@dataclass
class Calls:
    """How often the planner compared the request with a RAM state."""

    match_saved: int = 0
    aligned: int = 0
    common_prefix: int = 0

    @property
    def total(self) -> int:
        return self.match_saved + self.aligned + self.common_prefix


@pytest.fixture
def calls(monkeypatch) -> Calls:
    counted = Calls()

    def counting(name: str, real: Callable) -> Callable:
        def spy(*args, **kw):
            setattr(counted, name, getattr(counted, name) + 1)
            return real(*args, **kw)
        return spy

    monkeypatch.setattr(Planner, "_match_saved", counting("match_saved", Planner._match_saved))
    monkeypatch.setattr(Planner, "_aligned_plan", counting("aligned", Planner._aligned_plan))
    monkeypatch.setattr(planner_module, "common_prefix", counting("common_prefix", common_prefix))
    return counted


def keep_in_ram(cache, texts: list[str], **kw) -> list[SessionState]:
    states = [turn(cache, text, owner="o", kv=b"saved", **kw) for text in texts]
    for s in states:
        cache.tiers.remember(s)
    return states


BODY = "Some long tool output line.\n" * 8


def session(i: int | str) -> str:
    return INSTRUCTIONS + f"<|im_start|>user\nsession {i}: {BODY}<|im_end|>\n<|im_start|>assistant\n"


def test_a_plan_against_1000_unrelated_ram_states_compares_it_with_none_of_them(cache, calls):
    keep_in_ram(cache, [f"Note {i}: the {i}th unrelated thing to remember, {i} times over." for i in range(1000)])
    req = request(cache, session("new"), owner="o")
    calls.common_prefix = 0

    plan = cache.plan(req)

    assert plan is not None and plan.source == "cold"
    assert calls.total == 0, calls
    cache.diagnose(req, plan)
    assert calls.total <= 2, calls


def test_a_plan_against_1000_states_sharing_long_instructions_examines_one_of_them(cache, calls):
    states = keep_in_ram(cache, [session(i) + f"Answer {i}.<|im_end|>" for i in range(1000)])
    req = request(cache, session("new"), owner="o")
    shared = common_prefix(states[0].tokens, req.tokens)
    assert shared >= MIN_COPY_TOKENS and all(common_prefix(s.tokens, req.tokens) == shared for s in states)
    calls.common_prefix = 0

    plan = cache.plan(req)

    # Every state shares the instructions alike: the least recently kept is restored, as a scan picks.
    assert plan is not None and (plan.source, plan.keep, plan.restore) == ("ram", shared, states[0])
    assert calls.total <= 3, calls
    before = calls.total
    report = cache.diagnose(req, plan)
    assert report.longest_prefix == shared and report.remembered == len(states[0].tokens)
    assert calls.total - before <= 2, calls


def test_states_aligned_where_the_shared_instructions_end_are_passed_over_together(cache, calls):
    """Sessions that copied the same instructions hold the same tokens up to
    the alignment point there: the request's tokens start them all, so no
    branch keeps more through it, and none is examined for it. The one
    session whose KV holds other tokens for the same text (a sampled turn)
    is, and it wins with its branch."""
    head = INSTRUCTIONS + "<|im_start|>user\nsession"
    n_head = len(cache.ops.tokenize(head))
    texts = [session(i) + f"Answer {i}.<|im_end|>" for i in range(1000)]
    states = [turn(cache, text, owner="o", kv=b"saved", aligned=((n_head, len(head)),), aligned_text=text)
              for text in texts]
    # Its own spelling of the instructions' last words: same text, other tokens.
    sampled = INSTRUCTIONS[:-40]
    tokens = cache.ops.tokenize(sampled) + [cache.ops.tokenize(c)[0] for c in INSTRUCTIONS[-40:]]
    tokens += cache.ops.tokenize("<|im_start|>user\nsession")
    branch = SessionState(tokens=tokens + cache.ops.tokenize(" x"), kv_text=head + " x", visible=head + " x",
                          kv=b"saved", owner="o", aligned=((len(tokens), len(head)),), aligned_text=head + " x")
    assert cache.ops.detokenize(branch.tokens) == branch.kv_text
    for s in [*states[:500], branch, *states[500:]]:
        cache.tiers.remember(s)
    req = request(cache, session("new"), owner="o")
    assert common_prefix(branch.tokens, req.tokens) < common_prefix(states[0].tokens, req.tokens) < len(tokens)
    calls.common_prefix = 0

    plan = cache.plan(req)

    assert plan is not None and (plan.source, plan.keep, plan.restore) == ("ram", len(tokens), branch)
    assert plan.detail == "partial aligned"
    # Two states examined (the branch, and the first partial restore): each
    # matched, its token prefix and its points' text compared once.
    assert calls.match_saved == 2 and calls.total <= 8, calls


def test_the_index_follows_the_ram_tier(cache):
    """Kept, kept again, spilled over the budget, forgotten: the index
    holds what RAM holds, and nothing once RAM is empty."""
    cache.ram_budget_bytes = 40_000
    states = keep_in_ram(cache, [session(i) + f"Answer {i}." for i in range(12)])
    cache.tiers.remember(states[-3])
    ram = cache.tiers.ram
    index = ram.index
    assert list(index.in_order(dict(ram))) == list(ram.values())
    assert set(index.order) == set(ram) and len(ram) < len(states)
    req = request(cache, session(states.index(next(iter(ram.values())))) + "Answer", owner="o")
    plan = cache.plan(req)
    assert plan is not None and plan.restore is next(iter(ram.values())) and plan.source == "ram"
    for s in list(ram.values()):
        cache.tiers.forget(s)
    assert not index.owners and not index.order


# -- the indexed plan against a scan of every state (plain data, a toy tokenizer) -----------------

# One token a character, but "lo" is one token when the tokenizer writes it:
# a sampled "l" + "o" is not, so texts can agree where tokens part.
LO = 1000


def tokenize(text: str) -> list[int]:
    out, i = [], 0
    while i < len(text):
        if text.startswith("lo", i):
            out.append(LO)
            i += 2
        else:
            out.append(ord(text[i]))
            i += 1
    return out


def detokenize(tokens: list[int]) -> str:
    return "".join("lo" if t == LO else chr(t) for t in tokens)


@dataclass
class Kv:
    n_ctx: int = 4096
    tokenize: Callable[[str], list[int]] = tokenize
    detokenize: Callable[[list[int]], str] = detokenize

    def floor(self, seq: int, n: int) -> int:
        return 0

    def cheap_copy(self, seq: int) -> bool:
        return False


def sampled(text: str, start: int, split: list[bool]) -> list[int]:
    """Tokens of ``text`` as a model may have sampled them: from the
    ``start``-th token on, some "lo" as two."""
    out: list[int] = []
    for i, t in enumerate(tokenize(text)):
        if t == LO and i >= start and split and split[i % len(split)]:
            out += [ord("l"), ord("o")]
        else:
            out.append(t)
    return out


def scan_plan(p: Planner, req: CacheRequest, target: Resident) -> CachePlan:
    """What ``Planner._plan`` decides with only RAM states and an empty
    target: every state of the owner tried, as the planner did before its index."""
    states = [s for s in p.ram.values() if s.owner == req.owner]
    if req.previous_response_id:
        for s in reversed(states):
            if s.response_id == req.previous_response_id and s.visible and req.text.startswith(s.visible):
                return p._fits(req, p._continue(req, s, "response-id", target.seq, restore=True))
    candidates = []
    for s in states:
        plan = p._match_saved(req, s, "ram", target.seq)
        if plan is None:
            common = min(common_prefix(s.tokens, req.tokens), len(req.tokens) - 1)
            if common >= MIN_COPY_TOKENS and common >= s.floor:
                plan = CachePlan("ram", common, req.tokens[common:], req.text, restore=s, detail="partial",
                                 seq=target.seq)
            plan = p._aligned_plan(req, s, "ram", target.seq, floor=s.floor, beyond=plan.keep if plan else 0,
                                   restore=s) or plan
        if plan is not None:
            candidates.append(plan)
    for plan in sorted(candidates, key=lambda c: (c.keep, c.restore is None or c.restore.boundary is None,
                                                  c.restore is None, "parent" in c.detail.split(),
                                                  c.copy_from is None), reverse=True):
        fitted = p._fits(req, plan)
        if fitted.source != "cold" and not p._drops_reasoning(req, fitted):
            return fitted
    return cold(req, target.seq)


def scan_longest(p: Planner, req: CacheRequest) -> tuple[SessionState | None, int, int]:
    """``Planner._longest_remembered`` over RAM states only, every one scanned."""
    best, best_floor, longest, rank = None, 0, 0, ()
    for s in p.ram.values():
        if s.owner != req.owner:
            continue
        common = common_prefix(s.tokens, req.tokens)
        key = (common, s.signature == req.signature, bool(s.items))
        if common and key > rank:
            best, best_floor, longest, rank = s, s.floor, common, key
    return best, best_floor, longest


WORDS = ["lo", "a", "b", "l", "o", "ab", "lob", "bol"]
text_of = st.lists(st.sampled_from(WORDS), min_size=0, max_size=12).map("".join)


@st.composite
def worlds(draw):
    """RAM states branching from a shared instructions text and from one
    another (some sampled, some with hidden text, alignment points, floors,
    checkpoints, owners, response ids), and a request of the same kind."""
    instructions = "sys:" + "".join(draw(st.lists(st.sampled_from(WORDS), min_size=55, max_size=70)))
    texts = [instructions]
    states = []

    def branch() -> str:
        """A text that shares most of an earlier one (now and then little)."""
        parent = draw(st.sampled_from(texts))
        far = draw(st.sampled_from([False, False, False, False, True]))
        cut = draw(st.integers(0, len(parent) if far else 12))
        return parent[:max(0, len(parent) - cut)] + draw(text_of)

    for _ in range(draw(st.integers(1, 14))):
        text = branch()
        if len(text) < 2:
            continue
        texts.append(text)
        tokens = sampled(text, draw(st.integers(0, len(text))), draw(st.lists(st.booleans(), max_size=3)))
        hidden = draw(st.sampled_from(["", "", "<think>lo</think>"]))
        kv_text = detokenize(tokens)
        visible = draw(st.sampled_from([kv_text, kv_text, None, kv_text[:len(kv_text) // 2] + hidden]))
        # Points where the KV's first tokens hold exactly the first characters
        # of the prompt of its turn (which may go on otherwise than the KV).
        prompt = text[:len(text) - draw(st.integers(0, min(len(text), 10)))] + draw(text_of)
        cuts = sorted(set(draw(st.lists(st.integers(1, len(tokens)), max_size=4))))
        aligned = tuple((t, len(detokenize(tokens[:t]))) for t in cuts if prompt.startswith(detokenize(tokens[:t])))
        states.append(SessionState(
            tokens=tokens, kv_text=kv_text, visible=visible, kv=b"kv", aligned=aligned, aligned_text=prompt,
            owner=draw(st.sampled_from(["o", "o", "o", "p"])),
            floor=draw(st.sampled_from([0, 0, 0, len(tokens) // 2, len(tokens)])),
            boundary=draw(st.sampled_from([None, None, "input"])),
            response_id=draw(st.sampled_from([None, None, "r1", "r2"])),
            items=draw(st.sampled_from([[], ["item"]])),  # type: ignore[list-item]
            signature=draw(st.sampled_from([None, "same", "other"]))))
    text = branch()
    req = CacheRequest(text=text or "x", tokens=tokenize(text or "x"), items=[],
                       previous_response_id=draw(st.sampled_from([None, "r1", "r2"])),
                       needs_reasoning_state=draw(st.sampled_from([False, False, False, True])), max_new_tokens=draw(st.integers(0, 40)),
                       clamp_output=draw(st.booleans()), owner="o", signature=draw(st.sampled_from(["same", "other"])))  # type: ignore[arg-type]
    return states, req


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds(), churn=st.lists(st.tuples(st.booleans(), st.integers(0, 20)), max_size=8),
       n_ctx=st.sampled_from([4096, 4096, 4096, 140]))
def test_the_indexed_plan_is_the_plan_of_a_scan_of_every_state(world, churn, n_ctx):

    states, req = world
    # The tier's own container, kept in step through keeps, re-keeps (to
    # the end of the order) and drops.
    ram = RamStates()
    for s in states:
        ram.keep(s)
    for drop, i in churn if states else ():
        s = states[i % len(states)]
        if drop and s.key in ram and ram[s.key] is s:
            ram.drop(s.key)
        else:
            ram.keep(s)
    target = Resident(0)
    for mapping in (ram, dict(ram)):  # the maintained index, and one built from a plain mapping
        p = Planner(Kv(n_ctx=n_ctx), [target], mapping)
        got, want = p._plan(req, target), scan_plan(p, req, target)
        assert got is not None and want is not None
        assert (got.source, got.keep, got.suffix, got.base_text, got.restore, got.detail, got.seq) == (
            want.source, want.keep, want.suffix, want.base_text, want.restore, want.detail, want.seq)
        # The same state object, not an equal one (equal states tie-break by order).
        assert got.restore is want.restore
        assert p._longest_remembered(req)[1:] == scan_longest(p, req)[1:]
        assert p._longest_remembered(req)[0] is scan_longest(p, req)[0]


def test_equal_whole_states_tie_break_by_the_order_ram_kept_them():
    """Two spellings of one turn (the same text, as many tokens, sampled
    apart): the least recently kept is restored, as the scan's stable sort
    chose; kept again, it goes last."""
    text = "sys:" + "lo" * 40 + "ab"
    tokens = tokenize(text)
    first, second = (SessionState(tokens=tokens[:i] + [ord("l"), ord("o")] + tokens[i + 1:], kv_text=text,
                                  visible=text, kv=b"kv", owner="o") for i in (2, 3))
    assert len(first.tokens) == len(second.tokens) and first.key != second.key

    ram = RamStates()
    ram.keep(first)
    ram.keep(second)
    req = CacheRequest(text=text + "b", tokens=tokenize(text + "b"), items=[], owner="o")
    target = Resident(0)

    def restored() -> SessionState | None:
        plan = Planner(Kv(), [target], ram)._plan(req, target)
        assert plan is not None and (plan.source, plan.detail) == ("ram", "visible")
        return plan.restore

    assert restored() is first
    ram.keep(first)
    assert restored() is second


def test_partial_restores_of_an_equal_prefix_tie_break_by_the_order_ram_kept_them():
    """Two sessions sharing the request's first tokens, then parting from it
    (partial restores of an equal length): the least recently kept is
    restored, as the scan chose; kept again (``RamStates.keep`` of the same
    state: placement keeps a state captured ahead so), it goes last."""
    shared = "sys:" + "x" * (MIN_COPY_TOKENS + 16)
    first, second = (SessionState(tokens=tokenize(shared + tail), kv_text=shared + tail, visible=shared + tail,
                                  kv=b"kv", owner="o") for tail in ("first turn", "other turn"))

    ram = RamStates()
    ram.keep(first)
    ram.keep(second)
    text = shared + "new turn"
    req = CacheRequest(text=text, tokens=tokenize(text), items=[], owner="o")
    target = Resident(0)

    def restored() -> SessionState | None:
        p = Planner(Kv(), [target], ram)
        plan, scanned = p._plan(req, target), scan_plan(p, req, target)
        assert plan is not None and (plan.source, plan.detail, plan.keep) == ("ram", "partial", len(tokenize(shared)))
        assert plan.restore is scanned.restore
        return plan.restore

    assert restored() is first
    ram.keep(first)
    assert restored() is second
    assert ram.nbytes == first.nbytes + second.nbytes
