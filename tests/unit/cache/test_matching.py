"""The matching rules over resident sequences, with the bundled model's real
tokenizer and a recording fake of the engine's KV operations."""

from __future__ import annotations

import pytest

from lmspd.cache.disk import DiskCheckpoints
from lmspd.cache.manager import CacheRefused, CacheRequest
from lmspd.cache.planner import MIN_COPY_TOKENS
from lmspd.cache.state import SessionState
from lmspd.core.conversation import Message, SessionPin, ToolCall, ToolOutput
from support.cache_rig import INSTRUCTIONS, hold, make_cache, request, turn


def test_bpe_boundary_token_prefix_breaks_text_prefix_holds(cache):
    # The model sampled " Hel" + "lo" where the tokenizer would write " Hello":
    # a replay re-tokenizes differently, but its text still extends the KV's.
    tok = cache.ops.tokenize
    prompt = "<|im_start|>user\nGreet me<|im_end|>\n<|im_start|>assistant\n"
    sampled = tok(prompt) + tok(" Hel") + tok("lo")
    kv_text = prompt + " Hello"
    hold(cache, 0, SessionState(tokens=sampled, kv_text=kv_text))
    req = request(cache, kv_text + " world<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n")
    assert req.tokens[: len(sampled)] != sampled, "the token prefix must break for this case"
    plan = cache.plan(req)
    assert plan.source == "memory-text" and plan.seq == 0
    assert plan.keep == len(sampled)
    assert plan.suffix == tok(" world<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n")


def test_rule_order_visible_before_tokens(cache):
    tok = cache.ops.tokenize
    visible = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>"
    hidden = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>x</think>yo<|im_end|>"
    hold(cache, 2, SessionState(tokens=tok(hidden), kv_text=hidden, visible=visible,
                                items=[Message("user", "hi"), Message("assistant", "yo")]))
    plan = cache.plan(request(cache, visible + "\n<|im_start|>user\nmore<|im_end|>\n",
                              [Message("user", "hi"), Message("assistant", "yo"), Message("user", "more")]))
    assert plan.source == "visible-prefix" and plan.seq == 2
    assert plan.keep == len(tok(hidden)), "hidden tokens stay in the KV"
    assert plan.suffix == tok("\n<|im_start|>user\nmore<|im_end|>\n")


def test_tool_output_ids_and_response_id(cache):
    visible = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<tool_call>x</tool_call><|im_end|>"
    call = ToolCall(call_id="call_1", name="f", payload="{}")
    hold(cache, 1, turn(cache, visible, items=[Message("user", "q"), call], call_ids=frozenset({"call_1"}),
                        response_id="resp_9"))
    text = visible + "\n<|im_start|>user\nresult<|im_end|>\n"
    items = [Message("user", "q"), call, ToolOutput(call_id="call_1", output="r")]
    assert cache.plan(request(cache, text, items)).source == "tool-output-ids"
    plan = cache.plan(request(cache, text, items, previous_response_id="resp_9"))
    assert plan.source == "response-id" and plan.seq == 1


def test_required_state_gone_is_refused(cache):
    with pytest.raises(CacheRefused, match="replay the full input"):
        cache.plan(request(cache, "x", requires_state="nope"))


def test_disabled_cache_is_always_cold(vocab):
    cache = make_cache(vocab, enabled=False)
    hold(cache, 0, SessionState(tokens=[1, 2, 3], kv_text="abc"))
    plan = cache.plan(CacheRequest(text="abcd", tokens=[1, 2, 3, 4], items=[]))
    assert plan.source == "cold" and plan.keep == 0


def test_each_session_continues_its_own_sequence(cache):
    """Four resident sessions: a turn of any of them continues its sequence in place."""
    texts = [f"<|im_start|>user\nSession {i}: a question<|im_end|>\n<|im_start|>assistant\nAn answer {i}.<|im_end|>"
             for i in range(4)]
    for seq, text in enumerate(texts):
        hold(cache, seq, turn(cache, text), last_used=seq + 1)
    for seq in (2, 0, 3, 1):
        plan = cache.plan(request(cache, texts[seq] + "\n<|im_start|>user\nMore<|im_end|>\n"))
        assert (plan.source, plan.seq, plan.keep) == ("visible-prefix", seq, len(cache.residents[seq].tokens))
    assert cache.kv.calls == [], "matching alone never touches the KV"


def test_a_new_session_takes_a_free_sequence_then_the_least_recently_used(cache):
    for seq in range(3):
        hold(cache, seq, turn(cache, f"<|im_start|>user\nold {seq}<|im_end|>"), last_used=10 - seq)
    plan = cache.plan(request(cache, "<|im_start|>user\nsomething new<|im_end|>\n"))
    assert plan.seq == 3 and plan.source in ("cold", "memory-token")
    hold(cache, 3, turn(cache, "<|im_start|>user\nold 3<|im_end|>"), last_used=20)
    req = request(cache, "<|im_start|>user\nsomething else<|im_end|>\n")
    plan = cache.plan(req)
    assert plan.seq == 2, "sequence 2 was used least recently"
    evicted = cache.residents[2].state
    cache.apply(plan, req)
    assert ("capture", 2) in cache.kv.calls, "the evicted state is captured to RAM first"
    assert cache.stats.ram_sessions == 1 and evicted.kv == b"kv-of-2"
    # Its next turn comes back from RAM, into whichever sequence is the target now.
    cache.release(2)
    back = request(cache, evicted.visible + "\n<|im_start|>user\nagain<|im_end|>\n")
    plan = cache.plan(back)
    assert plan.source == "ram" and plan.restore is evicted


def test_a_connection_continues_its_latest_response_in_place(cache):
    pin = SessionPin("ws_a")
    text = "<|im_start|>user\nWrite a haiku<|im_end|>\n<|im_start|>assistant\nLeaves fall.<|im_end|>"
    hold(cache, 1, turn(cache, text, response_id="resp_1"))
    cache.residents[1].pin = pin
    more = text + "\n<|im_start|>user\nAnother<|im_end|>\n"
    plan = cache.plan(request(cache, more, previous_response_id="resp_1", pin=pin))
    assert (plan.source, plan.seq, plan.keep) == ("connection", 1, len(cache.residents[1].tokens))
    assert plan.suffix == cache.ops.tokenize("\n<|im_start|>user\nAnother<|im_end|>\n")
    # Another connection (or plain HTTP) naming the same id continues it by id.
    assert cache.plan(request(cache, more, previous_response_id="resp_1", pin=SessionPin("ws_b"))).source == "response-id"
    assert cache.plan(request(cache, more, previous_response_id="resp_1")).source == "response-id"


def test_open_connections_keep_their_sequences_the_least_recently_used_goes_first(vocab):
    cache = make_cache(vocab, n_seq=3)
    a, b = SessionPin("ws_a"), SessionPin("ws_b")
    # Sequence 0: connection a (used first), 1: plain HTTP (used after a), 2: connection b.
    for seq, pin, used in ((0, a, 1.0), (1, None, 2.0), (2, b, 3.0)):
        hold(cache, seq, turn(cache, f"<|im_start|>user\nsession {seq}<|im_end|>"), last_used=used)
        cache.residents[seq].pin = pin
    new = lambda i: request(cache, f"<|im_start|>user\nunrelated {i}<|im_end|>\n")  # noqa: E731
    assert cache.plan(new(1)).seq == 1, "a sequence no open connection holds goes first, though used later"
    cache.residents[1].busy, cache.residents[1].state = True, None  # a request runs there now
    assert cache.plan(new(2)).seq == 0, "then the least recently used connection's"
    a.close()
    cache.residents[1].busy = False
    assert cache.plan(new(3)).seq == 0, "a closed connection's sequence is like any other (least recently used)"


def test_a_running_sequence_is_never_evicted(vocab):
    cache = make_cache(vocab, n_seq=2)
    for seq in range(2):
        cache.residents[seq].busy = True
        cache.residents[seq].owner = "local"
    assert cache.plan(request(cache, "<|im_start|>user\nhello<|im_end|>\n")) is None, "wait for a step"
    cache.release(1)
    assert cache.plan(request(cache, "<|im_start|>user\nhello<|im_end|>\n")).seq == 1


def test_shared_instructions_are_copied_not_prefilled(cache):
    first = INSTRUCTIONS + "<|im_start|>user\nFix the bug in a.py<|im_end|>\n<|im_start|>assistant\nDone.<|im_end|>"
    hold(cache, 0, turn(cache, first))
    req = request(cache, INSTRUCTIONS + "<|im_start|>user\nWrite tests for b.py<|im_end|>\n")
    plan = cache.plan(req)
    shared = len(cache.ops.tokenize(INSTRUCTIONS + "<|im_start|>user\n"))
    assert (plan.source, plan.seq, plan.copy_from) == ("copy", 1, 0)
    assert plan.keep >= len(cache.ops.tokenize(INSTRUCTIONS)) and plan.keep <= shared
    cache.apply(plan, req)
    assert ("copy", 0, 1, plan.keep) in cache.kv.calls
    assert cache.residents[0].state is not None, "the sequence it copied from keeps its session"
    assert cache.stats.copies == 1 and cache.stats.copied_tokens == plan.keep


def test_a_regenerated_short_prompt_is_copied_where_the_copy_moves_only_used_cells(vocab):
    """A short prompt sent again (a retry, a benchmark's repeat) while the
    sequence that ran it holds its turn: below MIN_COPY_TOKENS, a copy of
    the source's used cells still costs far less than evaluating the prompt
    again; not where the copy would move a whole stream, nor from a source
    much longer than what it shares."""
    prompt = "<|im_start|>user\nTell me a short story about a lighthouse keeper and a storm.<|im_end|>\n"
    reply = "<|im_start|>assistant\n" + "The keeper climbed the stairs as the storm rose. " * 3 + "<|im_end|>"
    for cheap, expected in ((True, "copy"), (False, "cold")):
        cache = make_cache(vocab, cheap_copy=cheap)
        hold(cache, 0, turn(cache, prompt + reply))
        req = request(cache, prompt + "<|im_start|>assistant\n")
        n = len(req.tokens)
        assert n < MIN_COPY_TOKENS
        plan = cache.plan(req)
        assert plan.source == expected and plan.seq != 0, plan
        if cheap:
            assert plan.copy_from == 0 and plan.keep == n - 1 and len(plan.suffix) == 1
            cache.apply(plan, req)
            assert ("copy", 0, plan.seq, plan.keep) in cache.kv.calls
            assert cache.residents[0].state is not None, "the turn it copied from stays"
    # A source holding far more than the prompt: the prompt is evaluated again.
    cache = make_cache(vocab, cheap_copy=True)
    hold(cache, 0, turn(cache, prompt + reply * 8))
    plan = cache.plan(request(cache, prompt + "<|im_start|>assistant\n"))
    assert plan.source != "copy", plan


def test_waits_for_a_shared_prefix_another_sequence_is_prefilling(cache):
    tok = cache.ops.tokenize
    prompt = tok(INSTRUCTIONS + "<|im_start|>user\nTask one<|im_end|>\n")
    r = cache.residents[0]
    r.busy, r.owner, r.prompt, r.tokens = True, "local", prompt, prompt[:10]
    req = request(cache, INSTRUCTIONS + "<|im_start|>user\nTask two<|im_end|>\n")
    assert cache.plan(req) is None, "the instructions will be in sequence 0 in a step or two"
    r.tokens = list(prompt)
    plan = cache.plan(req)
    assert plan.source == "copy" and plan.copy_from == 0


def test_another_owners_sequences_are_never_matched_or_copied(cache):
    text = INSTRUCTIONS + "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>"
    hold(cache, 0, turn(cache, text, owner="key_a"))
    plan = cache.plan(request(cache, text + "\n<|im_start|>user\nmore<|im_end|>\n", owner="key_b"))
    assert plan.source == "cold" and plan.seq != 0
    assert cache.state_for_calls({"x"}, "key_b") is None and cache.states("key_b") == []


def test_a_finishing_sequence_of_the_same_owner_is_waited_for(cache):
    text = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>"
    hold(cache, 0, turn(cache, text), busy=True)  # its last token is still being evaluated
    req = request(cache, text + "\n<|im_start|>user\nmore<|im_end|>\n")
    assert cache.plan(req) is None
    cache.release(0)
    assert cache.plan(req).source == "visible-prefix"


def test_another_session_of_the_same_owner_does_not_wait_for_a_finishing_sequence(cache):
    """One API key, several sessions: only a request that continues the
    finishing sequence's state waits for it; another session's next turn is
    placed at once, on its own sequence."""
    mine = INSTRUCTIONS + "<|im_start|>user\nTask A<|im_end|>\n<|im_start|>assistant\nDone A.<|im_end|>"
    other = INSTRUCTIONS + "<|im_start|>user\nTask B<|im_end|>\n<|im_start|>assistant\nDone B.<|im_end|>"
    hold(cache, 0, turn(cache, mine, response_id="resp_a"), busy=True)  # evaluating its last token
    hold(cache, 1, turn(cache, other, response_id="resp_b"))
    req = request(cache, other + "\n<|im_start|>user\nmore B<|im_end|>\n")
    plan = cache.plan(req)
    assert plan is not None and (plan.source, plan.seq) == ("visible-prefix", 1)
    # A new session of the same owner is placed at once too.
    fresh = cache.plan(request(cache, "<|im_start|>user\nsomething else<|im_end|>\n"))
    assert fresh is not None and fresh.seq in (2, 3)
    # What continues the finishing state still waits for its step, by any rule.
    assert cache.plan(request(cache, mine + "\n<|im_start|>user\nmore A<|im_end|>\n")) is None
    assert cache.plan(request(cache, "<|im_start|>user\nx<|im_end|>\n", previous_response_id="resp_a")) is None


def test_a_state_leaving_ram_is_written_to_disk(vocab, tmp_path):
    disk = DiskCheckpoints(tmp_path, 1 << 30, "fp")
    cache = make_cache(vocab, n_seq=1, ram_budget_bytes=0, disk=disk)
    hold(cache, 0, turn(cache, "<|im_start|>user\none<|im_end|>"))
    req = request(cache, "<|im_start|>user\ntwo<|im_end|>\n")
    cache.apply(cache.plan(req), req)
    cache.flush()
    assert cache.stats.ram_sessions == 0 and len(disk) == 1 and cache.stats.disk_writes == 1


def test_a_short_shared_prefix_is_prefilled_not_restored(vocab):
    """A saved state that shares only a template's opening with the request
    is not worth restoring (its whole KV moves to save a few tokens)."""
    cache = make_cache(vocab, n_seq=1)
    head = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    hold(cache, 0, turn(cache, head + "An old question<|im_end|>"))
    req = request(cache, head + "A new question<|im_end|>\n")
    cache.apply(cache.plan(req), req)  # the old state goes to RAM
    cache.release(0)
    cache.residents[0].tokens, cache.residents[0].state = [], None
    plan = cache.plan(request(cache, head + "A third question<|im_end|>\n"))
    assert plan.source == "cold"


def test_required_state_without_a_visible_transcript_is_matched_like_any_prompt(cache):
    """A tool-output-only request names a live state whose turn has no visible
    transcript (it could not be aligned with the template): its prompt,
    rendered whole on top of the state's items, is matched by tokens — it
    never fails placement (which, retried every step, used to hang it)."""
    head = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<tool_call>x</tool_call>"
    state = SessionState(tokens=cache.ops.tokenize(head), kv_text=head, visible=None,
                         call_ids=frozenset({"call_1"}))
    hold(cache, 0, state)
    plan = cache.plan(request(cache, head + "<|im_end|>\n<|im_start|>user\nresult<|im_end|>\n",
                              requires_state=state.key))
    assert plan.source == "memory-token" and plan.seq == 0 and plan.keep == len(state.tokens), plan


def _counting_reads(disk: DiskCheckpoints) -> list[str]:
    """The checkpoints whose payload ``disk`` reads (and hashes) from now on."""
    reads: list[str] = []
    read = disk._read
    disk._read = lambda path, header_only=False: (reads.append(path.stem) if not header_only else None,  # type: ignore[method-assign]
                                                  read(path, header_only))[1]
    return reads


def _instructions_checkpoint(cache, disk: DiskCheckpoints, n: int) -> SessionState:
    """A mid-prefill checkpoint (``checkpoint_prefix``) of the first ``n`` tokens of the instructions."""
    tokens = cache.ops.tokenize(INSTRUCTIONS)[:n]
    state = SessionState(tokens=tokens, kv_text=cache.ops.detokenize(tokens), kv=b"prefix kv")
    disk.save(state)
    return state


def test_a_prefetched_disk_checkpoint_is_planned_without_a_read_on_the_scheduler_thread(vocab, tmp_path):
    disk = DiskCheckpoints(tmp_path, 1 << 30, "fp")
    cache = make_cache(vocab, n_seq=1, disk=disk)
    saved = turn(cache, INSTRUCTIONS + "<|im_start|>user\none<|im_end|>\n")
    saved.kv = b"saved kv"
    disk.save(saved)
    reads = _counting_reads(disk)
    req = request(cache, saved.visible + "<|im_start|>user\ntwo<|im_end|>\n")
    cache.prefetch(req)  # the prepare thread
    assert reads == [saved.key]
    plan = cache.plan(req)  # the scheduler thread
    assert plan.source == "disk" and plan.restore.kv == b"saved kv" and reads == [saved.key]
    cache.apply(plan, req)
    assert ("restore", 0, b"saved kv") in cache.kv.calls


def test_a_checkpoint_shorter_than_what_a_resident_sequence_shares_is_never_read(vocab, tmp_path):
    """A second session with the same instructions copies them from the
    sequence of the first: the mid-prefill checkpoint of those instructions
    (on a Codex-sized prompt, ~140 MB read and hashed) is read neither ahead
    on the prepare thread nor by the plan on the scheduler thread."""
    disk = DiskCheckpoints(tmp_path, 1 << 30, "fp")
    cache = make_cache(vocab, n_seq=2, disk=disk)
    first = turn(cache, INSTRUCTIONS + "<|im_start|>user\none<|im_end|>\n<|im_start|>assistant\nOK.<|im_end|>")
    hold(cache, 0, first)
    n_instructions = len(cache.ops.tokenize(INSTRUCTIONS))
    _instructions_checkpoint(cache, disk, n_instructions - 8)
    reads = _counting_reads(disk)
    req = request(cache, INSTRUCTIONS + "<|im_start|>user\nanother task<|im_end|>\n<|im_start|>assistant\n")
    cache.prefetch(req)
    assert reads == [] and not disk._read_ahead
    plan = cache.plan(req)
    assert (plan.source, plan.seq, plan.copy_from) == ("copy", 1, 0) and plan.keep >= n_instructions, plan
    assert reads == []


def test_a_checkpoint_longer_than_what_a_resident_sequence_shares_is_read_ahead_and_restored(vocab, tmp_path):
    disk = DiskCheckpoints(tmp_path, 1 << 30, "fp")
    cache = make_cache(vocab, n_seq=2, disk=disk)
    n_instructions = len(cache.ops.tokenize(INSTRUCTIONS))
    # Resident: a session that shares only the first 70 tokens of the instructions.
    head = cache.ops.detokenize(cache.ops.tokenize(INSTRUCTIONS)[:70])
    hold(cache, 0, turn(cache, head + "something else entirely<|im_end|>\n"))
    saved = _instructions_checkpoint(cache, disk, n_instructions)
    reads = _counting_reads(disk)
    req = request(cache, INSTRUCTIONS + "<|im_start|>user\nanother task<|im_end|>\n<|im_start|>assistant\n")
    cache.prefetch(req)
    assert reads == [saved.key]
    plan = cache.plan(req)
    assert plan.source == "disk" and plan.keep == n_instructions and reads == [saved.key], plan


def test_nothing_is_prefetched_for_a_request_a_resident_state_continues(vocab, tmp_path):
    disk = DiskCheckpoints(tmp_path, 1 << 30, "fp")
    cache = make_cache(vocab, n_seq=1, disk=disk)
    live = turn(cache, INSTRUCTIONS + "<|im_start|>user\none<|im_end|>\n")
    saved = turn(cache, INSTRUCTIONS + "<|im_start|>user\none<|im_end|>\n")
    saved.kv = b"saved kv"
    disk.save(saved)
    hold(cache, 0, live)
    cache.prefetch(request(cache, live.visible + "<|im_start|>user\ntwo<|im_end|>\n"))
    assert not disk._read_ahead
    cache.prefetch(request(cache, INSTRUCTIONS + "<|im_start|>user\none<|im_end|>\n<|im_start|>user\nx<|im_end|>\n",
                           reuse=False))
    assert not disk._read_ahead


def test_a_held_warm_up_keeps_its_sequence_from_the_next_new_session(cache):
    """A warm-up that ran nothing (its prompt was held) refreshes the holder:
    a request continuing nothing, arriving before the warm-up's turn, takes
    another sequence (``hold``; the scheduler's ``_already_warm``)."""
    for seq in range(4):
        hold(cache, seq, turn(cache, f"<|im_start|>user\nold {seq}<|im_end|>"), last_used=10 + seq)
    fresh = "<|im_start|>user\nsomething new<|im_end|>\n"
    assert cache.plan(request(cache, fresh)).seq == 0, "without it: the least recently used"
    cache.hold(0)
    assert cache.plan(request(cache, fresh)).seq == 1


def test_a_prefix_held_both_in_a_sequence_and_in_ram_is_copied_not_restored(cache):
    """Copying KV between sequences of the context is cheaper than writing
    the same state back from RAM: on a tie in kept tokens, the copy wins."""
    first = INSTRUCTIONS + "<|im_start|>user\nFix the bug in a.py<|im_end|>\n<|im_start|>assistant\nDone.<|im_end|>"
    state = turn(cache, first)
    hold(cache, 0, state)
    cache.tiers.remember(turn(cache, first, kv=b"saved"))
    req = request(cache, INSTRUCTIONS + "<|im_start|>user\nWrite tests for b.py<|im_end|>\n")
    plan = cache.plan(req)
    assert (plan.source, plan.copy_from, plan.restore) == ("copy", 0, None), plan


def test_a_replay_that_needs_reasoning_state_takes_the_whole_state_from_ram_over_an_equal_copy(cache):
    """The tie-break above must not pick a copy that the reasoning rule then
    refuses: a plan that keeps the state's hidden tokens serves instead."""
    tool_turn = INSTRUCTIONS + "<|im_start|>user\nList the files<|im_end|>\n<|im_start|>assistant\nCalling ls.<|im_end|>"
    cache.tiers.remember(turn(cache, tool_turn, kv=b"saved"))
    hold(cache, 0, turn(cache, tool_turn + "Zzz other"))
    req = request(cache, tool_turn + "\n<|im_start|>user\nresult: a.py<|im_end|>\n", needs_reasoning_state=True)
    plan = cache.plan(req)
    assert (plan.source, plan.detail) == ("ram", "visible"), plan
