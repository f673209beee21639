"""A Claude Code subagent pair against the real model, with the headers
Claude Code 2.1.332 sends (tests/fixtures/claude-code/captured: the main
agent sends ``x-claude-code-session-id`` only; a subagent adds
``x-claude-code-agent-id``): the child's first turn starts from its parent's
KV (the shared system prompt and tools reported as cached, copied from the
parent's sequence by lineage), the parent's next turn still continues its
own sequence, and the log names the lineage."""

from __future__ import annotations

import re
import time

import httpx

from support.server import MODEL

SESSION, CHILD = "5f0c2a9e-7d41-4c1b-9a55-3e8d2b6f1c07", "a9d3e1f0b2c4"
SYSTEM = ("You are a careful coding agent working in a repository. Read files before you change them, keep "
          "changes small, run the tests after each change, and report what you did in one or two sentences. ") * 2
TOOLS = [{"name": "Read", "description": "Read a file from the working directory.",
          "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                           "required": ["file_path"]}}]


def _turn(http: httpx.Client, headers: dict[str, str], messages: list[dict]) -> dict:
    r = http.post("/v1/messages", headers=headers, json={
        "model": MODEL, "max_tokens": 8, "temperature": 0, "system": SYSTEM, "tools": TOOLS, "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()


def _generation_lines(server, before: str, n: int) -> list[str]:
    """The first ``n`` generation log lines after ``before`` (a line may be
    printed just after its reply)."""
    deadline = time.monotonic() + 30
    while True:
        lines = [line for line in server.log()[len(before):].splitlines() if "generation response=" in line]
        if len(lines) >= n or time.monotonic() > deadline:
            assert len(lines) >= n, server.log()[-3000:]
            return lines[:n]
        time.sleep(0.05)


def test_a_subagent_starts_from_its_parents_kv_and_the_parent_continues(server, http):
    main = {"x-claude-code-session-id": SESSION}
    first = [{"role": "user", "content": "Which files define the parser?"}]
    before = server.log()
    parent = _turn(http, main, first)
    parent_seq = re.search(r"seq=(\d+) ", _generation_lines(server, before, 1)[0]).group(1)

    child = _turn(http, {**main, "x-claude-code-agent-id": CHILD},
                  [{"role": "user", "content": "Find every caller of parse() and list them."}])
    assert child["usage"]["cache_read_input_tokens"] >= 64, child["usage"]
    child_line = _generation_lines(server, before, 2)[1]
    assert re.search(rf"cache_source=copy from=seq{parent_seq} parent lineage={SESSION[:8]}>{CHILD[:8]} reused=",
                     child_line), child_line

    reply = "".join(b.get("text", "") for b in parent["content"] if b["type"] == "text") or "."
    again = _turn(http, main, [*first, {"role": "assistant", "content": reply},
                               {"role": "user", "content": "And the tests?"}])
    assert again["usage"]["cache_read_input_tokens"] >= parent["usage"]["input_tokens"], (parent, again)
    parent_again = _generation_lines(server, before, 3)[2]
    assert re.search(rf"seq={parent_seq} cache_source=(visible-prefix|memory-token|memory-text) ", parent_again), \
        parent_again
