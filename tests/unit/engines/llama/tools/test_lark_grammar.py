"""Custom tools' Lark and regex grammars, compiled by llguidance and checked
through the engine's own matcher (raw input under lmspd's fallback syntax,
the decoded string under a JSON syntax)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmspd.core.conversation import CustomTool
from lmspd.core.errors import ApiError
from lmspd.engines.llama.grammars import tool_call_grammar
from lmspd.engines.llama.tool_formats import FallbackFormat, HermesFormat
from support.clients import CODEX_CAPTURES

CODEX_REQUEST = CODEX_CAPTURES / "gpt-5.5_reasoning_apply_patch" / "001-POST-v1_responses-request.json"

# The grammar Codex sends for apply_patch (what the capture holds, checked below).
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
    body = json.loads(CODEX_REQUEST.read_text())["body"]
    custom = [t for t in body["tools"] if t.get("type") == "custom"]
    assert custom[0]["format"]["definition"] == APPLY_PATCH


def _raw(syntax: str, definition: str) -> str:
    return tool_call_grammar(FallbackFormat(), [CustomTool("t", None, {"syntax": syntax, "definition": definition})])


def _call(text: str) -> str:
    return f'<tool_call name="t">\n{text}\n</tool_call>'


def test_apply_patch_compiles_and_constrains(rig) -> None:
    grammar = _raw("lark", APPLY_PATCH)
    assert rig.compiles(grammar)
    for patch in PATCHES:
        assert rig.accepts(grammar, _call(patch)), patch
    for text in NOT_PATCHES:
        assert not rig.accepts(grammar, _call(text)), text


LARK_CASES = [
    # (grammar, accepted, rejected)
    ('start: "a"i "b".."d"~2 ["x"] ("y" | "z")+', ["Acdy", "abbxzz"], ["ab", "acdxq", "Bcdy"]),
    ("start: NUMBER (\",\" NUMBER)*\n%import common.NUMBER", ["1", "1.5,2e3,.5"], ["", "1,", "a"]),
    ("start: pair+\npair: CNAME \"=\" ESCAPED_STRING \";\"\n%import common (CNAME, ESCAPED_STRING)", ['a="x\\"y";b_1="";'], ['a="x";1="";', 'a="x']),
    ("start: WORD (\",\" WORD)*\n%import common.WORD\n%import common.WS\n%ignore WS", ["a,b", "a , b  ,c"], [",a", "a,,b", "a b"]),
    ("start: expr\nexpr: term (\"+\" term)*\nterm: /[0-9]+/ | \"(\" expr \")\"", ["1+(2+3)", "((4))"], ["1+", "(1"]),
    ("?start: _item*\n_item: A | B\nA: /a+/\nB: /b/\n// comment\n", ["", "aab", "bab"], ["c"]),
    ("start: /(?i:ab)c/ /\\d{2,3}/ /[^\\n\\]]/", ["ABc12x", "aBc12y"], ["abC12x", "abc1x", "abc12\n"]),
    ("start: C_COMMENT\n%import common.C_COMMENT", ["/* a * b */", "/***/"], ["/* a */ */", "/* a"]),
    # Left recursion and templates: Earley parsing takes them.
    ("start: start \"a\" | \"b\"", ["b", "baa"], ["a", "ab"]),
]


@pytest.mark.parametrize("grammar, accepted, rejected", LARK_CASES)
def test_lark_constructs(rig, grammar: str, accepted: list[str], rejected: list[str]) -> None:
    compiled = _raw("lark", grammar)
    for text in accepted:
        assert rig.accepts(compiled, _call(text)), (text, grammar)
    for text in rejected:
        assert not rig.accepts(compiled, _call(text)), (text, grammar)


@pytest.mark.parametrize(
    "grammar, line",
    [
        ("start: a\n%declare a", 2),
        ("start: \"x\"\n  | /a(?=b)/", 1),
        ("start: A\nA.2: /a+/", 2),
        ("start: /(a)\\1/", 1),
        ("start: \"x\" item\nitem: missing", 2),
        ("item: \"a\"", None),
        ("start: NAME\n%import python.NAME", 2),
    ],
)
def test_unsupported_constructs_are_a_400_naming_the_line(grammar: str, line: int | None) -> None:
    with pytest.raises(ApiError) as info:
        _raw("lark", grammar)
    err = info.value
    assert err.status == 400 and err.param == "tools.t.format.definition"
    if line is not None:
        assert f"line {line}," in err.message, err.message


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


_COMPILED: dict[tuple[str, str], str] = {}


def _regex_grammar(pattern: str, json_syntax: bool) -> str:
    key = (pattern, str(json_syntax))
    if key not in _COMPILED:
        fmt = HermesFormat(True) if json_syntax else FallbackFormat()
        _COMPILED[key] = tool_call_grammar(fmt, [CustomTool("t", None, {"syntax": "regex", "definition": pattern})])
    return _COMPILED[key]


@pytest.mark.parametrize("pattern", REGEXES)
@settings(max_examples=40, deadline=None)
@given(text=st.lists(_alphabet, max_size=6).map("".join))
def test_regex_matches_what_python_matches(rig, pattern: str, text: str) -> None:
    if text.endswith("\n") or "\n</tool_call>" in text:
        return  # the newline before the closing tag is syntax
    expected = bool(re.fullmatch(pattern, text, _flags(pattern)))
    assert rig.accepts(_regex_grammar(pattern, False), _call(text)) == expected


@pytest.mark.parametrize("pattern", REGEXES)
@settings(max_examples=25, deadline=None)
@given(text=st.lists(_alphabet, max_size=6).map("".join))
def test_regex_in_json_string_mode(rig, pattern: str, text: str) -> None:
    call = '<tool_call>\n{"name": "t", "arguments": ' + json.dumps({"input": text}, ensure_ascii=False) + "}\n</tool_call>"
    expected = bool(re.fullmatch(pattern, text, _flags(pattern)))
    assert rig.accepts(_regex_grammar(pattern, True), call) == expected
