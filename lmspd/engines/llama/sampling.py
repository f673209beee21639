"""Sampling under a grammar without paying for the grammar on every token.

llama.cpp's grammar sampler checks each candidate token's text against the
grammar; over the whole vocabulary (49k tokens for SmolLM2) that costs more
than a small model's forward pass. Most tokens a model samples under a
grammar are allowed anyway, so ``GrammarFirstRejection`` does what
llama.cpp's own ``common_sampler`` does: sample from the unconstrained
distribution, ask the grammar about that one token, and only when it is
rejected apply the grammar to the full vocabulary and sample again.

The result has the same distribution as applying the grammar first (an
allowed token is kept with probability p; a rejection resamples from the
allowed tokens, renormalized), and with greedy sampling it is the same
token. A lazy grammar (tool calls under ``tool_choice: auto``) allows
everything until its trigger, so it is free until a call starts.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
from llama_cpp import _internals as internals
from llama_cpp import llama_cpp

__all__ = ["GrammarFirstRejection", "GrammarRejected"]


class GrammarRejected(ValueError):
    """llama.cpp could not build a sampler from the grammar."""


class GrammarFirstRejection:
    def __init__(self, vocab: ctypes.c_void_p, n_vocab: int, gbnf: str, chain: internals.LlamaSampler,
                 lazy_patterns: list[str] | None = None, root: str = "root") -> None:
        if lazy_patterns:
            patterns = (ctypes.c_char_p * len(lazy_patterns))(*(p.encode() for p in lazy_patterns))
            grammar = llama_cpp.llama_sampler_init_grammar_lazy_patterns(
                vocab, gbnf.encode(), root.encode(), patterns, len(lazy_patterns), None, 0)
        else:
            grammar = llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode(), root.encode())
        if not grammar:
            raise GrammarRejected("llama.cpp rejected the grammar")
        self._grammar = grammar
        self._chain = chain
        self._n_vocab = n_vocab
        # One candidate array for the whole vocabulary, reused every token.
        self._data = (llama_cpp.llama_token_data * n_vocab)()
        self._view = np.ctypeslib.as_array(self._data)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._all = llama_cpp.llama_token_data_array(
            data=ctypes.cast(self._data, llama_cpp.llama_token_data_p), size=n_vocab, selected=-1, sorted=False)
        self._one_data = (llama_cpp.llama_token_data * 1)()
        self._one = llama_cpp.llama_token_data_array(
            data=ctypes.cast(self._one_data, llama_cpp.llama_token_data_p), size=1, selected=-1, sorted=False)
        self.rejections = 0

    def sample(self, ctx: internals.LlamaContext, idx: int = -1) -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx.ctx, idx), shape=(self._n_vocab,))
        token = self._pick(logits, constrained=False)
        if not self._allowed(token):
            self.rejections += 1
            token = self._pick(logits, constrained=True)
        llama_cpp.llama_sampler_accept(self._grammar, token)
        self._chain.accept(token)
        return token

    def _pick(self, logits: np.ndarray, *, constrained: bool) -> int:
        view, arr = self._view, self._all
        # Samplers sort and shrink the array in place: restore it whole.
        view["id"] = self._ids
        view["logit"] = logits
        view["p"] = 0.0
        arr.size, arr.selected, arr.sorted = self._n_vocab, -1, False
        if constrained:
            llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(arr))
        llama_cpp.llama_sampler_apply(self._chain.sampler, ctypes.byref(arr))
        return int(self._data[arr.selected].id)

    def _allowed(self, token: int) -> bool:
        one = self._one_data[0]
        one.id, one.logit, one.p = token, 1.0, 0.0
        self._one.size, self._one.selected, self._one.sorted = 1, -1, False
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(self._one))
        return math.isfinite(self._one_data[0].logit)

    def close(self) -> None:
        if self._grammar:
            llama_cpp.llama_sampler_free(self._grammar)
            self._grammar = None
        self._chain.close()

    def __del__(self) -> None:
        self.close()
