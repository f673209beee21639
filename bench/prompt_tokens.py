#!/usr/bin/env python
"""Tokenizing prompts: llama.cpp's ``llama_tokenize`` against lmspd's
``FragmentTokenizer`` (``lmspd.engines.llama.fragments``), side by side.

An agent sends its whole conversation every turn (Chat Completions, and a
Responses client without ``previous_response_id``). The prompt is rendered
and tokenized each time; llama.cpp cuts it at every special token's text,
scanning it once per special token, and tokenizes every fragment between
them at a fixed cost per fragment. lmspd cuts it in one pass and keeps
each fragment's tokens. Three cases per turn of a synthetic agent session
(instructions, a tool list, a 6 KB file read by a tool call, then short
turns), in each bundled model's own turn format:

  llama.cpp     ``llama_tokenize`` of the whole prompt (special tokens on)
  cold          a ``FragmentTokenizer`` that keeps nothing: the one-pass cut alone
  warm          the tokenizer that tokenized the earlier turns' prompts

Every case is checked to give llama.cpp's tokens. Medians of ``--reps``.

    .venv/bin/python bench/prompt_tokens.py
    .venv/bin/python bench/prompt_tokens.py --turns 12 --reps 5
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FORMATS = {
    # model id: (turn start, turn end, roles)
    "smollm2-135m-instruct": ("<|im_start|>{role}\n", "<|im_end|>\n", {"model": "assistant", "tool": "tool"}),
    "gemma3-270m": ("<start_of_turn>{role}\n", "<end_of_turn>\n", {"model": "model", "tool": "user"}),
}


def session(turns: int) -> list[list[tuple[str, str]]]:
    """The messages of each turn's prompt: every prompt extends the last."""
    tools = [{"type": "function", "name": f"tool_{i}", "description": f"Does thing {i} to a file. " * 4,
              "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                              "line": {"type": "integer"}}}} for i in range(12)]
    source = "\n".join(f"def handler_{i}(request):\n    value = request.get('key_{i}', {i})\n"
                       f"    return {{'status': 'ok', 'value': value * {i}}}\n" for i in range(60))
    messages = [("system", "You are a coding agent. Work in small steps and explain each change.\n" * 20
                 + "# Tools\n" + json.dumps(tools, indent=2))]
    prompts = []
    for turn in range(turns):
        messages.append(("user", f"Step {turn}: look at app/handlers.py and fix handler_{turn}."))
        prompts.append(list(messages))
        messages.append(("model", json.dumps({"name": "tool_0", "arguments": {"path": "app/handlers.py"}})))
        messages.append(("tool", source if turn == 0 else f"ok: handler_{turn} updated"))
        messages.append(("model", f"I changed handler_{turn} so that it returns the value unchanged."))
    return prompts


def render(model: str, messages: list[tuple[str, str]]) -> str:
    start, end, roles = FORMATS[model]
    text = "".join(start.format(role=roles.get(role, role)) + content + end for role, content in messages)
    return text + start.format(role=roles["model"])


def timed(tokenize: Callable[[str], list[int]], text: str, reps: int) -> tuple[float, list[int]]:
    times: list[float] = []
    out: list[int] = []  # never returned empty: without reps the median raises first
    for _ in range(reps):
        t = time.perf_counter()
        out = tokenize(text)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--models", default=",".join(FORMATS))
    args = parser.parse_args()

    import llama_cpp

    from lmspd.engines.llama.client_text import llama_tokenize
    from lmspd.engines.llama.fragments import FragmentTokenizer
    from lmspd.engines.llama.models import resolve_model

    for model in args.models.split(","):
        try:
            path = resolve_model(model)[1]
        except Exception as exc:  # Gemma is assembled by ./dev.sh
            print(f"\n{model}: skipped ({exc})")
            continue
        llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        vocab = llm._model.vocab
        t = time.perf_counter()
        warm = FragmentTokenizer(vocab)
        built = (time.perf_counter() - t) * 1000
        cold = FragmentTokenizer(vocab, cache_bytes=0)  # keeps nothing
        print(f"\n## {model}: tokenizer built in {built:.0f} ms (fallback: {warm.fallback})\n")
        print("| turn | prompt bytes | tokens | llama.cpp ms | cold ms | warm ms | llama.cpp / cold | llama.cpp / warm |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for turn, messages in enumerate(session(args.turns)):
            text = render(model, messages)
            base_ms, want = timed(functools.partial(llama_tokenize, vocab), text, args.reps)
            cold_ms, uncached = timed(cold.tokenize, text, args.reps)
            # A new turn's prompt is tokenized once; time that first pass.
            warm_ms, got = timed(warm.tokenize, text, 1)
            assert uncached == want and got == want, f"{model} turn {turn}: tokens differ from llama.cpp's"
            print(f"| {turn} | {len(text.encode())} | {len(want)} | {base_ms:.2f} | {cold_ms:.2f} | {warm_ms:.2f} "
                  f"| {base_ms / max(cold_ms, 1e-3):.1f}× | {base_ms / max(warm_ms, 1e-3):.1f}× |")
        llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
