#!/usr/bin/env python
"""What constrained decoding costs: tokens/s with and without a grammar.

One ``LlamaEngine`` in this process (no HTTP), one model, one prompt, greedy
sampling, the continuation cache off (every run prefills the same prompt
cold; prefill is not part of the rate). Four modes share the exact same
rendered prompt (the tool is listed in all of them), so they differ only in
what the sampler is given:

  free   ``tool_choice: none``: no grammar (the unconstrained path);
  auto   ``tool_choice: auto``: the lazy tool-call grammar, idle until the
         model writes the call trigger (this model answers in text);
  json   ``text.format: json_schema``: a JSON-schema grammar on every token;
  tool   ``tool_choice: {type: function, name}``: the forced call grammar
         (parallel calls allowed, so a run holds up to 4 calls).

Rounds interleave the modes (the order rotates each round) so that drift in
the machine's load hits all of them alike. Reported per mode: median decode
tokens/s (output tokens over the time after prefill, grammar setup in
llama.cpp included) with its interquartile range, median prepare ms
(rendering, tokenizing, GBNF building and the compile check), and the ratio
to ``free`` paired per round (median and p25-p75): the numbers to quote.

    .venv/bin/python bench/constrained.py --quick    # about a minute
    .venv/bin/python bench/constrained.py            # 8 rounds of 96 tokens
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import bundled_model_path, summarize  # noqa: E402

from lmspd.core.limits import DEFAULT_LIMITS  # noqa: E402
from lmspd.dialects.openai_responses import decode_request  # noqa: E402
from lmspd.engines.base import CancelToken  # noqa: E402
from lmspd.engines.llama.engine import CacheSettings, LlamaEngine  # noqa: E402

PROMPT = "Write a detailed weather report for Paris, London and Rome: sky, temperature, wind and rain."
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "reports": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "sky": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow"]},
                    "temperature_c": {"type": "integer"},
                    "wind_kmh": {"type": "integer"},
                    "summary": {"type": "string"},
                },
                "required": ["city", "sky", "temperature_c", "wind_kmh", "summary"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["reports"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "report_weather", "description": "Record weather reports.", "strict": True,
        "parameters": WEATHER_SCHEMA}
MODES = ("free", "auto", "json", "tool")


def body(mode: str, max_tokens: int) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "bench", "input": PROMPT, "tools": [TOOL], "temperature": 0,
                         "max_output_tokens": max_tokens, "tool_choice": "none"}
    if mode == "auto":
        b["tool_choice"] = "auto"
    elif mode == "json":
        b["text"] = {"format": {"type": "json_schema", "name": "reports", "schema": WEATHER_SCHEMA, "strict": True}}
    elif mode == "tool":
        b["tool_choice"] = {"type": "function", "name": "report_weather"}
    return b


class Runner:
    def __init__(self, model: Path, threads: int, ctx: int) -> None:
        self.engine = LlamaEngine("bench", model, n_ctx=ctx, n_threads=threads, cache=CacheSettings(enabled=False))
        self.loop = asyncio.new_event_loop()

    def run(self, mode: str, max_tokens: int) -> dict[str, Any]:
        eng = self.engine
        t0 = time.perf_counter()
        req = decode_request(body(mode, max_tokens), DEFAULT_LIMITS.request)
        prepared = eng.prepare(req.conversation)
        t1 = time.perf_counter()

        async def collect() -> list[Any]:
            return [e async for e in eng.generate(prepared, CancelToken())]

        events = self.loop.run_until_complete(collect())
        t2 = time.perf_counter()
        stats = eng.stats_
        decode_s = (t2 - t1) - stats.last_prefill_ms / 1000
        tokens = stats.last_output_tokens
        last = events[-1]
        return {
            "mode": mode,
            "prompt": prepared.text,
            "prompt_tokens": len(prepared.tokens),
            "grammar_bytes": len(prepared.grammar or ""),
            "prepare_ms": (t1 - t0) * 1000,
            "prefill_ms": stats.last_prefill_ms,
            "decode_s": decode_s,
            "output_tokens": tokens,
            "tps": (tokens / decode_s) if decode_s > 0 and tokens else None,
            "end": getattr(last, "reason", None) or getattr(last, "code", None),
            "calls": sum(1 for e in events if type(e).__name__ == "ToolCallDone"),
            "text": eng.detokenize(eng.last_output_token_ids())[:120],
        }


def fmt(v: float | None, spec: str = "{:.1f}") -> str:
    return "-" if v is None else spec.format(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF (default: the bundled SmolLM2-135M)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1,
                    help="llama.cpp threads (1 is steadier on a shared 2-core machine)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 48 tokens")
    ap.add_argument("--json", type=Path, default=None, help="also write every sample here")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.max_tokens = 3, 48

    model = args.model or bundled_model_path()
    runner = Runner(model, args.threads, args.ctx)
    print(f"model {model.name}  threads {args.threads}  ctx {args.ctx}  max_output_tokens {args.max_tokens}  "
          f"rounds {args.rounds}  ({platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})")

    # Warm-up (page in the model, fill caches), and a check that the prompt is the same in every mode.
    prompts = {m: runner.run(m, 8)["prompt"] for m in MODES}
    assert len(set(prompts.values())) == 1, "the modes must share one prompt"

    samples: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
        for mode in order:
            s = runner.run(mode, args.max_tokens)
            s["round"] = r
            samples.append(s)
        print(f"  round {r + 1}/{args.rounds}: " + "  ".join(
            f"{s['mode']} {fmt(s['tps'])} tok/s ({s['output_tokens']} tok)" for s in samples[-len(MODES):]),
            flush=True)

    first = {m: next(s for s in samples if s["mode"] == m) for m in MODES}
    print(f"\nprompt: {first['free']['prompt_tokens']} tokens, identical in every mode")
    print(f"{'mode':<6}{'tok/s':>9}{'p25-p75':>15}{'out tok':>9}{'prepare ms':>12}{'grammar B':>11}"
          f"{'vs free (paired)':>20}{'p25-p75':>15}  ends / sample")
    by_round: dict[int, dict[str, dict]] = {}
    for s in samples:
        by_round.setdefault(s["round"], {})[s["mode"]] = s
    for mode in MODES:
        mine = [s for s in samples if s["mode"] == mode]
        tps = summarize([s["tps"] for s in mine])
        prep = summarize([s["prepare_ms"] for s in mine])
        toks = summarize([s["output_tokens"] for s in mine])
        ratios = summarize([rd[mode]["tps"] / rd["free"]["tps"] for rd in by_round.values()
                            if rd[mode]["tps"] and rd["free"]["tps"]])
        ends = sorted({f"{s['end']}" + (f", {s['calls']} calls" if s["calls"] else "") for s in mine})
        print(f"{mode:<6}{fmt(tps and tps.median):>9}{(tps.spread() if tps else '-'):>15}"
              f"{fmt(toks and toks.median, '{:.0f}'):>9}{fmt(prep and prep.median):>12}{first[mode]['grammar_bytes']:>11}"
              f"{fmt(ratios and ratios.median, '{:.2f}x'):>20}{(ratios.spread('{:.2f}') if ratios else '-'):>15}"
              f"  {'; '.join(ends)} / {first[mode]['text'][:60]!r}")
    if args.json:
        args.json.write_text(json.dumps(samples, indent=1))
        print(f"\nsamples written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
