"""The one incremental JSON scanner every syntax shares.

``StringDecoder`` decodes a JSON string body as it streams; ``ValueScanner``
finds where a JSON value ends without parsing it; ``FunctionArgs`` and
``CustomInput`` receive a call's arguments piece by piece and check them at
the end; ``CallObject`` consumes one ``{"name": ..., "arguments": ...}``
object and drives a parser's call events.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Declared, ToolCallParser

__all__ = ["CallObject", "CustomInput", "FunctionArgs", "Sink", "StringDecoder", "ToolCallError", "ValueScanner", "WS"]


class ToolCallError(Exception):
    """The model's output holds a call that cannot be delivered; the engine
    fails the response with code ``invalid_tool_call``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message



_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')
WS = " \t\r\n"


class StringDecoder:
    """Decodes a JSON string body incrementally, up to its closing quote;
    whatever follows the quote is left in ``rest``."""

    def __init__(self) -> None:
        self._pending = ""
        self._high: int | None = None
        self.closed = False
        self.rest = ""

    def push(self, text: str) -> str:
        if self.closed:
            self.rest += text
            return ""
        text = self._pending + text
        self._pending = ""
        out: list[str] = []
        i, n = 0, len(text)
        while i < n:
            m = _PLAIN.match(text, i)
            if m:
                self._no_high()
                out.append(m.group())
                i = m.end()
                continue
            c = text[i]
            if c == '"':
                self._no_high()
                self.closed = True
                self.rest = text[i + 1 :]
                break
            if c != "\\":
                raise ToolCallError("control character inside a JSON string")
            if i + 1 >= n or (text[i + 1] == "u" and i + 6 > n):
                self._pending = text[i:]
                break
            e = text[i + 1]
            if e == "u":
                out.append(self._unicode(text[i + 2 : i + 6]))
                i += 6
            elif e in _ESCAPES:
                self._no_high()
                out.append(_ESCAPES[e])
                i += 2
            else:
                raise ToolCallError(f"invalid escape \\{e} in a JSON string")
        return "".join(out)

    def _unicode(self, digits: str) -> str:
        if not re.fullmatch(r"[0-9a-fA-F]{4}", digits):
            raise ToolCallError(f"invalid \\u escape {digits!r} in a JSON string")
        cp = int(digits, 16)
        if 0xD800 <= cp < 0xDC00:
            self._no_high()
            self._high = cp
            return ""
        if 0xDC00 <= cp < 0xE000:
            if self._high is None:
                raise ToolCallError("lone low surrogate in a JSON string")
            cp = 0x10000 + ((self._high - 0xD800) << 10) + (cp - 0xDC00)
            self._high = None
            return chr(cp)
        self._no_high()
        return chr(cp)

    def _no_high(self) -> None:
        if self._high is not None:
            raise ToolCallError("lone high surrogate in a JSON string")

    def close(self) -> None:
        if not self.closed:
            raise ToolCallError("unterminated JSON string")
        if self.rest:
            raise ToolCallError("text after the end of a JSON string")


class ValueScanner:
    """Finds where one JSON value ends, without parsing it."""

    def __init__(self) -> None:
        self._kind: str | None = None
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def scan(self, text: str, i: int) -> tuple[int, bool]:
        """Consume from ``text[i:]``; (end index, whether the value ended)."""
        n = len(text)
        if self._kind is None and i < n:
            c = text[i]
            if c in "{[":
                self._kind, self._depth = "nested", 1
                i += 1
            elif c == '"':
                self._kind, self._in_string = "string", True
                i += 1
            else:
                self._kind = "scalar"
        while i < n:
            c = text[i]
            if self._kind == "scalar":
                if c in ",}]" or c in WS:
                    return i, True
            elif self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
                    if self._kind == "string":
                        return i + 1, True
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1, True
            i += 1
        return i, False


class Sink(ABC):
    """Receives a call's argument value piece by piece; returns deltas."""

    @abstractmethod
    def push(self, chunk: str) -> str: ...

    @abstractmethod
    def end(self) -> str:
        """The payload (== all deltas joined); raises if invalid."""


class FunctionArgs(Sink):
    """A JSON object as written, or a JSON string holding one (decoded)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._raw: list[str] = []
        self._decoder: StringDecoder | None = None
        self._started = False

    def push(self, chunk: str) -> str:
        if not chunk:
            return ""
        if not self._started:
            self._started = True
            if chunk[0] == '"':
                self._decoder = StringDecoder()
                chunk = chunk[1:]
            elif chunk[0] != "{":
                raise ToolCallError(f"arguments of {self._name!r} are not a JSON object")
        out = self._decoder.push(chunk) if self._decoder else chunk
        self._raw.append(out)
        return out

    def end(self) -> str:
        if self._decoder:
            self._decoder.close()
        payload = "".join(self._raw)
        try:
            value = json.loads(payload)
        except ValueError:
            raise ToolCallError(f"arguments of {self._name!r} are not valid JSON") from None
        if not isinstance(value, dict):
            raise ToolCallError(f"arguments of {self._name!r} are not a JSON object")
        return payload


class CustomInput(Sink):
    """A custom tool's input under a JSON syntax: ``{"input": "..."}`` or a
    bare JSON string, decoded."""

    _HEAD = re.compile(r'\{\s*"input"\s*:\s*"')

    def __init__(self, name: str) -> None:
        self._name = name
        self._head = ""
        self._decoder: StringDecoder | None = None
        self._wrapped = False
        self._out: list[str] = []

    def push(self, chunk: str) -> str:
        if self._decoder is None:
            self._head += chunk
            if self._head.startswith('"'):
                chunk = self._head[1:]
            else:
                m = self._HEAD.match(self._head)
                if not m:
                    if len(self._head) > 64 or not self._head.startswith("{"):
                        raise self._malformed()
                    return ""
                chunk, self._wrapped = self._head[m.end() :], True
            self._head = ""
            self._decoder = StringDecoder()
        out = self._decoder.push(chunk)
        self._out.append(out)
        return out

    def end(self) -> str:
        if self._decoder is None or not self._decoder.closed:
            raise self._malformed()
        if self._wrapped:
            if self._decoder.rest.strip(WS) != "}":
                raise self._malformed()
            self._decoder.rest = ""
        self._decoder.close()
        return "".join(self._out)

    def _malformed(self) -> ToolCallError:
        return ToolCallError(f'input of {self._name!r} is not {{"input": <string>}}')


class CallObject:
    """One JSON call object, ``{"name": ..., "arguments": ...}``, consumed
    incrementally. Other keys (a Mistral ``id``, a ``type``) are skipped."""

    _ARG_KEYS = ("arguments", "parameters")

    def __init__(self, parser: ToolCallParser) -> None:
        self._p = parser
        self._state = "open"
        self._key = ""
        self._key_scanner: ValueScanner | None = None
        self._value: ValueScanner | None = None
        self._value_kind = ""  # name | args | skip
        self._name_raw = ""
        self._tool: Declared | None = None
        self._sink: Sink | None = None
        self._early_args: list[str] = []  # arguments seen before the name
        self._args_ended = False
        self._payload: str | None = None
        self._seen: set[str] = set()
        self.done = False

    def consume(self, text: str) -> int:
        """Consume a prefix of ``text``; how many characters were used."""
        i, n = 0, len(text)
        while i < n and not self.done:
            state = self._state
            c = text[i]
            if state == "value":
                i = self._value_step(text, i)
                continue
            if state == "key":
                assert self._key_scanner is not None
                j, ended = self._key_scanner.scan(text, i)
                self._key += text[i:j]
                i = j
                if ended:
                    try:
                        self._key = json.loads(self._key)
                    except ValueError:
                        raise ToolCallError("malformed key in a tool call") from None
                    self._state = "colon"
                continue
            if c in WS:
                i += 1
                continue
            if state == "open":
                if c != "{":
                    raise ToolCallError("a tool call is not a JSON object")
                self._state = "key_or_end"
            elif state in ("key_or_end", "key_next"):
                if c == "}" and state == "key_or_end":
                    self._close()
                elif c == '"':
                    self._key, self._key_scanner, self._state = "", ValueScanner(), "key"
                    continue  # the scanner consumes the opening quote
                else:
                    raise ToolCallError("malformed tool call object")
            elif state == "colon":
                if c != ":":
                    raise ToolCallError("malformed tool call object")
                self._begin_value()
            elif state == "value_start":
                self._state = "value"
                continue
            elif state == "comma_or_end":
                if c == ",":
                    self._state = "key_next"
                elif c == "}":
                    self._close()
                else:
                    raise ToolCallError("malformed tool call object")
            i += 1
        return i

    def _begin_value(self) -> None:
        key = self._key
        if key in self._seen or (key in self._ARG_KEYS and self._seen & set(self._ARG_KEYS)):
            raise ToolCallError(f"duplicate {key!r} in a tool call")
        self._seen.add(key)
        self._value = ValueScanner()
        self._value_kind = "name" if key == "name" else "args" if key in self._ARG_KEYS else "skip"
        self._state = "value_start"

    def _value_step(self, text: str, i: int) -> int:
        assert self._value is not None
        j, ended = self._value.scan(text, i)
        chunk = text[i:j]
        if self._value_kind == "name":
            self._name_raw += chunk
            if ended:
                self._on_name()
        elif self._value_kind == "args":
            self._on_args(chunk, ended)
        if ended:
            self._state = "comma_or_end"
        return j

    def _on_name(self) -> None:
        try:
            name = json.loads(self._name_raw)
        except ValueError:
            name = None
        if not isinstance(name, str):
            raise ToolCallError("a tool call's name is not a JSON string")
        self._tool = self._p._lookup(name)
        self._p._start(self._tool)
        self._sink = self._p._sink_for(self._tool)
        if self._early_args:
            self._p._delta(self._sink.push("".join(self._early_args)))
        if self._args_ended:
            self._payload = self._sink.end()

    def _on_args(self, chunk: str, ended: bool) -> None:
        if self._sink is None:
            self._early_args.append(chunk)
            self._args_ended = ended
            return
        self._p._delta(self._sink.push(chunk))
        if ended:
            self._payload = self._sink.end()

    def _close(self) -> None:
        if self._tool is None:
            raise ToolCallError("a tool call has no name")
        if self._payload is None:  # no arguments at all
            self._payload = "{}" if self._tool.kind == "function" else ""
            self._p._delta(self._payload)
        self._p._done(self._payload)
        self.done = True


