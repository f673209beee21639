"""The GPU check's headline numbers, from what bench/gpu/run.sh's benchmarks
wrote: single-stream decode through HTTP against in-process, TTFT − prefill
against in-process, and four streams' aggregate decode against one stream's.

    python bench/gpu/summary.py RESULTS_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str]) -> int:
    results = Path(argv[1]) if len(argv) > 1 else Path(".")
    lines = ["## GPU check summary"]
    overhead = _load(results / "overhead.json")
    if overhead:
        summary = overhead.get("summary", overhead)
        per = summary.get("per_system", {})
        for name in ("lmspd", "in-process"):
            stats = per.get(name) or {}
            dec = (stats.get("decode_tps") or {}).get("median")
            over = (stats.get("ttft_minus_prefill_ms") or {}).get("median")
            ttft = (stats.get("ttft_ms") or {}).get("median")
            lines.append(f"- {name}: decode {dec if dec is None else f'{dec:.1f}'} tok/s, TTFT "
                         f"{ttft if ttft is None else f'{ttft:.1f}'} ms, TTFT − prefill "
                         f"{over if over is None else f'{over:.1f}'} ms (medians)")
        for r in summary.get("ratios", []):
            if r.get("a") == "lmspd" and r.get("b") == "in-process":
                dec = r.get("decode_ratio_paired") or {}
                over = r.get("ttft_minus_prefill_delta_ms_paired") or {}
                lines.append(f"- single-stream decode, HTTP / in-process: {dec.get('median', float('nan')):.3f} paired "
                             f"(p25–p75 {dec.get('p25', float('nan')):.3f}–{dec.get('p75', float('nan')):.3f})")
                lines.append(f"- TTFT − prefill, lmspd − in-process: {over.get('median', float('nan')):+.1f} ms paired "
                             f"(p25–p75 {over.get('p25', float('nan')):+.1f}–{over.get('p75', float('nan')):+.1f})")
    else:
        lines.append("- no overhead.json (bench/overhead.py did not finish)")
    conc = _load(results / "concurrency.json")
    if conc:
        p4 = (conc.get("lmspd-p4") or {}).get("decode") or {}
        p1 = (conc.get("lmspd-p1") or {}).get("decode") or {}
        if p4.get("agg_tps") and p1.get("agg_tps"):
            lines.append(f"- 4 streams at once (--parallel 4): {p4['agg_tps']:.1f} tok/s aggregate, "
                         f"{p4.get('stream_tps_mean') or float('nan'):.1f} per stream; one at a time (--parallel 1): "
                         f"{p1['agg_tps']:.1f} tok/s; aggregate / single = {p4['agg_tps'] / p1['agg_tps']:.2f}x"
                         + ("" if p4.get("full") and p1.get("full") else " (a stream was cut short)"))
        for name in ("lmspd-p4", "lmspd-p1"):
            short = (conc.get(name) or {}).get("short")
            if short:
                lines.append(f"- {name}: a short request's TTFT alone {short['alone_ms']:.0f} ms, during a long "
                             f"generation {short['during_ms']:.0f} ms")
    else:
        lines.append("- no concurrency.json (bench/concurrency.py did not finish)")
    text = "\n".join(lines)
    print(text)
    (results / "summary.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
