"""FragmentTokenizer: llama.cpp's tokens for a prompt (special tokens on),
with the cut at special tokens done in one pass and each fragment of text
between them tokenized once. Checked against llama.cpp itself on both
bundled vocabularies (SmolLM2: 17 control tokens; Gemma 3: 6,414 special
tokens, among them runs of newlines and of spaces that contain each other)."""

from __future__ import annotations

import re

import llama_cpp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmspd.engines.llama.client_text import llama_tokenize
from lmspd.engines.llama.fragments import FragmentTokenizer, _trie_pattern, exact_cut
from lmspd.engines.llama.models import resolve_model
from support.cache_rig import GGUF

GEMMA = "gemma3-270m"


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def vocab(request):
    # Gemma 3 270M is assembled by ./dev.sh test (the e2e tests need it too): missing, this fails.
    path = GGUF if request.param == "smollm2" else resolve_model(GEMMA)[1]
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    yield llm._model.vocab  # llm owns the model: held until the module is done
    llm.close()


@pytest.fixture(scope="module")
def fragments(vocab):
    return FragmentTokenizer(vocab)


@pytest.fixture(scope="module")
def specials(vocab) -> list[str]:
    out = []
    for token in range(llama_cpp.llama_vocab_n_tokens(vocab)):
        if llama_cpp.llama_vocab_get_attr(vocab, token) & (1 | 8 | 16):
            out.append(llama_cpp.llama_vocab_get_text(vocab, token).decode("utf-8"))
    return out


# Pieces a prompt is made of: template markers come from the vocabulary;
# runs of newlines and spaces (special tokens in Gemma's vocabulary), code,
# non-ASCII text, and pieces of a marker's spelling.
PLAIN = ["hello", " world", "\n", "\n\n", "\n\n\n", "  ", "    ", "   x", "\t", "é", "日本語", "\u00a0", "<", "|", ">",
         "im_", "start", "_of_turn", "def f(x):\n    return x\n", "{\"path\": \"a.py\"}", "0123456789"]


def test_the_bundled_vocabularies_are_cut_here_not_by_llama_cpp(fragments) -> None:
    assert fragments.fallback is None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_tokens_are_llama_cpps_for_any_text(vocab, fragments, specials, data) -> None:
    common = [t for t in specials if not t.startswith("<unused")][:64] + specials[-3:]
    pieces = data.draw(st.lists(st.sampled_from(PLAIN + common) | st.text(max_size=6), max_size=40))
    text = "".join(pieces)
    assert fragments.tokenize(text) == llama_tokenize(vocab, text)
    # Again, from the fragment cache.
    assert fragments.tokenize(text) == llama_tokenize(vocab, text)


def test_a_prompt_sent_again_tokenizes_only_its_new_fragments(vocab, specials) -> None:
    fragments = FragmentTokenizer(vocab)
    calls: list[bytes] = []
    real = fragments._llama_tokenize
    fragments._llama_tokenize = lambda v, raw, special: calls.append(raw) or real(v, raw, special)
    marker = next(t for t in specials if t in ("<|im_start|>", "<start_of_turn>"))
    turn = f"{marker}user Read a.py and fix the off-by-one.{marker}model Done."
    first = fragments.tokenize(turn)
    assert calls == [turn.removeprefix(marker).encode()]  # one llama.cpp call for what was new
    calls.clear()
    assert fragments.tokenize(turn + f"{marker}user Thanks.") == first + llama_tokenize(vocab, f"{marker}user Thanks.")
    assert calls == [b"user Thanks."]


def test_the_fragment_cache_stays_within_its_bound(vocab, specials) -> None:
    fragments = FragmentTokenizer(vocab, cache_bytes=600, fragment_bytes=200)
    marker = next(t for t in specials if t in ("<|im_start|>", "<start_of_turn>"))
    for i in range(200):
        text = f"{marker}message {i} " + "word " * (i % 50)
        assert fragments.tokenize(text) == llama_tokenize(vocab, text)
        assert fragments.held_bytes <= 600
    calls: list[bytes] = []
    real = fragments._llama_tokenize
    fragments._llama_tokenize = lambda v, raw, special: calls.append(raw) or real(v, raw, special)
    big = "x " * 150  # over fragment_bytes: tokenized each time, never kept
    fragments.tokenize(big)
    fragments.tokenize(big)
    assert len(calls) == 2


# -- the cut itself, without a model ----------------------------------------------------


def leftmost_longest(texts: list[bytes], raw: bytes) -> list[tuple[int, int]]:
    found, at = [], 0
    while at < len(raw):
        hits = [t for t in texts if raw.startswith(t, at)]
        if hits:
            n = max(map(len, hits))
            found.append((at, at + n))
            at += n
        else:
            at += 1
    return found


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(st.text(alphabet="ab<>", min_size=1, max_size=4).map(str.encode), min_size=1, max_size=6,
                      unique=True),
       raw=st.text(alphabet="ab<>x", max_size=30).map(str.encode))
def test_the_trie_pattern_finds_the_leftmost_longest_text(texts, raw) -> None:
    pattern = _trie_pattern(texts)
    assert [m.span() for m in pattern.finditer(raw)] == leftmost_longest(texts, raw)


@pytest.mark.parametrize(("texts", "why"), [
    ([b"<|im_start|>", b"<|im_end|>", b"<|endoftext|>"], None),
    ([b"\n", b"\n\n", b"\n\n\n", b"  ", b"   ", b"<start_of_turn>"], None),
    ([b"<a>", b"x<a>y"], "contains"),
    ([b"ab", b"bc"], "overlaps"),
    ([b"abab"], "overlaps"),
    ([b"\n", b"\n<x>"], "contains"),
    ([b"\n\n", b"\n<x>"], "overlaps"),
    ([b""], "no text"),
])
def test_the_cut_is_taken_over_only_where_it_cuts_as_llama_cpp_does(texts, why) -> None:
    reason = exact_cut(dict.fromkeys(texts))
    if why is None:
        assert reason is None
    else:
        assert reason is not None and re.search(why, reason)


def test_a_prompt_over_the_bound_is_cut_by_llama_cpp_without_the_gil_held_here(vocab, specials, monkeypatch) -> None:
    from lmspd.engines.llama import fragments as module

    monkeypatch.setattr(module, "PROMPT_BYTES", 100)
    fragments = FragmentTokenizer(vocab)
    calls: list[tuple[bytes, bool]] = []
    real = fragments._llama_tokenize
    fragments._llama_tokenize = lambda v, raw, special: calls.append((raw, special)) or real(v, raw, special)
    text = specials[0].join(["a few words"] * 20)
    assert fragments.tokenize(text) == llama_tokenize(vocab, text)
    assert calls == [(text.encode(), True)] and fragments.held_bytes == 0
