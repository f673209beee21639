"""Llama 3.1+ tool calls: ``{"name": "get_weather", "parameters": {...}}`` at
the start of the reply, or anywhere after ``<|python_tag|>``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from lmspd.core.conversation import Tool, ToolCall, ToolOutput

from .base import CallLayout, FormatName, ToolCallParser, ToolFormat, dumps
from .json_scan import WS, CallObject, ToolCallError

_PY_TAG = "<|python_tag|>"


class Llama3Parser(ToolCallParser):
    """JSON calls at the start of the reply or after ``<|python_tag|>``."""

    def __init__(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> None:
        super().__init__(tools, new_call_id)
        self._state = "start"
        self._call: CallObject | None = None

    def _run(self, final: bool) -> None:
        while True:
            state = self._state
            if state == "start":
                verdict = _starts_with_call(self._buf)
                if verdict is None and not final:
                    return
                if verdict:
                    self._buf = self._buf.lstrip(WS)
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
                self._buf = self._buf.lstrip(WS + ";")
                if not self._buf:
                    return
                if self._buf[0] == "{":
                    self._new_call()
                else:
                    self._state = "text"

    def _new_call(self) -> None:
        self._call = CallObject(self)
        self._state = "json"


def _starts_with_call(text: str) -> bool | None:
    """Whether ``text`` opens with ``{"name"`` (whitespace allowed); None
    while it cannot tell yet."""
    rest = text.lstrip(WS)
    if not rest:
        return None
    if rest[0] != "{":
        return False
    rest = rest[1:].lstrip(WS)
    if rest.startswith('"name"'):
        return True
    if '"name"'.startswith(rest):
        return None
    return False


class Llama3Format(ToolFormat):
    name: FormatName = "llama3"
    trigger = _PY_TAG
    triggers = (_PY_TAG,)
    start_triggers = ('{"name"',)
    layout = CallLayout(separator="\n", prefix=_PY_TAG, prefix_optional=True)

    def system_block(self, tools: Sequence[Tool]) -> str:
        listed = "\n\n".join(dumps(t) for t in self.template_tools(tools))
        return (
            "Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.\n\n" + listed
        )

    def _render_call(self, call: ToolCall) -> str:
        args = dumps({"input": call.payload}) if call.kind == "custom" else call.payload or "{}"
        return f'{{"name": {dumps(call.name)}, "parameters": {args}}}'

    def render_outputs(self, outputs: Sequence[ToolOutput], names_by_call_id: Mapping[str, str]) -> str:
        return "\n\n".join(o.output for o in outputs)

    def parser(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> ToolCallParser:
        return Llama3Parser(tools, new_call_id)

    def call_parts(self, name: str, raw: bool) -> tuple[str, str]:
        return f'{{"name": {dumps(name)}, "parameters": ', "}"
