"""The embedded engine: llama.cpp through llama-cpp-python.

One model, one context holding ``parallel`` sequences, decoded together by
one scheduler thread (continuous batching, lmspd.engines.llama.scheduler).
lmspd drives llama.cpp at the token level (render -> tokenize -> match a
remembered KV state -> prefill the rest -> sample) instead of calling
``create_completion``, because the continuation cache must own exactly which
tokens are in each sequence's KV.

The parts: ``preparation`` (render, tokenize, constrain; the service's
preparing threads),
``scheduler`` (the batch and token loop; its own thread), ``generation``
(one sequence's text, reasoning, tool calls and events), ``kv`` (capture,
restore, copy, trim by sequence) and ``lmspd.cache`` (which sequence, which
tier, what is kept). The scheduler and the generations see the loaded
model through one ``runtime.LlamaRuntime``, never through this class.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, TypeVar

import llama_cpp
from llama_cpp import _internals as internals

from lmspd.cache.disk import DiskCheckpoints
from lmspd.cache.manager import ContinuationCache, KvOps
from lmspd.core.conversation import Conversation, SamplingDefaults
from lmspd.core.events import TERMINAL_EVENTS, EngineEvent
from lmspd.core.limits import DEFAULT_LIMITS, RequestLimits
from lmspd.core.run import LOCAL, RunContext
from lmspd.core.sealing import Sealer
from lmspd.engines.base import CancelToken, ModelInfo

from . import amx, native_log
from .cpus import default_threads
from .gguf import sampling_defaults
from .kv import SequenceKv
from .model_text import ModelText
from .placement import RuntimeConfig, plan
from .preparation import LlamaPrepared, Preparation, Repairs
from .preparations import Preparations
from .runtime import GenerationStats, LlamaRuntime
from .scheduler import Job, Scheduler
from .speculation import Planner, speculation_mode
from .tool_formats import ToolFormat
from .transcript import Transcript

__all__ = ["CacheSettings", "GenerationStats", "LlamaEngine", "LlamaPrepared"]

log = logging.getLogger("lmspd.engine")

DEFAULT_PARALLEL = 4
_GGML_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}

# What of a GGUF ``model_identity`` hashes: its head (the header, metadata
# and tensor index of any model we know fit in it: a 256k-token vocabulary
# is ~6 MiB) and blocks spread evenly over the whole file (the weights).
IDENTITY_HEAD_BYTES = 16 << 20
IDENTITY_BLOCKS = 16
IDENTITY_BLOCK_BYTES = 64 << 10

T = TypeVar("T")


def model_identity(path: Path) -> str:
    """A digest of the model file's content, for its KV checkpoints'
    fingerprint: other weights or metadata under the same name and size (a
    retrained or re-quantized model copied over the old one) must not
    restore the old model's states. This reads 17 MiB of any file (~15 ms
    from the page cache); hashing all of a 20 GB one would take ~25 s at
    every start, minutes from a cold disk."""
    size = path.stat().st_size
    digest = hashlib.sha256(b"%d:" % size)
    last = max(0, size - IDENTITY_BLOCK_BYTES)
    with open(path, "rb") as fh:
        digest.update(fh.read(IDENTITY_HEAD_BYTES))
        for i in range(IDENTITY_BLOCKS):
            fh.seek(last * i // (IDENTITY_BLOCKS - 1))
            digest.update(fh.read(IDENTITY_BLOCK_BYTES))
    return digest.hexdigest()[:32]


@dataclass
class CacheSettings:
    enabled: bool = True
    ram_budget_bytes: int = 1 << 30
    disk_dir: Path | None = None
    disk_budget_bytes: int = 4 << 30
    # Write a checkpoint every this many prefilled tokens of a long prompt.
    checkpoint_every: int = 2048
    # Keep every cell of sliding-window layers (trimmable, like plain
    # attention, at n_ctx cells per SWA layer) instead of the last window
    # (llama.cpp's server default; exact-state checkpoints stand in for trims).
    swa_full: bool = False
    # Cache-killer repairs (lmspd.engines.llama.preparation.Repairs).
    strip_billing_header: bool = True
    canonical_tool_order: bool = True


class LlamaEngine:
    # ``RunContext.prefill_only``: the prompt is evaluated and kept, nothing sampled.
    supports_prefill = True

    def __init__(
        self,
        model_id: str,
        path: Path,
        *,
        n_ctx: int = 0,
        n_threads: int | None = None,
        n_batch: int = 512,
        parallel: int = DEFAULT_PARALLEL,
        prefill_chunk: int | None = None,
        cache: CacheSettings | None = None,
        limits: RequestLimits = DEFAULT_LIMITS.request,
        chat_template: str | None = None,
        sealer: Sealer | None = None,
        grammars_at_start: bool = True,
        placement: RuntimeConfig | None = None,
        flash_attn: str = "auto",
        kv_type: str = "f16",
        speculative: str = "auto",
        sampling: SamplingDefaults | None = None,
        rope_scaling: str = "auto",
    ) -> None:
        """``placement`` is where and how the model runs (``placement.plan``,
        fitted to memory); without it ``n_ctx`` (0: the trained length),
        ``parallel`` and ``rope_scaling`` are taken as given."""
        self.limits = limits
        self.sealer = sealer
        self.cache_settings = cache or CacheSettings()
        if placement is None:
            placement = plan(path, ctx=n_ctx, parallel=max(1, parallel), flash_attn=flash_attn, kv_type=kv_type,
                             swa_full=self.cache_settings.swa_full, check=False, rope=rope_scaling)
        self.parallel = placement.parallel
        if n_threads:
            threads, threads_reason = n_threads, "--threads"
        else:
            chosen = default_threads()
            threads, threads_reason = chosen.threads, chosen.reason
        self.threads = threads
        # Requests being prepared right now (render, tokenize: CPU-bound,
        # in the service's worker threads); the scheduler decodes with one
        # thread fewer per long one (see Scheduler._decode_threads).
        self.preparations = Preparations()
        llama_cpp.llama_backend_init()
        native_log.install()
        model_params = amx.model_params()
        buffers = amx.extra_buffers()
        if buffers.reason:
            log.log(logging.INFO if buffers.use else logging.WARNING, "model %s: %s", model_id, buffers.reason)
        model_params.n_gpu_layers = placement.n_gpu_layers
        self._model = native_log.built(lambda: internals.LlamaModel(path_model=str(path), params=model_params))
        model = self._model
        params = llama_cpp.llama_context_default_params()
        # One KV stream per sequence, each the full window: every request
        # gets the context /v1/models reports, and a sequence attends only
        # over its own cells (a unified KV would make all of them pay for
        # every sequence's length).
        params.n_ctx = placement.window * self.parallel
        params.n_seq_max = self.parallel
        params.kv_unified = False
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_threads = threads
        params.n_threads_batch = threads
        # Flash attention: on a GPU the fast path (and what a quantized V
        # cache needs); off on the CPU unless asked, where llama.cpp's kernel
        # for it is the slower one for an agent's turn (SmolLM2, 2 threads, 58
        # tokens appended to an 8.8k-token history: 3.2-3.9 s with it, 0.9-1.3 s
        # without). placement.plan decided which.
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if placement.flash_attn
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.type_k = params.type_v = _GGML_TYPES[placement.kv_type]
        params.swa_full = self.cache_settings.swa_full
        if placement.rope is not None:
            params.rope_scaling_type = llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN
            params.rope_freq_scale = placement.rope.freq_scale
            params.yarn_orig_ctx = placement.rope.trained
        self.ctx = native_log.built(lambda: internals.LlamaContext(model=model, params=params))
        self.n_ctx = llama_cpp.llama_n_ctx_seq(self.ctx.ctx)
        # What llama.cpp made of it (it pads the window to 256 cells).
        self.placement = dataclasses.replace(placement, window=self.n_ctx)
        log.info("%s", self.placement.line(model_id))
        log.info("model %s: %d CPU threads (%s)", model_id, threads, threads_reason)
        text = ModelText.of(model, chat_template)
        self.vocab = text.vocab
        self.template = text.template
        self.tool_format: ToolFormat = text.tool_format
        self.reasoning = text.reasoning
        self.parse_always = text.parse_always
        # What a request leaves unset: the operator's flags (``sampling``)
        # over the model's own settings.
        own = sampling_defaults(model.metadata())
        sampling = own.under(sampling or SamplingDefaults())
        if sampling != SamplingDefaults():
            log.info("model %s: sampling for what a request leaves unset: %s (its own settings: %s)", model_id,
                     sampling.describe(), own.describe())
        self.info = ModelInfo(
            id=model_id,
            context_window=self.n_ctx,
            capabilities={"streaming": True, "tools": True, "structured_output": True,
                          "reasoning": self.reasoning is not None},
            source=str(path),
            max_concurrency=self.parallel,
            sampling=sampling,
        )
        self.stats_ = GenerationStats()
        self.kv = SequenceKv(self.ctx, model, swa_full=self.cache_settings.swa_full)
        if not self.kv.trimmable:
            log.info("model %s: %s KV cannot be trimmed (n_swa=%d): exact-state checkpoints at turn boundaries",
                     model_id, self.kv.kind, self.kv.n_swa)
        self.cache = self._build_cache(path, self.cache_settings)
        self.preparation = Preparation(
            model_id=model_id, vocab=self.vocab, template=self.template, tool_format=self.tool_format,
            reasoning=self.reasoning, cache=self.cache, n_ctx=self.n_ctx, limits=limits, sealer=sealer,
            repairs=Repairs(strip_billing_header=self.cache_settings.strip_billing_header,
                            canonical_tool_order=self.cache_settings.canonical_tool_order),
            sampling=sampling,
        )
        if grammars_at_start:
            self.preparation.build_grammars_in_background()
        self.transcript = Transcript.of(self.template, self.preparation.render)
        self.speculative = speculation_mode(speculative, self.kv)
        if speculative == "auto" and self.speculative == "off":
            log.info("model %s: no speculative decoding: its %s KV cannot drop rejected draft positions",
                     model_id, self.kv.kind)
        loaded = LlamaRuntime(
            ctx=self.ctx, kv=self.kv, cache=self.cache, threads=threads, preparations=self.preparations,
            stats=self.stats_, vocab=self.vocab, sampler=self.preparation.sampler, tool_format=self.tool_format,
            parse_always=self.parse_always, reasoning=self.reasoning, limits=limits, sealer=sealer,
            model_id=model_id, transcript=self.transcript,
        )
        self.scheduler = Scheduler(loaded, n_batch=n_batch, prefill_chunk=prefill_chunk or max(1, n_batch // 2),
                                   checkpoint_every=self.cache_settings.checkpoint_every,
                                   planner=Planner() if self.speculative == "auto" else None)

    def _build_cache(self, path: Path, settings: CacheSettings) -> ContinuationCache:
        disk = None
        if settings.enabled and settings.disk_dir is not None:
            # Per-sequence window: a checkpoint restores into any sequence,
            # whatever --parallel the server that wrote it ran with.
            # The KV's kind too: a window-only SWA state is not a full one.
            # A state is only valid under the positions' encoding it was
            # computed with, and restores only into the same cell types and
            # V layout (flash attention keeps V untransposed): a mismatch was
            # a read, a refused restore and a cold prefill for every match.
            # The model by its content, not its file name and size.
            placement = self.placement
            rope = f":yarn{placement.rope.trained}" if placement.rope else ""
            fingerprint = (f"gguf-{model_identity(path)}:{self.n_ctx}:{llama_cpp.__version__}:{self.kv.kind}"
                           f":{placement.kv_type}:fa{int(placement.flash_attn)}{rope}")
            disk = DiskCheckpoints(settings.disk_dir, settings.disk_budget_bytes, fingerprint)
        kv = self.kv
        ops = KvOps(capture=kv.capture, restore=kv.restore, copy=kv.copy, trim=kv.trim,
                    tokenize=self.tokenize, detokenize=self.detokenize, n_ctx=self.n_ctx, floor=kv.floor,
                    cheap_copy=kv.cell_copy_cheaper)
        return ContinuationCache(ops, n_seq=self.parallel, enabled=settings.enabled, trimmable=kv.trimmable,
                                 ram_budget_bytes=settings.ram_budget_bytes, disk=disk)

    # -- text <-> tokens, preparing (preparing threads; reads, never touches the KV) --

    def render(self, conversation: Conversation, *, add_generation_prompt: bool = True) -> str:
        return self.preparation.render(conversation, add_generation_prompt=add_generation_prompt)

    def tokenize(self, text: str) -> list[int]:
        return self.vocab.tokenize(text)

    def detokenize(self, tokens: list[int]) -> str:
        return self.vocab.detokenize(tokens)

    def count_tokens(self, conversation: Conversation) -> int:
        return len(self.tokenize(self.render(conversation)))

    def announce(self, conversation: Conversation) -> AbstractContextManager[None]:
        """Around an admitted request's wait for a preparing thread (the
        service's): the scheduler, idle, waits for it to share its first
        step (``Preparations.incoming``)."""
        return self.preparations.incoming(conversation)

    def prepare(self, conversation: Conversation, run: RunContext = LOCAL) -> LlamaPrepared:
        with self.preparations.running(conversation) as landed:
            prepared = self.preparation.prepare(conversation, run)
            landed(prepared)
            return prepared

    # The model is in this process: nothing to reach before generating.
    opens_first = False

    async def open(self, prepared: LlamaPrepared, cancel: CancelToken) -> None:
        return None

    async def discard(self, prepared: LlamaPrepared) -> None:
        return None  # ``open`` reached nothing

    # -- generating ----------------------------------------------------------

    def generate(self, prepared: LlamaPrepared, cancel: CancelToken,
                 response_id: str | None = None) -> AsyncIterator[EngineEvent]:
        """Run one generation on a sequence of the shared context.
        ``response_id`` names the response it produces (a later
        ``previous_response_id`` continues from its state).

        The job reaches the scheduler now, not at the first iteration: the
        prompt evaluates while the caller writes what precedes the first
        token (``Run.events``: ``response.created``). A caller that never
        iterates the events cancels ``cancel``."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        # Delivered once per scheduler step (Scheduler.outbox).
        emit = self.scheduler.outbox.sender(loop, queue.put_nowait)
        # A job waiting to be placed sleeps with the scheduler: a cancel wakes it.
        unwatch = cancel.on_cancel(self.scheduler.wake)
        self.scheduler.submit(Job(prepared, cancel, emit, response_id, prepared.cache_request()))
        return self._events(queue, cancel, unwatch)

    async def _events(self, queue: asyncio.Queue[EngineEvent], cancel: CancelToken,
                      unwatch: Callable[[], None]) -> AsyncIterator[EngineEvent]:
        finished = False
        try:
            while True:
                event = await queue.get()
                if isinstance(event, TERMINAL_EVENTS):
                    finished = True
                yield event
                if finished:
                    return
        finally:
            if not finished:
                # The consumer went away (client disconnect): the scheduler
                # ends it at its next step.
                cancel.cancel()
            unwatch()

    # -- stats and shutdown ------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        s = self.stats_
        c = self.cache.stats
        return {
            "generations": s.generations,
            "prefilled_tokens": s.prefilled_tokens,
            "last_cache_source": s.last_cache_source,
            "last_cache_detail": s.last_cache_detail,
            "last_reused_tokens": s.last_reused_tokens,
            "last_prefilled_tokens": s.last_prefilled_tokens,
            "last_prefill_ms": round(s.last_prefill_ms, 1),
            "last_output_tokens": s.last_output_tokens,
            "parallel": self.parallel,
            "runtime": self.placement.public(),
            "speculative": self.speculative,
            "speculation": self.scheduler.decode_stats.as_json(),
            "step_host_seconds": self.scheduler.host_cost.snapshot(),
            "active_sequences": self.scheduler.active,
            "prefilling": self.scheduler.prefills(),
            "sequences": self.cache.sequences(),
            "cache": {"enabled": self.cache.enabled, "kv": self.kv.kind, "checkpoints": c.checkpoints,
                      "checkpoint_restores": c.checkpoint_restores, "ram_sessions": c.ram_sessions, "ram_bytes": c.ram_bytes,
                      "disk_checkpoints": len(self.cache.disk) if self.cache.disk else 0,
                      "disk_bytes": self.cache.disk.total_bytes if self.cache.disk is not None else 0,
                      "ram_budget_bytes": self.cache.ram_budget_bytes,
                      "disk_budget_bytes": self.cache.disk.budget_bytes if self.cache.disk is not None else 0,
                      "disk_restores": c.disk_restores, "ram_restores": c.ram_restores,
                      "evictions": c.evictions, "captures_ahead": c.captures_ahead, "copies": c.copies,
                      "copied_tokens": c.copied_tokens},
        }

    def last_output_token_ids(self) -> list[int]:
        return list(self.stats_.last_output_token_ids)

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        # The scheduler thread owns the KV: it writes the shutdown checkpoints.
        await loop.run_in_executor(None, self.scheduler.close)
        await loop.run_in_executor(None, self.cache.flush)
        await loop.run_in_executor(None, self.preparation.close)
        self.ctx.close()
        self._model.close()
