#!/usr/bin/env python
"""What ``--rope-scaling auto`` (YaRN past the trained length) does to a
model's reading of a long text, against the same window unscaled.

lmspd's automatic window is at least 32768 tokens, longer than some models
were trained on (the bundled SmolLM2: 8192). One text (lmspd's own source,
concatenated) is read through lmspd's engine twice, with ``--rope-scaling
auto`` and ``none``, in one run on the same GGUF and threads, and the
perplexity of each next token is reported per band of positions: below the
trained length it shows what YaRN costs there, past it what it saves.

    .venv/bin/python bench/rope_scaling.py                  # 16384-token window, ~8 min on 2 cores
    .venv/bin/python bench/rope_scaling.py --window 32768 --tokens 20000
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import _internals as internals

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import bundled_model_path  # noqa: E402
from lmspd.engines.llama.engine import LlamaEngine  # noqa: E402

BATCH = 512


def source_text(chars: int) -> str:
    text = ""
    for path in sorted((ROOT / "lmspd").rglob("*.py")):
        text += path.read_text()
        if len(text) >= chars:
            break
    return text


def token_nll(engine: LlamaEngine, tokens: list[int]) -> np.ndarray:
    """-log p(token i+1 | tokens ..i), read a batch at a time (all logits of
    a batch, never the whole text's: 16k x 49k floats would be 3 GB)."""
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(engine._model.model))
    out = np.empty(len(tokens) - 1, dtype=np.float64)
    batch = internals.LlamaBatch(n_tokens=BATCH, embd=0, n_seq_max=1)
    for start in range(0, len(tokens) - 1, BATCH):
        piece = tokens[start:start + BATCH]
        batch.set_batch(piece, n_past=start, logits_all=True)
        engine.ctx.decode(batch)
        rows = np.ctypeslib.as_array(engine.ctx.get_logits(), shape=(len(piece), n_vocab)).astype(np.float64)
        top = rows.max(axis=1, keepdims=True)
        logsumexp = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
        follow = tokens[start + 1:start + 1 + len(piece)]
        n = len(follow)
        out[start:start + n] = logsumexp[:n] - rows[np.arange(n), follow]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: the bundled model)")
    parser.add_argument("--window", type=int, default=16384, help="the engine's window per sequence")
    parser.add_argument("--tokens", type=int, default=0, help="tokens of text to read (default: the window less 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--band", type=int, default=2048, help="positions per reported band")
    args = parser.parse_args()
    path = args.model or bundled_model_path()
    n_tokens = min(args.tokens or args.window - 1, args.window - 1)

    results: dict[str, np.ndarray] = {}
    trained = None
    for mode in ("none", "auto"):
        engine = LlamaEngine("bench", path, n_ctx=args.window, n_threads=args.threads, parallel=1,
                             n_batch=BATCH, rope_scaling=mode, grammars_at_start=False)
        try:
            tokens = engine.tokenize(source_text(n_tokens * 6))[:n_tokens]
            if len(tokens) < n_tokens:
                raise SystemExit(f"the text has {len(tokens)} tokens, fewer than the {n_tokens} asked for")
            started = time.monotonic()
            results[mode] = token_nll(engine, tokens)
            rope = engine.placement.rope
            trained = rope.trained if rope else trained
            print(f"[{mode}] {len(tokens)} tokens in {time.monotonic() - started:.0f} s; "
                  f"{rope.describe() if rope else 'unscaled'}", flush=True)
        finally:
            asyncio.run(engine.aclose())

    print(f"\n## rope_scaling — {path.name}, window {args.window}, {n_tokens} tokens of lmspd's source, "
          f"--threads {args.threads}; perplexity per band of positions"
          + (f" (trained on {trained})" if trained else " (the window is within the trained length: no YaRN)"))
    print("\n| positions | none | auto (YaRN) | auto / none |\n|---|---|---|---|")
    for start in range(0, n_tokens - 1, args.band):
        end = min(start + args.band, n_tokens - 1)
        none = math.exp(results["none"][start:end].mean())
        auto = math.exp(results["auto"][start:end].mean())
        print(f"| {start}–{end} | {none:.2f} | {auto:.2f} | {auto / none:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
