#!/usr/bin/env python
"""What constrained decoding costs, before and after llguidance, in one run.

Two worker processes each hold one ``LlamaEngine`` (no HTTP, same model,
same threads, continuation cache off: every run prefills the same prompt
cold; prefill is not part of the rate): ``new`` runs this checkout's
``lmspd``, ``old`` the code of ``--baseline`` (default: the parent of
the commit that began the move to llguidance), extracted with ``git archive`` into a
temporary directory. Five modes share one rendered prompt per side (the
tools are listed in all of them), so they differ only in what the sampler
is given:

  free   ``tool_choice: none``: no grammar (the unconstrained path);
  auto   ``tool_choice: auto``: the lazy tool-call grammar, idle until the
         model writes the call trigger (this model answers in text);
  json   ``text.format: json_schema``: a JSON-schema grammar on every token;
  tool   ``tool_choice: {type: function, name}``: the forced call grammar;
  lark   the forced call of a custom tool whose input follows Codex's
         apply_patch Lark grammar.

Every mode writes the same number of tokens (``--max-tokens``): the prompt
asks for prose that runs past it free (a prompt this model answers with
``<tool_response`` would stop ``free`` after 4 tokens, and its rate would be
that of a different, shorter generation), and the constrained outputs (JSON,
the forced calls, the patch) are longer too. A sample that ends early is
shown and left out of the ratios.

Rounds interleave the modes and the two sides (the order rotates each
round) so that drift in the machine's load hits all alike. Reported per
side and mode: median decode tokens/s (output tokens over the time after
prefill) and the ratio to the same side's ``free``, paired per round
(median and p25-p75); then the same ratio from CPU time (every thread's
CPU per output token, the prefill batches left out), which a shared,
loaded machine disturbs far less than wall time: the numbers to quote. Then fresh grammar compile
time: median ``prepare`` ms (render, tokenize, build and compile the
grammar; a grammar no cache has seen each time) for Codex's apply_patch
tool and a 50-property schema, minus the median ``prepare`` ms of ``free``;
for the new side also llguidance's own compile ms and how many matchers one
fresh prepare compiled (1: the check is the matcher's compile).

    .venv/bin/python bench/constrained.py --quick    # a few minutes
    .venv/bin/python bench/constrained.py            # 6 rounds of 96 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# Free (tool_choice none) greedy output of this prompt is prose past 96 tokens on both sides.
PROMPT = "Describe the weather in Paris, London and Rome today, city by city, in full sentences."
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
APPLY_PATCH = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
'''
TOOL = {"type": "function", "name": "report_weather", "description": "Record weather reports.", "strict": True,
        "parameters": WEATHER_SCHEMA}
PATCH_TOOL: dict[str, Any] = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
              "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH}}
MODES = ("free", "auto", "json", "tool", "lark")


def schema_50(salt: int) -> dict[str, Any]:
    props = {f"field_{i}": ({"type": "string", "maxLength": 40} if i % 3 == 0 else
                            {"type": "integer", "minimum": 0} if i % 3 == 1 else {"enum": ["a", "b", "c"]})
             for i in range(50)}
    return {"type": "object", "description": f"run {salt}", "properties": props, "required": list(props),
            "additionalProperties": False}


def body(mode: str, max_tokens: int, salt: int = 0) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "bench", "input": PROMPT, "tools": [TOOL, PATCH_TOOL], "temperature": 0,
                         "max_output_tokens": max_tokens, "tool_choice": "none"}
    if mode == "auto":
        b["tool_choice"] = "auto"
    elif mode == "json":
        b["text"] = {"format": {"type": "json_schema", "name": "reports", "schema": WEATHER_SCHEMA, "strict": True}}
    elif mode == "tool":
        b["tool_choice"] = {"type": "function", "name": "report_weather"}
    elif mode in ("lark", "compile_patch"):
        b["tool_choice"] = {"type": "custom", "name": "apply_patch"}
        if mode == "compile_patch":
            # A grammar no cache has seen: a comment line that differs per run.
            b["tools"] = [TOOL, {**PATCH_TOOL, "format": {**PATCH_TOOL["format"],
                                                          "definition": APPLY_PATCH + f"// run {salt}\n"}}]
    elif mode == "compile_schema":
        b["text"] = {"format": {"type": "json_schema", "name": "fifty", "schema": schema_50(salt), "strict": True}}
    return b


# --- the worker: one engine, one codebase ------------------------------------------


def worker(root: Path, threads: int, ctx: int) -> int:
    sys.path.insert(0, str(root))
    sys.path.insert(0, str(HERE))
    import asyncio

    import llama_cpp
    from llama_cpp import llama_cpp as bindings

    from _common import bundled_model_path
    from lmspd.core.limits import DEFAULT_LIMITS
    from lmspd.dialects.openai_responses import decode_request
    from lmspd.engines.base import CancelToken
    from lmspd.engines.llama.engine import CacheSettings, LlamaEngine

    # CPU time is what the sampler path costs, and on a shared machine it is
    # far steadier than wall time: count every thread's CPU over a
    # generation, less the process CPU spent inside the prefill batches'
    # decode calls (prefill may use more threads than decoding).
    prefill_cpu, decode_cpu = [0.0], [0.0]
    real_decode = bindings.llama_decode

    def timed_decode(ctx: Any, batch: Any) -> int:
        start = time.process_time()
        try:
            return real_decode(ctx, batch)
        finally:
            spent = time.process_time() - start
            if batch.n_tokens > 1:
                prefill_cpu[0] += spent
            else:
                decode_cpu[0] += spent

    # Both names: the package re-exports the binding, and code calls either.
    bindings.llama_decode = llama_cpp.llama_decode = timed_decode

    import lmspd
    assert Path(lmspd.__file__).resolve().is_relative_to(root.resolve()), lmspd.__file__
    engine = LlamaEngine("bench", bundled_model_path(), n_ctx=ctx, n_threads=threads,
                         cache=CacheSettings(enabled=False))
    loop = asyncio.new_event_loop()
    for line in sys.stdin:
        mode, max_tokens, salt = line.split()
        t0 = time.perf_counter()
        req = decode_request(body(mode, int(max_tokens), int(salt)), DEFAULT_LIMITS.request)
        compiler = getattr(getattr(engine, "preparation", None), "_grammar_compiler", None)
        compiles = compiler.compiles if compiler is not None else None
        prepared = engine.prepare(req.conversation)
        t1 = time.perf_counter()
        out: dict[str, Any] = {"prepare_ms": (t1 - t0) * 1000, "prompt": prepared.text}
        compiler = getattr(getattr(engine, "preparation", None), "_grammar_compiler", None)
        if compiler is not None and compiles is not None:  # this checkout: llguidance's own numbers
            out.update(matchers=compiler.compiles - compiles, compile_ms=compiler.last_compile_ms)
        if not mode.startswith("compile"):
            async def collect(prepared: Any = prepared) -> list[Any]:
                return [e async for e in engine.generate(prepared, CancelToken())]

            cpu0, prefill0, forward0 = time.process_time(), prefill_cpu[0], decode_cpu[0]
            events = loop.run_until_complete(collect())
            t2 = time.perf_counter()
            cpu = time.process_time() - cpu0 - (prefill_cpu[0] - prefill0)
            forward = decode_cpu[0] - forward0
            stats = engine.stats_
            decode_s = (t2 - t1) - stats.last_prefill_ms / 1000
            tokens = stats.last_output_tokens
            last = events[-1]
            out.update(decode_s=decode_s, output_tokens=tokens,
                       tps=(tokens / decode_s) if decode_s > 0 and tokens else None,
                       cpu_ms=(cpu * 1000 / tokens) if tokens else None,
                       # Everything but the forward passes: sampling, grammar, parsing, events.
                       host_ms=((cpu - forward) * 1000 / tokens) if tokens else None,
                       end=getattr(last, "reason", None) or getattr(last, "code", None),
                       calls=sum(1 for e in events if type(e).__name__ == "ToolCallDone"),
                       text=engine.detokenize(engine.last_output_token_ids())[:80])
        print(json.dumps(out), flush=True)
    return 0


class Side:
    def __init__(self, name: str, root: Path, threads: int, ctx: int) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(root), "--threads", str(threads),
             "--ctx", str(ctx)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(root))

    def run(self, mode: str, max_tokens: int, salt: int = 0) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(f"{mode} {max_tokens} {salt}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker died")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def baseline_ref() -> str:
    """The parent of the commit that started the llguidance work (it added
    the tool_formats package, the first file of the new layout)."""
    added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--",
                            "lmspd/engines/llama/tool_formats/__init__.py"], cwd=ROOT, capture_output=True,
                           text=True).stdout.split()
    return f"{added[-1]}^" if added else "HEAD"


def extract(ref: str, into: Path) -> Path:
    archive = subprocess.run(["git", "archive", "--format=tar", ref, "lmspd"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def median(values: Sequence[float | None]) -> float | None:
    xs = sorted(x for x in values if x is not None)
    return None if not xs else xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def quartiles(xs: list[float]) -> str:
    xs = sorted(x for x in xs if x is not None)
    if len(xs) < 2:
        return "-"
    import statistics

    q = statistics.quantiles(xs, n=4, method="inclusive")
    return f"{q[0]:.2f}-{q[2]:.2f}"


def fmt(v: float | None, spec: str = "{:.1f}") -> str:
    return "-" if v is None else spec.format(v)


def side(samples: list[dict[str, Any]], name: str, mode: str) -> list[dict[str, Any]]:
    return [s for s in samples if s["side"] == name and s["mode"] == mode]


def speed_ratios(samples: list[dict[str, Any]], name: str, mode: str, tokens: int,
                 speed: Callable[[dict[str, Any]], float | None]) -> list[float]:
    """Each round's speed of ``mode`` over free's on the same side, like with
    like only: rounds where both generations wrote all their tokens."""
    free = {s["round"]: s for s in side(samples, name, "free")}
    ratios = []
    for s in side(samples, name, mode):
        f = free.get(s["round"])
        if f is None or not s["output_tokens"] == f["output_tokens"] == tokens:
            continue
        mine, theirs = speed(s), speed(f)
        if mine and theirs:
            ratios.append(mine / theirs)
    return ratios


def report_decode(samples: list[dict[str, Any]], tokens: int) -> None:
    print(f"{'mode':<6}" + "".join(f"{s + ' tok/s':>13}{s + ' vs free':>13}{'p25-p75':>12}" for s in ("old", "new"))
          + "   tokens (old / new)")
    short = []
    for mode in MODES:
        row = f"{mode:<6}"
        lengths = []
        for name in ("old", "new"):
            mine = side(samples, name, mode)
            ratios = speed_ratios(samples, name, mode, tokens, lambda s: s["tps"])
            row += f"{fmt(median([s['tps'] for s in mine])):>13}{fmt(median(ratios), '{:.2f}x'):>13}{quartiles(ratios):>12}"
            lengths.append(",".join(sorted({str(s["output_tokens"]) for s in mine})))
            short += [f"{name} {mode}: {s['output_tokens']} tokens, {s['end']} ({s['text']!r})"
                      for s in mine if s["output_tokens"] != tokens]
        print(row + f"   {lengths[0]} / {lengths[1]}", flush=True)
    for line in short:
        print(f"  ended before {tokens} tokens (left out of the ratios): {line}", flush=True)
    print(f"{'':<6}" + "".join(f"{s + ' cpu ms/tok':>16}{s + ' vs free':>13}{'p25-p75':>12}" for s in ("old", "new"))
          + "   (all threads' CPU per output token, prefill batches left out;"
          " 'vs free' = free's CPU / this mode's: the same speed ratio, steadier than wall time)")
    for mode in MODES:
        row = f"{mode:<6}"
        for name in ("old", "new"):
            mine = side(samples, name, mode)
            ratios = speed_ratios(samples, name, mode, tokens,
                                  lambda s: 1 / s["cpu_ms"] if s.get("cpu_ms") else None)
            row += (f"{fmt(median([s.get('cpu_ms') for s in mine]), '{:.2f}'):>16}"
                    f"{fmt(median(ratios), '{:.3f}x'):>13}{quartiles(ratios):>12}")
        print(row, flush=True)
    # What the sampler path itself adds, free of the forward passes' noise:
    # each mode's CPU outside llama_decode per token, and the speed ratio it
    # implies against free at free's median forward-pass cost.
    print(f"{'':<6}" + "".join(f"{s + ' host ms/tok':>16}{s + ' implied':>13}" for s in ("old", "new"))
          + "   (CPU per output token outside llama_decode; implied = (fwd + free host) / (fwd + this host),"
          " fwd = free's median forward-pass CPU per token)")
    for mode in MODES:
        row = f"{mode:<6}"
        for name in ("old", "new"):
            host_ms = [s.get("host_ms") for s in side(samples, name, mode)]
            free = [s for s in side(samples, name, "free") if s.get("host_ms") is not None]
            host, free_host = median(host_ms), median([s["host_ms"] for s in free])
            fwd = median([s["cpu_ms"] - s["host_ms"] for s in free])
            implied = ((fwd + free_host) / (fwd + host)
                       if host is not None and free_host is not None and fwd is not None else None)
            row += f"{fmt(host, '{:.3f}'):>16}{fmt(implied, '{:.3f}x'):>13}"
        print(row, flush=True)


def report_compile(compile_ms: dict[tuple[str, str], list[float]], own: dict[str, list[dict[str, Any]]]) -> None:
    """Median and minimum: on a loaded machine a 3 ms compile that loses the
    CPU mid-way takes 15 ms, and the minimum shows what the work costs."""
    print(f"\n{'fresh grammar compile ms (prepare - free prepare)':<52}{'old med/min':>14}{'new med/min':>14}"
          f"{'new: llguidance':>17}{'matchers/prepare':>18}")
    for kind, label in (("compile_patch", "Codex apply_patch custom tool"), ("compile_schema", "50-property schema")):
        cells = []
        for name in ("old", "new"):
            mine, free = compile_ms[(name, kind)], compile_ms[(name, "free")]
            cells.append(f"{fmt((median(mine) or 0) - (median(free) or 0))}/{fmt(min(mine) - min(free))}")
        matchers = own.get(kind, [])
        llg = f"{fmt(median([s['compile_ms'] for s in matchers]))}/{fmt(min((s['compile_ms'] for s in matchers), default=None))}"
        count = ",".join(sorted({str(s["matchers"]) for s in matchers})) or "-"
        print(f"{label:<52}{cells[0]:>14}{cells[1]:>14}{llg:>17}{count:>18}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--baseline", default=None, help="git ref of the code to compare with")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--compiles", type=int, default=7, help="fresh grammars compiled per side and kind")
    ap.add_argument("--threads", type=int, default=1,
                    help="llama.cpp threads (1 is steadier on a shared 2-core machine)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 48 tokens, 5 compiles")
    ap.add_argument("--json", type=Path, default=None, help="also write every sample here")
    args = ap.parse_args()
    if args.worker is not None:
        return worker(args.worker, args.threads, args.ctx)
    if args.quick:
        args.rounds, args.max_tokens, args.compiles = 3, 48, 5

    ref = args.baseline or baseline_ref()
    tmp = tempfile.TemporaryDirectory(prefix="lmspd-bench-old-")
    old_root = extract(ref, Path(tmp.name))
    sides = [Side("old", old_root, args.threads, args.ctx), Side("new", ROOT, args.threads, args.ctx)]
    print(f"old = {ref}  new = this checkout  threads {args.threads}  max_output_tokens {args.max_tokens}  "
          f"rounds {args.rounds}  ({platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})")
    if args.max_tokens > 96:
        print("note: free decoding of this prompt is only known to run 96 tokens; rows that end early are left out")
    samples: list[dict[str, Any]] = []
    compile_ms: dict[tuple[str, str], list[float]] = {}
    own: dict[str, list[dict[str, Any]]] = {}
    try:
        for side in sides:  # warm-up: page the model in, build the tokenizer, check the prompt
            prompts = {m: side.run(m, 2)["prompt"] for m in MODES}
            assert len(set(prompts.values())) == 1, "the modes must share one prompt"
        for i in range(args.compiles):
            for side in sides:
                for kind in ("free", "compile_patch", "compile_schema"):
                    salt = 1000 + i if kind != "free" else 0
                    s = side.run(kind, 1, salt)
                    compile_ms.setdefault((side.name, kind), []).append(s["prepare_ms"])
                    if "matchers" in s and kind != "free":
                        own.setdefault(kind, []).append(s)
        report_compile(compile_ms, own)
        for r in range(args.rounds):
            order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
            for mode in order:
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    s = side.run(mode, args.max_tokens)
                    samples.append({**s, "side": side.name, "mode": mode, "round": r})
            # A table after every round: a run cut short still has numbers to quote.
            print(f"\nafter round {r + 1}/{args.rounds}:", flush=True)
            report_decode(samples, args.max_tokens)
    finally:
        for side in sides:
            side.close()
        tmp.cleanup()
    print(f"load average at the end {os.getloadavg()[0]:.1f}")

    if args.json:
        args.json.write_text(json.dumps({"samples": samples, "compile_ms": {f"{k[0]}:{k[1]}": v
                                                                          for k, v in compile_ms.items()}}, indent=1))
        print(f"\nsamples written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
