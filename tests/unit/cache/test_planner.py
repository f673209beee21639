"""The planner on its own: plain data in (sequences, RAM states, a disk
index, a toy tokenizer), a plan out. No model, no KV, no files: what the
cache's rules decide, apart from carrying them out."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmspd.cache.diagnostics import EvictionLog
from lmspd.cache.planner import MIN_COPY_TOKENS, CacheRefused, CacheRequest, Planner
from lmspd.cache.state import Resident, SessionState
from lmspd.core.conversation import Message, SessionPin, ToolCall, ToolOutput

# One token a character, but "lo" is one token when the tokenizer writes it
# (a sampled "l" + "o" is not): a token prefix can break where text holds.
MERGED = {"lo": 1000}
SPELLED = {v: k for k, v in MERGED.items()}


def tokenize(text: str) -> list[int]:
    out, i = [], 0
    while i < len(text):
        if text[i:i + 2] in MERGED:
            out.append(MERGED[text[i:i + 2]])
            i += 2
        else:
            out.append(ord(text[i]))
            i += 1
    return out


def detokenize(tokens: list[int]) -> str:
    return "".join(SPELLED.get(t) or chr(t) for t in tokens)


@dataclass
class Kv:
    tokenize: Callable[[str], list[int]] = tokenize
    detokenize: Callable[[list[int]], str] = detokenize
    n_ctx: int = 4096
    floors: dict[int, int] = field(default_factory=dict)
    # Sequences a copy from moves only used cells (``KvOps.cheap_copy``).
    cheap: frozenset[int] = frozenset()

    def floor(self, seq: int, n: int) -> int:
        return min(n, self.floors.get(seq, 0))

    def cheap_copy(self, seq: int) -> bool:
        return seq in self.cheap


@dataclass
class Checkpoint:
    state: SessionState

    @property
    def n_tokens(self) -> int:
        return len(self.state.tokens)


@dataclass
class Disk:
    """The disk tier as the planner reads it: an index of checkpoints, each
    read (``loaded``) only when a plan needs its KV."""

    checkpoints: list[Checkpoint] = field(default_factory=list)
    loaded: list[Checkpoint] = field(default_factory=list)

    def best_match(self, text, owner, response_id=None):
        fits = [cp for cp in self.checkpoints if cp.state.owner == owner and text.startswith(cp.state.kv_text)]
        return (max(fits, key=lambda cp: cp.n_tokens), "token-text") if fits else None

    def longest_common(self, tokens, owner):
        return None

    def load(self, cp):
        self.loaded.append(cp)
        return cp.state


SYSTEM = "<s>system: " + "Be careful and brief. " * 6 + "</s>"  # > MIN_COPY_TOKENS characters


def state(text: str, *, hidden: str = "", **kw) -> SessionState:
    """A finished turn whose visible transcript is ``text``; its KV holds
    ``hidden`` reasoning too, at the start of the answer (``<a>``)."""
    kv_text = text.replace("<a>", "<a>" + hidden, 1)
    return SessionState(tokens=tokenize(kv_text), kv_text=kv_text, visible=text, **kw)


def seq(n: int, held: SessionState | None = None, **kw) -> Resident:
    """Sequence ``n``, holding the finished turn ``held`` (or nothing)."""
    return Resident(n, tokens=list(held.tokens) if held else [], state=held, owner=held.owner if held else None,
                    **kw)


def ask(text: str, items=(), **kw) -> CacheRequest:
    return CacheRequest(text=text, tokens=tokenize(text), items=list(items), **kw)


def planner(residents, ram=(), disk=None, **kw) -> Planner:
    kv = kw.pop("kv", Kv())
    return Planner(kv, residents, {s.key: s for s in ram}, disk=disk, **kw)


def test_a_visible_prefix_keeps_the_hidden_reasoning_in_the_kv():
    turn = state(SYSTEM + "<u>hi</u><a>yo</a>", hidden="<think>x</think>")
    p = planner([seq(0, turn), seq(1)])
    nxt = turn.visible + "<u>more</u>"
    plan = p.plan(ask(nxt), target=None)
    assert (plan.source, plan.seq, plan.keep) == ("visible-prefix", 0, len(turn.tokens))
    assert plan.suffix == tokenize("<u>more</u>") and plan.base_text == turn.kv_text + "<u>more</u>"


def test_a_sampled_spelling_is_continued_by_text_when_tokens_part():
    # The model sampled "l" + "o" where the tokenizer writes "lo".
    kv_text = "<u>greet</u><a>Hello"
    sampled = SessionState(tokens=[ord(c) for c in kv_text], kv_text=kv_text)
    p = planner([seq(0, sampled)])
    req = ask(kv_text + " world</a><u>again</u>")
    assert req.tokens[:len(sampled.tokens)] != sampled.tokens
    plan = p.plan(req, target=None)
    assert (plan.source, plan.keep) == ("memory-text", len(sampled.tokens))
    assert plan.suffix == tokenize(" world</a><u>again</u>")


def test_all_of_a_states_tokens_is_a_memory_token_continuation():
    held = SessionState(tokens=tokenize(SYSTEM), kv_text=SYSTEM)
    plan = planner([seq(0, held)]).plan(ask(SYSTEM + "<u>q</u>"), target=None)
    assert (plan.source, plan.keep, plan.suffix) == ("memory-token", len(held.tokens), tokenize("<u>q</u>"))


def test_a_previous_response_id_in_ram_is_restored_into_the_target():
    saved = state(SYSTEM + "<u>q</u><a>a</a>", response_id="resp_1", kv=b"kv")
    other = seq(0, state("<u>unrelated</u>"))
    target = seq(1)
    plan = planner([other, target], ram=[saved]).plan(
        ask(saved.visible + "<u>next</u>", previous_response_id="resp_1"), target=target)
    assert (plan.source, plan.seq, plan.restore) == ("response-id", 1, saved)


def test_an_open_connection_continues_its_own_sequence():
    pin = SessionPin("ws-1")
    turn = state(SYSTEM + "<u>q</u><a>a</a>", response_id="resp_1")
    # Another sequence holds the same response: the connection's wins.
    p = planner([seq(0, copy.copy(turn)), seq(1, turn, pin=pin)])
    plan = p.plan(ask(turn.visible + "<u>n</u>", previous_response_id="resp_1", pin=pin), target=None)
    assert (plan.source, plan.seq) == ("connection", 1)


def test_a_tool_output_appends_to_the_state_that_made_the_call():
    call = ToolCall(call_id="c1", name="f", payload="{}")
    turn = state(SYSTEM + "<u>q</u><a><call/></a>", items=[Message("user", "q"), call], call_ids=frozenset({"c1"}))
    plan = planner([seq(0, turn)]).plan(
        ask(turn.visible + "<tool>r</tool>", [Message("user", "q"), call, ToolOutput(call_id="c1", output="r")]),
        target=None)
    assert (plan.source, plan.detail, plan.keep) == ("tool-output-ids", "ids=1", len(turn.tokens))


def test_a_required_state_that_is_gone_is_refused_and_one_in_ram_is_restored():
    turn = state(SYSTEM + "<u>q</u><a><call/></a>", kv=b"kv")
    target = seq(0)
    with pytest.raises(CacheRefused):
        planner([target]).plan(ask(turn.visible + "<tool>r</tool>", requires_state=turn.key), target=target)
    plan = planner([target], ram=[turn]).plan(ask(turn.visible + "<tool>r</tool>", requires_state=turn.key),
                                              target=target)
    assert (plan.source, plan.restore, plan.seq) == ("tool-output-ids", turn, 0)


def test_the_next_turn_of_a_sequence_still_running_waits_for_it():
    turn = state(SYSTEM + "<u>q</u><a>a</a>")
    p = planner([seq(0, turn, busy=True), seq(1)])
    assert p.plan(ask(turn.visible + "<u>n</u>"), target=None) is None
    # Another owner's request is no continuation of it: it goes on.
    assert p.plan(ask(turn.visible + "<u>n</u>", owner="bob"), target=p.residents[1]).source == "cold"


def test_nothing_to_continue_and_no_sequence_free_is_not_now():
    p = planner([seq(0, state("<u>a</u>"), busy=True)])
    assert p.plan(ask("<u>b</u>"), target=None) is None
    target = seq(1)
    p = planner([seq(0, state("<u>a</u>"), busy=True), target])
    plan = p.plan(ask("<u>b</u>"), target=target)
    assert (plan.source, plan.seq, plan.keep, plan.suffix) == ("cold", 1, 0, tokenize("<u>b</u>"))


def test_a_shared_prefix_is_copied_and_a_subagent_prefers_its_parents():
    first = seq(0, state(SYSTEM + "<u>docs</u><a>ok</a>"), agent="other")
    parent = seq(1, state(SYSTEM + "<u>parse</u><a>ok</a>"), agent="parent")
    target = seq(2)
    req = ask(SYSTEM + "<u>find callers</u>", agent="child", parent_agent="parent")
    plan = planner([first, parent, target]).plan(req, target=target)
    assert (plan.source, plan.copy_from, plan.seq) == ("copy", 1, 2)
    assert plan.keep >= MIN_COPY_TOKENS
    assert plan.detail.split() == ["from=seq1", "parent", "lineage=parent>child"]


def test_a_prefix_the_target_holds_is_kept_in_place_rather_than_copied_from_an_equal_one():
    # Two sessions send the same prompt again (a regenerate): the first runs
    # on its own sequence, the second's target holds the same prompt.
    prompt = SYSTEM + "<u>rewrite it</u><a>"
    running = Resident(0, tokens=tokenize(prompt), owner="local", busy=True, prompt=tokenize(prompt))
    target = seq(1, state(prompt + "two</a>"))
    plan = planner([running, target]).plan(ask(prompt), target=target)
    assert (plan.source, plan.seq, plan.copy_from) == ("memory-token", 1, None), plan
    assert plan.keep == len(tokenize(prompt)) - 1 and plan.detail == "partial"
    # Holding less than the running one, the target takes the longer copy.
    shorter = seq(1, state(SYSTEM + "<u>other</u>"))
    plan = planner([running, shorter]).plan(ask(prompt), target=shorter)
    assert (plan.source, plan.seq, plan.copy_from) == ("copy", 1, 0), plan


def test_a_shared_prefix_another_sequence_is_prefilling_is_waited_for_then_copied():
    prompt = tokenize(SYSTEM + "<u>x</u>")
    running = Resident(0, tokens=prompt[:5], owner="local", busy=True, prompt=prompt)
    target = seq(1)
    req = ask(SYSTEM + "<u>y</u>")
    assert planner([running, target]).plan(req, target=target) is None
    running.tokens = list(prompt)
    plan = planner([running, target]).plan(req, target=target)
    assert (plan.source, plan.copy_from, plan.keep) == ("copy", 0, len(tokenize(SYSTEM + "<u>")))


def sampled_turns() -> tuple[SessionState, str]:
    """Two turns, the first answer sampled in a spelling the tokenizer does
    not write ("l" + "o"), and the prompt of the second turn: a branch of
    it shares few tokens with the KV, and all of the first turn's text."""
    first = SYSTEM + "<u>hi</u><a>"
    kv1 = tokenize(first) + [ord(c) for c in "lo lo"] + tokenize("</a>")
    second = first + "lo lo</a><u>next</u><a>"
    kv2 = kv1 + tokenize("<u>next</u><a>")
    turn2 = SessionState(tokens=kv2 + tokenize("ok</a>"), kv_text=detokenize(kv2) + "ok</a>",
                         visible=second + "ok</a>", aligned=((len(kv1), len(first + "lo lo</a>")),
                                                             (len(kv2), len(second))), aligned_text=second)
    return turn2, first + "lo lo</a>"


def test_a_branch_keeps_a_sampled_turn_through_its_alignment_point_but_not_below_a_floor():
    turn2, before = sampled_turns()
    kept = turn2.aligned[0][0]
    branch = ask(before + "<u>other</u><a>")
    assert branch.tokens[:kept] != turn2.tokens[:kept], "the token prefix breaks inside the sampled turn"
    target = seq(1)
    plan = planner([seq(0, turn2), target]).plan(branch, target=target)
    assert (plan.source, plan.copy_from, plan.keep, plan.detail) == ("copy", 0, kept, "from=seq0 aligned")
    assert plan.suffix == tokenize("<u>other</u><a>") and plan.base_text == detokenize(turn2.tokens[:kept]) + (
        "<u>other</u><a>")
    p = planner([seq(0, turn2), target], kv=Kv(floors={0: kept + 1}), trimmable=False)
    assert p.plan(branch, target=target).source == "cold"


def test_a_shared_prefix_shorter_than_a_copy_is_worth_is_prefilled():
    short = "<s>hi</s>"
    target = seq(1)
    plan = planner([seq(0, state(short + "<u>a</u>")), target]).plan(ask(short + "<u>b</u>"), target=target)
    assert plan.source == "cold"


def test_a_whole_prompt_held_keeps_all_but_its_last_token_for_fresh_logits():
    held = SessionState(tokens=tokenize(SYSTEM), kv_text=SYSTEM, visible=SYSTEM)
    plan = planner([seq(0, held)]).plan(ask(SYSTEM), target=None)
    assert plan.keep == len(held.tokens) - 1 and plan.suffix == held.tokens[-1:]


def test_a_continuation_the_hidden_tokens_push_past_the_window_rereads_the_prompt():
    turn = state(SYSTEM + "<u>q</u><a>a</a>", hidden="<think>" + "x" * 200 + "</think>")
    target = seq(1)
    p = planner([seq(0, turn), target], kv=Kv(n_ctx=len(turn.tokens) + 10))
    req = ask(turn.visible + "<u>n</u>", max_new_tokens=8)
    plan = p.plan(req, target=target)
    assert plan.source == "copy" and plan.keep + len(plan.suffix) == len(req.tokens), plan


def test_a_request_without_an_output_limit_continues_a_turn_longer_than_its_replay():
    """No max_output_tokens (Codex, the agent SDKs): ``max_new_tokens`` is
    the room the window leaves the replay, which the hidden tokens of the
    turn's KV take part of. The plan leaves room for one token; the
    generation ends where the window does. A limit of the request's own
    still has to fit."""
    turn = state(SYSTEM + "<u>q</u><a>a</a>", hidden="<think>" + "x" * 20 + "</think>")
    target = seq(1)
    p = planner([seq(0, turn), target], kv=Kv(n_ctx=4096))
    text = turn.visible + "<u>n</u>"
    room = 4096 - len(tokenize(text))
    plan = p.plan(ask(text, max_new_tokens=room, clamp_output=True), target=target)
    assert (plan.source, plan.seq, plan.keep) == ("visible-prefix", 0, len(turn.tokens)), plan
    assert p.plan(ask(text, max_new_tokens=room), target=target).source == "copy"


def test_a_tool_output_only_request_its_state_cannot_hold_is_matched_like_any_other():
    """The call's state is live but its KV and the output exceed the window:
    the prompt, rendered whole on top of the state's items, still reuses
    what it shares with it rather than prefilling it all."""
    turn = state(SYSTEM + "<u>q</u><a><call/></a>", hidden="<think>" + "x" * 200 + "</think>")
    target = seq(1)
    p = planner([seq(0, turn), target], kv=Kv(n_ctx=len(turn.tokens) + 20))
    req = ask(turn.visible + "<tool>r</tool>", requires_state=turn.key, max_new_tokens=8)
    plan = p.plan(req, target=target)
    assert (plan.source, plan.copy_from) == ("copy", 0), plan
    assert plan.keep + len(plan.suffix) == len(req.tokens)
    # Bound only by the window, the call turn is continued.
    req = ask(turn.visible + "<tool>r</tool>", requires_state=turn.key, max_new_tokens=8, clamp_output=True)
    assert p.plan(req, target=target).source == "tool-output-ids"


def test_below_its_floor_a_state_is_not_cut_and_a_checkpoint_serves():
    conv = state(SYSTEM + "<u>a long document</u><a>ok</a>", kv=b"conv")
    conv.floor = len(conv.tokens) - 4
    mark = SessionState(tokens=tokenize(SYSTEM), kv_text=SYSTEM, kv=b"mark", floor=len(tokenize(SYSTEM)),
                        boundary="breakpoint")
    target = seq(0)
    edited = ask(SYSTEM + "<u>an edited document</u>")
    assert planner([target], ram=[conv], trimmable=False).plan(edited, target=target).source == "cold"
    plan = planner([target], ram=[conv, mark], trimmable=False).plan(edited, target=target)
    assert (plan.source, plan.restore, plan.keep) == ("checkpoint", mark, len(mark.tokens))
    assert plan.detail == "at=breakpoint from=ram text"


def test_a_disk_checkpoint_is_read_only_when_it_beats_what_memory_holds():
    cp = Checkpoint(SessionState(tokens=tokenize(SYSTEM), kv_text=SYSTEM, kv=b"disk"))
    target = seq(1)
    disk = Disk([cp])
    plan = planner([seq(0), target], disk=disk).plan(ask(SYSTEM + "<u>q</u>"), target=target)
    assert (plan.source, plan.detail, plan.restore, plan.keep) == ("disk", "key=token-text", cp.state, cp.n_tokens)
    # The same prefix resident in another sequence: copied, the disk never read.
    disk = Disk([cp])
    holder = seq(0, state(SYSTEM + "<u>other</u>"))
    plan = planner([holder, target], disk=disk).plan(ask(SYSTEM + "<u>q</u>"), target=target)
    assert plan.source == "copy" and disk.loaded == []


def test_a_replay_missing_its_reasoning_says_so_when_only_a_copy_serves_it():
    target = seq(1)
    p = planner([seq(0, state(SYSTEM + "<u>a</u>")), target])
    plan = p.plan(ask(SYSTEM + "<u>b</u>", needs_reasoning_state=True), target=target)
    assert plan.source == "cold" and plan.reasoning_stripped


def test_reuse_off_is_cold_and_diagnosed_so():
    turn = state(SYSTEM + "<u>q</u><a>a</a>")
    target = seq(1)
    p = planner([seq(0, turn), target])
    req = ask(turn.visible + "<u>n</u>", reuse=False)
    plan = p.plan(req, target=target)
    assert plan.source == "cold"
    assert p.diagnose(req, plan, EvictionLog()).miss_reason == "reuse_off"


def test_an_edited_message_is_diagnosed_at_the_item_it_parts_from():
    items = [Message("user", "first"), Message("assistant", "a")]
    turn = state(SYSTEM + "<u>first</u><a>a</a>", items=items)
    target = seq(1)
    p = planner([seq(0, turn), target])
    req = ask(SYSTEM + "<u>fixed</u>", [Message("user", "fixed")])
    plan = p.plan(req, target=target)
    report = p.diagnose(req, plan, EvictionLog())
    assert report.miss_reason == "messages_changed" and report.divergence_item == 0
    assert report.divergence_token == len(tokenize(SYSTEM + "<u>fi"))  # "first" / "fixed"


def test_an_evicted_state_is_named_with_what_pushed_it_out():
    gone = state(SYSTEM + "<u>q</u><a>a</a>")
    evictions = EvictionLog()
    evictions.record(gone.tokens, "local", "another_session")
    target = seq(0)
    p = planner([target])
    req = ask(gone.visible + "<u>n</u>")
    report = p.diagnose(req, p.plan(req, target=target), evictions)
    assert (report.miss_reason, report.evicted_by) == ("state_evicted", "another_session")


def test_one_owners_evictions_do_not_push_anothers_out_of_the_log():
    """The log is shared (64 entries); full, it drops the oldest of the owner
    holding the most, so a busy key's churn leaves another's entry to be
    named."""
    evictions = EvictionLog(size=8)
    evictions.record([1, 2, 3, 4], "key_alice", "another_session")
    for i in range(50):
        evictions.record([9, 9, i], "key_bob", "ram_budget")
    assert evictions.longest([1, 2, 3, 4, 5], "key_alice") == (4, 4, "another_session")
    assert evictions.longest([1, 2, 3, 4, 5], "key_bob") is None  # each reads its own only
    # Bob keeps his newest seven (43-49), the oldest of his gone first.
    assert evictions.longest([9, 9, 49], "key_bob") == (3, 3, "ram_budget")
    assert evictions.longest([9, 9, 43], "key_bob") == (3, 3, "ram_budget")
    assert evictions.longest([9, 9, 42], "key_bob") == (2, 3, "ram_budget")  # 42 is gone: a shared prefix only


def test_breakpoints_ahead_skip_those_reached_or_already_remembered():
    req = ask(SYSTEM + "<u>q</u>", breakpoints=(10, 20, 30))
    done = seq(0)
    done.tokens = req.tokens[:15]
    remembered = SessionState(tokens=req.tokens[:30], kv_text="", owner="local")
    assert planner([done], ram=[remembered], trimmable=False).breakpoints_ahead(req, 0) == [20]
    assert planner([done], trimmable=True).breakpoints_ahead(req, 0) == []


def test_a_likely_checkpoint_is_guessed_only_when_memory_holds_less():
    cp = Checkpoint(SessionState(tokens=tokenize(SYSTEM), kv_text=SYSTEM))
    p = planner([], disk=Disk([cp]))
    req = ask(SYSTEM + "<u>q</u>")
    assert p.likely_checkpoint(req, []) is cp
    assert p.likely_checkpoint(req, [state(SYSTEM + "<u>other</u>")]) is None
    assert p.likely_checkpoint(req, [SessionState(tokens=tokenize(SYSTEM), kv_text=SYSTEM)]) is None


TEXTS = st.lists(st.sampled_from([SYSTEM, "<u>a</u>", "<u>b</u>", "<a>lo</a>", "<a>ok</a>", "<tool>r</tool>"]),
                 min_size=1, max_size=5).map("".join)


@given(held=st.lists(TEXTS, min_size=1, max_size=3), saved=st.lists(TEXTS, max_size=2), text=TEXTS,
       busy=st.booleans(), trimmable=st.booleans())
def test_planning_changes_none_of_what_it_reads(held, saved, text, busy, trimmable):
    """Plans and diagnoses are pure: the sequences and saved states read are
    as they were; a plan runs on a sequence there is and evaluates at least
    one token (fresh logits)."""
    residents = [seq(i, state(t, response_id=f"r{i}")) for i, t in enumerate(held)]
    residents[0].busy = busy
    residents.append(seq(len(residents)))
    ram = [state(t, kv=b"kv") for t in saved]
    p = planner(residents, ram=ram, kv=Kv(floors={0: 20}), trimmable=trimmable)
    before = copy.deepcopy((residents, p.ram))
    req = ask(text, previous_response_id="r1")
    plan = p.plan(req, target=residents[-1])
    if plan is not None:
        p.diagnose(req, plan, EvictionLog())
        assert 0 <= plan.seq < len(residents) and plan.suffix
    assert copy.deepcopy((residents, p.ram)) == before


def test_under_scarcity_an_aligned_branch_is_kept_in_place_on_its_holder_but_not_below_a_floor():
    # A request waits behind this one and a copy would take both sequences
    # until the next step (tests/unit/cache/test_scarcity.py).
    turn2, before = sampled_turns()
    kept = turn2.aligned[0][0]
    branch = ask(before + "<u>other</u><a>")
    target = seq(1)
    plan = planner([seq(0, turn2), target]).plan(branch, target=target, contending=1)
    assert (plan.source, plan.seq, plan.copy_from, plan.keep) == ("memory-token", 0, None, kept), plan
    assert plan.detail == "partial aligned scarce"
    assert plan.suffix == tokenize("<u>other</u><a>")
    # Without contention: copied, as before.
    plan = planner([seq(0, turn2), target]).plan(branch, target=target, contending=0)
    assert (plan.source, plan.copy_from, plan.seq) == ("copy", 0, 1)
    p = planner([seq(0, turn2), target], kv=Kv(floors={0: kept + 1}), trimmable=False)
    assert p.plan(branch, target=target, contending=1).source == "cold"
