#!/usr/bin/env python
"""Flash attention on or off, at a long context: what each costs an agent's
turn on this machine. Why ``--flash-attn auto`` is off on the CPU.

One process, one model (loaded with lmspd's parameters), a fresh llama.cpp
context per mode and round, the modes taking turns round by round. Each
round evaluates ``--tokens`` prompt tokens in batches of 512 (a cold
prefill), then appends 58 tokens to it (an agent's next tool result on a
remembered KV), then decodes 16 tokens one at a time. Printed: each
round, then the medians per mode and their on/off ratios (all times: below 1,
flash attention is faster).

    .venv/bin/python bench/flash_attn.py                  # the bundled model, 7,500 tokens, 2 threads
    .venv/bin/python bench/flash_attn.py --model M.gguf --gpu-layers all --tokens 30000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp  # noqa: E402

from _common import load_gguf  # noqa: E402

BATCH = 512
APPEND = 58
DECODE = 16


def _fill(batch: llama_cpp.llama_batch, tokens: list[int], start: int) -> None:
    batch.n_tokens = len(tokens)
    for j, token in enumerate(tokens):
        batch.token[j] = token
        batch.pos[j] = start + j  # type: ignore[call-overload]  # llama-cpp-python types it as an array of arrays
        batch.n_seq_id[j] = 1
        batch.seq_id[j][0] = 0
        batch.logits[j] = 0
    batch.logits[len(tokens) - 1] = 1


def one_round(model: llama_cpp.llama_model_p, tokens: list[int], n: int, threads: int,
              flash: bool) -> dict[str, float]:
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n + APPEND + DECODE + BATCH
    params.n_batch = params.n_ubatch = BATCH
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash
                              else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(BATCH, 0, 1)
    try:
        t0 = time.perf_counter()
        for start in range(0, n, BATCH):
            _fill(batch, tokens[start:min(n, start + BATCH)], start)
            assert llama_cpp.llama_decode(ctx, batch) == 0
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        _fill(batch, tokens[n:n + APPEND], n)
        assert llama_cpp.llama_decode(ctx, batch) == 0
        append = time.perf_counter() - t0
        t0 = time.perf_counter()
        for k in range(DECODE):
            _fill(batch, [tokens[k]], n + APPEND + k)
            assert llama_cpp.llama_decode(ctx, batch) == 0
        decode = (time.perf_counter() - t0) / DECODE
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    return {"prefill s": prefill, "append ms": append * 1000, "decode ms/token": decode * 1000}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF (default: the bundled SmolLM2-135M)")
    ap.add_argument("--tokens", type=int, default=7500,
                    help="the context the append and the decode run at (the bundled model is trained on 8192)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gpu-layers", default="0", help="layers on the GPU: a number or all")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model, path = load_gguf(args.model, args.gpu_layers)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    # Token ids spread over the vocabulary: what attention costs does not depend on the text.
    tokens = [(i * 7919) % (n_vocab - 200) + 100 for i in range(args.tokens + APPEND + DECODE)]
    print(f"{path.name}: {args.tokens} tokens, {args.threads} threads, gpu layers {args.gpu_layers}, "
          f"{args.rounds} rounds", flush=True)
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for r in range(args.rounds):
        for flash in ((False, True) if r % 2 == 0 else (True, False)):
            got = one_round(model, tokens, args.tokens, args.threads, flash)
            results[flash].append(got)
            print(f"  round {r + 1} flash {'on ' if flash else 'off'}: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in got.items())
                  + f" ({args.tokens / got['prefill s']:.0f} prompt tok/s)", flush=True)
    llama_cpp.llama_model_free(model)
    print("\n| measure | off | on | on/off |\n|---|---:|---:|---:|")
    for key in results[False][0]:
        off = statistics.median(x[key] for x in results[False])
        on = statistics.median(x[key] for x in results[True])
        print(f"| {key} | {off:.1f} | {on:.1f} | {on / off:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
