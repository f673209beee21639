#!/usr/bin/env python
"""Greedy decoding with the pick made inside llama.cpp's graph (its backend
sampling, ``llama_set_sampler``) against the pick lmspd's scheduler makes on
the host (``sampling.greedy_tokens``: one argmax over the step's logits rows).

Not what lmspd does; a measurement for deciding whether it should. Right
after a decode the host reads every row of logits fresh from it (49k floats
a row for the bundled model, 152k for Qwen's vocabulary; on a GPU they are
first copied off the device), and everything it runs then runs on caches
the decode has emptied. Inside the graph the argmax runs where the logits
are, and only a token id a row comes back.

One process, one model (loaded with lmspd's parameters), two contexts of
``--parallel`` sequences decoding the same prompts greedily, taking turns
step by step (which one goes first alternates): ``host`` (no backend
sampler: llama.cpp copies the logits out, the host takes the argmax) and
``graph`` (a greedy backend sampler on every sequence: llama.cpp returns the
token). Printed per sequence count: the medians of a step's decode and of
the read after it, their ratios, and whether both picked the same tokens.

    .venv/bin/python bench/backend_sampling.py                  # the bundled model, 4 and 16 sequences, 2 threads
    .venv/bin/python bench/backend_sampling.py --model M.gguf --gpu-layers all --parallel 4,16,32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp  # noqa: E402

from _common import load_gguf  # noqa: E402
from lmspd.engines.llama.sampling import greedy_tokens  # noqa: E402

PROMPT = "Write a story about {topic}, in many short chapters."
TOPICS = ["a lighthouse", "a river", "a clockmaker", "the moon", "a fox", "a market", "a storm", "a library"]


class Lane:
    """One context decoding ``n`` sequences, with or without backend samplers."""

    def __init__(self, model: Any, prompts: list[list[int]], steps: int, threads: int, graph: bool) -> None:
        n = len(prompts)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n * (max(map(len, prompts)) + steps + 64)
        params.n_batch = params.n_ubatch = max(512, sum(map(len, prompts)))
        params.n_seq_max = n
        params.kv_unified = False  # one KV stream per sequence, as lmspd runs
        params.n_threads = params.n_threads_batch = threads
        self.graph = graph
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            raise SystemExit("llama.cpp could not create a context")
        self.samplers: list[Any] = []
        if graph:
            for seq in range(n):
                chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
                llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
                if not llama_cpp.llama_set_sampler(self.ctx, seq, chain):
                    raise SystemExit("llama.cpp cannot run a greedy sampler in this backend's graph")
                self.samplers.append(chain)
        self.batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
        self.n = n
        self.every = list(range(n))
        self.pos = [len(p) for p in prompts]
        # The prompts in one batch, a logits row at each one's end.
        k = 0
        ends = []
        for seq, prompt in enumerate(prompts):
            for i, token in enumerate(prompt):
                self._put(k, token, i, seq, i == len(prompt) - 1)
                k += 1
            ends.append(k - 1)
        self.batch.n_tokens = k
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        assert llama_cpp.llama_decode(self.ctx, self.batch) == 0
        self.last = self.read(ends)
        self.decode_ms: list[float] = []
        self.read_us: list[float] = []
        self.tokens: list[list[int]] = []

    def _put(self, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self.batch
        b.token[i], b.n_seq_id[i], b.logits[i] = token, 1, int(logits)
        b.pos[i] = pos
        b.seq_id[i][0] = seq

    def read(self, rows: list[int]) -> list[int]:
        """The picks at these batch positions, one a sequence."""
        if self.graph:
            return [llama_cpp.llama_get_sampled_token_ith(self.ctx, i) for i in rows]
        # One output row a sequence, in sequence order.
        return greedy_tokens(SimpleNamespace(ctx=self.ctx), self.every, self.n, self.n_vocab)  # type: ignore[arg-type]

    def step(self) -> None:
        for seq in range(self.n):
            self._put(seq, self.last[seq], self.pos[seq], seq, True)
            self.pos[seq] += 1
        self.batch.n_tokens = self.n
        t0 = time.perf_counter()
        assert llama_cpp.llama_decode(self.ctx, self.batch) == 0
        t1 = time.perf_counter()
        self.last = self.read(self.every)
        t2 = time.perf_counter()
        self.decode_ms.append((t1 - t0) * 1000)
        self.read_us.append((t2 - t1) * 1e6)
        self.tokens.append(list(self.last))

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        for chain in self.samplers:
            llama_cpp.llama_sampler_free(chain)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF (default: the bundled SmolLM2-135M)")
    ap.add_argument("--parallel", default="4,16", help="sequence counts, comma-separated")
    ap.add_argument("--steps", type=int, default=96, help="decode steps per sequence count")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gpu-layers", default="0", help="layers on the GPU: a number or all")
    args = ap.parse_args()
    model, path = load_gguf(args.model, args.gpu_layers)
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    print(f"{path.name}: vocabulary {n_vocab}, {args.threads} threads, gpu layers {args.gpu_layers}, "
          f"{args.steps} steps", flush=True)
    rows: list[dict[str, float]] = []
    for n in (int(x) for x in args.parallel.split(",")):
        prompts = []
        for i in range(n):
            text = PROMPT.format(topic=TOPICS[i % len(TOPICS)]) + f" ({i})"
            buf = (llama_cpp.llama_token * 256)()
            got = llama_cpp.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, 256, True, False)
            prompts.append(list(buf[:got]))
        lanes = {"host": Lane(model, prompts, args.steps, args.threads, graph=False),
                 "graph": Lane(model, prompts, args.steps, args.threads, graph=True)}
        try:
            for s in range(args.steps):
                for name in (("host", "graph") if s % 2 == 0 else ("graph", "host")):
                    lanes[name].step()
            host, graph = lanes["host"], lanes["graph"]
            # Compared until the first difference: after it the two decode different texts.
            same = 0
            for a, b in zip(host.tokens, graph.tokens, strict=True):
                if a != b:
                    break
                same += 1
            r: dict[str, float] = {"n": n, "same": same}
            for name, lane in lanes.items():
                r[f"{name} decode"] = statistics.median(lane.decode_ms)
                r[f"{name} read"] = statistics.median(lane.read_us)
            rows.append(r)
            print(f"  {n} sequences: host decode {r['host decode']:.2f} ms + read {r['host read']:.0f} µs; "
                  f"graph decode {r['graph decode']:.2f} ms + read {r['graph read']:.0f} µs; "
                  f"same tokens for {same}/{args.steps} steps", flush=True)
        finally:
            for lane in lanes.values():
                lane.close()
    llama_cpp.llama_model_free(model)
    print("\n| sequences | decode ms host | graph | graph/host | read µs host | graph | graph/host "
          "| step ms host | graph | graph/host | same tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        hs = r["host decode"] + r["host read"] / 1000
        gs = r["graph decode"] + r["graph read"] / 1000
        print(f"| {r['n']} | {r['host decode']:.2f} | {r['graph decode']:.2f} | "
              f"{r['graph decode'] / r['host decode']:.3f}× | {r['host read']:.0f} | {r['graph read']:.0f} | "
              f"{r['graph read'] / r['host read']:.2f}× | {hs:.2f} | {gs:.2f} | {gs / hs:.3f}× | "
              f"{r['same']}/{args.steps} steps |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
