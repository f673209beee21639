"""Hermes / Qwen 2.5 / Qwen 3 tool calls::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, results in ``<tool_response>`` blocks. lmspd's own
fallback syntax (``fallback.py``) is the same, plus raw custom-tool input
between ``<tool_call name="...">`` and ``</tool_call>``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from lmspd.core.conversation import Tool, ToolCall, ToolOutput

from .base import FormatName, ToolCallParser, ToolFormat, dumps, partial_suffix
from .json_scan import WS, CallObject, FunctionArgs, Sink, ToolCallError

_OPEN = "<tool_call"
_CLOSE = "</tool_call>"
_RAW_OPEN = re.compile(r'\s+name\s*=\s*"([^"\n]*)"\s*>')


class TaggedParser(ToolCallParser):
    """``<tool_call>{json}</tool_call>`` and ``<tool_call name="X">raw</tool_call>``."""

    def __init__(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> None:
        super().__init__(tools, new_call_id)
        self._state = "text"
        self._call: CallObject | None = None
        self._raw_started = False
        self._raw_body: list[str] = []
        self._raw_sink: Sink | None = None
        # A function's raw-form arguments: trailing whitespace held back
        # (it may end the body), and whether any non-space was pushed yet.
        self._raw_ws = ""
        self._raw_fed = False

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
            self._call = CallObject(self)
            self._state = "json"
            return True
        if buf[0] in WS:
            m = _RAW_OPEN.match(buf)
            if m:
                tool = self._lookup(m.group(1))
                self._buf = buf[m.end() :]
                self._start(tool)
                self._raw_sink = None if tool.kind == "custom" else FunctionArgs(tool.name)
                self._raw_started = False
                self._raw_body = []
                self._raw_ws, self._raw_fed = "", False
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
            keep = max(partial_suffix(self._buf, "\n" + _CLOSE), partial_suffix(self._buf, _CLOSE))
            self._raw_emit(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        body = self._buf[:at]
        self._buf = self._buf[at + len(_CLOSE) :]
        self._raw_emit(body[:-1] if body.endswith("\n") else body)
        if self._raw_sink is None:
            self._done("".join(self._raw_body))
        else:
            self._done(self._raw_sink.end())
        self._state = "after"
        return True

    def _raw_emit(self, text: str) -> None:
        if self._raw_sink is None:  # a custom tool: the raw text is the input
            self._raw_body.append(text)
            self._delta(text)
            return
        # A function's arguments (a JSON object, or a JSON string holding
        # one), stripped of the whitespace around them. They stream through
        # the sink, and its output is the delta: for a JSON string that is
        # the decoded text, as the payload ``end()`` gives.
        text = self._raw_ws + text
        body = text.rstrip()
        self._raw_ws = text[len(body) :]
        if not self._raw_fed:
            body = body.lstrip()
        if body:
            self._raw_fed = True
            self._delta(self._raw_sink.push(body))


class TaggedFormat(ToolFormat):
    """``<tool_call>`` blocks, one per call, separated by a newline."""

    result_markers = ("<tool_response", "</tool_response")

    def _render_call(self, call: ToolCall) -> str:
        if call.kind == "custom":
            if self.raw_custom:
                return f'<tool_call name="{call.name}">\n{call.payload}\n</tool_call>'
            args = dumps({"input": call.payload})
        else:
            args = call.payload or "{}"
        return f'<tool_call>\n{{"name": {dumps(call.name)}, "arguments": {args}}}\n</tool_call>'

    def parser(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> ToolCallParser:
        return TaggedParser(tools, new_call_id)

    def call_parts(self, name: str, raw: bool) -> tuple[str, str]:
        if raw:
            return f'<tool_call name="{name}">\n', "\n</tool_call>"
        return f'<tool_call>\n{{"name": {dumps(name)}, "arguments": ', "}\n</tool_call>"



class HermesFormat(TaggedFormat):
    name: FormatName = "hermes"
    trigger = "<tool_call>"
    triggers = ("<tool_call>",)

    def system_block(self, tools: Sequence[Tool]) -> str:
        listed = "\n".join(dumps(t) for t in self.template_tools(tools))
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


