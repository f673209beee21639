"""Mistral tool calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``;
the v11 templates (``[ARGS]``) use ``[TOOL_CALLS]name[ARGS]{...}`` per call."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence

from lmspd.core.conversation import Tool, ToolCall, ToolOutput

from .base import CallLayout, FormatName, ToolCallParser, ToolFormat, dumps
from .json_scan import CallObject, Sink, ToolCallError, ValueScanner

_TOOL_CALLS = "[TOOL_CALLS]"
_ARGS = "[ARGS]"


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS][{...}, ...]``, and ``[TOOL_CALLS]name[ARGS]{...}`` (v11)."""

    def __init__(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> None:
        super().__init__(tools, new_call_id)
        self._state = "text"
        self._call: CallObject | None = None
        self._in_array = False
        self._value: ValueScanner | None = None
        self._sink: Sink | None = None

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
                    self._value = ValueScanner()
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
        self._call = CallObject(self)
        self._state = "json"


class MistralFormat(ToolFormat):
    name: FormatName = "mistral"
    trigger = _TOOL_CALLS
    triggers = (_TOOL_CALLS,)
    result_markers = ("[TOOL_RESULTS]",)

    def __init__(self, native: bool, v11: bool = False) -> None:
        super().__init__(native)
        #: ``[TOOL_CALLS]name[ARGS]{...}`` instead of a JSON list.
        self.v11 = v11

    def __repr__(self) -> str:
        return f"MistralFormat(native={self.native}, v11={self.v11})"

    @property
    def layout(self) -> CallLayout:  # type: ignore[override]
        if self.v11:
            return CallLayout(separator="")
        return CallLayout(separator=", ", prefix=_TOOL_CALLS + "[", suffix="]")

    def system_block(self, tools: Sequence[Tool]) -> str:
        listed = dumps(self.template_tools(tools))
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
        args = dumps({"input": call.payload}) if call.kind == "custom" else call.payload or "{}"
        if self.v11:
            return f"{_TOOL_CALLS}{call.name}{_ARGS}{args}"
        # No "id": the grammar does not let the model write one either, and
        # the parser mints call ids of its own.
        return f'{{"name": {dumps(call.name)}, "arguments": {args}}}'

    def render_outputs(self, outputs: Sequence[ToolOutput], names_by_call_id: Mapping[str, str]) -> str:
        return "".join(
            f"[TOOL_RESULTS]{dumps({'content': o.output, 'call_id': self.template_call_id(o.call_id)})}[/TOOL_RESULTS]"
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
        return MistralParser(tools, new_call_id)

    def call_parts(self, name: str, raw: bool) -> tuple[str, str]:
        if self.v11:
            return f"{_TOOL_CALLS}{name}{_ARGS}", ""
        return f'{{"name": {dumps(name)}, "arguments": ', "}"
