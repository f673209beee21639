"""The continuation cache's residency: which sequence of the engine's
context holds which state, and what becomes of the state a sequence gives up.

It carries out the planner's plans (lmspd.cache.planner): copies a prefix
between sequences, restores a saved state, trims what a request does not
keep, and marks the sequence busy until its turn is over. A state that
leaves its sequence is captured once and kept in the saved tiers
(lmspd.cache.tiers).

A request that is no continuation goes to a free sequence, else to the
least recently used idle one, whose state moves to RAM first; the
sequences of open connections are taken last (the least recently used
connection first), so a connection's session stays resident while other
traffic comes and goes, and so is the sequence of a running subagent's
parent (a child never evicts its parent). A running sequence is never
evicted, nor one a stream copy reads or writes before the next decode
performs it. While nothing runs or waits, the state of the sequence a new
request would take is **captured ahead** into RAM (``capture_ahead``):
placing the request there then only clears the sequence, unless the
sequence changed since (then it is captured as before).

On a model whose KV cannot be trimmed exactly (sliding-window layers that
keep only their last window, recurrent layers), it keeps **exact-state
checkpoints** at the end of every prompt (``input``), at client-declared
and implicit breakpoints (``breakpoint``), at the end of a generation's
reasoning section (``reasoning``: a sealed replay that keeps the reasoning
but edits what followed it; only when the response carries its reasoning
sealed, the one form a replay renders) and at the end of every turn that a
later turn extends (``response``). Checkpoints are RAM states like the
others: same budget, spilled to disk.

It also keeps each turn's *alignment points* (``SessionState.aligned``),
through which the planner resumes a branch of a finished turn.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Callable

from .planner import CachePlan, CacheRequest, agent_tag, cold, running_parents
from .state import Resident, SessionState, common_prefix, state_key
from .tiers import CacheStats, Tiers

# Alignment points a state keeps (two a turn): a branch resumes from one of
# the last few turns.
MAX_ALIGNED = 64
# The largest state ``capture_ahead`` takes. A request that arrives during a
# capture ahead waits for it, and the guess may be wrong (the sequence's own
# session comes back and continues it in place): a few ms of copying is
# worth it for a short request's first token; a long agent context's
# hundreds of MB (a 20k-token context of an 8B model is ~2.6 GB) are
# captured on placement, if that placement ever comes.
AHEAD_MAX_BYTES = 64 << 20


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


class Residency:
    """The sequences of the context (``residents``, by id) and every change
    to what they hold; only the scheduler thread calls it."""

    def __init__(self, ops: KvOps, tiers: Tiers, stats: CacheStats, *, n_seq: int = 1, enabled: bool = True,
                 trimmable: bool = True) -> None:
        self.ops = ops
        self.tiers = tiers
        self.stats = stats
        self.enabled = enabled
        # False: keep exact-state checkpoints at turn boundaries.
        self.trimmable = trimmable
        self.residents = [Resident(seq) for seq in range(max(1, n_seq))]
        # Sequences a stream copy reads or writes before the next decode
        # performs it: nothing may overwrite them until then.
        self.copying: set[int] = set()
        self._copied_into: set[int] = set()
        # The state ``capture_ahead`` last looked at (kept or not: once),
        # weakly: its bytes are not held for it once nothing else holds them.
        self._looked_at: weakref.ref[SessionState] | None = None
        # KV bytes per token, from the last capture (None: none yet): what a
        # capture ahead would copy, known before copying it.
        self._bytes_per_token: float | None = None

    def by_recency(self) -> list[SessionState]:
        """The states the sequences hold, the most recently used first."""
        return [r.state for r in sorted(self.residents, key=lambda r: -r.last_used) if r.state is not None]

    def target(self, req: CacheRequest | None) -> Resident | None:
        """Where a request that continues no resident state goes: an empty
        sequence, else the least recently used idle one that no open
        connection holds and that is no running subagent's parent (nor this
        request's: a child never evicts its parent), else the least recently
        used connection's, else a parent's. ``req`` None: a request of no
        subagent (where the next new prompt lands)."""
        usable = [r for r in self.residents if not r.busy and r.seq not in self.copying]
        for r in usable:
            if not r.tokens and r.state is None:
                return r
        parents = running_parents(self.residents, req)
        owner = req.owner if req is not None else None
        return min(usable, key=lambda r: (r.agent is not None and r.agent in parents and r.owner == owner,
                                          r.pinned, r.last_used), default=None)

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
            self.evict(r)
            self.ops.copy(src.seq, r.seq, plan.keep)
            self.copying.update((src.seq, r.seq))
            self._copied_into.add(r.seq)
            r.tokens = src.tokens[: plan.keep]
            self.stats.copies += 1
            self.stats.copied_tokens += plan.keep
        elif plan.restore is not None:
            self.evict(r)
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
                # A state without its bytes never reached ops.restore, which
                # clears the sequence: clear it here, or the cold prefill
                # would land on what the sequence held before.
                self.ops.trim(r.seq, 0)
                r.tokens = []
                plan = cold(req, r.seq, detail="restore failed")
        elif plan.keep == 0:
            self.evict(r)
            self.ops.trim(r.seq, 0)
            r.tokens = []
        else:
            # Continues what this sequence holds, all of it or a prefix: a
            # state cut short is kept in RAM first.
            if r.state is not None and plan.keep < len(r.state.tokens):
                self.evict(r)
            elif r.state is not None and not self.trimmable:
                # The end of the turn this one extends: the state a branch or
                # an edit of the next turn resumes from.
                self.evict(r, boundary="response")
            elif r.state is not None and r.saved:
                # Kept ahead (``capture_ahead``) for a new prompt that went
                # elsewhere: the sequence goes on holding all of it, and a
                # copy in RAM would only take budget from evicted states.
                self.tiers.forget(r.state)
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
        return plan

    def decoded(self) -> None:
        """The step's ``llama_decode`` ran: pending stream copies are done."""
        self.copying.clear()
        self._copied_into.clear()

    def unsettled_copies(self) -> list[Resident]:
        """Sequences a copy went into that no decode has performed yet."""
        return [self.residents[seq] for seq in sorted(self._copied_into)]

    def finished(self, seq: int, state: SessionState) -> None:
        """The turn on ``seq`` is over: it holds ``state``."""
        r = self.residents[seq]
        state.aligned, state.aligned_text = self._aligned(r), r.prompt_text
        r.state = state
        r.saved = False

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

    def hold(self, seq: int) -> None:
        """``seq`` becomes the most recently used."""
        self.residents[seq].last_used = time.monotonic()

    def release(self, seq: int) -> None:
        """``seq`` holds exactly its state's tokens now: idle, reusable."""
        r = self.residents[seq]
        r.busy = False
        r.prompt, r.prompt_text, r.prompt_keep, r.prompt_aligned = [], "", 0, ()
        r.last_used = time.monotonic()

    def discard(self, seq: int) -> None:
        """Forget what ``seq`` holds (its generation failed)."""
        r = self.residents[seq]
        self.ops.trim(seq, 0)
        r.tokens, r.state, r.busy, r.saved, r.prompt, r.pin = [], None, False, False, [], None
        r.prompt_text, r.prompt_keep, r.prompt_aligned = "", 0, ()
        # An empty sequence runs no agent: the engine view must not say it does.
        r.agent = r.parent_agent = None

    def evict(self, r: Resident, boundary: str | None = None) -> None:
        """``r``'s state leaves its sequence: kept in RAM (captured once; not
        again when ``capture_ahead`` kept it already and the sequence still
        holds exactly it). With ``boundary`` the sequence goes on: the state
        is a checkpoint."""
        state = r.state
        if state is not None and self.enabled:
            if not self._kept(r):
                self._capture(r.seq, state)
            if boundary is not None:
                state.boundary = boundary
                self.stats.checkpoints += 1
            else:
                self.stats.evictions += 1
            self.tiers.remember(state, displaced=boundary is None)
            r.saved = True
        r.state = None

    # -- capture ahead (scheduler thread, idle) -----------------------------------

    def ahead(self) -> Resident | None:
        """The sequence whose state to capture now, while nothing runs, so
        that placing a new prompt on it later only clears it: the one the
        next new prompt takes (``target``), holding a finished turn that is
        not kept yet, and not looked at before. Not an open connection's
        (all sequences are, then: each most likely continues), nor the most
        recently used sequence (with one sequence, or only one idle, the
        next turn most likely continues it in place), nor a state larger
        than ``AHEAD_MAX_BYTES`` (at the last capture's bytes per token)."""
        if not self.enabled:
            return None
        r = self.target(None)
        if r is None or r.state is None or r.saved or r.pinned or (
                self._looked_at is not None and self._looked_at() is r.state):
            return None
        if all(o is r or o.last_used < r.last_used for o in self.residents):
            return None
        if self._bytes_per_token is not None and self._bytes_per_token * len(r.tokens) > AHEAD_MAX_BYTES:
            return None
        return r

    def capture_ahead(self) -> bool:
        """Capture ``ahead``'s state into RAM now, as placement would (same
        budget: the least recently kept states leave for disk). Without a
        disk tier only into room the budget has left: a state pushed out
        then would be lost, for a sequence that may never be taken. At most
        one capture a call; True when a state was kept."""
        r = self.ahead()
        if r is None:
            return False
        state = r.state
        assert state is not None
        self._looked_at = weakref.ref(state)
        if r.tokens != state.tokens or state.key in self.tiers.ram:
            return False  # not exactly what the KV holds, or kept already: placement decides
        floor = state.floor
        self._capture(r.seq, state)
        if not self.tiers.room_for(state.nbytes):
            state.kv, state.floor = None, floor
            return False
        self.tiers.remember(state)
        r.saved = True
        self.stats.captures_ahead += 1
        return True

    def _kept(self, r: Resident) -> bool:
        """``r``'s state was kept ahead and is still in RAM, its bytes those
        of exactly the tokens the sequence holds (``saved`` is cleared by
        every change to the sequence; the tokens are checked all the same:
        a stale state must never be restored)."""
        state = r.state
        return (r.saved and state is not None and state.kv is not None and r.tokens == state.tokens
                and self.tiers.ram.get(state.key) is state)

    def _capture(self, seq: int, state: SessionState) -> None:
        """``state``'s KV bytes, from ``seq`` which holds all of it."""
        state.kv = self.ops.capture(seq)
        state.floor = self.ops.floor(seq, len(state.tokens))
        self._learn_size(state.kv, len(state.tokens))

    def _learn_size(self, kv: bytes | bytearray | None, n_tokens: int) -> None:
        if kv and n_tokens:
            self._bytes_per_token = len(kv) / n_tokens

    def _captured(self, seq: int, owner: str, visible: str | None = None,
                  boundary: str | None = None) -> SessionState:
        """A new state of what ``seq`` holds now, its KV captured."""
        tokens = list(self.residents[seq].tokens)
        kv = self.ops.capture(seq)
        self._learn_size(kv, len(tokens))
        return SessionState(tokens=tokens, kv_text=self.ops.detokenize(tokens), visible=visible,
                            kv=kv, owner=owner, floor=self.ops.floor(seq, len(tokens)), boundary=boundary)

    # -- exact-state checkpoints (scheduler thread) --------------------------------

    def checkpoint(self, seq: int, owner: str, boundary: str, *, at: int | None = None,
                   generated: str | None = None) -> bool:
        """An exact-state checkpoint of what ``seq`` holds now, kept in RAM
        for a model whose KV cannot be trimmed (see ``ContinuationCache.checkpoint``).
        True when a new state was kept."""
        if self.trimmable or not self.enabled:
            return False
        r = self.residents[seq]
        if not r.tokens or (at is not None and len(r.tokens) != at):
            return False
        if state_key(owner, r.tokens) in self.tiers.ram:
            return False  # kept already: not worth a copy of the sequence's KV to find out
        if generated is None:
            visible = self._visible_at(r)
        else:
            visible = r.prompt_text + generated if r.prompt_text and len(r.tokens) >= len(r.prompt) else None
        state = self._captured(seq, owner, visible=visible, boundary=boundary)
        self.stats.checkpoints += 1
        self.tiers.remember(state)
        return True

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

    def prefix_state(self, seq: int, owner: str) -> SessionState:
        """What ``seq`` holds mid-prefill, captured (a crash-safety checkpoint)."""
        return self._captured(seq, owner)

    def idle_states(self) -> list[SessionState]:
        """The states of the idle sequences, each with its KV captured (at
        shutdown: what the disk keeps of them)."""
        states = []
        for r in self.residents:
            if r.state is not None and not r.busy:
                if self._kept(r):
                    continue  # the RAM tier's own, saved with it
                self._capture(r.seq, r.state)
                states.append(r.state)
        return states

    def sequences(self) -> list[dict[str, object]]:
        """Per-sequence occupancy for ``/health`` (read racily: numbers only)."""
        now = time.monotonic()
        return [{"id": r.seq, "owner": r.owner, "tokens": len(r.tokens), "busy": r.busy,
                 "idle_s": round(now - r.last_used, 1) if r.last_used else None,
                 "agent": agent_tag(r.agent) if r.agent else None,
                 "parent_agent": agent_tag(r.parent_agent) if r.parent_agent else None}
                for r in self.residents]


def _still_aligned(base: SessionState | None, text: str, keep: int) -> tuple[tuple[int, int], ...]:
    """The alignment points of ``base`` that hold for a prompt ``text`` which
    keeps ``keep`` of its tokens: inside both the kept tokens and the text
    the two share."""
    if base is None or not base.aligned:
        return ()
    shared = common_prefix(text, base.aligned_text)
    return tuple((t, c) for t, c in base.aligned if t <= keep and c <= shared)
