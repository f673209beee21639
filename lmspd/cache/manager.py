"""The continuation cache: which KV state a request continues from.

A request is matched in this order, the first rule that applies winning:

1. ``previous_response_id`` names the live state, a RAM session or a disk
   checkpoint: continue from it (``response-id``);
2. the first new item is a tool output for call ids the live state produced:
   append only the rendered tool-result suffix (``tool-output-ids``);
3. the rendered visible transcript extends the live state's visible
   transcript: append only the new suffix, hidden tokens stay in the KV
   (``visible-prefix``);
4. the prompt tokens start with all of the live tokens (``memory-token``);
5. the rendered text starts with the live tokens' text, the suffix
   tokenized on its own so BPE boundaries can't break the match
   (``memory-text``);
then the other sessions kept in RAM (``ram``), the longest disk checkpoint
(``disk``) or the longest common token prefix with the live KV, whichever
reuses the most; and finally a cold prefill (``cold``).

Everything here runs on the engine's generation thread, which alone touches
the KV; ``prepare`` on the event loop only reads the immutable states.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from lmspd.core.conversation import Item, ToolOutput

from .disk import DiskCheckpoints
from .state import SessionState, common_prefix

log = logging.getLogger("lmspd.cache")


@dataclass
class CachePlan:
    source: str
    keep: int
    suffix: list[int]
    # Text of the kept tokens + suffix, i.e. the prompt the model will have seen.
    base_text: str
    restore: SessionState | None = None
    detail: str = ""
    replaced_live: bool = False


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
    # (live, RAM, disk by visible transcript) may explain it.
    needs_reasoning_state: bool = False
    # Only states this owner's requests left are candidates.
    owner: str = "local"


class CacheRefused(Exception):
    """The request needed a state that is gone: the client must replay."""


@dataclass
class KvOps:
    """The engine operations the cache needs (the engine stays the KV's owner)."""

    live_tokens: Callable[[], list[int]]
    capture: Callable[[], bytes]
    restore: Callable[[SessionState], bool]
    tokenize: Callable[[str], list[int]]
    detokenize: Callable[[list[int]], str]
    n_ctx: int


@dataclass
class CacheStats:
    ram_sessions: int = 0
    ram_bytes: int = 0
    disk_checkpoints: int = 0
    disk_writes: int = 0
    disk_restores: int = 0
    ram_restores: int = 0


class ContinuationCache:
    def __init__(
        self,
        ops: KvOps,
        *,
        enabled: bool = True,
        ram_budget_bytes: int = 1 << 30,
        disk: DiskCheckpoints | None = None,
    ) -> None:
        self.ops = ops
        self.enabled = enabled
        self.ram_budget_bytes = ram_budget_bytes
        self.disk = disk
        self.live: SessionState | None = None
        self._live_saved = False
        # The owner of the request being run (for its mid-prefill checkpoints).
        self._owner: str | None = None
        self._ram: OrderedDict[str, SessionState] = OrderedDict()
        self.stats = CacheStats()
        self._writes: queue.Queue[SessionState | None] = queue.Queue(maxsize=4)
        self._writer: threading.Thread | None = None
        if disk is not None:
            self._writer = threading.Thread(target=self._write_loop, name="lmspd-kv-writer", daemon=True)
            self._writer.start()

    # -- read-only views (safe from the event loop) ----------------------------

    def states(self, owner: str) -> list[SessionState]:
        live = self.live
        every = ([live] if live else []) + list(reversed(self._ram.values()))
        return [s for s in every if s.owner == owner]

    def state_for_calls(self, call_ids: set[str], owner: str) -> SessionState | None:
        """A remembered state of ``owner`` whose last turn produced all of ``call_ids``."""
        for state in self.states(owner):
            if call_ids and call_ids <= state.call_ids:
                return state
        return None

    # -- matching ----------------------------------------------------------------

    def plan(self, req: CacheRequest) -> CachePlan:
        plan = self._plan(req)
        if req.needs_reasoning_state and (plan.source == "cold" or plan.detail in ("partial", "text")):
            raise CacheRefused(
                "This replay is missing reasoning state: a tool-call turn of this reasoning model comes without "
                "its reasoning item, and no live or saved state holds it. Replay the reasoning items (request "
                "include: [\"reasoning.encrypted_content\"] to get them) or continue the session it came from."
            )
        return plan

    def _plan(self, req: CacheRequest) -> CachePlan:
        self._owner = req.owner
        if not self.enabled or not req.reuse:
            return self._cold(req)
        live = self.live if self.live is not None and self.live.owner == req.owner else None
        if req.requires_state is not None and (live is None or live.key != req.requires_state):
            state = self._ram.get(req.requires_state)
            if state is None or state.owner != req.owner:
                raise CacheRefused(
                    "This request carries only tool outputs and requires live call state, which was replaced "
                    "before it ran; replay the full input."
                )
            return self._fits(req, self._continue(req, state, "tool-output-ids", restore=True))

        if req.previous_response_id:
            for state in self.states(req.owner):
                if state.response_id == req.previous_response_id and state.visible and req.text.startswith(state.visible):
                    return self._fits(req, self._continue(req, state, "response-id", restore=state is not live))
        if live is not None:
            if live.visible and req.text.startswith(live.visible):
                source = "tool-output-ids" if self._first_new_is_tool_output(req, live) else "visible-prefix"
                return self._fits(req, self._continue(req, live, source))
            n = len(live.tokens)
            if req.tokens[:n] == live.tokens and len(req.tokens) > n:
                return self._fits(req, CachePlan("memory-token", n, req.tokens[n:], req.text))
            if req.text.startswith(live.kv_text) and len(req.text) > len(live.kv_text):
                suffix_text = req.text[len(live.kv_text):]
                return self._fits(req, CachePlan("memory-text", n, self.ops.tokenize(suffix_text), req.text))

        candidates: list[CachePlan] = []
        for state in [s for s in self._ram.values() if s.owner == req.owner]:
            plan = self._match_saved(req, state, "ram")
            if plan is None:
                # A branch or an edit: the longest common token prefix still
                # saves that much prefill.
                common = min(common_prefix(state.tokens, req.tokens), len(req.tokens) - 1)
                if common > 0:
                    plan = CachePlan("ram", common, req.tokens[common:], req.text, restore=state, detail="partial")
            if plan is not None:
                candidates.append(plan)
        if self.disk is not None:
            hit = self.disk.best_match(req.text, req.owner, req.previous_response_id)
            if hit is not None:
                cp, kind = hit
                if not any(c.keep >= cp.n_tokens for c in candidates):
                    state = self.disk.load(cp)
                    if state is not None:
                        plan = self._match_saved(req, state, "disk")
                        if plan is not None:
                            plan.detail = f"key={kind}"
                            candidates.append(plan)
        live_common = 0
        if live is not None:
            live_common = min(common_prefix(live.tokens, req.tokens), len(req.tokens) - 1)
            if live_common > 0:
                candidates.append(CachePlan("memory-token", live_common, req.tokens[live_common:], req.text,
                                            detail="partial"))
        if self.disk is not None:
            best = max((c.keep for c in candidates), default=0)
            shared = self.disk.longest_common(req.tokens, req.owner)
            if shared is not None and min(shared[1], len(req.tokens) - 1) > best:
                state = self.disk.load(shared[0])
                if state is not None:
                    keep = min(shared[1], len(req.tokens) - 1)
                    candidates.append(CachePlan("disk", keep, req.tokens[keep:], req.text, restore=state,
                                                detail="partial"))
        for plan in sorted(candidates, key=lambda p: p.keep, reverse=True):
            fitted = self._fits(req, plan)
            if fitted.source != "cold":
                return fitted
        return self._cold(req)

    def _continue(self, req: CacheRequest, state: SessionState, source: str, restore: bool = False) -> CachePlan:
        assert state.visible is not None
        suffix_text = req.text[len(state.visible):]
        plan = CachePlan(source, len(state.tokens), self.ops.tokenize(suffix_text),
                         state.kv_text + suffix_text, restore=state if restore else None)
        if source == "tool-output-ids":
            plan.detail = f"ids={sum(isinstance(i, ToolOutput) for i in self._new_items(req, state))}"
        return plan

    def _match_saved(self, req: CacheRequest, state: SessionState, source: str) -> CachePlan | None:
        if state.visible and req.text.startswith(state.visible):
            plan = self._continue(req, state, source, restore=True)
            plan.detail = "visible"
            return plan
        if req.text.startswith(state.kv_text) and len(req.text) > len(state.kv_text):
            suffix = self.ops.tokenize(req.text[len(state.kv_text):])
            return CachePlan(source, len(state.tokens), suffix, req.text, restore=state, detail="text")
        return None

    def _first_new_is_tool_output(self, req: CacheRequest, state: SessionState) -> bool:
        new = self._new_items(req, state)
        return bool(new) and isinstance(new[0], ToolOutput) and new[0].call_id in state.call_ids

    @staticmethod
    def _new_items(req: CacheRequest, state: SessionState) -> list[Item]:
        return req.items[len(state.items):] if len(req.items) >= len(state.items) else []

    def _fits(self, req: CacheRequest, plan: CachePlan) -> CachePlan:
        if not plan.suffix:
            # Fresh logits need at least one evaluated token.
            if plan.keep == 0:
                return self._cold(req)
            base = plan.restore.tokens if plan.restore else self.ops.live_tokens()
            plan.keep -= 1
            plan.suffix = [base[plan.keep]]
        if plan.keep + len(plan.suffix) + req.max_new_tokens > self.ops.n_ctx:
            # Hidden tokens made the continuation longer than a cold prompt;
            # the cold prompt was already checked to fit.
            return self._cold(req)
        return plan

    def _cold(self, req: CacheRequest) -> CachePlan:
        return CachePlan("cold", 0, list(req.tokens), req.text)

    # -- state changes (generation thread) ---------------------------------------

    def before_apply(self, plan: CachePlan) -> None:
        """Keep the live state before a plan overwrites it (another session's turn)."""
        live = self.live
        if live is None:
            return
        continues_live = plan.restore is None and plan.keep >= len(live.tokens)
        if continues_live:
            return
        plan.replaced_live = True
        if not self._live_saved:
            live.kv = self.ops.capture()
            self._remember_in_ram(live)
            self._checkpoint(live)
            self._live_saved = True

    def restored(self, plan: CachePlan) -> None:
        if plan.source == "disk":
            self.stats.disk_restores += 1
        elif plan.restore is not None:
            self.stats.ram_restores += 1

    def set_live(self, state: SessionState) -> None:
        self.live = state
        self._live_saved = False

    def checkpoint_prefix(self, tokens: list[int], text: str) -> None:
        """A mid-prefill checkpoint, so that a crash loses little of a long prompt."""
        if self.disk is None:
            return
        state = SessionState(tokens=list(tokens), kv_text=text, kv=self.ops.capture(), owner=self._owner)
        self._checkpoint(state)

    def save_live(self) -> None:
        """At shutdown: the live state goes to disk, synchronously."""
        live = self.live
        if live is None or self.disk is None:
            return
        if live.kv is None or not self._live_saved:
            live.kv = self.ops.capture()
        self.disk.save(live)
        self.stats.disk_writes += 1

    def flush(self) -> None:
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join(timeout=30)
            self._writer = None

    def _remember_in_ram(self, state: SessionState) -> None:
        self._ram[state.key] = state
        self._ram.move_to_end(state.key)
        total = sum(s.nbytes for s in self._ram.values())
        while total > self.ram_budget_bytes and self._ram:
            _, old = self._ram.popitem(last=False)
            total -= old.nbytes
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
            self.disk.save(state)
            self.stats.disk_writes += 1
            self.stats.disk_checkpoints = len(self.disk)
        except Exception as exc:  # a failed checkpoint must never fail a generation
            log.warning("could not write KV checkpoint: %s", exc)
