"""Capture ahead: while the scheduler is idle, the state of the sequence the
next new prompt would take is captured into RAM, so that placing that
prompt only clears the sequence (issue 30: the capture was 1.4-1.8 ms of
every such request's time to first token). Placement never captures it
again while the sequence holds exactly those tokens, and captures as
before when anything changed. The bundled model's real tokenizer and a
recording fake of the engine's KV."""

from __future__ import annotations

from lmspd.cache.disk import DiskCheckpoints
from lmspd.cache.state import SessionState
from lmspd.core.conversation import SessionPin
from support.cache_rig import INSTRUCTIONS, hold, make_cache, request, turn


def captures(cache) -> list[int]:
    return [c[1] for c in cache.kv.calls if c[0] == "capture"]


def four_sessions(cache) -> list[SessionState]:
    """Four finished turns, sequence 0 the least recently used."""
    states = [turn(cache, f"<|im_start|>user\nsession {seq}: a question<|im_end|>\n<|im_start|>assistant\n"
                          f"Answer {seq}.<|im_end|>") for seq in range(4)]
    for seq, state in enumerate(states):
        hold(cache, seq, state, last_used=seq + 1)
    return states


def versioned_captures(cache) -> None:
    """Every capture returns new bytes (``v1``, ``v2``, ...): which capture a restore used shows."""
    n = [0]
    real = cache.ops.capture

    def capture(seq: int) -> bytes:
        real(seq)
        n[0] += 1
        return b"v%d" % n[0]

    cache.ops.capture = capture


def test_the_least_recently_used_state_is_kept_ahead_and_placement_does_not_capture_it_again(cache):
    states = four_sessions(cache)
    assert cache.capture_ahead_due()
    cache.capture_ahead()
    assert captures(cache) == [0], "the sequence a new prompt takes next, and only it"
    assert cache.residents[0].saved and states[0].kv == b"kv-of-0"
    assert cache.stats.ram_sessions == 1 and cache.stats.captures_ahead == 1
    assert not cache.capture_ahead_due(), "nothing more to do until something changes"
    cache.capture_ahead()
    assert captures(cache) == [0]

    req = request(cache, "<|im_start|>user\nsomething new<|im_end|>\n")
    plan = cache.plan(req)
    assert plan.seq == 0
    cache.apply(plan, req)
    assert captures(cache) == [0], "placement only clears the sequence"
    assert cache.stats.evictions == 1 and cache.stats.ram_sessions == 1
    assert cache.tiers.ram[states[0].key] is states[0]

    # The session evicted that way comes back from RAM, whole, with the bytes captured ahead.
    back = request(cache, states[0].visible + "\n<|im_start|>user\nagain<|im_end|>\n")
    plan = cache.plan(back)
    assert plan.source == "ram" and plan.restore is states[0] and plan.keep == len(states[0].tokens)
    cache.apply(plan, back)
    assert ("restore", plan.seq, b"kv-of-0") in cache.kv.calls
    assert cache.residents[plan.seq].tokens == states[0].tokens
    assert cache.stats.ram_restores == 1


def test_a_state_too_big_to_capture_ahead_is_left_to_placement(cache, monkeypatch):
    """A request arriving during a capture ahead waits for it: a state whose
    bytes (at the last capture's bytes per token) exceed the cap is captured
    on placement only, as before."""
    from lmspd.cache import residency

    states = four_sessions(cache)
    cache.capture_ahead()  # teaches the bytes per token: b"kv-of-0" over sequence 0's tokens
    assert captures(cache) == [0]
    req = request(cache, "<|im_start|>user\nsomething new<|im_end|>\n")
    cache.apply(cache.plan(req), req)  # sequence 0 taken; sequence 1 is next
    per_token = len(b"kv-of-0") / len(states[0].tokens)
    monkeypatch.setattr(residency, "AHEAD_MAX_BYTES", int(per_token * len(states[1].tokens)) - 1)
    assert not cache.capture_ahead_due()
    cache.capture_ahead()
    assert captures(cache) == [0], "not captured ahead"
    monkeypatch.setattr(residency, "AHEAD_MAX_BYTES", int(per_token * len(states[1].tokens)) + 1)
    assert cache.capture_ahead_due()
    cache.capture_ahead()
    assert captures(cache) == [0, 1]


def test_nothing_is_captured_ahead_while_a_sequence_is_free(cache):
    for seq in range(3):
        hold(cache, seq, turn(cache, f"<|im_start|>user\nold {seq}<|im_end|>"), last_used=seq + 1)
    assert not cache.capture_ahead_due()
    cache.capture_ahead()
    assert captures(cache) == [] and cache.stats.ram_sessions == 0


def test_the_most_recently_used_or_a_connections_sequence_is_not_captured_ahead(vocab):
    """With one sequence the next turn most likely continues it in place; an
    open connection's session is evicted last and most likely continues too."""
    cache = make_cache(vocab, n_seq=1)
    hold(cache, 0, turn(cache, "<|im_start|>user\nonly<|im_end|>"))
    assert not cache.capture_ahead_due()

    cache = make_cache(vocab, n_seq=2)
    for seq in range(2):
        hold(cache, seq, turn(cache, f"<|im_start|>user\npinned {seq}<|im_end|>"), last_used=seq + 1)
        cache.residents[seq].pin = SessionPin(f"ws{seq}")
    assert not cache.capture_ahead_due()
    cache.residents[0].pin.open = False  # the connection closed: an ordinary session now
    assert cache.capture_ahead_due()
    cache.capture_ahead()
    assert captures(cache) == [0]


def test_a_sequence_that_changed_after_the_capture_ahead_is_captured_again_on_placement(cache):
    versioned_captures(cache)
    states = four_sessions(cache)
    cache.capture_ahead()
    assert states[0].kv == b"v1"
    # Its own next turn continues it in place: the copy kept ahead is
    # dropped (the sequence holds all of it), the sequence changes.
    nxt = request(cache, states[0].visible + "\n<|im_start|>user\nmore<|im_end|>\n")
    plan = cache.plan(nxt)
    assert (plan.source, plan.seq) == ("visible-prefix", 0)
    cache.apply(plan, nxt)
    assert cache.stats.ram_sessions == 0 and not cache.tiers.ram, "no copy of a state its sequence still holds"
    r = cache.residents[0]
    r.tokens.extend(plan.suffix)
    turn2 = SessionState(tokens=list(r.tokens), kv_text=nxt.text, visible=nxt.text)
    cache.finished(0, turn2)
    cache.release(0)
    r.last_used = 0.5  # the least recently used again, and no idle pass since
    req = request(cache, "<|im_start|>user\nsomething new<|im_end|>\n")
    plan = cache.plan(req)
    assert plan.seq == 0
    cache.apply(plan, req)
    assert captures(cache) == [0, 0], "captured again on placement"
    assert turn2.kv == b"v2" and cache.tiers.ram[turn2.key] is turn2
    back = request(cache, turn2.visible + "\n<|im_start|>user\nagain<|im_end|>\n")
    plan = cache.plan(back)
    assert plan.source == "ram" and plan.restore is turn2
    cache.apply(plan, back)
    assert ("restore", plan.seq, b"v2") in cache.kv.calls


def test_a_kept_state_whose_sequence_no_longer_holds_its_tokens_is_captured_again(cache):
    """Belt and braces: every change to a sequence clears ``saved``; even
    if one did not, placement compares the tokens before it skips the
    capture, and never keeps bytes of other tokens under a state's name."""
    versioned_captures(cache)
    states = four_sessions(cache)
    cache.capture_ahead()
    r = cache.residents[0]
    assert r.saved and states[0].kv == b"v1"
    r.tokens = r.tokens[:-1]  # as if the KV had been cut back behind the cache's back
    req = request(cache, "<|im_start|>user\nsomething new<|im_end|>\n")
    plan = cache.plan(req)
    cache.apply(plan, req)
    assert captures(cache) == [0, 0] and states[0].kv == b"v2"


def an_old_state_in_ram_beside_two_sessions(cache) -> tuple[SessionState, list[SessionState]]:
    """A state kept in RAM (100 bytes of KV), and two sequences holding a
    finished turn each, sequence 0 the least recently used."""
    old = turn(cache, "<|im_start|>user\nkept in RAM<|im_end|>")
    old.kv = b"x" * 100
    cache.tiers.remember(old)
    states = [turn(cache, f"<|im_start|>user\nsession {seq}<|im_end|>") for seq in range(2)]
    for seq, state in enumerate(states):
        hold(cache, seq, state, last_used=seq + 1)
    return old, states


def test_capture_ahead_without_a_disk_takes_only_the_room_the_ram_budget_has_left(vocab):
    """What it would push out of RAM would be lost, for a sequence that may
    never be taken: placement captures it then, as before."""
    cache = make_cache(vocab, n_seq=2)
    old, states = an_old_state_in_ram_beside_two_sessions(cache)
    cache.ram_budget_bytes = old.nbytes + states[0].nbytes + len(b"kv-of-0") - 1
    assert cache.capture_ahead_due()
    cache.capture_ahead()
    assert captures(cache) == [0] and states[0].kv is None and not cache.residents[0].saved
    assert list(cache.tiers.ram.values()) == [old], "nothing pushed out"
    assert not cache.capture_ahead_due(), "looked at once, not again every idle pass"
    cache.ram_budget_bytes += 1
    req = request(cache, "<|im_start|>user\nsomething new<|im_end|>\n")
    cache.apply(cache.plan(req), req)
    assert captures(cache) == [0, 0] and states[0].kv == b"kv-of-0"


def test_capture_ahead_with_a_disk_pushes_out_to_disk_as_placement_does(vocab, tmp_path):
    disk = DiskCheckpoints(tmp_path, 1 << 30, "fp")
    cache = make_cache(vocab, n_seq=2, disk=disk)
    old, states = an_old_state_in_ram_beside_two_sessions(cache)
    cache.ram_budget_bytes = states[0].nbytes + len(b"kv-of-0")
    cache.capture_ahead()
    cache.flush()
    assert list(cache.tiers.ram.values()) == [states[0]] and len(disk) == 1
    req = request(cache, "<|im_start|>user\nsomething new<|im_end|>\n")
    cache.apply(cache.plan(req), req)
    assert captures(cache) == [0]


def test_a_state_kept_ahead_becomes_the_response_checkpoint_of_a_non_trimmable_kv(vocab):
    """A model whose KV cannot be trimmed (sliding window): the turn that
    extends a state in place keeps it as the ``response`` checkpoint; kept
    ahead, it is that checkpoint without a second capture."""
    turn1 = INSTRUCTIONS + "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>"
    text = turn1 + "\n<|im_start|>user\n" + "a long document " * 20 + "<|im_end|>\n<|im_start|>assistant\n"
    cache = make_cache(vocab, n_seq=2, floors={0: 10**6, 1: 10**6})
    t1 = turn(cache, turn1)
    hold(cache, 0, t1, last_used=1)
    hold(cache, 1, turn(cache, "<|im_start|>user\nother<|im_end|>"), last_used=2)
    cache.capture_ahead()
    assert captures(cache) == [0] and t1.boundary is None
    req = request(cache, text)
    plan = cache.plan(req)
    assert (plan.source, plan.seq) == ("visible-prefix", 0)
    cache.apply(plan, req)
    assert captures(cache) == [0] and cache.stats.checkpoints == 1
    assert t1.boundary == "response" and cache.tiers.ram[t1.key] is t1
    r = cache.residents[0]
    r.tokens.extend(plan.suffix)
    cache.finished(0, SessionState(tokens=list(r.tokens), kv_text=text))
    cache.release(0)
    edited = turn1 + "\n<|im_start|>user\n" + "an edited document " * 20 + "<|im_end|>\n<|im_start|>assistant\n"
    branch = cache.plan(request(cache, edited))
    assert branch.source == "checkpoint" and branch.detail.startswith("at=response from=ram"), branch
    assert branch.keep == len(t1.tokens) and branch.restore is t1


def test_the_shutdown_writes_a_state_kept_ahead_once(vocab, tmp_path):
    disk = DiskCheckpoints(tmp_path, 1 << 30, "fp")
    cache = make_cache(vocab, n_seq=2, disk=disk)
    saves: list[str] = []
    real = disk.save
    disk.save = lambda state: saves.append(state.key) or real(state)  # type: ignore[method-assign]
    states = [turn(cache, f"<|im_start|>user\nsession {seq}<|im_end|>") for seq in range(2)]
    for seq, state in enumerate(states):
        hold(cache, seq, state, last_used=seq + 1)
    cache.capture_ahead()
    cache.save_all()
    assert sorted(saves) == sorted(s.key for s in states)
    assert captures(cache) == [0, 1], "the other sequence's state is captured at shutdown as before"

