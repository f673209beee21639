"""Lark and regex grammars converted to GBNF, checked with llama.cpp's parser."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.engines.llama.lark import LarkUnsupported, lark_to_gbnf, regex_to_gbnf

CODEX_REQUEST = Path("/work/shared/clients/codex-cli/captured/gpt-5.5_reasoning_apply_patch/001-POST-v1_responses-request.json")

# The grammar Codex sends for apply_patch (kept here too, so the test does
# not depend on the capture being present).
APPLY_PATCH = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
'''

PATCHES = [
    "*** Begin Patch\n*** Update File: src/app.py\n@@ def main():\n-    print('hi')\n+    print(\"hello\")\n*** End Patch\n",
    "*** Begin Patch\n*** Add File: docs/é.md\n+# Title\n+\n+tab\there\n*** Delete File: old.txt\n*** End Patch",
    "*** Begin Patch\n*** Update File: a\n*** Move to: b\n@@\n x\n-y\n+z\n*** End of File\n*** End Patch\n",
]
NOT_PATCHES = ["hello", "*** Begin Patch\n*** End Patch\n", "*** Begin Patch\n*** Add File: x\n*** End Patch\n"]


def test_codex_capture_matches_the_grammar_here() -> None:
    if not CODEX_REQUEST.exists():
        pytest.skip("capture not available")
    body = json.loads(CODEX_REQUEST.read_text())["body"]
    custom = [t for t in body["tools"] if t.get("type") == "custom"]
    assert custom[0]["format"]["definition"] == APPLY_PATCH


def test_apply_patch_converts_compiles_and_constrains(rig) -> None:
    gbnf = lark_to_gbnf(APPLY_PATCH).grammar()
    assert rig.compiles(gbnf)
    for patch in PATCHES:
        assert rig.accepts(gbnf, patch), patch
    for text in NOT_PATCHES:
        assert not rig.accepts(gbnf, text), text


def test_apply_patch_inside_a_json_string(rig) -> None:
    gbnf = lark_to_gbnf(APPLY_PATCH, json_string=True).grammar()
    assert rig.compiles(gbnf)
    for patch in PATCHES:
        assert rig.accepts(gbnf, json.dumps(patch, ensure_ascii=False)[1:-1]), patch
        # The raw (unescaped) newline is not allowed inside a JSON string.
        assert not rig.accepts(gbnf, patch)


LARK_CASES = [
    # (grammar, accepted, rejected)
    ('start: "a"i "b".."d"~2 ["x"] ("y" | "z")+', ["Acdy", "abbxzz"], ["ab", "acdxq", "Bcdy"]),
    ("start: NUMBER (\",\" NUMBER)*\n%import common.NUMBER", ["1", "1.5,2e3,.5"], ["", "1,", "a"]),
    ("start: pair+\npair: CNAME \"=\" ESCAPED_STRING \";\"\n%import common (CNAME, ESCAPED_STRING)", ['a="x\\"y";b_1="";'], ['a="x";1="";', 'a="x']),
    ("start: WORD (\",\" WORD)*\n%import common.WORD\n%import common.WS\n%ignore WS", ["a,b", " a , b  ,c "], [",a", "a,,b", "a b"]),
    ("start: expr\nexpr: term (\"+\" term)*\nterm: /[0-9]+/ | \"(\" expr \")\"", ["1+(2+3)", "((4))"], ["1+", "(1"]),
    ("?start: _item*\n_item: A | B\nA.2: /a+/\nB: /b/\n// comment\n", ["", "aab", "bab"], ["c"]),
    ("start: /(?i:ab)c/ /\\d{2,3}/ /[^\\n\\]]/", ["ABc12x", "aBc123]"[:6] + "y"], ["abC12x", "abc1x", "abc12\n"]),
    ("start: C_COMMENT\n%import common.C_COMMENT", ["/* a * b */", "/***/"], ["/* a */ */", "/* a"]),
]


@pytest.mark.parametrize("grammar, accepted, rejected", LARK_CASES)
def test_lark_constructs(rig, grammar: str, accepted: list[str], rejected: list[str]) -> None:
    gbnf = lark_to_gbnf(grammar).grammar()
    assert rig.compiles(gbnf), gbnf
    for text in accepted:
        assert rig.accepts(gbnf, text), (text, gbnf)
    for text in rejected:
        assert not rig.accepts(gbnf, text), (text, gbnf)


@pytest.mark.parametrize(
    "grammar, construct",
    [
        ("start: _sep{x, \",\"}\n_sep{a, b}: a (b a)*\nx: \"x\"", "template"),
        ("start: a\n%declare a", "%declare"),
        ("start: /a(?=b)/", "regex construct"),
        ("start: /(a)\\1/", "regex construct"),
        ("start: /a\\bb/", "anchor"),
        ("start: start \"a\" | \"b\"", "left recursion"),
        ("start: a\na: b? a \"x\" | \"y\"\nb: \"b\"", "left recursion"),
        ("start: missing", "undefined symbol"),
        ("item: \"a\"", "no 'start' rule"),
        ("start: NAME\n%import python.NAME", "%import"),
        ("start: \"a\"\nstart: \"b\"", "duplicate"),
        ("start: /a{2000}/", "repetition"),
    ],
)
def test_unsupported_constructs_raise(grammar: str, construct: str) -> None:
    with pytest.raises(LarkUnsupported) as info:
        lark_to_gbnf(grammar)
    assert construct in info.value.construct


REGEXES = [
    r"a[bc]*d?",
    r"(ab|c)+",
    r"\d{2,4}-\w",
    r"\W\S\D",
    r"[^a-c\s]x{0,2}",
    r"(?i)hé",
    r".\..",
    r"[-+]?[0-9]+(\.[0-9]+)?",
    r"[\]\\\-^]+",
]
_alphabet = st.sampled_from(list("abcdhHéÉ-+.0123 \n\\]^x_"))


def _flags(pattern: str) -> int:
    # \d \w \s are converted with their ASCII (ECMAScript) meaning.
    return re.ASCII if re.search(r"\\[dwsDWS]", pattern) else 0


@pytest.mark.parametrize("pattern", REGEXES)
@settings(max_examples=40, deadline=None)
@given(text=st.lists(_alphabet, max_size=6).map("".join))
def test_regex_matches_what_python_matches(rig, pattern: str, text: str) -> None:
    gbnf = f"root ::= {regex_to_gbnf(pattern)}"
    assert rig.accepts(gbnf, text) == bool(re.fullmatch(pattern, text, _flags(pattern)))


@pytest.mark.parametrize("pattern", REGEXES)
@settings(max_examples=25, deadline=None)
@given(text=st.lists(_alphabet, max_size=6).map("".join))
def test_regex_in_json_string_mode(rig, pattern: str, text: str) -> None:
    gbnf = f"root ::= {regex_to_gbnf(pattern, json_string=True)}"
    encoded = json.dumps(text, ensure_ascii=False)[1:-1]
    assert rig.accepts(gbnf, encoded) == bool(re.fullmatch(pattern, text, _flags(pattern)))


def test_search_semantics_for_unanchored_patterns(rig) -> None:
    gbnf = f"root ::= {regex_to_gbnf('ab', search=True)}"
    assert rig.accepts(gbnf, "xxabyy") and not rig.accepts(gbnf, "xaxb")
    anchored = f"root ::= {regex_to_gbnf('^ab', search=True)}"
    assert rig.accepts(anchored, "abyy") and not rig.accepts(anchored, "xab")
