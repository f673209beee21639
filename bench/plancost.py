#!/usr/bin/env python
"""What planning one request costs the scheduler thread, by the number of
states kept in RAM.

The continuation cache's planner (lmspd.cache.planner) runs on the
scheduler thread before every admission, so every running stream waits for
it. This builds a cache over the bundled model's real tokenizer and a fake
KV (tests/support/cache_rig.py), keeps N finished turns of one owner in RAM
(~900 tokens each, sharing a ~150-token instruction prefix, each a session
of its own), and times ``ContinuationCache.plan`` and ``diagnose`` for a new
~850-token request of that owner that shares the instructions and nothing
else (a new session: no state continues it, each shares the same prefix).
Reported: milliseconds per call (the median of 7 batches of 20 calls), and
the plan chosen, which must be the same for every N and every tree.

With ``--baseline REF`` the code of a git ref (``git archive``) is measured
too, in the same run, side by side: each tree is timed in a child process
of its own with PYTHONPATH set to it (its lmspd and its cache rig).

    flock /tmp/lmspd-cpu.lock .venv/bin/python bench/plancost.py --baseline main
    .venv/bin/python bench/plancost.py --sizes 0,100,400,1600,3200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def measure(sizes: list[int], batches: int, calls: int) -> dict[str, Any]:
    """In the child: ms per plan and per diagnose at each size, with this
    tree's lmspd and cache rig (PYTHONPATH)."""
    import lmspd

    sys.path.insert(0, str(Path(lmspd.__file__).resolve().parent.parent / "tests"))
    from llama_cpp import Llama

    from support.cache_rig import GGUF, INSTRUCTIONS, make_cache, request, turn

    model = Llama(str(GGUF), vocab_only=True, verbose=False)

    class Vocab:
        def tokenize(self, b: bytes, add_bos: bool, special: bool) -> list[int]:
            return model.tokenize(b, add_bos=add_bos, special=special)

        def detokenize(self, t: list[int], special: bool) -> bytes:
            return model.detokenize(t, special=special)

    body = "Some long tool output line.\n" * 100
    probe = make_cache(Vocab())
    states = [turn(probe, INSTRUCTIONS + f"<|im_start|>user\nsession {i}: {body}<|im_end|>\n"
                   f"<|im_start|>assistant\nAnswer {i}.<|im_end|>", owner="o") for i in range(max(sizes))]
    rows = []
    for n in sizes:
        cache = make_cache(Vocab())
        for state in states[:n]:
            state.kv = b"x"
            cache.tiers.remember(state)
        req = request(cache, INSTRUCTIONS + "<|im_start|>user\nsession new: " + body
                      + "<|im_end|>\n<|im_start|>assistant\n", owner="o")
        plan = cache.plan(req)
        assert plan is not None
        shown = f"{plan.source} keep={plan.keep} {plan.detail}".strip()
        plan_ms, diagnose_ms = [], []
        for _ in range(batches):
            t = time.perf_counter()
            for _ in range(calls):
                cache.plan(req)
            plan_ms.append((time.perf_counter() - t) / calls * 1000)
            t = time.perf_counter()
            for _ in range(calls):
                cache.diagnose(req, plan)
            diagnose_ms.append((time.perf_counter() - t) / calls * 1000)
        rows.append({"n": n, "plan_ms": statistics.median(plan_ms), "diagnose_ms": statistics.median(diagnose_ms),
                     "plan": shown, "request_tokens": len(req.tokens)})
    return {"lmspd": str(Path(lmspd.__file__).resolve().parent), "rows": rows}


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``measure`` in a child process over ``tree``'s code."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--sizes", args.sizes,
           "--batches", str(args.batches), "--calls", str(args.calls)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=tree).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    if Path(result["lmspd"]) != (tree / "lmspd").resolve():
        raise SystemExit(f"the child measured {result['lmspd']}, not {tree}")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default=None, metavar="REF", help="also measure the code of this git ref")
    p.add_argument("--sizes", default="0,100,400,1600", help="RAM states to plan against (comma-separated)")
    p.add_argument("--batches", type=int, default=7)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        print(json.dumps(measure(sizes, args.batches, args.calls)))
        return 0

    results = {"this checkout": run_tree(ROOT, args)}
    if args.baseline:
        sys.path.insert(0, str(ROOT / "bench"))
        from _common import git_tree

        with tempfile.TemporaryDirectory() as tmp:
            results[args.baseline] = run_tree(git_tree(args.baseline, Path(tmp) / "base"), args)
    names = list(results)
    print("RAM states: ~900 tokens each, one owner, a shared ~150-token prefix; "
          f"request {results[names[0]]['rows'][0]['request_tokens']} tokens; ms per call (median)")
    header = f"{'N':>6}" + "".join(f"  {name + ' plan':>22}  {name + ' diagnose':>26}" for name in names)
    print(header)
    for i, n in enumerate(sizes):
        line = f"{n:>6}"
        for name in names:
            row = results[name]["rows"][i]
            line += f"  {row['plan_ms']:>22.3f}  {row['diagnose_ms']:>26.3f}"
        print(line)
    print("plans: " + "; ".join(f"{name}: " + ", ".join(sorted({r['plan'] for r in results[name]['rows'][1:]}))
                                 for name in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
