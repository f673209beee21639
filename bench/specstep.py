#!/usr/bin/env python
"""What speculation costs the host per step, without a server: the
scheduler's draft planning (``Scheduler._plan_drafts``: the n-gram index
kept up, the proposals, the planner) and the verification's bookkeeping
(``SequenceSpeculation.verified``), replayed over recorded token streams.

The streams are what the bundled model writes greedily (four short stories,
which the 135M model soon repeats, and one free-text passage that it does
not) plus a module copied with a rename (``edit``); the model runs once to
write them (~30 s on 2 cores). Each replayed sequence takes its stream's next
token every step; a draft is kept as far as it equals the stream, as the
sampler would keep it. Decode costs are fixed shapes, not measured: ``cpu``
the bundled model on 2 threads (1 token 11 ms ... 16 tokens 71 ms, a 512-token
prefill 900 ms: beside 4 sequences no draft fits the fair slack, beside 16 a
few tokens do), ``gpu`` flat (8 ms for any batch: drafts always have room,
and their length is ``Planner.max_draft``'s and the index's to bound).

Printed per case: µs per step (the best of ``--reps``), the drafts made,
the tokens kept, tokens per sequence-step (1 + kept per sequence and step:
at flat costs the speed-up over decoding without drafts), and a hash of every draft (tokens, per-position chances,
kept): with ``--baseline REF`` that ref's code replays the same streams in a
child process, and an equal hash shows that both made exactly the same
drafts.

With ``--memory`` (no model, no replay): what the n-gram index of one
sequence holds, by tracemalloc, per indexed token — over 16,384 random
tokens (every n-gram new: a full window of text that does not repeat) and
over a module repeated 12 times (split into words and signs, numbered in
order of appearance) — and how long indexing it takes, for this checkout
and ``--baseline``'s.

    .venv/bin/python bench/specstep.py
    .venv/bin/python bench/specstep.py --baseline main
    .venv/bin/python bench/specstep.py --memory --baseline main
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CASES = (("alone", 1, "cpu"), ("free", 4, "cpu"), ("free", 16, "cpu"), ("free", 4, "gpu"), ("free", 16, "gpu"),
         ("edit", 1, "cpu"), ("edit", 1, "gpu"))
TOPICS = ("a lighthouse keeper and a storm", "the history of ships", "a journey across a desert",
          "two rival bakers")


def _streams() -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from _common import bundled_model_path, llama_as_lmspd_loads

    llm = llama_as_lmspd_loads(bundled_model_path(), n_ctx=4096, n_threads=2, verbose=False)

    def chat(text: str) -> list[int]:
        return llm.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n".encode(), special=True)

    out: dict[str, Any] = {"free": []}
    for topic in TOPICS:
        prompt = f"Write a story about {topic}."
        reply = llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=240, temperature=0.0)
        assert isinstance(reply, dict)  # not streamed: the whole response
        text = reply["choices"][0]["message"]["content"]
        assert text is not None
        out["free"].append({"prompt": chat(prompt), "output": llm.tokenize(text.encode(), add_bos=False)})
    # Free text that does not repeat itself: the first lines of the Python licence's history.
    history = Path(sys.base_prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "LICENSE.txt")
    prose = history.read_text() if history.is_file() else (ROOT / "README.md").read_text()
    out["alone"] = [{"prompt": chat("Tell me about Python."), "output": llm.tokenize(prose.encode(), add_bos=False)[:400]}]
    module = (ROOT / "lmspd" / "engines" / "llama" / "stepcost.py").read_text()
    out["edit"] = [{"prompt": chat("Rewrite this file with decay renamed:\n" + module),
                    "output": llm.tokenize(module.replace("decay", "damping").encode(), add_bos=False)[:600]}]
    return out


def _shape(shape: str) -> dict[int, float]:
    if shape == "cpu":
        return {1: 11.0, 2: 18.0, 4: 27.0, 8: 46.0, 16: 71.0, 512: 900.0}
    return dict.fromkeys((1, 2, 4, 8, 16, 32, 512), 8.0)


def _cost(shape: str) -> Any:
    from lmspd.engines.llama.stepcost import DecodeCost

    cost = DecodeCost()
    for n, ms in _shape(shape).items():
        cost.observe(n, ms)
    return cost


class _Gen:
    """What ``Scheduler._plan_drafts`` reads of a ``Generation``."""

    def __init__(self) -> None:
        self.done = False
        self.max_new = 1 << 20
        self.sampled: list[int] = []

    @property
    def left(self) -> int:
        return self.max_new - len(self.sampled)


def _replay(streams: list[dict[str, Any]], nseq: int, shape: str, steps: int) -> tuple[float, list[Any]]:
    from lmspd.engines.llama.scheduler import Scheduler
    from lmspd.engines.llama.speculation import Planner, SequenceSpeculation

    cost = _cost(shape)
    fake = SimpleNamespace(planner=Planner(), decode_cost=cost, n_batch=512)
    runs = []
    for i in range(nseq):
        stream = streams[i % len(streams)]
        text = stream["output"][(i // len(streams)) * 5:]
        tokens = list(stream["prompt"])
        spec = SequenceSpeculation(tokens, None)
        spec.index.catch_up(1 << 20)
        runs.append(SimpleNamespace(spec=spec, prefilling=False, gen=_Gen(), pending=[text[0]], draft=None,
                                    tokens=tokens, text=text, at=1))
    parts = [(r, 1, True) for r in runs]
    trace: list[Any] = []
    spent = 0.0
    clock = time.perf_counter
    for _ in range(steps):
        t0 = clock()
        Scheduler._plan_drafts(fake, parts, nseq)  # type: ignore[arg-type]
        spent += clock() - t0
        for r in runs:
            draft, r.draft = r.draft, None
            r.tokens.extend(r.pending)
            r.gen.sampled.append(r.pending[0])
            if draft is not None:
                kept = 0
                while kept < len(draft.tokens) and draft.tokens[kept] == r.text[(r.at + kept) % len(r.text)]:
                    kept += 1
                trace.append((r.at, draft.source, tuple(draft.tokens), tuple(draft.rates), kept))
                r.tokens.extend(draft.tokens[:kept])
                r.gen.sampled.extend(draft.tokens[:kept])
                r.at += kept
                t0 = clock()
                r.spec.produced = len(r.gen.sampled)
                r.spec.verified(draft, kept)
                spent += clock() - t0
            r.pending = [r.text[r.at % len(r.text)]]
            r.at += 1
        cost.observe(nseq, _shape(shape)[nseq])  # as a step's decode would (the same cost again)
    return spent / steps, trace


def _measure(streams_path: str, reps: int, steps: int) -> list[dict[str, Any]]:
    streams = json.loads(Path(streams_path).read_text())
    out = []
    for kind, nseq, shape in CASES:
        best = float("inf")
        trace: list[Any] = []
        for _ in range(reps):
            per, trace = _replay(streams[kind], nseq, shape, steps)
            best = min(best, per)
        kept = sum(t[4] for t in trace)
        out.append({"case": f"{kind}-{nseq} {shape}", "us": round(best * 1e6, 1), "drafts": len(trace),
                    "kept": kept, "per_step": round(1 + kept / (steps * nseq), 2),
                    "trace": hashlib.sha1(repr(trace).encode()).hexdigest()[:10]})
    return out


def _memory_texts() -> dict[str, list[int]]:
    import random
    import re

    rng = random.Random(0)
    module = (ROOT / "lmspd" / "engines" / "llama" / "stepcost.py").read_text()
    ids: dict[str, int] = {}
    words = [ids.setdefault(w, 1000 + len(ids)) for w in re.findall(r"\w+|\S", module)]
    return {"random 16384": [rng.randrange(49152) for _ in range(16384)], "module x12": words * 12}


def _memory() -> list[dict[str, Any]]:
    import gc
    import tracemalloc

    from lmspd.engines.llama.speculation import NgramIndex

    out = []
    for name, text in _memory_texts().items():
        tokens = list(text)  # allocated before tracing: the sequence owns them, not the index
        gc.collect()
        tracemalloc.start()
        index = NgramIndex(tokens)
        index.catch_up(1 << 30)
        size, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert index._done == len(tokens) - 1
        del index
        # And how long indexing the text takes, untraced (best of 5).
        best = float("inf")
        for _ in range(5):
            index = NgramIndex(tokens)
            t0 = time.perf_counter()
            index.catch_up(1 << 30)
            best = min(best, time.perf_counter() - t0)
            del index
        out.append({"text": name, "tokens": len(tokens), "bytes": size, "per_token": round(size / len(tokens), 1),
                    "us_per_token": round(best / len(tokens) * 1e6, 2)})
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_memory":  # the child: ROOT
        sys.path.insert(0, sys.argv[2])
        import lmspd

        assert Path(lmspd.__file__).resolve().is_relative_to(Path(sys.argv[2]).resolve()), lmspd.__file__
        print(json.dumps(_memory()))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_measure":  # the child: ROOT STREAMS REPS STEPS
        sys.path.insert(0, sys.argv[2])
        import lmspd

        assert Path(lmspd.__file__).resolve().is_relative_to(Path(sys.argv[2]).resolve()), lmspd.__file__
        print(json.dumps(_measure(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=None, help="also replay this git ref's code")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2, help="this and the baseline alternate, round by round")
    parser.add_argument("--memory", action="store_true", help="the index's memory per indexed token instead")
    args = parser.parse_args()
    if args.memory:
        return _memory_main(args.baseline)
    with tempfile.TemporaryDirectory(prefix="lmspd-bench-specstep-") as tmp_name:
        tmp = Path(tmp_name)
        streams = tmp / "streams.json"
        streams.write_text(json.dumps(_streams()))
        roots = {"this": ROOT}
        if args.baseline:
            sys.path.insert(0, str(HERE))
            from _common import git_tree

            roots[args.baseline] = git_tree(args.baseline, tmp / "base")
        results: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in roots}
        for _ in range(args.rounds):
            for name, root in roots.items():
                cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "_measure", str(root), str(streams),
                       str(args.reps), str(args.steps)]
                results[name].append(json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                                               text=True).stdout))
    print(f"## specstep — {args.steps} steps, best of {args.reps} reps, {args.rounds} rounds (µs: best round)\n")
    print("| case | " + " | ".join(f"{n} µs/step | drafts | kept | tok/seq-step | trace" for n in roots) + " |")
    print("|---|" + "---|---|---|---|---|" * len(roots))
    for i, (kind, nseq, shape) in enumerate(CASES):
        cells = []
        for name in roots:
            rows = [r[i] for r in results[name]]
            row = min(rows, key=lambda r: r["us"])
            cells.append(f"{row['us']} | {row['drafts']} | {row['kept']} | {row['per_step']} | {row['trace']}")
        print(f"| {kind}-{nseq} {shape} | " + " | ".join(cells) + " |")
    return 0


def _memory_main(baseline: str | None) -> int:
    with tempfile.TemporaryDirectory(prefix="lmspd-bench-specstep-") as tmp_name:
        roots = {"this": ROOT}
        if baseline:
            sys.path.insert(0, str(HERE))
            from _common import git_tree

            roots[baseline] = git_tree(baseline, Path(tmp_name) / "base")
        results = {}
        for name, root in roots.items():
            cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "_memory", str(root)]
            results[name] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    print("## specstep --memory — the n-gram index of one sequence (sizes 6, 3): tracemalloc, and µs per token"
          " to index it (untraced, best of 5)\n")
    print("| text | tokens | " + " | ".join(f"{n} bytes/token | {n} MB | {n} µs/token" for n in roots) + " |")
    print("|---|---|" + "---|---|---|" * len(roots))
    for i, row in enumerate(results["this"]):
        cells = [f"{results[n][i]['per_token']} | {results[n][i]['bytes'] / 1e6:.2f} | {results[n][i]['us_per_token']}"
                 for n in roots]
        print(f"| {row['text']} | {row['tokens']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
