"""The embedded engine: llama.cpp through llama-cpp-python.

One model, one context, one generation at a time on a dedicated thread.
lmspd drives llama.cpp at the token level (render -> tokenize -> reuse the
KV prefix -> prefill the rest -> sample) instead of calling
``create_completion``, because the continuation cache needs to own exactly
which tokens are in the KV.
"""

from __future__ import annotations

import asyncio
import codecs
import ctypes
import json
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

from lmspd.core.conversation import Conversation, Message
from lmspd.core.errors import ApiError
from lmspd.core.events import (
    TERMINAL_EVENTS,
    EngineEvent,
    Failed,
    Finished,
    TextDelta,
    Usage,
)
from lmspd.engines.base import CancelToken, ModelInfo

from .prompt import template_messages
from .template import ChatTemplate

log = logging.getLogger("lmspd.engine")


@dataclass
class LlamaPrepared:
    conversation: Conversation
    text: str
    tokens: list[int]
    max_new_tokens: int
    # True when max_output_tokens (not the context window) caps the output.
    capped_by_request: bool
    grammar: str | None = None
    stop: list[str] = field(default_factory=list)

    @property
    def input_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class GenerationStats:
    """What the last generation cost; also read by tests and benchmarks."""

    generations: int = 0
    last_cache_source: str = "cold"
    last_reused_tokens: int = 0
    last_prefilled_tokens: int = 0
    last_prefill_ms: float = 0.0
    last_output_tokens: int = 0


class LlamaEngine:
    def __init__(
        self,
        model_id: str,
        path: Path,
        *,
        n_ctx: int = 0,
        n_threads: int | None = None,
        n_batch: int = 512,
    ) -> None:
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
        self._n_batch = n_batch
        meta = llm.metadata
        self.template = ChatTemplate(
            meta.get("tokenizer.chat_template"),
            bos_token=self._token_text(llm.token_bos()),
            eos_token=self._token_text(llm.token_eos()),
        )
        self.tool_format = None  # set by the tool-format registry (issue 3)
        self.info = ModelInfo(
            id=model_id,
            context_window=llm.n_ctx(),
            capabilities={
                "streaming": True,
                "tools": self.tool_format is not None,
                "structured_output": True,
                "reasoning": False,
            },
            source=str(path),
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmspd-llama")
        self._pieces: dict[int, bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)
        self.stats_ = GenerationStats()

    # -- preparing -----------------------------------------------------------

    def render(self, conversation: Conversation) -> str:
        messages, tools = template_messages(conversation, self.template, self.tool_format)
        return self.template.render(messages, tools=tools, add_generation_prompt=True)

    def tokenize(self, text: str) -> list[int]:
        # The template already wrote any BOS it wants; special=True so that
        # markers like <|im_start|> become their single tokens.
        return self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def count_tokens(self, conversation: Conversation) -> int:
        return len(self.tokenize(self.render(conversation)))

    def prepare(self, conversation: Conversation) -> LlamaPrepared:
        n_ctx = self.info.context_window
        text = self.render(conversation)
        tokens = self.tokenize(text)
        requested = conversation.max_output_tokens
        while conversation.truncate and len(tokens) + (requested or 1) > n_ctx:
            dropped = _drop_oldest_turn(conversation)
            if not dropped:
                break
            text = self.render(conversation)
            tokens = self.tokenize(text)
        room = n_ctx - len(tokens)
        if requested is not None and requested > room or room < 1:
            need = len(tokens) + (requested or 1)
            raise ApiError(
                "context_length_exceeded",
                f"This request needs {need} tokens ({len(tokens)} of input"
                + (f" + {requested} max_output_tokens" if requested else "")
                + f") but the model's context window is {n_ctx} tokens.",
                param="max_output_tokens" if requested and len(tokens) < n_ctx else "input",
            )
        grammar = self._output_grammar(conversation)
        return LlamaPrepared(
            conversation=conversation,
            text=text,
            tokens=tokens,
            max_new_tokens=requested if requested is not None else room,
            capped_by_request=requested is not None,
            grammar=grammar,
            stop=list(conversation.sampling.stop),
        )

    def _output_grammar(self, conversation: Conversation) -> str | None:
        fmt = conversation.output_format
        if fmt.type == "text":
            return None
        from llama_cpp import llama_grammar

        if fmt.type == "json_object" or not fmt.schema:
            return llama_grammar.JSON_GBNF
        return llama_grammar.json_schema_to_gbnf(json.dumps(fmt.schema))

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
            emit(Failed("server_error", f"Generation failed: {type(exc).__name__}"))

    def _run(self, prepared: LlamaPrepared, cancel: CancelToken, emit: Callable[[EngineEvent], None]) -> None:
        llm = self._llm
        tokens = prepared.tokens
        usage = Usage(input_tokens=len(tokens))
        started = time.perf_counter()

        reused = self._reuse_prefix(tokens)
        # Prefill in batches so that a cancel (or shutdown) is seen between them.
        for i in range(reused, len(tokens), self._n_batch):
            if cancel.cancelled:
                emit(self._cancelled(cancel, usage))
                return
            llm.eval(tokens[i : i + self._n_batch])
        prefill_ms = (time.perf_counter() - started) * 1000
        usage.cached_tokens = reused
        stats = self.stats_
        stats.generations += 1
        stats.last_cache_source = "memory-token" if reused else "cold"
        stats.last_reused_tokens = reused
        stats.last_prefilled_tokens = len(tokens) - reused
        stats.last_prefill_ms = prefill_ms
        log.info(
            "generation cache_source=%s reused=%d prefilled=%d prefill_ms=%.1f",
            stats.last_cache_source, reused, len(tokens) - reused, prefill_ms,
        )

        sampler = self._sampler(prepared)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stops = _StopMatcher(prepared.stop)
        ctx = llm._ctx
        reason = "length"
        stopped_by_string = False
        n_out = 0
        while n_out < prepared.max_new_tokens:
            if cancel.cancelled:
                usage.output_tokens = n_out
                self.stats_.last_output_tokens = n_out
                emit(self._cancelled(cancel, usage))
                return
            token = sampler.sample(ctx, -1)
            if llama_cpp.llama_vocab_is_eog(self._vocab, token):
                # Keep the end-of-turn marker in the KV: the next turn's prompt
                # has it right there, so it is prefix the cache can reuse.
                llm.eval([token])
                reason = "stop"
                break
            n_out += 1
            text = decoder.decode(self._piece(token))
            if text:
                text, hit = stops.feed(text)
                if text:
                    emit(TextDelta(text))
                if hit:
                    reason, stopped_by_string = "stop", True
                    break
            llm.eval([token])
        if not stopped_by_string:
            tail = decoder.decode(b"", final=True) + stops.flush()
            if tail:
                emit(TextDelta(tail))
        usage.output_tokens = n_out
        self.stats_.last_output_tokens = n_out
        emit(Finished(reason, usage))

    def _cancelled(self, cancel: CancelToken, usage: Usage) -> EngineEvent:
        if cancel.reason == "shutdown":
            return Failed("server_shutting_down", "The server is shutting down.", usage)
        return Finished("cancelled", usage)

    def _reuse_prefix(self, tokens: list[int]) -> int:
        """Keep the KV's longest common prefix with ``tokens``; return its length."""
        llm = self._llm
        live = llm.input_ids[: llm.n_tokens]
        common = 0
        limit = min(len(live), len(tokens))
        while common < limit and live[common] == tokens[common]:
            common += 1
        # At least one token must be evaluated to get fresh logits.
        common = min(common, len(tokens) - 1)
        llm.n_tokens = common
        return common

    def _sampler(self, prepared: LlamaPrepared) -> internals.LlamaSampler:
        sampling = prepared.conversation.sampling
        sampler = internals.LlamaSampler()
        if prepared.grammar is not None:
            sampler.add_grammar(self._llm._model, llama_cpp.LlamaGrammar.from_string(prepared.grammar, verbose=False))
        temperature = 1.0 if sampling.temperature is None else sampling.temperature
        if temperature <= 0:
            sampler.add_greedy()
            return sampler
        top_p = 1.0 if sampling.top_p is None else sampling.top_p
        if top_p < 1.0:
            sampler.add_top_p(top_p, 1)
        sampler.add_temp(temperature)
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(32)
        sampler.add_dist(seed)
        return sampler

    def _piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            buf = self._piece_buf
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            piece = bytes(buf.raw[: max(n, 0)])
            self._pieces[token] = piece
        return piece

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._llm._model.token_get_text(token)

    def stats(self) -> dict[str, Any]:
        s = self.stats_
        return {
            "generations": s.generations,
            "last_cache_source": s.last_cache_source,
            "last_reused_tokens": s.last_reused_tokens,
            "last_prefilled_tokens": s.last_prefilled_tokens,
            "last_output_tokens": s.last_output_tokens,
        }

    async def aclose(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._llm.close()


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

    def feed(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        buf = self._held + text
        for stop in self._stops:
            at = buf.find(stop)
            if at >= 0:
                self._held = ""
                return buf[:at], True
        keep = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), 0, -1):
                if buf.endswith(stop[:k]):
                    keep = max(keep, k)
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
