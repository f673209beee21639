"""Following task and background-response event streams in tests."""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import httpx

from .sse import Frame, parse_frames

# Prompts the bundled model answers in a few tokens at temperature 0, and one
# it never finishes within a small budget (for cancel and crash tests).
SHORT = "What is 2+2?"
LONG = "Write a very long story about a dragon and a knight."


def follow(client: httpx.Client, path: str, *, params: dict | None = None, headers: dict | None = None,
           stop_after: int | None = None) -> tuple[int, list[Frame], httpx.Headers]:
    """Read an SSE reply; with ``stop_after``, drop the connection after that
    many frames (the reader going away mid-stream)."""
    frames: list[Frame] = []
    with client.stream("GET", path, params=params, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [], r.headers
        for frame in parse_frames(r.iter_lines()):
            frames.append(frame)
            if stop_after is not None and len(frames) >= stop_after:
                break
        return r.status_code, frames, r.headers


def openai_events(frames: list[Frame]) -> list[dict[str, Any]]:
    """OpenAI stream frames as event dicts; checks the [DONE] trailer."""
    assert frames and frames[-1].data == "[DONE]", "an OpenAI stream ends with [DONE]"
    events = [json.loads(f.data) for f in frames[:-1]]
    for f, ev in zip(frames, events, strict=False):
        assert f.event == ev["type"], "the event: line must equal the JSON type"
    return events


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not reached in time")
