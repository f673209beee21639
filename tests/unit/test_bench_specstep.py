"""bench/specstep.py replays the scheduler's draft planning with stand-ins
for what it reads of a running sequence; a scheduler change that read one
more attribute (``Generation.left``) broke the bench, and nothing said so.
The replay runs here on a small stream of its own (no model)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "specstep.py"


def test_the_replay_drafts_a_copied_text_and_keeps_what_matches() -> None:
    spec = importlib.util.spec_from_file_location("specstep", BENCH)
    assert spec is not None and spec.loader is not None
    specstep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(specstep)
    text = [1000 + (i % 37) for i in range(200)]  # a passage the prompt holds, written out again
    streams = [{"prompt": [1, 2, 3] + text, "output": text}]
    per_step, trace = specstep._replay(streams, 1, "gpu", 40)
    assert per_step > 0
    assert trace and all(source == "ngram" for _, source, *_ in trace)
    assert sum(kept for *_, kept in trace) > 40  # a copy: most drafts kept
