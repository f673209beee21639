"""Continuous batching: one thread owns the llama.cpp context.

Each step builds one ``llama_batch`` with the next token of every decoding
sequence plus a chunk of pending prefill (capped while others decode, so a
long prompt does not stall their streams), runs one ``llama_decode``, then
samples every sequence whose logits are ready with its own sampler and
hands the token to its own ``Generation`` (stop matcher, reasoning splitter,
tool-call parser, events). A sequence that finishes or is cancelled is
released within one step: its last token is evaluated in the next batch
(for the next turn's cache) and the sequence is idle after it.

New requests wait in a FIFO inbox; between steps the cache places each on a
sequence (``ContinuationCache.plan``/``apply``).

What a step costs the host (``stepcost.HostCost``, bench/stepcost.py) is
kept proportional to its sequences, with small constants: the batch
(allocated once) is filled with one array copy per field, the greedy rows
are read in one pass, and the events go to the event loop once, just before
the decode releases the GIL (``Outbox``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import llama_cpp
import numpy as np
from llama_cpp._internals import LlamaContext, LlamaSampler

from lmspd.cache.manager import CachePlan, CacheRefused, CacheRequest
from lmspd.cache.state import SessionState
from lmspd.core.events import EngineEvent, Failed, Finished, Usage
from lmspd.engines.base import CancelToken

from .generation import Generation
from .handover import Outbox
from .preparation import LlamaPrepared
from .runtime import LlamaRuntime
from .sampling import GrammarFirstRejection, Greedy, greedy_tokens
from .speculation import DecodeStats, Draft, Planner, SequenceSpeculation
from .stepcost import DecodeCost, HostCost

log = logging.getLogger("lmspd.engine")

_NO_TOPS: dict[int, int] = {}  # never written


@dataclass
class Job:
    """A request handed to the scheduler."""

    prepared: LlamaPrepared
    cancel: CancelToken
    emit: Callable[[EngineEvent], None]
    response_id: str | None
    request: CacheRequest
    submitted: float = field(default_factory=time.perf_counter)


class Running:
    """A job placed on a sequence: prefilling, then decoding, then its last token."""

    def __init__(self, job: Job, plan: CachePlan, tokens: list[int], gen: Generation) -> None:
        self.job = job
        self.plan = plan
        self.seq = plan.seq
        # The sequence's evaluated tokens (shared with its cache Resident).
        self.tokens = tokens
        self.pending: list[int] = list(plan.suffix)
        self.prefilling = True
        self.gen = gen
        self.since_checkpoint = 0
        # Prefill positions to stop at for a breakpoint checkpoint (ascending).
        self.breaks: list[int] = []
        self.started = time.perf_counter()
        self.decoding_since = 0.0  # (set when the prefill ends)
        # Greedy sampling (with or without a grammar): its first pick is the
        # row's highest logit, which the step reads for all such rows at once.
        sampler = gen.sampler
        self.greedy = isinstance(sampler, Greedy) or (isinstance(sampler, GrammarFirstRejection) and sampler.greedy)
        # Speculation (None: this sequence never drafts) and this step's draft.
        self.spec: SequenceSpeculation | None = None
        self.draft: Draft | None = None


class Batch:
    """A ``llama_batch`` of one sequence id per token, with numpy views of
    its fields, so that a step fills it with array copies. ``llama_batch_init``
    gives each token a ``seq_id`` array of its own (one int, allocated
    apart): writing them took a Python loop over the tokens. Pointed at one
    contiguous array of ours instead, every token's sequence is one copy;
    the original pointers go back before ``llama_batch_free`` frees them."""

    def __init__(self, n: int) -> None:
        batch = llama_cpp.llama_batch_init(n, 0, 1)
        self.batch = batch
        self.tok = np.ctypeslib.as_array(batch.token, shape=(n,))
        self.pos = np.ctypeslib.as_array(batch.pos, shape=(n,))
        self.logits = np.ctypeslib.as_array(batch.logits, shape=(n,))
        np.ctypeslib.as_array(batch.n_seq_id, shape=(n,))[:] = 1
        self.seq = np.zeros(n, dtype=np.int32)
        self._seq_ptrs = np.ctypeslib.as_array(ctypes.cast(batch.seq_id, ctypes.POINTER(ctypes.c_size_t)), shape=(n,))
        self._allocated = self._seq_ptrs.copy()
        self._seq_ptrs[:] = self.seq.ctypes.data + self.seq.itemsize * np.arange(n, dtype=self._seq_ptrs.dtype)

    def free(self) -> None:
        self._seq_ptrs[:] = self._allocated
        llama_cpp.llama_batch_free(self.batch)


class Scheduler:
    def __init__(self, runtime: LlamaRuntime, *, n_batch: int, prefill_chunk: int, checkpoint_every: int,
                 planner: Planner | None = None) -> None:
        self.runtime = runtime
        # Speculative decoding (lmspd.engines.llama.speculation); None: off.
        self.planner = planner
        # What steps cost: the host's share (outside llama_decode) and the decode's by batch size.
        self.host_cost = HostCost()
        self.decode_cost = DecodeCost()
        self.decode_stats = DecodeStats()
        self.cache = runtime.cache
        self._ctx = runtime.ctx
        self.n_batch = n_batch
        self.prefill_chunk = max(1, min(prefill_chunk, n_batch))
        self.checkpoint_every = checkpoint_every
        # How long an idle scheduler waits for requests arriving together
        # (``_gather``): up to ``gather_s`` past the last one submitted, at
        # most ``gather_max_s`` in all.
        self.gather_s = 0.03
        self.gather_max_s = 0.1
        self._batch = Batch(n_batch)
        self._tok, self._pos, self._seq, self._logits = (self._batch.tok, self._batch.pos, self._batch.seq,
                                                         self._batch.logits)
        self._offsets = np.arange(n_batch, dtype=np.int32)
        self._cond = threading.Condition()
        self._inbox: deque[Job] = deque()
        self._waiting: list[Job] = []
        self._running: list[Running] = []
        self._closing = False
        self.outbox = Outbox()
        # A prefill ended this step: its first token goes out at the step's end.
        self._first_token = False
        self._threads = runtime.threads
        self._thread = threading.Thread(target=self._loop, name="lmspd-llama-scheduler", daemon=True)
        self._thread.start()

    # -- other threads ------------------------------------------------------------

    def submit(self, job: Job) -> None:
        self.runtime.preparations.submitted(job.prepared)
        with self._cond:
            self._inbox.append(job)
            self._cond.notify()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        """Cancel what runs, write the shutdown checkpoints, stop (blocking)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        self._batch.free()

    @property
    def active(self) -> int:
        return len(self._running)

    def prefills(self) -> list[dict[str, object]]:
        """Running prefills, for the console's engine view: tokens done of
        the prompt suffix this sequence evaluates (read racily from another
        thread: a snapshot of numbers, never the tokens)."""
        now = time.perf_counter()
        out: list[dict[str, object]] = []
        for run in list(self._running):
            if not run.prefilling:
                continue
            total = len(run.plan.suffix)
            out.append({"seq": run.seq, "owner": run.job.request.owner, "done": total - len(run.pending),
                        "total": total, "reused": run.plan.keep,
                        "elapsed_ms": round((now - run.started) * 1000)})
        return out

    # -- the scheduler thread -------------------------------------------------------

    def _loop(self) -> None:
        stepped = False
        while True:
            with self._cond:
                # A request left waiting for a step (its sequence evaluating
                # the last token of the turn it continues) is placed as soon
                # as that step is done, not at the next poll.
                while not (self._inbox or self._running or self._closing or (stepped and self._waiting)
                           or (not self._waiting and self.cache.capture_ahead_due())):
                    self._cond.wait(0.5 if self._waiting else None)
                    if self._waiting and not self._inbox:
                        break
                if self._inbox and not self._running:
                    self._gather()
                self._waiting.extend(self._inbox)
                self._inbox.clear()
                closing = self._closing
            if closing:
                try:
                    self._shutdown()
                finally:
                    self.outbox.flush()
                return
            stepped = False
            decoded: tuple[float, int] | None = None
            try:
                if self._waiting:
                    # Placing a request may take a while (a KV copy or a
                    # restore): the last step's events go out before it.
                    self.outbox.flush()
                self._admit()
                began = time.perf_counter()
                self._reap()
                if self._running:
                    decoded = self._step()
                    stepped = True
                elif self.cache.unsettled_copies():
                    self._settle_copies()
                    stepped = True
                elif not self._waiting:
                    # Idle: the state the next new prompt would evict goes to
                    # RAM now, off that request's path; one capture a pass,
                    # so a request arriving meanwhile waits for one at most.
                    self.cache.capture_ahead()
            except Exception:  # never leave the thread dead with streams open
                log.exception("scheduler step failed")
                for run in list(self._running):
                    self._fail(run, "server_error", "Generation failed.")
            if decoded is None or not self._running or self._first_token:
                # No decode follows at once to hand them over (``_step``), or
                # a sequence's first token is among them: its client waits
                # for nothing else (the next step's planning, its n-gram
                # index over a long prompt included, can wait): out now,
                # and the loop takes the GIL at once to send it.
                first, self._first_token = self._first_token, False
                try:
                    self.outbox.flush(yield_gil=first)
                except Exception:  # the thread must outlive it, and no stream may go on with a gap
                    log.exception("handing events to the event loop failed")
                    self._fail_all()
            if decoded is not None:
                decode_s, sequences = decoded
                self.host_cost.observe(time.perf_counter() - began - decode_s, sequences)

    def _gather(self) -> None:
        """Requests that arrive together share their first step. Sessions
        whose turns end in the same step send their next turns together, and
        the preparing pool prepares them a couple at a time; started at the
        first, a prefill step would leave the rest waiting all of it. So,
        with nothing running, a request about to arrive
        (``Preparations.arriving``: admitted, being prepared, or prepared
        and on its way) is waited for: ``gather_s``, again from each one
        that is submitted meanwhile (sixteen released together reached the
        scheduler over 35 ms, one every 2-3 ms, behind the event loop and
        two preparing threads: a fixed 30 ms left the last few for the next
        step, 300-450 ms later), and never more than ``gather_max_s`` in
        all. A request that nothing is known to follow does not wait.
        Called holding ``_cond`` (``submit`` notifies it)."""
        preps = self.runtime.preparations
        began = time.monotonic()
        deadline = began + self.gather_s
        seen = len(self._inbox)
        while not self._closing and preps.arriving():
            now = time.monotonic()
            if len(self._inbox) > seen:
                seen = len(self._inbox)
                deadline = min(began + self.gather_max_s, now + self.gather_s)
            left = deadline - now
            if left <= 0:
                return
            # Polled too: a preparation's end does not notify.
            self._cond.wait(min(left, 0.002))

    def _admit(self) -> None:
        """Place waiting jobs, in arrival order, on the sequences the cache
        picks, telling it how many wait behind each (``contending``): a burst
        that would find too few sequences keeps shared prefixes in place
        rather than copy them (a copy holds two sequences until the next step)."""
        jobs = list(self._waiting)
        for i, job in enumerate(jobs):
            if job.cancel.cancelled:
                self._waiting.remove(job)
                job.emit(_cancelled_event(job.cancel, Usage()))
                continue
            try:
                plan = self.cache.plan(job.request, contending=len(jobs) - i - 1)
            except CacheRefused as exc:
                self._waiting.remove(job)
                job.emit(Failed("invalid_request", str(exc)))
                continue
            except Exception:
                # Left waiting, it would fail again every step and never end.
                log.exception("could not place a request")
                self._waiting.remove(job)
                job.emit(Failed("server_error", "Generation failed."))
                continue
            if plan is None:
                continue  # no sequence for it yet: asked again after the next step
            # Out of ``_waiting`` and not yet in ``_running``: from here a
            # fault is this job's alone to end (``_not_placed``); the loop's
            # handler knows nothing of it.
            self._waiting.remove(job)
            try:
                warm = self._already_warm(job, plan)
            except Exception as exc:
                self._not_placed(job, exc)
                continue
            if not warm:
                self._start(job, plan)

    def _already_warm(self, job: Job, plan: CachePlan) -> bool:
        """A warm-up (``generate: false``) whose prompt the cache already
        holds (a sequence, a state in RAM or on disk) ends at once, the KV
        left as it is. Running it would copy or restore that prefix into a
        sequence of its own (or cut the holder back to it), and the turn
        after it would continue that sequence in place and prefill what
        another one had beyond it: Codex warms up with its instructions
        while the last session's whole prompt sits in another sequence.
        Unnamed by any remembered state, the next turn is matched by its
        prefix, which finds the longest."""
        if not job.prepared.run.prefill_only or plan.keep == 0 or len(plan.suffix) > 1:
            return False
        if plan.restore is None:
            holder = plan.copy_from if plan.copy_from is not None else plan.seq
            self.cache.hold(holder)
        log.info("generation response=%s cache_source=%s%s reused=%d prefilled=0 prefill_only already held",
                 job.response_id, plan.source, f" {plan.detail}" if plan.detail else "", plan.keep)
        job.emit(Finished("stop", Usage(input_tokens=plan.keep + len(plan.suffix), cached_tokens=plan.keep,
                                        cache_source=plan.source)))
        return True

    def _start(self, job: Job, plan: CachePlan) -> None:
        """Run ``job`` on ``plan.seq`` from the next step. A fault while
        placing it fails this job alone; its sequence, which ``apply`` may
        have half changed or marked busy (nothing would release it), is
        discarded."""
        try:
            run = self._placed(job, plan)
        except Exception as exc:
            self._not_placed(job, exc)
            self.cache.discard(plan.seq)
            return
        self._running.append(run)

    def _not_placed(self, job: Job, exc: Exception) -> None:
        log.error("could not start a generation", exc_info=exc)
        job.emit(Failed("server_error", f"Generation failed: {type(exc).__name__}"))

    def _placed(self, job: Job, plan: CachePlan) -> Running:
        # Before apply: the diagnosis compares with what the cache holds now.
        report = self.cache.diagnose(job.request, plan)
        plan = self.cache.apply(plan, job.request)
        resident = self.cache.residents[plan.seq]
        report.source = plan.source
        usage = Usage(input_tokens=plan.keep + len(plan.suffix), cached_tokens=plan.keep,
                      cache_source=report.source, cache_report=report)
        seq = plan.seq
        signature = job.request.signature

        def remember(state: SessionState) -> None:
            state.signature = signature
            self.cache.finished(seq, state)

        gen = Generation(self.runtime, job.prepared, plan, job.cancel, job.emit, usage,
                         response_id=job.response_id, kv_tokens=resident.tokens, remember=remember)
        # Output without a limit of its own is planned with room for one
        # token (``CacheRequest.clamp_output``): a continuation whose KV
        # holds more than its replay has less room than the prompt alone left.
        room = self.cache.ops.n_ctx - plan.keep - len(plan.suffix)
        if gen.max_new > room:
            gen.max_new, gen.reason = room, "context_window"
        run = Running(job, plan, resident.tokens, gen)
        run.breaks = self.cache.breakpoints_ahead(job.request, seq)
        conversation = job.prepared.conversation
        if self.planner is not None and conversation.speculative and not job.prepared.run.prefill_only:
            sampler = gen.sampler
            run.spec = SequenceSpeculation(resident.tokens, sampler if isinstance(sampler, GrammarFirstRejection)
                                           else None)
            gen.usage.decode_report = run.spec.stats
        return run

    def _reap(self) -> None:
        """Cancelled (client gone, shutdown): ended now, released after at most one step."""
        for run in list(self._running):
            if not run.job.cancel.cancelled or run.gen.done:
                continue
            try:
                if run.prefilling:
                    # Half a prompt has no turn to remember; its tokens stay
                    # resident for a prefix match.
                    run.job.emit(_cancelled_event(run.job.cancel, run.gen.usage))
                    run.gen.done = True
                    run.pending = []
                    self._release(run)
                else:
                    run.pending = run.gen.cancelled(run.pending)
                    if not run.pending:
                        self._release(run)
            except Exception:
                # This run's alone (remembering its turn renders it): the
                # loop's handler would have failed every stream running.
                log.exception("ending a cancelled generation failed")
                self._fail(run, "server_error", "Generation failed.")

    def _step(self) -> tuple[float, int] | None:
        """One batch, one decode. Returns the seconds ``llama_decode`` took
        and how many sequences decoded in it (None: nothing to evaluate)."""
        # What each sequence contributes: every decoding one its next token(s),
        # then the prefill budget to prefilling ones in arrival order, then
        # drafts out of what is left (``_plan_drafts``).
        parts: list[tuple[Running, int, bool]] = []  # run, tokens taken, wants logits
        n = 0
        decoding = [r for r in self._running if not r.prefilling]
        for run in decoding:
            k = len(run.pending)
            if k == 0 or n + k > self.n_batch:
                continue
            parts.append((run, k, not run.gen.done))
            n += k
        room = self.n_batch - n
        if decoding:
            room = min(room, self.prefill_chunk)
        for run in self._running:
            if not run.prefilling or room <= 0:
                continue
            k = min(len(run.pending), room)
            if run.breaks:  # the chunk ends at the next breakpoint, checkpointed there
                k = min(k, max(1, run.breaks[0] - len(run.tokens)))
            parts.append((run, k, k == len(run.pending)))
            room -= k
            n += k
        if not parts:
            return None
        if self.planner is not None:
            self._plan_drafts(parts, n)
        # In sequence order: with one KV stream per sequence, llama.cpp puts
        # only consecutive sequence ids into one micro-batch.
        parts.sort(key=lambda p: p[0].seq)
        rows: list[tuple[Running, int, int]] = []  # run, logits row (-1: none; a draft's: its first), tokens taken
        # The one-token parts (every decoding sequence's next token) go into
        # the batch together, one array copy per field.
        at: list[int] = []
        tok: list[int] = []
        pos: list[int] = []
        seq: list[int] = []
        out: list[bool] = []
        n = 0
        for run, k, wants in parts:
            draft = run.draft
            if draft is not None:
                self._put_draft(run, run.pending[0], draft.tokens, n)
                rows.append((run, n, 1))
                n += 1 + len(draft.tokens)
            elif k == 1:
                at.append(n)
                tok.append(run.pending[0])
                pos.append(len(run.tokens))
                seq.append(run.seq)
                out.append(wants)
                rows.append((run, n if wants else -1, 1))
                n += 1
            else:
                self._put(run, run.pending, n, k, wants)
                rows.append((run, n + k - 1 if wants else -1, k))
                n += k
        if at:
            where: slice | list[int] = slice(0, n) if len(at) == n else at
            self._tok[where] = tok
            self._pos[where] = pos
            self._seq[where] = seq
            self._logits[where] = out
        self._batch.batch.n_tokens = n
        self._decode_threads()
        # The last step's events, handed over as this thread is about to let
        # the GIL go for the decode: the loop does its share of the work
        # while the decode runs, not while this thread samples and parses
        # (llguidance and ctypes calls release the GIL, and each release
        # would hand the loop the GIL for up to the switch interval).
        self.outbox.flush()
        t0 = time.perf_counter()
        rc = llama_cpp.llama_decode(self._ctx.ctx, self._batch.batch)
        decode_s = time.perf_counter() - t0
        self._decoded(rc, n, decode_s)
        if rc != 0:
            log.error("llama_decode failed (%d) for a batch of %d tokens", rc, n)
            for run, _, _ in rows:
                run.draft = None
                self._fail(run, "server_error", f"Decoding failed ({rc}).")
            return decode_s, len(decoding)
        for run, _, k in rows:
            taken = run.pending[:k] if k > 1 else [run.pending[0]]
            del run.pending[:k]
            run.tokens.extend(taken)
        tops = self._greedy_tops(rows)
        for run, row, k in rows:
            try:
                if run.draft is not None:
                    self._verify(run, row, tops)
                else:
                    self._advance(run, row, k, tops)
            except Exception as exc:
                log.exception("generation failed")
                run.draft = None
                self._fail(run, "server_error", f"Generation failed: {type(exc).__name__}")
        return decode_s, len(decoding)

    def _greedy_tops(self, rows: list[tuple[Running, int, int]]) -> dict[int, int]:
        """The highest-logit token of every row a greedy sampler reads this
        step (each position of a greedy draft too), by batch position: read
        in one pass (``sampling.greedy_tokens``) instead of once per sequence.

        ``rows`` is in batch order, so each position's place among those
        that asked for logits is counted here (plain Python: right after a
        decode even a small numpy call costs ~0.1 ms, its code out of the
        caches)."""
        idxs: list[int] = []
        outputs: list[int] = []
        n_outputs = 0
        for run, row, _ in rows:
            if row < 0:
                continue
            width = 1 + len(run.draft.tokens) if run.draft is not None else 1
            if run.greedy:
                idxs.extend(range(row, row + width))
                outputs.extend(range(n_outputs, n_outputs + width))
            n_outputs += width
        if not idxs:
            return _NO_TOPS
        tops = greedy_tokens(self._ctx, outputs, n_outputs, self.runtime.vocab.n_vocab)
        return dict(zip(idxs, tops, strict=True))

    def _plan_drafts(self, parts: list[tuple[Running, int, bool]], n: int) -> None:
        """Drafts for the decoding sequences that have one worth its price
        (``speculation.Planner``), out of what the step's batch has left."""
        planner = self.planner
        assert planner is not None
        drafting = [run for run, k, wants in parts
                    if wants and run.spec is not None and not run.prefilling and k == 1 and not run.gen.done]
        if not drafting:
            return
        yielding = sum(1 for run, _, wants in parts if wants)
        shared = len(parts) > 1
        # Beside other work a draft may grow the step by ``fair_slack`` at
        # most; where one more token already costs more than that (a CPU
        # decoding several sequences), ``Planner.length`` gives every
        # candidate 0, and asking for the candidates (the grammar's forced
        # tokens, the n-gram walk) buys nothing.
        closed = shared and planner.no_room(self.decode_cost, n)
        for run in drafting:
            spec = run.spec
            assert spec is not None
            gen = run.gen
            limit = min(planner.max_draft, self.n_batch - n, gen.left - 1)
            if limit <= 0:
                continue
            spec.produced = len(gen.sampled)
            # Nothing past the step's fair room can be taken: not proposed either.
            room = 0 if closed else planner.room(self.decode_cost, limit, base_tokens=n, shared=shared)
            if room == 0 and spec.pass_step():
                continue
            # (A resting sequence is asked even without room: a long match ends its rest.)
            draft = spec.candidate(run.pending, max(1, room))
            if draft is None:
                continue
            k = planner.length(self.decode_cost, draft.rates, len(draft.tokens), base_tokens=n,
                               base_yield=yielding, shared=shared)
            if k <= 0:
                continue
            draft.cut(k)
            run.draft = draft
            n += k

    def _put_draft(self, run: Running, token: int, draft: list[int], at: int) -> None:
        """The next token and a draft after it, logits at every position."""
        k = 1 + len(draft)
        self._tok[at] = token
        self._tok[at + 1:at + k] = draft
        np.add(self._offsets[:k], len(run.tokens), out=self._pos[at:at + k])
        self._seq[at:at + k] = run.seq
        self._logits[at:at + k] = 1

    def _verify(self, run: Running, row: int, tops: dict[int, int]) -> None:
        """Sample at each position of a draft in turn: a draft token is kept
        while the sampler picked it, and the first pick that differs is the
        next token (so the output is what decoding without the draft gives).
        The sampler, the parsers and the repetition guard only ever see
        picked tokens; the KV loses the positions after the last kept one."""
        draft, run.draft = run.draft, None
        assert draft is not None and run.spec is not None
        gen = run.gen
        proposed = draft.tokens
        accepted = 0
        for i in range(len(proposed) + 1):
            if gen.done:
                break
            forced = gen.before_sample()
            if gen.done:
                break
            if forced:
                run.pending = forced
                break
            token = _sample(gen.sampler, self._ctx, row + i, tops.get(row + i))
            run.pending = gen.on_token(token)
            end = gen.take_reasoning_end()
            if end is not None:
                self.cache.checkpoint(run.seq, run.job.request.owner, "reasoning", at=end[0], generated=end[1])
            if i < len(proposed) and token == proposed[i] and run.pending == [token]:
                # Already evaluated: the draft's position holds it.
                run.tokens.append(token)
                run.pending = []
                accepted += 1
                continue
            break
        if accepted < len(proposed):
            self.runtime.kv.trim(run.seq, len(run.tokens))
        run.spec.produced = len(gen.sampled)
        run.spec.verified(draft, accepted)
        self.decode_stats.add(draft.source, len(proposed), accepted)
        if gen.done and not run.pending:
            self._release(run)

    def _decoded(self, rc: int, n: int, decode_s: float) -> None:
        """After a step's ``llama_decode``: a decode that ran performed the
        whole-stream copies llama.cpp had queued, and its time is the cost
        of ``n`` tokens. One that failed may have stopped before them (a
        batch it refuses, rc -1, does: test_kv_copy), so they stay marked
        unsettled; the next decode, or the idle scheduler's settle
        (``_settle_copies``), performs them. Cleared here, a state restored
        into the target meanwhile was overwritten by the copy later."""
        if rc != 0:
            return
        self.decode_cost.observe(n, decode_s * 1000)
        self.runtime.kv.decoded()
        self.cache.decoded()

    def _settle_copies(self) -> None:
        """llama.cpp performs a copy between sequences at the next decode; a
        request cancelled before its first step leaves one pending, which
        keeps both sequences from being reused. Re-evaluate the copy's last
        token to run that decode."""
        kv = self.runtime.kv
        n = 0
        emptied: list[int] = []
        for r in self.cache.unsettled_copies():
            if r.tokens and kv.recurrent:
                # A recurrent state cannot give its last token back: trimmed
                # (refused) and fed that token again, it would hold it
                # twice, and a later turn would continue that state. The
                # copied state is dropped instead, and settled as below.
                self.cache.discard(r.seq)
            if not r.tokens:
                # Discarded before its copy ran (a fault in its placement):
                # llama.cpp still holds the copy, and would run it at the
                # next decode over whatever is restored here meanwhile
                # (wrong output). Any decode runs it: a throwaway token on
                # the empty target, cleared after. (It was skipped, and the
                # copy counted as done with no decode.)
                self._tok[n], self._pos[n], self._seq[n], self._logits[n] = 0, 0, r.seq, 0
                emptied.append(r.seq)
                n += 1
                continue
            pos = len(r.tokens) - 1
            kv.trim(r.seq, pos)
            self._tok[n], self._pos[n], self._seq[n], self._logits[n] = r.tokens[-1], pos, r.seq, 0
            n += 1
        if not n:
            return
        self._batch.batch.n_tokens = n
        self._decode_threads()
        rc = llama_cpp.llama_decode(self._ctx.ctx, self._batch.batch)
        for seq in emptied:
            kv.clear(seq)
        if rc != 0:
            # The copies did not run (``_decoded``): their targets are
            # dropped, and stay marked, so that nothing is restored into
            # them before a decode that runs (the next request's) performs
            # the copies.
            for r in self.cache.unsettled_copies():
                if r.tokens:
                    self.cache.discard(r.seq)
            return
        kv.decoded()
        self.cache.decoded()

    def _decode_threads(self) -> None:
        """One decode thread fewer per long preparation (``Preparations``).
        llama.cpp's workers meet at a spinning barrier after every operation
        of the graph; one that shares its core with a thread tokenizing a
        huge prompt loses a time slice at many of those barriers while the
        others spin: a 1-token step took ~1.4 s instead of ~10 ms on two
        cores. Fewer threads, each with a core of its own, keep the step
        short."""
        runtime = self.runtime
        n = max(1, runtime.threads - runtime.preparations.long())
        if n != self._threads:
            llama_cpp.llama_set_n_threads(self._ctx.ctx, n, n)
            self._threads = n

    def _put(self, run: Running, tokens: list[int], at: int, k: int, logits: bool) -> None:
        """A chunk of ``k`` tokens (a prefill's, or a sequence's forced tokens) at ``at``."""
        self._tok[at:at + k] = tokens[:k]
        np.add(self._offsets[:k], len(run.tokens), out=self._pos[at:at + k])
        self._seq[at:at + k] = run.seq
        self._logits[at:at + k] = 0
        if logits:
            self._logits[at + k - 1] = 1

    def _advance(self, run: Running, row: int, k: int, tops: dict[int, int]) -> None:
        gen = run.gen
        if run.prefilling:
            run.since_checkpoint += k
            if run.spec is not None:
                # Indexed as it lands: a prefill step is long, decoding steps are not.
                run.spec.index.catch_up(2 * k + 256)
            while run.breaks and len(run.tokens) >= run.breaks[0]:
                # A client-declared breakpoint (non-trimmable KV): a later
                # request that diverges after it resumes from here.
                if len(run.tokens) == run.breaks.pop(0):
                    self.cache.checkpoint(run.seq, run.job.request.owner, "breakpoint")
            if run.pending:
                every = self.checkpoint_every
                if every and run.since_checkpoint >= every:
                    self.cache.checkpoint_prefix(run.seq, run.job.request.owner)
                    run.since_checkpoint = 0
                return
            run.prefilling = False
            self._prefilled(run)
            # The end of the input: where a regenerated or re-replayed turn
            # resumes on a model whose KV cannot be trimmed back to it.
            self.cache.checkpoint(run.seq, run.job.request.owner, "input")
            if run.job.prepared.run.prefill_only:
                gen.keep_prefilled()
        if gen.done:
            if not run.pending:
                self._release(run)
            return
        forced = gen.before_sample()
        if not gen.done:
            if forced:
                run.pending = forced
                return
            token = _sample(gen.sampler, self._ctx, row, tops.get(row))
            run.pending = gen.on_token(token)
            end = gen.take_reasoning_end()
            if end is not None:
                # The end of reasoning: where a sealed replay that keeps it
                # but parts after it (an edited answer) resumes on a model
                # whose KV cannot be trimmed back to it. The token just
                # taken is not evaluated yet: the KV ends right there.
                self.cache.checkpoint(run.seq, run.job.request.owner, "reasoning", at=end[0], generated=end[1])
        if gen.done and not run.pending:
            self._release(run)

    def _prefilled(self, run: Running) -> None:
        self._first_token = True
        plan = run.plan
        run.decoding_since = time.perf_counter()
        prefill_ms = (run.decoding_since - run.started) * 1000
        stats = self.runtime.stats
        stats.generations += 1
        stats.prefilled_tokens += len(plan.suffix)
        source = plan.source
        stats.last_cache_source = source
        stats.last_cache_detail = plan.detail
        stats.last_reused_tokens = plan.keep
        stats.last_prefilled_tokens = len(plan.suffix)
        stats.last_prefill_ms = prefill_ms
        report = run.gen.usage.cache_report
        miss = ""
        if report is not None and report.miss_reason is not None:
            miss = f" miss_reason={report.miss_reason} longest_prefix={report.longest_prefix}"
            if report.divergence_token is not None:
                miss += f" divergence=item:{report.divergence_item},token:{report.divergence_token}"
            if report.evicted_by is not None:
                miss += f" evicted_by={report.evicted_by}"
        log.info(
            "generation response=%s seq=%d cache_source=%s%s reused=%d prefilled=%d prefill_ms=%.1f%s%s",
            run.job.response_id, run.seq, source, f" {plan.detail}" if plan.detail else "",
            plan.keep, len(plan.suffix), prefill_ms,
            " prefill_only" if run.job.prepared.run.prefill_only else "", miss,
        )

    def _release(self, run: Running) -> None:
        self._running.remove(run)
        # What a generation came to, beside the line its prefill wrote: how
        # many tokens, how it ended (stop, length, repetition: a run that went
        # on to the output ceiling shows here) and in what time.
        if not run.prefilling and not run.job.prepared.run.prefill_only:
            gen = run.gen
            log.info("decode response=%s seq=%d output=%d end=%s decode_ms=%.1f%s", run.job.response_id, run.seq,
                     len(gen.sampled), gen.reason,
                     (time.perf_counter() - run.decoding_since) * 1000,
                     f" speculation {run.spec.stats.log_text()}" if run.spec is not None else "")
        self.cache.release(run.seq)
        close = getattr(run.gen.sampler, "close", None)
        if close is not None:
            close()

    def _fail_all(self) -> None:
        """End every running stream after events of theirs were lost; their
        failures go out at once (nothing else may come to flush them)."""
        for run in list(self._running):
            self._fail(run, "server_error", "Generation failed.")
        try:
            self.outbox.flush()
        except Exception:
            log.exception("handing events to the event loop failed again")

    def _fail(self, run: Running, code: str, message: str) -> None:
        if run in self._running:
            self._running.remove(run)
        if not run.gen.done:
            run.gen.failed(code, message)
        self.cache.discard(run.seq)

    def _shutdown(self) -> None:
        for job in self._waiting:
            job.emit(Failed("server_shutting_down", "The server is shutting down."))
        self._waiting.clear()
        for run in self._running:
            run.job.cancel.cancel("shutdown")
        # Each cancelled sequence evaluates what it sampled last, then the
        # remembered states go to disk.
        for _ in range(3):
            if not self._running:
                break
            self._reap()
            if self._running:
                self._step()
        self.outbox.flush()  # the terminal events, before the disk writes
        self.cache.save_all()


def _sample(sampler: LlamaSampler | Greedy | GrammarFirstRejection, ctx: LlamaContext, row: int,
            top: int | None) -> int:
    """``top``: the row's highest logit, read for a greedy sampler (``Scheduler._greedy_tops``)."""
    if top is None:
        return sampler.sample(ctx, row)
    assert not isinstance(sampler, LlamaSampler)
    return sampler.sample(ctx, row, top)


def _cancelled_event(cancel: CancelToken, usage: Usage) -> EngineEvent:
    if cancel.reason == "shutdown":
        return Failed("server_shutting_down", "The server is shutting down.", usage)
    return Finished("cancelled", usage)
