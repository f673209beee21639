"""lmspd's own tool syntax, for templates that know nothing of tools (the
bundled SmolLM2): the Hermes blocks, plus raw custom-tool input::

    <tool_call name="apply_patch">
    *** Begin Patch
    ...
    </tool_call>

The newline after the opening tag and the one before the closing tag are
part of the syntax, not of the input. An input cannot contain
``</tool_call>``. Results come back in the next user turn as
``<tool_response call_id="..." name="...">`` blocks; a model that writes one
itself is inventing the next turn, and the engine stops there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lmspd.core.conversation import CustomTool, Tool, ToolOutput

from .base import FormatName, dumps, grammar_note
from .hermes import TaggedFormat


class FallbackFormat(TaggedFormat):
    name: FormatName = "fallback"
    # "<tool_call" covers both "<tool_call>" and '<tool_call name="...">'.
    trigger = "<tool_call"
    triggers = ("<tool_call",)
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
                if note := grammar_note(tool):
                    lines.append(note)
            else:
                if tool.description:
                    lines.append(tool.description)
                schema = tool.parameters or {"type": "object", "properties": {}}
                lines.append(f"Arguments (JSON Schema): {dumps(schema)}")
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


