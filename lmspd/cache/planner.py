"""The continuation cache's planner: where a request resumes from.

Given a request (its text, tokens, items and marks) and what the cache holds
— the resident sequences, the states saved in RAM and on disk — it decides
which sequence the request runs on and what of which state it keeps: the
plan. It changes nothing: the residency carries a plan out
(lmspd.cache.residency), the tiers keep what it restores from
(lmspd.cache.tiers). It works on plain data (``Resident``, ``SessionState``,
token lists) through the few read-only operations it is handed (text to
tokens and back, how far a sequence can be trimmed, the disk tier's index
and reads), so it can be tested with plain data.

A request is matched in this order, the first rule that applies winning:

0. the request came on an open connection (a WebSocket) and continues that
   connection's latest response, still resident in the connection's
   sequence: append only the new input there (``connection``);
1. ``previous_response_id`` names a resident state, a RAM session or a disk
   checkpoint: continue from it (``response-id``);
2. the first new item is a tool output for call ids a resident state
   produced: append only the rendered tool-result suffix (``tool-output-ids``);
3. the rendered visible transcript extends a resident state's visible
   transcript: append only the new suffix, hidden tokens stay in the KV
   (``visible-prefix``);
4. the prompt tokens start with all of a resident state's tokens
   (``memory-token``);
5. the rendered text starts with a resident state's text, the suffix
   tokenized on its own so BPE boundaries can't break the match
   (``memory-text``);
then whichever reuses the most of: the sessions kept in RAM (``ram``), the
longest disk checkpoint (``disk``), the longest common token prefix with a
resident sequence — kept in place, or copied into a free sequence when the
one holding it should stay (``copy``, e.g. agents sharing instructions);
and finally a cold prefill (``cold``). A partial reuse of a finished turn
(a branch: an edited message, a re-run tool) may also keep up to the last
of its *alignment points* (``SessionState.aligned``, ``aligned`` in the
log) before the request's text parts from that turn's prompt: where each
turn's prompt began and ended, in tokens and characters, which after
sampled turns reach further than any common token prefix. Rules 2-5 run
against every idle resident sequence of the request's owner; the longest
continuation wins.

On a model whose KV cannot be trimmed exactly (sliding-window layers that
keep only their last window, recurrent layers), every rule that would cut a
state short (a partial token prefix, a partial RAM or disk state, a copy)
is allowed only down to that state's ``floor``; below it the request falls
back to the nearest **exact-state checkpoint** at or before the divergence
(``checkpoint``), kept by the residency (lmspd.cache.residency).

The RAM states are many (a short state of a small model is ~1 MB of a
1 GiB budget) and the plan runs before every admission: they are found
through their index (lmspd.cache.index), which hands the planner only the
states whose candidate can be the plan (``_ram_examined``), and the
diagnosis only the states that share the longest prefix (``_longest_saved``).

A request that continues no resident state goes to the sequence the
residency offers (``target``: its eviction order). A running sequence is
never planned over: with no sequence to offer, the plan is "not now"
(None). So is a request whose shared prefix another sequence is prefilling
right now (it copies it once it is there, instead of prefilling it twice).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, TypeVar

from lmspd.core.conversation import Item, SessionPin, ToolOutput

from .diagnostics import CacheReport, EvictionLog, Signature, classify
from .index import RamIndex
from .state import Resident, SessionState, common_prefix

log = logging.getLogger("lmspd.cache")

# A shared prefix another sequence is prefilling is worth waiting for when
# it saves at least this many tokens of prefill.
WAIT_FOR_SHARED_PREFIX = 32
# Copying between sequences moves a whole KV stream, and restoring a saved
# state moves all of it: for a partial prefix, only worth it when the prefix
# is at least this long (a chat template's default system prompt is not).
MIN_COPY_TOKENS = 64
# A copy that moves only the source's used cells (``KvOps.cheap_copy``) pays
# for a shorter prefix: evaluating a token costs far more than moving its
# cells (SmolLM2 on 2 cores: ~1 ms against ~20 µs). Worth it from this many
# shared tokens, and while the source holds at most CELL_COPY_RATIO times
# what is shared (the copy moves all of it). A regenerated short prompt
# (a retry, a benchmark's repeat) re-evaluated 40 tokens, ~0.3 s on 2 busy
# cores, where the copy takes a millisecond.
MIN_CELL_COPY_TOKENS = 8
CELL_COPY_RATIO = 8


@dataclass
class CachePlan:
    source: str
    keep: int
    suffix: list[int]
    # Text of the kept tokens + suffix, i.e. the prompt the model will have seen.
    base_text: str
    restore: SessionState | None = None
    detail: str = ""
    # The sequence the request runs on, and the one it copies ``keep`` tokens from.
    seq: int = -1
    copy_from: int | None = None
    # ``suffix`` and ``base_text``, worked out only for a candidate that is
    # tried (``resolved``): an aligned branch tokenizes the rest of the
    # prompt and detokenizes the kept KV, and every remembered state of the
    # owner may offer one.
    lazy: Callable[[], tuple[list[int], str]] | None = None
    # The request needed hidden reasoning no remembered state could give
    # (``needs_reasoning_state``): the turn renders without it, as OpenAI
    # accepts such a replay, and the diagnosis says ``reasoning_stripped``.
    reasoning_stripped: bool = False

    def resolved(self) -> CachePlan:
        if self.lazy is not None:
            self.suffix, self.base_text = self.lazy()
            self.lazy = None
        return self


@dataclass
class CacheRequest:
    """What matching needs to know about a prepared request."""

    text: str
    tokens: list[int]
    items: list[Item]
    previous_response_id: str | None = None
    reuse: bool = True
    # Set when the request only makes sense on top of a remembered state
    # (a tool output whose call exists nowhere but in that state).
    requires_state: str | None = None
    max_new_tokens: int = 0
    # ``max_new_tokens`` may be cut to the room the window leaves: the
    # request set no limit, or only a ceiling (Anthropic's ``max_tokens``).
    # A plan then need leave room for one token, so that a turn whose KV
    # holds more than its replay (hidden reasoning, a call sampled as other
    # tokens) is still continued; the generation ends where the window does
    # (``context_window``).
    clamp_output: bool = False
    # A replayed tool-call turn lacks its reasoning: only a remembered state
    # (resident, RAM, disk by visible transcript) may explain it.
    needs_reasoning_state: bool = False
    # Only states this owner's requests left are candidates.
    owner: str = "local"
    # The open connection the request came on (rule 0, eviction order).
    pin: SessionPin | None = None
    signature: Signature = field(default_factory=Signature)
    # Token positions where a client declared a reusable prefix ends: on a
    # non-trimmable KV the prefill stops there for an exact-state checkpoint.
    breakpoints: tuple[int, ...] = ()
    # The client's agent and the agent that spawned it (a subagent:
    # lmspd.dialects.session.agent_lineage), both of this owner's session.
    agent: str | None = None
    parent_agent: str | None = None


class CacheRefused(Exception):
    """The request needed a state that is gone: the client must replay."""


class KvReads(Protocol):
    """What the planner asks of the engine (``KvOps`` has it): nothing that
    changes the KV."""

    @property
    def tokenize(self) -> Callable[[str], list[int]]: ...

    @property
    def detokenize(self) -> Callable[[list[int]], str]: ...

    @property
    def n_ctx(self) -> int: ...  # per sequence

    # The shortest prefix a sequence holding n tokens can be trimmed to exactly.
    @property
    def floor(self) -> Callable[[int, int], int]: ...

    # Whether a copy from this sequence moves only its used cells.
    @property
    def cheap_copy(self) -> Callable[[int], bool]: ...


class SavedCheckpoint(Protocol):
    @property
    def n_tokens(self) -> int: ...


CheckpointT = TypeVar("CheckpointT", bound=SavedCheckpoint)


class SavedStates(Protocol[CheckpointT]):
    """The disk tier as the planner reads it (lmspd.cache.disk.DiskCheckpoints):
    its index, and a checkpoint's state once the plan needs its KV."""

    def best_match(self, text: str, owner: str,
                   response_id: str | None = None) -> tuple[CheckpointT, str] | None: ...

    def longest_common(self, tokens: list[int], owner: str) -> tuple[CheckpointT, int] | None: ...

    def load(self, cp: CheckpointT) -> SessionState | None: ...


def cold(req: CacheRequest, seq: int, detail: str = "") -> CachePlan:
    """A prefill of the whole prompt on ``seq``."""
    return CachePlan("cold", 0, list(req.tokens), req.text, detail=detail, seq=seq)


def agent_tag(agent: str | None) -> str:
    """A short, stable name for an agent id in logs and views (its first
    8 characters: client ids are UUIDs or thread ids, never secrets)."""
    return (agent or "-")[:8]


def running_parents(residents: Sequence[Resident], req: CacheRequest | None) -> set[str]:
    """The agents whose subagents run now, and ``req``'s parent: a child never
    evicts its parent (``Residency.target``)."""
    parents = {r.parent_agent for r in residents if r.busy and r.parent_agent is not None}
    if req is not None and req.parent_agent is not None:
        parents.add(req.parent_agent)
    return parents


def may_take(r: Resident, parents: set[str]) -> bool:
    """Whether ``r`` may be given to another request while other sequences
    are to be had: not an open connection's, not one of ``parents``'."""
    return not r.pinned and not (r.agent is not None and r.agent in parents)


def continues(req: CacheRequest, state: SessionState) -> bool:
    """Whether ``req`` could continue ``state`` in place (by any rule that
    keeps the whole state): string and list prefix tests, no tokenizing."""
    if req.previous_response_id is not None and req.previous_response_id == state.response_id:
        return True
    if req.requires_state is not None and req.requires_state == state.key:
        return True
    if state.visible and req.text.startswith(state.visible):
        return True
    n = len(state.tokens)
    if len(req.tokens) > n and req.tokens[:n] == state.tokens:
        return True
    return len(req.text) > len(state.kv_text) and req.text.startswith(state.kv_text)


class Planner:
    """Plans over what it is given: the sequences of the context (by id),
    the RAM states by key (least recently kept first), the disk tier, and
    the sequences a pending stream copy reads or writes. The cache hands it
    its own, live; it reads them when asked and changes none of them."""

    def __init__(self, ops: KvReads, residents: Sequence[Resident], ram: Mapping[str, SessionState], *,
                 disk: SavedStates[Any] | None = None, copying: Collection[int] = frozenset(),
                 enabled: bool = True, trimmable: bool = True) -> None:
        self.ops = ops
        self.residents = residents
        self.ram = ram
        self.disk = disk
        self.copying = copying
        self.enabled = enabled
        # False: a state is cut short only down to its floor.
        self.trimmable = trimmable

    def _index(self) -> RamIndex:
        """The RAM states' index: the tier's own (``RamStates``), kept in
        step with it; a plain mapping of states (a test's) is indexed anew."""
        index = getattr(self.ram, "index", None)
        return index if isinstance(index, RamIndex) else RamIndex(self.ram)

    # -- guesses from a snapshot (any thread) ------------------------------------

    def likely_checkpoint(self, req: CacheRequest, states: list[SessionState]) -> Any | None:
        """The disk checkpoint ``req`` will most likely restore, guessed from
        ``states`` (a snapshot of the owner's resident and RAM states):
        nothing of them continues the request, a checkpoint's key starts its
        text (or shares the longest token prefix)."""
        disk = self.disk
        if disk is None or any(continues(req, s) for s in states):
            return None
        held = self.held(req, states)
        hit = disk.best_match(req.text, req.owner, req.previous_response_id)
        if hit is not None:
            return hit[0] if hit[0].n_tokens > held else None
        shared = disk.longest_common(req.tokens, req.owner)
        if shared is not None and shared[1] >= MIN_COPY_TOKENS and shared[1] > held:
            return shared[0]
        return None

    def held(self, req: CacheRequest, states: list[SessionState]) -> int:
        """How much of ``req`` a state in memory (resident, or in RAM)
        already holds, as the snapshot shows it: a disk checkpoint no longer
        than that is never the plan. A new session that shares an agent's
        instructions with a resident one copies them from there; reading
        (and hashing) a mid-prefill checkpoint of them first (141 MB for 6k
        of Codex-sized instructions) cost its first turn 0.3-1.0 s on two
        cores."""
        held = 0
        for s in states:
            common = min(common_prefix(s.tokens, req.tokens), len(req.tokens) - 1)
            # A resident state's floor is known only once captured: on a
            # model whose KV cannot be trimmed, count whole states only.
            exact = common == len(s.tokens) or (self.trimmable and common >= MIN_COPY_TOKENS) or (
                s.kv is not None and common >= max(s.floor, MIN_COPY_TOKENS))
            if exact:
                held = max(held, common)
        return held

    # -- matching (scheduler thread) -------------------------------------------

    def plan(self, req: CacheRequest, target: Resident | None, *, contending: int = 0) -> CachePlan | None:
        """Where ``req`` runs and what it reuses, ``target`` being the sequence
        it takes when it continues none (None: every sequence is busy or
        being copied); None: not now (no sequence is free, or another
        sequence is about to hold what it needs) — ask again after the next
        step. ``contending``: how many requests behind this one wait for a
        sequence in the same admission pass (``_shared_candidates``: when
        sequences are scarce, a shared prefix is kept in place)."""
        plan = self._plan(req, target, contending)
        if plan is None:
            return None
        # A replayed tool call without its reasoning (Codex, the Vercel AI SDK,
        # the openai SDK's tool loop send them so) continues a state that
        # holds the reasoning when one does (``_plan`` prefers it); else it
        # renders without it, and says so.
        plan.reasoning_stripped = self._drops_reasoning(req, plan)
        if plan.restore is not None and plan.restore.boundary is not None and plan.source in ("ram", "disk"):
            # Rules that name their match (response-id, tool-output-ids) keep their name.
            plan.detail = f"at={plan.restore.boundary} from={plan.source}" + (f" {plan.detail}" if plan.detail else "")
            plan.source = "checkpoint"
        if req.parent_agent is not None:
            # The lineage in the log line and the request's report.
            plan.detail = (f"{plan.detail} " if plan.detail else "") + (
                f"lineage={agent_tag(req.parent_agent)}>{agent_tag(req.agent)}")
        return plan

    @staticmethod
    def _drops_reasoning(req: CacheRequest, plan: CachePlan) -> bool:
        """The request needs a state's hidden reasoning, and ``plan`` would
        rebuild its prompt from the visible text only."""
        return req.needs_reasoning_state and (plan.source in ("cold", "copy") or plan.detail == "text"
                                              or "partial" in plan.detail.split())

    def _plan(self, req: CacheRequest, target: Resident | None, contending: int = 0) -> CachePlan | None:
        idle = [r for r in self.residents if not r.busy]
        if not self.enabled or not req.reuse:
            return None if target is None else cold(req, target.seq)
        # A sequence of this owner that is just evaluating its last token
        # holds its state a step from now: a next turn that continues it
        # waits that step. Any other request of the owner goes on (one API
        # key often drives several sessions at once).
        if any(r.busy and r.state is not None and r.owner == req.owner and continues(req, r.state)
               for r in self.residents):
            return None
        mine = [r for r in idle if r.state is not None and r.state.owner == req.owner]
        if req.requires_state is not None:
            live = [r for r in mine if r.state is not None and r.state.key == req.requires_state]
            for r in live:
                assert r.state is not None
                if self._extends(req, r.state):
                    fitted = self._fits(req, self._continue(req, r.state, "tool-output-ids", r.seq))
                    if fitted.source != "cold":
                        return fitted
            if not live:
                state = self.ram.get(req.requires_state)
                if state is None or state.owner != req.owner:
                    raise CacheRefused(
                        "This request carries only tool outputs and requires live call state, which was replaced "
                        "before it ran; replay the full input."
                    )
                if self._extends(req, state):
                    if target is None:
                        return None
                    fitted = self._fits(req, self._continue(req, state, "tool-output-ids", target.seq, restore=True))
                    if fitted.source != "cold":
                        return fitted
            # The state is there but has no visible transcript to append to
            # (its turn could not be aligned with the template), or its whole
            # KV and the output would not fit the window: the prompt, rendered
            # whole on top of its items, is matched like any other.

        if req.pin is not None and req.previous_response_id:
            for r in mine:
                state = r.state
                if (r.pin is req.pin and state.response_id == req.previous_response_id  # type: ignore[union-attr]
                        and state.visible and req.text.startswith(state.visible)):  # type: ignore[union-attr]
                    return self._fits(req, self._continue(req, state, "connection", r.seq))  # type: ignore[arg-type]
        if req.previous_response_id:
            for r in mine:
                state = r.state
                if state.response_id == req.previous_response_id and state.visible and req.text.startswith(state.visible):  # type: ignore[union-attr]
                    return self._fits(req, self._continue(req, state, "response-id", r.seq))  # type: ignore[arg-type]
            for state in reversed(self._index().by_response(req.owner, req.previous_response_id)):
                if state.visible and req.text.startswith(state.visible) and target is not None:
                    return self._fits(req, self._continue(req, state, "response-id", target.seq, restore=True))
        resident_plans = [p for r in mine if (p := self._match_resident(req, r)) is not None]
        for plan in sorted(resident_plans, key=lambda p: p.keep, reverse=True):
            fitted = self._fits(req, plan)
            if fitted.source != "cold":
                return fitted

        shared = self._shared_candidates(req, target, self._scarce(contending))
        held = max((p.keep for p in shared if self._serves(req, p)), default=0)
        candidates = self._saved_candidates(req, target, held) + shared
        best = max((c.keep for c in candidates), default=0)
        if self._worth_waiting(req, best):
            return None
        # On a tie the state itself beats a checkpoint of the same prefix, and
        # KV already in the context (kept in place, or copied between
        # sequences) beats bytes restored from RAM or disk.
        # A subagent's copy from its own parent beats an equal one from
        # another session (lineage, not luck: the parent is kept resident).
        # Else the target's own tokens beat an equal copy into it: a copy
        # moves KV (on a split cache the whole stream) and holds its source
        # until the next step (two sessions sending the same prompt again).
        for plan in sorted(candidates, key=lambda p: (p.keep, p.restore is None or p.restore.boundary is None,
                                                      p.restore is None, "parent" in p.detail.split(),
                                                      p.copy_from is None),
                           reverse=True):
            fitted = self._fits(req, plan)
            # A plan that would be refused for want of reasoning state gives
            # way to one that keeps it (a whole state restored), shorter or not.
            if fitted.source != "cold" and not self._drops_reasoning(req, fitted):
                return fitted
        return None if target is None else cold(req, target.seq)

    @staticmethod
    def _extends(req: CacheRequest, state: SessionState) -> bool:
        """The prompt continues the state's visible transcript."""
        return bool(state.visible) and req.text.startswith(state.visible)  # type: ignore[arg-type]

    def _match_resident(self, req: CacheRequest, r: Resident) -> CachePlan | None:
        state = r.state
        assert state is not None
        if state.visible and req.text.startswith(state.visible):
            source = "tool-output-ids" if self._first_new_is_tool_output(req, state) else "visible-prefix"
            return self._continue(req, state, source, r.seq)
        n = len(state.tokens)
        if req.tokens[:n] == state.tokens and len(req.tokens) > n:
            return CachePlan("memory-token", n, req.tokens[n:], req.text, seq=r.seq)
        if req.text.startswith(state.kv_text) and len(req.text) > len(state.kv_text):
            suffix_text = req.text[len(state.kv_text):]
            return CachePlan("memory-text", n, self.ops.tokenize(suffix_text), req.text, seq=r.seq)
        return None

    def _saved_candidates(self, req: CacheRequest, target: Resident | None, held: int = 0) -> list[CachePlan]:
        """RAM sessions and disk checkpoints, restored into ``target``. A
        checkpoint no longer than ``held`` (what a resident sequence shares
        with ``req``, copied for less than a restore costs) is not read."""
        if target is None:
            return []
        candidates: list[CachePlan] = []
        for state in self._ram_examined(req):
            plan = self._match_saved(req, state, "ram", target.seq)
            if plan is None:
                # A branch or an edit: the longest common token prefix still
                # saves that much prefill.
                common = min(common_prefix(state.tokens, req.tokens), len(req.tokens) - 1)
                # Below its floor it cannot serve, and counted as a candidate
                # it would hide a shorter disk checkpoint that can.
                if common >= MIN_COPY_TOKENS and common >= state.floor:
                    plan = CachePlan("ram", common, req.tokens[common:], req.text, restore=state, detail="partial",
                                     seq=target.seq)
                plan = self._aligned_plan(req, state, "ram", target.seq, floor=state.floor,
                                          beyond=plan.keep if plan else 0, restore=state) or plan
            if plan is not None:
                candidates.append(plan)
        if self.disk is None:
            return candidates
        hit = self.disk.best_match(req.text, req.owner, req.previous_response_id)
        if hit is not None:
            cp, kind = hit
            if cp.n_tokens > held and not any(c.keep >= cp.n_tokens for c in candidates):
                loaded = self.disk.load(cp)
                if loaded is not None:
                    plan = self._match_saved(req, loaded, "disk", target.seq)
                    if plan is not None:
                        plan.detail = f"key={kind}"
                        candidates.append(plan)
        best = max((c.keep for c in candidates), default=0)
        shared = self.disk.longest_common(req.tokens, req.owner)
        if shared is not None and min(shared[1], len(req.tokens) - 1) > max(best, held, MIN_COPY_TOKENS - 1):
            loaded = self.disk.load(shared[0])
            if loaded is not None:
                keep = min(shared[1], len(req.tokens) - 1)
                candidates.append(CachePlan("disk", keep, req.tokens[keep:], req.text, restore=loaded,
                                            detail="partial", seq=target.seq))
        return candidates

    def _ram_examined(self, req: CacheRequest) -> list[SessionState]:
        """The RAM states of ``req``'s owner whose candidate (the loop of
        ``_saved_candidates``) can be the plan, in RAM order, found through
        the index (lmspd.cache.index) instead of trying every state:

        - every state whose visible transcript or KV text starts the request
          (``_match_saved``: a whole state);
        - every state with an alignment point whose text starts the request
          and whose tokens it does not start (``_aligned_plan`` keeps more
          than the common token prefix only then);
        - of all other states, only the one whose partial restore the plan's
          order tries first: the longest common token prefix, at least
          ``MIN_COPY_TOKENS`` and the state's floor; then no checkpoint
          (``boundary``); then the least recently kept (the sort is stable).
          The rest offer the same plan with the same or a shorter prefix, and
          ``_fits`` and ``_drops_reasoning`` treat every partial restore
          alike (its suffix is the rest of the prompt, its cut at or above
          the floor): one that loses to that one loses to it for good."""
        index = self._index()
        found = index.text_prefixes(req.owner, req.text)
        found.update(index.aligned_branches(req.owner, req.text, req.tokens[:-1], MIN_COPY_TOKENS))
        partial = self._longest_partial(index, req, skip=found)
        if partial is not None:
            found[partial[0]] = partial[1]
        return index.in_order(found)

    @staticmethod
    def _longest_partial(index: RamIndex, req: CacheRequest,
                         skip: Collection[str]) -> tuple[str, SessionState] | None:
        """The state (key, state) of the partial RAM restore the plan would
        try first, of those not in ``skip``. Levels come longest prefix
        first; a level's states are in RAM order, and repeat the deeper
        levels' states, which were below their floor there and are below it
        here too. Trimmable: the first state of the first level."""
        # The prefix a plan keeps leaves the prompt's last token to evaluate.
        for depth, node in index.levels(req.owner, req.tokens[:-1]):
            if depth < MIN_COPY_TOKENS:
                return None
            checkpoint: tuple[str, SessionState] | None = None
            for key, state in node.below.items():
                if key in skip or state.floor > depth:
                    continue
                if state.boundary is None:
                    return key, state
                checkpoint = checkpoint or (key, state)
            if checkpoint is not None:
                return checkpoint
        return None

    def _scarce(self, contending: int) -> bool:
        """A copy from an idle sequence would leave too few sequences for the
        ``contending`` requests behind this one in the same admission pass:
        a copy takes its source as well as its target until the next step
        performs it (``Residency.apply``: both are ``copying``), and each
        request behind needs one. Never with nobody contending."""
        usable = sum(1 for r in self.residents if not r.busy and r.seq not in self.copying)
        return contending > usable - 2

    def _shared_candidates(self, req: CacheRequest, target: Resident | None, scarce: bool = False) -> list[CachePlan]:
        """A common token prefix with a sequence of the same owner: kept in
        place when that sequence is the target anyway, else copied into the
        target (the sequence holding it stays as it is). When sequences are
        ``scarce`` (``_scarce``), a copy that would lock an idle holder for
        the step is kept in place on the holder instead, cut to the shared
        prefix (its state goes to RAM first), so that every request of a
        burst gets a sequence at once; not a holder ``target`` would never
        hand out either (``may_take``: an open connection's, a running
        subagent's parent). A copy from a holder that is running or copying
        already (many requests sharing one system prompt) costs only its
        target and stays a copy."""
        candidates: list[CachePlan] = []
        parents = running_parents(self.residents, req) if scarce else set()
        for r in self.residents:
            if r.owner != req.owner or not r.tokens:
                continue
            common = min(common_prefix(r.tokens, req.tokens), len(req.tokens) - 1)
            # A finished turn may share more through its alignment points.
            state = r.state if r.state is not None and not r.busy else None
            floor = self.ops.floor(r.seq, len(r.tokens)) if state is not None else 0
            if target is not None and r.seq != target.seq:
                aligned = state and self._aligned_plan(req, state, "copy", target.seq, floor=floor, beyond=common,
                                                       copy_from=r.seq)
                copy: CachePlan | None = None
                if aligned:
                    aligned.detail = f"from=seq{r.seq} aligned"
                    copy = aligned
                elif common >= MIN_COPY_TOKENS or (common >= MIN_CELL_COPY_TOKENS
                                                   and common * CELL_COPY_RATIO >= len(r.tokens)
                                                   and self.ops.cheap_copy(r.seq)):
                    parent = req.parent_agent is not None and r.agent == req.parent_agent
                    copy = CachePlan("copy", common, req.tokens[common:], req.text,
                                     detail=f"from=seq{r.seq}" + (" parent" if parent else ""),
                                     seq=target.seq, copy_from=r.seq)
                if copy is not None and scarce and not r.busy and r.seq not in self.copying and may_take(r, parents):
                    # Kept in place: the same tokens, on the holder.
                    copy.source, copy.seq, copy.copy_from = "memory-token", r.seq, None
                    copy.detail = "partial aligned scarce" if aligned else "partial scarce"
                if copy is not None:
                    candidates.append(copy)
            elif not r.busy and r.seq not in self.copying:
                aligned = state and self._aligned_plan(req, state, "memory-token", r.seq, floor=floor, beyond=common)
                if aligned:
                    candidates.append(aligned)
                elif common > 0:
                    candidates.append(CachePlan("memory-token", common, req.tokens[common:], req.text,
                                                detail="partial", seq=r.seq))
        return candidates

    def _worth_waiting(self, req: CacheRequest, best: int) -> bool:
        """Another sequence of this owner is prefilling a prompt that shares
        more with this one than anything else has: wait until it is there."""
        for r in self.residents:
            if not r.busy or r.owner != req.owner or len(r.tokens) >= len(r.prompt):
                continue
            shared = min(common_prefix(r.prompt, req.tokens), len(req.tokens) - 1)
            if shared > len(r.tokens) and shared >= MIN_COPY_TOKENS and shared - best >= WAIT_FOR_SHARED_PREFIX:
                return True
        return False

    def _continue(self, req: CacheRequest, state: SessionState, source: str, seq: int,
                  restore: bool = False) -> CachePlan:
        assert state.visible is not None
        suffix_text = req.text[len(state.visible):]
        plan = CachePlan(source, len(state.tokens), self.ops.tokenize(suffix_text),
                         state.kv_text + suffix_text, restore=state if restore else None, seq=seq)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("join %s: KV ends %r (visible %r), suffix starts %r", source, state.kv_text[-48:],
                      state.visible[-48:], suffix_text[:48])
        if source == "tool-output-ids":
            plan.detail = f"ids={sum(isinstance(i, ToolOutput) for i in self._new_items(req, state))}"
        return plan

    def _match_saved(self, req: CacheRequest, state: SessionState, source: str, seq: int) -> CachePlan | None:
        if state.visible and req.text.startswith(state.visible):
            plan = self._continue(req, state, source, seq, restore=True)
            plan.detail = "visible"
            return plan
        if req.text.startswith(state.kv_text) and len(req.text) > len(state.kv_text):
            suffix = self.ops.tokenize(req.text[len(state.kv_text):])
            return CachePlan(source, len(state.tokens), suffix, req.text, restore=state, detail="text", seq=seq)
        return None

    def _first_new_is_tool_output(self, req: CacheRequest, state: SessionState) -> bool:
        new = self._new_items(req, state)
        return bool(new) and isinstance(new[0], ToolOutput) and new[0].call_id in state.call_ids

    @staticmethod
    def _new_items(req: CacheRequest, state: SessionState) -> list[Item]:
        return req.items[len(state.items):] if len(req.items) >= len(state.items) else []

    def _aligned_plan(self, req: CacheRequest, state: SessionState, source: str, seq: int, *,
                      floor: int, beyond: int, **fields: object) -> CachePlan | None:
        """A branch of ``state`` (an edit of a message it holds) through its
        alignment points: keep the KV up to the last point before the
        request's text parts from the prompt of the turn that left the state
        (``aligned_text``), and prefill the rest of the text from there. None unless it keeps more than
        ``beyond`` tokens (what a common token prefix keeps)."""
        if not state.aligned:
            return None
        shared = common_prefix(req.text, state.aligned_text)
        # Something is left to prefill (the request's next-token logits).
        points = [(t, c) for t, c in state.aligned
                  if c <= shared and c < len(req.text) and t >= floor and t > max(beyond, MIN_COPY_TOKENS - 1)]
        if not points:
            return None
        t, c = points[-1]
        rest, kept = req.text[c:], state.tokens[:t]
        ops = self.ops
        return CachePlan(source, t, [], "", detail="partial aligned", seq=seq,
                         lazy=lambda: (ops.tokenize(rest), ops.detokenize(kept) + rest),
                         **fields)  # type: ignore[arg-type]

    def _base_tokens(self, plan: CachePlan) -> list[int]:
        if plan.restore is not None:
            return plan.restore.tokens
        source = plan.copy_from if plan.copy_from is not None else plan.seq
        return self.residents[source].tokens

    def _floor(self, plan: CachePlan) -> int:
        """How short the plan's base state can be cut and stay exact."""
        if plan.restore is not None:
            return plan.restore.floor
        r = self.residents[plan.copy_from if plan.copy_from is not None else plan.seq]
        return self.ops.floor(r.seq, len(r.tokens)) if r.tokens else 0

    def _below_floor(self, plan: CachePlan) -> bool:
        """The plan cuts its base state where it would not stay exact."""
        return bool(plan.keep) and plan.keep < len(self._base_tokens(plan)) and plan.keep < self._floor(plan)

    def _too_long(self, req: CacheRequest, plan: CachePlan) -> bool:
        """The kept tokens, the suffix and the output exceed a sequence."""
        output = 1 if req.clamp_output else req.max_new_tokens
        return plan.keep + len(plan.suffix) + output > self.ops.n_ctx

    def _serves(self, req: CacheRequest, plan: CachePlan) -> bool:
        """``_fits`` would take ``plan`` as it is (its suffix known now)."""
        return (plan.lazy is None and bool(plan.suffix) and not self._below_floor(plan)
                and not self._too_long(req, plan))

    def _fits(self, req: CacheRequest, plan: CachePlan) -> CachePlan:
        plan.resolved()
        if not plan.suffix:
            # Fresh logits need at least one evaluated token.
            if plan.keep == 0:
                return cold(req, plan.seq)
            plan.keep -= 1
            plan.suffix = [self._base_tokens(plan)[plan.keep]]
        if self._below_floor(plan):
            # A cut below the floor would leave a window or a recurrent state
            # inexact: the next candidate (a checkpoint) must serve it.
            return cold(req, plan.seq)
        if self._too_long(req, plan):
            # Hidden tokens made the continuation longer than a cold prompt;
            # the cold prompt was already checked to fit.
            return cold(req, plan.seq)
        return plan

    # -- exact-state checkpoints (scheduler thread) -------------------------------

    def breakpoints_ahead(self, req: CacheRequest, seq: int) -> list[int]:
        """The breakpoints of ``req`` its prefill on ``seq`` has yet to reach
        and that no remembered state already ends at: the positions the
        scheduler stops the prefill at for a ``checkpoint``."""
        if self.trimmable or not self.enabled or not req.breakpoints:
            return []
        done = len(self.residents[seq].tokens)
        ends = self._index().end_depths(req.owner, req.tokens)
        return [p for p in req.breakpoints
                if done < p < len(req.tokens) and not (p in ends and self._remembers(req.tokens[:p], req.owner))]

    def _remembers(self, tokens: list[int], owner: str) -> bool:
        key = SessionState(tokens=tokens, kv_text="", owner=owner).key
        return key in self.ram

    # -- diagnostics (scheduler thread) -------------------------------------------

    def diagnose(self, req: CacheRequest, plan: CachePlan, evictions: EvictionLog) -> CacheReport:
        """Why ``plan`` reuses less than a full continuation of what the cache
        remembers (lmspd.cache.diagnostics); ``evictions``: what left it."""
        report = self._diagnose(req, plan, evictions)
        if plan.reasoning_stripped:
            report.miss_reason = "reasoning_stripped"
        return report

    def _diagnose(self, req: CacheRequest, plan: CachePlan, evictions: EvictionLog) -> CacheReport:
        report = CacheReport(plan.source, plan.keep, len(plan.suffix))
        if not self.enabled or not req.reuse:
            report.miss_reason = "reuse_off"
            return report
        if self._continues_whole(plan):
            # Continues a whole state (the common case of an agent loop):
            # nothing was missed, and nothing is scanned for it.
            report.longest_prefix = plan.keep
            return report
        best, best_floor, longest = self._longest_remembered(req)
        # What the plan keeps is shared too: after sampled turns a branch
        # keeps more through alignment points than any token prefix shows
        # (the divergence below stays the token prefix of the state named).
        report.longest_prefix = max(longest, plan.keep)
        evicted = evictions.longest(req.tokens, req.owner)
        if evicted is not None and evicted[0] > max(longest, plan.keep + 1):
            # More of it was remembered once: say what pushed that state out.
            report.divergence_token, report.remembered, report.evicted_by = evicted
            report.miss_reason = "state_evicted"
            return report
        if best is None or longest == 0:
            return report  # nothing remembered shares a token with it
        report.divergence_token = longest
        report.remembered = len(best.tokens)
        reason, item = classify(best, req.items, req.signature)
        report.divergence_item = item
        if plan.keep + 1 < longest and reason in ("messages_changed", "reasoning_stripped"):
            # The prompt parts from the state in its messages, yet not even
            # the shared part was reused: say why not.
            if not self.trimmable and best_floor > longest:
                reason = "checkpoint_missing"
            elif longest < MIN_COPY_TOKENS:
                reason = "below_min_reuse"
        report.miss_reason = reason
        return report

    def _continues_whole(self, plan: CachePlan) -> bool:
        """The plan extends all of the state it starts from (or copies). Not a
        partial reuse or a checkpoint: those part from a state that may share
        more with the request (the diagnosis looks for it)."""
        if plan.source in ("cold", "checkpoint") or "partial" in plan.detail.split():
            return False
        return plan.keep + 1 >= len(self._base_tokens(plan))

    def _longest_remembered(self, req: CacheRequest) -> tuple[SessionState | None, int, int]:
        """The remembered state (resident, RAM) sharing the longest token
        prefix with ``req``, its floor, and the longest prefix shared with
        anything remembered (disk included): a scan of every state, so only
        for a request that did not continue one whole."""
        best: SessionState | None = None
        best_floor = longest = 0
        # (state, floor): a resident's floor is live, a saved state's was taken at capture.
        states = [(r.state, self.ops.floor(r.seq, len(r.tokens))) for r in self.residents
                  if r.state is not None and r.state.owner == req.owner]
        saved = self._longest_saved(req)
        if saved is not None:
            states.append((saved, saved.floor))
        rank: tuple = ()
        for state, floor in states:
            common = common_prefix(state.tokens, req.tokens)
            # The longest prefix wins; on a tie (a template's few leading
            # tokens), the state of the same system and tools, then one that
            # knows its items: the conversation this request most likely is.
            key = (common, state.signature == req.signature, bool(state.items))
            if common and key > rank:
                best, best_floor, longest, rank = state, floor, common, key
        if self.disk is not None:
            shared = self.disk.longest_common(req.tokens, req.owner)
            if shared is not None and shared[1] > longest:
                longest = shared[1]
        return best, best_floor, longest

    def _longest_saved(self, req: CacheRequest) -> SessionState | None:
        """The RAM state ``_longest_remembered``'s scan would pick among the
        RAM states: of those sharing the longest token prefix (the index's
        first level), the first in RAM order of the best rank (the same
        signature, then with items). States of one ``kind`` rank alike: only
        the first of each kind is looked at."""
        index = self._index()
        for depth, node in index.levels(req.owner, req.tokens):
            if depth == 0:
                return None
            firsts = [next(iter(same.items())) for same in node.kinds.values()]
            if not firsts:
                return None
            _, best = max(firsts, key=lambda ks: (ks[1].signature == req.signature, bool(ks[1].items),
                                                  -index.order[ks[0]]))
            return best
        return None
