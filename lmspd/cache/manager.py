"""The continuation cache: which sequence a request runs on and what of its
KV it keeps.

Three tiers, fastest first: the **resident sequences** of the engine's
context (their KV stays in place between turns), **sessions in RAM**
(captured KV bytes of sequences that had to make room) and **disk
checkpoints**. ``ContinuationCache`` is the one object the llama engine
talks to; it composes three parts with one job each:

- the **planner** (lmspd.cache.planner): given a request and what is
  resident or saved, where it resumes from (the plan, and why it reused no
  more: the diagnosis). It changes nothing;
- the **residency** (lmspd.cache.residency): which sequence holds which
  state; carries plans out, evicts, keeps exact-state checkpoints, keeps a
  running subagent's parent and an open connection's session resident;
- the **tiers** (lmspd.cache.tiers): the states in RAM, under a budget, and
  the disk checkpoints (lmspd.cache.disk) they spill to.

Everything that changes residency runs on the engine's scheduler thread,
which alone touches the KV; ``prepare`` (in the service's preparing
threads) only reads ``states``, an immutable snapshot the scheduler
replaces whole.
"""

from __future__ import annotations

from lmspd.cache.diagnostics import CacheReport
from lmspd.cache.disk import DiskCheckpoints
from lmspd.cache.planner import CachePlan, CacheRefused, CacheRequest, Planner
from lmspd.cache.residency import KvOps, Residency
from lmspd.cache.state import Resident, SessionState
from lmspd.cache.tiers import CacheStats, Tiers

# What the llama engine imports from here (the parts' own names stay theirs).
__all__ = ["CachePlan", "CacheRefused", "CacheRequest", "ContinuationCache", "KvOps"]


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
        self.disk = disk
        self.stats = CacheStats()
        self.tiers = Tiers(self.stats, budget_bytes=ram_budget_bytes, disk=disk)
        # What left every tier, and why (diagnostics: ``state_evicted``).
        self.evictions = self.tiers.evictions
        self.residency = Residency(ops, self.tiers, self.stats, n_seq=n_seq, enabled=enabled, trimmable=trimmable)
        self.residents = self.residency.residents
        self.planner = Planner(ops, self.residents, self.tiers.ram, disk=disk, copying=self.residency.copying,
                               enabled=enabled, trimmable=trimmable)
        self._snapshot: tuple[SessionState, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.planner.enabled

    @property
    def trimmable(self) -> bool:
        """False: keep exact-state checkpoints at turn boundaries."""
        return self.planner.trimmable

    @property
    def ram_budget_bytes(self) -> int:
        return self.tiers.budget_bytes

    @ram_budget_bytes.setter
    def ram_budget_bytes(self, value: int) -> None:
        self.tiers.budget_bytes = value

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
        read and its checksum. A guess from the snapshot
        (``Planner.likely_checkpoint``). ``plan`` takes the read from
        ``DiskCheckpoints.load``; a guess it does not use is dropped."""
        disk = self.disk
        if disk is None or not self.enabled or not req.reuse:
            return
        cp = self.planner.likely_checkpoint(req, self.states(req.owner))
        if cp is not None:
            disk.prefetch(cp)

    def _publish(self) -> None:
        self._snapshot = tuple(self.residency.by_recency() + self.tiers.ram.newest_first())

    # -- planning (scheduler thread) --------------------------------------------

    def plan(self, req: CacheRequest, *, contending: int = 0) -> CachePlan | None:
        """``Planner.plan``, offered the sequence the residency would evict
        for a request that continues nothing. ``contending``: how many
        requests behind this one wait for a sequence in the same admission
        pass (the scheduler's ``_admit``): when sequences are that scarce, a
        shared prefix is kept in place rather than copied
        (``Planner._shared_candidates``)."""
        return self.planner.plan(req, self.residency.target(req), contending=contending)

    def diagnose(self, req: CacheRequest, plan: CachePlan) -> CacheReport:
        return self.planner.diagnose(req, plan, self.evictions)

    def breakpoints_ahead(self, req: CacheRequest, seq: int) -> list[int]:
        return self.planner.breakpoints_ahead(req, seq)

    # -- residency changes (scheduler thread) ----------------------------------

    def apply(self, plan: CachePlan, req: CacheRequest) -> CachePlan:
        plan = self.residency.apply(plan, req)
        self._publish()
        return plan

    def decoded(self) -> None:
        self.residency.decoded()

    def unsettled_copies(self) -> list[Resident]:
        return self.residency.unsettled_copies()

    def capture_ahead_due(self) -> bool:
        """A sequence the next new prompt would take holds a state not kept
        yet (``Residency.ahead``): the idle scheduler captures it now."""
        return self.residency.ahead() is not None

    def capture_ahead(self) -> None:
        """Capture that state into RAM while nothing runs, so that placing a
        new prompt there only clears the sequence (one capture a call)."""
        if self.residency.capture_ahead():
            self._publish()

    def finished(self, seq: int, state: SessionState) -> None:
        """The turn on ``seq`` is over; its state is set before the client
        gets the terminal event (its next request may look up its calls)."""
        self.residency.finished(seq, state)
        self._publish()

    def hold(self, seq: int) -> None:
        """A warm-up found its whole prompt in ``seq`` and ran nothing: the
        sequence becomes the most recently used, the last that a request
        continuing nothing takes, until the turn the warm-up announced."""
        self.residency.hold(seq)
        self._publish()

    def release(self, seq: int) -> None:
        self.residency.release(seq)
        self._publish()

    def discard(self, seq: int) -> None:
        self.residency.discard(seq)
        self._publish()

    def checkpoint(self, seq: int, owner: str, boundary: str, *, at: int | None = None,
                   generated: str | None = None) -> None:
        """An exact-state checkpoint of what ``seq`` holds now (the end of a
        prompt, a breakpoint, the end of reasoning), for a model whose KV
        cannot be trimmed: a later request that diverges after this point
        resumes from here. ``generated``: past the end of the prompt, the
        sampled text the KV holds (the reasoning), which a replay that
        renders it (sealed reasoning) has right after the prompt's text;
        ``at``: how many tokens the KV must hold for that to be true."""
        if self.residency.checkpoint(seq, owner, boundary, at=at, generated=generated):
            self._publish()

    def checkpoint_prefix(self, seq: int, owner: str) -> None:
        """A mid-prefill checkpoint, so that a crash loses little of a long prompt."""
        if self.disk is None or not self.enabled:
            return
        self.tiers.write_behind(self.residency.prefix_state(seq, owner))

    def save_all(self) -> None:
        """At shutdown: every remembered state goes to disk, synchronously."""
        if self.disk is None or not self.enabled:
            return
        self.tiers.save_all(self.residency.idle_states())

    def flush(self) -> None:
        self.tiers.flush()

    def sequences(self) -> list[dict[str, object]]:
        return self.residency.sequences()
