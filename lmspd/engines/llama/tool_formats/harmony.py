"""gpt-oss's Harmony format: every message is a header and a body in channels::

    <|channel|>analysis<|message|>The user wants the weather...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

``analysis`` is reasoning (``ReasoningDelta``s, then one ``ReasoningDone``
when its body ends — the order lmspd.core.events asks of every engine, so
that the reasoning item is closed before a text or call item opens), ``final`` and a
``commentary`` message without a recipient are text, and a message whose
recipient is ``functions.NAME`` (in the header, before or after the
channel) is a call whose body is the JSON arguments. The header is markup:
none of it ever reaches the text. A body ends at ``<|end|>``, ``<|call|>``,
``<|return|>`` or the next ``<|start|>``; the end of the output also ends
it (``<|call|>`` and ``<|return|>`` are end-of-generation tokens, so the
engine stops before the parser sees them).

The markers are special tokens of the gpt-oss vocabulary; the parser
expects them as text (the engine renders exactly these special tokens as
text: ``Vocabulary.show_markers``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from lmspd.core.conversation import Tool, ToolCall, ToolOutput
from lmspd.core.events import ReasoningDelta, ReasoningDone

from .base import CallLayout, FormatName, ToolCallParser, ToolFormat, dumps, partial_suffix
from .json_scan import Sink, ToolCallError

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_BODY_ENDS = (END, CALL, RETURN, START)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_MAX_HEADER = 512


class HarmonyParser(ToolCallParser):
    def __init__(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> None:
        super().__init__(tools, new_call_id)
        self._state = "header"  # the reply starts inside an assistant header
        self._kind = "text"  # reasoning | text | call
        self._sink: Sink | None = None
        self._fresh = False
        self._reasoned = False  # this reasoning message has emitted a delta

    @property
    def in_reasoning(self) -> bool:
        return self._state == "body" and self._kind == "reasoning"

    def _run(self, final: bool) -> None:
        while self._buf:
            if self._state == "header":
                at = self._buf.find(MESSAGE)
                if at < 0:
                    if len(self._buf) > _MAX_HEADER:
                        raise ToolCallError("a Harmony message header is too long")
                    if final:
                        self._buf = ""  # a header with no body: nothing to show
                    return
                self._header(self._buf[:at])
                self._buf = self._buf[at + len(MESSAGE):]
                self._state = "body"
            else:
                ends = [(at, m) for m in _BODY_ENDS if (at := self._buf.find(m)) >= 0]
                if ends:
                    at, marker = min(ends)
                    self._body(self._buf[:at])
                    self._buf = self._buf[at + len(marker):]
                    self._close()
                    self._state = "header"
                    continue
                keep = 0 if final else max(partial_suffix(self._buf, m) for m in _BODY_ENDS)
                self._body(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
        if final and self._state == "body":
            self._close()
            self._state = "header"

    def _header(self, header: str) -> None:
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        name = channel.group(1) if channel else "final"
        if recipient and recipient.group(1).startswith("functions."):
            tool = self._lookup(recipient.group(1)[len("functions."):])
            self._start(tool)
            self._sink = self._sink_for(tool)
            self._kind = "call"
            self._fresh = True
        elif recipient:
            raise ToolCallError(f"the model addressed {recipient.group(1)!r}, which is not a function")
        else:
            self._kind = "reasoning" if name == "analysis" else "text"

    def _body(self, text: str) -> None:
        if not text:
            return
        if self._kind == "call":
            assert self._sink is not None
            if self._fresh:
                text = text.lstrip()
                if not text:
                    return
                self._fresh = False
            self._delta(self._sink.push(text))
        elif self._kind == "reasoning":
            last = self._events[-1] if self._events else None
            if isinstance(last, ReasoningDelta):
                self._events[-1] = ReasoningDelta(last.text + text)
            else:
                self._events.append(ReasoningDelta(text))
            self._reasoned = True
        else:
            self._text(text)

    def _close(self) -> None:
        if self._kind == "call":
            assert self._sink is not None
            self._done(self._sink.end())
            self._sink = None
        elif self._kind == "reasoning" and self._reasoned:
            self._events.append(ReasoningDone())
            self._reasoned = False
        self._kind = "text"


class HarmonyFormat(ToolFormat):
    name: FormatName = "harmony"
    trigger = " to=functions."
    triggers = (CHANNEL + "commentary to=functions.",)
    layout = CallLayout(separator=START + "assistant")
    # A tool's result is a message from the tool: the model writing one is
    # inventing the next turn.
    result_markers = (START + "functions.",)
    reasoning_channels = True

    @property
    def markers(self) -> tuple[str, ...]:
        return (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)

    def system_block(self, tools: Sequence[Tool]) -> str:
        # gpt-oss templates render tools themselves (a TypeScript-like
        # namespace in the developer message); this is for a template that does not.
        lines = ["# Tools", "", "## functions", "", "namespace functions {", ""]
        for t in self.template_tools(tools):
            f = t["function"]
            lines += [f"// {f['description']}", f"type {f['name']} = (_: {dumps(f['parameters'])}) => any;", ""]
        lines.append("} // namespace functions")
        return "\n".join(lines)

    def _render_call(self, call: ToolCall) -> str:
        args = dumps({"input": call.payload}) if call.kind == "custom" else call.payload or "{}"
        before, after = self.call_parts(call.name, raw=False)
        return before + args + after

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        return self.layout.separator.join(self._render_call(c) for c in calls)

    def render_outputs(self, outputs: Sequence[ToolOutput], names_by_call_id: Mapping[str, str]) -> str:
        return "".join(
            f"{START}functions.{names_by_call_id.get(o.call_id, '')} to=assistant{CHANNEL}commentary"
            f"{MESSAGE}{json.dumps(o.output, ensure_ascii=False) if not o.output.startswith(('{', '[')) else o.output}{END}"
            for o in outputs
        )

    def parser(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> ToolCallParser:
        return HarmonyParser(tools, new_call_id)

    def call_parts(self, name: str, raw: bool) -> tuple[str, str]:
        return f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}", CALL


__all__ = ["HarmonyFormat", "HarmonyParser"]
