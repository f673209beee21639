"""Cache-affinity routing against round-robin and least-loaded, behind one
lmspd in front of three llama.cpp servers.

One run, one GGUF (the bundled SmolLM2-135M-Instruct unless ``--model``):
three xllamacpp servers (llama.cpp's own server, ``bench/_common.py
serve-xllamacpp``: one slot each, its default RAM prompt cache) and one
``lmspd serve --engine upstream`` with the three URLs, started afresh for
each policy (``--upstream-routing affinity|round-robin|least-loaded``), so
that no policy starts with another's caches.

The workload, the same for every policy: ``--sessions`` agent sessions
(default 6) of ``--turns`` turns (default 8). Each round sends every
session's next turn at once (each session waits for its own reply, as an
agent does). A session has its own system prompt (~``--system-tokens``)
and asks a short question per turn; the sessions are of the three kinds
lmspd routes on, two of each:

    key     /v1/responses, full history replayed, ``prompt_cache_key``
    chain   /v1/responses, ``previous_response_id`` (stored)
    chat    /v1/chat/completions, full history replayed, no key at all

Metrics, per policy, over turns 2+ (the first turn of a session is cold
under every policy):

* TTFT: request sent -> first text delta, client side, streaming.
* prefill: prompt tokens the endpoint evaluated (``input_tokens`` minus the
  ``cached_tokens`` llama-server reported, relayed by lmspd).
* new suffix: ``input_tokens`` minus the previous turn's ``input_tokens``
  (the previous reply as replayed plus the new question): the least a
  prefix cache can leave to prefill.

Targets (issue 15): affinity's mean TTFT of turns 2+ at most 0.5x
round-robin's, and its prefill per turn within 10% of the new suffix.

    python bench/routing.py                      # ~5 min on a loaded 2-core box
    python bench/routing.py --sessions 3 --turns 4 --system-tokens 120
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    LMSPD_READY,
    ChildServer,
    Sample,
    bundled_model_path,
    post_sse,
    stream_chat_completions,
    xllamacpp_server,
)

POLICIES = ("affinity", "round-robin", "least-loaded")
KINDS = ("key", "chain", "chat")
MODEL = "pool"
WORDS = ("parser", "cache", "socket", "thread", "buffer", "schema", "router", "index", "stream", "token",
         "module", "client", "server", "bridge", "queue", "budget", "ledger", "vector", "kernel", "widget")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated subset of {POLICIES}")
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=200, help="about this many tokens of system prompt")
    p.add_argument("--reply-tokens", type=int, default=8, help="max output tokens per turn")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1, help="threads per llama.cpp server")
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--workdir", type=Path, default=None, help="keep server logs here (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write every turn here")
    args = p.parse_args(argv)
    args.policies = [x for x in args.policies.split(",") if x]
    if not set(args.policies) <= set(POLICIES):
        p.error(f"--policies: choose from {POLICIES}")
    return args


# -- the sessions -------------------------------------------------------------------


@dataclass
class Session:
    index: int
    kind: str
    system: str
    questions: list[str]
    history: list[dict] = field(default_factory=list)
    previous: str | None = None
    last_input: int | None = None

    @property
    def name(self) -> str:
        return f"s{self.index}-{self.kind}"

    def send(self, client: Any, base: str, turn: int, reply_tokens: int) -> Sample:
        """One turn, streamed; the session's history follows the reply."""
        question = self.questions[turn - 1]
        sample = Sample(system=self.name, round=turn)
        if self.kind == "chat":
            if not self.history:
                self.history.append({"role": "system", "content": self.system})
            self.history.append({"role": "user", "content": question})
            body: dict[str, Any] = {"model": MODEL, "messages": self.history, "max_tokens": reply_tokens,
                                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            stream_chat_completions(client, base + "/v1/chat/completions", body, sample)
        else:
            body = {"model": MODEL, "instructions": self.system, "max_output_tokens": reply_tokens,
                    "temperature": 0, "stream": True}
            if self.kind == "key":
                self.history.append({"role": "user", "content": question})
                body.update(input=self.history, store=False, prompt_cache_key=f"bench-session-{self.index}")
            else:
                body.update(input=question, previous_response_id=self.previous, store=True)
            self._responses(client, base, body, sample)
        if self.kind != "chain":
            self.history.append({"role": "assistant", "content": sample.text})
        sample.extra["kind"] = self.kind
        sample.extra["new_suffix"] = (None if self.last_input is None or sample.input_tokens is None
                                      else sample.input_tokens - self.last_input)
        self.last_input = sample.input_tokens
        return sample

    def _responses(self, client: Any, base: str, body: dict, sample: Sample) -> None:
        clock = time.perf_counter
        parts: list[str] = []
        t0 = clock()
        for name, raw in post_sse(client, base + "/v1/responses", body):
            data = json.loads(raw)
            kind = data.get("type") or name
            if kind == "response.created":
                self.previous = data["response"]["id"]
            elif kind == "response.output_text.delta":
                if sample.first_delta is None:
                    sample.first_delta = clock() - t0
                parts.append(data["delta"])
            elif kind in ("response.completed", "response.incomplete", "response.failed"):
                sample.terminal = clock() - t0
                response = data["response"]
                sample.status = response.get("status")
                usage = response.get("usage") or {}
                sample.input_tokens = usage.get("input_tokens")
                sample.output_tokens = usage.get("output_tokens")
                sample.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        sample.text = "".join(parts)


def make_sessions(args: argparse.Namespace) -> list[Session]:
    rng = random.Random(args.seed)
    sessions = []
    for i in range(args.sessions):
        words = [rng.choice(WORDS) for _ in range(max(8, int(args.system_tokens / 1.3)))]
        system = (f"Session {i}. You are agent {i}, working on project {rng.randrange(10**6):06d}. "
                  "Notes on the code base: " + " ".join(words) + ". Answer in a few words.")
        questions = [f"Question {t}: what does the {rng.choice(WORDS)} do with the {rng.choice(WORDS)}?"
                     for t in range(1, args.turns + 1)]
        sessions.append(Session(i, KINDS[i % len(KINDS)], system, questions))
    return sessions


# -- one policy ------------------------------------------------------------------------


def run_policy(policy: str, args: argparse.Namespace, model: Path, workdir: Path) -> tuple[list[Sample], dict]:
    import httpx

    llamas = [xllamacpp_server(model, args.ctx, args.threads, 512, workdir / f"{policy}-llama{i}.log").start()
              for i in range(3)]
    lmspd = None
    try:
        cmd = [sys.executable, "-m", "lmspd", "serve", "--port", "0", "--data-dir", str(workdir / f"{policy}-data"),
               "--engine", "upstream", "--upstream-model", "smol", "--served-model", MODEL,
               "--upstream-routing", policy, "--log-level", "info"]
        for server in llamas:
            cmd += ["--upstream-url", server.url + "/v1"]
        lmspd = ChildServer("lmspd", cmd, LMSPD_READY, workdir / f"{policy}-lmspd.log").start()
        sessions = make_sessions(args)
        samples: list[Sample] = []
        with httpx.Client(timeout=300) as client, ThreadPoolExecutor(len(sessions)) as pool:
            for turn in range(1, args.turns + 1):
                samples += pool.map(lambda s, turn=turn: s.send(client, lmspd.url, turn, args.reply_tokens), sessions)
                print(f"  {policy}: round {turn}/{args.turns} done", file=sys.stderr, flush=True)
            routing = client.get(lmspd.url + "/health").json()["models"][MODEL]["routing"]
        for s in samples:
            s.extra["policy"] = policy
        return samples, routing
    finally:
        if lmspd is not None:
            lmspd.stop()
        for server in llamas:
            server.stop()


# -- the report ---------------------------------------------------------------------------


def mean(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "–" if x is None else format(x, spec)


def summarize(policy: str, samples: list[Sample], routing: dict) -> dict[str, Any]:
    later = [s for s in samples if s.round >= 2]
    prefill = [s.input_tokens - (s.cached_tokens or 0) for s in later if s.input_tokens is not None]
    suffix = [s.extra["new_suffix"] for s in later if s.extra.get("new_suffix") is not None]
    hits = [s for s in later if s.input_tokens and (s.cached_tokens or 0) >= s.input_tokens / 2]
    routes = {k: v for k, v in routing["routes"].items() if v}
    return {
        "policy": policy,
        "ttft_ms": mean([s.ttft_ms for s in later]),
        "ttft_p50_ms": statistics.median([s.ttft_ms for s in later if s.ttft_ms is not None]),
        "ttft_first_ms": mean([s.ttft_ms for s in samples if s.round == 1]),
        "prefill": mean(prefill),
        "suffix": mean(suffix),
        "input": mean([s.input_tokens for s in later]),
        "hit_share": len(hits) / len(later) if later else None,
        "routes": routes,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = (args.model or bundled_model_path()).resolve()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lmspd-routing-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"model {model.name}; 3 xllamacpp servers (1 slot, {args.threads} thread each, ctx {args.ctx}); "
          f"{args.sessions} sessions x {args.turns} turns ({', '.join(KINDS)}), rounds sent at once; "
          f"~{args.system_tokens}-token system prompts, {args.reply_tokens} output tokens; logs in {workdir}",
          flush=True)
    results: dict[str, dict] = {}
    every: list[dict] = []
    started = time.monotonic()
    for policy in args.policies:
        samples, routing = run_policy(policy, args, model, workdir)
        results[policy] = summarize(policy, samples, routing)
        every += [s.row() for s in samples]
    wall = time.monotonic() - started
    load = os.getloadavg()

    print(f"\nturns 2..{args.turns} of {args.sessions} sessions (wall {wall:.0f} s, load average at the end "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} CPUs)\n")
    print("| policy | mean TTFT | p50 TTFT | turn-1 TTFT | prompt tokens | prefilled/turn | new suffix/turn "
          "| prefill / suffix | cache hits | routes |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results.values():
        ratio = None if not r["suffix"] or r["prefill"] is None else r["prefill"] / r["suffix"]
        routes = ", ".join(f"{k} {v}" for k, v in r["routes"].items())
        print(f"| {r['policy']} | {fmt(r['ttft_ms'])} ms | {fmt(r['ttft_p50_ms'])} ms | {fmt(r['ttft_first_ms'])} ms "
              f"| {fmt(r['input'])} | {fmt(r['prefill'], '.1f')} | {fmt(r['suffix'], '.1f')} | {fmt(ratio, '.2f')} "
              f"| {fmt(100 * r['hit_share'] if r['hit_share'] is not None else None)}% | {routes} |")
    aff, rr = results.get("affinity"), results.get("round-robin")
    if aff and rr and aff["ttft_ms"] and rr["ttft_ms"]:
        ratio = aff["ttft_ms"] / rr["ttft_ms"]
        print(f"\naffinity / round-robin mean TTFT (turns 2+): {ratio:.2f}x (target <= 0.5x): "
              + ("met" if ratio <= 0.5 else "NOT met"))
    ll = results.get("least-loaded")
    if aff and ll and aff["ttft_ms"] and ll["ttft_ms"]:
        print(f"affinity / least-loaded mean TTFT (turns 2+): {aff['ttft_ms'] / ll['ttft_ms']:.2f}x")
    if aff and aff["suffix"] and aff["prefill"] is not None:
        ratio = aff["prefill"] / aff["suffix"]
        print(f"affinity prefill per turn / new suffix: {ratio:.2f} (target within 10%, <= 1.10): "
              + ("met" if ratio <= 1.10 else "NOT met"))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "turns": every}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
