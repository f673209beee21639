"""Lark grammars and regular expressions, converted to llama.cpp GBNF.

Codex declares ``apply_patch`` as a custom tool whose input must match a Lark
grammar; JSON Schema ``pattern`` and custom tools with ``syntax: regex`` carry
regular expressions. Both become GBNF here so that sampling can enforce them.

The conversion reads a Lark grammar as a character-level context-free
grammar: every rule and terminal becomes a GBNF rule, and regex terminals are
inlined as regular sub-grammars. Whatever the GBNF accepts, the Lark grammar
accepts (the GBNF may be stricter, never looser), with one exception noted
below under "lexing".

Converted:

- rules (``name: ...``, with ``?``/``!`` modifiers, which do not change the
  language) and terminals (``NAME: ...``), priorities (``.N``, ignored);
- alternatives ``|`` (also on continuation lines), sequences, groups ``( )``,
  optional ``[ ]``, ``?`` ``*`` ``+``, ``~ n`` and ``~ n..m``, aliases
  ``-> name`` (ignored);
- string literals, with the ``i`` flag (ASCII case folding), and character
  ranges ``"a".."z"``;
- regex terminals ``/.../flags`` of the regular kinds: literals, ``.``,
  classes ``[...]``/``[^...]``, ``\\d \\w \\s`` and their negations (ASCII
  meaning, as in ECMAScript), groups (capturing, ``(?:``, named), ``|``,
  greedy/lazy/possessive quantifiers (laziness does not change a language),
  ``^``/``$`` at the ends only, flags ``i`` ``s`` ``x`` ``m`` ``u``;
- ``%import common.X`` / ``%import common (X, Y)`` / ``-> alias`` for Lark's
  common terminals (DIGIT, INT, NUMBER, WORD, CNAME, WS, LF, NEWLINE,
  ESCAPED_STRING, comments, ...);
- ``%ignore X``: Lark skips X between any two tokens. The GBNF allows any
  number of X between the items of a rule (never inside a terminal) and
  around the start rule; a run of X then splits between neighbouring slots
  in several ways, which llama.cpp handles by keeping several stacks.

Raise ``LarkUnsupported`` (the caller then constrains to free text instead):

- templates (``_sep{x, y}``), ``%declare``, ``%override``, ``%extend``,
  imports from modules other than ``common``;
- lookarounds, backreferences, ``\\b``/``\\B``, conditionals, atomic
  groups, anchors inside a pattern, bounded repetitions above 1000;
- left recursion (llama.cpp rejects it), undefined symbols, a missing
  ``start`` rule, grammars larger than the request limits allow.

Lexing: Lark tokenizes with longest match and terminal priorities before
parsing; the GBNF is the plain context-free language and does not model
that. For grammars such as ``apply_patch`` (whose terminals are delimited
by literals and line ends) both agree.

In ``json_string`` mode the output constrains the *JSON-encoded* form of the
text (the inside of a JSON string): literals and classes are escaped as
JSON requires, so a custom tool wrapped as ``{"input": "..."}`` for a native
tool-call format is still constrained by its grammar.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
try:  # Python 3.11+ keeps the regex parser here.
    from re import _constants as _sre  # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

from lmspd.core.limits import DEFAULT_LIMITS

__all__ = [
    "LarkUnsupported",
    "GbnfFragment",
    "lark_to_gbnf",
    "regex_to_gbnf",
    "gbnf_literal",
    "json_gbnf_literal",
]

MAX_CODEPOINT = 0x10FFFF
# Imported common terminals live under this prefix, apart from the grammar's own.
_COMMON_PREFIX = "__common_"
MAX_REPEAT_BOUND = 1000
_MAX_NESTING = 64

Ranges = list[tuple[int, int]]


class LarkUnsupported(Exception):
    """The grammar uses a construct lmspd cannot turn into GBNF."""

    def __init__(self, construct: str) -> None:
        super().__init__(f"unsupported grammar construct: {construct}")
        self.construct = construct


@dataclass(frozen=True, slots=True)
class GbnfFragment:
    """GBNF rules to merge into a larger grammar; ``root`` names the entry rule."""

    root: str
    rules: dict[str, str]

    def grammar(self) -> str:
        """A standalone grammar whose ``root`` is this fragment."""
        lines = [f"root ::= {self.root}"]
        lines += [f"{name} ::= {body}" for name, body in self.rules.items()]
        return "\n".join(lines) + "\n"


# --- GBNF text -------------------------------------------------------------


def gbnf_literal(text: str) -> str:
    """A GBNF string literal matching ``text`` exactly."""
    out = []
    for ch in text:
        cp = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif cp < 0x20 or cp == 0x7F:
            out.append(f"\\x{cp:02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def json_gbnf_literal(text: str) -> str:
    """A GBNF literal matching ``text`` as it appears inside a JSON string."""
    return gbnf_literal(json.dumps(text, ensure_ascii=False)[1:-1])


def _class_char(cp: int) -> str:
    # Escape everything but ASCII alphanumerics: no character can then be
    # mistaken for a range dash, a negation caret or a closing bracket.
    if cp < 0x80 and chr(cp).isalnum():
        return chr(cp)
    if cp <= 0xFF:
        return f"\\x{cp:02X}"
    if cp <= 0xFFFF:
        return f"\\u{cp:04X}"
    return f"\\U{cp:08X}"


def _normalize(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: Ranges) -> Ranges:
    out: Ranges = []
    nxt = 0
    for lo, hi in _normalize(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODEPOINT:
        out.append((nxt, MAX_CODEPOINT))
    return out


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    return _complement(_complement(a) + _complement(b))


def _subtract(a: Ranges, b: Ranges) -> Ranges:
    return _intersect(a, _complement(b))


def _contains(ranges: Ranges, cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in ranges)


def _class_text(ranges: Ranges) -> str:
    ranges = _normalize(ranges)
    if not ranges:
        raise LarkUnsupported("empty character class")
    negated = False
    comp = _complement(ranges)
    if ranges[-1][1] == MAX_CODEPOINT and len(comp) < len(ranges) + 1:
        ranges, negated = comp, True
    if negated and not ranges:
        ranges, negated = [(0, MAX_CODEPOINT)], False
    body = "".join(
        _class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}"
        for lo, hi in ranges
    )
    return f"[{'^' if negated else ''}{body}]"


_JSON_SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
_JSON_SPECIAL: Ranges = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]


def _json_class_text(ranges: Ranges) -> str:
    """Characters of ``ranges`` as they may appear JSON-encoded."""
    ranges = _normalize(ranges)
    alts = []
    plain = _subtract(ranges, _JSON_SPECIAL)
    if plain:
        alts.append(_class_text(plain))
    for cp, esc in _JSON_SHORT_ESCAPES.items():
        if _contains(ranges, cp):
            alts.append(gbnf_literal(esc))
    others = [cp for cp in range(0x20) if cp not in _JSON_SHORT_ESCAPES and _contains(ranges, cp)]
    if len(others) == 0x20 - 5:
        # Every other control, as \u00XX (not the ones with short escapes).
        alts.append('"\\\\u00" ("0" [0-7bBeEfF] | "1" [0-9a-fA-F])')
    else:
        alts += [gbnf_literal(f"\\u{cp:04x}") for cp in others]
    if not alts:
        raise LarkUnsupported("empty character class")
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


def _repeat(expr: str, lo: int, hi: int | None) -> str:
    if hi is not None and hi < lo:
        raise LarkUnsupported(f"repetition {{{lo},{hi}}}")
    if max(lo, hi or 0) > MAX_REPEAT_BOUND:
        raise LarkUnsupported(f"repetition bound above {MAX_REPEAT_BOUND}")
    if (lo, hi) == (0, None):
        return f"({expr})*"
    if (lo, hi) == (1, None):
        return f"({expr})+"
    if (lo, hi) == (0, 1):
        return f"({expr})?"
    if hi is None:
        return f"({expr}){{{lo},}}"
    if lo == hi:
        return f"({expr}){{{lo}}}" if lo else '""'
    return f"({expr}){{{lo},{hi}}}"


# --- regular expressions ---------------------------------------------------

_ASCII_DIGIT: Ranges = [(0x30, 0x39)]
_ASCII_WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_ASCII_SPACE: Ranges = [(0x09, 0x0D), (0x20, 0x20)]
_CATEGORIES: dict[object, tuple[Ranges, bool]] = {
    _sre.CATEGORY_DIGIT: (_ASCII_DIGIT, False),
    _sre.CATEGORY_NOT_DIGIT: (_ASCII_DIGIT, True),
    _sre.CATEGORY_WORD: (_ASCII_WORD, False),
    _sre.CATEGORY_NOT_WORD: (_ASCII_WORD, True),
    _sre.CATEGORY_SPACE: (_ASCII_SPACE, False),
    _sre.CATEGORY_NOT_SPACE: (_ASCII_SPACE, True),
}
_STARTS = (_sre.AT_BEGINNING, _sre.AT_BEGINNING_STRING)
_ENDS = (_sre.AT_END, _sre.AT_END_STRING)
_REPEATS = tuple(
    op for op in (getattr(_sre, n, None) for n in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")) if op
)


def _fold_case(ranges: Ranges) -> Ranges:
    extra: Ranges = []
    for lo, hi in ranges:
        # ASCII letters fold as ranges; anything else one code point at a
        # time, and only for small ranges (wide ones already hold both cases
        # or are not letters that matter here).
        for base, other in ((0x41, 0x61), (0x61, 0x41)):
            a, b = max(lo, base), min(hi, base + 25)
            if a <= b:
                extra.append((a - base + other, b - base + other))
        if hi - lo < 256:
            for cp in range(max(lo, 0x80), hi + 1):
                for v in {chr(cp).lower(), chr(cp).upper()}:
                    if len(v) == 1:
                        extra.append((ord(v), ord(v)))
    return _normalize(ranges + extra)


class _RegexConverter:
    def __init__(self, json_string: bool) -> None:
        self.json_string = json_string
        self.depth = 0

    def chars(self, ranges: Ranges, ci: bool) -> str:
        if ci:
            ranges = _fold_case(ranges)
        return _json_class_text(ranges) if self.json_string else _class_text(ranges)

    def literal(self, cp: int, ci: bool) -> str:
        if ci and chr(cp).lower() != chr(cp).upper():
            return self.chars([(cp, cp)], True)
        ch = chr(cp)
        return json_gbnf_literal(ch) if self.json_string else gbnf_literal(ch)

    def seq(self, items: list, ci: bool, dotall: bool) -> str:
        self.depth += 1
        if self.depth > _MAX_NESTING:
            raise LarkUnsupported("regex nested too deeply")
        parts = [self.item(op, av, ci, dotall) for op, av in items]
        self.depth -= 1
        return " ".join(p for p in parts if p) or '""'

    def item(self, op: object, av: object, ci: bool, dotall: bool) -> str:
        if op is _sre.LITERAL:
            return self.literal(av, ci)  # type: ignore[arg-type]
        if op is _sre.NOT_LITERAL:
            excluded = [(av, av)]  # type: ignore[list-item]
            if ci:
                excluded = _fold_case(excluded)  # type: ignore[arg-type]
            return self.chars(_complement(excluded), False)  # type: ignore[arg-type]
        if op is _sre.ANY:
            return self.chars([(0, MAX_CODEPOINT)] if dotall else _complement([(0x0A, 0x0A)]), False)
        if op is _sre.IN:
            return self.chars(self.in_ranges(av), ci)  # type: ignore[arg-type]
        if op is _sre.BRANCH:
            _, branches = av  # type: ignore[misc]
            return "(" + " | ".join(self.seq(list(b), ci, dotall) for b in branches) + ")"
        if op is _sre.SUBPATTERN:
            _, add, remove, sub = av  # type: ignore[misc]
            ci = (ci or bool(add & re.I)) and not remove & re.I
            dotall = (dotall or bool(add & re.S)) and not remove & re.S
            return "(" + self.seq(list(sub), ci, dotall) + ")"
        if op in _REPEATS:
            lo, hi, sub = av  # type: ignore[misc]
            return _repeat(self.seq(list(sub), ci, dotall), lo, None if hi is _sre.MAXREPEAT else hi)
        if op is _sre.AT:
            raise LarkUnsupported("anchor or word boundary inside a pattern")
        raise LarkUnsupported(f"regex construct {str(op).lower()}")

    def in_ranges(self, items: list) -> Ranges:
        ranges: Ranges = []
        negate = False
        for op, av in items:
            if op is _sre.NEGATE:
                negate = True
            elif op is _sre.LITERAL:
                ranges.append((av, av))
            elif op is _sre.RANGE:
                ranges.append(av)
            elif op is _sre.CATEGORY and av in _CATEGORIES:
                cat, neg = _CATEGORIES[av]
                ranges += _complement(cat) if neg else cat
            else:
                raise LarkUnsupported(f"character class item {str(op).lower()}")
        return _complement(ranges) if negate else _normalize(ranges)


def _parse_regex(pattern: str, flags: int) -> tuple[list, int]:
    try:
        parsed = _sre_parse.parse(pattern, flags)
    except (re.error, OverflowError, RecursionError) as exc:
        raise LarkUnsupported(f"invalid regex /{pattern}/: {exc}") from None
    return list(parsed), parsed.state.flags


def regex_to_gbnf(pattern: str, *, flags: int = 0, json_string: bool = False, search: bool = False) -> str:
    """A GBNF expression for the strings ``pattern`` matches in full.

    ``search`` gives JSON Schema's semantics (the pattern may match anywhere
    unless anchored with ``^``/``$``); otherwise the whole text must match,
    as for a Lark terminal or a ``regex`` custom tool.
    """
    items, all_flags = _parse_regex(pattern, flags)
    anchored_start = bool(items) and items[0][0] is _sre.AT and items[0][1] in _STARTS
    if anchored_start:
        items = items[1:]
    anchored_end = bool(items) and items[-1][0] is _sre.AT and items[-1][1] in _ENDS
    if anchored_end:
        items = items[:-1]
    conv = _RegexConverter(json_string)
    body = conv.seq(items, bool(all_flags & re.I), bool(all_flags & re.S))
    if search:
        anything = _repeat(conv.chars([(0, MAX_CODEPOINT)], False), 0, None)
        body = " ".join(
            ([] if anchored_start else [anything]) + [f"({body})"] + ([] if anchored_end else [anything])
        )
    return body


# --- Lark ------------------------------------------------------------------

# Lark's common.lark, rewritten where the original relies on lookbehind or
# lazy matching to end a token (ESCAPED_STRING, C_COMMENT).
_COMMON = r"""
DIGIT: "0".."9"
HEXDIGIT: "a".."f" | "A".."F" | DIGIT
INT: DIGIT+
SIGNED_INT: ["+"|"-"] INT
DECIMAL: INT "." INT? | "." INT
_EXP: ("e"|"E") SIGNED_INT
FLOAT: INT _EXP | DECIMAL _EXP?
SIGNED_FLOAT: ["+"|"-"] FLOAT
NUMBER: FLOAT | INT
SIGNED_NUMBER: ["+"|"-"] NUMBER
ESCAPED_STRING: "\"" /([^"\\\n]|\\[^\n])*/ "\""
LCASE_LETTER: "a".."z"
UCASE_LETTER: "A".."Z"
LETTER: UCASE_LETTER | LCASE_LETTER
WORD: LETTER+
CNAME: ("_"|LETTER) ("_"|LETTER|DIGIT)*
WS_INLINE: (" "|/\t/)+
WS: /[ \t\f\r\n]/+
CR: /\r/
LF: /\n/
NEWLINE: (CR? LF)+
SH_COMMENT: /#[^\n]*/
CPP_COMMENT: /\/\/[^\n]*/
C_COMMENT: /\/\*([^*]|\*+[^*\/])*\*+\//
SQL_COMMENT: /--[^\n]*/
"""

_TOKEN_RE = re.compile(
    r"""
    (?P<ws>[ \t\f\r]+)
  | (?P<comment>//[^\n]*)
  | (?P<nl>\n)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regexp>/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<directive>%[a-z]+)
  | (?P<op>->|\.\.|[:|()\[\]?!*+~,{}.])
  | (?P<number>\d+)
  | (?P<name>[_a-zA-Z][_a-zA-Z0-9]*)
    """,
    re.X,
)

# AST: ("alt", [nodes]) ("seq", [nodes]) ("lit", text, ci) ("re", pattern, flags)
# ("ref", name) ("rep", node, lo, hi) ("range", lo, hi)
Node = tuple


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if not m:
            raise LarkUnsupported(f"unexpected text {text[pos:pos + 20]!r}")
        kind = m.lastgroup or ""
        if kind not in ("ws", "comment"):
            tokens.append((kind, m.group()))
        pos = m.end()
    return tokens


def _statements(tokens: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Split into statements: a newline ends one unless the next line
    continues it with ``|`` or a bracket is still open."""
    out: list[list[tuple[str, str]]] = []
    cur: list[tuple[str, str]] = []
    depth = 0
    for i, tok in enumerate(tokens):
        if tok[0] == "nl":
            nxt = next((t for t in tokens[i + 1 :] if t[0] != "nl"), None)
            if depth > 0 or (nxt is not None and nxt == ("op", "|")):
                continue
            if cur:
                out.append(cur)
                cur = []
            continue
        if tok[0] == "op" and tok[1] in "([":
            depth += 1
        elif tok[0] == "op" and tok[1] in ")]":
            depth -= 1
        cur.append(tok)
    if cur:
        out.append(cur)
    return out


class _ExprParser:
    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.toks = tokens
        self.i = 0
        self.depth = 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, kind: str, value: str | None = None) -> str:
        tok = self.peek()
        if tok is None or tok[0] != kind or (value is not None and tok[1] != value):
            raise LarkUnsupported(f"syntax: expected {value or kind}, got {tok[1] if tok else 'end'}")
        self.i += 1
        return tok[1]

    def at(self, kind: str, value: str | None = None) -> bool:
        tok = self.peek()
        return tok is not None and tok[0] == kind and (value is None or tok[1] == value)

    def expansions(self) -> Node:
        self.depth += 1
        if self.depth > _MAX_NESTING:
            raise LarkUnsupported("grammar nested too deeply")
        alts = [self.alias()]
        while self.at("op", "|"):
            self.i += 1
            alts.append(self.alias())
        self.depth -= 1
        return alts[0] if len(alts) == 1 else ("alt", alts)

    def alias(self) -> Node:
        items = []
        while (tok := self.peek()) is not None and tok not in (("op", "|"), ("op", ")"), ("op", "]"), ("op", "->")):
            items.append(self.expr())
        if self.at("op", "->"):
            self.i += 1
            self.take("name")
        return items[0] if len(items) == 1 else ("seq", items)

    def expr(self) -> Node:
        node = self.atom()
        tok = self.peek()
        if tok in (("op", "?"), ("op", "*"), ("op", "+")):
            self.i += 1
            lo, hi = {"?": (0, 1), "*": (0, None), "+": (1, None)}[tok[1]]
            return ("rep", node, lo, hi)
        if tok == ("op", "~"):
            self.i += 1
            lo = int(self.take("number"))
            hi = lo
            if self.at("op", ".."):
                self.i += 1
                hi = int(self.take("number"))
            return ("rep", node, lo, hi)
        return node

    def atom(self) -> Node:
        tok = self.peek()
        if tok is None:
            raise LarkUnsupported("syntax: unexpected end of definition")
        kind, value = tok
        self.i += 1
        if (kind, value) == ("op", "("):
            node = self.expansions()
            self.take("op", ")")
            return node
        if (kind, value) == ("op", "["):
            node = self.expansions()
            self.take("op", "]")
            return ("rep", node, 0, 1)
        if kind == "string":
            text, ci = _string_value(value)
            if self.at("op", ".."):
                self.i += 1
                hi, _ = _string_value(self.take("string"))
                if len(text) != 1 or len(hi) != 1:
                    raise LarkUnsupported("character range between strings longer than one character")
                return ("range", ord(text), ord(hi))
            return ("lit", text, ci)
        if kind == "regexp":
            body, _, flag_text = value[1:].rpartition("/")
            flags = 0
            for f in flag_text:
                flags |= {"i": re.I, "m": re.M, "s": re.S, "l": 0, "u": 0, "x": re.X}[f]
            return ("re", body.replace("\\/", "/"), flags)
        if kind == "name":
            if self.at("op", "{"):
                raise LarkUnsupported(f"template {value}{{...}}")
            return ("ref", value)
        raise LarkUnsupported(f"syntax: unexpected {value!r}")


def _string_value(token: str) -> tuple[str, bool]:
    ci = token.endswith("i")
    raw = token[:-1] if ci else token
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        raise LarkUnsupported(f"string literal {raw}") from None
    return value, ci


def _parse_definitions(text: str) -> tuple[dict[str, Node], list[tuple[str, str, str]], list[Node]]:
    """Definitions, imports (module, name, alias) and %ignore expansions."""
    defs: dict[str, Node] = {}
    imports: list[tuple[str, str, str]] = []
    ignores: list[Node] = []
    for stmt in _statements(_tokenize(text)):
        head = stmt[0]
        if head[0] == "directive":
            if head[1] == "%import":
                imports += _parse_import(stmt[1:])
            elif head[1] == "%ignore":
                p = _ExprParser(stmt[1:])
                ignores.append(p.expansions())
                if p.peek() is not None:
                    raise LarkUnsupported("syntax: trailing tokens after %ignore")
            else:
                raise LarkUnsupported(head[1])
            continue
        if head in (("op", "?"), ("op", "!")):  # rule modifiers: same language
            stmt = stmt[1:]
        p = _ExprParser(stmt)
        name = p.take("name")
        if p.at("op", "."):
            p.i += 1
            p.take("number")
        if p.at("op", "{"):
            raise LarkUnsupported(f"template {name}{{...}}")
        p.take("op", ":")
        body = p.expansions()
        if p.peek() is not None:
            raise LarkUnsupported(f"syntax: unexpected {p.peek()[1]!r} in {name}")  # type: ignore[index]
        if name in defs:
            raise LarkUnsupported(f"duplicate definition of {name}")
        defs[name] = body
    return defs, imports, ignores


def _parse_import(toks: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """``common.X``, ``common.X -> Y`` or ``common (X, Y)``, as (module, name, alias)."""
    names = [t[1] for t in toks if t[0] == "name"]
    if ("op", "(") in toks:
        module, listed = (names[0] if names else ""), names[1:]
        if module != "common":
            raise LarkUnsupported(f"%import {module}")
        return [("common", n, n) for n in listed]
    alias = None
    if ("op", "->") in toks:
        alias, names = names[-1], names[:-1]
    if len(names) != 2 or names[0] != "common":
        raise LarkUnsupported(f"%import {'.'.join(names)}")
    return [("common", names[1], alias or names[1])]


def _refs(node: Node) -> list[str]:
    kind = node[0]
    if kind == "ref":
        return [node[1]]
    if kind in ("alt", "seq"):
        return [r for n in node[1] for r in _refs(n)]
    if kind == "rep":
        return _refs(node[1])
    return []


_COMMON_DEFS: dict[str, Node] | None = None


def _common_defs() -> dict[str, Node]:
    global _COMMON_DEFS
    if _COMMON_DEFS is None:
        _COMMON_DEFS = _parse_definitions(_COMMON)[0]
    return _COMMON_DEFS


def _resolve_imports(defs: dict[str, Node], imports: list[tuple[str, str, str]]) -> None:
    common = _common_defs()
    # Imported terminals and what they use live under a private prefix, so a
    # grammar's own DIGIT cannot collide with common's.
    def rename(node: Node) -> Node:
        kind = node[0]
        if kind == "ref":
            return ("ref", f"{_COMMON_PREFIX}{node[1]}")
        if kind in ("alt", "seq"):
            return (kind, [rename(n) for n in node[1]])
        if kind == "rep":
            return ("rep", rename(node[1]), node[2], node[3])
        return node

    for _, name, alias in imports:
        if name not in common:
            raise LarkUnsupported(f"%import common.{name}")
        todo = [name]
        while todo:
            n = todo.pop()
            key = f"{_COMMON_PREFIX}{n}"
            if key not in defs:
                defs[key] = rename(common[n])
                todo += _refs(common[n])
        if alias in defs:
            raise LarkUnsupported(f"duplicate definition of {alias}")
        defs[alias] = ("ref", f"{_COMMON_PREFIX}{name}")


def _nullable(defs: dict[str, Node]) -> dict[str, bool]:
    """Which definitions can match the empty string (a fixpoint)."""
    null = {name: False for name in defs}
    changed = True
    while changed:
        changed = False
        for name, body in defs.items():
            if not null[name] and _nullable_node(body, null):
                null[name] = changed = True
    return null


def _left_refs(node: Node, null: dict[str, bool]) -> list[str]:
    """Symbols that can start ``node`` (leftmost, past nullable prefixes)."""
    kind = node[0]
    if kind == "ref":
        return [node[1]]
    if kind == "alt":
        return [r for n in node[1] for r in _left_refs(n, null)]
    if kind == "rep":
        return _left_refs(node[1], null)
    if kind == "seq":
        out = []
        for n in node[1]:
            out += _left_refs(n, null)
            if not _nullable_node(n, null):
                break
        return out
    return []


def _nullable_node(node: Node, null: dict[str, bool]) -> bool:
    kind = node[0]
    if kind == "lit":
        return node[1] == ""
    if kind == "re":
        try:
            return re.fullmatch(node[1], "", node[2]) is not None
        except re.error:
            return False
    if kind == "range":
        return False
    if kind == "ref":
        return null.get(node[1], False)
    if kind == "seq":
        return all(_nullable_node(n, null) for n in node[1])
    if kind == "alt":
        return any(_nullable_node(n, null) for n in node[1])
    return node[2] == 0 or _nullable_node(node[1], null)


def _check_left_recursion(defs: dict[str, Node], reachable: list[str]) -> None:
    null = _nullable(defs)
    edges = {name: set(_left_refs(defs[name], null)) for name in reachable}
    state: dict[str, int] = {}

    def visit(name: str) -> None:
        state[name] = 1
        for nxt in edges.get(name, ()):
            if state.get(nxt) == 1:
                raise LarkUnsupported(f"left recursion through {nxt}")
            if nxt not in state:
                visit(nxt)
        state[name] = 2

    for name in reachable:
        if name not in state:
            visit(name)


class _LarkEmitter:
    def __init__(self, prefix: str, json_string: bool, ignore: str | None) -> None:
        self.prefix = prefix
        self.regex = _RegexConverter(json_string)
        self.json_string = json_string
        self.ignore = ignore

    def rule_name(self, name: str) -> str:
        # "n-" (the grammar's names) and "c-" (imported from common) keep
        # them apart from each other and from "root"/"ignore".
        if name.startswith(_COMMON_PREFIX):
            return f"{self.prefix}-c-{name[len(_COMMON_PREFIX):].replace('_', '-')}"
        return f"{self.prefix}-n-{name.replace('_', '-')}"

    def emit(self, node: Node, in_rule: bool) -> str:
        kind = node[0]
        if kind == "lit":
            text, ci = node[1], node[2]
            if ci:
                return " ".join(self.regex.literal(ord(c), True) for c in text) or '""'
            return json_gbnf_literal(text) if self.json_string else gbnf_literal(text)
        if kind == "range":
            return self.regex.chars([(node[1], node[2])], False)
        if kind == "re":
            return "(" + regex_to_gbnf(node[1], flags=node[2], json_string=self.json_string) + ")"
        if kind == "ref":
            return self.rule_name(node[1])
        if kind == "alt":
            return "(" + " | ".join(self.emit(n, in_rule) for n in node[1]) + ")"
        if kind == "seq":
            sep = f" {self.ignore}* " if in_rule and self.ignore else " "
            return "(" + sep.join(self.emit(n, in_rule) for n in node[1]) + ")"
        item, lo, hi = self.emit(node[1], in_rule), node[2], node[3]
        if hi == 0:
            return '""'
        if not (in_rule and self.ignore) or hi == 1:
            return _repeat(item, lo, hi)
        # Ignored tokens may sit between repetitions as well.
        rest = _repeat(f"{self.ignore}* {item}", max(lo - 1, 0), None if hi is None else hi - 1)
        return f"({item} {rest})" if lo >= 1 else f"({item} {rest})?"


def lark_to_gbnf(
    definition: str,
    *,
    prefix: str = "lark",
    json_string: bool = False,
    start: str = "start",
    max_bytes: int = DEFAULT_LIMITS.request.max_tool_schema_bytes,
) -> GbnfFragment:
    """Convert a Lark grammar; rule names all start with ``prefix``.

    Raises ``LarkUnsupported`` when a construct has no GBNF equivalent.
    """
    if len(definition.encode()) > max_bytes:
        raise LarkUnsupported(f"grammar larger than {max_bytes} bytes")
    if not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9-]*", prefix):
        raise ValueError(f"bad rule prefix {prefix!r}")
    defs, imports, ignores = _parse_definitions(definition)
    _resolve_imports(defs, imports)
    if start not in defs:
        raise LarkUnsupported(f"no {start!r} rule")
    roots = [start] + [r for node in ignores for r in _refs(node)]
    reachable: list[str] = []
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in reachable:
            continue
        if name not in defs:
            raise LarkUnsupported(f"undefined symbol {name}")
        reachable.append(name)
        todo += _refs(defs[name])
    _check_left_recursion(defs, reachable)

    ignore_rule = f"{prefix}-ignore" if ignores else None
    em = _LarkEmitter(prefix, json_string, ignore_rule)
    rules: dict[str, str] = {}
    for name in sorted(reachable):
        # Lowercase names are rules (ignored tokens may separate their items);
        # uppercase names are terminals, matched as one lexical unit.
        is_rule = name.removeprefix(_COMMON_PREFIX).lstrip("_")[:1].islower()
        rules[em.rule_name(name)] = em.emit(defs[name], in_rule=is_rule)
    root = f"{prefix}-root"
    if ignore_rule:
        rules[ignore_rule] = " | ".join(em.emit(n, in_rule=False) for n in ignores)
        rules[root] = f"{ignore_rule}* {em.rule_name(start)} {ignore_rule}*"
    else:
        rules[root] = em.rule_name(start)
    return GbnfFragment(root=root, rules=rules)

