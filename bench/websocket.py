"""A 12-turn agent loop over Responses WebSocket mode (only the new input
each turn, ``previous_response_id`` = the connection's latest response)
against the same loop over HTTP with full replay (the whole history every
turn, as Codex does over SSE), on the same lmspd server in one run.

Per turn: TTFT (request sent -> first ``response.output_text.delta``), the
bytes the client sent, and where the engine's prefix came from
(``cache_source`` from ``/health``). Both loops use ``store: false``,
temperature 0 and the same instructions; each turn's new input is a user
message carrying a simulated tool result (~130 tokens), so that the
history grows as an agent's does. The loops take turns (turn k of one,
then turn k of the other; which goes first rotates), each on its
own conversation and KV sequence, so that neither evicts the other's state
and both see the same load at the same turn. ``--repeat N`` runs the pair
N times, each run on a fresh server (so that both loops' first turns start
from the same cache state), and prints per-turn medians; the WS/HTTP ratio
of a turn is the median of the runs' paired ratios (one run's single TTFT
per turn is at the mercy of a shared machine). A turn where the two loops
did not prefill the same tokens is named below the table.

Both loops prefill the same tokens on the same turn, so prompt evaluation,
the noisiest part of a TTFT on a shared machine (up to +-30% run to run),
is work they share, not work that tells them apart. The table therefore also
prints each turn's *TTFT less the engine's prefill* (``last_prefill_ms``
from ``/health``: from the scheduler taking the request to its last prompt
token evaluated): what the transport, decoding the request, rendering,
cache planning and the first sample cost, which is where the two paths
differ. Its WS - HTTP difference per turn is the median of the runs' paired
differences.

``--control`` adds a third loop, a second HTTP full replay on a sequence of
its own (an A/A control): the same path and the same work as the first, so
its paired ratios against HTTP show how often "at or below HTTP" holds for
two paths that cannot differ, on this machine, in this run.

    .venv/bin/python bench/websocket.py                 # 12 turns, once
    .venv/bin/python bench/websocket.py --repeat 3      # per-turn medians of 3
    .venv/bin/python bench/websocket.py --repeat 6 --control   # and HTTP against HTTP
    .venv/bin/python bench/websocket.py --turns 6 --max-output 8
    .venv/bin/python bench/websocket.py --ctx 16384 --instructions-lines 300 --lines 1   # ~9k-token history, as Codex
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Generator

import httpx
from websockets.sync.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import iter_sse, lmspd_server  # noqa: E402

# Lines of simulated tool output per turn (~30 tokens each; --lines).
LINES = 4
INSTRUCTIONS = "You are a coding agent. Read the tool results and say in one short sentence what you will do next."


def agent_rules(lines: int) -> str:
    """``lines`` of simulated agent instructions (~29 tokens each on
    SmolLM2), so that the history a turn continues is as long as an agent's
    (Codex's first request is ~9k tokens, most of it its instructions)."""
    return "\n".join(f"- Rule {i}: before you edit src/module_{i}.py, read its tests and keep its public names."
                     for i in range(lines))


def tool_result(loop: str, turn: int) -> str:
    lines = [f"{loop}/src/module_{turn}.py line {i}: value_{turn}_{i} = compute({i}, {turn * i})"
             for i in range(LINES)]
    return f"Tool result of turn {turn} (cat {loop}/src/module_{turn}.py):\n" + "\n".join(lines)


def request(model: str, items: Any, max_output: int, **extra: Any) -> dict[str, Any]:
    return {"model": model, "instructions": INSTRUCTIONS, "input": items, "temperature": 0,
            "max_output_tokens": max_output, "store": False, **extra}


def health(client: httpx.Client, model: str) -> dict[str, Any]:
    return client.get("/health").json()["models"][model]


def http_loop(client: httpx.Client, model: str, turns: int, max_output: int,
              name: str = "http") -> Generator[dict[str, Any], None, None]:
    history: list[dict[str, Any]] = []
    for turn in range(1, turns + 1):
        history.append({"role": "user", "content": tool_result(name, turn)})
        body = json.dumps({**request(model, history, max_output), "stream": True}).encode()
        started = time.perf_counter()
        ttft = None
        final = None
        with client.stream("POST", "/v1/responses", content=body,
                           headers={"Content-Type": "application/json"}) as r:
            r.raise_for_status()
            for _event, data in iter_sse(r.iter_lines()):
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if ttft is None and ev["type"] == "response.output_text.delta":
                    ttft = time.perf_counter() - started
                if ev["type"] in ("response.completed", "response.incomplete", "response.failed"):
                    final = ev["response"]
        assert final is not None and final["status"] != "failed", final
        history += final["output"]
        row = _row(turn, ttft, len(body), final, health(client, model))
        print(name, json.dumps(row), flush=True)
        yield row


def ws_loop(url: str, client: httpx.Client, model: str, turns: int, max_output: int,
            name: str = "ws") -> Generator[dict[str, Any], None, None]:
    previous = None
    with connect(url.replace("http://", "ws://", 1) + "/v1/responses", max_size=2**24) as ws:
        for turn in range(1, turns + 1):
            new = [{"role": "user", "content": tool_result(name, turn)}]
            extra: dict[str, str] = {"previous_response_id": previous} if previous else {}
            frame = json.dumps({"type": "response.create", **request(model, new, max_output, **extra)})
            started = time.perf_counter()
            ws.send(frame)
            ttft = None
            while True:
                ev = json.loads(ws.recv(timeout=600))
                if ev["type"] == "error":
                    raise RuntimeError(ev)
                if ttft is None and ev["type"] == "response.output_text.delta":
                    ttft = time.perf_counter() - started
                if ev["type"] in ("response.completed", "response.incomplete", "response.failed"):
                    final = ev["response"]
                    break
            assert final["status"] != "failed", final
            previous = final["id"]
            row = _row(turn, ttft, len(frame.encode()), final, health(client, model))
            print(name, json.dumps(row), flush=True)
            yield row


def _row(turn: int, ttft: float | None, sent: int, final: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
    usage = final["usage"]
    ttft_ms = None if ttft is None else ttft * 1000
    prefill_ms = stats["last_prefill_ms"]
    return {"turn": turn, "ttft_ms": ttft_ms, "sent_bytes": sent, "prefill_ms": prefill_ms,
            "overhead_ms": None if ttft_ms is None else ttft_ms - prefill_ms,
            "input_tokens": usage["input_tokens"], "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
            "cache_source": stats["last_cache_source"], "prefilled": stats["last_prefilled_tokens"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--max-output", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1,
                        help="run both loops this many times (each on a fresh server) and compare per-turn medians")
    parser.add_argument("--lines", type=int, default=4, help="lines of tool output per turn (~30 tokens each)")
    parser.add_argument("--instructions-lines", type=int, default=0,
                        help="add this many lines of agent rules to the instructions (~29 tokens each)")
    parser.add_argument("--control", action="store_true",
                        help="add a second HTTP full-replay loop (A/A): the noise floor of the paired ratios")
    parser.add_argument("--json", type=Path, default=None, help="also write every row here")
    args = parser.parse_args()
    global LINES, INSTRUCTIONS
    LINES = args.lines
    if args.instructions_lines:
        INSTRUCTIONS = f"{INSTRUCTIONS}\n{agent_rules(args.instructions_lines)}"

    runs = [_run_pair(args, r) for r in range(args.repeat)]
    http = _median_rows([run["http"] for run in runs])
    ws = _median_rows([run["ws"] for run in runs])
    ratios = _paired_ratios(runs)
    _print(http, ws, ratios, _paired_overheads(runs), len(runs))
    if args.control:
        _print_control(_paired_ratios(runs, "control"), ratios, _paired_overheads(runs, "control"))
    _check_same_work(runs)
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=2))
    return 0


def _run_pair(args: argparse.Namespace, r: int) -> dict[str, list[dict[str, Any]]]:
    """One run of both loops on a server of its own. A fresh server per run
    puts both loops' first turns on the same footing: after the warm-up,
    each conversation gets an empty sequence and prefills its first turn
    cold. On one server kept across runs the sequences run out: in a later
    run the loop that went first took the last empty sequence (cold, 167
    tokens) and the other reused an earlier conversation's sequence in place
    (a 30-token shared prefix, 137 tokens prefilled), so turn 1 compared
    unequal work."""
    data_dir = Path(tempfile.mkdtemp(prefix="lmspd-bench-ws-"))
    server = lmspd_server(None, args.ctx, args.threads, data_dir, data_dir / "server.log").start()
    try:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            # Warm-up: load pages, compile graphs, prefill the instructions
            # (each loop then copies them: the same start for all); not measured.
            client.post("/v1/responses", json=request(model, "Hello.", 4)).raise_for_status()
            # The loops take turns, each on its own conversation and
            # sequence (none evicts another's state), so that turn k of
            # each runs under the same load; which goes first rotates.
            loops = {"http": http_loop(client, model, args.turns, args.max_output, f"http{r}"),
                     "ws": ws_loop(server.url, client, model, args.turns, args.max_output, f"ws{r}")}
            if args.control:
                # "api0" tokenizes like "http0" and "ws0" on SmolLM2 ("ctl0"
                # takes one token more), so the control does the same work.
                loops["control"] = http_loop(client, model, args.turns, args.max_output, f"api{r}")
            rows: dict[str, list[dict[str, Any]]] = {name: [] for name in loops}
            names = list(loops)
            for turn in range(args.turns):
                # Rotate who goes first: over len(names) consecutive turns
                # (or runs) each loop leads once.
                lead = (turn + r) % len(names)
                for name in names[lead:] + names[:lead]:
                    rows[name].append(next(loops[name]))
            for loop in loops.values():
                loop.close()
            return rows
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def _median_rows(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Turn by turn, the median TTFT over the runs (``_check_same_work``
    says where the other columns differ between runs)."""
    merged = []
    for rows in zip(*runs, strict=True):
        ttfts = [r["ttft_ms"] for r in rows if r["ttft_ms"] is not None]
        overheads = [r["overhead_ms"] for r in rows if r["overhead_ms"] is not None]
        merged.append({**rows[0], "ttft_ms": statistics.median(ttfts) if ttfts else None,
                       "overhead_ms": statistics.median(overheads) if overheads else None,
                       "ttft_all": [r["ttft_ms"] for r in rows]})
    return merged


def _paired_ratios(runs: list[dict[str, list[dict[str, Any]]]], path: str = "ws") -> list[list[float]]:
    """Turn by turn, ``path``/HTTP TTFT of each run: the two turns of a pair
    ran one right after the other, so their ratio cancels what drifts between
    runs. (The ratio of the two medians can divide one run's WebSocket turn
    by another run's HTTP turn.)"""
    ratios: list[list[float]] = []
    for turn in range(len(runs[0]["http"])):
        pairs = [(run[path][turn]["ttft_ms"], run["http"][turn]["ttft_ms"]) for run in runs]
        ratios.append([w / h for w, h in pairs if w and h])
    return ratios


def _paired_overheads(runs: list[dict[str, list[dict[str, Any]]]], path: str = "ws") -> list[list[float]]:
    """Turn by turn, ``path`` - HTTP of each run's TTFT less the engine's
    prefill (ms): what the two paths do differently, without the prefill
    they share."""
    diffs: list[list[float]] = []
    for turn in range(len(runs[0]["http"])):
        pairs = [(run[path][turn]["overhead_ms"], run["http"][turn]["overhead_ms"]) for run in runs]
        diffs.append([w - h for w, h in pairs if w is not None and h is not None])
    return diffs


def _check_same_work(runs: list[dict[str, list[dict[str, Any]]]]) -> None:
    """Both loops should prefill the same tokens on the same turn in every
    run; say where they did not (the TTFTs then compare unequal work)."""
    for turn in range(len(runs[0]["http"])):
        work = {path: [(run[path][turn]["cached_tokens"], run[path][turn]["prefilled"]) for run in runs]
                for path in runs[0]}
        if len({w for per_run in work.values() for w in per_run}) > 1:
            print(f"note: turn {turn + 1} prefilled unequal work (cached, prefilled) per run: "
                  + ", ".join(f"{path} {w}" for path, w in work.items()))


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _print(http: list[dict[str, Any]], ws: list[dict[str, Any]], ratios: list[list[float]],
           overheads: list[list[float]], repeats: int) -> None:
    if repeats > 1:
        print(f"TTFT: median of {repeats} runs per turn; WS/HTTP: median of the {repeats} runs' paired ratios; "
              f"WS-HTTP: median of the paired differences of TTFT less prefill")
    print("turn | HTTP TTFT ms | WS TTFT ms | WS/HTTP | HTTP TTFT-prefill ms | WS TTFT-prefill ms | WS-HTTP ms | "
          "HTTP sent B | WS sent B | HTTP cache (cached/input) | "
          "WS cache (cached/input)" + (" | WS/HTTP per run" if repeats > 1 else ""))
    print("---|---|---|---|---|---|---|---|---|---|---" + ("|---" if repeats > 1 else ""))
    for h, w, rs, ds in zip(http, ws, ratios, overheads, strict=True):
        ratio = statistics.median(rs) if rs else None
        diff = statistics.median(ds) if ds else None
        per_run = " | " + " ".join(f"{r:.2f}" for r in rs) if repeats > 1 else ""
        print(f"{h['turn']} | {_fmt(h['ttft_ms'])} | {_fmt(w['ttft_ms'])} | "
              f"{'-' if ratio is None else f'{ratio:.2f}'} | {_fmt(h['overhead_ms'])} | {_fmt(w['overhead_ms'])} | "
              f"{'-' if diff is None else f'{diff:+.1f}'} | {h['sent_bytes']} | {w['sent_bytes']} | "
              f"{h['cache_source']} {h['cached_tokens']}/{h['input_tokens']} | "
              f"{w['cache_source']} {w['cached_tokens']}/{w['input_tokens']}{per_run}")
    print()
    _print_tallies(ratios, overheads, "WS/HTTP TTFT", "TTFT less prefill, WS - HTTP", "WS")
    print(f"client bytes: HTTP {sum(h['sent_bytes'] for h in http)} total "
          f"(turn 1 {http[0]['sent_bytes']}, turn {http[-1]['turn']} {http[-1]['sent_bytes']}); "
          f"WS {sum(w['sent_bytes'] for w in ws)} total "
          f"(turn 1 {ws[0]['sent_bytes']}, turn {ws[-1]['turn']} {ws[-1]['sent_bytes']})")


def _print_control(control: list[list[float]], ws: list[list[float]], control_overheads: list[list[float]]) -> None:
    """The A/A control beside WS/HTTP, turn by turn: how often two loops
    doing the same work on the same path land at or below each other."""
    print("\nturn | control/HTTP (median of paired) | WS/HTTP (median of paired) | control/HTTP per run")
    print("---|---|---|---")
    for turn, (cs, ws_) in enumerate(zip(control, ws, strict=True), 1):
        c = statistics.median(cs) if cs else None
        w = statistics.median(ws_) if ws_ else None
        print(f"{turn} | {'-' if c is None else f'{c:.2f}'} | {'-' if w is None else f'{w:.2f}'} | "
              + " ".join(f"{r:.2f}" for r in cs))
    print()
    _print_tallies(control, control_overheads, "control (HTTP against HTTP, same work) TTFT",
                   "control TTFT less prefill, control - HTTP", "control")


def _print_tallies(ratios: list[list[float]], overheads: list[list[float]], ttft: str, less_prefill: str,
                   path: str) -> None:
    """The two verdicts over all turns: the median of the per-turn medians
    of paired TTFT ratios and of paired differences of TTFT less prefill,
    and on how many turns ``path`` was at or below HTTP by each."""
    medians = [statistics.median(rs) for rs in ratios if rs]
    if medians:
        print(f"{ttft}: median {statistics.median(medians):.2f}x, "
              f"turns where {path} <= HTTP: {sum(r <= 1 for r in medians)}/{len(medians)}")
    diffs = [statistics.median(ds) for ds in overheads if ds]
    if diffs:
        print(f"{less_prefill}: median {statistics.median(diffs):+.1f} ms, "
              f"turns where {path} <= HTTP: {sum(d <= 0 for d in diffs)}/{len(diffs)}")


if __name__ == "__main__":
    sys.exit(main())
