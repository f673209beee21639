"""The one strict JSON decoder: client bodies (lmspd.bodies), WebSocket
messages and an upstream provider's chunks are all read with it. A text
that two JSON parsers could read differently is refused, not guessed at:

- duplicate keys (``"store": false, "store": true``): Python keeps the last,
  other parsers the first;
- non-finite numbers (``NaN``, ``Infinity``, ``1e400``): not JSON at all
  (RFC 8259), and nothing downstream (the store, the SSE writer, schema
  bounds) can represent them;
- lone surrogate escapes (``"\\ud800"``): not a Unicode string, so no
  tokenizer or UTF-8 writer can take it.

Each is an ``ApiError`` (400) whose ``param`` is the JSON path of the
offending value; so is an integer too long for Python to read (more than
``sys.get_int_max_str_digits()`` digits).

The C parser holds the interpreter lock for the whole document, however
many threads wait (the event loop among them): ``value_bound`` and
``count_values`` say how many values a text holds without parsing it, so
that a caller can refuse a document too costly to parse before it starts.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

from lmspd.core.errors import ApiError

SURROGATE = re.compile("[\ud800-\udfff]")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*\Z")


def has_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone UTF-16 surrogate (no UTF-8 can encode it)."""
    return not text.isascii() and SURROGATE.search(text) is not None


class _NonFinite:
    """Stands where the parser met NaN, ±Infinity or an overflowing number,
    so that the walk after parsing can say where it was."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


class _TooLong:
    """Stands where the parser met an integer too long for ``int()``."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits


class _Duplicated(dict[str, Any]):
    """An object in which ``key`` appeared more than once."""

    __slots__ = ("key",)
    key: str


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                dup = _Duplicated(obj)
                dup.key = key
                return dup
            seen.add(key)
    return obj


def _float(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _int(text: str) -> Any:
    # int() refuses more than sys.get_int_max_str_digits() digits, which the
    # parser would report as a bare ValueError about sys.set_int_max_str_digits.
    try:
        return int(text)
    except ValueError:
        return _TooLong(len(text.lstrip("-")))


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_float=_float, parse_int=_int,
                            parse_constant=_NonFinite)


def decode_json(raw: bytes | str, *, max_depth: int = 64) -> Any:
    """Parse JSON strictly (see the module docstring); every refusal is an
    ``ApiError`` (400) naming the JSON path where it applies."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        if text.startswith("\ufeff"):
            raise ValueError("a byte order mark is not allowed (RFC 8259 §8.1)")
        value = _DECODER.decode(text)
    except RecursionError:
        raise ApiError("invalid_json", "The JSON body is nested too deeply.") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError("invalid_json", f"The body is not valid JSON: {exc}") from None
    _check(value, max_depth)
    return value


def _check(value: Any, max_depth: int) -> None:
    # Iterative, so that the walk itself cannot hit the recursion limit; the
    # path is only spelled out for the one value that is refused.
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(value, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, dict):
            if depth > max_depth:
                raise ApiError("invalid_json", f"The JSON body is nested deeper than {max_depth} levels.",
                               param=json_path(path) or None)
            if isinstance(node, _Duplicated):
                where = json_path((*path, node.key))
                raise ApiError("invalid_json", f"The JSON body repeats the key {node.key!r} (at {where!r}); "
                               "each key may appear once.", param=where)
            for key, child in node.items():
                if SURROGATE.search(key):
                    raise _surrogate(json_path(path), "a key")
                if isinstance(child, (dict, list)):
                    stack.append((child, depth + 1, (*path, key)))
                else:
                    _check_scalar(child, (*path, key))
        elif isinstance(node, list):
            if depth > max_depth:
                raise ApiError("invalid_json", f"The JSON body is nested deeper than {max_depth} levels.",
                               param=json_path(path) or None)
            for index, child in enumerate(node):
                if isinstance(child, (dict, list)):
                    stack.append((child, depth + 1, (*path, index)))
                else:
                    _check_scalar(child, (*path, index))
        else:
            _check_scalar(node, path)


def _check_scalar(value: Any, path: tuple[str | int, ...]) -> None:
    if isinstance(value, str):
        if not value.isascii() and SURROGATE.search(value):
            raise _surrogate(json_path(path), "the string")
    elif isinstance(value, _NonFinite):
        where = json_path(path)
        raise ApiError("invalid_json", f"{where or 'The body'!r} is {_shown(value.text)}: JSON numbers must be "
                       "finite.", param=where or None)
    elif isinstance(value, _TooLong):
        where = json_path(path)
        what = f"{where!r} is" if where else "The body is"
        raise ApiError("invalid_json", f"{what} an integer of {value.digits} digits; the limit is "
                       f"{sys.get_int_max_str_digits()}.", param=where or None)


def _shown(number: str) -> str:
    # A number as a message quotes it: "1" followed by 5000 zeros is not.
    return number if len(number) <= 24 else f"{number[:12]}...{number[-8:]} ({len(number)} characters)"


def _surrogate(where: str, what: str) -> ApiError:
    return ApiError("invalid_json", f"In {where or 'the body'!r}, {what} contains a lone UTF-16 surrogate "
                    "escape (\\ud800-\\udfff without its pair), which is not text.", param=where or None)


def json_path(path: tuple[str | int, ...]) -> str:
    """``('input', 0, 'content')`` -> ``input[0].content``, the ``param`` style
    of every other error."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _IDENT.match(part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part, ensure_ascii=True)}]"
    return out


# -- counting values before parsing ------------------------------------------

# What a string holds up to its closing quote: runs of plain characters and
# escapes (possessive: the scan never backtracks).
_STRING_CONTENT = re.compile(rb'[^"\\]*+(?:\\[\s\S][^"\\]*+)*+')
# A string's scan goes this many bytes per call: each call holds the
# interpreter lock, at 5-10 ns a byte (an 8 MiB string at once: ~90 ms).
_STRING_WINDOW = 64 * 1024
_WHITESPACE = b" \t\r\n"


def value_bound(text: bytes | str) -> int:
    """At least the number of values ``text`` holds (see ``count_values``),
    in three scans at memory speed: every value but the document itself
    follows a ``[``, a ``{`` or a comma. Brackets and commas inside strings
    count too, so source code sent as text may come out far above its count."""
    if isinstance(text, str):
        return text.count("[") + text.count("{") + text.count(",") + 1
    return text.count(b"[") + text.count(b"{") + text.count(b",") + 1


def count_values(text: bytes, stop: int) -> int:
    """The values in the JSON document ``text``: each object, array, string,
    number, ``true``, ``false`` and ``null`` (an object's keys are not
    values). Exact for valid JSON; for a text that is not, some number the
    parser will refuse anyway. Counting ends once it passes ``stop``: the
    answer is then some number above it.

    Outside strings, a value begins after each comma and inside each ``[``
    or ``{`` that does not close at once; strings are skipped by a scan of
    their own (the part of the work that is per string, not per byte)."""
    count = 1
    pos = 0
    while count <= stop:
        quote = text.find(b'"', pos)
        count += _values_begun(text[pos:] if quote < 0 else text[pos:quote])
        if quote < 0:
            break
        pos = _after_string(text, quote + 1)
    return count


def _values_begun(gap: bytes) -> int:
    # A stretch of JSON between two strings: no quote, so every character counts.
    begun = gap.count(b",")
    containers = gap.count(b"[") + gap.count(b"{")
    if containers:
        tight = gap.translate(None, _WHITESPACE)
        begun += containers - tight.count(b"[]") - tight.count(b"{}")
    return begun


def _after_string(text: bytes, pos: int) -> int:
    """Where the string whose content starts at ``pos`` ends, past its
    closing quote (``len(text)`` for a string that never closes)."""
    end = len(text)
    while True:
        window = min(pos + _STRING_WINDOW, end)
        stopped = _STRING_CONTENT.match(text, pos, window).end()  # type: ignore[union-attr]
        if stopped < window and text[stopped] == 0x22:  # the closing quote
            return stopped + 1
        if window == end:
            return end
        # The window ended inside the string (or inside one of its escapes).
        pos = stopped
