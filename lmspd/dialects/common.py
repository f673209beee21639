"""Small rules the message-list dialects (Chat Completions, Anthropic
Messages) share: answered tool calls, stop sequences, seeds, and naming the
dialect's own parameter when the core refuses something.
"""

from __future__ import annotations

import re
from typing import Sequence

from lmspd.core.conversation import Item, orphan_tool_outputs
from lmspd.core.errors import ApiError, invalid
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


_ITEM_PARAM = re.compile(r"^input\[(\d+)\]")


def rename_param(exc: ApiError, names: dict[str, str], item_paths: Sequence[str] = ()) -> ApiError:
    """The core names Responses fields (``max_output_tokens``, ``input[3]``,
    ``text.format``); say the field this dialect's client actually sent.
    ``item_paths[i]`` is the wire path of neutral item ``i``."""
    param = exc.param
    if param is None:
        return exc
    item = _ITEM_PARAM.match(param)
    if item is not None and int(item.group(1)) < len(item_paths):
        exc.param = item_paths[int(item.group(1))] + param[item.end():]
        return exc
    for src in sorted(names, key=len, reverse=True):
        if param == src or param.startswith((src + ".", src + "[")):
            exc.param = names[src] + param[len(src):]
            break
    return exc
