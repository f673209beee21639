"""A tool format's special markers are looked up in the vocabulary once per
model, not at every request's preparation (~0.2 ms of each short request's
time to first token). The bundled model's vocabulary."""

from __future__ import annotations

from lmspd.engines.llama.tool_formats import HarmonyFormat


class Counting:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls = 0

    def tokenize_str(self, text, parse_special=False):
        self.calls += 1
        return self.tokenizer.tokenize_str(text, parse_special=parse_special)

    def is_special_token(self, token):
        return self.tokenizer.is_special_token(token)


def test_the_special_markers_of_a_tool_format_are_tokenized_once(rig, monkeypatch):
    compiler = rig.compiler
    counting = Counting(compiler.tokenizer)
    monkeypatch.setattr(compiler, "tokenizer", counting)
    monkeypatch.setattr(compiler, "_specials", {})
    fmt = HarmonyFormat(True)
    first = compiler.special_markers(fmt.markers)
    calls = counting.calls
    assert calls == len(tuple(fmt.markers))
    assert all(compiler.special_markers(fmt.markers) == first for _ in range(5))
    assert counting.calls == calls
    other = compiler.special_markers(["<|im_start|>", "plain text"])
    assert other == frozenset({"<|im_start|>"}), "another marker set is looked up on its own"
