"""The ``compaction`` item: a long context window replaced by a summary the
model wrote, carried by the client as an opaque, sealed blob.

On the wire it is ``{"type": "compaction", "id": ..., "encrypted_content": ...}``
(OpenAI Responses / Open Responses). ``encrypted_content`` is sealed with
the server key (``lmspd.core.sealing``, purpose ``compaction``): the client
cannot read or alter it, and a tampered blob is a 400 naming it. Inside is
the summary, which is all lmspd needs to expand it again: the neutral form
of a compaction item is a user ``Message`` whose text is the summary under
``SUMMARY_PREFIX`` and whose ``compaction`` field keeps the blob, so that
every engine renders it with no special case and every dialect writes it
back as the item it came as.

What a compaction stands for (``effective_items``): the assistant turns and
tool traffic before it. The client's own messages (system, developer, user)
before it stay, so Codex's replay of ``[developer prompt, user messages,
compaction, new input]`` and a ``previous_response_id`` chain through an
auto-compacted turn both render as the reduced window, never the original.
"""

from __future__ import annotations

from lmspd.core.conversation import Item, Message
from lmspd.core.errors import invalid
from lmspd.core.sealing import Sealer

PURPOSE = "compaction"

# The fixed prompt the local model summarizes with (appended to the window
# as the last user turn). Documented in README.md; changing it changes
# every summary, so it is versioned with the package.
COMPACTION_PROMPT = (
    "You are compacting this conversation so that it can continue in a smaller context window. "
    "Write a concise summary of everything above that is needed to continue the work: the user's goal "
    "and constraints, decisions made, facts learned (file names, commands, results of tool calls), "
    "what has been done and what remains to do. Write plain prose and lists; do not call tools; "
    "do not address the user."
)

# How the summary reads to the model when the compaction item is expanded.
SUMMARY_PREFIX = "Summary of the earlier conversation (it was compacted to save context):\n\n"

# Kinds of message a compaction does not stand for: they stay in the window.
_KEPT_ROLES = frozenset({"system", "developer", "user"})


def seal(sealer: Sealer, summary: str, owner: str = "local") -> str:
    # Bound to the credential's owner, as sealed reasoning: another API key's
    # client cannot make this server expand (and render) someone's summary.
    return sealer.seal_value(PURPOSE, {"summary": summary}, owner=owner)


def expand(sealer: Sealer | None, blob: str, where: str, item_id: str | None = None,
           owner: str = "local") -> Message:
    """A compaction item as input: its neutral message (400 naming ``where``
    when the blob is not one this server sealed)."""
    param = f"{where}.encrypted_content"
    if sealer is None:
        raise invalid(f"'{param}' cannot be opened here: compaction items are read only by the server "
                      "that issued them.", param)
    value = sealer.open_value(PURPOSE, blob, param, owner=owner)
    summary = value.get("summary")
    if not isinstance(summary, str):
        raise invalid(f"'{param}' is not valid: it holds no summary.", param)
    return summary_message(summary, blob, item_id)


def summary_message(summary: str, blob: str, item_id: str | None) -> Message:
    return Message(role="user", text=SUMMARY_PREFIX + summary, id=item_id, compaction=blob)


def is_compaction(item: Item) -> bool:
    return isinstance(item, Message) and item.compaction is not None


def effective_items(items: list[Item]) -> list[Item]:
    """The window a model sees: before the last compaction, only the
    client's own messages remain (see the module docstring)."""
    last = max((i for i, item in enumerate(items) if is_compaction(item)), default=None)
    if last is None:
        return items
    head = [item for item in items[:last]
            if isinstance(item, Message) and item.role in _KEPT_ROLES and not is_compaction(item)]
    return head + items[last:]
