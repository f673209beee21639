"""Client text stays text: no request can write the model's control tokens.

The prompt is rendered by the chat template and tokenized with special
tokens on, so that the template's markers (``<|im_start|>``, ``<|im_end|>``)
become their single control tokens. Text a client supplies (messages,
instructions, tool definitions, call arguments, tool outputs) must not: a
user message containing ``<|im_end|>\\n<|im_start|>system\\n…`` would
otherwise be read by the model as a real system turn.

So before rendering, every occurrence of a control token's text inside a
client string gets ``MARK`` (a Unicode noncharacter) after its first
character, and ``tokenize`` splits the rendered text at ``MARK``, which no
control token's text can span, dropping it. Each mark is self-contained, so
any slice of a rendered prompt still tokenizes safely on its own: the
continuation cache compares rendered texts by prefix and tokenizes only the
new suffix (``lmspd.cache.planner``). The split falls just after the first
character, which gives the tokens that tokenizing the client text with
special tokens off would give (``<`` then ``|im_end|>``).

Only control tokens are neutralized: llama.cpp matches user-defined tokens
(``<think>`` in some vocabularies) even with special tokens off, as Hugging
Face tokenizers do.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable

# U+FDD0 is a noncharacter: never assigned, so no real text needs it.
MARK = "\ufdd0"


class ClientText:
    def __init__(self, control_texts: Iterable[str]) -> None:
        texts = sorted({t for t in control_texts if len(t) >= 2}, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(t) for t in texts)) if texts else None

    def neutral(self, text: str) -> str:
        """``text`` with every control token's spelling broken by ``MARK``
        (and any ``MARK`` the client sent removed: marks are ours)."""
        if MARK in text:
            text = text.replace(MARK, "")
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda m: m.group()[0] + MARK + m.group()[1:], text)

    def neutral_json(self, value: Any) -> Any:
        """Every string in a JSON-like value (tool schemas), neutralized."""
        if isinstance(value, str):
            return self.neutral(value)
        if isinstance(value, dict):
            return {self.neutral(k): self.neutral_json(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.neutral_json(v) for v in value]
        return value


def neutral_items(items: list[Any], client: ClientText) -> list[Any]:
    """Copies of conversation items whose client-supplied strings are
    neutralized. Hidden reasoning stays as sampled: the server sealed it, and
    it must render exactly as the model wrote it (lmspd.core.sealing)."""
    from lmspd.core.conversation import CustomTool, FunctionTool, Message, ToolCall, ToolOutput

    out = []
    for item in items:
        if isinstance(item, Message):
            item = dataclasses.replace(item, text=client.neutral(item.text))
        elif isinstance(item, ToolCall):
            item = dataclasses.replace(item, name=client.neutral(item.name), payload=client.neutral(item.payload))
        elif isinstance(item, ToolOutput):
            item = dataclasses.replace(item, output=client.neutral(item.output))
        elif isinstance(item, FunctionTool):
            item = dataclasses.replace(item, name=client.neutral(item.name),
                                       description=None if item.description is None else
                                       client.neutral(item.description),
                                       parameters=client.neutral_json(item.parameters))
        elif isinstance(item, CustomTool):
            item = dataclasses.replace(item, name=client.neutral(item.name),
                                       description=None if item.description is None else
                                       client.neutral(item.description),
                                       grammar=client.neutral_json(item.grammar))
        out.append(item)
    return out


def llama_tokenize(vocab: Any, text: str) -> list[int]:
    """``text`` as tokens, special tokens on, no BOS (``llama_tokenize_bytes``)."""
    return llama_tokenize_bytes(vocab, text.encode("utf-8"), True)


def llama_tokenize_bytes(vocab: Any, raw: bytes, special: bool) -> list[int]:
    """``raw`` (UTF-8) as tokens, no BOS: one llama.cpp pass into a buffer
    sized for the worst case (a token is at least one byte), where
    llama-cpp-python's own ``tokenize`` makes two passes over a long text
    and builds its list while holding the GIL (a 3M-token prompt stalled
    every other thread for most of a second). ``special``: cut at special
    tokens' texts (``lmspd.engines.llama.fragments``). Runs in the preparing
    pool; ctypes releases the GIL for the C call."""
    import llama_cpp
    import numpy as np

    room = len(raw) + 8
    buf = (llama_cpp.llama_token * room)()
    n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, room, False, special)
    if n < 0:  # cannot happen (room is an upper bound), but never read past the buffer
        raise RuntimeError(f"tokenizing {len(raw)} bytes needs {-n} tokens")
    ids = np.frombuffer(buf, dtype=np.int32, count=n)  # type: ignore[call-overload]  # ctypes arrays are buffers
    tokens: list[int] = []
    # In slices, so that other threads get the GIL in between.
    for start in range(0, n, 1 << 16):
        tokens += ids[start:start + (1 << 16)].tolist()
    return tokens


def tokenize_marked(text: str, tokenize: Callable[[str], list[int]]) -> list[int]:
    """Tokenize a rendered prompt (special tokens on) piece by piece between
    marks, so that no control token spans a mark; the marks themselves are
    not tokens."""
    if MARK not in text:
        return tokenize(text)
    tokens: list[int] = []
    for piece in text.split(MARK):
        if piece:
            tokens += tokenize(piece)
    return tokens
