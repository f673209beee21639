"""Forced text, canonical or the model's own spelling (grammars:
``_NO_FORCING``): in a grammar whose every call is a free-text custom tool
the mask the sampler resamples from after a rejection admits every token
that continues the forced markup; elsewhere llguidance's canonical first
token alone. The bundled model's free-text custom tool depends on the
first (tests/e2e/test_tools.py::test_custom_tool_free_text)."""

from __future__ import annotations

import numpy as np

from lmspd.core.conversation import CustomTool, FunctionTool
from lmspd.engines.llama import grammars
from lmspd.engines.llama.tool_formats.fallback import FallbackFormat
from support.grammar_rig import GrammarRig

NOTE = CustomTool("note", "Write a short note.")
NOTEBOOK = FunctionTool("notebook", "Open a notebook.", {"type": "object", "properties": {}})


def allowed(rig: GrammarRig, matcher) -> set[bytes]:
    mask = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return {rig.compiler.tokenizer.decode_bytes([int(t)]) for t in np.flatnonzero(mask[: rig.compiler.n_vocab])}


def opened(rig: GrammarRig, tools, text: str):
    matcher = rig.compiler.matcher(grammars.tool_call_grammar(FallbackFormat(), tools, check=False))
    assert matcher.consume_tokens(rig.tokens(text))
    return matcher


def test_a_free_text_custom_tools_tag_admits_every_spelling(rig):
    matcher = opened(rig, [NOTE], '<tool_call name="')
    # Canonically "note" then '">'; the model's own spelling was "not" "e" '"' ">".
    assert {b"note", b"not", b"no", b"n"} <= allowed(rig, matcher)
    assert matcher.consume_tokens(rig.tokens("not") + rig.tokens("e"))
    assert {b'">', b'"'} <= allowed(rig, matcher)
    assert b"x" not in allowed(rig, matcher)


def test_a_function_call_keeps_the_canonical_spelling(rig):
    matcher = opened(rig, [NOTEBOOK], '<tool_call>\n{"name": "')
    assert allowed(rig, matcher) == {b"note"}
    schema = {"type": "object", "properties": {"notebook": {"type": "string"}}, "required": ["notebook"]}
    matcher = rig.compiler.matcher(grammars.json_schema_grammar(schema, check=False))
    assert matcher.consume_tokens(rig.tokens('{"'))
    assert allowed(rig, matcher) == {b"note"}
