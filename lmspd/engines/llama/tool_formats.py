"""Tool-call syntaxes: which one a model speaks, how to render it, how to parse it.

A model learned one way to call tools; its chat template shows which.
``detect_tool_format(chat_template)`` picks a ``ToolFormat``:

``hermes``   Qwen2.5, Qwen3, Hermes 2 Pro/3 and alike::

                 <tool_call>
                 {"name": "get_weather", "arguments": {"city": "Paris"}}
                 </tool_call>

             one block per call, results in ``<tool_response>`` blocks.
``llama3``   Llama 3.1+: ``{"name": "get_weather", "parameters": {...}}`` at
             the start of the reply, or anywhere after ``<|python_tag|>``.
``mistral``  ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]``; the
             v11 templates (``[ARGS]``) use ``[TOOL_CALLS]name[ARGS]{...}``.
``fallback`` the template knows nothing of tools (the bundled SmolLM2):
             lmspd renders the tool list and past calls itself, below.

``native`` is true when the template itself renders ``tools``,
``tool_calls`` and role ``tool`` messages (the Hugging Face convention):
the engine then passes them to the template (``template_tools``,
``template_tool_calls``, ``template_tool_message`` give the dicts) and uses
only the parser and grammars from here. Otherwise the engine appends
``system_block(tools)`` to the system prompt, renders past calls with
``render_calls`` inside the assistant turn and results with
``render_outputs`` as a user turn.

Custom (freeform) tools under a JSON syntax are offered as a function with
one string parameter ``input`` and unwrapped back: the call's payload is the
raw string.

The fallback format
-------------------

The tool list is a text block appended to the system prompt: each tool's
name, description and JSON parameter schema (freeform tools: their Lark or
regex grammar when they have one), then the exact call syntax. A function
call is::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, several blocks (separated by a newline) for parallel
calls. A custom tool's raw input goes between the tags, unencoded, so that a
grammar can constrain the raw text::

    <tool_call name="apply_patch">
    *** Begin Patch
    ...
    </tool_call>

The newline after the opening tag and the one before the closing tag are
part of the syntax, not of the input (an input that itself ends with a
newline is followed by a blank line). An input cannot contain
``</tool_call>``. Results come back in the next user turn::

    <tool_response call_id="call_..." name="get_weather">
    {"temperature": 21}
    </tool_response>

A model that writes ``<tool_response`` or ``</tool_response`` itself (small
models parrot the last result) is inventing the next turn: the engine stops
generation there (``ToolFormat.result_markers``), so the markup never
reaches the client.

Parsing
-------

``ToolFormat.parser(tools, new_call_id)`` returns an incremental
``ToolCallParser``: ``feed(text)`` and ``finish()`` return engine events.
Text outside calls comes out as ``TextDelta`` at once, except a tail that
could still become the start of a call. ``ToolCallStarted`` comes as soon
as the name is complete and declared, then ``ToolCallDelta`` fragments of
the arguments JSON (functions, raw text as the model wrote it) or of the
decoded input (custom tools), then ``ToolCallDone`` with their
concatenation. Whitespace right after a call is never text. A name that is
not declared, or a call that does not parse, raises ``ToolCallError``; call
markup is never returned as text.
"""

from __future__ import annotations

import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lmspd.core.conversation import CustomTool, FunctionTool, Tool, ToolCall, ToolOutput
from lmspd.core.events import (
    EngineEvent,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStarted,
    ToolKind,
)

__all__ = [
    "ToolCallError",
    "ToolCallParser",
    "ToolFormat",
    "HermesFormat",
    "Llama3Format",
    "MistralFormat",
    "FallbackFormat",
    "detect_tool_format",
]

FormatName = Literal["hermes", "llama3", "mistral", "fallback"]


class ToolCallError(Exception):
    """The model's output holds a call that cannot be delivered; the engine
    fails the response with code ``invalid_tool_call``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _custom_parameters() -> dict[str, Any]:
    """The JSON Schema a custom tool is offered with under a JSON syntax."""
    return {
        "type": "object",
        "properties": {"input": {"type": "string", "description": "The raw input of this freeform tool."}},
        "required": ["input"],
        "additionalProperties": False,
    }


def _grammar_note(tool: CustomTool) -> str:
    grammar = tool.grammar or {}
    definition = grammar.get("definition")
    if not definition:
        return ""
    return f"Its input must match this {grammar.get('syntax', 'lark')} grammar:\n{definition.rstrip()}"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# --- incremental JSON pieces ------------------------------------------------

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')
_WS = " \t\r\n"


class _StringDecoder:
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


class _ValueScanner:
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
                if c in ",}]" or c in _WS:
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


class _Sink(ABC):
    """Receives a call's argument value piece by piece; returns deltas."""

    @abstractmethod
    def push(self, chunk: str) -> str: ...

    @abstractmethod
    def end(self) -> str:
        """The payload (== all deltas joined); raises if invalid."""


class _FunctionArgs(_Sink):
    """A JSON object as written, or a JSON string holding one (decoded)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._raw: list[str] = []
        self._decoder: _StringDecoder | None = None
        self._started = False

    def push(self, chunk: str) -> str:
        if not chunk:
            return ""
        if not self._started:
            self._started = True
            if chunk[0] == '"':
                self._decoder = _StringDecoder()
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


class _CustomInput(_Sink):
    """A custom tool's input under a JSON syntax: ``{"input": "..."}`` or a
    bare JSON string, decoded."""

    _HEAD = re.compile(r'\{\s*"input"\s*:\s*"')

    def __init__(self, name: str) -> None:
        self._name = name
        self._head = ""
        self._decoder: _StringDecoder | None = None
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
            self._decoder = _StringDecoder()
        out = self._decoder.push(chunk)
        self._out.append(out)
        return out

    def end(self) -> str:
        if self._decoder is None or not self._decoder.closed:
            raise self._malformed()
        if self._wrapped:
            if self._decoder.rest.strip(_WS) != "}":
                raise self._malformed()
            self._decoder.rest = ""
        self._decoder.close()
        return "".join(self._out)

    def _malformed(self) -> ToolCallError:
        return ToolCallError(f'input of {self._name!r} is not {{"input": <string>}}')


# --- the parser core ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Declared:
    name: str
    kind: ToolKind
    namespace: str | None


class ToolCallParser:
    """Incremental parser of a model's output: text and tool calls.

    After a ``ToolCallError`` the parser is spent; the response fails.
    """

    def __init__(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> None:
        self._tools: dict[str, _Declared] = {}
        for tool in tools:
            kind: ToolKind = "custom" if isinstance(tool, CustomTool) else "function"
            namespace = tool.namespace if isinstance(tool, FunctionTool) else None
            self._tools[tool.name] = _Declared(tool.name, kind, namespace)
        self._new_call_id = new_call_id
        self._buf = ""
        self._events: list[EngineEvent] = []
        self._index = 0
        self._open: _Declared | None = None
        self._finished = False

    # public

    def feed(self, text: str) -> list[EngineEvent]:
        if self._finished:
            raise RuntimeError("parser already finished")
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[EngineEvent]:
        if not self._finished:
            self._finished = True
            self._run(final=True)
            if self._open is not None:
                raise ToolCallError(f"tool call {self._open.name!r} is incomplete")
        return self._take()

    # for subclasses

    def _run(self, final: bool) -> None:
        """Consume ``self._buf`` as far as it can be decided."""
        raise NotImplementedError

    def _take(self) -> list[EngineEvent]:
        events, self._events = self._events, []
        return events

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._events and isinstance(self._events[-1], TextDelta):
            self._events[-1] = TextDelta(self._events[-1].text + text)
        else:
            self._events.append(TextDelta(text))

    def _lookup(self, name: str) -> _Declared:
        tool = self._tools.get(name)
        if tool is None:
            raise ToolCallError(f"the model called {name!r}, which is not among the request's tools")
        return tool

    def _start(self, tool: _Declared) -> None:
        self._open = tool
        self._events.append(
            ToolCallStarted(self._index, self._new_call_id(), tool.name, tool.kind, tool.namespace)
        )

    def _delta(self, text: str) -> None:
        if not text:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, ToolCallDelta) and last.index == self._index:
            self._events[-1] = ToolCallDelta(self._index, last.delta + text)
        else:
            self._events.append(ToolCallDelta(self._index, text))

    def _done(self, payload: str) -> None:
        self._events.append(ToolCallDone(self._index, payload))
        self._open = None
        self._index += 1

    def _sink_for(self, tool: _Declared) -> _Sink:
        return _CustomInput(tool.name) if tool.kind == "custom" else _FunctionArgs(tool.name)

    def _text_until(self, trigger: str, final: bool) -> bool:
        """Emit the text before ``trigger`` and drop the trigger; whether it was found.

        Without a match, the tail that could still grow into the trigger
        stays in the buffer (unless ``final``)."""
        at = self._buf.find(trigger)
        if at >= 0:
            self._text(self._buf[:at])
            self._buf = self._buf[at + len(trigger) :]
            return True
        keep = 0 if final else _partial_suffix(self._buf, trigger)
        cut = len(self._buf) - keep
        self._text(self._buf[:cut])
        self._buf = self._buf[cut:]
        return False

    def _skip_ws(self) -> bool:
        """Drop leading whitespace; whether anything else is left."""
        self._buf = self._buf.lstrip(_WS)
        return bool(self._buf)


def _partial_suffix(text: str, trigger: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``trigger``."""
    for k in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-k:]):
            return k
    return 0


class _CallObject:
    """One JSON call object, ``{"name": ..., "arguments": ...}``, consumed
    incrementally. Other keys (a Mistral ``id``, a ``type``) are skipped."""

    _ARG_KEYS = ("arguments", "parameters")

    def __init__(self, parser: ToolCallParser) -> None:
        self._p = parser
        self._state = "open"
        self._key = ""
        self._key_scanner: _ValueScanner | None = None
        self._value: _ValueScanner | None = None
        self._value_kind = ""  # name | args | skip
        self._name_raw = ""
        self._tool: _Declared | None = None
        self._sink: _Sink | None = None
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
            if c in _WS:
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
                    self._key, self._key_scanner, self._state = "", _ValueScanner(), "key"
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
        self._value = _ValueScanner()
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


# --- the syntaxes ---------------------------------------------------------

_OPEN = "<tool_call"
_CLOSE = "</tool_call>"
_RAW_OPEN = re.compile(r'\s+name\s*=\s*"([^"\n]*)"\s*>')


class _TaggedParser(ToolCallParser):
    """``<tool_call>{json}</tool_call>`` and ``<tool_call name="X">raw</tool_call>``."""

    def __init__(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> None:
        super().__init__(tools, new_call_id)
        self._state = "text"
        self._call: _CallObject | None = None
        self._raw_started = False
        self._raw_body: list[str] = []
        self._raw_sink: _Sink | None = None

    def _run(self, final: bool) -> None:
        while True:
            state = self._state
            if state == "text":
                if not self._text_until(_OPEN, final):
                    return
                self._state = "open"
            elif state == "open":
                if not self._open_tag(final):
                    return
            elif state == "json":
                assert self._call is not None
                self._buf = self._buf[self._call.consume(self._buf) :]
                if not self._call.done:
                    if final:
                        raise ToolCallError("tool call JSON is incomplete")
                    return
                self._state = "close"
            elif state == "close":
                if not self._skip_ws():
                    return
                if self._buf.startswith(_CLOSE):
                    self._buf = self._buf[len(_CLOSE) :]
                    self._state = "after"
                elif _CLOSE.startswith(self._buf) and not final:
                    return
                else:
                    raise ToolCallError(f"expected {_CLOSE} after a tool call")
            elif state == "raw":
                if not self._raw_step(final):
                    return
            elif state == "after":
                if not self._skip_ws():
                    return
                self._state = "text"

    def _open_tag(self, final: bool) -> bool:
        buf = self._buf
        if not buf:
            if final:
                raise ToolCallError("unterminated tool call")
            return False
        if buf[0] == ">":
            self._buf = buf[1:]
            self._call = _CallObject(self)
            self._state = "json"
            return True
        if buf[0] in _WS:
            m = _RAW_OPEN.match(buf)
            if m:
                tool = self._lookup(m.group(1))
                self._buf = buf[m.end() :]
                self._start(tool)
                self._raw_sink = None if tool.kind == "custom" else _FunctionArgs(tool.name)
                self._raw_started = False
                self._raw_body = []
                self._state = "raw"
                return True
            if ">" in buf or len(buf) > 256 or final:
                raise ToolCallError("malformed <tool_call ...> tag")
            return False
        # "<tool_calls" and such: not ours, plain text.
        self._text(_OPEN)
        self._state = "text"
        return True

    def _raw_step(self, final: bool) -> bool:
        if not self._raw_started:
            if not self._buf:
                if final:
                    raise ToolCallError("unterminated tool call")
                return False
            self._raw_started = True
            if self._buf[0] == "\n":
                self._buf = self._buf[1:]
        at = self._buf.find(_CLOSE)
        if at < 0:
            if final:
                raise ToolCallError("unterminated tool call: missing </tool_call>")
            # Hold back what may still become "\n</tool_call>": that newline
            # belongs to the syntax, not to the input.
            keep = max(_partial_suffix(self._buf, "\n" + _CLOSE), _partial_suffix(self._buf, _CLOSE))
            self._raw_emit(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        body = self._buf[:at]
        self._buf = self._buf[at + len(_CLOSE) :]
        self._raw_emit(body[:-1] if body.endswith("\n") else body)
        if self._raw_sink is None:
            self._done("".join(self._raw_body))
        else:
            payload = "".join(self._raw_body).strip()
            self._raw_sink.push(payload)
            self._delta(payload)
            self._done(self._raw_sink.end())
        self._state = "after"
        return True

    def _raw_emit(self, text: str) -> None:
        self._raw_body.append(text)
        if self._raw_sink is None:
            self._delta(text)


_PY_TAG = "<|python_tag|>"


class _Llama3Parser(ToolCallParser):
    """JSON calls at the start of the reply or after ``<|python_tag|>``."""

    def __init__(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> None:
        super().__init__(tools, new_call_id)
        self._state = "start"
        self._call: _CallObject | None = None

    def _run(self, final: bool) -> None:
        while True:
            state = self._state
            if state == "start":
                verdict = _starts_with_call(self._buf)
                if verdict is None and not final:
                    return
                if verdict:
                    self._buf = self._buf.lstrip(_WS)
                    self._new_call()
                else:
                    self._state = "text"
            elif state == "text":
                if not self._text_until(_PY_TAG, final):
                    return
                self._state = "tag"
            elif state == "tag":
                if not self._skip_ws():
                    if final:
                        raise ToolCallError(f"{_PY_TAG} without a tool call")
                    return
                if self._buf[0] != "{":
                    raise ToolCallError(f"{_PY_TAG} is not followed by a JSON tool call")
                self._new_call()
            elif state == "json":
                assert self._call is not None
                self._buf = self._buf[self._call.consume(self._buf) :]
                if not self._call.done:
                    if final:
                        raise ToolCallError("tool call JSON is incomplete")
                    return
                self._state = "after"
            elif state == "after":
                self._buf = self._buf.lstrip(_WS + ";")
                if not self._buf:
                    return
                if self._buf[0] == "{":
                    self._new_call()
                else:
                    self._state = "text"

    def _new_call(self) -> None:
        self._call = _CallObject(self)
        self._state = "json"


def _starts_with_call(text: str) -> bool | None:
    """Whether ``text`` opens with ``{"name"`` (whitespace allowed); None
    while it cannot tell yet."""
    rest = text.lstrip(_WS)
    if not rest:
        return None
    if rest[0] != "{":
        return False
    rest = rest[1:].lstrip(_WS)
    if rest.startswith('"name"'):
        return True
    if '"name"'.startswith(rest):
        return None
    return False


_TOOL_CALLS = "[TOOL_CALLS]"
_ARGS = "[ARGS]"


class _MistralParser(ToolCallParser):
    """``[TOOL_CALLS][{...}, ...]``, and ``[TOOL_CALLS]name[ARGS]{...}`` (v11)."""

    def __init__(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> None:
        super().__init__(tools, new_call_id)
        self._state = "text"
        self._call: _CallObject | None = None
        self._in_array = False
        self._value: _ValueScanner | None = None
        self._sink: _Sink | None = None

    def _run(self, final: bool) -> None:
        while True:
            state = self._state
            if state == "text":
                if not self._text_until(_TOOL_CALLS, final):
                    return
                self._state = "calls"
            elif state == "calls":
                if not self._skip_ws():
                    if final:
                        raise ToolCallError(f"{_TOOL_CALLS} without a tool call")
                    return
                c = self._buf[0]
                if c == "[":
                    self._buf = self._buf[1:]
                    self._in_array = True
                    self._state = "item"
                elif c == "{":
                    self._in_array = False
                    self._new_call()
                else:
                    self._state = "v11_name"
            elif state == "item":
                if not self._skip_ws():
                    if final:
                        raise ToolCallError("unterminated tool call list")
                    return
                if self._buf[0] != "{":
                    raise ToolCallError("malformed tool call list")
                self._new_call()
            elif state == "json":
                assert self._call is not None
                self._buf = self._buf[self._call.consume(self._buf) :]
                if not self._call.done:
                    if final:
                        raise ToolCallError("tool call JSON is incomplete")
                    return
                self._state = "next"
            elif state == "next":
                if not self._skip_ws():
                    return  # a list cut short after a complete call is accepted
                c = self._buf[0]
                if c == ",":
                    self._buf = self._buf[1:]
                    self._state = "item" if self._in_array else "bare_next"
                elif c == "]" and self._in_array:
                    self._buf = self._buf[1:]
                    self._state = "after"
                elif self._in_array:
                    raise ToolCallError("malformed tool call list")
                else:
                    self._state = "text"
            elif state == "bare_next":
                if not self._skip_ws():
                    if final:
                        raise ToolCallError("malformed tool call list")
                    return
                if self._buf[0] != "{":
                    raise ToolCallError("malformed tool call list")
                self._new_call()
            elif state == "v11_name":
                at = self._buf.find(_ARGS)
                if at < 0:
                    if final or len(self._buf) > 512:
                        raise ToolCallError(f"{_TOOL_CALLS} without {_ARGS}")
                    return
                tool = self._lookup(self._buf[:at].strip())
                self._buf = self._buf[at + len(_ARGS) :]
                self._start(tool)
                self._sink = self._sink_for(tool)
                self._value = None
                self._state = "v11_args"
            elif state == "v11_args":
                if self._value is None:
                    if not self._skip_ws():
                        if final:
                            raise ToolCallError("tool call without arguments")
                        return
                    self._value = _ValueScanner()
                assert self._sink is not None
                j, ended = self._value.scan(self._buf, 0)
                self._delta(self._sink.push(self._buf[:j]))
                self._buf = self._buf[j:]
                if not ended:
                    if final:
                        raise ToolCallError("tool call arguments are incomplete")
                    return
                self._done(self._sink.end())
                self._state = "after"
            elif state == "after":
                if not self._skip_ws():
                    return
                self._state = "text"

    def _new_call(self) -> None:
        self._call = _CallObject(self)
        self._state = "json"


# --- formats --------------------------------------------------------------


class ToolFormat(ABC):
    """One tool-call syntax: prompt rendering, parsing and grammar pieces."""

    name: FormatName
    #: The text that starts a call in the model's output.
    trigger: str
    #: Whether custom tools are called with their raw input (else wrapped
    #: as a function with one string parameter ``input``).
    raw_custom: bool = False
    #: Text that opens a tool *result*. The model writing one is inventing
    #: the next turn: generation stops there, and it is never shown as text.
    result_markers: tuple[str, ...] = ()

    def __init__(self, native: bool) -> None:
        self.native = native

    def __repr__(self) -> str:
        return f"{type(self).__name__}(native={self.native})"

    # prompt

    @abstractmethod
    def system_block(self, tools: Sequence[Tool]) -> str:
        """Tool list and call syntax, to append to the system prompt."""

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        """Assistant text for past calls, as the model would have written them."""
        return "\n".join(self._render_call(c) for c in calls)

    @abstractmethod
    def _render_call(self, call: ToolCall) -> str: ...

    @abstractmethod
    def render_outputs(self, outputs: Sequence[ToolOutput], names_by_call_id: Mapping[str, str]) -> str:
        """Text of the user turn that carries tool results."""

    # native templates (Hugging Face convention)

    def template_tools(self, tools: Sequence[Tool]) -> list[dict[str, Any]]:
        out = []
        for tool in tools:
            if isinstance(tool, CustomTool):
                description = "\n\n".join(p for p in (tool.description, _grammar_note(tool)) if p)
                parameters = _custom_parameters()
            else:
                description = tool.description or ""
                parameters = tool.parameters or {"type": "object", "properties": {}}
            out.append(
                {
                    "type": "function",
                    "function": {"name": tool.name, "description": description, "parameters": parameters},
                }
            )
        return out

    def template_tool_calls(self, calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            if call.kind == "custom":
                arguments: Any = {"input": call.payload}
            else:
                try:
                    arguments = json.loads(call.payload or "{}")
                except ValueError:
                    arguments = call.payload
            out.append(
                {
                    "id": self.template_call_id(call.call_id),
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments},
                }
            )
        return out

    def template_tool_message(self, output: ToolOutput, name: str | None) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "tool",
            "tool_call_id": self.template_call_id(output.call_id),
            "content": output.output,
        }
        if name is not None:
            message["name"] = name
        return message

    def template_call_id(self, call_id: str) -> str:
        """The id a template sees for ``call_id`` (Mistral wants 9 characters)."""
        return call_id

    # parsing

    @abstractmethod
    def parser(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> ToolCallParser: ...

    # grammar pieces (see lmspd.engines.llama.grammars)

    @abstractmethod
    def call_parts(self, name: str, raw: bool) -> tuple[str, str]:
        """Literal text before and after a call's arguments (``raw``: before
        and after a custom tool's raw input)."""

    @abstractmethod
    def gbnf_calls(self, call_rule: str, max_calls: int | None) -> str:
        """GBNF for 1..``max_calls`` calls of ``call_rule`` (None: no bound)."""

    @abstractmethod
    def lazy_patterns(self, heads: Sequence[str]) -> list[str]:
        """Trigger regexes for a lazy grammar whose calls begin with ``heads``."""

    def grammar(
        self, tools: Sequence[Tool], *, allowed_names: Sequence[str] | None = None, parallel: bool = False
    ) -> str:
        """Shorthand for ``grammars.tool_call_grammar(self, ...)``."""
        from lmspd.engines.llama.grammars import tool_call_grammar

        return tool_call_grammar(self, tools, allowed_names=allowed_names, parallel=parallel)

    def lazy_grammar(
        self, tools: Sequence[Tool], *, allowed_names: Sequence[str] | None = None, parallel: bool = True
    ) -> tuple[str, list[str]]:
        """Shorthand for ``grammars.lazy_tool_call_grammar(self, ...)``."""
        from lmspd.engines.llama.grammars import lazy_tool_call_grammar

        return lazy_tool_call_grammar(self, tools, allowed_names=allowed_names, parallel=parallel)


def _repeat_calls(call: str, sep: str, max_calls: int | None) -> str:
    """``call``, then up to ``max_calls - 1`` more, each after ``sep`` (GBNF)."""
    if max_calls == 1:
        return call
    more = f"({sep} {call})" if sep else f"({call})"
    return f"{call} {more}*" if max_calls is None else f"{call} {more}{{0,{max_calls - 1}}}"


_REGEX_SPECIAL = set("\\^$.*+?()[]{}|")


def _regex_escape(text: str) -> str:
    """Escape for std::regex (ECMAScript); it matches bytes, so non-ASCII stays raw."""
    out = []
    for ch in text:
        if ch in _REGEX_SPECIAL:
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _prefix_regex(texts: Iterable[str]) -> str:
    """A regex matching every prefix (including the empty one) of ``texts``."""
    trie: dict = {}
    for text in texts:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})

    def emit(node: dict) -> str:
        if not node:
            return ""
        alts = [_regex_escape(ch) + emit(child) for ch, child in sorted(node.items())]
        return "(?:" + "|".join(alts) + ")?"

    return emit(trie)


def _trigger_pattern(trigger: str, heads: Iterable[str], *, at_start: bool = False) -> str:
    """A full-match regex for llama.cpp's lazy grammars.

    llama.cpp matches the pattern against everything generated so far and,
    on a match, feeds the grammar from the first capture group to the end.
    Matching only when the text ends inside the literal head of a call keeps
    that feed a valid grammar prefix (anything else would abort the
    process), so a token that carries the trigger and then something
    unexpected leaves the call unconstrained instead.
    """
    tails = [h[len(trigger) :] for h in heads if h.startswith(trigger)]
    lead = r"^\s*" if at_start else r"^[\s\S]*?"
    return f"{lead}({_regex_escape(trigger)}{_prefix_regex(tails)})$"


class _TaggedFormat(ToolFormat):
    result_markers = ("<tool_response", "</tool_response")

    def _render_call(self, call: ToolCall) -> str:
        if call.kind == "custom":
            if self.raw_custom:
                return f'<tool_call name="{call.name}">\n{call.payload}\n</tool_call>'
            args = _dumps({"input": call.payload})
        else:
            args = call.payload or "{}"
        return f'<tool_call>\n{{"name": {_dumps(call.name)}, "arguments": {args}}}\n</tool_call>'

    def parser(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> ToolCallParser:
        return _TaggedParser(tools, new_call_id)

    def call_parts(self, name: str, raw: bool) -> tuple[str, str]:
        if raw:
            return f'<tool_call name="{name}">\n', "\n</tool_call>"
        return f'<tool_call>\n{{"name": {_dumps(name)}, "arguments": ', "}\n</tool_call>"

    def gbnf_calls(self, call_rule: str, max_calls: int | None) -> str:
        return _repeat_calls(call_rule, '"\\n"', max_calls)

    def lazy_patterns(self, heads: Sequence[str]) -> list[str]:
        return [_trigger_pattern(self.trigger, heads)]


class HermesFormat(_TaggedFormat):
    name: FormatName = "hermes"
    trigger = "<tool_call>"

    def system_block(self, tools: Sequence[Tool]) -> str:
        listed = "\n".join(_dumps(t) for t in self.template_tools(tools))
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def render_outputs(self, outputs: Sequence[ToolOutput], names_by_call_id: Mapping[str, str]) -> str:
        return "\n".join(f"<tool_response>\n{o.output}\n</tool_response>" for o in outputs)


class FallbackFormat(_TaggedFormat):
    name: FormatName = "fallback"
    # "<tool_call" covers both "<tool_call>" and '<tool_call name="...">'.
    trigger = "<tool_call"
    raw_custom = True

    def __init__(self, native: bool = False) -> None:
        super().__init__(native=False)

    def system_block(self, tools: Sequence[Tool]) -> str:
        parts = ["# Tools\n\nYou may call one or more tools. Available tools:"]
        has_custom = False
        for tool in tools:
            lines = [f"## {tool.name}"]
            if isinstance(tool, CustomTool):
                has_custom = True
                lines.append("Freeform tool: its input is raw text, not JSON.")
                if tool.description:
                    lines.append(tool.description)
                if note := _grammar_note(tool):
                    lines.append(note)
            else:
                if tool.description:
                    lines.append(tool.description)
                schema = tool.parameters or {"type": "object", "properties": {}}
                lines.append(f"Arguments (JSON Schema): {_dumps(schema)}")
            parts.append("\n".join(lines))
        syntax = (
            "To call a tool, write one block per call (several blocks for several calls):\n"
            '<tool_call>\n{"name": "<tool name>", "arguments": <JSON object>}\n</tool_call>'
        )
        if has_custom:
            syntax += (
                "\nTo call a freeform tool, put its raw input between the tags instead:\n"
                '<tool_call name="<tool name>">\n<raw input>\n</tool_call>'
            )
        syntax += '\nResults come back as <tool_response call_id="..." name="..."> blocks.'
        parts.append(syntax)
        return "\n\n".join(parts)

    def render_outputs(self, outputs: Sequence[ToolOutput], names_by_call_id: Mapping[str, str]) -> str:
        blocks = []
        for o in outputs:
            name = names_by_call_id.get(o.call_id, "")
            blocks.append(
                f'<tool_response call_id="{_attr(o.call_id)}" name="{_attr(name)}">\n{o.output}\n</tool_response>'
            )
        return "\n".join(blocks)


def _attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


class Llama3Format(ToolFormat):
    name: FormatName = "llama3"
    trigger = _PY_TAG

    def system_block(self, tools: Sequence[Tool]) -> str:
        listed = "\n\n".join(_dumps(t) for t in self.template_tools(tools))
        return (
            "Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.\n\n" + listed
        )

    def _render_call(self, call: ToolCall) -> str:
        args = _dumps({"input": call.payload}) if call.kind == "custom" else call.payload or "{}"
        return f'{{"name": {_dumps(call.name)}, "parameters": {args}}}'

    def render_outputs(self, outputs: Sequence[ToolOutput], names_by_call_id: Mapping[str, str]) -> str:
        return "\n\n".join(o.output for o in outputs)

    def parser(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> ToolCallParser:
        return _Llama3Parser(tools, new_call_id)

    def call_parts(self, name: str, raw: bool) -> tuple[str, str]:
        return f'{{"name": {_dumps(name)}, "parameters": ', "}"

    def gbnf_calls(self, call_rule: str, max_calls: int | None) -> str:
        calls = _repeat_calls(call_rule, '"\\n"', max_calls)
        return f'"<|python_tag|>"? {calls}'

    def lazy_patterns(self, heads: Sequence[str]) -> list[str]:
        start = '{"name"'
        return [
            _trigger_pattern(start, heads, at_start=True),
            _trigger_pattern(_PY_TAG, [_PY_TAG + h for h in heads]),
        ]


class MistralFormat(ToolFormat):
    name: FormatName = "mistral"
    trigger = _TOOL_CALLS
    result_markers = ("[TOOL_RESULTS]",)

    def __init__(self, native: bool, v11: bool = False) -> None:
        super().__init__(native)
        #: ``[TOOL_CALLS]name[ARGS]{...}`` instead of a JSON list.
        self.v11 = v11

    def __repr__(self) -> str:
        return f"MistralFormat(native={self.native}, v11={self.v11})"

    def system_block(self, tools: Sequence[Tool]) -> str:
        listed = _dumps(self.template_tools(tools))
        syntax = (
            "[TOOL_CALLS]<tool name>[ARGS]<JSON arguments>"
            if self.v11
            else '[TOOL_CALLS][{"name": "<tool name>", "arguments": <JSON arguments>}]'
        )
        return f"[AVAILABLE_TOOLS]{listed}[/AVAILABLE_TOOLS]\nTo call tools, reply with {syntax}"

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        if self.v11:
            return "".join(self._render_call(c) for c in calls)
        return _TOOL_CALLS + "[" + ", ".join(self._render_call(c) for c in calls) + "]"

    def _render_call(self, call: ToolCall) -> str:
        args = _dumps({"input": call.payload}) if call.kind == "custom" else call.payload or "{}"
        if self.v11:
            return f"{_TOOL_CALLS}{call.name}{_ARGS}{args}"
        # No "id": the grammar does not let the model write one either, and
        # the parser mints call ids of its own.
        return f'{{"name": {_dumps(call.name)}, "arguments": {args}}}'

    def render_outputs(self, outputs: Sequence[ToolOutput], names_by_call_id: Mapping[str, str]) -> str:
        return "".join(
            f"[TOOL_RESULTS]{_dumps({'content': o.output, 'call_id': self.template_call_id(o.call_id)})}[/TOOL_RESULTS]"
            for o in outputs
        )

    def template_call_id(self, call_id: str) -> str:
        # Mistral templates reject ids that are not 9 alphanumerics.
        digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
        alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        out = []
        for _ in range(9):
            digest, r = divmod(digest, 62)
            out.append(alphabet[r])
        return "".join(out)

    def parser(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> ToolCallParser:
        return _MistralParser(tools, new_call_id)

    def call_parts(self, name: str, raw: bool) -> tuple[str, str]:
        if self.v11:
            return f"{_TOOL_CALLS}{name}{_ARGS}", ""
        return f'{{"name": {_dumps(name)}, "arguments": ', "}"

    def gbnf_calls(self, call_rule: str, max_calls: int | None) -> str:
        if self.v11:
            return _repeat_calls(call_rule, "", max_calls)
        calls = _repeat_calls(call_rule, '", "', max_calls)
        return f'"[TOOL_CALLS][" {calls} "]"'

    def lazy_patterns(self, heads: Sequence[str]) -> list[str]:
        if self.v11:
            return [_trigger_pattern(_TOOL_CALLS, heads)]
        return [_trigger_pattern(_TOOL_CALLS, [_TOOL_CALLS + "[" + h for h in heads])]


_RENDERS_TOOLS = re.compile(r"\btools\b")


def detect_tool_format(chat_template: str | None) -> ToolFormat:
    """The tool-call syntax a chat template speaks (``FallbackFormat`` if none)."""
    t = chat_template or ""
    native = bool(_RENDERS_TOOLS.search(t))
    if "<tool_call>" in t:
        return HermesFormat(native)
    if _TOOL_CALLS in t:
        return MistralFormat(native, v11=_ARGS in t)
    if "<|start_header_id|>" in t and (_PY_TAG in t or '"parameters"' in t):
        return Llama3Format(native)
    return FallbackFormat()
