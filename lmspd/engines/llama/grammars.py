"""Grammars that make the llama engine's output valid by construction.

lmspd writes no grammar engine of its own: JSON Schema and Lark are
compiled by llguidance (the engine behind OpenAI's structured outputs and
llama.cpp's ``LLAMA_LLGUIDANCE`` build). This module only composes what a
request demands into one llguidance grammar (a JSON string, see
``llguidance.grammar_from``) and turns what llguidance refuses into a 400
that names the JSON path or grammar line:

- ``json_schema_grammar(schema)`` / ``json_object_grammar()`` for
  ``text.format`` ``json_schema`` / ``json_object``;
- ``tool_call_grammar(fmt, tools, ...)`` for ``tool_choice`` ``required``
  or a named tool: one call (``parallel``: up to ``max_calls``) in the
  syntax ``fmt`` describes, then only end-of-turn;
- ``lazy_tool_call_grammar(...)`` for ``tool_choice: auto``: the same
  grammar plus the trigger texts; the sampler leaves the text free and
  starts the grammar where the model writes a trigger
  (``sampling.GrammarFirstRejection``).

A tool syntax describes its markers as data (``ToolFormat.call_parts``,
``layout``, ``triggers``); the Lark that glues them together is written
here. A marker that is one special token of the model (``<|python_tag|>``,
``[TOOL_CALLS]``) is written as that token (``specials``).

The forced-call rule: ``tool_choice`` ``required`` or a named tool makes
exactly one call, after which the grammar allows only end-of-turn (so the
turn ends ``tool_calls`` / ``tool_use``, never ``length``), unless the
request explicitly set ``parallel_tool_calls: true``; then up to
``RequestLimits.max_parallel_tool_calls``. Under ``auto`` the model chose to
call, and parallel calls are allowed unless the request said
``parallel_tool_calls: false`` (the engine's ``_max_calls``). llama.cpp's
server defaults ``parallel_tool_calls`` to false for the same reason.

Compiled once
-------------

Validating a piece with llguidance compiles it, and the engine's matcher
compiles the whole grammar again: twice the cost of a fresh grammar (Codex's
apply_patch tool: ~57 ms under load). So the engine builds with
``check=False`` (only lmspd's own bounds, no llguidance validation), compiles
the whole once for its matcher, and only when llguidance refuses it builds
again with ``check=True``: each piece then validates on its own, so the 400
names the tool, the JSON path or the grammar line, and a non-strict tool's
parameters fall back to what llguidance can enforce
(``preparation.Preparation._compile``). Called without ``check``, the
builders validate every piece, as a caller with no compiler needs.

JSON Schema coverage
--------------------

What lmspd does with each keyword, next to OpenAI's strict mode (the subset
``strict: true`` accepts) and llama.cpp's ``json-schema-to-grammar``
(``common/json-schema-to-grammar.cpp``, what llama-server applies).
*enforced*: every output satisfies it; *not enforced*: ignored for a
non-strict tool's parameters, a 400 for ``text.format`` and strict tools;
*annotation*: never affects output; *400*: always refused.

=========================  =====================  ================  ==========================
keyword                    lmspd (llguidance)     OpenAI strict     llama.cpp json-schema-to-
                                                                    grammar
=========================  =====================  ================  ==========================
type (one or a list)       enforced               yes               yes
enum, const                enforced               yes               yes
properties, required       enforced (properties   yes (all          yes
                           in schema order)       required)
additionalProperties       enforced               must be false     yes
patternProperties          enforced (disjoint)    no                no (ignored)
propertyNames              not enforced           no                no (ignored)
minProperties/             enforced when all      no                no (ignored)
maxProperties              properties required
dependentRequired,         not enforced           no                no (ignored)
dependentSchemas
items, prefixItems         enforced               items only        yes
minItems, maxItems         enforced               yes               yes
uniqueItems                not enforced           no                no (ignored)
contains, min/maxContains  not enforced           no                no (ignored)
minLength, maxLength       enforced               yes               yes
pattern                    enforced (no           yes               yes (a subset)
                           lookaround)
format                     enforced: date-time,   a fixed list      date, time, date-time,
                           time, date, duration,                    uuid; others ignored
                           email, hostname, ipv4,
                           ipv6, uuid, uri; other
                           values annotation
minimum, maximum,          enforced (integer and  yes               integers only
exclusiveMin/Max           number)
multipleOf                 enforced               yes               no (ignored)
anyOf                      enforced               yes               yes
oneOf                      enforced when provably no                as anyOf (looser)
                           disjoint, else 400
allOf                      enforced (merged)      no                yes (merged)
not, if/then/else          not enforced           no                no (ignored)
$ref (local), $defs        enforced (recursion    yes               yes
                           allowed)
$ref (remote)              400                    no                no
unevaluatedProperties/     not enforced           no                no
Items
title, description,        annotation             yes               annotation
default, examples,
$comment, $schema
=========================  =====================  ================  ==========================

Numbers in a schema must be finite (``1e400`` and ``Infinity`` are a 400),
counts non-negative integers; a schema is bounded by
``RequestLimits.max_tool_schema_bytes`` and ``max_json_depth``, a custom
tool's grammar by ``max_grammar_bytes`` and ``max_grammar_rules``.

Unbounded numbers get a bound of sixteen digits (``±(10**16 - 1)``): a small
model given a number with no end writes digits until ``max_output_tokens``.
The trade-off is compile time: llguidance turns a numeric range into a
lexer regex, and the same range written inline N times costs far more than
N times one (17 inline integer bounds: ~50 ms to compile; one: 0.6 ms). So
every bounded number whose schema is only its type and bounds is written
once under ``$defs`` and referenced (``_share_numbers``): 17 integers then
compile in ~1 ms, which keeps the bound and the ≤ 20 ms compile target.
A number with other keywords (``multipleOf``, an ``enum``) stays inline.

Custom (freeform) tools: a Lark grammar is compiled as its own sub-grammar
(its terminals cannot clash with the call syntax around it), a regex as a
terminal. Under a syntax that wraps custom input in JSON
(``{"input": "..."}``) a regex still constrains the decoded string; a Lark
grammar cannot be applied inside a JSON string, so there the input is any
JSON string (not enforced).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np

from lmspd.core.conversation import CustomTool, FunctionTool, Tool
from lmspd.core.errors import ApiError
from lmspd.core.limits import DEFAULT_LIMITS, Limits

if TYPE_CHECKING:
    from lmspd.engines.llama.tool_formats import ToolFormat
    from lmspd.engines.llama.tool_formats.base import ParamBlocks

__all__ = [
    "check_json_schema",
    "json_schema_grammar",
    "json_object_grammar",
    "tool_call_grammar",
    "lazy_tool_call_grammar",
    "lazy_triggers",
    "validate",
]

# Whitespace a model may write between JSON tokens: one space, or a newline
# and some indentation. Unbounded whitespace lets a small model spin.
JSON_OPTIONS: Any = {"whitespace_pattern": r"(?:\x20|\n[\x20\t]{0,20})"}
_LENIENT: Any = {**JSON_OPTIONS, "lenient": True}


def _summary(message: str) -> str:
    """llguidance's message in one line: the first, and its ``error:`` line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "refused"
    detail = next((line for line in lines[1:] if line.startswith("error:")), "")
    return (lines[0] + (" " + detail if detail else ""))[:400]


def _unsupported(param: str, keyword: str, why: str) -> ApiError:
    return ApiError(
        "unsupported_capability",
        f"JSON Schema keyword {keyword!r} at {param} cannot be enforced by constrained decoding ({why}).",
        param=param,
    )


# --- the schema's own bounds (before llguidance sees it) -----------------------

_NAMES = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
           "minContains", "maxContains")


def _check_bounds(schema: Any, param: str, limits: Limits) -> None:
    """Size, depth, finite numbers and integer counts, with the path of the
    first offender (llguidance's own messages name no path)."""
    try:
        size = len(json.dumps(schema, allow_nan=True).encode())
    except (TypeError, ValueError, RecursionError):
        raise ApiError("invalid_request", f"{param} is not a JSON schema.", param=param) from None
    if size > limits.request.max_tool_schema_bytes:
        raise ApiError("invalid_request",
                       f"{param} is {size} bytes; the limit is {limits.request.max_tool_schema_bytes}.", param=param)
    max_depth = limits.request.max_json_depth
    stack: list[tuple[Any, str, int]] = [(schema, param, 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > max_depth:
            raise ApiError("invalid_request", f"Schema nested deeper than {max_depth} at {path}.", param=path)
        if isinstance(node, float) and not math.isfinite(node):
            raise ApiError("invalid_request", f"{path} is not a finite number.", param=path)
        if isinstance(node, dict):
            for key, value in node.items():
                sub = f"{path}.{key}"
                if key in _COUNTS and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                    raise ApiError("invalid_request", f"{sub} must be a non-negative integer.", param=sub)
                stack.append((value, sub, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node))
    if schema is False:
        raise _unsupported(param, "false", "the schema false matches nothing")
    if not isinstance(schema, (dict, bool)):
        raise ApiError("invalid_request", f"Schema at {param} is not an object or a boolean.", param=param)


_KEYWORDS = ("oneOf", "anyOf", "allOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
             "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "format",
             "pattern", "patternProperties", "additionalProperties", "required", "properties", "items",
             "prefixItems", "enum", "const", "type")
_QUOTED = re.compile(r"""["'`]([$A-Za-z][A-Za-z0-9_]*)["'`]""")


def _keyword_path(schema: Any, keyword: str, param: str) -> str | None:
    """Where ``keyword`` first appears as a keyword (not a property name)."""
    stack: deque[tuple[Any, str]] = deque([(schema, param)])
    while stack:
        node, path = stack.popleft()
        if isinstance(node, dict):
            if keyword in node:
                return f"{path}.{keyword}"
            for key, value in node.items():
                if key in _NAMES and isinstance(value, dict):
                    stack.extend((v, f"{path}.{key}.{k}") for k, v in value.items())
                elif key not in ("enum", "const", "default", "examples"):
                    stack.append((value, f"{path}.{key}"))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return None


def _schema_error(message: str, schema: Any, param: str) -> ApiError:
    """llguidance's refusal, pinned to the keyword's path where it names one."""
    short = _summary(message)
    for keyword in _QUOTED.findall(message):
        path = _keyword_path(schema, keyword, param)
        if path is not None:
            return _unsupported(path, keyword, short)
    for keyword in _KEYWORDS:
        if re.search(rf"\b{re.escape(keyword)}\b", message):
            path = _keyword_path(schema, keyword, param)
            if path is not None:
                return _unsupported(path, keyword, short)
    if "regex" in message:
        path = _keyword_path(schema, "pattern", param)
        if path is not None:
            return _unsupported(path, "pattern", short)
    if "$ref" in message or "ref" in message.lower() or "retriev" in message:
        path = _keyword_path(schema, "$ref", param)
        if path is not None:
            return _unsupported(path, "$ref", short)
    return ApiError("unsupported_capability",
                    f"The JSON schema at {param} cannot be enforced by constrained decoding ({short}).", param=param)


_MAGNITUDE = 10**16 - 1
# The string formats llguidance enforces.
_FORMATS = {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"}


def _closed(schema: Any, in_all_of: bool = False) -> Any:
    """``schema`` with ``additionalProperties: false`` where an object lists
    its properties and says nothing of others: the grammar may be stricter
    than the schema (every output still validates), and a small model given
    room for extra keys invents them. ``allOf`` branches stay open (closing
    each would refuse the keys of the others). Numbers without bounds get
    sixteen digits' worth."""
    if isinstance(schema, list):
        return [_closed(v, in_all_of) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("enum", "const", "default", "examples"):
            out[key] = value
        elif key in _NAMES and isinstance(value, dict):
            out[key] = {k: _closed(v) for k, v in value.items()}
        else:
            out[key] = _closed(value, key == "allOf")
    if "format" in out and out["format"] not in _FORMATS:
        # JSON Schema 2020-12: format is an annotation unless asserted;
        # pydantic and zod write ones no grammar knows ("password", "int64").
        del out["format"]
    types: list[Any] = out["type"] if isinstance(out.get("type"), list) else [out.get("type")]
    if ("integer" in types or "number" in types) and "enum" not in out and "const" not in out:
        # llguidance's numbers have no digit limit: a small model writes
        # digits until max_output_tokens. Sixteen digits, as before.
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = _MAGNITUDE
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -_MAGNITUDE
    required: list[Any] = out["required"] if isinstance(out.get("required"), list) else []
    declared: dict[str, Any] = out["properties"] if isinstance(out.get("properties"), dict) else {}
    if ("properties" in out and not in_all_of and "allOf" not in out
            and all(r in declared for r in required)
            and not any(k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties"))):
        out["additionalProperties"] = False
    return out


# The keywords a number's schema may have and still be shared (the rest are annotations).
_NUMBER_KEYS = {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                "title", "description", "default", "examples", "$comment"}
_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_SHARED = "lmspd_number_"


def _share_numbers(schema: Any) -> Any:
    """``schema`` (already ``_closed``) with every plain bounded number
    replaced by a ``$ref`` to one ``$defs`` entry per distinct range (why:
    module docstring). The root itself is never replaced."""
    if not isinstance(schema, dict):
        return schema
    defs: dict[str, dict[str, Any]] = {}
    names: dict[str, str] = {}

    def shared(node: dict[str, Any]) -> Any:
        kind = node.get("type")
        if kind not in ("integer", "number") or not set(node) <= _NUMBER_KEYS:
            return None
        bounds = {k: node[k] for k in _BOUND_KEYS if k in node}
        if not bounds:
            return None
        key = json.dumps([kind, bounds], sort_keys=True)
        name = names.get(key)
        if name is None:
            name = names[key] = f"{_SHARED}{len(names)}"
            defs[name] = {"type": kind, **bounds}
        return {"$ref": f"#/$defs/{name}"}

    def walk(node: Any, root: bool = False) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        if not root and (ref := shared(node)) is not None:
            return ref
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ("enum", "const", "default", "examples") or key == "oneOf":
                # oneOf: llguidance proves its branches disjoint by their
                # types, which it cannot see through a $ref.
                out[key] = value
            elif key in _NAMES and isinstance(value, dict):
                out[key] = {k: walk(v) for k, v in value.items()}
            else:
                out[key] = walk(value)
        return out

    out = walk(schema, root=True)
    if defs:
        own = out.get("$defs")
        if own is not None and not isinstance(own, dict):
            return schema  # not a schema lmspd can extend: left as it was
        if own and any(name in own for name in defs):
            return schema
        out["$defs"] = {**(own or {}), **defs}
    return out


def _enforced(schema: Any) -> Any:
    """The schema the grammar is built from: closed objects, bounded and shared numbers."""
    return _share_numbers(_closed(schema))


def _schema_grammar(schema: Any, param: str, limits: Limits, *, lenient: bool = False, check: bool = True) -> str:
    _check_bounds(schema, param, limits)
    options = _LENIENT if lenient else JSON_OPTIONS
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            _enforced(schema) if isinstance(schema, dict) else {}, defaults=options)
    except ValueError as exc:
        raise ApiError("invalid_request", f"{param} is not a JSON schema: {exc}", param=param) from None
    error = validate(grammar) if check else ""
    if error:
        raise _schema_error(error, schema, param)
    return grammar


def check_json_schema(schema: Any, *, param: str = "text.format.schema", limits: Limits = DEFAULT_LIMITS) -> None:
    """Raise ``ApiError`` if ``schema`` cannot be enforced."""
    _schema_grammar(schema, param, limits)


def json_schema_grammar(
    schema: Any, *, param: str = "text.format.schema", limits: Limits = DEFAULT_LIMITS, check: bool = True
) -> str:
    """A grammar for JSON text valid against ``schema`` (``text.format`` json_schema).
    ``check=False``: not validated by llguidance (see "Compiled once")."""
    return _schema_grammar(schema, param, limits, check=check)


def json_object_grammar(*, check: bool = True) -> str:
    """A grammar for any JSON object (``text.format`` json_object), written
    compactly: with no schema to end it, a small model given room for
    newlines and indentation pretty-prints until its token budget runs out.
    (``check``: as the other builders take it; nothing here to validate.)"""
    return llguidance.LLMatcher.grammar_from_json_schema(_closed({"type": "object"}),
                                                         defaults={"whitespace_flexible": False})


@functools.lru_cache(maxsize=256)
def validate(grammar: str) -> str:
    """llguidance's error for ``grammar`` ('' when it compiles).

    Validating compiles the grammar; the engine validates only a grammar
    its matcher refused ("Compiled once"). Cached by content, as the
    matchers are (lmspd.engines.llama.matchers)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error and messages else ""


# --- Lark pieces ------------------------------------------------------------------


def _json_rule(schema: Any, options: dict[str, Any] = JSON_OPTIONS) -> str:
    body = _enforced(schema) if isinstance(schema, dict) else {}
    return "%json " + json.dumps({**body, "x-guidance": options}, ensure_ascii=False)


def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def literal(text: str, specials: Collection[str] = ()) -> str:
    """Lark for the exact ``text``; markers in ``specials`` as their token."""
    if not text:
        return '""'
    found = sorted((m for m in specials if m and m in text), key=len, reverse=True)
    if not found:
        return _string(text)
    pattern = re.compile("|".join(re.escape(m) for m in found))
    parts, at = [], 0
    for m in pattern.finditer(text):
        if m.start() > at:
            parts.append(_string(text[at:m.start()]))
        parts.append(m.group())  # <|python_tag|> is Lark's syntax for a special token
        at = m.end()
    if at < len(text):
        parts.append(_string(text[at:]))
    return " ".join(parts)


_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def regex_escape(text: str) -> str:
    """``text`` as a literal inside Lark's ``/.../`` (Rust regex syntax)."""
    out = []
    for ch in text:
        if ch in _REGEX_META:
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


# Where a grammar leaves one byte sequence (a call's opening tag, a JSON
# key), llguidance's mask admits only the first token of that text's
# canonical tokenization, while a sampled token that spells it otherwise
# passes the one-token check: the grammar-first sampler keeps the model's
# own spelling when its first choice fits and imposes the canonical one
# after a rejection. With forcing off the mask admits every token that
# continues the text (``not`` as well as ``note`` before ``note">``), as
# the GBNF grammars before llguidance did. Measured on the bundled model,
# each way helps one kind of call:
# - a free-text custom tool, forced: canonical ``note`` ``">`` and greedy
#   decoding loops on ``<tool_name>Hi!</tool_name>`` until the budget runs
#   out; its own ``not`` ``e`` ``"`` ``>`` and it writes one line and
#   closes the call (tests/e2e/test_tools.py::test_custom_tool_free_text);
# - a JSON call, forced off its own answer: with forcing off it spells
#   ``get_time`` ``g`` ``et`` ``_`` ``t`` ``im`` ``e`` and then writes a
#   worse argument (``"Paris"`` where canonical forcing gives
#   ``"Europe/Paris"``).
# So forcing stays on everywhere but in grammars whose every call is a
# free-text custom tool (there the only forced text is the call markup).
_NO_FORCING = '%llguidance {"no_forcing": true}\n'


def _top(lark: str, subgrammars: list[tuple[str, str]]) -> str:
    grammars: list[dict[str, Any]] = [{"lark_grammar": lark}]
    grammars += [{"name": name, "lark_grammar": body} for name, body in subgrammars]
    return json.dumps({"grammars": grammars}, ensure_ascii=False)


_STRING_LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_DEPTH = np.zeros(256, dtype=np.int8)
_DEPTH[[ord("("), ord("[")]] = 1
_DEPTH[[ord(")"), ord("]")]] = -1


def _nesting(definition: str) -> int:
    """How deep groups nest (string literals aside), in C-speed passes."""
    steps = _DEPTH[np.frombuffer(_STRING_LITERAL.sub("", definition).encode(), dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


_RULE_LINE = re.compile(r"(?m)^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_\-]*(?:\.-?\d+)?(?:\[[^\]\n]*\])?[ \t]*:")


def _check_custom_grammar(tool: CustomTool, definition: str, limits: Limits) -> None:
    """Bounds before llguidance sees it (its compile time grows with both,
    and a chain of thousands of rules overflows its stack)."""
    param = f"tools.{tool.name}.format.definition"
    request = limits.request
    size = len(definition.encode())
    if size > request.max_grammar_bytes:
        raise ApiError("invalid_request",
                       f"The grammar of custom tool {tool.name!r} is {size} bytes; the limit is "
                       f"{request.max_grammar_bytes}.", param=param)
    deepest = _nesting(definition)
    if deepest > request.max_grammar_depth:
        raise ApiError("invalid_request",
                       f"The grammar of custom tool {tool.name!r} nests groups {deepest} deep; the limit is "
                       f"{request.max_grammar_depth}.", param=param)
    rules = len(_RULE_LINE.findall(definition))
    if rules > request.max_grammar_rules:
        raise ApiError("invalid_request",
                       f"The grammar of custom tool {tool.name!r} defines {rules} rules; the limit is "
                       f"{request.max_grammar_rules}.", param=param)


def _grammar_error(tool: CustomTool, message: str) -> ApiError:
    first = _summary(message)
    m = re.match(r"(?:at )?(\d+)\((\d+)\)", first)
    where = f" (line {m.group(1)}, column {m.group(2)})" if m else ""
    return ApiError("unsupported_capability",
                    f"The {tool.grammar.get('syntax', 'lark') if tool.grammar else 'lark'} grammar of custom tool "
                    f"{tool.name!r} cannot be compiled{where}: {first}",
                    param=f"tools.{tool.name}.format.definition")


# --- tool calls -------------------------------------------------------------------


@dataclass
class _Calls:
    rules: list[str]
    subgrammars: list[tuple[str, str]]
    alternatives: list[str]
    # Every call a free-text custom tool written raw (see _NO_FORCING).
    free_text: bool = True


def _function_args(tool: FunctionTool, limits: Limits, check: bool) -> str:
    param = f"tools.{tool.name}.parameters"
    schema = tool.parameters or {"type": "object"}
    try:
        _schema_grammar(schema, param, limits, check=check)
        if isinstance(schema, dict) and schema.get("type") not in (None, "object"):
            raise ApiError("unsupported_capability", f"{param} must describe a JSON object.", param=param)
        return _json_rule(schema)
    except ApiError:
        if tool.strict:
            raise
    # Not strict: what llguidance does not implement is ignored; failing
    # that, the arguments need only be a JSON object.
    try:
        _schema_grammar(schema, param, limits, lenient=True)
        return _json_rule(schema, _LENIENT)
    except ApiError:
        return _json_rule({"type": "object"})


def _custom_raw(tool: CustomTool, i: int, close: str, calls: _Calls, limits: Limits, check: bool,
                avoid: Sequence[str] = ()) -> str:
    """The rule for a custom tool's raw input, ending with ``close``."""
    grammar = tool.grammar or {}
    definition = grammar.get("definition") or ""
    if not definition:
        # Free text up to the first closing marker (which it includes),
        # never a tool result's markup (the model inventing the next turn).
        terminal = f"/(?s:.*){regex_escape(close)}/"
        if avoid:
            terminal += " & ~/(?s:.*)(" + "|".join(regex_escape(m) for m in avoid) + ")(?s:.*)/"
        calls.rules += [f"free_{i}[lazy]: FREE_{i}", f"FREE_{i}: {terminal}"]
        return f"free_{i}"
    _check_custom_grammar(tool, definition, limits)
    if grammar.get("syntax") == "regex":
        lark = f"start: C\nC: /{llguidance.regex_to_lark(definition, 'dw')}/\n"
    else:
        lark = definition
    error = validate(_top(lark, [])) if check else ""
    if error:
        raise _grammar_error(tool, error)
    calls.subgrammars.append((f"custom_{i}", lark))
    return f"@custom_{i} {_string(close)}"


def _custom_json(tool: CustomTool, limits: Limits) -> str:
    """``{"input": <string>}`` for a syntax that calls custom tools as functions."""
    grammar = tool.grammar or {}
    definition = grammar.get("definition") or ""
    string: dict[str, Any] = {"type": "string"}
    if definition:
        _check_custom_grammar(tool, definition, limits)
        if grammar.get("syntax") == "regex":
            string["pattern"] = f"^(?:{definition})$"
            error = validate(llguidance.LLMatcher.grammar_from_json_schema(string))
            if error:
                raise _grammar_error(tool, error)
        else:
            # A Lark grammar cannot apply inside a JSON string; it must at
            # least compile (a broken grammar is the client's error).
            error = validate(_top(definition, []))
            if error:
                raise _grammar_error(tool, error)
    return _json_rule({"type": "object", "properties": {"input": string}, "required": ["input"],
                       "additionalProperties": False})


def _block_args(blocks: ParamBlocks, tool: Tool, i: int, specials: Collection[str], calls: _Calls) -> str:
    """One block per parameter (Qwen3-Coder's ``<parameter=name>``): the
    declared names (a custom tool's ``input``); the values are free text up
    to the closing marker (not schema-checked)."""
    if isinstance(tool, CustomTool):
        props = ["input"]
    else:
        props = list(((tool.parameters or {}).get("properties") or {}).keys())
    alts = [f"{literal(blocks.parts(name)[0], specials)} pvalue_{i}" for name in props]
    close = blocks.close
    calls.rules.append(f"pvalue_{i}[lazy]: /(?s:.*){regex_escape(close)}/")
    if not alts:
        return '""'
    calls.rules.append(f"param_{i}: " + " | ".join(alts))
    return f"param_{i}*"


def _call_rules(fmt: ToolFormat, tools: Sequence[Tool], allowed_names: Sequence[str] | None,
                specials: Collection[str], limits: Limits, check: bool) -> _Calls:
    by_name = {t.name: t for t in tools if isinstance(t, (FunctionTool, CustomTool))}
    names = list(by_name) if allowed_names is None else list(dict.fromkeys(allowed_names))
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ApiError("invalid_request", f"tool_choice names {missing[0]!r}, which is not among the tools.",
                       param="tool_choice")
    if not names:
        raise ApiError("invalid_request", "tool_choice requires a tool call but no tool can be called.",
                       param="tool_choice")
    calls = _Calls([], [], [])
    for i, name in enumerate(names):
        tool = by_name[name]
        free = False
        if fmt.param_blocks is not None:
            before, after = fmt.call_parts(name, raw=False)
            args = _block_args(fmt.param_blocks, tool, i, specials, calls)
            rule = f"{literal(before, specials)} {args} {literal(after, specials)}"
        elif isinstance(tool, CustomTool) and fmt.raw_custom:
            before, after = fmt.call_parts(name, raw=True)
            free = not (tool.grammar or {}).get("definition")
            # The newline before the closing tag belongs to the input when it is free text.
            body = _custom_raw(tool, i, after.lstrip("\n") if free else after,
                               calls, limits, check, fmt.result_markers)
            rule = f"{literal(before, specials)} {body}"
        elif isinstance(tool, CustomTool):
            before, after = fmt.call_parts(name, raw=False)
            rule = f"{literal(before, specials)} {_custom_json(tool, limits)} {literal(after, specials)}"
        else:
            before, after = fmt.call_parts(name, raw=False)
            rule = f"{literal(before, specials)} {_function_args(tool, limits, check)} {literal(after, specials)}"
        calls.rules.append(f"call_{i}: {rule}")
        calls.alternatives.append(f"call_{i}")
        calls.free_text = calls.free_text and free
    return calls


def _tool_grammar(fmt: ToolFormat, tools: Sequence[Tool], allowed_names: Sequence[str] | None,
                  max_calls: int | None, specials: Collection[str], limits: Limits, check: bool) -> str:
    if max_calls is not None and max_calls < 1:
        raise ValueError("max_calls must be at least 1")
    calls = _call_rules(fmt, tools, allowed_names, specials, limits, check)
    layout = fmt.layout
    more = f"({literal(layout.separator, specials)} call)"
    seq = "call" if max_calls == 1 else f"call {more}*" if max_calls is None else f"call {more}{{0,{max_calls - 1}}}"
    prefix = literal(layout.prefix, specials) if layout.prefix else ""
    if prefix and layout.prefix_optional:
        prefix = f"({prefix})?"
    suffix = literal(layout.suffix, specials) if layout.suffix else ""
    # Free-text custom tools only: the model spells the forced markup its
    # own way (see _NO_FORCING).
    lark = (_NO_FORCING if calls.free_text else "") + "\n".join([
        f"start: {prefix} {seq} {suffix}".rstrip(),
        "call: " + " | ".join(calls.alternatives),
        *calls.rules,
    ]) + "\n"
    # With ``check`` every piece was validated on its own (errors name their
    # tool); the whole compiles in the engine (matchers.GrammarCompiler).
    return _top(lark, calls.subgrammars)


def tool_call_grammar(
    fmt: ToolFormat,
    tools: Sequence[Tool],
    *,
    allowed_names: Sequence[str] | None = None,
    parallel: bool = False,
    max_calls: int | None = None,
    specials: Collection[str] = (),
    limits: Limits = DEFAULT_LIMITS,
    check: bool = True,
) -> str:
    """A grammar forcing one call (``parallel``: one or more, at most
    ``max_calls``) in ``fmt``'s syntax, to a tool named in ``allowed_names``
    (None: any of ``tools``); after the last call only end-of-turn.
    ``check=False``: the pieces are not validated by llguidance (see
    "Compiled once")."""
    bound = max_calls if parallel else 1
    return _tool_grammar(fmt, tools, allowed_names, bound, specials, limits, check)


def lazy_tool_call_grammar(
    fmt: ToolFormat,
    tools: Sequence[Tool],
    *,
    allowed_names: Sequence[str] | None = None,
    parallel: bool = True,
    max_calls: int | None = None,
    specials: Collection[str] = (),
    limits: Limits = DEFAULT_LIMITS,
    check: bool = True,
) -> tuple[str, list[str]]:
    """(grammar, triggers) for ``tool_choice: auto``: the grammar of the
    calls, which the sampler starts where the output first shows one of
    the trigger texts (``fmt.triggers``; ``fmt.start_triggers``, written
    ``^…``, only at the start of the reply, after whitespace)."""
    grammar = tool_call_grammar(fmt, tools, allowed_names=allowed_names, parallel=parallel,
                                max_calls=max_calls, specials=specials, limits=limits, check=check)
    return grammar, lazy_triggers(fmt)


def lazy_triggers(fmt: ToolFormat) -> list[str]:
    """The texts that wake a lazy call grammar (``^…``: only at the start of the reply)."""
    return [*fmt.triggers, *("^" + t for t in fmt.start_triggers)]

