#!/usr/bin/env python
"""The host cost of a decode step: lmspd's time outside ``llama_decode`` per
step, at 4 and 16 decoding sequences, with and without a grammar.

Starts ``lmspd serve --parallel 16`` in a child process that records every
scheduler step (the child wraps ``HostCost.observe`` and ``llama_decode``
before serving; lmspd itself is unchanged): the host seconds the scheduler
measured (batch planning and fill, sampling, the parsers, the hand-over of
events), how many sequences decoded, and the ``llama_decode`` it ran. The
client streams ``/v1/responses`` requests at once (temperature 0,
``--max-tokens`` each, ``--repetition-window 0`` so that no stream ends
early). Scenarios:

  free-4      4 streams of free text
  grammar-4   4 streams, each a required ``write_file`` call with a strict
              JSON schema (llguidance on every token, the tool-call parser)
  free-16     the same with 16 streams
  grammar-16

Only steps in which exactly that many sequences decoded count (not the
prefill steps at the start, nor the tail where streams have ended). Reported
per scenario: host ms per step (p50, p90, mean), the decode's ms per step
(p50), and the host's share of the step (host / (host + decode), summed over
the counted steps). Targets (issue #30, the bundled model on the 2-core
development machine): host ≤ 0.5 ms per step at 4 sequences, ≤ 1.5 ms at 16.

``--baseline REF`` runs the code of a git ref too (``git archive`` into a
temporary directory), both servers up, taking turns round by round, so that
before and after are measured side by side under the same load. Half of the
rounds run with the servers started in one order, half in the other: on the
2-core machine the server started first measured ~6–9 % more host time per
step with the same code on both sides (0.92–0.94× one way, 1.02–1.09× the
other, 2026-12-06).
``--speculative off,auto`` (the default) measures each mode in turn; with
``auto`` a step may also verify drafts (more positions sampled per step).

    .venv/bin/python bench/stepcost.py
    .venv/bin/python bench/stepcost.py --baseline main --rounds 3
    .venv/bin/python bench/stepcost.py --profile /tmp/prof   # cProfile of the scheduler thread
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SCENARIOS = ("free-4", "grammar-4", "free-16", "grammar-16")
TOPICS = ("a dragon and a knight", "the history of ships", "a journey across a desert", "the northern sea",
          "a lighthouse keeper", "a city under the ice", "two rival bakers", "a clockmaker's apprentice")
WRITE_TOOL = {"type": "function", "name": "write_file", "description": "Write text to a file.", "strict": True,
              "parameters": {"type": "object", "required": ["path", "content"], "additionalProperties": False,
                             "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}


# -- the child: lmspd serve, recording every step -------------------------------------------


def _serve(root: str, samples_path: str, profile: str, argv: list[str]) -> int:
    sys.path.insert(0, root)
    import llama_cpp

    import lmspd.engines.llama.scheduler as scheduler
    import lmspd.engines.llama.stepcost as stepcost
    from lmspd.cli import main

    assert Path(scheduler.__file__).resolve().is_relative_to(Path(root).resolve()), scheduler.__file__
    clock = time.perf_counter
    cpu = time.thread_time
    steps: list[tuple[float, float, int, int, float, float]] = []
    # The latest llama_decode: tokens, seconds, the scheduler thread's CPU seconds in it.
    last: list[Any] = [0, 0.0, 0.0]
    cpu_at = [0.0]  # the scheduler thread's CPU clock at the previous step's end
    decode = llama_cpp.llama_decode

    def timed_decode(ctx: Any, batch: Any) -> int:
        t0, c0 = clock(), cpu()
        try:
            return decode(ctx, batch)
        finally:
            last[0], last[1], last[2] = batch.n_tokens, clock() - t0, cpu() - c0

    llama_cpp.llama_decode = timed_decode
    observe = stepcost.HostCost.observe

    def recorded(self: Any, seconds: float, sequences: int, *a: Any, **kw: Any) -> None:
        # The host's CPU time: the scheduler thread's CPU since the previous
        # step ended, less the decode's (llama.cpp's first thread is this
        # one). Unlike the wall time it leaves out waits for the GIL and for
        # a core, which a loaded machine adds; it includes the admission
        # between steps.
        now = cpu()
        host_cpu, cpu_at[0] = now - cpu_at[0] - last[2], now
        steps.append((clock(), seconds, sequences, last[0], last[1], host_cpu))
        observe(self, seconds, sequences, *a, **kw)

    stepcost.HostCost.observe = recorded  # type: ignore[method-assign]

    def dump() -> None:
        # Written off the scheduler thread, in batches, so that recording stays out of the steps.
        done = 0
        with open(samples_path, "a", buffering=1 << 16) as out:
            while True:
                time.sleep(0.2)
                n = len(steps)
                for row in steps[done:n]:
                    out.write(json.dumps(row) + "\n")
                out.flush()
                done = n

    threading.Thread(target=dump, daemon=True).start()
    if profile:
        import cProfile

        loop = scheduler.Scheduler._loop

        def profiled(self: Any) -> None:
            prof = cProfile.Profile()
            prof.enable()
            try:
                loop(self)
            finally:
                prof.disable()
                prof.dump_stats(profile)

        scheduler.Scheduler._loop = profiled  # type: ignore[method-assign]
    return main(argv)


# -- the client -------------------------------------------------------------------------------


def bodies(scenario: str, model: str, max_tokens: int, nonce: int) -> list[dict[str, Any]]:
    kind, n = scenario.split("-")
    out = []
    for i in range(int(n)):
        topic = TOPICS[i % len(TOPICS)]
        body: dict[str, Any] = {"model": model, "temperature": 0, "max_output_tokens": max_tokens, "stream": True,
                                "store": False}
        if kind == "free":
            body["input"] = f"({nonce}-{i}) Write a very long story about {topic}."
        else:
            body["input"] = (f"({nonce}-{i}) Write a very long story about {topic} and save it to "
                             f"stories/story_{i}.txt with write_file.")
            body["tools"] = [WRITE_TOOL]
            body["tool_choice"] = "required"
        out.append(body)
    return out


def stream(client: Any, url: str, body: dict[str, Any]) -> int:
    """Output tokens of one streamed response (only the terminal event is parsed)."""
    tokens = 0
    with client.stream("POST", url + "/v1/responses", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:400]}")
        for line in resp.iter_lines():
            if line.startswith("data: ") and ('"response.completed"' in line or '"response.incomplete"' in line
                                              or '"response.failed"' in line):
                usage = (json.loads(line[6:]).get("response") or {}).get("usage") or {}
                tokens = usage.get("output_tokens") or 0
    return tokens


def run_scenario(url: str, model: str, scenario: str, args: argparse.Namespace, nonce: int) -> dict[str, Any]:
    import httpx

    reqs = bodies(scenario, model, args.max_tokens, nonce)
    tokens = [0] * len(reqs)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with httpx.Client(timeout=600) as client:
                tokens[i] = stream(client, url, reqs[i])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t1 = time.perf_counter()
    if errors:
        raise errors[0]
    return {"t0": t0, "t1": t1, "tokens": tokens}


class Server:
    def __init__(self, name: str, root: Path, tmp: Path, args: argparse.Namespace, speculative: str,
                 start: int = 0) -> None:
        sys.path.insert(0, str(HERE))
        from _common import LMSPD_READY, ChildServer

        self.name = name
        self.samples = tmp / f"{name}-{speculative}.jsonl"
        profile = str(Path(args.profile) / f"{name}-{speculative}-{start}.prof") if args.profile else ""
        cmd = [sys.executable, str(Path(__file__).resolve()), "_serve", str(root), str(self.samples), profile,
               "serve", "--port", "0", "--data-dir", str(tmp / f"{name}-{speculative}-data"),
               "--ctx", str(args.ctx), "--threads", str(args.threads), "--parallel", "16",
               "--speculative", speculative, "--repetition-window", "0", "--kv-disk-space-mb", "0",
               "--max-queue", "64", "--log-level", "warning"]
        self.child = ChildServer(name, cmd, LMSPD_READY, tmp / f"{name}-{speculative}.log").start()
        import httpx

        self.url = self.child.url
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def steps(self) -> list[list[float]]:
        time.sleep(0.5)  # the child's writer runs every 0.2 s
        return [json.loads(line) for line in self.samples.read_text().splitlines() if line]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(steps: list[list[float]], windows: list[dict[str, Any]], n: int) -> dict[str, Any] | None:
    rows = [s for s in steps for w in windows if w["t0"] <= s[0] <= w["t1"] and s[2] == n]
    if not rows:
        return None
    host = [r[1] * 1000 for r in rows]
    dec = [r[4] * 1000 for r in rows]
    host_cpu = [r[5] * 1000 for r in rows]
    return {"steps": len(rows), "host_p50": statistics.median(host), "host_p90": pct(host, 0.9),
            "cpu_p50": statistics.median(host_cpu), "cpu_p90": pct(host_cpu, 0.9),
            "host_mean": statistics.fmean(host), "decode_p50": statistics.median(dec),
            "batch_mean": statistics.fmean(r[3] for r in rows),
            "share": sum(host) / (sum(host) + sum(dec)),
            "tokens": sum(sum(w["tokens"]) for w in windows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=1024, help="context window per sequence")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--speculative", default="off,auto", help="modes to measure, in turn")
    parser.add_argument("--baseline", default=None, help="also run this git ref's code, side by side")
    parser.add_argument("--profile", default=None, help="a directory: cProfile of each server's scheduler thread")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    scenarios = [s for s in args.scenarios.split(",") if s]
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    results: dict[tuple[str, str, str], dict[str, Any] | None] = {}
    with tempfile.TemporaryDirectory(prefix="lmspd-bench-stepcost-") as tmp_name:
        tmp = Path(tmp_name)
        roots = {"this": ROOT}
        if args.baseline:
            base = tmp / "baseline"
            base.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
            roots[args.baseline] = base
        for mode in args.speculative.split(","):
            windows: dict[tuple[str, str], list[dict[str, Any]]] = {}
            steps: dict[str, list[list[float]]] = {}
            starts = [list(roots.items())]
            if len(roots) > 1 and args.rounds > 1:
                starts.append(starts[0][::-1])
            done = 0
            for half, start in enumerate(starts):
                rounds = (args.rounds - done) // (len(starts) - half)
                done += rounds
                servers = [Server(name, root, tmp, args, mode, half) for name, root in start]
                try:
                    for rnd in range(rounds + 1):
                        order = servers if rnd % 2 == 0 else servers[::-1]
                        for srv in order:
                            for scen in scenarios:
                                nonce = (half * 100 + rnd) * 1000 + os.getpid() % 1000
                                got = run_scenario(srv.url, srv.model, scen, args, nonce=nonce)
                                if rnd:  # round 0 warms up (grammar compiles, first allocations)
                                    windows.setdefault((srv.name, scen), []).append(got)
                                print(f"[{srv.name} {mode}] round {rnd} {scen}: {sum(got['tokens'])} tokens in "
                                      f"{got['t1'] - got['t0']:.1f} s", file=sys.stderr, flush=True)
                    for srv in servers:
                        # The samples file gathers both halves' steps (a restarted child appends).
                        steps[srv.name] = srv.steps()
                finally:
                    for srv in servers:
                        srv.child.stop()
            for name in roots:
                for scen in scenarios:
                    n = int(scen.split("-")[1])
                    results[(name, mode, scen)] = summarize(steps[name], windows.get((name, scen), []), n)
    print(f"\n## stepcost — bundled model, --threads {args.threads}, --parallel 16, --ctx {args.ctx}, "
          f"{args.max_tokens} tokens a stream, {args.rounds} rounds; load average at start "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print("| code | speculative | scenario | steps | host ms p50 | p90 | mean | host CPU ms p50 | p90 "
          "| decode ms p50 | batch tokens | host share | target |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (name, mode, scen), r in results.items():
        if r is None:
            print(f"| {name} | {mode} | {scen} | 0 | — | — | — | — | — | — | — | — | — |")
            continue
        target = 0.5 if scen.endswith("-4") else 1.5
        verdict = "meets" if r["host_p50"] <= target else "MISSES"
        print(f"| {name} | {mode} | {scen} | {r['steps']} | {r['host_p50']:.3f} | {r['host_p90']:.3f} "
              f"| {r['host_mean']:.3f} | {r['cpu_p50']:.3f} | {r['cpu_p90']:.3f} | {r['decode_p50']:.1f} "
              f"| {r['batch_mean']:.1f} | {r['share'] * 100:.1f} % "
              f"| ≤ {target} ms: {verdict} |")
    if args.baseline:
        print(f"\nhost ms p50, {args.baseline} → this (ratio):")
        for (name, mode, scen), r in results.items():
            b = results.get((args.baseline, mode, scen))
            if name == "this" and r and b:
                print(f"  {mode:<5} {scen:<11} {b['host_p50']:.3f} → {r['host_p50']:.3f} "
                      f"({r['host_p50'] / b['host_p50']:.2f}×); host CPU {b['cpu_p50']:.3f} → {r['cpu_p50']:.3f} "
                      f"({r['cpu_p50'] / b['cpu_p50']:.2f}×)")
    if args.json:
        args.json.write_text(json.dumps({" ".join(k): v for k, v in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 4 and sys.argv[1] == "_serve":
        sys.exit(_serve(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]))
    sys.exit(main())
