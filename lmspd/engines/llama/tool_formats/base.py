"""What every tool-call syntax shares: the parser core and the format's interface."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lmspd.core.conversation import CustomTool, Tool, ToolCall, ToolOutput, member_name
from lmspd.core.events import EngineEvent, TextDelta, ToolCallDelta, ToolCallDone, ToolCallStarted, ToolKind

from .json_scan import WS, CustomInput, FunctionArgs, Sink, ToolCallError

__all__ = ["CallLayout", "ParamBlocks", "ToolCallError", "ToolCallParser", "ToolFormat"]

FormatName = Literal["hermes", "llama3", "mistral", "fallback", "harmony", "qwen3_coder"]


@dataclass(frozen=True)
class CallLayout:
    """How several calls sit in one reply: ``prefix call (separator call)* suffix``."""

    separator: str = "\n"
    prefix: str = ""
    suffix: str = ""
    #: The prefix may be left out (Llama 3's ``<|python_tag|>`` at the start).
    prefix_optional: bool = False


@dataclass(frozen=True)
class ParamBlocks:
    """Arguments as one block per parameter instead of a JSON object
    (Qwen3-Coder: ``<parameter=city>\nParis\n</parameter>\n``)."""

    #: Before the parameter's name, and between its name and its value.
    open: str
    after_name: str
    #: After the value.
    close: str

    def parts(self, name: str) -> tuple[str, str]:
        """Literal text before and after the value of parameter ``name``."""
        return f"{self.open}{name}{self.after_name}", self.close


def custom_parameters() -> dict[str, Any]:
    """The JSON Schema a custom tool is offered with under a JSON syntax."""
    return {
        "type": "object",
        "properties": {"input": {"type": "string", "description": "The raw input of this freeform tool."}},
        "required": ["input"],
        "additionalProperties": False,
    }


def grammar_note(tool: CustomTool) -> str:
    grammar = tool.grammar or {}
    definition = grammar.get("definition")
    if not definition:
        return ""
    return f"Its input must match this {grammar.get('syntax', 'lark')} grammar:\n{definition.rstrip()}"


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class Declared:
    # As the model writes it (a namespace's member qualified).
    name: str
    kind: ToolKind
    namespace: str | None
    # As the call carries it, beside its namespace.
    member: str


class ToolCallParser:
    """Incremental parser of a model's output: text and tool calls.

    After a ``ToolCallError`` the parser is spent; the response fails.
    """

    def __init__(self, tools: Iterable[Tool], new_call_id: Callable[[], str]) -> None:
        self._tools: dict[str, Declared] = {}
        for tool in tools:
            kind: ToolKind = "custom" if isinstance(tool, CustomTool) else "function"
            self._tools[tool.name] = Declared(tool.name, kind, tool.namespace, member_name(tool))
        self._new_call_id = new_call_id
        self._buf = ""
        self._events: list[EngineEvent] = []
        self._index = 0
        self._open: Declared | None = None
        self._finished = False

    # public

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside a reasoning section that
        the format itself marks (Harmony's ``analysis`` channel): the next
        token is a reasoning token. Formats whose reasoning is a block
        before the reply (``<think>``) leave that to the reasoning splitter."""
        return False

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

    def _lookup(self, name: str) -> Declared:
        tool = self._tools.get(name)
        if tool is None:
            raise ToolCallError(f"the model called {name!r}, which is not among the request's tools")
        return tool

    def _start(self, tool: Declared) -> None:
        self._open = tool
        self._events.append(
            ToolCallStarted(self._index, self._new_call_id(), tool.member, tool.kind, tool.namespace)
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

    def _sink_for(self, tool: Declared) -> Sink:
        return CustomInput(tool.name) if tool.kind == "custom" else FunctionArgs(tool.name)

    def _text_until(self, trigger: str, final: bool) -> bool:
        """Emit the text before ``trigger`` and drop the trigger; whether it was found.

        Without a match, the tail that could still grow into the trigger
        stays in the buffer (unless ``final``)."""
        at = self._buf.find(trigger)
        if at >= 0:
            self._text(self._buf[:at])
            self._buf = self._buf[at + len(trigger) :]
            return True
        keep = 0 if final else partial_suffix(self._buf, trigger)
        cut = len(self._buf) - keep
        self._text(self._buf[:cut])
        self._buf = self._buf[cut:]
        return False

    def _skip_ws(self) -> bool:
        """Drop leading whitespace; whether anything else is left."""
        self._buf = self._buf.lstrip(WS)
        return bool(self._buf)


def partial_suffix(text: str, trigger: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``trigger``."""
    for k in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-k:]):
            return k
    return 0


class ToolFormat(ABC):
    """One tool-call syntax: prompt rendering, parsing and grammar pieces."""

    name: FormatName
    #: The text that starts a call in the model's output (what the engine
    #: stops at when no call may be made).
    trigger: str
    #: Texts that start the calls grammar wherever they appear
    #: (``tool_choice: auto``), and those that do only at the very start.
    triggers: tuple[str, ...] = ()
    start_triggers: tuple[str, ...] = ()
    layout: CallLayout = CallLayout()
    #: None: arguments are a JSON object; else one block per parameter.
    param_blocks: ParamBlocks | None = None
    #: Whether custom tools are called with their raw input (else wrapped
    #: as a function with one string parameter ``input``).
    raw_custom: bool = False
    #: Text that opens a tool *result*. The model writing one is inventing
    #: the next turn: generation stops there, and it is never shown as text.
    result_markers: tuple[str, ...] = ()
    #: Whether the format's parser marks the reasoning itself (Harmony's
    #: channels: ``ToolCallParser.in_reasoning``), with no reasoning block
    #: for a splitter to see.
    reasoning_channels: bool = False

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
                description = "\n\n".join(p for p in (tool.description, grammar_note(tool)) if p)
                parameters = custom_parameters()
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

    # grammar pieces, as data (lmspd.engines.llama.grammars writes the grammar)

    @abstractmethod
    def call_parts(self, name: str, raw: bool) -> tuple[str, str]:
        """Literal text before and after a call's arguments (``raw``: before
        and after a custom tool's raw input)."""

    @property
    def markers(self) -> tuple[str, ...]:
        """Every fixed marker of the syntax (those that are one special token
        of the model are constrained as that token)."""
        found = (*self.triggers, *self.start_triggers, self.layout.prefix, self.layout.suffix, *self.result_markers)
        return tuple(dict.fromkeys(m for m in found if m.strip()))
