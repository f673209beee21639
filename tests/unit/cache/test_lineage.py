"""Subagents (a Claude Code Task agent, a Codex spawned thread): a child's
first turn starts from its parent's KV by lineage, its parent stays resident
while it runs, and the lineage is named in the plan's detail (the log line)
and the sequences' view."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lmspd.core.limits import MAX_SESSION_KEY_CHARS
from lmspd.dialects.session import agent_lineage
from support.cache_rig import INSTRUCTIONS, hold, make_cache, request, turn

PARENT, CHILD, OTHER = "0b1e2f3a-parent-session", "a4c0ffee-subagent", "99aa00bb-other-session"


def _parent_turn(cache):
    return turn(cache, INSTRUCTIONS + "<|im_start|>user\nRefactor the parser<|im_end|>\n"
                                      "<|im_start|>assistant\nI will ask a subagent.<|im_end|>")


def _hold_agent(cache, seq, state, agent, parent=None, **kw):
    hold(cache, seq, state, **kw)
    cache.residents[seq].agent, cache.residents[seq].parent_agent = agent, parent


def test_a_childs_first_turn_copies_its_parents_prefix_by_lineage(vocab):
    cache = make_cache(vocab, n_seq=3)
    # Another session holds the same instructions, in the lower sequence: an
    # equal copy from it is what matching picked by luck.
    _hold_agent(cache, 0, turn(cache, INSTRUCTIONS + "<|im_start|>user\nWrite docs<|im_end|>\n"
                                                     "<|im_start|>assistant\nOk.<|im_end|>"), OTHER, last_used=3.0)
    _hold_agent(cache, 1, _parent_turn(cache), PARENT, last_used=2.0)
    req = request(cache, INSTRUCTIONS + "<|im_start|>user\nFind every caller of parse()<|im_end|>\n",
                  agent=CHILD, parent_agent=PARENT)
    plan = cache.plan(req)
    assert (plan.source, plan.copy_from, plan.seq) == ("copy", 1, 2), plan
    assert plan.keep >= len(cache.ops.tokenize(INSTRUCTIONS))
    assert plan.detail.split() == ["from=seq1", "parent", f"lineage={PARENT[:8]}>{CHILD[:8]}"]


def test_a_running_child_never_lets_its_parent_be_evicted_and_the_parent_continues(vocab):
    cache = make_cache(vocab, n_seq=3)
    parent = _parent_turn(cache)
    _hold_agent(cache, 0, parent, PARENT, last_used=1.0)  # the least recently used
    child = request(cache, INSTRUCTIONS + "<|im_start|>user\nFind every caller<|im_end|>\n",
                    agent=CHILD, parent_agent=PARENT)
    _hold_agent(cache, 2, turn(cache, "<|im_start|>user\nunrelated<|im_end|>\n"), OTHER, last_used=5.0)
    plan = cache.plan(child)
    assert plan.seq != 0, "the child's own turn took its parent's sequence"
    cache.apply(plan, child)
    cache.decoded()  # the step that evaluates the copy
    assert cache.residents[plan.seq].busy and cache.residents[plan.seq].parent_agent == PARENT
    # While the child runs, a new session goes anywhere but to the parent.
    # (Text that shares no token with any sequence: placed, not matched.)
    other = request(cache, "Something else entirely", agent="new-one")
    placed = cache.plan(other)
    assert placed.seq not in (0, plan.seq), placed
    cache.apply(placed, other)
    assert cache.residents[0].state is parent
    # The parent's next turn is still a continuation of its own sequence.
    nxt = request(cache, parent.visible + "\n<|im_start|>user\nThe subagent says: 3 callers<|im_end|>\n",
                  agent=PARENT)
    again = cache.plan(nxt)
    assert (again.source, again.seq, again.keep) == ("visible-prefix", 0, len(parent.tokens)), again
    view = cache.sequences()
    assert view[plan.seq]["agent"] == CHILD[:8] and view[plan.seq]["parent_agent"] == PARENT[:8]


def test_without_lineage_the_least_recently_used_parent_is_what_a_new_session_evicts(vocab):
    """The same placement as above with no lineage: sequence 0 is taken
    (what the rule above prevents)."""
    cache = make_cache(vocab, n_seq=3)
    _hold_agent(cache, 0, _parent_turn(cache), None, last_used=1.0)
    cache.residents[1].busy, cache.residents[1].owner = True, "local"
    _hold_agent(cache, 2, turn(cache, "<|im_start|>user\nunrelated<|im_end|>\n"), None, last_used=5.0)
    placed = cache.plan(request(cache, "Something else entirely"))
    assert (placed.source, placed.seq) == ("cold", 0), placed


def test_agent_lineage_from_what_claude_code_and_codex_send():
    session = {"x-claude-code-session-id": PARENT}
    assert agent_lineage(session) == (PARENT, None)
    assert agent_lineage({**session, "x-claude-code-agent-id": CHILD}) == (CHILD, PARENT)
    assert agent_lineage({**session, "x-claude-code-agent-id": "grandchild",
                          "x-claude-code-parent-agent-id": CHILD}) == ("grandchild", CHILD)
    codex_root = {"session-id": "root-thread", "thread-id": "root-thread"}
    assert agent_lineage(codex_root) == ("root-thread", None)
    assert agent_lineage({**codex_root, "thread-id": "child-thread", "x-codex-parent-thread-id": "root-thread",
                          "x-openai-subagent": "collab_spawn"}) == ("child-thread", "root-thread")
    assert agent_lineage({}) == (None, None)


@given(st.dictionaries(st.sampled_from(["x-claude-code-session-id", "x-claude-code-agent-id",
                                        "x-claude-code-parent-agent-id", "thread-id", "x-codex-parent-thread-id"]),
                       st.text(max_size=MAX_SESSION_KEY_CHARS + 8)))
def test_agent_lineage_is_bounded_and_never_raises(headers):
    for value in agent_lineage(headers):
        assert value is None or 0 < len(value) <= MAX_SESSION_KEY_CHARS and value == value.strip()
