"""The continuation cache: which sequence a request runs on and what of its
KV it keeps.

Three tiers, fastest first: the **resident sequences** of the engine's
context (their KV stays in place between turns), **sessions in RAM**
(captured KV bytes of sequences that had to make room) and **disk
checkpoints**. A request is matched in this order, the first rule that
applies winning:

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
(``checkpoint``), which the cache keeps for such models at the end of every
prompt (``input``), at client-declared and implicit breakpoints
(``breakpoint``), at the end of a generation's reasoning section
(``reasoning``: a sealed replay that keeps the reasoning but edits what
followed it; only when the response carries its reasoning sealed, the one
form a replay renders) and at the end of every turn that a later turn extends
(``response``). Checkpoints are RAM states like the others: same budget,
spilled to disk.

A request that is no continuation goes to a free sequence, else to the
least recently used idle one, whose state moves to RAM first; the
sequences of open connections are taken last (the least recently used
connection first), so a connection's session stays resident while other
traffic comes and goes. A state that
leaves RAM (over budget) is written to disk; so is every remembered state
at shutdown. A running sequence is never evicted: with none idle, the
request waits for the next step. So does a request whose shared prefix
another sequence is prefilling right now (it copies it once it is there,
instead of prefilling it twice).

Everything that changes residency runs on the engine's scheduler thread,
which alone touches the KV; ``prepare`` (in the service's preparing
threads) only reads ``states``, an immutable snapshot the scheduler
replaces whole.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from lmspd.core.conversation import Item, SessionPin, ToolOutput

from .diagnostics import CacheReport, EvictionLog, Signature, classify
from .disk import DiskCheckpoints
from .state import SessionState, common_prefix

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
# Alignment points a state keeps (two a turn): a branch resumes from one of
# the last few turns.
MAX_ALIGNED = 64


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


@dataclass
class KvOps:
    """The engine's KV operations by sequence id (the engine owns the KV;
    the cache only decides)."""

    capture: Callable[[int], bytes | bytearray]
    restore: Callable[[int, bytes | bytearray], bool]
    copy: Callable[[int, int, int], None]  # src, dst, n_tokens
    trim: Callable[[int, int], None]  # seq, keep
    tokenize: Callable[[str], list[int]]
    detokenize: Callable[[list[int]], str]
    n_ctx: int  # per sequence
    # The shortest prefix a sequence holding n tokens can be trimmed to exactly.
    floor: Callable[[int, int], int] = lambda seq, n: 0
    # Whether a copy from this sequence moves only its used cells (not the
    # whole stream of the window): cheap for a short source.
    cheap_copy: Callable[[int], bool] = lambda seq: False


@dataclass
class Resident:
    """One sequence of the context and what its KV holds."""

    seq: int
    # The tokens evaluated in this sequence: exactly what its KV holds.
    tokens: list[int] = field(default_factory=list)
    # The finished turn it holds (None while a request runs on it, or empty).
    state: SessionState | None = None
    owner: str | None = None
    busy: bool = False
    last_used: float = 0.0
    # The state is already captured in RAM (no second capture on eviction).
    saved: bool = False
    # While busy: the whole prompt it is prefilling (for shared-prefix waits),
    # the request's text, and how many of ``prompt`` it kept (for the visible
    # transcript of a checkpoint taken during the prefill).
    prompt: list[int] = field(default_factory=list)
    prompt_text: str = ""
    prompt_keep: int = 0
    # While busy: the alignment points (``SessionState.aligned``) of the
    # state it continues that still hold for this prompt.
    prompt_aligned: tuple[tuple[int, int], ...] = ()
    # A caller's hint that this sequence belongs to a session (reserved).
    session_key: str | None = None
    # The agent whose turn it holds or runs, and that agent's parent.
    agent: str | None = None
    parent_agent: str | None = None
    # The connection whose session this sequence holds (see ``pinned``).
    pin: SessionPin | None = None

    @property
    def pinned(self) -> bool:
        """Held by a connection that is still open: evicted last."""
        return self.pin is not None and self.pin.open


@dataclass
class CacheStats:
    ram_sessions: int = 0
    ram_bytes: int = 0
    disk_checkpoints: int = 0
    disk_writes: int = 0
    disk_restores: int = 0
    ram_restores: int = 0
    evictions: int = 0
    copies: int = 0
    copied_tokens: int = 0
    checkpoints: int = 0  # exact-state checkpoints taken (non-trimmable KV)
    checkpoint_restores: int = 0


class ContinuationCache:
    def __init__(
        self,
        ops: KvOps,
        *,
        n_seq: int = 1,
        enabled: bool = True,
        ram_budget_bytes: int = 1 << 30,
        disk: DiskCheckpoints | None = None,
        trimmable: bool = True,
    ) -> None:
        self.ops = ops
        self.enabled = enabled
        # False: keep exact-state checkpoints at turn boundaries.
        self.trimmable = trimmable
        self.ram_budget_bytes = ram_budget_bytes
        self.disk = disk
        self.residents = [Resident(seq) for seq in range(max(1, n_seq))]
        # What left every tier, and why (diagnostics: ``state_evicted``).
        self.evictions = EvictionLog()
        if disk is not None and disk.on_evict is None:
            disk.on_evict = lambda tokens, owner: self.evictions.record(tokens, owner, "disk_budget")
        self._ram: OrderedDict[str, SessionState] = OrderedDict()
        self.stats = CacheStats()
        # Sequences a stream copy reads or writes before the next decode
        # performs it: nothing may overwrite them until then.
        self._copying: set[int] = set()
        self._copied_into: set[int] = set()
        self._snapshot: tuple[SessionState, ...] = ()
        self._writes: queue.Queue[SessionState | None] = queue.Queue(maxsize=4)
        self._writer: threading.Thread | None = None
        if disk is not None:
            self._writer = threading.Thread(target=self._write_loop, name="lmspd-kv-writer", daemon=True)
            self._writer.start()

    # -- read-only views (safe from the event loop) ----------------------------

    def states(self, owner: str) -> list[SessionState]:
        return [s for s in self._snapshot if s.owner == owner]

    def continued_state(self, response_id: str, owner: str, text: str) -> SessionState | None:
        """The remembered state of ``owner``'s response ``response_id`` whose
        visible transcript ``text`` extends (the response-id and connection
        rules, read off the snapshot): its tokens are the KV's own for that
        prefix of ``text``."""
        for state in self.states(owner):
            if state.response_id == response_id and state.visible and text.startswith(state.visible):
                return state
        return None

    def state_for_calls(self, call_ids: set[str], owner: str) -> SessionState | None:
        """A remembered state of ``owner`` whose last turn produced all of ``call_ids``."""
        for state in self.states(owner):
            if call_ids and call_ids <= state.call_ids:
                return state
        return None

    def prefetch(self, req: CacheRequest) -> None:
        """Read the disk checkpoint ``req`` will most likely restore, here
        (the request's prepare thread) rather than on the scheduler thread
        while it plans, where every running sequence would wait for the
        read and its checksum. A guess from the snapshot: nothing resident
        or in RAM continues the request, a checkpoint's key starts its text
        (or shares the longest token prefix). ``plan`` takes the read from
        ``DiskCheckpoints.load``; a guess it does not use is dropped."""
        disk = self.disk
        if disk is None or not self.enabled or not req.reuse:
            return
        states = self.states(req.owner)
        if any(self._continues(req, s) for s in states):
            return
        held = self._held(req, states)
        hit = disk.best_match(req.text, req.owner, req.previous_response_id)
        if hit is not None:
            if hit[0].n_tokens > held:
                disk.prefetch(hit[0])
            return
        shared = disk.longest_common(req.tokens, req.owner)
        if shared is not None and shared[1] >= MIN_COPY_TOKENS and shared[1] > held:
            disk.prefetch(shared[0])

    def _held(self, req: CacheRequest, states: list[SessionState]) -> int:
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

    def _publish(self) -> None:
        resident = [r.state for r in sorted(self.residents, key=lambda r: -r.last_used) if r.state is not None]
        self._snapshot = tuple(resident + list(reversed(self._ram.values())))

    # -- matching (scheduler thread) -------------------------------------------

    def plan(self, req: CacheRequest) -> CachePlan | None:
        """Where ``req`` runs and what it reuses; None: not now (no sequence is
        free, or another sequence is about to hold what it needs) — ask
        again after the next step."""
        plan = self._plan(req)
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
                f"lineage={_tag(req.parent_agent)}>{_tag(req.agent)}")
        return plan

    @staticmethod
    def _drops_reasoning(req: CacheRequest, plan: CachePlan) -> bool:
        """The request needs a state's hidden reasoning, and ``plan`` would
        rebuild its prompt from the visible text only."""
        return req.needs_reasoning_state and (plan.source in ("cold", "copy") or plan.detail == "text"
                                              or "partial" in plan.detail.split())

    def _plan(self, req: CacheRequest) -> CachePlan | None:
        idle = [r for r in self.residents if not r.busy]
        target = self._target(idle, req)
        if not self.enabled or not req.reuse:
            return None if target is None else self._cold(req, target.seq)
        # A sequence of this owner that is just evaluating its last token
        # holds its state a step from now: a next turn that continues it
        # waits that step. Any other request of the owner goes on (one API
        # key often drives several sessions at once).
        if any(r.busy and r.state is not None and r.owner == req.owner and self._continues(req, r.state)
               for r in self.residents):
            return None
        mine = [r for r in idle if r.state is not None and r.state.owner == req.owner]
        if req.requires_state is not None:
            live = [r for r in mine if r.state is not None and r.state.key == req.requires_state]
            for r in live:
                assert r.state is not None
                if self._extends(req, r.state):
                    return self._fits(req, self._continue(req, r.state, "tool-output-ids", r.seq))
            if not live:
                state = self._ram.get(req.requires_state)
                if state is None or state.owner != req.owner:
                    raise CacheRefused(
                        "This request carries only tool outputs and requires live call state, which was replaced "
                        "before it ran; replay the full input."
                    )
                if self._extends(req, state):
                    if target is None:
                        return None
                    return self._fits(req, self._continue(req, state, "tool-output-ids", target.seq, restore=True))
            # The state is there but has no visible transcript to append to
            # (its turn could not be aligned with the template): the prompt,
            # rendered whole on top of its items, is matched like any other.

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
            for state in reversed(self._ram.values()):
                if (state.owner == req.owner and state.response_id == req.previous_response_id and state.visible
                        and req.text.startswith(state.visible) and target is not None):
                    return self._fits(req, self._continue(req, state, "response-id", target.seq, restore=True))
        resident_plans = [p for r in mine if (p := self._match_resident(req, r)) is not None]
        for plan in sorted(resident_plans, key=lambda p: p.keep, reverse=True):
            fitted = self._fits(req, plan)
            if fitted.source != "cold":
                return fitted

        shared = self._shared_candidates(req, idle, target)
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
        for plan in sorted(candidates, key=lambda p: (p.keep, p.restore is None or p.restore.boundary is None,
                                                      p.restore is None, "parent" in p.detail.split()),
                           reverse=True):
            fitted = self._fits(req, plan)
            # A plan that would be refused for want of reasoning state gives
            # way to one that keeps it (a whole state restored), shorter or not.
            if fitted.source != "cold" and not self._drops_reasoning(req, fitted):
                return fitted
        return None if target is None else self._cold(req, target.seq)

    @staticmethod
    def _continues(req: CacheRequest, state: SessionState) -> bool:
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

    @staticmethod
    def _extends(req: CacheRequest, state: SessionState) -> bool:
        """The prompt continues the state's visible transcript."""
        return bool(state.visible) and req.text.startswith(state.visible)  # type: ignore[arg-type]

    def _target(self, idle: list[Resident], req: CacheRequest | None = None) -> Resident | None:
        """Where a request that continues no resident state goes: an empty
        sequence, else the least recently used idle one that no open
        connection holds and that is no running subagent's parent (nor this
        request's: a child never evicts its parent), else the least recently
        used connection's, else a parent's."""
        usable = [r for r in idle if r.seq not in self._copying]
        for r in usable:
            if not r.tokens and r.state is None:
                return r
        parents = {r.parent_agent for r in self.residents if r.busy and r.parent_agent is not None}
        if req is not None and req.parent_agent is not None:
            parents.add(req.parent_agent)
        return min(usable, key=lambda r: (r.agent is not None and r.agent in parents and r.owner == (
            req.owner if req is not None else r.owner), r.pinned, r.last_used), default=None)

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
        for state in [s for s in self._ram.values() if s.owner == req.owner]:
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

    def _shared_candidates(self, req: CacheRequest, idle: list[Resident], target: Resident | None) -> list[CachePlan]:
        """A common token prefix with a sequence of the same owner: kept in
        place when that sequence is the target anyway, else copied into the
        target (the sequence holding it stays as it is)."""
        candidates: list[CachePlan] = []
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
                if aligned:
                    aligned.detail = f"from=seq{r.seq} aligned"
                    candidates.append(aligned)
                elif common >= MIN_COPY_TOKENS or (common >= MIN_CELL_COPY_TOKENS
                                                   and common * CELL_COPY_RATIO >= len(r.tokens)
                                                   and self.ops.cheap_copy(r.seq)):
                    parent = req.parent_agent is not None and r.agent == req.parent_agent
                    candidates.append(CachePlan("copy", common, req.tokens[common:], req.text,
                                                detail=f"from=seq{r.seq}" + (" parent" if parent else ""),
                                                seq=target.seq, copy_from=r.seq))
            elif not r.busy and r.seq not in self._copying:
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
        return plan.keep + len(plan.suffix) + req.max_new_tokens > self.ops.n_ctx

    def _serves(self, req: CacheRequest, plan: CachePlan) -> bool:
        """``_fits`` would take ``plan`` as it is (its suffix known now)."""
        return (plan.lazy is None and bool(plan.suffix) and not self._below_floor(plan)
                and not self._too_long(req, plan))

    def _fits(self, req: CacheRequest, plan: CachePlan) -> CachePlan:
        plan.resolved()
        if not plan.suffix:
            # Fresh logits need at least one evaluated token.
            if plan.keep == 0:
                return self._cold(req, plan.seq)
            plan.keep -= 1
            plan.suffix = [self._base_tokens(plan)[plan.keep]]
        if self._below_floor(plan):
            # A cut below the floor would leave a window or a recurrent state
            # inexact: the next candidate (a checkpoint) must serve it.
            return self._cold(req, plan.seq)
        if self._too_long(req, plan):
            # Hidden tokens made the continuation longer than a cold prompt;
            # the cold prompt was already checked to fit.
            return self._cold(req, plan.seq)
        return plan

    def _cold(self, req: CacheRequest, seq: int) -> CachePlan:
        return CachePlan("cold", 0, list(req.tokens), req.text, seq=seq)

    # -- diagnostics (scheduler thread) -------------------------------------------

    def diagnose(self, req: CacheRequest, plan: CachePlan) -> CacheReport:
        """Why ``plan`` reuses less than a full continuation of what the cache
        remembers (lmspd.cache.diagnostics)."""
        report = self._diagnose(req, plan)
        if plan.reasoning_stripped:
            report.miss_reason = "reasoning_stripped"
        return report

    def _diagnose(self, req: CacheRequest, plan: CachePlan) -> CacheReport:
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
        evicted = self.evictions.longest(req.tokens, req.owner)
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
        states += [(s, s.floor) for s in self._ram.values() if s.owner == req.owner]
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

    # -- residency changes (scheduler thread) ----------------------------------

    def apply(self, plan: CachePlan, req: CacheRequest) -> CachePlan:
        """Make ``plan.seq`` hold the plan's kept tokens and mark it busy.
        Returns the plan that was applied (cold when a restore failed)."""
        r = self.residents[plan.seq]
        base = (plan.restore if plan.restore is not None
                else self.residents[plan.copy_from].state if plan.copy_from is not None
                else r.state if plan.keep else None)
        if plan.copy_from is not None:
            src = self.residents[plan.copy_from]
            self._evict(r)
            self.ops.copy(src.seq, r.seq, plan.keep)
            self._copying.update((src.seq, r.seq))
            self._copied_into.add(r.seq)
            r.tokens = src.tokens[: plan.keep]
            self.stats.copies += 1
            self.stats.copied_tokens += plan.keep
        elif plan.restore is not None:
            self._evict(r)
            if plan.restore.kv is not None and self.ops.restore(r.seq, plan.restore.kv):
                if plan.source == "checkpoint":
                    self.stats.checkpoint_restores += 1
                if plan.source == "disk" or "from=disk" in plan.detail.split():
                    self.stats.disk_restores += 1
                else:
                    self.stats.ram_restores += 1
                r.tokens = list(plan.restore.tokens)
                if plan.keep < len(r.tokens):
                    self.ops.trim(r.seq, plan.keep)
                    del r.tokens[plan.keep:]
            else:
                r.tokens = []
                plan = CachePlan("cold", 0, list(req.tokens), req.text, detail="restore failed", seq=r.seq)
        elif plan.keep == 0:
            self._evict(r)
            self.ops.trim(r.seq, 0)
            r.tokens = []
        else:
            # Continues what this sequence holds, all of it or a prefix: a
            # state cut short is kept in RAM first.
            if r.state is not None and plan.keep < len(r.state.tokens):
                self._evict(r)
            elif r.state is not None and not self.trimmable:
                # The end of the turn this one extends: the state a branch or
                # an edit of the next turn resumes from.
                self._evict(r, boundary="response")
            if plan.keep < len(r.tokens):
                self.ops.trim(r.seq, plan.keep)
                del r.tokens[plan.keep:]
        r.state = None
        r.saved = False
        r.busy = True
        r.owner = req.owner
        r.pin = req.pin
        r.agent, r.parent_agent = req.agent, req.parent_agent
        r.prompt = r.tokens + plan.suffix
        r.prompt_text, r.prompt_keep = req.text, len(r.tokens)
        r.prompt_aligned = _still_aligned(base, req.text, r.prompt_keep) if plan.source != "cold" else ()
        r.last_used = time.monotonic()
        self._publish()
        return plan

    def decoded(self) -> None:
        """The step's ``llama_decode`` ran: pending stream copies are done."""
        self._copying.clear()
        self._copied_into.clear()

    def unsettled_copies(self) -> list[Resident]:
        """Sequences a copy went into that no decode has performed yet."""
        return [self.residents[seq] for seq in sorted(self._copied_into)]

    def finished(self, seq: int, state: SessionState) -> None:
        """The turn on ``seq`` is over; its state is set before the client
        gets the terminal event (its next request may look up its calls)."""
        r = self.residents[seq]
        state.aligned, state.aligned_text = self._aligned(r), r.prompt_text
        r.state = state
        r.saved = False
        self._publish()

    def _aligned(self, r: Resident) -> tuple[tuple[int, int], ...]:
        """The alignment points of the turn that ran on ``r``, in characters
        of its prompt: those of the state the prompt continued, where the
        prompt's new suffix began, and the prompt's end."""
        if not r.prompt_text:
            return ()
        points = list(r.prompt_aligned)
        if r.prompt_keep:
            tail = self.ops.detokenize(r.prompt[r.prompt_keep:])
            if r.prompt_text.endswith(tail):
                points.append((r.prompt_keep, len(r.prompt_text) - len(tail)))
        points.append((len(r.prompt), len(r.prompt_text)))
        # Strictly increasing; the latest few are the ones a branch resumes from.
        out: list[tuple[int, int]] = []
        for t, c in points:
            if not out or (t > out[-1][0] and c > out[-1][1]):
                out.append((t, c))
        return tuple(out[-MAX_ALIGNED:])

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

    def hold(self, seq: int) -> None:
        """A warm-up found its whole prompt in ``seq`` and ran nothing: the
        sequence becomes the most recently used, the last that a request
        continuing nothing takes, until the turn the warm-up announced."""
        self.residents[seq].last_used = time.monotonic()
        self._publish()

    def release(self, seq: int) -> None:
        """``seq`` holds exactly its state's tokens now: idle, reusable."""
        r = self.residents[seq]
        r.busy = False
        r.prompt, r.prompt_text, r.prompt_keep, r.prompt_aligned = [], "", 0, ()
        r.last_used = time.monotonic()
        self._publish()

    def discard(self, seq: int) -> None:
        """Forget what ``seq`` holds (its generation failed)."""
        r = self.residents[seq]
        self.ops.trim(seq, 0)
        r.tokens, r.state, r.busy, r.saved, r.prompt, r.pin = [], None, False, False, [], None
        r.prompt_text, r.prompt_keep, r.prompt_aligned = "", 0, ()
        self._publish()

    def _evict(self, r: Resident, boundary: str | None = None) -> None:
        """``r``'s state leaves its sequence: kept in RAM (captured once).
        With ``boundary`` the sequence goes on: the state is a checkpoint."""
        state = r.state
        if state is not None and not r.saved and self.enabled:
            state.kv = self.ops.capture(r.seq)
            state.floor = self.ops.floor(r.seq, len(state.tokens))
            if boundary is not None:
                state.boundary = boundary
                self.stats.checkpoints += 1
            else:
                self.stats.evictions += 1
            self._remember_in_ram(state, displaced=boundary is None)
            r.saved = True
        r.state = None

    def checkpoint(self, seq: int, owner: str, boundary: str, *, at: int | None = None,
                   generated: str | None = None) -> None:
        """An exact-state checkpoint of what ``seq`` holds now (the end of a
        prompt, a breakpoint, the end of reasoning), for a model whose KV
        cannot be trimmed: a later request that diverges after this point
        resumes from here. ``generated``: past the end of the prompt, the
        sampled text the KV holds (the reasoning), which a replay that
        renders it (sealed reasoning) has right after the prompt's text;
        ``at``: how many tokens the KV must hold for that to be true."""
        if self.trimmable or not self.enabled:
            return
        r = self.residents[seq]
        tokens = list(r.tokens)
        if not tokens or (at is not None and len(tokens) != at):
            return
        if generated is None:
            visible = self._visible_at(r)
        else:
            visible = r.prompt_text + generated if r.prompt_text and len(tokens) >= len(r.prompt) else None
        state = SessionState(tokens=tokens, kv_text=self.ops.detokenize(tokens), visible=visible,
                             kv=self.ops.capture(seq), owner=owner, floor=self.ops.floor(seq, len(tokens)),
                             boundary=boundary)
        if state.key in self._ram:
            return
        self.stats.checkpoints += 1
        self._remember_in_ram(state)
        self._publish()

    def _visible_at(self, r: Resident) -> str | None:
        """The request text ``r``'s KV covers now, mid-prefill: what a later
        request that shares it starts with. A prefill that continues a
        sampled turn holds the model's own tokens (and spelling) of it, which
        neither the prompt's tokens nor its text match; only this transcript
        lets a later request find a checkpoint taken after such a turn."""
        n = len(r.tokens)
        if not r.prompt_text or not r.prompt_keep <= n <= len(r.prompt):
            return None
        suffix = r.prompt[r.prompt_keep:]
        tail = self.ops.detokenize(suffix)
        if not r.prompt_text.endswith(tail):
            return None
        visible = r.prompt_text[:len(r.prompt_text) - len(tail)] + self.ops.detokenize(suffix[:n - r.prompt_keep])
        return visible if r.prompt_text.startswith(visible) else None

    def breakpoints_ahead(self, req: CacheRequest, seq: int) -> list[int]:
        """The breakpoints of ``req`` its prefill on ``seq`` has yet to reach
        and that no remembered state already ends at: the positions the
        scheduler stops the prefill at for a ``checkpoint``."""
        if self.trimmable or not self.enabled or not req.breakpoints:
            return []
        done = len(self.residents[seq].tokens)
        ends = {len(s.tokens) for s in self._ram.values() if s.owner == req.owner}
        return [p for p in req.breakpoints
                if done < p < len(req.tokens) and not (p in ends and self._remembers(req.tokens[:p], req.owner))]

    def _remembers(self, tokens: list[int], owner: str) -> bool:
        key = SessionState(tokens=tokens, kv_text="", owner=owner).key
        return key in self._ram

    def checkpoint_prefix(self, seq: int, owner: str) -> None:
        """A mid-prefill checkpoint, so that a crash loses little of a long prompt."""
        if self.disk is None or not self.enabled:
            return
        tokens = list(self.residents[seq].tokens)
        state = SessionState(tokens=tokens, kv_text=self.ops.detokenize(tokens), kv=self.ops.capture(seq),
                             owner=owner, floor=self.ops.floor(seq, len(tokens)))
        self._checkpoint(state)

    def save_all(self) -> None:
        """At shutdown: every remembered state goes to disk, synchronously."""
        if self.disk is None or not self.enabled:
            return
        states = list(self._ram.values())
        for r in self.residents:
            if r.state is not None and not r.busy:
                if r.state.kv is None or not r.saved:
                    r.state.kv = self.ops.capture(r.seq)
                    r.state.floor = self.ops.floor(r.seq, len(r.state.tokens))
                states.append(r.state)
        for state in states:
            self._save(state)

    def flush(self) -> None:
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join(timeout=30)
            self._writer = None

    def sequences(self) -> list[dict[str, object]]:
        """Per-sequence occupancy for ``/health`` (read racily: numbers only)."""
        now = time.monotonic()
        return [{"id": r.seq, "owner": r.owner, "tokens": len(r.tokens), "busy": r.busy,
                 "idle_s": round(now - r.last_used, 1) if r.last_used else None,
                 "agent": _tag(r.agent) if r.agent else None,
                 "parent_agent": _tag(r.parent_agent) if r.parent_agent else None}
                for r in self.residents]

    def _remember_in_ram(self, state: SessionState, displaced: bool = False) -> None:
        """Keep ``state`` in RAM, the least recently kept leaving for disk
        when over budget. ``displaced``: another request took its sequence."""
        self._ram[state.key] = state
        self._ram.move_to_end(state.key)
        total = sum(s.nbytes for s in self._ram.values())
        while total > self.ram_budget_bytes and self._ram:
            _, old = self._ram.popitem(last=False)
            total -= old.nbytes
            if self.disk is not None:
                self._checkpoint(old)  # leaving RAM: the disk keeps it
            else:
                # Never held at all (the budget is smaller than it), it was
                # lost when the other request took its sequence.
                by = "another_session" if old is state and displaced else "ram_budget"
                self.evictions.record(old.tokens, old.owner, by)
        self.stats.ram_sessions = len(self._ram)
        self.stats.ram_bytes = total

    def _checkpoint(self, state: SessionState) -> None:
        if self.disk is None:
            return
        try:
            self._writes.put_nowait(state)
        except queue.Full:
            self._save(state)  # back-pressure: never drop a checkpoint silently

    def _write_loop(self) -> None:
        while True:
            state = self._writes.get()
            if state is None:
                return
            self._save(state)

    def _save(self, state: SessionState) -> None:
        assert self.disk is not None
        try:
            if self.disk.save(state) is not None:
                self.stats.disk_writes += 1
            self.stats.disk_checkpoints = len(self.disk)
        except Exception as exc:  # a failed checkpoint must never fail a generation
            log.warning("could not write KV checkpoint: %s", exc)


def _still_aligned(base: SessionState | None, text: str, keep: int) -> tuple[tuple[int, int], ...]:
    """The alignment points of ``base`` that hold for a prompt ``text`` which
    keeps ``keep`` of its tokens: inside both the kept tokens and the text
    the two share."""
    if base is None or not base.aligned:
        return ()
    shared = common_prefix(text, base.aligned_text)
    return tuple((t, c) for t, c in base.aligned if t <= keep and c <= shared)


def _tag(agent: str | None) -> str:
    """A short, stable name for an agent id in logs and views (its first
    8 characters: client ids are UUIDs or thread ids, never secrets)."""
    return (agent or "-")[:8]
