"""Fixtures of the cache unit tests (helpers: tests/support/cache_rig.py)."""

from __future__ import annotations

import llama_cpp
import pytest

from support.cache_rig import GGUF, make_cache


@pytest.fixture(scope="module")
def vocab():
    """The bundled model's tokenizer only (no weights, no context)."""
    return llama_cpp.Llama(str(GGUF), vocab_only=True, verbose=False)


@pytest.fixture
def cache(vocab):
    return make_cache(vocab)
