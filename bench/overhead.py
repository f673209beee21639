#!/usr/bin/env python
"""What lmspd's HTTP/SSE layer costs on top of llama.cpp.

In one run, on the same GGUF, the same rendered prompt and the same settings
(greedy sampling, same max tokens, threads, context size and batch size),
this measures time to first token (TTFT) and decode tokens/s of:

  lmspd       ``lmspd serve`` in a child process, streaming ``POST /v1/responses``
              (SSE) over HTTP;
  in-process  llama-cpp-python called in this process:
              ``Llama.create_completion(prompt_text, stream=True)`` on the exact
              text lmspd renders (rendered by lmspd's own ``LlamaEngine.render``);
  xllamacpp   the prebuilt llama.cpp server from the PyPI package ``xllamacpp``
              in a child process, streaming its own ``/v1/responses``
              (``/v1/chat/completions`` if that misbehaves; the run says so);
  lmspd@REF   with ``--baseline REF``: ``lmspd serve`` running the code of a
              git ref (``git archive``), beside this checkout's, so that a
              change is measured before and after in the same rounds.

Noise control: every system is warmed up first, then the systems run
round-robin (the order rotates each round), so slow drift in the machine's
load hits all of them alike; each round sends all systems the same prompt,
whose system message starts with a fresh nonce, so no system can reuse more
than the few template tokens before it from its previous request. Reported
are medians with the interquartile range, and ratios computed per round
(paired) as well as from the medians. With ``--baseline`` the two lmspd
servers are started again the other way round half-way through the rounds:
on the 2-core machine the server started first measured 3-4 % slower decode
and ~50 ms more CPU per request with the same code on both sides
(bench/README.md); the run prints the paired comparison of each half.

    .venv/bin/python bench/overhead.py --quick     # about a minute
    .venv/bin/python bench/overhead.py             # the full run

Needs ``pip install xllamacpp`` for the third system (skipped with a note
if it is not installed, or with ``--systems lmspd,in-process``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    Sample,
    add_gpu_arguments,
    bundled_model_path,
    git_tree,
    llama_as_lmspd_loads,
    llama_gpu_kwargs,
    lmspd_gpu_flags,
    lmspd_server,
    paired,
    stream_chat_completions,
    stream_responses,
    summarize,
    with_cpu,
    xllamacpp_server,
)

LMSPD, INPROC, XLLAMA = "lmspd", "in-process", "xllamacpp"
ALL_SYSTEMS = (LMSPD, INPROC, XLLAMA)
# lmspd's engine logs one INFO line per generation ending in "prefill_ms=N".
PREFILL_LOG = re.compile(r"lmspd\.engine: generation\b.*?\bprefill_ms=([\d.]+)")
N_BATCH = 512  # lmspd's LlamaEngine default; used for all three

USER_PROMPT = (
    "Write a long, detailed story about a lighthouse keeper who finds an old map "
    "hidden inside the lighthouse wall. Describe the island, the weather and the "
    "journey in many paragraphs."
)


def system_prompt(nonce: str) -> str:
    # The nonce comes first, so the only prefix a cache can reuse between two
    # rounds is the template's own "<|im_start|>system\n" (+ "Session").
    return f"Session {nonce}. You are a helpful assistant who writes long, vivid stories."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short run: 3 rounds of 32 tokens, 1 warm-up")
    p.add_argument("--reps", type=int, default=None, help="measured rounds (default 10, quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up requests per system (default 2, quick 1)")
    p.add_argument("--max-tokens", type=int, default=None, help="max output tokens (default 128, quick 32)")
    p.add_argument("--threads", type=int, default=1,
                   help="llama.cpp threads for all systems (default 1: on a shared 2-core machine more "
                        "threads make OpenMP barriers stall whenever another process takes a core)")
    p.add_argument("--ctx", type=int, default=2048, help="context window for all systems (default 2048)")
    p.add_argument("--model", type=Path, default=None, help="a GGUF (default: the bundled SmolLM2-135M)")
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                   help=f"comma-separated subset of {', '.join(ALL_SYSTEMS)}")
    p.add_argument("--xllamacpp-endpoint", choices=["auto", "responses", "chat"], default="auto",
                   help="xllamacpp endpoint (auto: /v1/responses, falling back to chat completions)")
    p.add_argument("--gap", type=float, default=0.2, help="seconds of idle between requests (default 0.2)")
    p.add_argument("--seed", type=int, default=None, help="seed for the nonces (default: time)")
    p.add_argument("--json", type=Path, default=None, help="also write every sample and the summary here")
    p.add_argument("--baseline", default=None, metavar="REF",
                   help="also run lmspd at this git ref (system lmspd@REF), in the same rounds")
    add_gpu_arguments(p)
    args = p.parse_args(argv)
    args.reps = args.reps if args.reps is not None else (3 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.max_tokens = args.max_tokens if args.max_tokens is not None else (32 if args.quick else 128)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in ALL_SYSTEMS]
    if bad:
        p.error(f"unknown system(s) {bad}; choose from {ALL_SYSTEMS}")
    if args.reps < 1 or args.warmup < 0 or args.max_tokens < 2 or args.threads < 1:
        p.error("need --reps >= 1, --warmup >= 0, --max-tokens >= 2, --threads >= 1")
    return args


# -- the prompts, rendered by lmspd itself ---------------------------------------------


def responses_body(model_id: str, nonce: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model_id,
        "instructions": system_prompt(nonce),
        "input": USER_PROMPT,
        "stream": True,
        "temperature": 0,
        "max_output_tokens": max_tokens,
    }


def render_with_lmspd(model: Path, model_id: str, bodies: list[dict[str, Any]], ctx: int,
                      threads: int) -> list[tuple[str, list[int]]]:
    """The prompt text and tokens lmspd's own engine makes of each request body:
    decoded by lmspd's /v1/responses decoder, rendered by ``LlamaEngine.render``
    (the GGUF's chat template through jinja2) and tokenized by ``LlamaEngine``."""
    from lmspd.core.limits import DEFAULT_LIMITS
    from lmspd.dialects import openai_responses
    from lmspd.engines.llama.engine import LlamaEngine

    engine = LlamaEngine(model_id, model, n_ctx=ctx, n_threads=threads, n_batch=N_BATCH)
    try:
        out = []
        for body in bodies:
            conversation = openai_responses.decode_request(dict(body), DEFAULT_LIMITS.request).conversation
            text = engine.render(conversation)
            out.append((text, engine.tokenize(text)))
        return out
    finally:
        asyncio.run(engine.aclose())


# -- the three systems --------------------------------------------------------------------


class InProcess:
    """llama-cpp-python in this process, configured as lmspd's engine is."""

    def __init__(self, model: Path, ctx: int, threads: int, placement: dict[str, Any]) -> None:
        import llama_cpp

        self._llama_cpp = llama_cpp
        self.llm = llama_as_lmspd_loads(
            model, n_ctx=ctx, n_batch=N_BATCH, n_ubatch=N_BATCH,
            n_threads=threads, n_threads_batch=threads, verbose=False, **placement,
        )

    def tokens_as_create_completion_sees(self, text: str) -> list[int]:
        # create_completion tokenizes with add_bos=True, special=True.
        return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)

    def run(self, sample: Sample, prompt: str | list[int], prompt_tokens: list[int], max_tokens: int) -> Sample:
        llm = self.llm
        live = llm.input_ids[: llm.n_tokens].tolist()
        common = 0
        while common < min(len(live), len(prompt_tokens)) and live[common] == prompt_tokens[common]:
            common += 1
        sample.cached_tokens = min(common, len(prompt_tokens) - 1)  # what Llama.generate will keep
        sample.input_tokens = len(prompt_tokens)
        parts: list[str] = []
        finish = None
        ctx = llm._ctx.ctx
        self._llama_cpp.llama_perf_context_reset(ctx)
        clock = time.perf_counter
        t0 = clock()
        chunks = llm.create_completion(prompt, stream=True, temperature=0, max_tokens=max_tokens)
        assert not isinstance(chunks, dict)  # streamed: an iterator of chunks
        for chunk in chunks:
            now = clock() - t0
            choice = chunk["choices"][0]
            if choice["text"]:
                if sample.first_delta is None:
                    sample.first_delta = now
                sample.last_delta = now
                sample.deltas += 1
                parts.append(choice["text"])
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
        sample.terminal = clock() - t0
        perf = self._llama_cpp.llama_perf_context(ctx)
        # Batched prompt evaluation (a 1-token prompt would count as a decode step).
        sample.extra["prefill_ms"] = perf.t_p_eval_ms
        sample.text = "".join(parts)
        sample.status = finish
        if finish == "length":
            sample.output_tokens = max_tokens
        else:  # stopped at end of turn: count by re-tokenizing (approximate)
            sample.output_tokens = len(llm.tokenize(sample.text.encode("utf-8"), add_bos=False, special=False))
            sample.note = "tokens re-counted"
        return sample


def cache_opt_out_check(client: httpx.Client, url: str, model_id: str) -> dict[str, Any]:
    """Is ``extensions: {"lmspd.cache": {"reuse": false}}`` honoured? Send the
    same request twice with it; a non-zero cached_tokens the second time means no."""
    body = {"model": model_id, "input": "Say one word.", "max_output_tokens": 2, "temperature": 0,
            "extensions": {"lmspd.cache": {"reuse": False}}}
    results = []
    for _ in range(2):
        r = client.post(url + "/v1/responses", json=body)
        r.raise_for_status()
        usage = r.json()["usage"]
        results.append({"input_tokens": usage["input_tokens"],
                        "cached_tokens": usage["input_tokens_details"]["cached_tokens"]})
    return {"accepted": True, "second_request": results[1], "honoured": results[1]["cached_tokens"] == 0}


# -- reporting -----------------------------------------------------------------------------


def fmt(v: float | None, spec: str = "{:.1f}") -> str:
    return "–" if v is None else spec.format(v)


def cell(summary: Any, spec: str = "{:.1f}") -> str:
    """``median (p25–p75)``."""
    if summary is None:
        return "–"
    return f"{spec.format(summary.median)} ({spec.format(summary.p25)}–{spec.format(summary.p75)})"


def _in_order(names: set[str]) -> list[str]:
    """lmspd first, then a baseline lmspd@REF, then the others."""
    return sorted(names, key=lambda n: (ALL_SYSTEMS.index(n) if n in ALL_SYSTEMS else 0.5, n))


def _metric(samples: list[Sample], name: str, attr: str) -> Any:
    return summarize([getattr(s, attr) for s in samples if s.system == name])


def report(args: argparse.Namespace, samples: list[Sample], meta: dict[str, Any]) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 170), highlight=False)
    systems = _in_order({x.system for x in samples})
    base = next((s for s in systems if s.startswith(LMSPD + "@")), None)
    per: dict[str, dict[str, Any]] = {}
    table = Table(title=f"Per system: median (p25–p75) over {args.reps} rounds", title_justify="left")
    for col in ("system", "TTFT ms", "prefill ms", "TTFT−prefill ms", "decode tok/s", "last delta→end ms",
                "CPU ms/req", "CPU wait ms/req", "out/in/cached tok"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for name in systems:
        mine = [s for s in samples if s.system == name]
        stats = {attr: _metric(samples, name, attr)
                 for attr in ("ttft_ms", "prefill_ms", "ttft_minus_prefill_ms", "decode_tps", "tail_ms", "total_ms",
                              "cpu_ms", "wait_ms")}

        def values(attr: str, mine: list[Sample] = mine) -> str:
            return "/".join(map(str, sorted({getattr(s, attr) for s in mine if getattr(s, attr) is not None}))) or "?"

        label = name + (" (chat)" if name == XLLAMA and meta.get("xllamacpp_endpoint") == "chat" else "")
        table.add_row(label, cell(stats["ttft_ms"], "{:.0f}"), cell(stats["prefill_ms"], "{:.0f}"),
                      cell(stats["ttft_minus_prefill_ms"]),
                      cell(stats["decode_tps"]), cell(stats["tail_ms"]), cell(stats["cpu_ms"], "{:.0f}"),
                      cell(stats["wait_ms"], "{:.0f}"),
                      f"{values('output_tokens')} / {values('input_tokens')} / {values('cached_tokens')}")
        per[name] = {k: (v.__dict__ if v else None) for k, v in stats.items()}
    console.print(table)

    ratios: list[dict[str, Any]] = []
    rt = Table(title="Ratios and differences: from the medians, and paired per round as median (p25–p75)",
               title_justify="left")
    for col in ("comparison", "decode ratio", "decode ratio paired", "TTFT Δ ms", "TTFT Δ ms paired",
                "TTFT−prefill Δ ms paired", "per-token Δ µs", "CPU Δ ms/req paired"):
        rt.add_column(col, justify="left" if col == "comparison" else "right")
    lines = []
    pairs = [(LMSPD, INPROC), (LMSPD, XLLAMA), (XLLAMA, INPROC)]
    if base is not None:
        pairs[1:1] = [(base, INPROC), (LMSPD, base)]
    for a, b in pairs:
        if a not in per or b not in per or not per[a]["decode_tps"] or not per[b]["decode_tps"]:
            continue
        dec_med = per[a]["decode_tps"]["median"] / per[b]["decode_tps"]["median"]
        dec_pair = summarize(paired(samples, a, b, lambda x, y: (x.decode_tps / y.decode_tps)
                                    if x.decode_tps and y.decode_tps else None))
        ttft_med = per[a]["ttft_ms"]["median"] - per[b]["ttft_ms"]["median"]
        ttft_pair = summarize(paired(samples, a, b, lambda x, y: (x.ttft_ms - y.ttft_ms)
                                     if x.ttft_ms is not None and y.ttft_ms is not None else None))
        over_pair = summarize(paired(samples, a, b, lambda x, y: (x.ttft_minus_prefill_ms - y.ttft_minus_prefill_ms)
                                     if x.ttft_minus_prefill_ms is not None and y.ttft_minus_prefill_ms is not None
                                     else None))
        per_tok = (1 / per[a]["decode_tps"]["median"] - 1 / per[b]["decode_tps"]["median"]) * 1e6
        cpu_pair = summarize(paired(samples, a, b, lambda x, y: (x.cpu_ms - y.cpu_ms)
                                    if x.cpu_ms is not None and y.cpu_ms is not None else None))
        rt.add_row(f"{a} vs {b}", f"{dec_med:.3f}", cell(dec_pair, "{:.3f}"), f"{ttft_med:+.1f}",
                   cell(ttft_pair, "{:+.0f}"), cell(over_pair, "{:+.1f}"), f"{per_tok:+.0f}",
                   cell(cpu_pair, "{:+.0f}"))
        ratios.append({"a": a, "b": b, "decode_ratio_of_medians": dec_med,
                       "decode_ratio_paired": dec_pair and dec_pair.__dict__,
                       "ttft_delta_ms_of_medians": ttft_med, "ttft_delta_ms_paired": ttft_pair and ttft_pair.__dict__,
                       "ttft_minus_prefill_delta_ms_paired": over_pair and over_pair.__dict__,
                       "per_token_delta_us": per_tok, "cpu_delta_ms_paired": cpu_pair and cpu_pair.__dict__})
        if a.startswith(LMSPD) and dec_pair and ttft_pair:
            goal = b == INPROC

            def verdict(ok: bool) -> str:
                return "meets" if ok else "MISSES"

            lines.append(f"{a} decode / {b} decode = {dec_pair.median:.3f} paired ({dec_med:.3f} from medians)"
                         + (f"  [target ≥ 0.95: {verdict(dec_pair.median >= 0.95)}]" if goal else ""))
            lines.append(f"{a} TTFT − {b} TTFT = {ttft_pair.median:+.1f} ms paired ({ttft_med:+.1f} from medians)"
                         + (f"  [target ≤ 5 ms: {verdict(ttft_pair.median <= 5.0)}]" if goal else ""))
            if over_pair:
                lines.append(f"  the same without prompt evaluation (TTFT − prefill) = {over_pair.median:+.1f} ms "
                             f"paired (p25–p75 {over_pair.p25:+.1f}–{over_pair.p75:+.1f})"
                             + (f"  [target ≤ 5 ms: {verdict(over_pair.median <= 5.0)}]" if goal else ""))
            if cpu_pair:
                lines.append(f"  {a} uses {cpu_pair.median:+.1f} ms CPU per request more than {b} (paired)")
    if base is not None and LMSPD in per and meta.get("restart_at"):
        # The paired comparison of the two lmspd servers in each half: the
        # start-order effect is the difference between the halves.
        cut = meta["restart_at"]
        for label, keep in ((f"{LMSPD} started first", lambda r: r < cut),
                            (f"{base} started first", lambda r: r >= cut)):
            half = [s for s in samples if keep(s.round)]
            dec = summarize(paired(half, LMSPD, base, lambda x, y: (x.decode_tps / y.decode_tps)
                                   if x.decode_tps and y.decode_tps else None))
            cpu = summarize(paired(half, LMSPD, base, lambda x, y: (x.cpu_ms - y.cpu_ms)
                                   if x.cpu_ms is not None and y.cpu_ms is not None else None))
            if dec and cpu:
                lines.append(f"{label}: {LMSPD} decode / {base} decode = {dec.median:.3f} paired, "
                             f"CPU {cpu.median:+.1f} ms per request")
    if ratios:
        console.print(rt)
    for line in lines:
        console.print("  " + line, markup=False)

    # Sanity: the same prompt and the same greedy output everywhere?
    checks = []
    for a in [LMSPD, *([base] if base else []), XLLAMA]:
        if a in per and INPROC in per:
            same_in = paired(samples, a, INPROC, lambda x, y: float(x.input_tokens == y.input_tokens))
            same_text = paired(samples, a, INPROC, lambda x, y: float(x.text == y.text))
            checks.append(f"{a} vs in-process: same input token count in {int(sum(same_in))}/{len(same_in)} rounds, "
                          f"same output text in {int(sum(same_text))}/{len(same_text)}")
    for line in checks:
        console.print("  check: " + line, markup=False)
    for line in meta.get("notes", []):
        console.print("  note: " + line, markup=False)
    return {"per_system": per, "ratios": ratios, "headline": lines, "checks": checks}


class LmspdChild:
    """One ``lmspd serve`` the rounds call: this checkout's, or ``--baseline``'s
    (``source``), restartable so that two of them can be started either way round."""

    def __init__(self, name: str, source: Path | None, model: Path | None, model_id: str,
                 bodies: list[dict[str, Any]], args: argparse.Namespace, tmp: Path, client: httpx.Client) -> None:
        self.name, self._source, self._model, self._model_id = name, source, model, model_id
        self._bodies, self._args, self._tmp, self._client = bodies, args, tmp, client
        self._srv: Any = None

    @property
    def url(self) -> str:
        return self._srv.url

    @property
    def pid(self) -> int:
        return self._srv.pid

    def start(self, start: int) -> dict[str, Any]:
        """Start the server (``start``: which start this is, for its own data
        dir and log) and send it the cache opt-out check's two requests, which
        also leave every server's sequences used alike before the rounds."""
        tag = self.name.replace("@", "-at-").replace("/", "_")
        args = self._args
        self._srv = lmspd_server(self._model, args.ctx, args.threads, self._tmp / f"{tag}-data-{start}",
                                 self._tmp / f"{tag}-{start}.log", extra=lmspd_gpu_flags(args), source=self._source)
        self._srv.start()
        served = self._client.get(self.url + "/v1/models").json()["data"][0]["id"]
        assert served == self._model_id, (served, self._model_id)
        check = cache_opt_out_check(self._client, self.url, served)
        self._srv.new_log_text()  # skip what the start and the check logged
        return check

    def stop(self) -> None:
        if self._srv is not None:
            self._srv.stop()
            self._srv = None

    def run(self, r: int, i: int) -> Sample:
        srv = self._srv
        body = self._bodies[i]
        s = with_cpu(srv.pid, lambda: stream_responses(self._client, srv.url + "/v1/responses", body,
                                                       Sample(self.name, r)))
        # The engine logs each generation's prefill time (INFO, stderr).
        found = PREFILL_LOG.findall(srv.new_log_text())
        if found:
            s.extra["prefill_ms"] = float(found[-1])
        return s


def cache_opt_out_note(check: dict[str, Any]) -> str:
    if check["honoured"]:
        return ('lmspd honours extensions {"lmspd.cache": {"reuse": false}} (an identical second request reported 0 '
                "cached tokens); the measurement uses the nonce instead, so that every system reuses the same few "
                "template tokens")
    return ('lmspd accepts extensions {"lmspd.cache": {"reuse": false}} but does not honour it: an identical second '
            f"request still reported {check['second_request']['cached_tokens']} of "
            f"{check['second_request']['input_tokens']} input tokens cached; the nonce keeps prefix reuse equal instead")


# -- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = (args.model or bundled_model_path()).resolve()
    rng = random.Random(args.seed if args.seed is not None else time.time_ns())
    rounds = args.warmup + args.reps
    # One nonce per round (warm-ups first), the same for every system in that
    # round. Consecutive nonces differ in their first digit, so every request
    # can reuse exactly the same few template tokens ("<|im_start|>system\nSession ").
    nonces = [f"{i % 10}{rng.randrange(10**5):05d}" for i in range(rounds)]
    notes: list[str] = []
    meta: dict[str, Any] = {"notes": notes}

    if XLLAMA in args.systems:
        # Not imported here: it runs in a child, and its own ggml stays out of this process.
        try:
            meta["xllamacpp_version"] = importlib.metadata.version("xllamacpp")
        except importlib.metadata.PackageNotFoundError:
            notes.append("xllamacpp is not installed (pip install xllamacpp): skipped")
            args.systems.remove(XLLAMA)

    import llama_cpp

    from lmspd import __version__ as lmspd_version
    from lmspd.engines.llama.models import DEFAULT_MODEL_ID, served_id_for

    model_id = DEFAULT_MODEL_ID if args.model is None else served_id_for(model)
    print(f"model {model}\nthreads {args.threads}, ctx {args.ctx}, batch {N_BATCH}, max tokens {args.max_tokens}, "
          f"temperature 0, {args.warmup} warm-up + {args.reps} rounds, systems {', '.join(args.systems)}")
    print(f"lmspd {lmspd_version}, llama-cpp-python {llama_cpp.__version__}"
          + (f", xllamacpp {meta['xllamacpp_version']}" if "xllamacpp_version" in meta else "")
          + f", Python {platform.python_version()}", flush=True)

    bodies = [responses_body(model_id, n, args.max_tokens) for n in nonces]
    rendered = render_with_lmspd(model, model_id, bodies, args.ctx, args.threads)

    tmp = Path(tempfile.mkdtemp(prefix="lmspd-bench-"))
    servers = []
    lmspd_children: list[LmspdChild] = []
    samples: list[Sample] = []
    client = httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0))
    try:
        runners: dict[str, Callable[[int, int], Sample]] = {}
        if INPROC in args.systems:
            inproc = InProcess(model, args.ctx, args.threads, llama_gpu_kwargs(args))
            prompts: list[str | list[int]] = []
            mismatched = 0
            for text, tokens in rendered:
                if inproc.tokens_as_create_completion_sees(text) == tokens:
                    prompts.append(text)
                else:  # never seen with SmolLM2; keeps the comparison exact if a GGUF adds a BOS
                    mismatched += 1
                    prompts.append(tokens)
            if mismatched:
                notes.append(f"create_completion(text) tokenizes {mismatched} prompts differently from lmspd "
                             "(BOS?): the in-process run was given lmspd's token list instead")
            else:
                notes.append("in-process prompt: lmspd's rendered text; create_completion tokenizes it to "
                             f"exactly lmspd's tokens ({len(rendered[0][1])} tokens)")

            def run_inproc(r: int, i: int) -> Sample:
                return with_cpu(os.getpid(), lambda: inproc.run(Sample(INPROC, r), prompts[i], rendered[i][1],
                                                                  args.max_tokens))

            runners[INPROC] = run_inproc

        if LMSPD in args.systems:
            lmspd_children.append(LmspdChild(LMSPD, None, args.model and model, model_id, bodies, args, tmp, client))
        if args.baseline:
            lmspd_children.append(LmspdChild(f"{LMSPD}@{args.baseline}", git_tree(args.baseline, tmp / "base-src"),
                                             args.model and model, model_id, bodies, args, tmp, client))
        for child in lmspd_children:
            t = time.perf_counter()
            check = child.start(0)
            print(f"{child.name} ready at {child.url} in {time.perf_counter() - t:.1f}s (pid {child.pid})", flush=True)
            if child.name == LMSPD:
                meta["lmspd_cache_opt_out"] = check
                notes.append(cache_opt_out_note(check))
            runners[child.name] = child.run
        # Two lmspd servers: whichever starts first measures a few per cent
        # slower with the same code (bench/README.md), so half-way through
        # they are started again the other way round.
        restart_at = args.reps // 2 if len(lmspd_children) == 2 and args.reps >= 2 else None
        if restart_at is not None:
            meta["restart_at"] = restart_at
            notes.append(f"rounds 1-{restart_at}: {lmspd_children[0].name} started first; rounds "
                         f"{restart_at + 1}-{args.reps}: {lmspd_children[1].name} started first "
                         "(the start-order effect cancels in the paired medians)")

        if XLLAMA in args.systems:
            srv = xllamacpp_server(model, args.ctx, args.threads, N_BATCH, tmp / "xllamacpp.log")
            servers.append(srv)
            t = time.perf_counter()
            srv.start()
            print(f"xllamacpp ready at {srv.url} in {time.perf_counter() - t:.1f}s (pid {srv.pid})", flush=True)
            for line in srv.stdout_lines():
                if line.startswith("xllamacpp-system-info:"):
                    meta["xllamacpp_system_info"] = line.split(":", 1)[1].strip()
            x_model = client.get(srv.url + "/v1/models").json()["data"][0]["id"]
            x_url = srv.url
            x_pid = srv.pid

            def run_x_responses(r: int, i: int) -> Sample:
                body = {**bodies[i], "model": x_model}
                return with_cpu(x_pid, lambda: stream_responses(client, x_url + "/v1/responses", body,
                                                                Sample(XLLAMA, r)))

            def run_x_chat(r: int, i: int) -> Sample:
                b = bodies[i]
                body = {"model": x_model, "stream": True, "stream_options": {"include_usage": True},
                        "temperature": 0, "max_tokens": b["max_output_tokens"],
                        "messages": [{"role": "system", "content": b["instructions"]},
                                     {"role": "user", "content": b["input"]}]}
                return with_cpu(x_pid, lambda: stream_chat_completions(client, x_url + "/v1/chat/completions", body,
                                                                       Sample(XLLAMA, r)))

            endpoint = "chat" if args.xllamacpp_endpoint == "chat" else "responses"
            runners[XLLAMA] = run_x_chat if endpoint == "chat" else run_x_responses
            meta["xllamacpp_endpoint"] = endpoint

        order = _in_order(set(runners))
        print(f"warming up ({args.warmup} per system)...", flush=True)
        for w in range(args.warmup):
            for name in order:
                s = runners[name](-1 - w, w)
                if name == XLLAMA and args.xllamacpp_endpoint == "auto" and meta["xllamacpp_endpoint"] == "responses":
                    problem = None
                    if not s.deltas:
                        problem = "no response.output_text.delta events"
                    elif s.output_tokens is None:
                        problem = "no usage.output_tokens in the terminal event"
                    if problem:
                        notes.append(f"xllamacpp /v1/responses misbehaved ({problem}): fell back to "
                                     "/v1/chat/completions")
                        runners[XLLAMA] = run_x_chat
                        meta["xllamacpp_endpoint"] = "chat"
                time.sleep(args.gap)
        if XLLAMA in runners and meta.get("xllamacpp_endpoint") == "responses":
            notes.append("xllamacpp streamed through its own /v1/responses")

        print(f"measuring {args.reps} rounds, round-robin...", flush=True)
        for r in range(args.reps):
            i = args.warmup + r
            if r == restart_at:
                for child in lmspd_children:
                    child.stop()
                for child in reversed(lmspd_children):
                    child.start(1)
                for child in reversed(lmspd_children):
                    for w in range(args.warmup):
                        child.run(-1 - w, w)
                        time.sleep(args.gap)
                print(f"  started again, {lmspd_children[1].name} first", flush=True)
            rotated = order[r % len(order):] + order[: r % len(order)]
            cells = []
            for name in rotated:
                s = runners[name](r, i)
                samples.append(s)
                cells.append(f"{name} {fmt(s.ttft_ms)}ms {fmt(s.decode_tps)}tok/s")
                time.sleep(args.gap)
            print(f"  round {r + 1}/{args.reps}: " + " | ".join(cells), flush=True)
    finally:
        client.close()
        for child in lmspd_children:
            child.stop()
        for srv in servers:
            srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    x_info = meta.get("xllamacpp_system_info", "")
    here_info = llama_cpp.llama_print_system_info().decode(errors="replace")
    meta["llama_cpp_python_system_info"] = here_info.strip()
    if x_info and ("AVX512 = 1" in here_info) != ("AVX512 = 1" in x_info):
        notes.append("the CPU kernels differ: llama-cpp-python was built "
                     + ("with" if "AVX512 = 1" in here_info else "without") + " AVX-512, xllamacpp's wheel "
                     + ("with" if "AVX512 = 1" in x_info else "without")
                     + " it, so xllamacpp's decode rate differs in the kernels, not only in the server")
    summary = report(args, samples, meta)
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "meta": meta, "summary": summary, "samples": [s.row() for s in samples],
        }, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
