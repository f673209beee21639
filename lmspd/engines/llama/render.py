"""The prompt a model would be fed for a conversation, read from the GGUF's
vocabulary alone: no weights, no context, in a second or so whatever the
model's size (``lmspd render``).

The conversation goes through the engine's own preparation (``ModelText``
and ``Preparation``: the cache repairs, the tool list and calls in the
model's syntax, sealed reasoning, truncation to the window), so the text
and tokens are those a server serving the model evaluates. What only a
running server holds is not there: nothing is remembered (no KV to continue
from), and reasoning sealed by a server stays sealed."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
from llama_cpp import _internals as internals

from lmspd.cache.manager import ContinuationCache, KvOps
from lmspd.core.conversation import Conversation
from lmspd.core.limits import DEFAULT_LIMITS, RequestLimits

from . import native_log
from .fit import asked_window
from .model_text import ModelText
from .preparation import LlamaPrepared, Preparation, Repairs


class PromptRenderer:
    def __init__(self, model_id: str, path: Path, *, chat_template: str | None = None, n_ctx: int | None = None,
                 repairs: Repairs | None = None, limits: RequestLimits = DEFAULT_LIMITS.request) -> None:
        """``n_ctx``: the context window a prompt must fit, as a server's
        ``--ctx`` (None: ``auto``, without the fitting to memory: a server may
        have fitted a shorter one; 0: the model's trained length), padded."""
        llama_cpp.llama_backend_init()
        native_log.install()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = native_log.built(lambda: internals.LlamaModel(path_model=str(path), params=params))
        self.text = ModelText.of(self._model, chat_template)
        # (A vocabulary-only model has no hyperparameters: n_ctx_train is 0.)
        meta = self._model.metadata()
        trained = int(meta.get(f"{meta.get('general.architecture')}.context_length") or 0)
        self.n_ctx = asked_window(n_ctx, trained)
        vocab = self.text.vocab

        # The cache is off: it never asks for these.
        ops = KvOps(capture=lambda seq: b"", restore=lambda seq, data: False, copy=lambda src, dst, n: None,
                    trim=lambda seq, keep: None, tokenize=vocab.tokenize, detokenize=vocab.detokenize,
                    n_ctx=self.n_ctx)
        self._preparation = Preparation(
            model_id=model_id, vocab=vocab, template=self.text.template, tool_format=self.text.tool_format,
            reasoning=self.text.reasoning, cache=ContinuationCache(ops, enabled=False), n_ctx=self.n_ctx,
            limits=limits, sealer=None, repairs=repairs or Repairs())

    def prepare(self, conversation: Conversation) -> LlamaPrepared:
        """As the engine prepares it: raises the same ``ApiError``s (a
        prompt over the window that cannot be truncated, a tool schema the
        grammar cannot express)."""
        return self._preparation.prepare(conversation)

    def close(self) -> None:
        self._preparation.close()
        self._model.close()
