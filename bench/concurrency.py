"""Several agents at once on one model: lmspd ``--parallel 4`` against lmspd
``--parallel 1`` and llama.cpp's own server with 4 slots, side by side in
one run (the same GGUF, ``--ctx`` per sequence/slot, ``--threads``).

Systems (started one after the other, each alone on the machine):

``lmspd-p4``   ``lmspd serve --parallel 4`` — four sequences, continuous batching.
``lmspd-p1``   ``lmspd serve --parallel 1`` — one sequence: requests queue, and
               a session switch moves KV through RAM.
``llama-4``    ``xllamacpp`` (llama.cpp's server) with ``n_parallel = 4``, each
               slot the full ``--ctx`` (``n_ctx = 4 × ctx``), no unified KV —
               the same layout as lmspd's.

Every system gets the same streaming ``/v1/chat/completions`` bodies
(temperature 0). Scenarios:

1. ``agents`` — 4 agent sessions at once, each a full replay every turn (a
   ``--dev-tokens`` developer prompt, the task, then per earlier turn the
   model's reply verbatim and a ``--tool-tokens`` tool result), ``--turns``
   turns of ``--reply-tokens`` output. Each session's developer prompt is its
   own (a nonce at its start). Reports aggregate output tokens/s (all output
   tokens over the scenario's wall time), TTFT mean/p90 of turns 2+, and the
   tokens each system prefilled per turn (prompt − cached).
2. ``shared`` — the same, all four sessions with one developer prompt (the
   nonce moves into the task): the instructions should be prefilled once.
3. ``decode`` — 4 streams of ``--decode-tokens`` output on short prompts at
   once: aggregate decode tokens/s and mean TTFT. Every system must do the
   same work: lmspd runs with ``--repetition-window 0`` (the 135M model
   loops on these prompts at temperature 0, and lmspd's repetition guard
   would end those streams early while llama.cpp's server, which has none,
   generates on), and the table shows each stream's output tokens and its
   own decode rate; a row whose streams did not all reach
   ``--decode-tokens`` gets no ratio.
4. ``short`` — a short request alone (median of 3), then the same while a
   ``--decode-tokens`` generation streams: its TTFT against its TTFT alone.
5. ``decode-paired`` — scenario 3 again, ``--decode-rounds`` rounds with
   ``lmspd-p4`` and ``llama-4`` both started (each idle while the other
   runs) and taking turns, first one then the other: the per-round ratio,
   median. One run of scenario 3 per system swings by ±10% between runs on
   the 2-core machine (0.91× and 1.05× on the same code), more than the
   difference it measures.
6. ``decode16`` — 16 streams of ``--decode16-tokens`` (128) output at once,
   paired the same way: ``lmspd-p16`` (``lmspd serve --parallel 16``) and
   ``llama-16`` (the llama.cpp server with 16 slots) both started with
   ``--decode16-ctx`` per sequence/slot, one warm-up each, then
   ``--decode16-rounds`` rounds taking turns. Per round and system: the
   aggregate (all output tokens over the round's wall time), the decode
   phase's aggregate (tokens after each stream's first, over the span from
   the first stream's first token to the last stream's last), per-stream
   TTFT (mean, max) and each server process's CPU time. lmspd's host cost
   per step comes from its own ``/metrics`` histogram
   ``lmspd_step_host_seconds``, read before and after the measured rounds
   (p50 interpolated in its buckets, and the mean), and from ``/health``'s
   per-sequence-count mean (``mean_ms_by_sequences``, the server's whole
   life, warm-up included). Not in the default ``--scenarios``: pass
   ``--scenarios decode16`` (it needs no ``--systems``). ``--baseline REF``
   adds ``lmspd-p16@REF``, the code of a git ref of this repository
   (``git archive``, run as a third server beside the two), in the same
   rounds, the order of the three alternating.

Ratios are printed against ``llama-4`` (and scenario 4 against itself).
The development machine is 2 shared cores: quote numbers with the load they
were measured under (``--quick`` runs a smaller version of each scenario).

    python bench/concurrency.py --quick
    python bench/concurrency.py --systems lmspd-p4,llama-4 --turns 6
    python bench/concurrency.py --scenarios decode16
    python bench/concurrency.py --scenarios decode16 --baseline main
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import (  # noqa: E402
    ChildServer,
    Sample,
    add_gpu_arguments,
    bundled_model_path,
    git_tree,
    lmspd_gpu_flags,
    lmspd_server,
    sched_ns,
    stream_chat_completions,
    xllamacpp_server,
)

N_BATCH = 512
SYSTEMS = ("lmspd-p4", "lmspd-p1", "llama-4")
WORDS = ("alpha beta gamma delta repository module function test change review commit branch file line "
         "error value return import class method result output input parse build deploy config").split()


def filler(n_words: int, seed: int) -> str:
    """Deterministic prose-like filler, about 1.3 tokens a word for this tokenizer."""
    out = []
    x = seed * 2654435761 % 2**32
    for i in range(n_words):
        x = (1103515245 * x + 12345) % 2**31
        out.append(WORDS[x % len(WORDS)])
        if i % 14 == 13:
            out[-1] += "."
    return " ".join(out)


def dev_prompt(tokens: int, nonce: str | None) -> str:
    head = f"Session {nonce}. " if nonce else ""
    return (head + "You are a coding agent. Follow the repository rules below exactly. "
            + filler(int(tokens / 1.3), 7))


def tool_result(tokens: int, session: int, turn: int) -> str:
    return f"Tool output (session {session}, turn {turn}):\n" + filler(int(tokens / 1.3), 1000 * session + turn)


# -- systems ------------------------------------------------------------------------------


def served_name(system: str, url: str) -> str:
    return "bench" if system.startswith("llama-") else httpx.get(url + "/v1/models").json()["data"][0]["id"]


def start(system: str, args: argparse.Namespace, model: Path, tmp: Path, ctx: int | None = None) -> ChildServer:
    """``system``: ``lmspd-pN`` or ``llama-N`` (N sequences / slots);
    ``lmspd-pN@REF``: the code of git ref REF (``git_tree``)."""
    ctx = args.ctx if ctx is None else ctx
    if system.startswith("lmspd"):
        name, _, ref = system.partition("@")
        parallel = name.removeprefix("lmspd-p")
        tag = system.replace("@", "-at-").replace("/", "-")
        source = git_tree(ref, tmp / f"{tag}-src") if ref else None
        return lmspd_server(model if args.model else None, ctx, args.threads, tmp / f"{tag}-data",
                            tmp / f"{tag}.log", log_level="warning", source=source,
                            extra=["--parallel", parallel, "--kv-disk-space-mb", "0", "--max-queue", "64",
                                   # The same work as a server without a guard (scenario 3).
                                   "--repetition-window", "0", *lmspd_gpu_flags(args)]).start()
    slots = int(system.removeprefix("llama-"))
    return xllamacpp_server(model, ctx, args.threads, N_BATCH, tmp / f"{system}.log", parallel=slots).start()


def chat(client: httpx.Client, url: str, model: str, messages: list[dict], max_tokens: int, system: str,
         rnd: int) -> Sample:
    body = {"model": model, "messages": messages, "stream": True, "temperature": 0, "max_tokens": max_tokens,
            "stream_options": {"include_usage": True}}
    return stream_chat_completions(client, url + "/v1/chat/completions", body, Sample(system, rnd))


def prefilled(s: Sample) -> int | None:
    if s.input_tokens is None:
        return None
    cached = s.cached_tokens if s.cached_tokens is not None else s.extra.get("server_cache_n")
    return s.input_tokens - (cached or 0)


# -- scenarios ---------------------------------------------------------------------------


def agents(url: str, model: str, system: str, args: argparse.Namespace, shared: bool) -> dict[str, Any]:
    samples: list[list[Sample]] = [[] for _ in range(4)]
    errors: list[BaseException] = []

    def session(i: int) -> None:
        try:
            nonce = f"{i}-{os.getpid()}"
            task = f"Task {nonce}: fix the failing test in module_{i}.py and explain the fix."
            messages = [{"role": "system", "content": dev_prompt(args.dev_tokens, None if shared else nonce)},
                        {"role": "user", "content": task}]
            with httpx.Client(timeout=600) as client:
                for turn in range(args.turns):
                    sent = time.perf_counter()
                    s = chat(client, url, model, messages, args.reply_tokens, system, turn)
                    s.extra["sent"] = sent
                    samples[i].append(s)
                    messages = messages + [{"role": "assistant", "content": s.text},
                                           {"role": "user", "content": tool_result(args.tool_tokens, i, turn)}]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=session, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    every = [s for ss in samples for s in ss]
    later = [s for s in every if s.round >= 1]
    ttfts = sorted(s.ttft_ms for s in later if s.ttft_ms is not None)
    return {
        # How synchronized the sessions run: for each turn 2+, how many other
        # requests were also waiting for their first token when it was sent.
        # Sessions that start together (scenario 2 waits for the shared
        # prefix once) keep arriving together, and each then queues behind
        # the others' prefill: a higher TTFT for the same work.
        "waiting_with": statistics.fmean(_waiting_with(s, every) for s in later) if later else None,
        "agg_tps": sum(s.output_tokens or 0 for s in every) / wall,
        "ttft_mean": statistics.fmean(ttfts) if ttfts else None,
        "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else None,
        "prefill_turn1": statistics.fmean(prefilled(s) or 0 for s in every if s.round == 0),
        "prefill_later": statistics.fmean(prefilled(s) or 0 for s in later) if later else None,
        "prefill_total": sum(prefilled(s) or 0 for s in every),
        "wall_s": wall,
    }


def _waiting_with(s: Sample, every: list[Sample]) -> int:
    t = s.extra["sent"]
    return sum(1 for o in every if o is not s and o.ttft_ms is not None
               and o.extra["sent"] <= t < o.extra["sent"] + o.ttft_ms / 1000)


LONG_PROMPTS = ["Write a very long story about a dragon and a knight.", "Write a long essay about the history of ships.",
                "Describe, in great detail, a journey across a desert.", "Write a long poem about the northern sea."]


# Scenario 6's 16 prompts: four kinds of long writing on four subjects each.
LONG_PROMPTS_16 = [f"{kind} {subject}." for kind in ("Write a very long story about", "Write a long essay about",
                                                      "Describe, in great detail,", "Write a long poem about")
                   for subject in ("a dragon and a knight", "the history of ships", "a journey across a desert",
                                   "the northern sea")]


def decode(url: str, model: str, system: str, args: argparse.Namespace, *, streams: int = 4,
           tokens: int | None = None, pid: int | None = None) -> dict[str, Any]:
    """``streams`` requests of ``tokens`` output at once, each its own client
    (and connection), all sent together. ``pid``: the server's process,
    whose CPU time over the round is reported."""
    tokens = args.decode_tokens if tokens is None else tokens
    prompts = LONG_PROMPTS if streams <= len(LONG_PROMPTS) else LONG_PROMPTS_16
    assert streams <= len(prompts)
    out: list[Sample] = [None] * streams  # type: ignore[list-item]
    sent = [0.0] * streams
    # Scenario 6's streams leave together (each client built first); scenario 3 as it always ran.
    go = threading.Barrier(streams) if streams > 4 else None

    def one(i: int) -> None:
        with httpx.Client(timeout=600) as client:
            if go is not None:
                go.wait()
            sent[i] = time.perf_counter()
            out[i] = chat(client, url, model, [{"role": "user", "content": prompts[i]}], tokens, system, i)

    cpu0 = sched_ns(pid) if pid else None
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu1 = sched_ns(pid) if pid else None
    per_stream = [s.output_tokens or 0 for s in out]
    # Each stream's own rate: its tokens after the first over its decode span.
    rates = [(s.output_tokens - 1) / (s.last_delta - s.first_delta) for s in out
             if s.output_tokens and s.output_tokens > 1 and s.first_delta is not None and s.last_delta is not None
             and s.last_delta > s.first_delta]
    ttfts = [s.ttft_ms for s in out if s.ttft_ms is not None]
    # The decode phase, all streams together: every token after a stream's
    # first, from the first stream's first token to the last stream's last.
    firsts = [sent[i] + s.first_delta for i, s in enumerate(out) if s.first_delta is not None]
    lasts = [sent[i] + s.last_delta for i, s in enumerate(out) if s.last_delta is not None]
    span = max(lasts) - min(firsts) if firsts and lasts else 0.0
    result = {"agg_tps": sum(per_stream) / wall,
              "decode_tps": sum(max(0, n - 1) for n in per_stream) / span if span > 0 else None,
              "ttft_mean": statistics.fmean(ttfts) if ttfts else None,
              "ttft_max": max(ttfts) if ttfts else None,
              "ttfts": [round(t, 1) for t in ttfts],
              "tokens": sum(per_stream), "per_stream": per_stream, "full": all(n == tokens for n in per_stream),
              "stream_tps_mean": statistics.fmean(rates) if rates else None, "wall_s": wall}
    if cpu0 and cpu1:
        result["cpu_s"] = (cpu1[0] - cpu0[0]) / 1e9
        result["cpu_wait_s"] = (cpu1[1] - cpu0[1]) / 1e9
    return result


# -- scenario 6: 16 streams ----------------------------------------------------------------


def host_histogram(url: str) -> dict[str, Any]:
    """lmspd's ``lmspd_step_host_seconds`` from ``/metrics`` (cumulative
    buckets by upper bound in seconds, sum, count), and ``/health``'s mean
    host ms per step by number of decoding sequences."""
    text = httpx.get(url + "/metrics", timeout=30).text
    buckets: dict[float, float] = {}
    total = count = 0.0
    for line in text.splitlines():
        if not line.startswith("lmspd_step_host_seconds"):
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith("lmspd_step_host_seconds_bucket"):
            le = name.split('le="', 1)[1].split('"', 1)[0]
            buckets[float("inf") if le == "+Inf" else float(le)] = float(value)
        elif name.startswith("lmspd_step_host_seconds_sum"):
            total = float(value)
        elif name.startswith("lmspd_step_host_seconds_count"):
            count = float(value)
    by_sequences: dict[str, float] = {}
    try:
        models = httpx.get(url + "/health", timeout=30).json().get("models") or {}
        for stats in models.values():
            by_sequences = (stats.get("step_host_seconds") or {}).get("mean_ms_by_sequences") or {}
    except (httpx.HTTPError, ValueError):
        pass
    return {"buckets": buckets, "sum_s": total, "count": count, "mean_ms_by_sequences": by_sequences}


def histogram_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The steps observed between two ``host_histogram`` reads: count, mean
    ms, and p50/p90 ms interpolated linearly inside their bucket."""
    count = after["count"] - before["count"]
    bounds = sorted(after["buckets"])
    cum = [after["buckets"][b] - before["buckets"].get(b, 0.0) for b in bounds]

    def quantile(q: float) -> float | None:
        if count <= 0:
            return None
        rank = q * count
        lo_bound, lo_cum = 0.0, 0.0
        for bound, c in zip(bounds, cum, strict=True):
            if c >= rank:
                if bound == float("inf"):
                    return lo_bound * 1000  # beyond the last bucket: its bound, a floor
                return (lo_bound + (bound - lo_bound) * (rank - lo_cum) / max(c - lo_cum, 1e-9)) * 1000
            lo_bound, lo_cum = bound, c
        return None

    return {"steps": int(count), "mean_ms": (after["sum_s"] - before["sum_s"]) / count * 1000 if count > 0 else None,
            "p50_ms": quantile(0.5), "p90_ms": quantile(0.9),
            "mean_ms_at_16_lifetime": after["mean_ms_by_sequences"].get("16"),
            "mean_ms_by_sequences_lifetime": after["mean_ms_by_sequences"]}


def decode16(servers: dict[str, tuple[str, str, int | None]], args: argparse.Namespace) -> dict[str, Any]:
    """``servers``: system -> (url, model name, pid), ``lmspd-p16`` and
    ``llama-16`` (and ``lmspd-p16@REF`` with ``--baseline``)."""
    n, tokens = 16, args.decode16_tokens
    order = list(servers)
    rounds: dict[str, list[dict[str, Any]]] = {system: [] for system in servers}
    for system, (url, name, pid) in servers.items():
        w = decode(url, name, system, args, streams=n, tokens=tokens, pid=pid)  # warm-up
        print(f"[decode16] warm-up {system}: {json.dumps(w)}", file=sys.stderr, flush=True)
    lmspd_url = servers["lmspd-p16"][0]
    before = host_histogram(lmspd_url)
    for i in range(args.decode16_rounds):
        for system in order if i % 2 == 0 else order[::-1]:
            url, name, pid = servers[system]
            r = decode(url, name, system, args, streams=n, tokens=tokens, pid=pid)
            r["load"] = os.getloadavg()[0]
            rounds[system].append(r)
            print(f"[decode16] round {i + 1} {system}: {json.dumps(r)}", file=sys.stderr, flush=True)
    host = histogram_between(before, host_histogram(lmspd_url))
    mine, base = rounds["lmspd-p16"], rounds["llama-16"]

    def paired(key: str, mine: list[dict[str, Any]] = mine,
               base: list[dict[str, Any]] = base) -> list[float]:
        # Like with like only: a round where a stream was cut short did less work.
        return [a[key] / b[key] for a, b in zip(mine, base, strict=True)
                if a["full"] and b["full"] and a.get(key) and b.get(key)]

    ratios = paired("agg_tps")
    decode_ratios = paired("decode_tps")
    out: dict[str, Any] = {"rounds": rounds, "ratios": ratios, "decode_ratios": decode_ratios,
           "median_ratio": statistics.median(ratios) if ratios else None,
           "median_decode_ratio": statistics.median(decode_ratios) if decode_ratios else None,
           "host": host}
    baseline = next((system for system in servers if "@" in system), None)
    if baseline is not None:
        out["baseline"] = baseline
        out["baseline_ratios"] = paired("agg_tps", rounds[baseline], base)
        out["vs_baseline_ratios"] = paired("agg_tps", mine, rounds[baseline])
    return out


def decode_paired(servers: dict[str, tuple[str, str]], args: argparse.Namespace) -> dict[str, Any]:
    """``servers``: system -> (url, model name), ``lmspd-p4`` and ``llama-4``."""
    rounds: dict[str, list[float]] = {system: [] for system in servers}
    order = list(servers)
    for system, (url, name) in servers.items():
        decode(url, name, system, args)  # warm-up
    for i in range(args.decode_rounds):
        for system in order if i % 2 == 0 else order[::-1]:
            url, name = servers[system]
            r = decode(url, name, system, args)
            # Like with like only: a stream cut short did less work.
            rounds[system].append(r["agg_tps"] if r["full"] else float("nan"))
    mine, base = rounds["lmspd-p4"], rounds["llama-4"]
    ratios = [a / b for a, b in zip(mine, base, strict=True) if a == a and b == b]
    return {"rounds": rounds, "ratios": ratios, "median_ratio": statistics.median(ratios) if ratios else None}


def short(url: str, model: str, system: str, args: argparse.Namespace) -> dict[str, Any]:
    msgs = [{"role": "user", "content": "Name one colour."}]
    with httpx.Client(timeout=600) as client:
        alone = statistics.median(chat(client, url, model, msgs, 8, system, 0).ttft_ms or 0 for _ in range(3))
        long_done = threading.Event()
        started = threading.Event()
        result: dict[str, Any] = {}

        def long() -> None:
            with httpx.Client(timeout=600) as c:
                body = {"model": model, "messages": [{"role": "user", "content": LONG_PROMPTS[0]}], "stream": True,
                        "temperature": 0, "max_tokens": args.decode_tokens}
                with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if '"content"' in line and not started.is_set():
                            started.set()
                result["long_end"] = time.perf_counter()
            long_done.set()

        t = threading.Thread(target=long)
        t.start()
        started.wait(300)
        time.sleep(1.0)  # well into the long generation
        s = chat(client, url, model, msgs, 8, system, 1)
        short_end = time.perf_counter()
        t.join()
    return {"alone_ms": alone, "during_ms": s.ttft_ms, "ratio": (s.ttft_ms or 0) / alone if alone else None,
            "before_long_ended": short_end < result.get("long_end", 0)}


# -- report -------------------------------------------------------------------------------


def fmt(v: Any, f: str = "{:.1f}") -> str:
    return "—" if v is None else f.format(v)


def ratio(a: float | None, b: float | None) -> str:
    return "—" if not a or not b else f"{a / b:.2f}×"


def report(results: dict[str, dict[str, Any]], base: str = "llama-4") -> None:
    ran = {scen for r in results.values() for scen in r}
    for scen, title in (("agents", "1. four agent sessions"), ("shared", "2. four sessions, shared instructions")):
        if scen not in ran:
            continue
        print(f"\n### {title}\n")
        print("| system | aggregate tok/s | vs llama-4 | TTFT 2+ mean ms | p90 ms | vs llama-4 (mean) "
              "| waiting with (2+) | prefilled turn 1 | prefilled/turn 2+ | prefilled total |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        b = results.get(base, {}).get(scen, {})
        for system, r in results.items():
            x = r.get(scen)
            if not x:
                continue
            print(f"| {system} | {fmt(x['agg_tps'])} | {ratio(x['agg_tps'], b.get('agg_tps'))} "
                  f"| {fmt(x['ttft_mean'], '{:.0f}')} | {fmt(x['ttft_p90'], '{:.0f}')} "
                  f"| {ratio(x['ttft_mean'], b.get('ttft_mean'))} | {fmt(x.get('waiting_with'), '{:.2f}')} "
                  f"| {fmt(x['prefill_turn1'], '{:.0f}')} "
                  f"| {fmt(x['prefill_later'], '{:.0f}')} | {x['prefill_total']} |")
    if "decode" in ran:
        report_decode4(results, base)
    paired = results.get("paired", {}).get("decode-paired")
    if paired:
        print(f"\n### 3p. decode-heavy, paired: {len(paired['ratios'])} rounds taking turns, both servers up\n")
        print("| round | lmspd-p4 tok/s | llama-4 tok/s | ratio |")
        print("|---|---|---|---|")
        for i, (a, b) in enumerate(zip(paired["rounds"]["lmspd-p4"], paired["rounds"]["llama-4"], strict=True)):
            print(f"| {i + 1} | {fmt(a)} | {fmt(b)} | {ratio(a, b) if a == a and b == b else '—'} |")
        q = sorted(paired["ratios"])
        if q:
            print(f"\nmedian ratio {paired['median_ratio']:.3f} (min {q[0]:.3f}, max {q[-1]:.3f})")
    d16 = results.get("decode16", {}).get("decode16")
    if d16:
        report_decode16(d16)
    if "short" not in ran:
        return
    print("\n### 4. a short request during a long generation\n")
    print("| system | TTFT alone ms | TTFT during ms | during/alone | finished before the long one |")
    print("|---|---|---|---|---|")
    for system, r in results.items():
        x = r.get("short")
        if x:
            print(f"| {system} | {fmt(x['alone_ms'], '{:.0f}')} | {fmt(x['during_ms'], '{:.0f}')} "
                  f"| {fmt(x['ratio'], '{:.2f}×')} | {'yes' if x['before_long_ended'] else 'no'} |")


def report_decode4(results: dict[str, dict[str, Any]], base: str) -> None:
    print("\n### 3. decode-heavy: 4 streams\n")
    print("| system | output tokens per stream | aggregate decode tok/s | vs llama-4 | per-stream tok/s "
          "| vs llama-4 | TTFT mean ms | vs llama-4 |")
    print("|---|---|---|---|---|---|---|---|")
    b = results.get(base, {}).get("decode", {})
    # A ratio compares like with like only when both did the whole work.
    comparable = b.get("full", False)
    for system, r in results.items():
        x = r.get("decode")
        if x:
            same = comparable and x.get("full", False)
            cut = "" if x.get("full", False) else " (cut short)"
            print(f"| {system} | {'/'.join(map(str, x.get('per_stream', [])))}{cut} | {fmt(x['agg_tps'])} "
                  f"| {ratio(x['agg_tps'], b.get('agg_tps')) if same else '—'} "
                  f"| {fmt(x.get('stream_tps_mean'))} "
                  f"| {ratio(x.get('stream_tps_mean'), b.get('stream_tps_mean')) if same else '—'} "
                  f"| {fmt(x['ttft_mean'], '{:.0f}')} | {ratio(x['ttft_mean'], b.get('ttft_mean'))} |")


def report_decode16(d: dict[str, Any]) -> None:
    mine, base = d["rounds"]["lmspd-p16"], d["rounds"]["llama-16"]
    print(f"\n### 6. decode16: 16 streams at once, {len(mine)} rounds taking turns, both servers up\n")
    print("| round | load | lmspd-p16 tok/s | llama-16 tok/s | ratio | decode-phase tok/s lmspd / llama | ratio "
          "| TTFT mean ms lmspd / llama | TTFT max ms lmspd / llama | CPU s lmspd / llama | tokens per stream |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i, (a, b) in enumerate(zip(mine, base, strict=True)):
        same = a["full"] and b["full"]
        cut = "" if same else " (cut short)"
        counts = sorted(set(a["per_stream"]) | set(b["per_stream"]))
        print(f"| {i + 1} | {a.get('load', 0):.1f} | {fmt(a['agg_tps'])} | {fmt(b['agg_tps'])} "
              f"| {ratio(a['agg_tps'], b['agg_tps']) if same else '—'} "
              f"| {fmt(a['decode_tps'])} / {fmt(b['decode_tps'])} "
              f"| {ratio(a['decode_tps'], b['decode_tps']) if same else '—'} "
              f"| {fmt(a['ttft_mean'], '{:.0f}')} / {fmt(b['ttft_mean'], '{:.0f}')} "
              f"| {fmt(a['ttft_max'], '{:.0f}')} / {fmt(b['ttft_max'], '{:.0f}')} "
              f"| {fmt(a.get('cpu_s'))} / {fmt(b.get('cpu_s'))} | {'/'.join(map(str, counts))}{cut} |")

    def spread(xs: list[float]) -> str:
        q = sorted(xs)
        return f"median {statistics.median(q):.3f} (min {q[0]:.3f}, max {q[-1]:.3f})" if q else "—"

    print(f"\naggregate lmspd-p16 / llama-16, paired: {spread(d['ratios'])}  [target ≥ 1.0: "
          f"{'meets' if (d['median_ratio'] or 0) >= 1.0 else 'MISSES'}]")
    print(f"decode phase lmspd-p16 / llama-16, paired: {spread(d['decode_ratios'])}")
    baseline = d.get("baseline")
    if baseline:
        old = d["rounds"][baseline]
        print(f"\n{baseline}, the same rounds: tok/s "
              + ", ".join(f"{fmt(r['agg_tps'])}" for r in old) + "; TTFT mean / max ms "
              + ", ".join(f"{fmt(r['ttft_mean'], '{:.0f}')} / {fmt(r['ttft_max'], '{:.0f}')}" for r in old))
        print(f"aggregate {baseline} / llama-16, paired: {spread(d['baseline_ratios'])}")
        print(f"aggregate lmspd-p16 / {baseline}, paired: {spread(d['vs_baseline_ratios'])}")
    for system, rs in d["rounds"].items():
        tt = [t for r in rs for t in r["ttfts"]]
        if tt:
            q = sorted(tt)
            print(f"{system} per-stream TTFT over all rounds: median {statistics.median(q):.0f} ms, "
                  f"p90 {q[min(len(q) - 1, int(0.9 * len(q)))]:.0f} ms, max {q[-1]:.0f} ms")
    h = d["host"]
    by = h.get("mean_ms_by_sequences_lifetime") or {}
    print(f"lmspd host per step (lmspd_step_host_seconds over the measured rounds, {h['steps']} steps): "
          f"p50 {fmt(h['p50_ms'], '{:.3f}')} ms, p90 {fmt(h['p90_ms'], '{:.3f}')} ms, "
          f"mean {fmt(h['mean_ms'], '{:.3f}')} ms; at exactly 16 sequences (/health, the server's life): "
          f"mean {fmt(h['mean_ms_at_16_lifetime'], '{:.3f}')} ms  [target ≤ 1.5 ms]")
    if by:
        print("  mean host ms by decoding sequences (/health): "
              + ", ".join(f"{k}: {v}" for k, v in sorted(by.items(), key=lambda kv: int(kv[0]))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: the bundled SmolLM2-135M)")
    parser.add_argument("--ctx", type=int, default=4096, help="context window per sequence / slot")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--scenarios", default="agents,shared,decode,short,decode-paired")
    parser.add_argument("--decode-rounds", type=int, default=6, help="rounds of decode-paired (quick 3)")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--dev-tokens", type=int, default=1500)
    parser.add_argument("--tool-tokens", type=int, default=250)
    parser.add_argument("--reply-tokens", type=int, default=48)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--decode16-tokens", type=int, default=128, help="scenario 6: output tokens per stream")
    parser.add_argument("--decode16-rounds", type=int, default=4, help="scenario 6: measured rounds (quick 2)")
    parser.add_argument("--decode16-ctx", type=int, default=2048,
                        help="scenario 6: context per sequence / slot (16x this per server, both servers up)")
    parser.add_argument("--quick", action="store_true",
                        help="3 turns, a 600-token developer prompt, 120-token tool results, 128 decode tokens")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--baseline", default=None, metavar="REF",
                        help="decode16: also run this git ref's lmspd (lmspd-p16@REF), in the same rounds")
    add_gpu_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.turns, args.dev_tokens, args.tool_tokens, args.decode_tokens = 3, 600, 120, 128
        args.decode_rounds = 3
        args.decode16_rounds = 2
    model = args.model or bundled_model_path()
    # SIGTERM unwinds like Ctrl-C, so that the servers started here are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    scenarios = args.scenarios.split(",")
    results: dict[str, dict[str, Any]] = {}
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="lmspd-bench-conc-") as tmp_name:
        tmp = Path(tmp_name)
        for system in (args.systems.split(",") if set(scenarios) - {"decode-paired", "decode16"} else []):
            srv = start(system, args, model, tmp)
            try:
                name = served_name(system, srv.url)
                r: dict[str, Any] = {}
                for scen in (s for s in scenarios if s not in ("decode-paired", "decode16")):
                    print(f"[{system}] {scen} ...", file=sys.stderr, flush=True)
                    if scen in ("agents", "shared"):
                        r[scen] = agents(srv.url, name, system, args, shared=scen == "shared")
                    elif scen == "decode":
                        r[scen] = decode(srv.url, name, system, args)
                    elif scen == "short":
                        r[scen] = short(srv.url, name, system, args)
                    # As it comes: a long run cut short still reports what it measured.
                    print(f"[{system}] {scen}: {json.dumps(r[scen])}", file=sys.stderr, flush=True)
                results[system] = r
            finally:
                srv.stop()
        pair = ("lmspd-p4", "llama-4")
        if "decode-paired" in scenarios and set(pair) <= set(args.systems.split(",")):
            print("[paired] decode-paired ...", file=sys.stderr, flush=True)
            (tmp / "paired").mkdir()
            started = [start(system, args, model, tmp / "paired") for system in pair]
            try:
                servers = {system: (srv.url, served_name(system, srv.url)) for system, srv in zip(pair, started,
                                                                                                  strict=True)}
                results["paired"] = {"decode-paired": decode_paired(servers, args)}
                print(f"[paired] decode-paired: {json.dumps(results['paired'])}", file=sys.stderr, flush=True)
            finally:
                for srv in started:
                    srv.stop()
        if "decode16" in scenarios:
            print("[decode16] ...", file=sys.stderr, flush=True)
            (tmp / "decode16").mkdir()
            started = []
            systems16 = ["lmspd-p16", "llama-16"] + ([f"lmspd-p16@{args.baseline}"] if args.baseline else [])
            try:
                for system in systems16:
                    started.append(start(system, args, model, tmp / "decode16", ctx=args.decode16_ctx))
                servers16 = {system: (srv.url, served_name(system, srv.url), srv.pid)
                             for system, srv in zip(systems16, started, strict=True)}
                results["decode16"] = {"decode16": decode16(servers16, args)}
            finally:
                for srv in started:
                    srv.stop()
    print(f"\n## concurrency — {model.name}, ctx {args.ctx}/sequence, {args.threads} threads, {args.turns} turns, "
          f"dev {args.dev_tokens} / tool {args.tool_tokens} / reply {args.reply_tokens} tokens"
          f"{' (--quick)' if args.quick else ''}; load average at start {load[0]:.1f}")
    if "decode16" in scenarios:
        print(f"decode16: 16 streams x {args.decode16_tokens} tokens, ctx {args.decode16_ctx}/sequence, "
              f"{args.decode16_rounds} rounds, load average at its end {os.getloadavg()[0]:.1f}")
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
