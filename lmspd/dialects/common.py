"""Small rules the message-list dialects (Chat Completions, Anthropic
Messages) share: answered tool calls, items per request, stop sequences,
seeds; and with OpenAI Responses, the reasoning effort scale and the
refusal of ``moderation``. (Naming the dialect's own fields in the core's
errors: ``lmspd.dialects.fields``.)
"""

from __future__ import annotations

from typing import Sequence

from lmspd.core.conversation import Item, orphan_tool_outputs
from lmspd.core.errors import invalid
from lmspd.core.limits import RequestLimits


def check_answered(items: Sequence[Item], paths: Sequence[str], *, call: str, output: str) -> None:
    """Every tool output answers a call made earlier in the replayed history.

    ``paths[i]`` is where ``items[i]`` came from on the wire, so the error
    points at the client's own field; ``call``/``output`` name the dialect's
    shapes (``tool_calls``/``role: tool``, ``tool_use``/``tool_result``).
    """
    for index, call_id in orphan_tool_outputs(list(items))[:1]:
        path = paths[index]
        raise invalid(
            f"No {call} found for the {output} with id {call_id!r} ({path}). "
            f"Replay the full history: include the assistant turn whose {call} produced this id.",
            path,
        )


# ``moderation`` (Responses, Chat Completions) runs a moderation model
# beside the one asked; lmspd runs none, so ignoring it would let through
# what the client asked to be blocked.
MODERATION_REFUSAL = ("'moderation' runs a moderation model on the input and output; lmspd runs none, so it "
                      "can neither score nor block. Omit 'moderation'.")


def neutral_effort(effort: str | None) -> str | None:
    """A requested reasoning effort on the neutral scale, which tops out at
    ``xhigh`` (the llama engine's largest thinking budget): ``max`` asks for
    the most there is, and that is ``xhigh`` here, as Anthropic's ``max``
    is. A reply still echoes what was asked."""
    return "xhigh" if effort == "max" else effort


def check_item_count(count: int, path: str, limits: RequestLimits, *, parts: str) -> None:
    """``max_input_items`` bounds the neutral items a message list decodes
    into, not only its messages: one message holds any number of ``parts``
    (tool calls, content blocks), each an item of its own, as the same
    history sent to /v1/responses would be. ``count``: the items so far,
    ``path`` the wire place of the latest."""
    if count > limits.max_input_items:
        raise invalid(
            f"'messages' comes to more than {limits.max_input_items} items (each message, and each of its "
            f"{parts}, is one), exceeded at '{path}'; the limit is {limits.max_input_items} (max_input_items).",
            path)


def decode_stop(stop: str | list[str] | None, limits: RequestLimits, param: str) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > limits.max_stop_sequences:
        raise invalid(f"'{param}' has {len(stops)} sequences; the limit is {limits.max_stop_sequences}.", param)
    for i, s in enumerate(stops):
        if not s:
            raise invalid(f"'{param}[{i}]' is empty.", f"{param}[{i}]")
    return stops


def seed32(seed: int | None) -> int | None:
    # Clients send any 64-bit integer (OpenAI allows negatives); llama.cpp's
    # sampler takes a uint32. Folding keeps equal seeds equal and distinct
    # small seeds distinct.
    return None if seed is None else seed & 0xFFFFFFFF

