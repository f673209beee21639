"""What the scheduler and each generation run on, made once by the engine
(``LlamaEngine``) after the model and its context are loaded.

The scheduler and a generation see the loaded model through this one object
and never through the engine: what they depend on is this fixed, named set.
Members that are objects with state of their own (the KV, the cache, the
stats, the preparations in flight) are the engine's, shared: the engine
reports them and tests read them there.

Not to be confused with ``placement.RuntimeConfig``: where and how the model
is to run, decided before loading (the engine's ``runtime``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llama_cpp._internals import LlamaContext, LlamaSampler

from lmspd.cache.manager import ContinuationCache
from lmspd.core.limits import RequestLimits
from lmspd.core.sealing import Sealer

from .kv import SequenceKv
from .preparation import LlamaPrepared
from .reasoning import ReasoningSyntax
from .sampling import GrammarFirstRejection, Greedy
from .tool_formats import ToolFormat
from .transcript import Transcript
from .vocab import Vocabulary

if TYPE_CHECKING:
    # The scheduler defines it and imports this module.
    from .preparations import Preparations


@dataclass
class GenerationStats:
    """What the last generation cost; also read by tests and benchmarks."""

    generations: int = 0
    prefilled_tokens: int = 0  # all generations together
    last_cache_source: str = "cold"
    last_cache_detail: str = ""
    last_reused_tokens: int = 0
    last_prefilled_tokens: int = 0
    last_prefill_ms: float = 0.0
    last_output_tokens: int = 0
    last_output_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LlamaRuntime:
    # -- the scheduler's --------------------------------------------------------
    # Only the scheduler thread decodes in it.
    ctx: LlamaContext
    # Rejected draft positions and settled copies are trimmed through it,
    # and it is told when a decode ran.
    kv: SequenceKv
    # Places requests on sequences, takes checkpoints, remembers turns (a
    # generation's ``remember`` reaches it through the scheduler).
    cache: ContinuationCache
    # The scheduler decodes with one thread fewer per long preparation
    # running, and an idle one waits briefly for a request being prepared.
    threads: int
    preparations: Preparations
    # Written as a prefill and a generation end; the engine reports it.
    stats: GenerationStats

    # -- a generation's ----------------------------------------------------------
    # Also the scheduler's: the width of a logits row.
    vocab: Vocabulary
    # ``Preparation.sampler``, bound: a request's grammar matcher is built
    # with the compiler the preparing side owns, and a generation needs
    # nothing else of that side.
    sampler: Callable[[LlamaPrepared], LlamaSampler | Greedy | GrammarFirstRejection]
    tool_format: ToolFormat
    # The model writes the tool format's markers as special tokens: its
    # output is parsed even when the request offers no tools.
    parse_always: bool
    reasoning: ReasoningSyntax | None
    # The server's output ceiling and repetition guard.
    limits: RequestLimits
    # A sealed reasoning names the model it came from; no sealer: the
    # server cannot seal.
    sealer: Sealer | None
    model_id: str
    # Which end token a turn keeps in the KV, and the text the cache
    # matches the next request against.
    transcript: Transcript
