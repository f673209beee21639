"""A burst that needs every sequence (issue 30, ``decode16``): a copy between
sequences holds its source and its target until the next decode performs it,
so when the requests of one admission pass would find too few sequences,
a prefix shared with an idle sequence is kept in place on it instead
(``Planner._shared_candidates``, told ``contending`` by the scheduler's
``_admit``). Without contention, and for a holder that stays put (an open
connection's, a running subagent's parent, one running or copying already),
the copy is planned as before."""

from __future__ import annotations

from lmspd.core.conversation import SessionPin
from support.cache_rig import INSTRUCTIONS, hold, make_cache, request, turn

N = 16


def _prompt(i: int) -> str:
    # Long enough that a copy of it is worth it (``MIN_COPY_TOKENS``), and
    # sharing nothing worth a copy with the others.
    return (f"<|im_start|>user\nQuestion {i}: " + f"tell me about the number {i} and its friends. " * 8
            + "<|im_end|>\n<|im_start|>assistant\n")


def _burst_cache(vocab, n_seq: int = N):
    """Every sequence holds last round's turn of one prompt; the request for
    prompt ``i`` shares all of it with sequence ``i``, which is not the
    least recently used."""
    cache = make_cache(vocab, n_seq=n_seq)
    for i in range(n_seq):
        hold(cache, i, turn(cache, _prompt(i) + f"The number {i} is fine.<|im_end|>"), last_used=100.0 - i)
    return cache


def _admit(cache, reqs, contending=None):
    """One admission pass as ``Scheduler._admit`` runs it: the plans, None
    for a request left waiting."""
    plans = []
    for i, req in enumerate(reqs):
        plan = cache.plan(req, contending=len(reqs) - i - 1 if contending is None else contending)
        if plan is not None:
            cache.apply(plan, req)
        plans.append(plan)
    return plans


def test_a_burst_needing_every_sequence_keeps_each_prefix_in_place_and_all_start(vocab):
    cache = _burst_cache(vocab)
    reqs = [request(cache, _prompt(i)) for i in range(N)]
    plans = _admit(cache, reqs)
    assert all(p is not None for p in plans), [p and (p.source, p.seq, p.copy_from) for p in plans]
    for i, (plan, req) in enumerate(zip(plans, reqs)):
        assert (plan.source, plan.seq, plan.copy_from) == ("memory-token", i, None), plan
        assert plan.keep == len(req.tokens) - 1 and plan.detail in ("partial scarce", "partial")
    assert not cache.residency.copying and cache.stats.copies == 0
    # Each holder's whole turn went to RAM before it was cut short.
    assert cache.stats.evictions == N and all(r.busy for r in cache.residents)


def test_the_same_burst_planned_one_at_a_time_copies_and_leaves_some_waiting(vocab):
    # What the pass did before it told the cache who waits: each request
    # copied its prefix into the least recently used sequence, two
    # sequences a copy, and the last ones found none until a step had run.
    cache = _burst_cache(vocab)
    plans = _admit(cache, [request(cache, _prompt(i)) for i in range(N)], contending=0)
    assert any(p is None for p in plans)
    placed = [p for p in plans if p is not None]
    assert placed and all(p.source == "copy" for p in placed)


def test_a_lone_request_still_copies_and_leaves_the_holder_as_it_is(vocab):
    cache = _burst_cache(vocab, n_seq=4)
    req = request(cache, _prompt(1))
    [plan] = _admit(cache, [req])
    assert (plan.source, plan.copy_from, plan.seq) == ("copy", 1, 3), plan
    assert plan.keep == len(req.tokens) - 1
    assert cache.residents[1].state is not None and not cache.residents[1].busy


def test_a_burst_with_sequences_to_spare_copies_as_before(vocab):
    # Three requests, sixteen sequences: a copy leaves enough for the rest.
    cache = _burst_cache(vocab)
    plans = _admit(cache, [request(cache, _prompt(i)) for i in (1, 2, 3)])
    assert [(p.source, p.copy_from) for p in plans] == [("copy", 1), ("copy", 2), ("copy", 3)], plans


def _shared_cache(vocab, n_seq: int):
    """Sequence 0 holds a session over the shared instructions; the others
    hold unrelated turns of other sessions."""
    cache = make_cache(vocab, n_seq=n_seq)
    hold(cache, 0, turn(cache, INSTRUCTIONS + "<|im_start|>user\nWrite docs<|im_end|>\n"
                                              "<|im_start|>assistant\nOk.<|im_end|>"), last_used=50.0)
    for i in range(1, n_seq):
        hold(cache, i, turn(cache, f"<|im_start|>user\nunrelated {i}<|im_end|>\n"), last_used=float(i))
    return cache


def _agents(cache, n):
    return [request(cache, INSTRUCTIONS + f"<|im_start|>user\nTask {i}<|im_end|>\n") for i in range(n)]


def test_many_requests_sharing_one_source_copy_it(vocab):
    cache = _shared_cache(vocab, n_seq=8)
    plans = _admit(cache, _agents(cache, 4))
    assert [(p.source, p.copy_from) for p in plans] == [("copy", 0)] * 4, plans
    assert not cache.residents[0].busy


def test_under_scarcity_only_the_first_keeps_a_shared_source_in_place_the_rest_copy_it(vocab):
    # Four sequences, four requests sharing the instructions of sequence 0:
    # a first copy would take sequence 0 too and leave one request waiting.
    # Kept in place there, sequence 0 is only read by the copies after it,
    # each of which costs just its own sequence.
    cache = _shared_cache(vocab, n_seq=4)
    reqs = _agents(cache, 4)
    plans = _admit(cache, reqs)
    assert all(p is not None for p in plans), plans
    assert (plans[0].source, plans[0].seq) == ("memory-token", 0)
    assert [(p.source, p.copy_from) for p in plans[1:]] == [("copy", 0)] * 3, plans
    assert len({p.seq for p in plans}) == 4
    shared = len(cache.ops.tokenize(INSTRUCTIONS))
    assert all(p.keep >= shared for p in plans)


def test_an_open_connections_sequence_is_never_cut_for_a_burst(vocab):
    cache = _burst_cache(vocab, n_seq=2)
    pin = SessionPin("conn")
    cache.residents[0].pin = pin
    plans = _admit(cache, [request(cache, _prompt(0)), request(cache, "<|im_start|>user\nhi<|im_end|>\n")])
    assert (plans[0].source, plans[0].copy_from, plans[0].seq) == ("copy", 0, 1), plans[0]
    assert cache.residents[0].state is not None and not cache.residents[0].busy


def test_a_running_subagents_parent_is_never_cut_for_a_burst(vocab):
    cache = _burst_cache(vocab, n_seq=3)
    cache.residents[0].agent = "parent-agent"
    child = cache.residents[2]
    child.busy, child.state, child.parent_agent = True, None, "parent-agent"
    plans = _admit(cache, [request(cache, _prompt(0)), request(cache, "<|im_start|>user\nhi<|im_end|>\n")])
    assert (plans[0].source, plans[0].copy_from, plans[0].seq) == ("copy", 0, 1), plans[0]
    assert cache.residents[0].state is not None
