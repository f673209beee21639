"""What ``truncation: auto`` costs next to one render of the whole prompt.

The engine's own preparation (the bundled model's template and tokenizer,
loaded vocab-only: no KV, no generation) prepares conversations of N
messages that do not fit the window, three ways in one run:

* ``count``: one render and tokenization of the whole conversation (what
  ``/v1/responses/input_tokens`` does): the floor;
* ``truncate``: ``Preparation.prepare`` with ``truncation: auto`` (the
  guided search of ``lmspd/engines/llama/truncation.py``);
* ``bisect``: the bisection it replaced (O(log n) renders of what is kept),
  reimplemented here over the same render and tokenizer for comparison.

    .venv/bin/python bench/truncation.py            # 300, 1000 and 3000 messages
    .venv/bin/python bench/truncation.py --messages 3000 --ctx 8192
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bundled_model_path  # noqa: E402


def preparation(ctx: int):
    import llama_cpp
    from llama_cpp import _internals as internals

    from lmspd.cache.manager import ContinuationCache, KvOps
    from lmspd.core.limits import DEFAULT_LIMITS
    from lmspd.engines.llama.preparation import Preparation
    from lmspd.engines.llama.reasoning import ReasoningSyntax
    from lmspd.engines.llama.template import ChatTemplate
    from lmspd.engines.llama.tool_formats import detect_tool_format
    from lmspd.engines.llama.vocab import Vocabulary

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = internals.LlamaModel(path_model=str(bundled_model_path()), params=params, verbose=False)
    vocab = Vocabulary(model)
    source = model.metadata()["tokenizer.chat_template"]
    template = ChatTemplate(source)
    ops = KvOps(capture=lambda s: b"", restore=lambda s, d: True, copy=lambda a, b, n: None,
                trim=lambda s, k: None, tokenize=vocab.tokenize, detokenize=vocab.detokenize, n_ctx=ctx)
    return Preparation(model_id="m", vocab=vocab, template=template, tool_format=detect_tool_format(source),
                       reasoning=ReasoningSyntax.detect(template), cache=ContinuationCache(ops), n_ctx=ctx,
                       limits=DEFAULT_LIMITS.request, sealer=None)


def conversation(messages: int):
    from lmspd.core.conversation import Conversation, Item, Message

    items: list[Item] = [Message("system", "You are terse.")]
    for i in range(messages // 2):
        items += [Message("user", f"Question {i}: what is the capital of country number {i}?"),
                  Message("assistant", f"Answer {i}: it is city number {i}.")]
    items.append(Message("user", "The last question."))
    return Conversation(model="m", items=items, max_output_tokens=64, truncate=True)


def bisect_truncate(prep, conv, budget: int) -> int:
    """The previous algorithm: the fewest oldest droppable items by bisection."""
    items = list(conv.items)
    droppable = [i for i, item in enumerate(items[:-1]) if getattr(item, "role", None) not in ("system", "developer")]

    def fits(k: int) -> bool:
        gone = set(droppable[:k])
        kept = dataclasses.replace(conv, items=[item for i, item in enumerate(items) if i not in gone])
        return len(prep.vocab.tokenize(prep.render(kept))) <= budget

    lo, hi, best = 1, len(droppable), len(droppable)
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, hi = mid, mid - 1
        else:
            lo = mid + 1
    return best


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, nargs="*", default=[300, 1000, 3000])
    parser.add_argument("--ctx", type=int, default=4096)
    args = parser.parse_args()
    prep = preparation(args.ctx)
    budget = args.ctx - 64
    print(f"bundled model, vocab only, --ctx {args.ctx}; seconds (best of 3)")
    print("| messages | body KB | count (1 render) | truncate | bisect | truncate / count | bisect / truncate |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in args.messages:
        conv = conversation(n)
        body_kb = len(json.dumps([{"role": getattr(i, "role", ""), "content": getattr(i, "text", "")}
                                  for i in conv.items])) / 1024

        def count(conv=conv) -> None:
            prep.vocab.tokenize(prep.render(conv))

        def truncate(conv=conv) -> None:
            prep.prepare(dataclasses.replace(conv, items=list(conv.items)))

        def bisect(conv=conv) -> None:
            whole = prep.render(conv)
            prep.vocab.tokenize(whole)  # the whole prompt first, as prepare does
            bisect_truncate(prep, conv, budget)

        truncate()  # the grammar compiler and caches, once
        c, t, b = (min(timed(fn) for _ in range(3)) for fn in (count, truncate, bisect))
        print(f"| {n} | {body_kb:.0f} | {c:.3f} | {t:.3f} | {b:.3f} | {t / c:.2f}x | {b / t:.2f}x |")


if __name__ == "__main__":
    main()
