"""The embedded engine: llama.cpp through llama-cpp-python.

One model, one context, one generation at a time on a dedicated thread.
lmspd drives llama.cpp at the token level (render -> tokenize -> match a
remembered KV state -> prefill the rest -> sample) instead of calling
``create_completion``, because the continuation cache must own exactly which
tokens are in the KV.
"""

from __future__ import annotations

import asyncio
import codecs
import ctypes
import dataclasses
import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import llama_cpp
from llama_cpp import _internals as internals

from lmspd.cache.disk import DiskCheckpoints
from lmspd.cache.manager import CachePlan, CacheRefused, CacheRequest, ContinuationCache, KvOps
from lmspd.cache.state import SessionState, capture_kv, restore_kv
from lmspd.core.conversation import (
    Conversation,
    CustomTool,
    FunctionTool,
    Item,
    Message,
    Reasoning,
    ToolCall,
    orphan_tool_outputs,
)
from lmspd.core.errors import ApiError
from lmspd.core.sealing import Sealer
from lmspd.core.limits import DEFAULT_LIMITS, Limits, RequestLimits
from lmspd.core.events import (
    TERMINAL_EVENTS,
    EngineEvent,
    Failed,
    Finished,
    ReasoningDelta,
    ReasoningDone,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStarted,
    Usage,
)
from lmspd.core.ids import new_id
from lmspd.engines.base import CancelToken, ModelInfo

from . import grammars
from .prompt import template_messages
from .reasoning import BUDGETS, ReasoningSplitter, ReasoningSyntax
from .matchers import GrammarCompiler
from .sampling import GrammarFirstRejection
from .template import ChatTemplate
from .tool_formats import ToolCallError, ToolCallParser, ToolFormat, detect_tool_format

log = logging.getLogger("lmspd.engine")


@dataclass
class CacheSettings:
    enabled: bool = True
    ram_budget_bytes: int = 1 << 30
    disk_dir: Path | None = None
    disk_budget_bytes: int = 4 << 30
    # Write a checkpoint every this many prefilled tokens of a long prompt.
    checkpoint_every: int = 2048


@dataclass
class LlamaPrepared:
    conversation: Conversation
    text: str
    tokens: list[int]
    max_new_tokens: int
    grammar: str | None = None
    lazy_patterns: list[str] | None = None
    tools: list[FunctionTool | CustomTool] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    requires_state: str | None = None
    reuse_cache: bool = True
    needs_reasoning_state: bool = False
    # The id of the response this generation produces (set by the service).
    response_id: str | None = None

    @property
    def input_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class GenerationStats:
    """What the last generation cost; also read by tests and benchmarks."""

    generations: int = 0
    last_cache_source: str = "cold"
    last_cache_detail: str = ""
    last_reused_tokens: int = 0
    last_prefilled_tokens: int = 0
    last_prefill_ms: float = 0.0
    last_output_tokens: int = 0
    last_output_token_ids: list[int] = field(default_factory=list)


class LlamaEngine:
    def __init__(
        self,
        model_id: str,
        path: Path,
        *,
        n_ctx: int = 0,
        n_threads: int | None = None,
        n_batch: int = 512,
        cache: CacheSettings | None = None,
        limits: RequestLimits = DEFAULT_LIMITS.request,
        chat_template: str | None = None,
        sealer: Sealer | None = None,
    ) -> None:
        self.limits = limits
        self.sealer = sealer
        threads = n_threads or max(1, (os.cpu_count() or 2))
        self._llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        llm = self._llm
        self._vocab = llm._model.vocab
        self._n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self._n_batch = n_batch
        meta = llm.metadata
        # --chat-template overrides the GGUF's own (e.g. a thinking-style one).
        template_source = chat_template or meta.get("tokenizer.chat_template")
        self.template = ChatTemplate(
            template_source,
            bos_token=self._token_text(llm.token_bos()),
            eos_token=self._token_text(llm.token_eos()),
        )
        self.tool_format: ToolFormat = detect_tool_format(template_source)
        self._closer = self._turn_closer()
        self.reasoning = ReasoningSyntax.detect(self.template)
        self.info = ModelInfo(
            id=model_id,
            context_window=llm.n_ctx(),
            capabilities={"streaming": True, "tools": True, "structured_output": True,
                          "reasoning": self.reasoning is not None},
            source=str(path),
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmspd-llama")
        self._pieces: dict[int, bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)
        self.stats_ = GenerationStats()
        self.cache_settings = cache or CacheSettings()
        self.cache = self._build_cache(path, self.cache_settings)

    def _build_cache(self, path: Path, settings: CacheSettings) -> ContinuationCache:
        llm = self._llm
        disk = None
        if settings.enabled and settings.disk_dir is not None:
            fingerprint = f"{path.name}:{path.stat().st_size}:{llm.n_ctx()}:{llama_cpp.__version__}"
            disk = DiskCheckpoints(settings.disk_dir, settings.disk_budget_bytes, fingerprint)
        ops = KvOps(
            live_tokens=lambda: llm.input_ids[: llm.n_tokens].tolist(),
            capture=lambda: capture_kv(llm._ctx.ctx),
            restore=self._restore,
            tokenize=self.tokenize,
            detokenize=self.detokenize,
            n_ctx=llm.n_ctx(),
        )
        return ContinuationCache(ops, enabled=settings.enabled, ram_budget_bytes=settings.ram_budget_bytes, disk=disk)

    # -- text <-> tokens -------------------------------------------------------

    def render(self, conversation: Conversation, *, add_generation_prompt: bool = True) -> str:
        messages, tools = template_messages(conversation, self.template, self.tool_format)
        return self.template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def tokenize(self, text: str) -> list[int]:
        # The template already wrote any BOS it wants; special=True so that
        # markers like <|im_start|> become their single tokens.
        return self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def detokenize(self, tokens: list[int]) -> str:
        return self._llm._model.detokenize(tokens, special=True).decode("utf-8", errors="replace")

    def count_tokens(self, conversation: Conversation) -> int:
        return len(self.tokenize(self.render(conversation)))

    # -- preparing (event loop; reads, never touches the KV) --------------------

    def prepare(self, conversation: Conversation) -> LlamaPrepared:
        self._open_sealed_reasoning(conversation)
        requires_state = self._attach_live_history(conversation)
        n_ctx = self.info.context_window
        text = self.render(conversation)
        tokens = self.tokenize(text)
        requested = conversation.max_output_tokens
        while conversation.truncate and len(tokens) + (requested or 1) > n_ctx:
            if not _drop_oldest_turn(conversation):
                break
            text = self.render(conversation)
            tokens = self.tokenize(text)
        room = n_ctx - len(tokens)
        if conversation.max_output_tokens_is_ceiling and requested is not None and room >= 1:
            requested = min(requested, room)
        if (requested is not None and requested > room) or room < 1:
            need = len(tokens) + (requested or 1)
            raise ApiError(
                "context_length_exceeded",
                f"This request needs {need} tokens ({len(tokens)} of input"
                + (f" + {requested} max_output_tokens" if requested else "")
                + f") but the model's context window is {n_ctx} tokens.",
                param="max_output_tokens" if requested and len(tokens) < n_ctx else "input",
            )
        prepared = LlamaPrepared(
            conversation=conversation,
            text=text,
            tokens=tokens,
            max_new_tokens=requested if requested is not None else room,
            stop=list(conversation.sampling.stop),
            requires_state=requires_state,
            reuse_cache=conversation.cache_reuse,
            needs_reasoning_state=self._needs_reasoning_state(conversation),
        )
        self._constrain(prepared)
        return prepared

    def _open_sealed_reasoning(self, conversation: Conversation) -> None:
        """Replayed reasoning this server sealed renders exactly as sampled."""
        for i, item in enumerate(conversation.items):
            if isinstance(item, Reasoning) and item.encrypted_content:
                if self.sealer is None or self.reasoning is None:
                    continue  # another provider's blob: nothing we can render
                item.hidden = self.sealer.open(self.info.id, item.encrypted_content,
                                               f"input[{i}].encrypted_content")

    def _needs_reasoning_state(self, conversation: Conversation) -> bool:
        """A replayed tool-call turn of a reasoning model without its reasoning
        item cannot be rendered as the model saw it."""
        if self.reasoning is None or not conversation.require_reasoning_state:
            return False
        reasoning_seen = False
        for item in conversation.items:
            if isinstance(item, Reasoning):
                reasoning_seen = True
            elif isinstance(item, ToolCall):
                if not reasoning_seen:
                    return True
            elif isinstance(item, Message) and item.role != "assistant":
                reasoning_seen = False
        return False

    def _attach_live_history(self, conversation: Conversation) -> str | None:
        """A tool output must answer a call in the replayed history — or one the
        engine still remembers, whose history is then put in front of it."""
        orphans = orphan_tool_outputs(conversation.items)
        if not orphans:
            return None
        state = (self.cache.state_for_calls({call_id for _, call_id in orphans}, conversation.owner)
                 if self.cache.enabled else None)
        # Only a request that starts with the outputs continues a remembered
        # turn; outputs after some replayed history must find their call there.
        if state is None or orphans[0][0] != 0:
            index, call_id = orphans[0]
            raise ApiError(
                "invalid_request",
                f"No tool call found for the tool output with call_id {call_id!r} (input[{index}]), and the "
                "server holds no live state that produced it. Replay the full history: include the "
                "function_call item that produced this call_id before its output.",
                param=f"input[{index}].call_id",
            )
        conversation.items = list(state.items) + conversation.items
        return state.key

    def _constrain(self, prepared: LlamaPrepared) -> None:
        """Grammars only for requests that demand a shape; none otherwise."""
        conv = prepared.conversation
        fmt = conv.output_format
        choice = conv.tool_choice
        limits = Limits(request=self.limits)
        specials = self._grammars().special_markers(self.tool_format.markers)
        if conv.tools and choice.mode != "none":
            names = choice.allowed if choice.allowed is not None else [t.name for t in conv.tools]
            prepared.tools = [t for t in conv.tools if t.name in names]
            if choice.mode == "required":
                # A forced call ends the turn (see grammars): one call unless
                # the request explicitly allowed parallel calls.
                prepared.grammar = grammars.tool_call_grammar(
                    self.tool_format, conv.tools, allowed_names=names, parallel=self._max_calls(conv, True) > 1,
                    max_calls=self._max_calls(conv, True), specials=specials, limits=limits,
                )
                self._check_grammar(prepared.grammar)
                return
        if conv.tools and fmt.type == "text":
            # The tools are in the prompt: a tool result the model writes
            # itself ends its turn, and so does a call where none may be made
            # (tool_choice none); neither markup ever reaches output_text.
            prepared.stop += self.tool_format.result_markers
            if not prepared.tools:
                prepared.stop.append(self.tool_format.trigger)
        if fmt.type == "json_schema" and fmt.schema is not None:
            prepared.grammar = grammars.json_schema_grammar(fmt.schema, param=fmt.param, limits=limits)
        elif fmt.type != "text":
            prepared.grammar = grammars.json_object_grammar()
        elif prepared.tools:
            # auto: free text until the model starts a call, then the call is constrained.
            prepared.grammar, prepared.lazy_patterns = grammars.lazy_tool_call_grammar(
                self.tool_format, conv.tools, allowed_names=[t.name for t in prepared.tools],
                parallel=self._max_calls(conv, False) > 1, max_calls=self._max_calls(conv, False),
                specials=specials, limits=limits,
            )
        if fmt.type != "text" and prepared.tools:
            # The reply must be JSON: the model cannot also call tools.
            prepared.tools = []
        if prepared.grammar is not None:
            self._check_grammar(prepared.grammar)

    def _max_calls(self, conv: Conversation, forced: bool) -> int:
        """Calls one turn may make: under a forced tool_choice only an explicit
        ``parallel_tool_calls: true`` allows more than one; under auto only
        an explicit false forbids them."""
        allowed = conv.parallel_tool_calls is True if forced else conv.parallel_tool_calls is not False
        return self.limits.max_parallel_tool_calls if allowed else 1

    def _grammars(self) -> GrammarCompiler:
        # Built on first use (it walks the vocabulary once, ~0.4 s).
        compiler = getattr(self, "_grammar_compiler", None)
        if compiler is None:
            compiler = self._grammar_compiler = GrammarCompiler(self._vocab, self.limits)
        return compiler

    def _check_grammar(self, grammar: str) -> None:
        # Compiles (or finds in the cache) now, so that a grammar llguidance
        # refuses is this request's 400, not a failure mid-generation.
        self._grammars().matcher(grammar)

    # -- generating ----------------------------------------------------------

    async def generate(self, prepared: LlamaPrepared, cancel: CancelToken) -> AsyncIterator[EngineEvent]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[EngineEvent] = asyncio.Queue()

        def emit(event: EngineEvent) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        loop.run_in_executor(self._executor, self._run_safely, prepared, cancel, emit)
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
                # The consumer went away (client disconnect): stop within a token.
                cancel.cancel()

    def _run_safely(self, prepared: LlamaPrepared, cancel: CancelToken, emit: Callable[[EngineEvent], None]) -> None:
        try:
            self._run(prepared, cancel, emit)
        except Exception as exc:  # never leave a stream without its terminal event
            log.exception("generation failed")
            self._llm.n_tokens = 0
            self.cache.set_live(None)  # type: ignore[arg-type]
            emit(Failed("server_error", f"Generation failed: {type(exc).__name__}"))

    def _run(self, prepared: LlamaPrepared, cancel: CancelToken, emit: Callable[[EngineEvent], None]) -> None:
        llm = self._llm
        started = time.perf_counter()
        try:
            plan = self.cache.plan(self._cache_request(prepared))
        except CacheRefused as exc:
            emit(Failed("invalid_request", str(exc)))
            return
        self.cache.before_apply(plan)
        if plan.restore is not None:
            if self._restore(plan.restore):
                self.cache.restored(plan)
            else:
                plan = CachePlan("cold", 0, list(prepared.tokens), prepared.text, detail="restore failed")
        llm.n_tokens = plan.keep
        usage = Usage(input_tokens=plan.keep + len(plan.suffix), cached_tokens=plan.keep)

        if not self._prefill(plan, cancel):
            emit(self._cancelled(cancel, usage))
            return
        prefill_ms = (time.perf_counter() - started) * 1000
        stats = self.stats_
        stats.generations += 1
        stats.last_cache_source = plan.source
        stats.last_cache_detail = plan.detail
        stats.last_reused_tokens = plan.keep
        stats.last_prefilled_tokens = len(plan.suffix)
        stats.last_prefill_ms = prefill_ms
        log.info(
            "generation response=%s cache_source=%s%s reused=%d prefilled=%d prefill_ms=%.1f",
            prepared.response_id, plan.source, f" {plan.detail}" if plan.detail else "",
            plan.keep, len(plan.suffix), prefill_ms,
        )
        _Generation(self, prepared, plan, cancel, emit, usage).run()

    def _prefill(self, plan: CachePlan, cancel: CancelToken) -> bool:
        """Evaluate the plan's suffix in batches, checkpointing long prompts;
        False if cancelled (checked between batches)."""
        llm = self._llm
        every = self.cache_settings.checkpoint_every
        since = 0
        suffix = plan.suffix
        for i in range(0, len(suffix), self._n_batch):
            if cancel.cancelled:
                return False
            batch = suffix[i : i + self._n_batch]
            llm.eval(batch)
            since += len(batch)
            if every and since >= every and i + self._n_batch < len(suffix):
                tokens = llm.input_ids[: llm.n_tokens].tolist()
                self.cache.checkpoint_prefix(tokens, self.detokenize(tokens))
                since = 0
        return True

    def _cache_request(self, prepared: LlamaPrepared) -> CacheRequest:
        conv = prepared.conversation
        return CacheRequest(
            text=prepared.text,
            tokens=prepared.tokens,
            items=conv.items,
            previous_response_id=conv.previous_response_id,
            reuse=prepared.reuse_cache,
            requires_state=prepared.requires_state,
            max_new_tokens=prepared.max_new_tokens,
            needs_reasoning_state=prepared.needs_reasoning_state,
            owner=conv.owner,
        )

    def _restore(self, state: SessionState) -> bool:
        if state.kv is None:
            return False
        llm = self._llm
        if not restore_kv(llm._ctx.ctx, state.kv):
            llm.n_tokens = 0
            return False
        n = len(state.tokens)
        llm.input_ids[:n] = state.tokens
        llm.n_tokens = n
        return True

    def _cancelled(self, cancel: CancelToken, usage: Usage) -> EngineEvent:
        if cancel.reason == "shutdown":
            return Failed("server_shutting_down", "The server is shutting down.", usage)
        return Finished("cancelled", usage)

    def _sampler(self, prepared: LlamaPrepared) -> internals.LlamaSampler | GrammarFirstRejection:
        sampling = prepared.conversation.sampling
        chain = internals.LlamaSampler()
        temperature = 1.0 if sampling.temperature is None else sampling.temperature
        if temperature <= 0:
            chain.add_greedy()
        else:
            top_p = 1.0 if sampling.top_p is None else sampling.top_p
            if top_p < 1.0:
                chain.add_top_p(top_p, 1)
            chain.add_temp(temperature)
            seed = sampling.seed if sampling.seed is not None else random.getrandbits(32)
            chain.add_dist(seed)
        if prepared.grammar is None:
            return chain
        compiler = self._grammars()
        return GrammarFirstRejection(compiler.matcher(prepared.grammar), compiler.tokenizer, self._n_vocab, chain,
                                     prepared.lazy_patterns)

    def piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            buf = self._piece_buf
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            piece = bytes(buf.raw[: max(n, 0)])
            self._pieces[token] = piece
        return piece

    def is_eog(self, token: int) -> bool:
        return llama_cpp.llama_vocab_is_eog(self._vocab, token)

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._llm._model.token_get_text(token)

    # -- the visible transcript --------------------------------------------------

    def _turn_closer(self) -> str | None:
        """What the template writes after an assistant message's content."""
        marker = "\x00lmspd\x00"
        try:
            text = self.template.render(
                [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}],
                add_generation_prompt=False,
            )
        except ApiError:
            return None
        at = text.rfind(marker)
        return text[at + len(marker):] if at >= 0 else None

    def visible_transcript(self, conversation: Conversation, outputs: list[Item], eog_text: str | None) -> str | None:
        """The text a client's replay of this turn renders to, as far as the
        KV covers it (up to the end-of-turn token when one was sampled)."""
        closer = self._closer
        # Only a turn that renders (text or calls) has a transcript to extend.
        if closer is None or not any(isinstance(o, (Message, ToolCall)) for o in outputs):
            return None
        after = dataclasses.replace(conversation, items=list(conversation.items) + outputs)
        try:
            text = self.render(after, add_generation_prompt=False)
        except ApiError:
            return None
        if not text.endswith(closer):
            return None
        body = text[: len(text) - len(closer)]
        if eog_text is not None:
            if not closer.startswith(eog_text):
                return None
            body += eog_text
        return body

    # -- stats and shutdown ------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        s = self.stats_
        c = self.cache.stats
        return {
            "generations": s.generations,
            "last_cache_source": s.last_cache_source,
            "last_cache_detail": s.last_cache_detail,
            "last_reused_tokens": s.last_reused_tokens,
            "last_prefilled_tokens": s.last_prefilled_tokens,
            "last_prefill_ms": round(s.last_prefill_ms, 1),
            "last_output_tokens": s.last_output_tokens,
            "cache": {"enabled": self.cache.enabled, "ram_sessions": c.ram_sessions, "ram_bytes": c.ram_bytes,
                      "disk_checkpoints": len(self.cache.disk) if self.cache.disk else 0,
                      "disk_restores": c.disk_restores, "ram_restores": c.ram_restores},
        }

    def last_output_token_ids(self) -> list[int]:
        return list(self.stats_.last_output_token_ids)

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        # The generation thread owns the KV: it writes the shutdown checkpoint.
        await loop.run_in_executor(self._executor, self.cache.save_live)
        await loop.run_in_executor(None, self.cache.flush)
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._llm.close()


class _Generation:
    """One sampling loop: tokens -> text -> (tool-call parser) -> events."""

    def __init__(self, engine: LlamaEngine, prepared: LlamaPrepared, plan: CachePlan, cancel: CancelToken,
                 emit: Callable[[EngineEvent], None], usage: Usage) -> None:
        self.engine = engine
        self.prepared = prepared
        self.plan = plan
        self.cancel = cancel
        self.emit = emit
        self.usage = usage
        self.parser: ToolCallParser | None = (
            engine.tool_format.parser(prepared.tools, lambda: new_id("call")) if prepared.tools else None
        )
        self.text = ""  # visible text, for the transcript
        self.raw = bytearray()  # everything sampled, for the KV's text
        self.calls: dict[int, ToolCall] = {}
        syntax = engine.reasoning
        self.splitter = ReasoningSplitter(syntax) if syntax is not None else None
        self.reasoning_open = False
        self.forced = 0
        conv = prepared.conversation
        self.budget = BUDGETS.get(conv.reasoning_effort, BUDGETS[None])
        if prepared.grammar is not None and not prepared.lazy_patterns:
            # The reply has a required shape: no free-form thinking first.
            self.budget = 0

    def run(self) -> None:
        engine, llm = self.engine, self.engine._llm
        sampler = engine._sampler(self.prepared)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stops = _StopMatcher(self.prepared.stop)
        ctx = llm._ctx
        reason = "length"
        last_token: int | None = None  # sampled, not yet in the KV
        eog_text: str | None = None
        stopped_by: str | None = None  # the stop sequence that ended the text
        sampled: list[int] = []
        try:
            while len(sampled) < self.prepared.max_new_tokens:
                if self.cancel.cancelled:
                    self._finish_tokens(sampled)
                    self.emit(engine._cancelled(self.cancel, self.usage))
                    self._remember(None)
                    return
                splitter = self.splitter
                if splitter is not None and splitter.in_reasoning and self.usage.reasoning_tokens >= self.budget:
                    self._force_close()
                token = sampler.sample(ctx, -1)
                if engine.is_eog(token):
                    last_token = token
                    eog_text = engine.detokenize([token])
                    reason = "stop"
                    break
                sampled.append(token)
                last_token = token
                if self.splitter is not None and self.splitter.in_reasoning:
                    self.usage.reasoning_tokens += 1
                piece = engine.piece(token)
                self.raw += piece
                text = decoder.decode(piece)
                # Text goes out before the token is evaluated: the client
                # should not wait a decode step for what is already known.
                hit: str | None = None
                if text:
                    text, hit = stops.feed(text)
                    if text:
                        self._text(text)
                if hit:
                    reason, stopped_by = "stop", hit
                if hit or len(sampled) >= self.prepared.max_new_tokens:
                    # The last token's decode step only serves the next
                    # turn's cache: it can wait for the terminal event.
                    break
                llm.eval([token])
                last_token = None
            if stopped_by is None:
                tail = decoder.decode(b"", final=True) + stops.flush()
                if tail:
                    self._text(tail)
            # Cut off by max_output_tokens, a call may be mid-arguments: the
            # response is incomplete (the session closes that call as
            # incomplete), not an invalid call. What the parser still holds
            # is at most the start of call markup, never shown as text.
            if self.splitter is not None:
                self._route(self.splitter.feed("", final=True))
                self._close_reasoning()
            if self.parser is not None and reason != "length":
                self._events(self.parser.finish())
        except ToolCallError as exc:
            self._finish_tokens(sampled)
            self._end(Failed("invalid_tool_call", f"The model produced an invalid tool call: {exc}", self.usage),
                      last_token, eog_text)
            return
        self._finish_tokens(sampled)
        if reason == "stop" and self.calls:
            reason = "tool_calls"
        # Only the client's own stop sequences are named (not the tool
        # format's markers the engine also stops at).
        named = stopped_by if stopped_by in self.prepared.conversation.sampling.stop else None
        self._end(Finished(reason, self.usage, named), last_token, eog_text)  # type: ignore[arg-type]

    def _end(self, terminal: EngineEvent, last_token: int | None, eog_text: str | None) -> None:
        """The live state is set before the terminal event (a client's next
        request may look up its calls the moment it has the reply); the last
        token's decode step comes after it. The engine's next generation is
        queued behind this one on the same executor, so it plans against a
        KV that holds that token."""
        self._remember(eog_text, last_token)
        self.emit(terminal)
        if last_token is not None:
            # Also the end-of-turn token: the next turn's prompt has it right
            # there, so it is prefix the cache can reuse.
            self.engine._llm.eval([last_token])

    def _text(self, text: str) -> None:
        if self.splitter is not None:
            self._route(self.splitter.feed(text))
            return
        self._visible(text)

    def _route(self, pieces: list[tuple[str, str]]) -> None:
        for kind, piece in pieces:
            if kind == "reasoning":
                self.reasoning_open = True
                self.emit(ReasoningDelta(piece))
            else:
                self._close_reasoning()
                self._visible(piece)

    def _close_reasoning(self) -> None:
        if not self.reasoning_open:
            return
        self.reasoning_open = False
        sealed = None
        engine = self.engine
        if self.prepared.conversation.include_encrypted_reasoning and engine.sealer is not None:
            sealed = engine.sealer.seal(engine.info.id, self.splitter.hidden)
        self.emit(ReasoningDone(sealed))

    def _force_close(self) -> None:
        """The thinking budget is spent: write the block's end into the KV."""
        engine, llm = self.engine, self.engine._llm
        text = self.splitter.syntax.forced_close
        tokens = engine.tokenize(text)
        llm.eval(tokens)
        self.forced += len(tokens)
        self.raw += text.encode()
        self._route(self.splitter.feed(text))

    def _visible(self, text: str) -> None:
        if self.parser is None:
            self.text += text
            self.emit(TextDelta(text))
            return
        self._events(self.parser.feed(text))

    def _events(self, events: list[EngineEvent]) -> None:
        for event in events:
            if isinstance(event, TextDelta):
                self.text += event.text
            elif isinstance(event, ToolCallStarted):
                event = self._public_call(event)
                call = ToolCall(call_id=event.call_id, name=event.name, payload="", kind=event.kind,
                                namespace=event.namespace)
                self.calls[event.index] = call
            elif isinstance(event, ToolCallDelta):
                self.calls[event.index].payload += event.delta
            elif isinstance(event, ToolCallDone):
                self.calls[event.index].payload = event.payload
            self.emit(event)

    def _public_call(self, event: ToolCallStarted) -> ToolCallStarted:
        """A namespaced function is offered as ``ns__name``; its call carries
        the namespace and the plain name back."""
        if event.namespace and event.name.startswith(event.namespace + "__"):
            return dataclasses.replace(event, name=event.name[len(event.namespace) + 2:])
        return event

    def _finish_tokens(self, sampled: list[int]) -> None:
        self.usage.output_tokens = len(sampled) + self.forced
        stats = self.engine.stats_
        stats.last_output_tokens = len(sampled)
        stats.last_output_token_ids = sampled

    def _remember(self, eog_text: str | None, pending: int | None = None) -> None:
        """Make what is in the KV, plus the ``pending`` token about to be
        evaluated, the live state."""
        engine, llm = self.engine, self.engine._llm
        outputs: list[Item] = []
        if self.splitter is not None and self.splitter.hidden:
            # The client replays it (without the hidden text unless sealed).
            outputs.append(Reasoning(text=self.splitter.reasoning))
        if self.text:
            outputs.append(Message(role="assistant", text=self.text))
        for index in sorted(self.calls):
            call = self.calls[index]
            if call.namespace:
                call = dataclasses.replace(call, name=f"{call.namespace}__{call.name}")
            outputs.append(call)
        conversation = self.prepared.conversation
        visible = engine.visible_transcript(conversation, outputs, eog_text)
        kv_text = self.plan.base_text + self.raw.decode("utf-8", errors="replace") + (eog_text or "")
        state = SessionState(
            tokens=llm.input_ids[: llm.n_tokens].tolist() + ([pending] if pending is not None else []),
            kv_text=kv_text,
            visible=visible,
            items=list(conversation.items) + outputs,
            call_ids=frozenset(c.call_id for c in self.calls.values()),
            response_id=self.prepared.response_id,
            owner=conversation.owner,
        )
        engine.cache.set_live(state)


def _drop_oldest_turn(conversation: Conversation) -> bool:
    """``truncation: auto``: drop the oldest non-system item; False if none left."""
    items = conversation.items
    for i, item in enumerate(items):
        if isinstance(item, Message) and item.role in ("system", "developer"):
            continue
        # Never leave the conversation without its last item.
        if i == len(items) - 1:
            return False
        del items[i]
        return True
    return False


class _StopMatcher:
    """Stop sequences over streamed text, holding back only a possible prefix."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """The text that is safe to show, and the stop sequence that ended
        it (the earliest in the text), if one did."""
        if not self._stops:
            return text, None
        buf = self._held + text
        found = [(at, stop) for stop in self._stops if (at := buf.find(stop)) >= 0]
        if found:
            at, stop = min(found)
            self._held = ""
            return buf[:at], stop
        keep = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), 0, -1):
                if buf.endswith(stop[:k]):
                    keep = max(keep, k)
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
