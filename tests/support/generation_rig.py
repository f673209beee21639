"""A ``Generation`` without a model: a toy vocabulary whose tokens are whole
strings (the test decides where tokens end) in a ``LlamaRuntime`` with no
context, KV or cache (a generation never reaches them). The test feeds
sampled tokens as the scheduler does (``before_sample``, then ``on_token``;
a token is evaluated after ``on_token`` returns it), through the real
reasoning splitter, tool-call parser and stop matcher."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmspd.cache.manager import CachePlan
from lmspd.core.events import Usage
from lmspd.core.limits import RequestLimits
from lmspd.engines.base import CancelToken
from lmspd.engines.llama.generation import Generation
from lmspd.engines.llama.preparation import LlamaPrepared
from lmspd.engines.llama.preparations import Preparations
from lmspd.engines.llama.reasoning import ReasoningSyntax
from lmspd.engines.llama.runtime import GenerationStats, LlamaRuntime
from lmspd.engines.llama.transcript import Transcript

PROMPT = [1, 2, 3]  # what the KV holds before the first sampled token
EOG = 0


class ToyVocab:
    """Token ids for whole strings, allocated on first use."""

    def __init__(self) -> None:
        self.pieces: dict[int, bytes] = {EOG: b""}

    def id(self, text: str) -> int:
        for token, piece in self.pieces.items():
            if piece == text.encode() and token != EOG:
                return token
        token = len(self.pieces) + 100
        self.pieces[token] = text.encode()
        return token

    def piece(self, token: int) -> bytes:
        return self.pieces[token]

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.pieces[t] for t in tokens).decode()

    def tokenize(self, text: str) -> list[int]:
        return [self.id(ch) for ch in text]  # one token a character: a forced close is several


def toy_generation(vocab: ToyVocab, prepared: LlamaPrepared, *, reasoning: ReasoningSyntax | None,
                   tool_format: Any = None, sealer: Any = None, parse_always: bool = False,
                   on_event: Callable[[Any], None] = lambda event: None) -> Generation:
    """A cold generation of ``prepared`` (its tokens are ``PROMPT``, its text
    what the KV holds): ``sealer`` None is a server that cannot seal reasoning."""
    runtime = LlamaRuntime(
        ctx=None, kv=None, cache=None, threads=1, preparations=Preparations(),  # type: ignore[arg-type]
        stats=GenerationStats(), vocab=vocab, sampler=lambda prepared: None,  # type: ignore[arg-type]
        tool_format=tool_format, parse_always=parse_always, reasoning=reasoning,
        limits=RequestLimits(repetition_window=0), sealer=sealer, model_id="m",
        # No known turn closer: every end token is kept, and no turn has a visible transcript.
        transcript=Transcript(closer=None, render=lambda conversation, **kw: ""))
    plan = CachePlan("cold", 0, list(prepared.tokens), prepared.text)
    return Generation(runtime, prepared, plan, CancelToken(), on_event, Usage(), response_id=None,
                      kv_tokens=list(prepared.tokens), remember=lambda state: None)
