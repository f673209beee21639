#!/usr/bin/env python
"""Why the default thread count stops at the CPUs the process really has.

llama.cpp's workers meet at a spinning barrier after every operation: a
worker without a CPU of its own (a second hardware thread of a core, a CPU
outside the affinity mask, time beyond the cgroup quota, or a core another
process holds) makes the others wait for its time slice. This decodes the
bundled model in process (llama-cpp-python, greedy, ``--tokens`` tokens)
with every thread count from 1 to the machine's CPUs, alone and beside
``--busy`` processes that each spin on a CPU (standing in for a quota of
that many CPUs fewer), rounds taking turns, and prints the median tok/s of
each and its ratio to one thread.

    .venv/bin/python bench/threads.py                 # 1 busy process
    .venv/bin/python bench/threads.py --busy 2 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bundled_model_path, die_with_parent, llama_as_lmspd_loads  # noqa: E402


def decode_tps(llm, tokens: int) -> float:
    llm.reset()
    first = None
    n = 0
    for _ in llm.create_completion("Once upon a time", max_tokens=tokens, temperature=0, stream=True):
        n += 1
        if first is None:
            first = time.perf_counter()
    assert first is not None
    return (n - 1) / (time.perf_counter() - first)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=1, help="processes spinning beside the decode")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    cpus = os.cpu_count() or 1
    counts = list(range(1, cpus + 1))
    llms = {n: llama_as_lmspd_loads(bundled_model_path(), n_ctx=512, n_threads=n, n_threads_batch=n, verbose=False)
            for n in counts}
    results: dict[tuple[bool, int], list[float]] = {}
    for _ in range(args.rounds):
        for busy in (False, True):
            hogs = [subprocess.Popen(die_with_parent([sys.executable, "-c", "while True: pass"]))
                    for _ in range(args.busy if busy else 0)]
            try:
                time.sleep(0.5)
                for n in counts:
                    results.setdefault((busy, n), []).append(decode_tps(llms[n], args.tokens))
            finally:
                for hog in hogs:
                    hog.kill()
    print(f"\n## threads — bundled model, {args.tokens} tokens, {cpus} CPUs, {args.rounds} rounds\n")
    print("| beside | threads | tok/s (median) | vs 1 thread |")
    print("|---|---|---|---|")
    for busy in (False, True):
        one = statistics.median(results[(busy, 1)])
        for n in counts:
            tps = statistics.median(results[(busy, n)])
            print(f"| {f'{args.busy} busy' if busy else 'nothing'} | {n} | {tps:.1f} | {tps / one:.2f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
