"""How much memory a local model needs, and the window and sequences that fit.

Pure arithmetic on a GGUF header's numbers: no llama.cpp here, so the model
registry (``--models-max-mem``), the engine's start and the unit tests all
count the same bytes.

The KV is what llama.cpp allocates for a context with one stream per
sequence (``kv_unified = false``): every layer holds, per sequence, ``window``
cells (padded to 256) of K and V rows; a sliding-window layer holds only its
window plus one micro-batch (padded to 256) unless ``--swa-full`` keeps every
cell (llama-kv-cache-iswa.cpp). A row of a quantized type is its blocks:
q8_0 stores 32 values in 34 bytes, q4_0 in 18 (ggml's block_q8_0, block_q4_0).

The rule for ``--ctx auto`` (README, "KV memory"): the window is the model's
trained length, or ``AUTO_MIN_WINDOW`` where it was trained shorter, capped by
what fits ``parallel`` sequences; where ``AUTO_MIN_WINDOW`` does not fit them,
``parallel`` comes down first (unless it was given), then the window, down to
``FLOOR_WINDOW``; below that the model is refused with the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Codex's first request is ~9k tokens in the bundled model's tokens; 32768
# leaves its turns room (the window lmspd always served by default).
AUTO_MIN_WINDOW = 32768
# The smallest window ``--ctx auto`` settles for: Codex's first turn (~9k
# tokens) plus ~7k tokens of answers and tool results.
FLOOR_WINDOW = 16384
# Windows are whole multiples of this (llama.cpp pads a sequence's cells to 256).
CELL_PAD = 256
# lmspd's micro-batch (the engine's n_batch = n_ubatch).
N_UBATCH = 512

# ggml type -> (bytes per block, values per block).
KV_TYPES: dict[str, tuple[int, int]] = {"f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}

# Which layers slide, per architecture, where the header has no
# ``<arch>.attention.sliding_window_pattern`` (llama.cpp's load_swa_pattern
# defaults): with pattern n, layer i slides unless i % n == n - 1.
SWA_PATTERNS = {"gemma3": 6, "gemma2": 2, "gpt-oss": 2, "cohere2": 4}

MIB = 1 << 20
GIB = 1 << 30


class FitError(ValueError):
    """The model does not fit as asked: the message names the numbers and the flags."""


def pad(n: int, to: int = CELL_PAD) -> int:
    return -(-n // to) * to


def asked_window(ctx: int | None, trained: int | None) -> int:
    """The window ``--ctx`` asks for before it is fitted to memory, padded
    as llama.cpp pads it: ``auto`` (None) the trained length, or
    ``AUTO_MIN_WINDOW`` where that is longer; 0 the trained length; N itself.
    ``trained`` None or 0: the GGUF does not say. (``lmspd render`` sizes a
    prompt by this too.)"""
    if ctx is None:
        return pad(max(trained or 0, AUTO_MIN_WINDOW))
    return pad(ctx or trained or AUTO_MIN_WINDOW)


def row_bytes(kv_type: str, values: int) -> int:
    per_block, block = KV_TYPES[kv_type]
    return -(-values // block) * per_block


@dataclass(frozen=True)
class ModelShape:
    """What a GGUF header says about a model's attention."""

    layers: int
    heads: int
    kv_heads: tuple[int, ...]  # per layer (0: a layer without KV)
    head_k: int
    head_v: int
    swa: tuple[bool, ...]  # per layer: a sliding-window layer
    n_swa: int  # the sliding window, in tokens (0: none)
    trained: int | None  # the trained context length
    vocab: int

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> "ModelShape | None":
        """None where the header lacks the shape (or describes a recurrent model)."""
        arch = meta.get("general.architecture")

        def num(key: str) -> int | None:
            value = meta.get(f"{arch}.{key}")
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        layers, width, heads = num("block_count"), num("embedding_length"), num("attention.head_count")
        if not (isinstance(arch, str) and layers and width and heads) or num("ssm.state_size"):
            return None
        raw_kv = meta.get(f"{arch}.attention.head_count_kv", heads)
        if isinstance(raw_kv, list) and len(raw_kv) == layers and all(isinstance(h, int) for h in raw_kv):
            kv_heads = tuple(raw_kv)
        elif isinstance(raw_kv, int) and raw_kv > 0:
            kv_heads = (raw_kv,) * layers
        else:
            return None
        head_k = num("attention.key_length") or width // heads
        head_v = num("attention.value_length") or width // heads
        n_swa = num("attention.sliding_window") or 0
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, list) and len(pattern) == layers:
            swa = tuple(bool(p) for p in pattern)
        else:
            n = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) else SWA_PATTERNS.get(arch, 0)
            # pattern 0 or 1: every layer slides (llama.cpp's set_swa_pattern).
            swa = tuple(n_swa > 0 and (n <= 1 or i % n < n - 1) for i in range(layers)) if n_swa else (False,) * layers
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = num("vocab_size") or getattr(tokens, "length", None) or (len(tokens) if isinstance(tokens, list) else 0)
        return cls(layers=layers, heads=heads, kv_heads=kv_heads, head_k=head_k, head_v=head_v, swa=swa,
                   n_swa=n_swa, trained=num("context_length"), vocab=int(vocab))

    def kv_bytes(self, window: int, sequences: int = 1, kv_type: str = "f16", *, swa_full: bool = False,
                 layers: int | None = None) -> int:
        """K and V of ``sequences`` windows of ``window`` tokens, over the first
        ``layers`` layers (default all), as llama.cpp allocates them."""
        cells = pad(window)
        swa_cells = cells if swa_full else min(cells, pad(self.n_swa + N_UBATCH))
        total = 0
        for i in range(self.layers if layers is None else layers):
            h = self.kv_heads[i]
            if h:
                total += (swa_cells if self.swa[i] else cells) * (row_bytes(kv_type, h * self.head_k)
                                                                  + row_bytes(kv_type, h * self.head_v))
        return total * sequences

    def compute_bytes(self, window: int, sequences: int, *, flash_attn: bool) -> int:
        """llama.cpp's compute buffers (an estimate): one micro-batch's
        activations and logits, and without flash attention the f32
        attention scores of a micro-batch against a whole window."""
        width = self.heads * max(self.head_k, self.head_v)
        out = N_UBATCH * 4 * (self.vocab + 8 * width)
        if not flash_attn:
            out += N_UBATCH * pad(window) * self.heads * 4
        # SmolLM2-135M, 32768 x 4, CPU: llama.cpp reserves 646 MiB without
        # flash attention and 98 MiB with it; this says 745 and 169.
        return out + 64 * MIB


@dataclass(frozen=True)
class Memory:
    """Where the model goes and how many bytes it may take there."""

    where: str  # "RAM" or a device's name ("CUDA0", ...)
    usable: int  # bytes lmspd may use (free memory less the headroom)
    free: int  # what the backend reports free
    headroom: int
    # A device's memory (placement sets it): fewer --gpu-layers there is a way out.
    gpu: bool = False
    # ``usable`` is --models-max-mem's, below what is free: a larger one is a way out.
    capped: bool = False


@dataclass(frozen=True)
class Request:
    """What the flags ask for: None where lmspd decides."""

    ctx: int | None = None  # None: auto; 0: the trained length
    parallel: int | None = None  # None: 4, lowered to fit
    kv_type: str = "f16"
    swa_full: bool = False
    flash_attn: bool = False


DEFAULT_PARALLEL = 4


@dataclass(frozen=True)
class Fit:
    window: int
    parallel: int
    kv_bytes: int
    weights_bytes: int
    compute_bytes: int
    reason: str  # what was chosen and why, for the log and /health

    @property
    def total(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes


def fit(shape: ModelShape, weights: int, memory: Memory, ask: Request) -> Fit:
    """The window and sequences for ``ask`` in ``memory``, or :class:`FitError`."""
    parallel_given = ask.parallel is not None
    parallel = ask.parallel if ask.parallel is not None else DEFAULT_PARALLEL

    def need(window: int, seqs: int) -> tuple[int, int]:
        return (shape.kv_bytes(window, seqs, ask.kv_type, swa_full=ask.swa_full),
                shape.compute_bytes(window, seqs, flash_attn=ask.flash_attn))

    def total(window: int, seqs: int) -> int:
        kv, compute = need(window, seqs)
        return weights + kv + compute

    def done(window: int, seqs: int, reason: str) -> Fit:
        kv, compute = need(window, seqs)
        return Fit(window, seqs, kv, weights, compute, reason)

    def largest_window(seqs: int, ceiling: int) -> int:
        """The largest multiple of CELL_PAD up to ``ceiling`` that fits (0: none)."""
        lo, hi = 0, ceiling // CELL_PAD
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if total(mid * CELL_PAD, seqs) <= memory.usable:
                lo = mid
            else:
                hi = mid - 1
        return lo * CELL_PAD

    avail = f"{memory.usable / MIB:,.0f} MiB usable in {memory.where} ({memory.free / MIB:,.0f} MiB free less " \
            f"{memory.headroom / MIB:,.0f} MiB headroom)"
    if weights + shape.compute_bytes(CELL_PAD, 1, flash_attn=ask.flash_attn) > memory.usable:
        raise FitError(f"the model's weights need {weights / MIB:,.0f} MiB, more than the {avail}; use "
                       + _either([*_room(memory), "a smaller quantization of the model"]))

    if ask.ctx is not None:
        window = asked_window(ask.ctx, shape.trained)
        what = f"--ctx {ask.ctx}" if ask.ctx else f"--ctx 0 (the trained length, {window})"
        if total(window, parallel) <= memory.usable:
            return done(window, parallel, f"{what}, --parallel {parallel}: fits")
        if not parallel_given:
            for seqs in range(parallel - 1, 0, -1):
                if total(window, seqs) <= memory.usable:
                    return done(window, seqs, f"{what}: --parallel lowered from {parallel} to {seqs} to fit "
                                              f"the {avail}")
        # Without --parallel, one sequence was tried last.
        seqs = parallel if parallel_given else 1
        asked = f"{what} with --parallel {seqs}" if parallel_given else f"{what}, even as one sequence,"
        raise FitError(_refusal(asked, total(window, seqs), avail,
                                _ways_out(memory, ask, seqs, "a smaller --ctx (or --ctx auto)")))

    trained = shape.trained or AUTO_MIN_WINDOW
    target = asked_window(None, shape.trained)
    runs_past = f" (past the trained {trained})" if trained < AUTO_MIN_WINDOW else ""
    if total(target, parallel) <= memory.usable:
        return done(target, parallel, f"window {target}{runs_past}: the model's full window fits {parallel} "
                                      f"sequences")
    window = largest_window(parallel, target)
    if window >= AUTO_MIN_WINDOW:
        return done(window, parallel, f"window {window} (trained {trained}): the largest that fits {parallel} "
                                      f"sequences in the {avail}")
    seqs = parallel
    if not parallel_given:
        while seqs > 1 and total(AUTO_MIN_WINDOW, seqs) > memory.usable:
            seqs -= 1
        if total(AUTO_MIN_WINDOW, seqs) <= memory.usable:
            window = largest_window(seqs, target)
            return done(window, seqs, f"--parallel lowered from {parallel} to {seqs} so that each sequence keeps "
                                      f"a {window}-token window{runs_past}, in the {avail}")
    window = largest_window(seqs, AUTO_MIN_WINDOW)
    if window >= FLOOR_WINDOW:
        lowered = f"--parallel lowered from {parallel} to {seqs}, " if seqs != parallel else ""
        return done(window, seqs, f"{lowered}window lowered to {window} (below {AUTO_MIN_WINDOW}, floor "
                                  f"{FLOOR_WINDOW}) to fit {seqs} sequences in the {avail}")
    sequences = f"--parallel {seqs} sequences" if parallel_given else "one sequence"
    raise FitError(_refusal(f"{sequences} of the smallest automatic window ({FLOOR_WINDOW} tokens)",
                            total(FLOOR_WINDOW, seqs), avail,
                            _ways_out(memory, ask, seqs, "a smaller --ctx given explicitly")))


def _refusal(what: str, needed: int, avail: str, flags: str) -> str:
    return f"{what} needs {needed / MIB:,.0f} MiB (weights, KV and compute buffers), more than the {avail}; " \
           f"try {flags}"


def _room(memory: Memory) -> list[str]:
    """More room where the model goes, where a flag gives it."""
    return (["a larger --models-max-mem"] if memory.capped else []) + \
           (["fewer --gpu-layers (the rest stays in RAM)"] if memory.gpu else [])


def _ways_out(memory: Memory, ask: Request, seqs: int, smaller_ctx: str) -> str:
    """What would fit the window: only what the flags have left to change
    (no lower --parallel below one sequence, no q8_0 on a q8_0 KV)."""
    ways = [smaller_ctx]
    if seqs > 1:
        ways.append("a lower --parallel")
    smaller_kv = {"f16": "--kv-type q8_0 (with flash attention)", "q8_0": "--kv-type q4_0"}.get(ask.kv_type)
    if smaller_kv:
        ways.append(smaller_kv)
    return _either([*ways, *_room(memory)])


def _either(ways: list[str]) -> str:
    return ways[0] if len(ways) == 1 else f"{', '.join(ways[:-1])}, or {ways[-1]}"
