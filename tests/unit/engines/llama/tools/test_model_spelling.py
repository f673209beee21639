"""Forced text, spelled the model's way: where a grammar leaves one byte
sequence, the mask the sampler resamples from after a rejection admits
every token that continues it, not only the first token of its canonical
tokenization (matchers: ``_model_spells``). The bundled model's free-text
custom tool depends on it (tests/e2e/test_tools.py::test_custom_tool_free_text)."""

from __future__ import annotations

import numpy as np
import pytest

from lmspd.engines.llama import grammars
from support.grammar_rig import GrammarRig


def allowed(rig: GrammarRig, matcher) -> set[bytes]:
    mask = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return {rig.compiler.tokenizer.decode_bytes([int(t)]) for t in np.flatnonzero(mask[: rig.compiler.n_vocab])}


def token(rig: GrammarRig, piece: str) -> int:
    [t] = rig.tokens(piece)
    return t


def test_a_forced_tag_admits_every_spelling(rig):
    lark = 'start: "<tool_call name=\\"note\\">\\n" /(?s:.*)<\\/tool_call>/\n'
    matcher = rig.compiler.matcher(lark)
    assert matcher.consume_tokens([token(rig, p) for p in ("<", "tool", "_", "call", " name", '="')])
    # Canonically "note" then '">'; the model's own spelling was "not" "e" '"' ">".
    assert {b"note", b"not", b"no", b"n"} <= allowed(rig, matcher)
    assert matcher.consume_tokens([token(rig, "not"), token(rig, "e")])
    assert {b'">', b'"'} <= allowed(rig, matcher)
    assert b"x" not in allowed(rig, matcher)


def test_a_forced_json_key_admits_every_spelling(rig):
    schema = {"type": "object", "properties": {"notebook": {"type": "string"}}, "required": ["notebook"],
              "additionalProperties": False}
    matcher = rig.compiler.matcher(grammars.json_schema_grammar(schema, check=False))
    assert matcher.consume_tokens(rig.tokens('{"'))
    assert {b"note", b"not"} <= allowed(rig, matcher)


@pytest.mark.parametrize("text", ['{"notebook": "a"}', '{"notebook":"a"}'])
def test_the_schema_still_holds(rig, text):
    schema = {"type": "object", "properties": {"notebook": {"type": "string"}}, "required": ["notebook"],
              "additionalProperties": False}
    matcher = rig.compiler.matcher(grammars.json_schema_grammar(schema, check=False))
    assert matcher.consume_tokens(rig.tokens(text)) and matcher.is_accepting()
    other = rig.compiler.matcher(grammars.json_schema_grammar(schema, check=False))
    assert other.validate_tokens(rig.tokens('{"other": "a"}')) < len(rig.tokens('{"other": "a"}'))
