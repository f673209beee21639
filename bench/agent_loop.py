"""A coding-agent session replayed as Codex replays it, against lmspd's
continuation cache and the llama.cpp servers it is compared with.

One run, one GGUF (the bundled SmolLM2-135M-Instruct Q4_1 unless ``--model``),
the same ``--threads`` and ``--ctx`` for every system:

* **The workload.** Every request carries the full history (stateless:
  ``store: false``, no ``previous_response_id``): a long developer prompt
  (``--dev-tokens``, a few thousand tokens), an environment-context message,
  the user's task, then one ``function_call`` and one ~``--tool-tokens``
  ``function_call_output`` per earlier turn. The ``shell`` tool is forced
  (``tool_choice: "required"``, ``parallel_tool_calls: false``); the call the
  system returns is replayed verbatim in the next request, followed by the
  tool output the bench scripts for that turn.
* **Two sessions interleaved** (A1 B1 A2 B2 …, the same developer prompt, a
  different task and different tool outputs) with **a restart** after turn
  ``--restart-after``: the server is stopped with SIGTERM and started again
  on the same ``--data-dir`` / ``--kv-disk-dir`` between B_R and A_{R+1}.
* **One single session** S with the same shape, run alone afterwards on the
  same lmspd server (cache checks: a new session after the restart).
* **The paired reference M** (``--no-paired``: none): session A's very
  requests, sent to a second lmspd server that serves nothing else, each
  M_k right before A_k (even k) or right after it (odd k). A_k and M_k
  evaluate the same prompt on the same KV (the table checks prompt,
  prefilled and output tokens), close together in time, so the median of
  A_k / M_k is what interleaving with B costs, with the machine's load
  drift paired out. (S's prompts differ from A's and B's by hundreds of
  tokens, and S runs minutes later: its ratio is printed too, unpaired.)
  Every lmspd turn also shows the KV it moved (/health's eviction, restore
  and copy counters): none on a turn of a session that stayed resident.

Systems:

``lmspd``
    ``python -m lmspd serve --port 0 --data-dir D --ctx C --threads T --kv-disk-dir K``,
    streaming ``/v1/responses``. Cache facts per request from ``GET /health``
    (``last_cache_source``, ``last_reused_tokens``, ``last_prefilled_tokens``,
    ``last_prefill_ms``) and the ``generation response=… cache_source=…`` log line.
``lmspd-nocache``
    the same with ``--no-prefix-cache``: the cold-prefill reference. Every request
    is a cold prefill there, so it is sent only the turns in ``--nocache-turns``
    (by default the first turn after the restart), with exactly the bodies lmspd
    was sent for those turns.
``xllamacpp-responses`` / ``xllamacpp-chat``
    llama.cpp's own server from the ``xllamacpp`` package (``bench/_common.py
    serve-xllamacpp``: one slot, its default RAM prompt cache), through its
    ``/v1/responses`` and its ``/v1/chat/completions``. Prefilled tokens come
    from its ``timings.prompt_n`` (``cache_n`` reused).
``llama-cpp-server``
    ``python -m llama_cpp.server --model M --n_ctx C --n_threads T --n_threads_batch T
    --cache True`` (its RAM state cache) through ``/v1/chat/completions``.
    Prefilled tokens come from its verbose log (``prompt eval … / N tokens``,
    ``N prefix-match hit``).

**Where a system does not return a function call** (the llama.cpp servers
ignore ``tools`` for this GGUF's template, and ``llama_cpp.server`` only forces
a call for a *named* ``tool_choice``), the bench synthesizes the assistant
turn: it appends the call lmspd made at the same turn (same name, arguments
and call id) and the same tool output. Those systems are asked for
``--reply-tokens`` tokens of whatever they generate; their TTFT is the first
text delta. The table marks those turns with ``*``.

The baselines (llama.cpp servers) run the interleaved sessions for
``--baseline-turns`` turns each, without the restart (their caches live in
RAM only, so their first turn after a restart is a cold prefill — what
``lmspd-nocache`` measures), then session A alone up to ``--turns``, then
A's follow-up (U) and its edit (E): the same requests lmspd got (the
assistant turns are lmspd's where the server made no call), so those rows
compare like with like. Time on the shared 2-core development machine is
the limit (prompt evaluation runs at ~50 tokens/s there).

**Metrics.** TTFT: request sent → first model output event (lmspd: the
``response.output_item.added`` of the forced ``function_call``, which lmspd
sends once the call's name is parsed; text systems: the first text delta).
``prefilled``: tokens the system evaluated for this prompt. ``expect``: the
tokens of what is new in the request — lmspd's own ``LlamaEngine`` (loaded in
this process) renders the new request and the previous turn's visible
transcript (``LlamaEngine.transcript.visible``: previous prompt + the call as
the client replays it, up to the end-of-turn token) and tokenizes the
difference, as lmspd does for a visible-prefix match. Whether the previous
turn's KV holds its end-of-turn token (Gemma ends a call with ``<eos>`` or
with ``<end_of_turn>``, and lmspd keeps only the latter) is read from the
next turn's reused count (``kv_holds_end``).

Targets: steady-state prefill == the new suffix; interleaved TTFT within
1.05× of the same request alone (A_k / M_k, median over turns; #11); first
turn after the restart ≥ 5× faster than ``lmspd-nocache`` on the same request.

    .venv/bin/python bench/agent_loop.py --quick            # ~3-5 min on the shared 2-core machine
    .venv/bin/python bench/agent_loop.py --json out.json    # the full run: ~23 min there (load ~10);
    # --baseline-turns 2 --dev-tokens 1600 trims it towards ~15 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    ChildServer,
    bundled_model_path,
    die_with_parent,
    lmspd_server,
    post_sse,
    sched_ns,
    xllamacpp_server,
)

MODEL_ID = "smollm2-135m-instruct"
ALL_SYSTEMS = ["lmspd", "lmspd-nocache", "xllamacpp-responses", "xllamacpp-chat", "xllamacpp-swa-full",
               "llama-cpp-server"]
N_BATCH = 512
# /health cache counters that mean KV moved between a sequence and RAM/disk:
# none should move on a turn whose session stayed resident.
MOVES = ("evictions", "checkpoints", "ram_restores", "disk_restores", "checkpoint_restores", "copies")
# A new connection per request: xllamacpp's server sometimes drops a kept-alive
# connection between two streams ("Server disconnected without sending a response").
FRESH = {"Connection": "close"}

SHELL_TOOL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command and returns its output.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {
            # Bounded so that a 135M model at temperature 0 cannot loop inside the call.
            "command": {"type": "array", "items": {"type": "string", "maxLength": 32}, "minItems": 1, "maxItems": 4,
                        "description": "The command to execute, as argv."},
            "workdir": {"type": "string", "description": "The working directory to execute the command in."},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
}

# Session A after its last turn: a follow-up user message (U), then the same
# request with that message edited (E, a branch).
BRANCH_TURNS = (("U", "Summarize what you found in one sentence."),
                ("E", "Summarize what you found in one short paragraph, in French."))

# When the bench has to invent a call (no call from the system and none from lmspd).
FALLBACK_COMMANDS = [
    ["rg", "-n", "def ", "src"], ["sed", "-n", "1,80p", "src/app/cli.py"], ["pytest", "-q", "tests"],
    ["git", "diff", "--stat"], ["ls", "-la", "src/app"], ["cat", "pyproject.toml"],
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 turns, a short developer prompt, short tool outputs")
    p.add_argument("--model", default=None,
                   help="a GGUF path or a bundled model id (default: the bundled SmolLM2-135M-Instruct; "
                        "gemma3-270m: Gemma 3 270M, sliding-window attention)")
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS), help=f"comma-separated subset of {ALL_SYSTEMS}")
    p.add_argument("--turns", type=int, default=None, help="turns per session (default 12, quick 4)")
    p.add_argument("--restart-after", type=int, default=None,
                   help="restart lmspd after this turn of the interleaved sessions (default turns/2)")
    p.add_argument("--baseline-turns", type=int, default=None,
                   help="interleaved turns the llama.cpp servers run (default 4, quick 3)")
    p.add_argument("--nocache-turns", default=None,
                   help="turns lmspd-nocache is sent, e.g. A7,B7 (default: A<restart+1>)")
    p.add_argument("--dev-tokens", type=int, default=None, help="developer prompt tokens (default 2400, quick 500)")
    p.add_argument("--tool-tokens", type=int, default=None, help="tokens per tool output (default 250, quick 100)")
    p.add_argument("--max-call-tokens", type=int, default=96, help="max_output_tokens of a forced call (default 96)")
    p.add_argument("--reply-tokens", type=int, default=8,
                   help="max tokens asked of systems that answer with text (default 8)")
    p.add_argument("--ctx", type=int, default=8192, help="context size for every system (default 8192)")
    p.add_argument("--threads", type=int, default=1, help="threads for every system (default 1)")
    p.add_argument("--seed", type=int, default=7, help="seed for the scripted tool outputs (default 7)")
    p.add_argument("--workdir", type=Path, default=None, help="keep data dirs and server logs here (default: a temp dir)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="send no warm-up request to the restarted lmspd nor to lmspd-nocache: the restart turn "
                        "and its cold reference both pay a fresh process's first-request costs")
    p.add_argument("--json", type=Path, default=None, help="also write every turn, the ratios and the notes here")
    p.add_argument("--no-paired", dest="paired", action="store_false",
                   help="no mirror of session A on a second lmspd server (the paired interleaving reference)")
    args = p.parse_args(argv)
    q = args.quick
    args.turns = args.turns or (4 if q else 12)
    args.restart_after = args.restart_after if args.restart_after is not None else args.turns // 2
    args.baseline_turns = args.baseline_turns if args.baseline_turns is not None else (3 if q else 4)
    args.baseline_turns = min(args.baseline_turns, args.turns)
    args.dev_tokens = args.dev_tokens or (500 if q else 2400)
    args.tool_tokens = args.tool_tokens or (100 if q else 250)
    if args.model is not None:
        global MODEL_ID
        from lmspd.engines.llama.models import ModelNotFound, resolve_model

        try:
            # lmspd serves a bundled id under that id, a path under its stem.
            args.model_name = args.model
            MODEL_ID, args.model = resolve_model(args.model)
        except ModelNotFound as exc:
            p.error(str(exc))
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in ALL_SYSTEMS]
    if bad:
        p.error(f"unknown system(s) {bad}; choose from {ALL_SYSTEMS}")
    if not 1 <= args.restart_after < args.turns:
        p.error("--restart-after must be between 1 and --turns - 1")
    if args.nocache_turns is None:
        args.nocache_turns = [f"A{args.restart_after + 1}"]
    else:
        args.nocache_turns = [t.strip() for t in args.nocache_turns.split(",") if t.strip()]
    for label in args.nocache_turns:
        if not re.fullmatch(r"[ABS]\d+", label) or not 1 <= int(label[1:]) <= args.turns:
            p.error(f"--nocache-turns: {label!r} is not a turn like A{args.turns}")
    return args


# -- lmspd's own renderer and tokenizer, in process -----------------------------------------


class Counter:
    """Token counts as lmspd makes them: its ``/v1/responses`` decoder, its
    ``LlamaEngine.render`` (the GGUF's chat template) and its tokenizer. The
    engine is loaded with a tiny context and no cache: it never generates."""

    def __init__(self, model: Path | None) -> None:
        from lmspd.core.limits import DEFAULT_LIMITS
        from lmspd.dialects import openai_responses
        from lmspd.engines.llama.engine import CacheSettings, LlamaEngine

        self._decode = lambda body: openai_responses.decode_request(dict(body), DEFAULT_LIMITS.request).conversation
        self.engine = LlamaEngine(MODEL_ID, model or bundled_model_path(), n_ctx=256, n_threads=1,
                                  n_batch=N_BATCH, cache=CacheSettings(enabled=False), grammars_at_start=False)
        llm = getattr(self.engine, "_model", None)  # the engine's llama model
        try:
            self.eog_text: str | None = self.engine.detokenize([llm.token_eos()]) if llm is not None else None
        except Exception:  # noqa: BLE001 - an internal; the token-difference fallback still works
            self.eog_text = None
        if self.eog_text is not None and not self.engine.transcript.turn_ends_with(self.eog_text):
            # Gemma's <eos> (the end a call's grammar admits) is not its turn
            # closer: lmspd keeps it out of the KV and the visible transcript.
            self.eog_text = None
        # The end token the template's turn closer starts with (Gemma's
        # <end_of_turn>, SmolLM2's <|im_end|>): a grammar admits every end
        # token, and where the model samples this one lmspd keeps it in the KV.
        closer = self.engine.transcript.closer or ""
        first = self.engine.tokenize(closer)[:1]
        self.closer_end: str | None = (self.engine.detokenize(first)
                                       if first and self.engine.vocab.is_eog(first[0]) else None)

    def count(self, text: str) -> int:
        return len(self.engine.tokenize(text))

    def trim(self, text: str, n_tokens: int) -> str:
        """The longest whole-line start of ``text`` within ``n_tokens`` tokens."""
        tokens = self.engine.tokenize(text)
        if len(tokens) <= n_tokens:
            return text
        cut = self.engine.detokenize(tokens[:n_tokens])
        at = cut.rfind("\n")
        return cut[:at] if at > len(cut) // 2 else cut

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        return len(self.engine.tokenize(self.engine.render(self._decode(body))))

    def new_suffix(self, prev_body: dict[str, Any], outputs: list[dict[str, Any]],
                   new_body: dict[str, Any], end_in_kv: bool | None = None) -> tuple[int | None, str]:
        """Tokens of what ``new_body`` adds to the previous turn's visible
        transcript (previous prompt + its output up to the end-of-turn token).
        ``end_in_kv``: whether the previous turn's KV holds the turn closer's
        end token (``kv_holds_end``); None: assume the model's EOS ended it."""
        engine = self.engine
        try:
            new_text = engine.render(self._decode(new_body))
            prev = self._decode(prev_body)
            after = self._decode({**prev_body, "input": list(prev_body["input"]) + outputs})
            outs = list(after.items[len(prev.items):])
            eog = self.eog_text if end_in_kv is None else self.closer_end if end_in_kv else None
            visible = engine.transcript.visible(prev, outs, eog)
            if visible is not None and new_text.startswith(visible):
                how = "visible" + (f", {eog} in KV" if eog and end_in_kv else "")
                return len(engine.tokenize(new_text[len(visible):])), how
            # Fallback: the token difference of the two renders.
            before = engine.render(after, add_generation_prompt=False)
            return len(engine.tokenize(new_text)) - len(engine.tokenize(before)), "token-diff"
        except Exception as exc:  # noqa: BLE001 - a count is a nice-to-have, never a crash
            return None, f"error: {type(exc).__name__}: {exc}"

    def close(self) -> None:
        asyncio.run(self.engine.aclose())


# -- the scripted workload ----------------------------------------------------------------------


DEV_HEAD = """You are a coding agent running in a terminal-based coding assistant. You are expected to be precise, safe, and helpful.

Your capabilities:

- Receive user prompts and other context provided by the harness, such as files in the workspace.
- Communicate with the user by streaming thinking and responses, and by making and updating plans.
- Emit function calls to run terminal commands and apply patches.

# How you work

## Personality

Your default personality and tone is concise, direct, and friendly. You communicate efficiently, always keeping the user clearly informed about ongoing actions without unnecessary detail. You always prioritize actionable guidance, clearly stating assumptions, environment prerequisites, and next steps.

## Using the shell tool

- Call `shell` with `command` as an argv array, for example ["rg", "-n", "pattern", "src"].
- Prefer `rg` over `grep` and `rg --files` over `find`: they are much faster.
- Read files in chunks of at most 250 lines with `sed -n 'START,ENDp' FILE`.
- Never run commands that need a network connection; the sandbox has none.
- Set `workdir` instead of chaining `cd` into the command.

# Repository rules (AGENTS.md)
"""

_AREAS = ["the CLI", "the HTTP routes", "the stream session", "the SQLite store", "the task manager",
          "the engine adapters", "the cache manager", "the disk checkpoints", "the dialect decoders",
          "the SSE encoder", "the configuration loader", "the credential store", "the test fixtures"]
_VERBS = ["keep", "document", "test", "log", "validate", "time out", "bound", "name", "type-annotate", "version"]
_THINGS = ["every public function", "each error path", "the request limits", "all file writes",
           "the retry budget", "the event order", "shutdown handling", "the byte budgets", "user-visible strings",
           "the wire format", "the cancellation points", "the schema migrations"]
_WHY = ["so that a crash loses nothing", "because clients replay it verbatim", "since the tests assert it",
        "to keep the diff reviewable", "because operators read these logs", "so that upgrades stay safe",
        "as the design document requires", "because the benchmarks depend on it"]


def developer_prompt(counter: Counter, n_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = [DEV_HEAD]
    i = 0
    while counter.count("\n".join(lines)) < n_tokens + 50:
        for _ in range(20):
            i += 1
            lines.append(f"- Rule {i}: in {rng.choice(_AREAS)}, {rng.choice(_VERBS)} {rng.choice(_THINGS)} "
                         f"{rng.choice(_WHY)}; when unsure, ask before changing {rng.choice(_THINGS)}.")
    return counter.trim("\n".join(lines), n_tokens)


SESSION_TASKS = {
    "A": "Add a `--verbose` flag to the `serve` command and thread it through to the logging setup. Run the tests.",
    "B": "Evicting KV checkpoints is slow when the directory holds many files. Find out why and fix it.",
    "S": "tests/test_history.py fails intermittently on CI. Find the cause and make the test reliable.",
}

_MODULES = ["cli", "server", "routes", "session", "store", "tasks", "engine", "cache", "disk", "history",
            "config", "limits", "events", "dialects", "sse", "auth"]
_FUNCS = ["load", "save", "evict", "render", "decode", "encode", "plan", "restore", "capture", "flush",
          "prune", "resolve", "validate", "stream", "close", "open", "scan", "match", "checkpoint", "retry"]


def _code_lines(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        f, g = rng.choice(_FUNCS), rng.choice(_FUNCS)
        kind = rng.randrange(5)
        if kind == 0:
            out.append(f"def {f}_{g}(self, path: Path, budget: int = {rng.randrange(1, 64) * 1024}) -> bool:")
        elif kind == 1:
            out.append(f"    if not self._{f}ed and len(self._{g}s) > {rng.randrange(2, 200)}:")
        elif kind == 2:
            out.append(f"        self._{g}s.append({f}_{g}(entry, limit={rng.randrange(1, 9)}))")
        elif kind == 3:
            out.append(f"    log.debug(\"{f} {g}: %s entries in %.1f ms\", len(items), elapsed)")
        else:
            out.append(f"    return sorted(self._{f}s, key=lambda e: e.{g}_at)[:{rng.randrange(1, 50)}]")
    return out


def tool_output(counter: Counter, session: str, turn: int, n_tokens: int, seed: int) -> str:
    """A scripted ~n_tokens command output, in Codex's exec-output framing."""
    rng = random.Random(f"{seed}:{session}:{turn}")
    kind = (turn + "ABS".index(session)) % 4
    mods = [rng.choice(_MODULES) for _ in range(40)]
    if kind == 0:
        body = [f"src/app/{m}.py:{rng.randrange(10, 900)}:{line.strip()}" for m, line in zip(mods, _code_lines(rng, 40), strict=True)]
    elif kind == 1:
        start = rng.randrange(1, 400)
        body = [f"{start + i:>5}\t{line}" for i, line in enumerate(_code_lines(rng, 60))]
    elif kind == 2:
        body = [f"tests/test_{m}.py {'.' * rng.randrange(3, 30)}{'F' if rng.random() < 0.2 else ''}"
                f"{'.' * rng.randrange(0, 10)}   [{rng.randrange(1, 100):>3}%]" for m in mods[:14]]
        body += ["", "=================================== FAILURES ===================================",
                 f"____________________ test_{rng.choice(_FUNCS)}_{rng.choice(_FUNCS)} ____________________"]
        body += _code_lines(rng, 16)
        body += [f"E       AssertionError: expected {rng.randrange(100)} entries, got {rng.randrange(100)}"]
    else:
        body = [f"-rw-r--r--  1 dev dev {rng.randrange(200, 90000):>6} Nov {rng.randrange(1, 29):>2} "
                f"{rng.randrange(0, 24):02d}:{rng.randrange(0, 60):02d} {m}.py" for m in mods]
    text = (f"Chunk ID: {rng.randrange(16**6):06x}\nWall time: {rng.random():.4f} seconds\nProcess exited with code "
            f"{rng.choice([0, 0, 0, 1])}\nOriginal token count: {rng.randrange(300, 2000)}\nOutput:\n" + "\n".join(body))
    return counter.trim(text, n_tokens) + "\n"


@dataclass
class Workload:
    dev: str
    tool_tokens: int
    seed: int
    counter: Counter
    max_call_tokens: int
    outputs: dict[tuple[str, int], str] = field(default_factory=dict)

    def start_items(self, session: str) -> list[dict[str, Any]]:
        env = ("<environment_context>\n  <cwd>/srv/work/app</cwd>\n  <shell>bash</shell>\n"
               f"  <current_date>2026-11-29</current_date>\n  <session>{session}</session>\n</environment_context>")
        return [
            {"type": "message", "id": f"msg_dev_{session}", "role": "developer",
             "content": [{"type": "input_text", "text": self.dev}]},
            {"type": "message", "id": f"msg_env_{session}", "role": "user",
             "content": [{"type": "input_text", "text": env}]},
            {"type": "message", "id": f"msg_task_{session}", "role": "user",
             "content": [{"type": "input_text", "text": SESSION_TASKS[session]}]},
        ]

    def tool_output(self, session: str, turn: int) -> str:
        key = (session, turn)
        if key not in self.outputs:
            self.outputs[key] = tool_output(self.counter, session, turn, self.tool_tokens, self.seed)
        return self.outputs[key]

    def responses_body(self, session: str, items: list[dict[str, Any]], max_tokens: int,
                       cache_key: bool = True) -> dict[str, Any]:
        body = {
            "model": MODEL_ID, "stream": True, "store": False, "temperature": 0,
            "input": items, "tools": [SHELL_TOOL], "tool_choice": "required", "parallel_tool_calls": False,
            "max_output_tokens": max_tokens,
        }
        if cache_key:  # Codex sends one per thread
            body["prompt_cache_key"] = f"bench-session-{session}"
        return body


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Responses items as Chat Completions messages (developer -> system)."""
    out: list[dict[str, Any]] = []
    for it in items:
        kind = it.get("type", "message")
        if kind == "message":
            text = "".join(c.get("text", "") for c in it["content"]) if isinstance(it["content"], list) else it["content"]
            out.append({"role": "system" if it["role"] in ("developer", "system") else it["role"], "content": text})
        elif kind == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    return out


def chat_body(items: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    fn = {k: SHELL_TOOL[k] for k in ("name", "description", "parameters")}
    return {"model": MODEL_ID, "stream": True, "temperature": 0, "max_tokens": max_tokens,
            "stream_options": {"include_usage": True}, "messages": chat_messages(items),
            "tools": [{"type": "function", "function": fn}], "tool_choice": "required", "parallel_tool_calls": False}


# -- one turn over the wire ---------------------------------------------------------------------------


@dataclass
class Turn:
    system: str
    label: str  # A3, B3, S3, U13/E13 (session A's follow-up and its edit), or "warmup"
    session: str
    turn: int
    after_restart: bool = False
    after_synth: bool = False  # the previous turn's call was the bench's, not the one lmspd sampled
    ttft_ms: float | None = None
    total_ms: float | None = None
    status: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    prefilled: int | None = None
    reused: int | None = None
    prefill_ms: float | None = None
    source: str | None = None  # lmspd's last_cache_source (+ detail); llama_cpp.server's cache hit/miss
    expected_suffix: int | None = None
    expected_how: str = ""
    own_call: bool | None = None  # False: the bench synthesized the assistant turn
    output_tokens: int | None = None
    cpu_ms: float | None = None
    wait_ms: float | None = None
    call: str = ""  # the call's arguments as the system returned them (truncated)
    moves: str = ""  # lmspd: KV moved by this turn (captures to RAM, restores), from /health's counters
    log: str = ""
    note: str = ""


def _first_output(kind: str | None, data: dict[str, Any]) -> bool:
    if kind in ("response.output_text.delta", "response.function_call_arguments.delta",
                "response.custom_tool_call_input.delta"):
        return True
    return kind == "response.output_item.added" and (data.get("item") or {}).get("type") in (
        "function_call", "custom_tool_call")


def stream_responses_turn(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    clock = time.perf_counter
    out: dict[str, Any] = {"ttft": None, "response": None, "timings": None}
    t0 = clock()
    for name, raw in post_sse(client, url, body, FRESH):
        data = json.loads(raw)
        kind = data.get("type") or name
        if out["ttft"] is None and _first_output(kind, data):
            out["ttft"] = clock() - t0
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            if out["ttft"] is None:  # the first token ended the turn: no output event to time
                out["ttft"], out["ttft_is_end"] = clock() - t0, True
            out["response"] = data.get("response") or {}
            out["timings"] = data.get("timings")
        elif kind == "error":
            raise RuntimeError(f"{url}: error event: {raw[:600]}")
    out["total"] = clock() - t0
    return out


def stream_chat_turn(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    clock = time.perf_counter
    out: dict[str, Any] = {"ttft": None, "usage": None, "timings": None, "finish": None, "calls": {}, "text": ""}
    t0 = clock()
    for _name, raw in post_sse(client, url, body, FRESH):
        data = json.loads(raw)
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls"):
                if out["ttft"] is None:
                    out["ttft"] = clock() - t0
            out["text"] += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                slot = out["calls"].setdefault(tc.get("index", 0), {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.get("id") or slot["id"]
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                out["finish"] = choice["finish_reason"]
                if out["ttft"] is None:  # the first token ended the turn: no delta to time
                    out["ttft"], out["ttft_is_end"] = clock() - t0, True
        if data.get("usage"):
            out["usage"] = data["usage"]
        if isinstance(data.get("timings"), dict):
            out["timings"] = data["timings"]
    out["total"] = clock() - t0
    return out


# -- servers -------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PolledServer(ChildServer):
    """A server that prints no URL line: started on a free port, ready when
    ``probe`` answers. stdout and stderr both go to the log."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path, probe: str = "/v1/models") -> None:
        super().__init__(name, cmd, re.compile("(?!)"), log_path)
        self.url = f"http://127.0.0.1:{port}"
        self.probe = probe

    def start(self, timeout: float = 180.0) -> "PolledServer":
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(die_with_parent(self.cmd), stdout=self._log, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + self.probe, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not start ({' '.join(self.cmd)}):\n{self.log_tail()}")


def llama_cpp_server(model: Path, ctx: int, threads: int, log_path: Path) -> PolledServer:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--n_ctx", str(ctx),
           "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_batch", str(N_BATCH),
           "--host", "127.0.0.1", "--port", str(port), "--cache", "True"]
    return PolledServer("llama-cpp-server", cmd, port, log_path)


# "generation response=R seq=N cache_source=S [detail] reused=… prefilled=…" (lmspd.engines.llama.scheduler)
LMSPD_GEN_LINE = re.compile(r"generation response=\S+ (?:seq=\d+ )?cache_source=.*")
LLCPP_PREFIX = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
LLCPP_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


# -- the run ---------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = args.model or bundled_model_path()
        self.work = args.workdir or Path(tempfile.mkdtemp(prefix="lmspd-agent-loop-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.counter = Counter(args.model)
        dev = developer_prompt(self.counter, args.dev_tokens, args.seed)
        self.wl = Workload(dev, args.tool_tokens, args.seed, self.counter, args.max_call_tokens)
        self.turns: list[Turn] = []
        self.notes: list[str] = []
        # What lmspd was sent and answered, per turn label: the other systems replay it.
        self.ref: dict[str, dict[str, Any]] = {}
        # Per lmspd turn label: whether its KV kept the end-of-turn token (``kv_holds_end``).
        self.kv_end: dict[str, bool] = {}
        self.client = httpx.Client(timeout=httpx.Timeout(900.0, connect=10.0))

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"  note: {text}", flush=True)

    # -- schedules

    def interleaved(self, n: int) -> list[tuple[str, int]]:
        return [(s, k) for k in range(1, n + 1) for s in ("A", "B")]

    # -- lmspd --------------------------------------------------------------------------------------

    def lmspd(self, nocache: bool = False, name: str | None = None) -> ChildServer:
        name = name or ("lmspd-nocache" if nocache else "lmspd")
        base = self.work / name
        base.mkdir(exist_ok=True)
        n = len(list(base.glob("server*.log")))
        srv = lmspd_server(None if self.args.model is None else self.args.model_name, self.args.ctx, self.args.threads,
                           base / "data", base / f"server{n}.log")
        srv.cmd += ["--kv-disk-dir", str(base / "kv")]
        if nocache:
            srv.cmd.append("--no-prefix-cache")
        srv.name = name
        t = time.perf_counter()
        srv.start()
        print(f"  {name} up at {srv.url} in {time.perf_counter() - t:.1f}s", flush=True)
        return srv

    def health(self, srv: ChildServer) -> dict[str, Any]:
        return self.client.get(srv.url + "/health").json()["models"][MODEL_ID]

    def warmup_responses(self, srv: ChildServer, tools: bool = True) -> None:
        body = {"model": MODEL_ID, "stream": True, "store": False, "temperature": 0, "max_output_tokens": 16,
                "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}]}
        if tools:
            body.update(tools=[SHELL_TOOL], tool_choice="required", parallel_tool_calls=False)
        stream_responses_turn(self.client, srv.url + "/v1/responses", body)
        srv.new_log_text()

    def lmspd_turn(self, srv: ChildServer, system: str, label: str, body: dict[str, Any],
                   after_restart: bool = False) -> tuple[Turn, dict[str, Any]]:
        session, k = label[0], int(label[1:])
        turn = Turn(system, label, session, k, after_restart=after_restart)
        moved_before = self.health(srv).get("cache") or {}
        before = sched_ns(srv.pid) if srv.pid else None
        r = stream_responses_turn(self.client, srv.url + "/v1/responses", body)
        after = sched_ns(srv.pid) if srv.pid else None
        resp = r["response"] or {}
        usage = resp.get("usage") or {}
        h = self.health(srv)
        moved = h.get("cache") or {}
        turn.moves = " ".join(f"{k}+{moved[k] - moved_before.get(k, 0)}" for k in MOVES
                              if isinstance(moved.get(k), int) and moved[k] != moved_before.get(k, 0))
        logs = LMSPD_GEN_LINE.findall(srv.new_log_text())
        turn.ttft_ms = None if r["ttft"] is None else r["ttft"] * 1000
        turn.total_ms = r["total"] * 1000
        turn.status = resp.get("status")
        turn.prompt_tokens = usage.get("input_tokens")
        turn.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        turn.output_tokens = usage.get("output_tokens")
        turn.prefilled = h.get("last_prefilled_tokens")
        turn.reused = h.get("last_reused_tokens")
        turn.prefill_ms = h.get("last_prefill_ms")
        detail = h.get("last_cache_detail") or ""
        turn.source = h.get("last_cache_source", "") + (f" {detail}" if detail else "")
        turn.log = logs[-1] if logs else ""
        if len(logs) != 1:
            turn.note += f"{len(logs)} generation log lines; "
        if before and after:
            turn.cpu_ms = (after[0] - before[0]) / 1e6
            turn.wait_ms = (after[1] - before[1]) / 1e6
        if turn.cached_tokens is not None and turn.reused is not None and turn.cached_tokens != turn.reused:
            turn.note += f"usage cached_tokens {turn.cached_tokens} != /health reused {turn.reused}; "
        return turn, resp

    def run_lmspd(self) -> None:
        a = self.args
        print(f"\n== lmspd: interleaved A/B x {a.turns} turns, restart after turn {a.restart_after}, "
              f"then single session S x {a.turns}", flush=True)
        srv = self.lmspd()
        # The paired reference: session A's very requests on a server of its
        # own (M, "mirror"), sent right before or right after A_k, alternating:
        # the same prompt, KV and batches, so A_k / M_k is the interleaving
        # cost alone, under the same machine load.
        mirror = None
        try:
            mirror = self.lmspd(name="lmspd-single") if a.paired else None
            self.warmup_responses(srv)
            if mirror is not None:
                self.warmup_responses(mirror)
            items = {s: self.wl.start_items(s) for s in "ABS"}
            prev: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
            schedule = self.interleaved(a.turns) + [("S", k) for k in range(1, a.turns + 1)]
            restarted_for: set[str] = set()
            restarted = False
            synthesized: set[str] = set()
            for session, k in schedule:
                after_restart = False
                if session == "A" and k == a.restart_after + 1 and not restarted:
                    restarted = True
                    t = time.perf_counter()
                    srv.stop()
                    stopped = time.perf_counter() - t
                    srv = self.lmspd()
                    # Warmed up as lmspd-nocache is (the first request of a
                    # process pays one-time costs: graph reservation, grammar
                    # compilation), so the ratio compares caches only;
                    # --no-warmup: neither is, and both pay them.
                    t = time.perf_counter()
                    if a.warmup:
                        self.warmup_responses(srv)
                    warm = time.perf_counter() - t
                    restarted_for = {"A", "B"}
                    print(f"  restart: stop (SIGTERM, shutdown checkpoint) {stopped:.1f}s; "
                          + (f"warm-up request {warm:.1f}s" if a.warmup else "no warm-up"), flush=True)
                if session in restarted_for:
                    after_restart = True
                    restarted_for.discard(session)
                label = f"{session}{k}"
                body = self.wl.responses_body(session, list(items[session]), a.max_call_tokens)
                paired = mirror is not None and session == "A"
                prev_a = prev.get("A")
                if paired and k % 2 == 0:
                    assert mirror is not None
                    self.mirror_turn(mirror, k, body, prev_a)
                turn, resp = self.lmspd_turn(srv, "lmspd", label, body, after_restart)
                turn.after_synth = session in synthesized
                if session in prev:
                    pb, pout = prev[session]
                    self.expect(turn, f"{session}{k - 1}", (pb, pout), body)
                outputs = [o for o in resp.get("output") or [] if o.get("type") != "reasoning"]
                turn.call = " | ".join(str(o.get("arguments", o.get("type")))[:160] for o in outputs)
                calls = [o for o in outputs if o.get("type") == "function_call" and o.get("status") == "completed"]
                if calls and len(outputs) == 1:
                    call = calls[0]
                    turn.own_call = True
                    synthesized.discard(session)
                else:
                    call = {"type": "function_call", "id": f"fc_bench_{label}", "status": "completed",
                            "call_id": f"call_bench_{label}", "name": "shell",
                            "arguments": json.dumps({"command": FALLBACK_COMMANDS[k % len(FALLBACK_COMMANDS)]})}
                    turn.own_call = False
                    turn.note += (f"lmspd returned {[o.get('type') + '/' + str(o.get('status')) for o in outputs]} "
                                  f"(status {turn.status}); the bench synthesized the call; ")
                    outputs = [call]
                    synthesized.add(session)
                self.ref[label] = {"body": body, "call": call}
                prev[session] = (body, outputs)
                items[session] += outputs + [{"type": "function_call_output", "id": f"fco_bench_{label}",
                                              "call_id": call["call_id"], "output": self.wl.tool_output(session, k)}]
                self.add(turn)
                if paired and k % 2 == 1:
                    assert mirror is not None
                    self.mirror_turn(mirror, k, body, prev_a)
            self.run_branch(srv, items["A"], prev["A"])
            h = self.health(srv)
            self.note(f"lmspd cache at the end: {json.dumps(h.get('cache'))}")
        finally:
            srv.stop()
            if mirror is not None:
                mirror.stop()

    def mirror_turn(self, srv: ChildServer, k: int, body: dict[str, Any],
                    prev: tuple[dict[str, Any], list[dict[str, Any]]] | None) -> None:
        turn, resp = self.lmspd_turn(srv, "lmspd", f"M{k}", body)
        turn.session, turn.turn = "M", k
        if prev is not None:
            turn.expected_suffix, turn.expected_how = self.counter.new_suffix(prev[0], prev[1], body)
        outputs = [o for o in resp.get("output") or [] if o.get("type") != "reasoning"]
        turn.call = " | ".join(str(o.get("arguments", o.get("type")))[:160] for o in outputs)
        turn.own_call = True
        self.add(turn)

    def expect(self, turn: Turn, prev_label: str, prev: tuple[dict[str, Any], list[dict[str, Any]]],
               body: dict[str, Any]) -> None:
        """``turn``'s expected new suffix over lmspd's turn ``prev_label``.
        Whether that turn's KV holds its end token is learnt from the first
        later turn that continued it whole (``kv_holds_end``)."""
        end = self.kv_end.get(prev_label)
        before = next((t for t in self.turns if t.system == turn.system and t.label == prev_label), None)
        if end is None and before is not None:
            end = kv_holds_end(before, turn)
            if end is not None:
                self.kv_end[prev_label] = end
        turn.expected_suffix, turn.expected_how = self.counter.new_suffix(prev[0], prev[1], body, end)

    def run_branch(self, srv: ChildServer, items: list[dict[str, Any]],
                   prev: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
        """Session A, after the single session ran: a follow-up user turn
        (``U``), then the same turn edited (``E``, a branch: the client went
        back and changed its last message). Both continue A's last call turn
        and its tool output; on a KV that cannot be trimmed the edit resumes
        from the exact-state checkpoint at the end of that turn."""
        a = self.args
        k = a.turns + 1
        for tag, text in BRANCH_TURNS:
            body = self.wl.responses_body("A", items + [{"type": "message", "role": "user", "id": f"msg_{tag}{k}",
                                                         "content": [{"type": "input_text", "text": text}]}],
                                          a.reply_tokens)
            body["tool_choice"] = "none"  # the tools stay listed: the same prompt
            turn, _resp = self.lmspd_turn(srv, "lmspd", f"{tag}{k}", body)
            turn.session, turn.own_call = "A", True
            self.expect(turn, f"A{a.turns}", prev, body)
            self.add(turn)

    def run_nocache(self) -> None:
        labels = [lb for lb in self.args.nocache_turns if lb in self.ref]
        print(f"\n== lmspd-nocache: {', '.join(labels)} (lmspd's exact request bodies, each a cold prefill)", flush=True)
        if not labels:
            self.note("lmspd-nocache: no lmspd turns to replay (run lmspd in the same invocation)")
            return
        srv = self.lmspd(nocache=True)
        try:
            if self.args.warmup:  # as the restarted lmspd was
                t = time.perf_counter()
                self.warmup_responses(srv)
                print(f"  warm-up request {time.perf_counter() - t:.1f}s", flush=True)
            for label in labels:
                turn, resp = self.lmspd_turn(srv, "lmspd-nocache", label, self.ref[label]["body"])
                turn.own_call = None
                self.add(turn)
        finally:
            srv.stop()

    # -- the llama.cpp servers ------------------------------------------------------------------------

    def run_baseline(self, system: str) -> None:
        a = self.args
        n = a.baseline_turns
        print(f"\n== {system}: interleaved A/B x {n} turns (no restart), A alone to turn {a.turns}, then U and E",
              flush=True)
        base = self.work / system
        base.mkdir(exist_ok=True)
        if system.startswith("xllamacpp"):
            try:
                import xllamacpp  # noqa: F401
            except ImportError:
                self.note(f"{system}: xllamacpp is not installed; skipped")
                return
            srv: ChildServer = xllamacpp_server(self.model, a.ctx, a.threads, N_BATCH, base / "server.log",
                                                swa_full=system == "xllamacpp-swa-full")
        else:
            srv = llama_cpp_server(self.model, a.ctx, a.threads, base / "server.log")
        t = time.perf_counter()
        srv.start()
        print(f"  {system} up at {srv.url} in {time.perf_counter() - t:.1f}s", flush=True)
        chat = system != "xllamacpp-responses"
        url = srv.url + ("/v1/chat/completions" if chat else "/v1/responses")
        try:
            warm = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}]
            self.send_baseline(srv, url, chat, warm, 4)
            srv.new_log_text()
            items = {s: self.wl.start_items(s) for s in "AB"}
            # Then session A alone up to lmspd's last turn, so that its
            # follow-up and edit (U, E) are the very requests lmspd got.
            schedule = self.interleaved(n) + [("A", k) for k in range(n + 1, a.turns + 1)]
            for session, k in schedule:
                label = f"{session}{k}"
                turn, own = self.baseline_turn(system, srv, url, chat, Turn(system, label, session, k),
                                               items[session], "required")
                if own is not None:
                    turn.own_call = True
                    call = own
                elif label in self.ref:
                    turn.own_call = False
                    call = self.ref[label]["call"]
                else:
                    turn.own_call = False
                    call = {"type": "function_call", "id": f"fc_bench_{label}", "status": "completed",
                            "call_id": f"call_bench_{label}", "name": "shell",
                            "arguments": json.dumps({"command": FALLBACK_COMMANDS[k % len(FALLBACK_COMMANDS)]})}
                    turn.note += "no lmspd call for this turn: a fixed call was synthesized; "
                items[session] += [call, {"type": "function_call_output", "id": f"fco_bench_{label}",
                                          "call_id": call["call_id"], "output": self.wl.tool_output(session, k)}]
                self.add(turn)
            # Session A's follow-up and its edit, as lmspd got them (run_branch),
            # after the baseline's own last turn of A.
            for tag, text in BRANCH_TURNS:
                label = f"{tag}{a.turns + 1}"
                msg = {"type": "message", "role": "user", "id": f"msg_{label}",
                       "content": [{"type": "input_text", "text": text}]}
                turn, _own = self.baseline_turn(system, srv, url, chat, Turn(system, label, "A", a.turns + 1),
                                                items["A"] + [msg], "none")
                turn.own_call = True  # a text reply: nothing to synthesize
                self.add(turn)
        finally:
            srv.stop()

    def baseline_turn(self, system: str, srv: ChildServer, url: str, chat: bool, turn: Turn,
                      items: list[dict[str, Any]], tool_choice: str) -> tuple[Turn, dict[str, Any] | None]:
        """One request to a llama.cpp server: its timings and token counts,
        and the call it made (None: it made none)."""
        before = sched_ns(srv.pid) if srv.pid else None
        r = self.send_baseline(srv, url, chat, items, self.args.reply_tokens, tool_choice)
        after = sched_ns(srv.pid) if srv.pid else None
        if before and after:
            turn.cpu_ms = (after[0] - before[0]) / 1e6
            turn.wait_ms = (after[1] - before[1]) / 1e6
        turn.ttft_ms = None if r["ttft"] is None else r["ttft"] * 1000
        turn.total_ms = r["total"] * 1000
        if r.get("ttft_is_end"):
            turn.note += "first token was end-of-turn: TTFT is the time of the finish; "
        own = None
        label = turn.label
        if chat:
            usage = r["usage"] or {}
            turn.prompt_tokens = usage.get("prompt_tokens")
            turn.output_tokens = usage.get("completion_tokens")
            turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            turn.status = r["finish"]
            calls = [c for c in r["calls"].values() if c["name"] == "shell" and c["arguments"]]
            if calls and _json_ok(calls[0]["arguments"]):
                c = calls[0]
                own = {"type": "function_call", "id": f"fc_{system}_{label}", "status": "completed",
                       "call_id": c["id"] or f"call_{system}_{label}", "name": "shell",
                       "arguments": c["arguments"]}
        else:
            resp = r["response"] or {}
            usage = resp.get("usage") or {}
            turn.prompt_tokens = usage.get("input_tokens")
            turn.output_tokens = usage.get("output_tokens")
            turn.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
            turn.status = resp.get("status")
            calls = [o for o in resp.get("output") or [] if o.get("type") == "function_call"
                     and o.get("status") == "completed"]
            if calls:
                own = calls[0]
        tm = r.get("timings")
        if isinstance(tm, dict):
            turn.prefilled = tm.get("prompt_n")
            turn.reused = tm.get("cache_n")
            turn.prefill_ms = tm.get("prompt_ms")
        if system == "llama-cpp-server":
            self.llcpp_facts(turn, srv.new_log_text())
        return turn, own

    def send_baseline(self, srv: ChildServer, url: str, chat: bool, items: list[dict[str, Any]],
                      max_tokens: int, tool_choice: str = "required") -> dict[str, Any]:
        if chat:
            body = chat_body(items, max_tokens)
            body["tool_choice"] = tool_choice
            return stream_chat_turn(self.client, url, body)
        session = next((it["id"][len("msg_task_"):] for it in items if str(it.get("id", "")).startswith("msg_task_")), "x")
        body = self.wl.responses_body(session, items, max_tokens)
        body["tool_choice"] = tool_choice
        return stream_responses_turn(self.client, url, body)

    @staticmethod
    def llcpp_facts(turn: Turn, log: str) -> None:
        hits = LLCPP_PREFIX.findall(log)
        evals = LLCPP_EVAL.findall(log)
        src = []
        if "cache hit" in log:
            src.append("ram-cache hit")
        elif "cache miss" in log:
            src.append("ram-cache miss")
        if hits:
            turn.reused, turn.prefilled = int(hits[-1][0]), int(hits[-1][1])
            src.append("prefix")
        elif evals:
            turn.reused, turn.prefilled = 0, int(evals[-1][1])
            src.append("cold")
        if turn.prompt_tokens is None and turn.prefilled is not None:
            turn.prompt_tokens = (turn.reused or 0) + turn.prefilled
        turn.source = " ".join(src)

    # -- bookkeeping and the report ---------------------------------------------------------------------

    def add(self, turn: Turn) -> None:
        self.turns.append(turn)
        ttft = "-" if turn.ttft_ms is None else f"{turn.ttft_ms:8.0f}"
        exp = "" if turn.expected_suffix is None else f" expect={turn.expected_suffix}"
        print(f"  {turn.system:<20} {turn.label:<4}{'R' if turn.after_restart else ' '} ttft_ms={ttft} "
              f"prompt={turn.prompt_tokens} prefilled={turn.prefilled}{exp} reused={turn.reused} "
              f"src={turn.source or '-'} call={'own' if turn.own_call else 'synth' if turn.own_call is False else '-'}"
              f"{' moved=' + turn.moves.replace(' ', ',') if turn.moves else ''}"
              f"{' ' + turn.note if turn.note else ''}{' args=' + turn.call[:90] if turn.call else ''}", flush=True)

    def run(self) -> dict[str, Any]:
        a = self.args
        t0 = time.perf_counter()
        dev_tokens = self.counter.count(self.wl.dev)
        tool_tok = [self.counter.count(self.wl.tool_output(s, k)) for s in "AB" for k in range(1, a.turns + 1)]
        print(f"workload: developer prompt {dev_tokens} tokens, tool outputs {min(tool_tok)}-{max(tool_tok)} tokens, "
              f"{a.turns} turns/session, ctx {a.ctx}, threads {a.threads}; work dir {self.work}", flush=True)
        if "lmspd" in a.systems:
            self.run_lmspd()
        if "lmspd-nocache" in a.systems:
            self.run_nocache()
        for system in ("xllamacpp-responses", "xllamacpp-chat", "xllamacpp-swa-full", "llama-cpp-server"):
            if system in a.systems:
                try:
                    self.run_baseline(system)
                except Exception as exc:  # noqa: BLE001 - one baseline failing must not lose the run
                    self.note(f"{system} failed: {type(exc).__name__}: {str(exc)[:400]}")
        elapsed = time.perf_counter() - t0
        return self.report(elapsed, dev_tokens, tool_tok)

    def get(self, system: str, label: str) -> Turn | None:
        for t in self.turns:
            if t.system == system and t.label == label:
                return t
        return None

    def report(self, elapsed: float, dev_tokens: int, tool_tok: list[int]) -> dict[str, Any]:
        a = self.args
        systems = [s for s in ALL_SYSTEMS if s in a.systems and any(t.system == s for t in self.turns)]
        labels = ([f"{s}{k}" for s, k in self.interleaved(a.turns)] + [f"S{k}" for k in range(1, a.turns + 1)]
                  + [f"U{a.turns + 1}", f"E{a.turns + 1}"] + [f"M{k}" for k in range(1, a.turns + 1)])
        print("\nper turn: TTFT ms / tokens prefilled (lmspd: + expected new suffix, cache source). "
              "* = the bench synthesized the assistant turn; R = first turn after the restart")
        head = f"{'turn':<6}{'prompt':>7}  {'lmspd ttft/prefilled (expect) source':<52}"
        others = [s for s in systems if s != "lmspd"]
        head += "".join(f"{s:>24}" for s in others)
        print(head)
        print("-" * len(head))
        for label in labels:
            lm = self.get("lmspd", label)
            rest = [self.get(s, label) for s in others]
            if lm is None and not any(rest):
                continue
            if label == f"A{a.restart_after + 1}":
                print(f"{'-- restart (SIGTERM; same --data-dir and --kv-disk-dir) --':^{len(head)}}")
            if label == "S1":
                print(f"{'-- single session S, alone on the restarted lmspd --':^{len(head)}}")
            if label == "M1":
                print(f"{'-- M: session A mirrored on a server of its own, paired with A (same requests) --':^{len(head)}}")
            if label == f"U{a.turns + 1}":
                print(f"{'-- session A: a follow-up user turn (U), then a branch that edits it (E) --':^{len(head)}}")
            prompt = lm.prompt_tokens if lm else next((t.prompt_tokens for t in rest if t), None)
            mark = "R" if lm and lm.after_restart else " "
            row = f"{label + mark:<6}{_fmt(prompt):>7}  "
            if lm:
                exp = f"({_fmt(lm.expected_suffix)})" if lm.expected_suffix is not None else ""
                cell = f"{_fmt(lm.ttft_ms)}/{_fmt(lm.prefilled)} {exp} {lm.source}{'' if lm.own_call else ' *'}"
                row += f"{cell:<52}"
            else:
                row += f"{'':<52}"
            for t in rest:
                cell = "" if t is None else f"{_fmt(t.ttft_ms)}/{_fmt(t.prefilled)}{' *' if t.own_call is False else ''}"
                row += f"{cell:>24}"
            print(row)

        ratios = self.ratios()
        print("\ntargets")
        for r in ratios.values():
            print(f"  {r['name']}: {r['value']}  (target {r['target']}) -> {r['verdict']}")
            for d in r.get("details", []):
                print(f"      {d}")
        anomalies = self.anomalies()
        if anomalies:
            print("\nlmspd cache behaviour that looks wrong")
            for x in anomalies:
                print(f"  {x}")
        for n in self.notes:
            print(f"note: {n}")
        print(f"\nwall time {elapsed:.0f}s")
        return {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
            "model": str(self.model), "developer_prompt_tokens": dev_tokens,
            "tool_output_tokens": {"min": min(tool_tok), "max": max(tool_tok)},
            "turns": [asdict(t) for t in self.turns], "ratios": ratios, "anomalies": anomalies,
            "notes": self.notes, "wall_s": elapsed, "work_dir": str(self.work),
        }

    def ratios(self) -> dict[str, dict[str, Any]]:
        a = self.args
        out: dict[str, dict[str, Any]] = {}
        lm = [t for t in self.turns if t.system == "lmspd"]
        # 1. steady-state prefill == the new suffix
        steady = [t for t in lm if t.turn > 1 and t.expected_suffix is not None and t.prefilled is not None
                  and not t.after_synth]
        if steady:
            exact = [t for t in steady if _as_expected(t)]
            worst = max(steady, key=_suffix_miss)
            rel = [prefilled / expected for prefilled, expected in map(_suffix_counts, steady) if expected]
            out["prefill"] = {
                "name": "lmspd steady-state prefilled / new suffix (turns >= 2, incl. after restart)",
                "value": f"{len(exact)}/{len(steady)} turns exact; median ratio {statistics.median(rel):.2f}; "
                         f"worst {worst.label}: {worst.prefilled} vs {worst.expected_suffix}",
                "target": "== 1.00 on every turn (the edit E: <= 1.00)",
                "verdict": "met" if len(exact) == len(steady) else "NOT met",
                "details": [f"{t.label}{'R' if t.after_restart else ''}: prefilled {t.prefilled} vs new {t.expected_suffix} "
                            f"({t.expected_how}) src={t.source}" for t in steady if not _as_expected(t)],
                "turns": {t.label: [t.prefilled, t.expected_suffix] for t in steady},
            }
        # 2. interleaved vs single: A_k against its mirror M_k, the same
        # request on a server that serves only it, sent next to A_k in time.
        mirrored = []
        for k in range(2, a.turns + 1):
            if k == a.restart_after + 1:
                continue  # the post-restart turn is measured by ratio 3
            ta, tm = self.get("lmspd", f"A{k}"), self.get("lmspd", f"M{k}")
            if ta and tm and ta.ttft_ms and tm.ttft_ms:
                mirrored.append((k, ta, tm))
        if mirrored:
            rs = [ta.ttft_ms / tm.ttft_ms for _, ta, tm in mirrored]  # type: ignore[operator]
            med = statistics.median(rs)
            q = statistics.quantiles(rs, n=4, method="inclusive") if len(rs) > 1 else [rs[0], rs[0], rs[0]]
            unequal = [k for k, ta, tm in mirrored if _work(ta) != _work(tm)]
            out["interleave_paired"] = {
                "name": "lmspd interleaved A_k TTFT / the same request alone on its own server (M_k), paired per turn",
                "value": f"median {med:.3f} (p25-p75 {q[0]:.2f}-{q[2]:.2f}); n={len(rs)} turns; "
                         f"{len(rs) - len(unequal)}/{len(rs)} pairs did equal work (prompt, prefilled, output tokens)",
                "target": "<= 1.05", "verdict": "met" if med <= 1.05 else "NOT met",
                "details": [f"turn {k}{' (A first)' if k % 2 else ' (M first)'}: A {ta.ttft_ms:.0f} ms, "
                            f"M {tm.ttft_ms:.0f} ms -> {ta.ttft_ms / tm.ttft_ms:.3f}; "  # type: ignore[operator]
                            f"work A {_work(ta)} M {_work(tm)}; A moved [{ta.moves}] src={ta.source}"
                            for k, ta, tm in mirrored],
            }
        # 2b. the same against session S (a different session, run later
        # alone on the restarted server): unpaired in time, unequal work.
        pairs = []
        for k in range(2, a.turns + 1):
            if k == a.restart_after + 1:
                continue  # the post-restart turn is measured by ratio 3
            ta, tb, ts = self.get("lmspd", f"A{k}"), self.get("lmspd", f"B{k}"), self.get("lmspd", f"S{k}")
            if ta and tb and ts and ta.ttft_ms and tb.ttft_ms and ts.ttft_ms:
                pairs.append((k, (ta.ttft_ms + tb.ttft_ms) / 2, ts.ttft_ms))
        if pairs:
            rs = [i / s for _, i, s in pairs]
            med = statistics.median(rs)
            q = statistics.quantiles(rs, n=4, method="inclusive") if len(rs) > 1 else [rs[0], rs[0], rs[0]]
            ratio_of_medians = statistics.median(i for _, i, _ in pairs) / statistics.median(s for _, _, s in pairs)
            out["interleave"] = {
                "name": "lmspd interleaved TTFT / session S's TTFT (unpaired: S runs later, other prompts; "
                        "mean of A_k and B_k over S_k)",
                "value": f"median {med:.2f} (p25-p75 {q[0]:.2f}-{q[2]:.2f}); ratio of medians {ratio_of_medians:.2f}; "
                         f"n={len(rs)} turns",
                "target": "<= 1.30", "verdict": "met" if med <= 1.3 else "NOT met",
                "details": [f"turn {k}: interleaved {i:.0f} ms, single {s:.0f} ms -> {i / s:.2f}" for k, i, s in pairs],
            }
        # 3. first turn after the restart vs a cold prefill of the same request
        label = f"A{a.restart_after + 1}"
        warm, cold = self.get("lmspd", label), self.get("lmspd-nocache", label)
        if warm and cold and warm.ttft_ms and cold.ttft_ms:
            r = cold.ttft_ms / warm.ttft_ms
            both = "both after one warm-up request" if a.warmup else "neither warmed up"
            out["restart"] = {
                "name": f"cold-prefill TTFT / lmspd TTFT on {label}, the first turn after the restart ({both})",
                "value": f"{r:.1f}x ({cold.ttft_ms:.0f} ms cold, {cold.prefilled} tokens; {warm.ttft_ms:.0f} ms "
                         f"after restart, {warm.prefilled} tokens, {warm.source})"
                         + (f"; server prefill ms {cold.prefill_ms:.0f} vs {warm.prefill_ms:.0f} = "
                            f"{cold.prefill_ms / warm.prefill_ms:.1f}x; TTFT beyond the prefill (the same work on "
                            f"both: request handling and the decode up to the call's name) {cold.ttft_ms - cold.prefill_ms:.0f}"
                            f" vs {warm.ttft_ms - warm.prefill_ms:.0f} ms (lmspd's also holds its plan and restore)"
                            if cold.prefill_ms and warm.prefill_ms else ""),
                "target": ">= 5x", "verdict": "met" if r >= 5 else "NOT met",
            }
        return out

    def anomalies(self) -> list[str]:
        out = []
        for t in self.turns:
            if t.system != "lmspd":
                continue
            if t.after_synth:
                out.append(f"{t.label}: not judged - the bench replaced lmspd's previous call (see its note), so "
                           f"only a partial match is possible (source '{t.source}', prefilled {t.prefilled})")
                continue
            src = (t.source or "").split(" ")[0]
            partial_ok = False
            if t.label[0] in "UE":
                # The edit (E) may trim U's state back (a trimmable KV), copy
                # its turns before the edit into a free sequence (``aligned``),
                # or restore the checkpoint at the end of A's last call turn.
                ok = {"tool-output-ids", "visible-prefix", "ram", "checkpoint", "memory-token", "memory-text"}
                if t.label[0] == "E":
                    ok.add("copy")
                partial_ok = t.label[0] == "E"
            elif t.session == "M":
                # Alone on its server: cold, then each turn continues the last.
                ok = {"cold"} if t.turn == 1 else {"tool-output-ids", "visible-prefix"}
            elif t.turn == 1 and t.session in "AB":
                # B1 shares A1's developer prompt: copied from A's sequence.
                ok = {"cold", "memory-token", "ram", "copy"}
            elif t.turn == 1:
                # S1 shares the developer prompt with a saved conversation; on a
                # non-trimmable KV a checkpoint at or before the divergence serves.
                ok = {"memory-token", "ram", "disk", "checkpoint"}
            elif t.after_restart:
                ok = {"disk"}
            elif t.session == "S":
                ok = {"tool-output-ids", "visible-prefix"}
            else:
                # Resident on its own sequence (--parallel > 1) or restored from RAM.
                ok = {"tool-output-ids", "visible-prefix", "ram"}
            # A session that stayed on its sequence moves no KV (checkpoints
            # of a non-trimmable KV are captures by design, not moves).
            moved = [m for m in t.moves.split() if not m.startswith("checkpoints+")]
            if moved and t.turn > 1 and t.label[0] in "ABM" and not t.after_restart:
                out.append(f"{t.label}: KV moved on a resident session's turn: {' '.join(moved)} (src={t.source})")
            bad = src not in ok or (t.turn > 1 and "partial" in (t.source or "") and not partial_ok)
            over = (t.turn > 1 and t.expected_suffix is not None and t.prefilled is not None
                    and not _as_expected(t))
            if bad or over:
                why = []
                if bad:
                    why.append(f"cache_source '{t.source}' where {sorted(ok)} was expected")
                if over:
                    why.append(f"prefilled {t.prefilled} tokens where the new suffix is {t.expected_suffix}")
                out.append(f"{t.label}{'R' if t.after_restart else ''}: {'; '.join(why)} | reused={t.reused} "
                           f"prompt={t.prompt_tokens} cached_tokens={t.cached_tokens} ttft={_fmt(t.ttft_ms)}ms | "
                           f"log: {t.log}")
        return out


def kv_holds_end(before: Turn, turn: Turn) -> bool | None:
    """Whether lmspd's KV after turn ``before`` holds an end-of-turn token,
    from ``turn``, which continued it: None unless ``turn`` kept all of it.

    A forced call's grammar admits every end token. Gemma ends a call with
    <eos> on some turns and <end_of_turn> (its turn closer) on others, and
    no API field tells the client which. lmspd keeps <end_of_turn> in the KV,
    so the next prompt's suffix starts after it, but it leaves <eos> out,
    because a replay renders <end_of_turn> there instead. The next turn's
    ``reused`` is the whole state: the previous prompt (its reused and
    prefilled tokens), its output tokens, and the end token when it was
    kept. One token more than the first three means the end token was
    kept. Anything else means a partial reuse."""
    words = (turn.source or "").split()
    if None in (before.reused, before.prefilled, before.output_tokens, turn.reused) or not words \
            or words[0] in ("cold", "copy") or "partial" in words:
        return None
    extra = turn.reused - (before.reused + before.prefilled + before.output_tokens)  # type: ignore[operator]
    return {0: False, 1: True}.get(extra)


def _work(t: Turn) -> tuple[int | None, int | None, int | None]:
    """What a turn evaluated: prompt tokens, tokens prefilled, output tokens."""
    return (t.prompt_tokens, t.prefilled, t.output_tokens)


def _suffix_counts(t: Turn) -> tuple[int, int]:
    """Tokens prefilled and the expected new suffix, of a turn that has both
    (the only turns ``_as_expected`` and the prefill ratio look at)."""
    assert t.prefilled is not None and t.expected_suffix is not None
    return t.prefilled, t.expected_suffix


def _suffix_miss(t: Turn) -> int:
    prefilled, expected = _suffix_counts(t)
    return abs(prefilled - expected)


def _as_expected(t: Turn) -> bool:
    """Prefilled exactly the new suffix; the edit (E) at most that: it may
    resume from a checkpoint after A's last call turn (the end of the tool
    output before the edited message), which leaves less to prefill."""
    prefilled, expected = _suffix_counts(t)
    if t.label.startswith("E"):
        return prefilled <= expected
    return prefilled == expected


def _json_ok(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.0f}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    try:
        result = bench.run()
    finally:
        bench.client.close()
        bench.counter.close()
    result["notes"] += [
        "TTFT: lmspd = request sent -> response.output_item.added of the forced function_call (sent once "
        "the call's name is parsed, so it includes the decode of the call's opening tokens); text systems = "
        "first text delta.",
        "llama-cpp-server: prefilled = the 'prompt eval ... / N tokens' count in its verbose log (its "
        "llama_perf milliseconds are not meaningful, so no prefill ms); reused = its 'N prefix-match hit'.",
        "every request goes on a new connection (Connection: close): xllamacpp's server sometimes drops a "
        "kept-alive connection between two streams.",
    ]
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
