"""The cache-miss diagnosis on the scheduler thread: free for a request that
continues a remembered state whole, and naming what evicted the state a
request would have continued."""

from __future__ import annotations

from lmspd.cache.disk import DiskCheckpoints
from support.cache_rig import INSTRUCTIONS, hold, make_cache, request, turn

TURN = "<|im_start|>user\nName a planet.<|im_end|>\n<|im_start|>assistant\nMars.<|im_end|>"


def test_a_whole_continuation_scans_nothing(cache, monkeypatch):
    hold(cache, 0, turn(cache, TURN))
    # Many remembered states a scan would compare the prompt with.
    for seq in (1, 2, 3):
        hold(cache, seq, turn(cache, f"<|im_start|>user\nOther session {seq}<|im_end|>"))
    req = request(cache, TURN + "\n<|im_start|>user\nAnother.<|im_end|>\n")
    plan = cache.plan(req)
    assert plan.source == "visible-prefix"

    def scan(_req):
        raise AssertionError("a plain continuation must not scan the remembered states")

    monkeypatch.setattr(cache.planner, "_longest_remembered", scan)
    report = cache.diagnose(req, plan)
    assert report.miss_reason is None and report.longest_prefix == plan.keep


def test_a_partial_reuse_is_diagnosed(cache):
    hold(cache, 0, turn(cache, TURN))
    edited = request(cache, TURN.replace("planet", "star") + "\n<|im_start|>user\nAnother.<|im_end|>\n")
    plan = cache.plan(edited)
    report = cache.diagnose(edited, plan)
    assert report.miss_reason is not None and report.divergence_token == report.longest_prefix > 0


def evicted_state_report(vocab, room_for_a=False, **kw):
    """Session A's turn, then sessions B and C on the one sequence; A's next turn.
    ``room_for_a``: RAM holds A's state alone, not A's and B's."""
    cache = make_cache(vocab, n_seq=1, **kw)
    a = turn(cache, INSTRUCTIONS + "<|im_start|>user\nSession A asks.<|im_end|>\n<|im_start|>assistant\nOk.<|im_end|>")
    if room_for_a:
        cache.ram_budget_bytes = a.nbytes + 100
    hold(cache, 0, a)
    for tag in ("B", "C"):
        other = request(cache, f"<|im_start|>user\nSession {tag}, unrelated.<|im_end|>\n")
        plan = cache.apply(cache.plan(other), other)
        r = cache.residents[0]
        r.tokens.extend(plan.suffix)
        cache.finished(0, turn(cache, cache.ops.detokenize(r.tokens)))
        cache.release(0)
    cache.flush()
    again = request(cache, a.visible + "\n<|im_start|>user\nAnd then?<|im_end|>\n")
    plan = cache.plan(again)
    return plan, cache.diagnose(again, plan), a


def test_a_state_no_ram_could_hold_was_evicted_by_another_session(vocab):
    plan, report, a = evicted_state_report(vocab, ram_budget_bytes=0)
    assert plan.keep < 8, plan  # only the template's opening tokens, shared with C
    assert report.miss_reason == "state_evicted" and report.evicted_by == "another_session", report
    assert report.divergence_token > 64 and report.remembered == len(a.tokens)
    assert report.as_json()["evicted_by"] == "another_session" and report.anthropic_json() is None


def test_a_state_pushed_out_of_ram_was_evicted_by_the_ram_budget(vocab):
    # B's state pushes A's out of RAM when C takes the sequence.
    plan, report, _a = evicted_state_report(vocab, room_for_a=True)
    assert plan.keep < 8, plan  # only the template's opening tokens, shared with C
    assert report.miss_reason == "state_evicted" and report.evicted_by == "ram_budget", report


def test_a_checkpoint_pushed_off_the_disk_was_evicted_by_the_disk_budget(vocab, tmp_path):
    disk = DiskCheckpoints(tmp_path, 1500, "fp")  # room for one small checkpoint
    plan, report, _a = evicted_state_report(vocab, ram_budget_bytes=0, disk=disk)
    assert plan.keep < 8, plan  # only the template's opening tokens, shared with C
    assert report.miss_reason == "state_evicted" and report.evicted_by == "disk_budget", report
