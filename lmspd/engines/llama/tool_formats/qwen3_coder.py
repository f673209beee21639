"""Qwen3-Coder's XML-style tool calls::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text (one newline after the opening tag and one
before the closing tag are syntax). It is typed by the JSON types the
tool's schema admits for the parameter (``type``, a list of them, the
members of ``anyOf``/``oneOf``, an ``enum``'s or ``const``'s values):
where a string is admitted, the text is that string, unless it spells a
value of another admitted type (``null`` of an optional string, ``3`` where
a string or an integer is); where no string is, the JSON value it spells;
where the schema says nothing, the JSON value it spells if any, else the
string. So ``1234`` for an ``Optional[str]`` is ``"1234"``, and ``01`` of
an enum of strings is ``"01"``. Local ``$ref``s (``#/$defs/...``,
``#/definitions/...``: pydantic's enums and models) are followed. A value
JSON spells only loosely (``NaN``, ``Infinity``) is text. A parameter given
twice keeps its first value: the first has streamed already, and arguments
with a key twice are refused by strict JSON decoders (serde's). The call's
arguments stream one parameter at a time. A custom tool is
offered as a function with one string parameter ``input``, whose raw value
is the input.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from lmspd.core.conversation import FunctionTool, Tool, ToolCall, ToolOutput

from .base import FormatName, ParamBlocks, ToolCallParser, ToolFormat, dumps
from .json_scan import ToolCallError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_CLOSE, PARAM_CLOSE = "</function>", "</parameter>"
BLOCKS = ParamBlocks("<parameter=", ">\n", f"\n{PARAM_CLOSE}\n")
_FUNCTION = re.compile(r"<function=([^>\n]{1,256})>")
_PARAM = re.compile(r"<parameter=([^>\n]{1,256})>")
_MAX_TAG = 300


def _admitted(schema: Any, root: Any, depth: int = 0) -> set[str]:
    """The JSON types ``schema`` admits, as far as it says (empty: it does
    not); ``root``: the tool's parameters, where its ``$ref``s point."""
    if not isinstance(schema, dict) or depth > 8:
        return set()
    out: set[str] = set()
    ref = schema.get("$ref")
    if isinstance(ref, str):
        out |= _admitted(_resolve(ref, root), root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, str):
        out.add(kind)
    elif isinstance(kind, list):
        out.update(k for k in kind if isinstance(k, str))
    for key in ("anyOf", "oneOf", "allOf"):
        members = schema.get(key)
        for member in members if isinstance(members, list) else ():
            out |= _admitted(member, root, depth + 1)
    values = schema.get("enum")
    values = list(values) if isinstance(values, list) else []
    if "const" in schema:
        values.append(schema["const"])
    out.update(_type_of(v) for v in values)
    return out


def _resolve(ref: str, root: Any) -> Any:
    """A local ``$ref``'s target in ``root`` (None where it is not one)."""
    for prefix in ("#/$defs/", "#/definitions/"):
        if ref.startswith(prefix) and isinstance(root, dict):
            defs = root.get(prefix[2:-1])
            return defs.get(ref[len(prefix):]) if isinstance(defs, dict) else None
    return None


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _fits(value: Any, types: set[str]) -> bool:
    kind = _type_of(value)
    return kind in types or (kind == "integer" and "number" in types)


_PYTHON = {"True": ("boolean", True), "False": ("boolean", False), "None": ("null", None)}


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _value(raw: str, schema: Any, root: Any = None) -> Any:
    types = _admitted(schema, root)
    try:
        value = json.loads(raw, parse_constant=_not_json)
    except ValueError:
        python = _PYTHON.get(raw.strip())
        if python is not None and python[0] in types and "string" not in types:
            return python[1]  # Python's spelling, as the model's training code writes it
        return raw
    if not types or "string" not in types:
        return value
    # A string is admitted: the text is one, unless it spells another admitted type's value.
    return value if not isinstance(value, str) and _fits(value, types) else raw


class Qwen3CoderParser(ToolCallParser):
    def __init__(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> None:
        tools = list(tools)
        super().__init__(tools, new_call_id)
        self._schemas: dict[str, dict[str, Any]] = {}
        self._roots: dict[str, Any] = {}
        for tool in tools:
            if isinstance(tool, FunctionTool):
                self._schemas[tool.name] = dict(((tool.parameters or {}).get("properties") or {}))
                self._roots[tool.name] = tool.parameters
        self._state = "text"
        self._param: str | None = None
        self._count = 0
        self._payload: list[str] = []
        self._given: set[str] = set()  # the open call's parameters so far

    def _run(self, final: bool) -> None:
        while True:
            state = self._state
            if state == "text":
                if not self._text_until(OPEN, final):
                    return
                self._state = "function"
            elif state == "function":
                if not self._skip_ws():
                    if final:
                        raise ToolCallError("unterminated tool call")
                    return
                m = _FUNCTION.match(self._buf)
                if m is None:
                    if len(self._buf) > _MAX_TAG or ">" in self._buf or final:
                        raise ToolCallError("expected <function=...> in a tool call")
                    return
                tool = self._lookup(m.group(1).strip())
                self._buf = self._buf[m.end():]
                self._start(tool)
                self._count, self._payload = 0, []
                self._given.clear()
                self._state = "params"
            elif state == "params":
                if not self._skip_ws():
                    if final:
                        raise ToolCallError("unterminated tool call")
                    return
                if self._buf.startswith(FUNCTION_CLOSE):
                    self._buf = self._buf[len(FUNCTION_CLOSE):]
                    self._end_call()
                    self._state = "close"
                    continue
                m = _PARAM.match(self._buf)
                if m is None:
                    if (FUNCTION_CLOSE.startswith(self._buf) or "<parameter=".startswith(self._buf[:11])) \
                            and len(self._buf) < _MAX_TAG and not final and ">" not in self._buf:
                        return
                    raise ToolCallError("expected <parameter=...> or </function> in a tool call")
                self._param = m.group(1).strip()
                self._buf = self._buf[m.end():]
                self._state = "value"
            elif state == "value":
                at = self._buf.find(PARAM_CLOSE)
                if at < 0:
                    if final:
                        raise ToolCallError("unterminated <parameter=...>")
                    return
                raw = self._buf[:at]
                self._buf = self._buf[at + len(PARAM_CLOSE):]
                raw = raw[1:] if raw.startswith("\n") else raw
                raw = raw[:-1] if raw.endswith("\n") else raw
                self._param_done(raw)
                self._state = "params"
            elif state == "close":
                if not self._skip_ws():
                    if final:
                        return  # a call cut short after </function> is complete
                    return
                if self._buf.startswith(CLOSE):
                    self._buf = self._buf[len(CLOSE):]
                    self._state = "after"
                elif CLOSE.startswith(self._buf) and not final:
                    return
                else:
                    raise ToolCallError(f"expected {CLOSE} after a tool call")
            elif state == "after":
                if not self._skip_ws():
                    return
                self._state = "text"

    def _param_done(self, raw: str) -> None:
        assert self._open is not None and self._param is not None
        if self._open.kind == "custom":
            if self._param != "input":
                raise ToolCallError(f"custom tool {self._open.name!r} takes only <parameter=input>")
            self._payload.append(raw)
            self._delta(raw)
            return
        if self._param in self._given:
            return  # the first value stands (module docstring)
        self._given.add(self._param)
        name = self._open.name
        value = _value(raw, self._schemas.get(name, {}).get(self._param), self._roots.get(name))
        piece = ("{" if self._count == 0 else ", ") + f"{dumps(self._param)}: {dumps(value)}"
        self._count += 1
        self._payload.append(piece)
        self._delta(piece)

    def _end_call(self) -> None:
        assert self._open is not None
        if self._open.kind == "function":
            tail = "{}" if self._count == 0 else "}"
            self._payload.append(tail)
            self._delta(tail)
        self._done("".join(self._payload))


class Qwen3CoderFormat(ToolFormat):
    name: FormatName = "qwen3_coder"
    trigger = OPEN
    triggers = (OPEN,)
    param_blocks = BLOCKS
    result_markers = ("<tool_response", "</tool_response")

    def system_block(self, tools: Sequence[Tool]) -> str:
        listed = "\n".join(dumps(t) for t in self.template_tools(tools))
        return (
            "# Tools\n\nYou have access to the following functions:\n\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
            "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
            "</parameter>\n</function>\n</tool_call>"
        )

    def _render_call(self, call: ToolCall) -> str:
        if call.kind == "custom":
            params: dict[str, Any] = {"input": call.payload}
        else:
            try:
                params = json.loads(call.payload or "{}")
            except ValueError:
                params = {}
        body = "".join(
            BLOCKS.parts(k)[0] + (v if isinstance(v, str) else dumps(v)) + BLOCKS.close
            for k, v in (params.items() if isinstance(params, dict) else ())
        )
        before, after = self.call_parts(call.name, raw=False)
        return before + body + after

    def render_outputs(self, outputs: Sequence[ToolOutput], names_by_call_id: Mapping[str, str]) -> str:
        return "\n".join(f"<tool_response>\n{o.output}\n</tool_response>" for o in outputs)

    def parser(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> ToolCallParser:
        return Qwen3CoderParser(tools, new_call_id)

    def call_parts(self, name: str, raw: bool) -> tuple[str, str]:
        return f"{OPEN}\n<function={name}>\n", f"{FUNCTION_CLOSE}\n{CLOSE}"


__all__ = ["Qwen3CoderFormat", "Qwen3CoderParser"]
