"""The cache-miss diagnosis on the scheduler thread: free for a request that
continues a remembered state whole, and naming what evicted the state a
request would have continued."""

from __future__ import annotations

from support.cache_rig import hold, request, turn

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

    monkeypatch.setattr(cache, "_longest_remembered", scan)
    report = cache.diagnose(req, plan)
    assert report.miss_reason is None and report.longest_prefix == plan.keep


def test_a_partial_reuse_is_diagnosed(cache):
    hold(cache, 0, turn(cache, TURN))
    edited = request(cache, TURN.replace("planet", "star") + "\n<|im_start|>user\nAnother.<|im_end|>\n")
    plan = cache.plan(edited)
    report = cache.diagnose(edited, plan)
    assert report.miss_reason is not None and report.divergence_token == report.longest_prefix > 0
