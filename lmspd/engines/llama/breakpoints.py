"""Client-declared cache breakpoints -> token positions in a rendered prompt.

A breakpoint is an offset in a message's text, a tool output or the
instructions where a client said a reusable prefix ends
(``lmspd.core.conversation.Message.breakpoints``, ``ToolOutput.breakpoints``).
The chat template puts that text somewhere in the prompt, maybe trimmed, maybe
merged into another turn (Gemma has no system role), so the offset is found
by its text: the last characters before it, searched in order through the
rendered prompt. A breakpoint whose text cannot be found is dropped: it only
ever costs a checkpoint, never a wrong prompt.

With ``implicit`` the end of the instructions and of each leading system or
developer message is a breakpoint too, declared or not: on a KV that cannot
be trimmed it is the prefix a new session of the same agent shares (Codex
and most agents declare none), so without a checkpoint there every new
session prefills it again. It costs one state capture per distinct prefix
(the cache skips a position a remembered state already ends at). So is the
end of the item before a closing user message (a tool output, an assistant
or user message): where an edit of that message, a branch, diverges. A
turn that continues its state in place has that item in the KV already and
captures nothing there; one that prefills it (a follow-up after a tool
output) stops there once.

A breakpoint on the tool list (``Conversation.tools_breakpoint``) is not in
any item's text: the caller renders where the tool definitions end
(``tools_end``, a prefix of the prompt's text) and it becomes a position
like the others.
"""

from __future__ import annotations

from typing import Callable

from lmspd.cache.state import common_prefix
from lmspd.core.conversation import Conversation, Message, ToolOutput

# Characters before a breakpoint that locate it in the prompt.
ANCHOR_CHARS = 160


def token_positions(conversation: Conversation, text: str, tokens: list[int],
                    tokenize: Callable[[str], list[int]], *, implicit: bool = False,
                    tools_end: int | None = None) -> tuple[int, ...]:
    """Token positions in ``tokens`` (the tokenized ``text``) where each of the
    conversation's breakpoints ends, ascending, each inside the prompt;
    ``tools_end``: the character offset in ``text`` where the rendered tool
    definitions end, for a breakpoint on the tool list."""
    anchors: list[str] = []
    if conversation.instructions:
        ends = conversation.instructions_breakpoints
        if implicit and len(conversation.instructions) not in ends:
            ends = (*ends, len(conversation.instructions))
        anchors += [conversation.instructions[:at] for at in ends]
    items = conversation.items
    # The item before a closing user message: where an edit of that message
    # (a branch) diverges, implicit on a non-trimmable KV.
    before_last = len(items) - 2 if implicit and len(items) >= 2 and _is_user(items[-1]) else -1
    leading = True
    for i, item in enumerate(items):
        if isinstance(item, ToolOutput):
            out_ends = item.breakpoints
            if i == before_last and len(item.output) not in out_ends:
                out_ends = (*out_ends, len(item.output))
            anchors += [item.output[:at] for at in out_ends]
        if not isinstance(item, Message):
            leading = False
            continue
        at_ends = item.breakpoints
        leading = leading and item.role in ("system", "developer")
        if implicit and (leading or i == before_last) and len(item.text) not in at_ends:
            at_ends = (*at_ends, len(item.text))
        anchors += [item.text[:at] for at in at_ends]
    positions: list[int] = []
    start = 0

    def add(end: int) -> None:
        # The prefix tokenized on its own may end on another BPE boundary:
        # the position is where it still agrees with the prompt's tokens.
        pos = common_prefix(tokenize(text[:end]), tokens)
        if 0 < pos < len(tokens) and pos not in positions:
            positions.append(pos)

    for before in anchors:
        anchor = before.strip()[-ANCHOR_CHARS:]
        if not anchor:
            continue
        found = text.find(anchor, start)
        if found < 0:
            continue
        start = found + len(anchor)
        add(start)
    if tools_end:
        add(tools_end)
    return tuple(sorted(positions))


def _is_user(item: object) -> bool:
    return isinstance(item, Message) and item.role == "user"
