"""GBNF grammars that make the llama engine's output valid by construction.

Three uses, all optional (an unconstrained request builds no grammar):

- ``json_schema_grammar(schema)`` / ``json_object_grammar()`` for
  ``text.format`` ``json_schema`` / ``json_object``;
- ``tool_call_grammar(fmt, tools, allowed_names=..., parallel=...)`` forces
  one (or more) tool calls from the first token, for ``tool_choice``
  ``required`` or a named tool;
- ``lazy_tool_call_grammar(...)`` returns the same grammar plus trigger
  patterns for ``tool_choice: auto``: llama.cpp leaves sampling free until
  a pattern matches, then constrains the call from its trigger on.

JSON Schema goes through llama-cpp-python's ``SchemaConverter`` after a
strict pass over the schema. The rule is that the grammar may be stricter
than the schema (every output validates) but never looser: a keyword the
converter would silently ignore is rejected with ``unsupported_capability``
naming it. What the pass does:

- annotations (``title``, ``description``, ``default``, ``examples``,
  ``$schema``, ``$comment``, unknown keywords...) are dropped;
- ``type`` (one or a list), ``enum``, ``const``, ``properties``,
  ``required``, ``additionalProperties``, ``items``, ``prefixItems``,
  ``minItems``/``maxItems``, ``minLength``/``maxLength``, ``pattern`` (the
  regular subset, see ``lark.py``), ``format`` date/time/date-time/uuid,
  ``anyOf``, local ``$ref`` (recursion included) are enforced;
- ``oneOf`` is enforced when its branches are provably disjoint (distinct
  types, distinct constants, or a discriminating constant property), else
  rejected; ``allOf`` is enforced for one branch, or for object branches
  that merge without conflict;
- integer bounds (``minimum``, ``maximum``, exclusive or not) are enforced,
  number bounds when they are inclusive integers from 0 up (such numbers
  are written without exponent); other number bounds, ``multipleOf``,
  ``not``, ``if``/``then``/``else``,
  ``patternProperties``, ``propertyNames``, ``dependentRequired``,
  ``dependentSchemas``, ``contains``, ``uniqueItems: true``,
  ``minProperties``/``maxProperties`` beyond what ``required`` implies are
  rejected;
- objects never get properties beyond ``properties`` (even when
  ``additionalProperties`` allows them) unless they declare no properties at
  all, because the converter could repeat a declared key with another
  value; required keys with no declared schema get ``additionalProperties``'
  schema; other ``format`` values are annotations (JSON Schema 2020-12);
- strings are plain JSON strings without raw control characters (the
  converter's string rule allowed them, which ``json.loads`` rejects).

Tool calls: a function's arguments follow its ``parameters`` schema when
that converts. With ``strict: true`` a schema that does not convert is an
error (400); otherwise the arguments are only required to be a JSON object.
Custom tools follow their Lark or regex grammar when it converts, otherwise
free text (up to the closing tag for the raw syntax, any JSON string when
wrapped as ``{"input": ...}``).

Limits: a schema is bounded by ``RequestLimits.max_tool_schema_bytes`` and
``max_json_depth``; a grammar by ``MAX_GRAMMAR_BYTES``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from llama_cpp.llama_grammar import PRIMITIVE_RULES, RESERVED_NAMES, SchemaConverter

from lmspd.core.conversation import CustomTool, FunctionTool, Tool
from lmspd.core.errors import ApiError
from lmspd.core.limits import DEFAULT_LIMITS, Limits
from lmspd.engines.llama.lark import (
    LarkUnsupported,
    MAX_REPEAT_BOUND,
    gbnf_literal,
    lark_to_gbnf,
    regex_to_gbnf,
)

if TYPE_CHECKING:
    from lmspd.engines.llama.tool_formats import ToolFormat

__all__ = [
    "MAX_GRAMMAR_BYTES",
    "check_json_schema",
    "json_schema_grammar",
    "json_object_grammar",
    "tool_call_grammar",
    "lazy_tool_call_grammar",
    "grammar_compiles",
]

# Belongs in lmspd.core.limits (RequestLimits.max_grammar_bytes) once that
# module takes it; a grammar this large takes llama.cpp noticeable time to load.
MAX_GRAMMAR_BYTES = 1024 * 1024

_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def _any() -> dict[str, Any]:
    return {"type": ["object", "array", "string", "number", "boolean", "null"]}


_OBJECT_KW = {
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    "minProperties", "maxProperties", "dependentRequired", "dependentSchemas", "dependencies",
    "unevaluatedProperties",
}
_ARRAY_KW = {
    "items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains",
    "minContains", "maxContains", "unevaluatedItems",
}
_STRING_KW = {"minLength", "maxLength", "pattern", "format"}
_NUMBER_KW = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
_GENERAL_KW = {
    "type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref",
    "$dynamicRef", "$recursiveRef",
}
_KNOWN_KW = _OBJECT_KW | _ARRAY_KW | _STRING_KW | _NUMBER_KW | _GENERAL_KW
_NEVER = (
    "not", "if", "then", "else", "$dynamicRef", "$recursiveRef", "patternProperties", "propertyNames",
    "dependentRequired", "dependentSchemas", "dependencies", "contains", "minContains", "maxContains",
)
_FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
_KW_OF_TYPE = {
    "object": _OBJECT_KW, "array": _ARRAY_KW, "string": _STRING_KW, "number": _NUMBER_KW,
    "integer": _NUMBER_KW, "boolean": set(), "null": set(),
}

# JSON string characters without raw control characters (the converter's own
# rule lets the model emit a raw newline inside a string).
_SAFE_CHAR = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'


def _unsupported(param: str, keyword: str, why: str = "") -> ApiError:
    detail = f" ({why})" if why else ""
    return ApiError(
        "unsupported_capability",
        f"JSON Schema keyword {keyword!r} at {param} cannot be enforced by constrained decoding{detail}.",
        param=param,
    )


class _Normalizer:
    """Checks a schema and rewrites it into the subset the converter enforces.

    Every ``$ref`` target is normalized once and stored under a fresh name
    in ``$defs`` (``<ref_prefix>N``): the converter names rules after a
    ref's last path segment, so two targets with the same last segment, or a
    ref named like a property, would otherwise share a rule.
    """

    def __init__(self, root: Any, param: str, ref_prefix: str, limits: Limits) -> None:
        self.root = root
        self.param = param
        self.ref_prefix = ref_prefix
        self.max_depth = limits.request.max_json_depth
        self.ref_ids: dict[str, str] = {}
        self.defs: dict[str, Any] = {}

    def run(self) -> dict[str, Any]:
        out = dict(self.node(self.root, self.param, 0))
        if self.defs:
            if "$ref" in out:
                # The converter's ref walk does not descend below a $ref node,
                # so the root must not be one.
                out = {"anyOf": [out]}
            out["$defs"] = self.defs
            self._check_left_recursion(out)
        return out

    # structure

    def node(self, node: Any, path: str, depth: int) -> dict[str, Any]:
        if depth > self.max_depth:
            raise ApiError("invalid_request", f"Schema nested deeper than {self.max_depth} at {path}.", param=path)
        if node is True:
            return _any()
        if node is False:
            raise _unsupported(path, "false", "the schema false matches nothing")
        if not isinstance(node, dict):
            raise ApiError("invalid_request", f"Schema at {path} is not an object or a boolean.", param=path)
        for kw in _NEVER:
            if kw in node:
                raise _unsupported(f"{path}.{kw}", kw)
        kws = [k for k in node if k in _KNOWN_KW]
        if "$ref" in node:
            return self.ref(node, kws, path, depth)
        if "const" in node or "enum" in node:
            return self.literals(node, path)
        combos = [k for k in ("anyOf", "oneOf", "allOf") if k in node]
        if len(combos) > 1:
            raise _unsupported(f"{path}.{combos[1]}", combos[1], f"together with {combos[0]}")
        if combos == ["allOf"]:
            return self.all_of(node, kws, path, depth)
        if combos:
            key = combos[0]
            for other in kws:
                if other != key:
                    raise _unsupported(f"{path}.{other}", other, f"next to {key}")
            branches = node[key]
            if not isinstance(branches, list) or not branches:
                raise ApiError("invalid_request", f"{path}.{key} must be a non-empty array.", param=f"{path}.{key}")
            if key == "oneOf":
                self._check_disjoint(branches, f"{path}.oneOf")
            return {"anyOf": [self.node(b, f"{path}.{key}[{i}]", depth + 1) for i, b in enumerate(branches)]}
        return self.typed(node, path, depth)

    def ref(self, node: dict, kws: list[str], path: str, depth: int) -> dict[str, Any]:
        for other in kws:
            if other != "$ref":
                raise _unsupported(f"{path}.{other}", other, "next to $ref")
        ref = node["$ref"]
        pointer = self._pointer(ref, f"{path}.$ref")
        if pointer not in self.ref_ids:
            name = f"{self.ref_prefix}{len(self.ref_ids)}"
            self.ref_ids[pointer] = name
            self.defs[name] = self.node(self._resolve(pointer, f"{path}.$ref"), self._pointer_path(pointer), depth + 1)
        return {"$ref": f"#/$defs/{self.ref_ids[pointer]}"}

    def typed(self, node: dict, path: str, depth: int) -> dict[str, Any]:
        t = node.get("type")
        if t is None:
            # Type-specific keywords only constrain values of that type;
            # producing that type alone is stricter, hence fine.
            present = set(node)
            t = next((k for k, kws in _KW_OF_TYPE.items() if kws and present & kws), None)
            if t is None:
                return _any()
        types = t if isinstance(t, list) else [t]
        if not types or any(x not in _TYPES for x in types):
            raise ApiError("invalid_request", f"{path}.type has an unknown type.", param=f"{path}.type")
        if "number" in types and "integer" in types:
            types = [x for x in types if x != "integer"]
        if len(types) > 1:
            return {"anyOf": [self.one_type(node, x, path, depth) for x in dict.fromkeys(types)]}
        return self.one_type(node, types[0], path, depth)

    def one_type(self, node: dict, t: str, path: str, depth: int) -> dict[str, Any]:
        if t == "object":
            return self.object(node, path, depth)
        if t == "array":
            return self.array(node, path, depth)
        if t == "string":
            return self.string(node, path)
        if t in ("integer", "number"):
            return self.number(node, t, path)
        return {"type": t}

    def object(self, node: dict, path: str, depth: int) -> dict[str, Any]:
        props_in = node.get("properties", {})
        if not isinstance(props_in, dict):
            raise ApiError("invalid_request", f"{path}.properties must be an object.", param=f"{path}.properties")
        # A property whose schema is false may not appear: never emit it.
        props = {
            k: self.node(v, f"{path}.properties.{k}", depth + 1) for k, v in props_in.items() if v is not False
        }
        required = node.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ApiError("invalid_request", f"{path}.required must be an array of strings.", param=f"{path}.required")
        additional = node.get("additionalProperties", True)
        if node.get("unevaluatedProperties", True) is not True:
            if node["unevaluatedProperties"] is not False:
                raise _unsupported(f"{path}.unevaluatedProperties", "unevaluatedProperties")
            if "additionalProperties" not in node:
                additional = False
        for r in required:
            if r not in props:
                if additional is False or props_in.get(r) is False:
                    raise _unsupported(f"{path}.required", "required", f"{r!r} is required but not allowed")
                props[r] = self.node(additional, f"{path}.additionalProperties", depth + 1)
        required = list(dict.fromkeys(required))
        if "minProperties" in node and node["minProperties"] > len(required):
            raise _unsupported(f"{path}.minProperties", "minProperties", "more than the required properties")
        if "maxProperties" in node:
            # Extra keys are only ever produced for property-less maps.
            if not props or len(props) > node["maxProperties"]:
                raise _unsupported(f"{path}.maxProperties", "maxProperties")
        out: dict[str, Any] = {"type": "object"}
        if props:
            out["properties"] = props
            out["required"] = required
        elif additional is False:
            out["properties"] = {}
        elif isinstance(additional, dict) and self._constrains(additional):
            out["additionalProperties"] = self.node(additional, f"{path}.additionalProperties", depth + 1)
        return out

    def array(self, node: dict, path: str, depth: int) -> dict[str, Any]:
        lo, hi = node.get("minItems", 0), node.get("maxItems")
        for key, v in (("minItems", lo), ("maxItems", hi)):
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ApiError("invalid_request", f"{path}.{key} must be a non-negative integer.", param=f"{path}.{key}")
        if hi is not None and hi < lo:
            raise _unsupported(f"{path}.maxItems", "maxItems", "smaller than minItems")
        unique = node.get("uniqueItems", False)
        # unevaluatedItems: false holds for every array produced here (all
        # items are covered by items, or there are none beyond the tuple).
        if node.get("unevaluatedItems", False) not in (True, False):
            raise _unsupported(f"{path}.unevaluatedItems", "unevaluatedItems")
        items = node.get("items", True)
        prefix = node.get("prefixItems")
        if isinstance(items, list):  # draft 4 tuples
            prefix, items = items, node.get("additionalItems", True)
        elif "additionalItems" in node:
            raise _unsupported(f"{path}.additionalItems", "additionalItems")
        if prefix is not None:
            if not isinstance(prefix, list):
                raise ApiError("invalid_request", f"{path}.prefixItems must be an array.", param=f"{path}.prefixItems")
            if items not in (True, False) and items != {}:
                raise _unsupported(f"{path}.items", "items", "after prefixItems")
            n = len(prefix)
            # The converter emits exactly the tuple.
            if lo > n or (hi is not None and hi < n):
                raise _unsupported(f"{path}.minItems", "minItems/maxItems", "with prefixItems")
            if unique and n > 1:
                raise _unsupported(f"{path}.uniqueItems", "uniqueItems")
            return {"type": "array", "prefixItems": [self.node(p, f"{path}.prefixItems[{i}]", depth + 1) for i, p in enumerate(prefix)]}
        if unique and (hi is None or hi > 1):
            raise _unsupported(f"{path}.uniqueItems", "uniqueItems")
        if items is False:
            if lo > 0:
                raise _unsupported(f"{path}.items", "items", "false with minItems")
            return {"type": "array", "prefixItems": []}
        if max(lo, hi or 0) > MAX_REPEAT_BOUND:
            raise _unsupported(f"{path}.maxItems", "maxItems", f"bounds above {MAX_REPEAT_BOUND}")
        out = {"type": "array", "items": self.node(items, f"{path}.items", depth + 1), "minItems": lo}
        if hi is not None:
            out["maxItems"] = hi
        return out

    def string(self, node: dict, path: str) -> dict[str, Any]:
        fmt = node.get("format")
        enforced_format = fmt in _FORMATS
        has_len = "minLength" in node or "maxLength" in node
        pattern = node.get("pattern")
        if pattern is not None and (has_len or enforced_format):
            raise _unsupported(f"{path}.pattern", "pattern", "combined with a length or format")
        if enforced_format and has_len:
            key = "minLength" if "minLength" in node else "maxLength"
            raise _unsupported(f"{path}.{key}", key, f"combined with format {fmt!r}")
        if pattern is not None:
            if not isinstance(pattern, str):
                raise ApiError("invalid_request", f"{path}.pattern must be a string.", param=f"{path}.pattern")
            try:
                regex_to_gbnf(pattern, json_string=True, search=True)
            except LarkUnsupported as exc:
                raise _unsupported(f"{path}.pattern", "pattern", exc.construct) from None
            return {"type": "string", "pattern": pattern}
        if enforced_format:
            return {"type": "string", "format": fmt}
        if has_len:
            lo, hi = node.get("minLength", 0), node.get("maxLength")
            if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int) or hi < lo)):
                raise ApiError("invalid_request", f"{path} has invalid minLength/maxLength.", param=path)
            if max(lo, hi or 0) > 8 * MAX_REPEAT_BOUND:
                raise _unsupported(f"{path}.maxLength", "maxLength", f"bounds above {8 * MAX_REPEAT_BOUND}")
            out: dict[str, Any] = {"type": "string", "minLength": lo}
            if hi is not None:
                out["maxLength"] = hi
            return out
        return {"type": "string"}

    def number(self, node: dict, t: str, path: str) -> dict[str, Any]:
        """Bounds become integer ``minimum``/``maximum`` the converter
        subclass enforces: any integer range, and for numbers a range with
        integer ends from 0 up (probabilities, scores, ratings)."""
        for key in _NUMBER_KW & set(node):
            value = node[key]
            flag_ok = key.startswith("exclusive") and isinstance(value, bool)  # draft 4
            if not flag_ok and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ApiError("invalid_request", f"{path}.{key} must be a number.", param=f"{path}.{key}")
        multiple = node.get("multipleOf")
        if multiple is not None and not (t == "integer" and multiple == 1):
            raise _unsupported(f"{path}.multipleOf", "multipleOf")
        lo = _bound(node, "minimum", "exclusiveMinimum", t, path, up=True)
        hi = _bound(node, "maximum", "exclusiveMaximum", t, path, up=False)
        if lo is not None and hi is not None and lo > hi:
            raise _unsupported(f"{path}.minimum", "minimum", "no value lies between minimum and maximum")
        if t == "number" and (lo is not None or hi is not None) and (lo is None or lo < 0):
            key = "minimum" if lo is not None else "maximum"
            raise _unsupported(f"{path}.{key}", key, "number bounds need an integer minimum of 0 or more")
        out: dict[str, Any] = {"type": t}
        if lo is not None:
            out["minimum"] = lo
        if hi is not None:
            out["maximum"] = hi
        return out

    def literals(self, node: dict, path: str) -> dict[str, Any]:
        key = "const" if "const" in node else "enum"
        values = [node["const"]] if key == "const" else node["enum"]
        if key == "enum" and (not isinstance(values, list) or not values):
            raise ApiError("invalid_request", f"{path}.enum must be a non-empty array.", param=f"{path}.enum")
        rest = {k: v for k, v in node.items() if k in _KNOWN_KW and k not in ("const", "enum")}
        if "const" in node and "enum" in node:
            rest["enum"] = node["enum"]
        if rest:
            # Only the values that also pass the sibling keywords may be emitted.
            values = [v for v in values if self._valid(v, rest, path)]
            if not values:
                raise _unsupported(f"{path}.{key}", key, "no value satisfies the other keywords")
        return {"enum": values}

    def all_of(self, node: dict, kws: list[str], path: str, depth: int) -> dict[str, Any]:
        parts = node["allOf"]
        if not isinstance(parts, list) or not parts:
            raise ApiError("invalid_request", f"{path}.allOf must be a non-empty array.", param=f"{path}.allOf")
        siblings = {k: node[k] for k in kws if k != "allOf"}
        if len(parts) == 1 and not siblings:
            return self.node(parts[0], f"{path}.allOf[0]", depth + 1)
        # Merge object schemas; anything else cannot be intersected here.
        merged_props: dict[str, Any] = {}
        required: list[str] = []
        closed: list[set[str]] = []  # property sets of parts that forbid others
        components = [(f"{path}.allOf[{i}]", p) for i, p in enumerate(parts)]
        if siblings:
            components.append((path, siblings))
        for where, part in components:
            part = self._deref(part, where)
            allowed = {"type", "properties", "required", "additionalProperties"}
            if (
                not isinstance(part, dict)
                or any(k in _KNOWN_KW and k not in allowed for k in part)
                or part.get("type", "object") != "object"
                or not isinstance(part.get("properties", {}), dict)
            ):
                raise _unsupported(f"{path}.allOf", "allOf", "only object schemas with properties can be combined")
            for k, v in part.get("properties", {}).items():
                if k in merged_props and merged_props[k] != v:
                    raise _unsupported(f"{path}.allOf", "allOf", f"property {k!r} defined twice")
                merged_props[k] = v
            required += part.get("required", [])
            if part.get("additionalProperties", True) is False:
                closed.append(set(part.get("properties", {})))
        for names in closed:
            if set(merged_props) - names or set(required) - names:
                raise _unsupported(f"{path}.allOf", "allOf", "a part forbids properties another part declares")
        return self.object(
            {"type": "object", "properties": merged_props, "required": list(dict.fromkeys(required)), "additionalProperties": False},
            path,
            depth,
        )

    # helpers

    def _pointer(self, ref: Any, path: str) -> str:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise _unsupported(path, "$ref", "only local references (#/...) are supported")
        pointer = unquote(ref[1:])
        if pointer and not pointer.startswith("/"):
            raise _unsupported(path, "$ref", "anchors are not supported")
        return pointer

    def _resolve(self, pointer: str, path: str) -> Any:
        target = self.root
        for raw in pointer.split("/")[1:]:
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise ApiError("invalid_request", f"$ref #{pointer} at {path} points nowhere.", param=path)
        return target

    def _pointer_path(self, pointer: str) -> str:
        return self.param + "".join(f".{p}" for p in pointer.split("/")[1:])

    def _deref(self, node: Any, path: str) -> Any:
        seen = set()
        while isinstance(node, dict) and "$ref" in node:
            pointer = self._pointer(node["$ref"], f"{path}.$ref")
            if pointer in seen:
                raise _unsupported(f"{path}.$ref", "$ref", "a reference cycle")
            seen.add(pointer)
            node = self._resolve(pointer, f"{path}.$ref")
        return node

    def _constrains(self, schema: dict) -> bool:
        return any(k in _KNOWN_KW for k in schema)

    def _valid(self, value: Any, schema: dict, path: str) -> bool:
        import jsonschema

        doc = dict(schema)
        if isinstance(self.root, dict):
            for key in ("$defs", "definitions"):
                if key in self.root:
                    doc[key] = self.root[key]
        try:
            return jsonschema.Draft202012Validator(doc).is_valid(value)
        except Exception:  # noqa: BLE001 - an unresolvable sibling is not enforceable
            raise _unsupported(path, "enum", "the keywords next to it cannot be checked") from None

    def _check_disjoint(self, branches: list, path: str) -> None:
        resolved = [self._deref(b, f"{path}[{i}]") for i, b in enumerate(branches)]
        for i in range(len(resolved)):
            for j in range(i + 1, len(resolved)):
                if not _disjoint(resolved[i], resolved[j]):
                    raise _unsupported(
                        path, "oneOf", f"branches {i} and {j} may overlap; use anyOf or a discriminating const"
                    )

    def _check_left_recursion(self, schema: dict) -> None:
        """A ref cycle that consumes no text first loops llama.cpp's parser."""

        def left(node: dict) -> set[str]:
            if "$ref" in node:
                return {node["$ref"].rsplit("/", 1)[-1]}
            if "anyOf" in node:
                return set().union(*(left(b) for b in node["anyOf"]))
            return set()

        edges = {name: left(body) for name, body in self.defs.items()}
        state: dict[str, int] = {}

        def visit(name: str) -> None:
            state[name] = 1
            for nxt in edges.get(name, ()):
                if state.get(nxt) == 1:
                    raise _unsupported(self.param, "$ref", "a reference cycle that produces no text")
                if nxt not in state:
                    visit(nxt)
            state[name] = 2

        for name in edges:
            if name not in state:
                visit(name)


def _literal_set(node: Any) -> list[str] | None:
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [json.dumps(node["const"], sort_keys=True)]
    if "enum" in node and isinstance(node["enum"], list):
        return [json.dumps(v, sort_keys=True) for v in node["enum"]]
    return None


def _type_class(node: Any) -> set[str] | None:
    if not isinstance(node, dict) or "type" not in node:
        return None
    types = node["type"] if isinstance(node["type"], list) else [node["type"]]
    return {"number" if t == "integer" else t for t in types}


def _disjoint(a: Any, b: Any) -> bool:
    la, lb = _literal_set(a), _literal_set(b)
    if la is not None and lb is not None and not set(la) & set(lb):
        return True
    ta, tb = _type_class(a), _type_class(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        pa, pb = a.get("properties", {}), b.get("properties", {})
        ra, rb = set(a.get("required", [])), set(b.get("required", []))
        for key in ra & rb & set(pa) & set(pb):
            la, lb = _literal_set(pa[key]), _literal_set(pb[key])
            if la is not None and lb is not None and not set(la) & set(lb):
                return True
    return False


def _bound(node: dict, inclusive: str, exclusive: str, t: str, path: str, *, up: bool) -> int | None:
    """An integer bound from ``minimum``/``exclusiveMinimum`` (or the maxima).

    For integers any bound rounds inward; for numbers only integer
    inclusive bounds are representable."""
    value, strict = node.get(inclusive), False
    ex = node.get(exclusive)
    if isinstance(ex, bool):  # draft 4: a flag on the inclusive bound
        strict = ex
    elif ex is not None:
        if value is None or (ex >= value if up else ex <= value):
            value, strict = ex, True
    if value is None:
        return None
    if t == "number":
        if strict or value != int(value):
            key = exclusive if strict else inclusive
            raise _unsupported(f"{path}.{key}", key, "number bounds must be inclusive integers")
        return int(value)
    if up:
        n = math.floor(value) + 1 if strict else math.ceil(value)
    else:
        n = math.ceil(value) - 1 if strict else math.floor(value)
    if abs(n) >= 10**_MAX_DIGITS:
        raise _unsupported(f"{path}.{inclusive}", inclusive, f"bounds beyond {_MAX_DIGITS} digits")
    return n


_MAX_DIGITS = 16  # the converter's integers have at most 16 digits


def _digits_range(lo: str, hi: str) -> str:
    """GBNF for the digit strings of one length from ``lo`` to ``hi``."""
    if lo == hi:
        return gbnf_literal(lo)
    n = len(lo) - 1
    if lo[1:] == "0" * n and hi[1:] == "9" * n:
        return f"[{lo[0]}-{hi[0]}]" + (f" [0-9]{{{n}}}" if n else "")
    if lo[0] == hi[0]:
        return f"{gbnf_literal(lo[0])} {_digits_range(lo[1:], hi[1:])}"
    alts = [f"{gbnf_literal(lo[0])} {_digits_range(lo[1:], '9' * n)}"]
    if int(hi[0]) - int(lo[0]) > 1:
        alts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}] [0-9]{{{n}}}")
    alts.append(f"{gbnf_literal(hi[0])} {_digits_range('0' * n, hi[1:])}")
    return "(" + " | ".join(alts) + ")"


def _natural_range(lo: int, hi: int | None) -> str:
    """GBNF for the integers lo..hi (hi None: unbounded), lo >= 0, no sign."""
    alts = []
    if lo == 0:
        alts.append('"0"')
        lo = 1
    if hi is None or lo <= hi:
        top = _MAX_DIGITS if hi is None else len(str(hi))
        for width in range(len(str(lo)), top + 1):
            a = max(lo, 10 ** (width - 1))
            if hi is None and a == 10 ** (width - 1):
                # Every longer width is unconstrained: one rule for them all.
                alts.append(f"[1-9] [0-9]{{{width - 1},{_MAX_DIGITS - 1}}}" if width > 1 else f"[1-9] [0-9]{{0,{_MAX_DIGITS - 1}}}")
                break
            b = 10**width - 1 if hi is None else min(hi, 10**width - 1)
            if a <= b:
                alts.append(_digits_range(str(a), str(b)))
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


def _integer_range(lo: int | None, hi: int | None) -> str:
    alts = []
    if lo is None or lo < 0:
        # Negative n in [lo, min(hi, -1)], written "-" |n|.
        alts.append('"-" ' + _natural_range(1 if hi is None or hi >= 0 else -hi, None if lo is None else -lo))
    if hi is None or hi >= 0:
        alts.append(_natural_range(max(lo or 0, 0), hi))
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


def _number_range(lo: int, hi: int | None) -> str:
    """Numbers in [lo, hi] with integer ends, lo >= 0, without exponent."""
    fraction = '("." [0-9]{1,16})?'
    if hi is None:
        return f"{_natural_range(lo, None)} {fraction}"
    exact = f'{gbnf_literal(str(hi))} ("." "0"{{1,16}})?'
    if hi == lo:
        return exact
    return f"({_natural_range(lo, hi - 1)} {fraction} | {exact})"


def _counted(item: str, lo: int, hi: int | None, sep: str | None = None) -> str:
    """``item`` repeated lo..hi times (separated by ``sep``), in GBNF."""
    if sep is None:
        if hi is None:
            return {0: f"{item}*", 1: f"{item}+"}.get(lo, f"{item}{{{lo},}}")
        return f"{item}{{{lo},{hi}}}" if hi else '""'
    if hi == 0:
        return '""'
    more = _counted(f"({sep} {item})", max(lo - 1, 0), None if hi is None else hi - 1)
    return f"{item} {more}" if lo >= 1 else f"({item} {more})?"


class _Converter(SchemaConverter):
    """llama-cpp-python's converter, with GBNF ``{m,n}`` counts instead of
    nested expansions, JSON-safe patterns and strings, and integer floors."""

    def __init__(self) -> None:
        super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)

    def visit(self, schema: dict, name: str) -> str:
        t = schema.get("type")
        rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
        if t == "string" and "pattern" in schema:
            body = regex_to_gbnf(schema["pattern"], json_string=True, search=True)
            return self._add_rule(rule_name, f'"\\"" ({body}) "\\"" space')
        if t == "string" and ("minLength" in schema or "maxLength" in schema):
            char = self._add_primitive("char", PRIMITIVE_RULES["char"])
            count = _counted(char, schema.get("minLength", 0), schema.get("maxLength"))
            return self._add_rule(rule_name, f'"\\"" {count} "\\"" space')
        if t == "array" and isinstance(schema.get("items"), dict):
            item = self.visit(schema["items"], f"{name}{'-' if name else ''}item")
            count = _counted(item, schema.get("minItems", 0), schema.get("maxItems"), sep='"," space')
            return self._add_rule(rule_name, f'"[" space {count} "]" space')
        if t == "integer" and ("minimum" in schema or "maximum" in schema):
            body = _integer_range(schema.get("minimum"), schema.get("maximum"))
            return self._add_rule(rule_name, f"{body} space")
        if t == "number" and "minimum" in schema:
            return self._add_rule(rule_name, f"{_number_range(schema['minimum'], schema.get('maximum'))} space")
        return super().visit(schema, name)

    def format_grammar(self) -> str:
        if "char" in self._rules:
            self._rules["char"] = _SAFE_CHAR
        return super().format_grammar()


def _schema_size_check(schema: Any, param: str, limits: Limits) -> None:
    try:
        size = len(json.dumps(schema).encode())
    except (TypeError, ValueError, RecursionError):
        raise ApiError("invalid_request", f"{param} is not a JSON schema.", param=param) from None
    if size > limits.request.max_tool_schema_bytes:
        raise ApiError(
            "invalid_request",
            f"{param} is {size} bytes; the limit is {limits.request.max_tool_schema_bytes}.",
            param=param,
        )


def _normalized(schema: Any, param: str, ref_prefix: str, limits: Limits) -> dict[str, Any]:
    _schema_size_check(schema, param, limits)
    return _Normalizer(schema, param, ref_prefix, limits).run()


def _bounded(grammar: str, param: str) -> str:
    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise ApiError(
            "invalid_request",
            f"The grammar for {param} would exceed {MAX_GRAMMAR_BYTES} bytes; simplify the schema.",
            param=param,
        )
    return grammar


def check_json_schema(schema: Any, *, param: str = "text.format.schema", limits: Limits = DEFAULT_LIMITS) -> None:
    """Raise ``ApiError`` if ``schema`` cannot be enforced (cheap; for request validation)."""
    _normalized(schema, param, "ref-", limits)


def json_schema_grammar(
    schema: dict[str, Any], *, param: str = "text.format.schema", limits: Limits = DEFAULT_LIMITS
) -> str:
    """GBNF for JSON text valid against ``schema`` (``text.format`` json_schema)."""
    converter = _Converter()
    normalized = _normalized(schema, param, "ref-", limits)
    converter.resolve_refs(normalized, "schema")
    rule = converter.visit(normalized, "v")
    converter._add_rule("root", rule)
    return _bounded(converter.format_grammar() + "\n", param)


def json_object_grammar() -> str:
    """GBNF for any JSON object (``text.format`` json_object)."""
    return json_schema_grammar({"type": "object"})


# --- tool calls ----------------------------------------------------------


def _until(name: str, stop: str) -> dict[str, str]:
    """Rules for any text not containing ``stop``, then ``stop`` itself.

    A KMP automaton: rule ``name-k`` means "the last k characters match the
    start of ``stop``", so the text ends exactly at the first ``stop``."""
    fail = [0] * (len(stop) + 1)
    for i in range(1, len(stop)):
        k = fail[i]
        while k and stop[i] != stop[k]:
            k = fail[k]
        fail[i + 1] = k + 1 if stop[i] == stop[k] else 0

    def step(k: int, ch: str) -> int:
        while k and stop[k] != ch:
            k = fail[k]
        return k + 1 if stop[k] == ch else 0

    rules = {}
    alphabet = sorted(set(stop))
    for k in range(len(stop)):
        alts, moving = [], []
        for ch in alphabet:
            j = step(k, ch)
            if j == len(stop):
                alts.append(gbnf_literal(ch))
            elif j:
                alts.append(f"{gbnf_literal(ch)} {name}-{j}")
            else:
                continue
            moving.append(ch)
        # Every other character leaves no partial match behind.
        alts.append(f"[^{''.join(_class_escape(ch) for ch in moving)}] {name}-0")
        rules[f"{name}-{k}"] = " | ".join(alts)
    return rules


def _class_escape(ch: str) -> str:
    return ch if ch.isascii() and ch.isalnum() else f"\\x{ord(ch):02X}" if ord(ch) < 0x100 else f"\\u{ord(ch):04X}"


def _function_args(converter: _Converter, tool: FunctionTool, index: int, limits: Limits) -> str:
    param = f"tools.{tool.name}.parameters"
    if not tool.parameters:
        return converter._add_primitive("object", PRIMITIVE_RULES["object"])
    try:
        normalized = _normalized(tool.parameters, param, f"ref-{index}-", limits)
        if normalized.get("type") != "object":
            raise ApiError("unsupported_capability", f"{param} must describe a JSON object.", param=param)
    except ApiError:
        if tool.strict:
            raise
        # Not strict: the arguments need only be a JSON object.
        return converter._add_primitive("object", PRIMITIVE_RULES["object"])
    converter.resolve_refs(normalized, f"tool{index}")
    return converter.visit(normalized, f"t{index}")


def _custom_input(converter: _Converter, tool: CustomTool, index: int, json_string: bool) -> str | None:
    """The rule for a custom tool's input, or None for free text."""
    grammar = tool.grammar or {}
    definition = grammar.get("definition")
    if not definition:
        return None
    try:
        if grammar.get("syntax") == "regex":
            body = regex_to_gbnf(definition, json_string=json_string)
            return converter._add_rule(f"c{index}", f"({body})")
        fragment = lark_to_gbnf(definition, prefix=f"c{index}", json_string=json_string)
    except LarkUnsupported:
        return None
    for rule, body in fragment.rules.items():
        converter._rules[rule] = body
    return fragment.root


def _call_alternatives(
    fmt: ToolFormat, tools: Sequence[Tool], allowed_names: Sequence[str] | None, limits: Limits
) -> tuple[_Converter, list[str], list[str]]:
    """Rules for each allowed tool's call; (converter, rule names, literal heads)."""
    by_name = {t.name: t for t in tools if isinstance(t, (FunctionTool, CustomTool))}
    names = list(by_name) if allowed_names is None else list(dict.fromkeys(allowed_names))
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ApiError("invalid_request", f"tool_choice names {missing[0]!r}, which is not among the tools.", param="tool_choice")
    if not names:
        raise ApiError("invalid_request", "tool_choice requires a tool call but no tool can be called.", param="tool_choice")
    converter = _Converter()
    alts, heads = [], []
    for i, name in enumerate(names):
        tool = by_name[name]
        if isinstance(tool, CustomTool) and fmt.raw_custom:
            rule = _custom_input(converter, tool, i, json_string=False)
            before, after = fmt.call_parts(name, raw=True)
            if rule is None:
                # Free text: anything up to the closing tag (which the rule includes).
                stop = after.lstrip("\n")
                for k, body in _until(f"u{i}", stop).items():
                    converter._rules[k] = body
                body = f"{gbnf_literal(before)} u{i}-0"
            else:
                body = f"{gbnf_literal(before)} {rule} {gbnf_literal(after)}"
        else:
            if isinstance(tool, CustomTool):
                rule = _custom_input(converter, tool, i, json_string=True)
                # The primitive string rule ends with its own optional space.
                string = f'"\\"" {rule} "\\"" space' if rule else converter._add_primitive("string", PRIMITIVE_RULES["string"])
                args = converter._add_rule(f"t{i}-input", f'"{{" space "\\"input\\"" space ":" space {string} "}}" space')
            else:
                args = _function_args(converter, tool, i, limits)
            before, after = fmt.call_parts(name, raw=False)
            body = f"{gbnf_literal(before)} {args} {gbnf_literal(after)}"
        alts.append(converter._add_rule(f"call-{i}", body))
        heads.append(before)
    return converter, alts, heads


def _tool_grammar(
    fmt: ToolFormat,
    tools: Sequence[Tool],
    allowed_names: Sequence[str] | None,
    max_calls: int | None,
    limits: Limits,
) -> tuple[str, list[str]]:
    if max_calls is not None and max_calls < 1:
        raise ValueError("max_calls must be at least 1")
    converter, alts, heads = _call_alternatives(fmt, tools, allowed_names, limits)
    converter._add_rule("call", " | ".join(alts))
    converter._add_rule("root", fmt.gbnf_calls("call", max_calls))
    return _bounded(converter.format_grammar() + "\n", "tools"), heads


def tool_call_grammar(
    fmt: ToolFormat,
    tools: Sequence[Tool],
    *,
    allowed_names: Sequence[str] | None = None,
    parallel: bool = False,
    max_calls: int | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> str:
    """GBNF forcing one call (``parallel``: one or more, at most ``max_calls``)
    in ``fmt``'s syntax, to a tool named in ``allowed_names`` (None: any of
    ``tools``); after the last call only end-of-generation is allowed."""
    return _tool_grammar(fmt, tools, allowed_names, max_calls if parallel else 1, limits)[0]


def lazy_tool_call_grammar(
    fmt: ToolFormat,
    tools: Sequence[Tool],
    *,
    allowed_names: Sequence[str] | None = None,
    parallel: bool = True,
    max_calls: int | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> tuple[str, list[str]]:
    """(grammar, trigger patterns) for ``tool_choice: auto``.

    For ``LlamaSampler.add_grammar_lazy_patterns(model, LlamaGrammar.from_string(grammar),
    patterns, trigger_tokens)``: the grammar starts at the trigger text, so
    the text before a call is free and the call itself is constrained.
    """
    grammar, heads = _tool_grammar(fmt, tools, allowed_names, max_calls if parallel else 1, limits)
    return grammar, fmt.lazy_patterns(heads)


def grammar_compiles(vocab: Any, gbnf: str, root: str = "root") -> bool:
    """Whether llama.cpp accepts ``gbnf`` (``vocab``: ``Llama._model.vocab``).

    ``LlamaGrammar.from_string`` does not parse anything in llama-cpp-python
    0.3.36; llama.cpp only parses when the sampler is created, and adding
    the NULL it returns on a bad grammar to a sampler chain would crash.
    """
    from llama_cpp import llama_cpp

    sampler = llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode(), root.encode())
    if not sampler:
        return False
    llama_cpp.llama_sampler_free(sampler)
    return True

