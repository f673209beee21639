"""A long prefill shows its progress in the engine view: ``GET /lmsp/v1/engine``
lists each running prefill with the tokens done of its prompt, live, while the
request is still evaluating its prompt (the console draws it: test_console.py)."""

from __future__ import annotations

import threading
import time
import uuid

import httpx

from support.server import MODEL


def long_prompt(lines: int = 200) -> str:
    """About 13-16 tokens a line (1,352 for 100 lines on SmolLM2), never seen
    before (the nonce defeats the cache)."""
    nonce = uuid.uuid4().hex
    return f"{nonce}\n" + "\n".join(f"line {i}: the quick brown fox {nonce[:4]}." for i in range(lines)) + \
        "\nHow many lines were there?"


def watch_prefill(url: str, body: dict) -> tuple[httpx.Response, list[dict]]:
    """Run ``body`` while polling the engine view; the reply and every prefill seen."""
    out: dict[str, httpx.Response] = {}

    def send() -> None:
        out["r"] = httpx.post(url + "/v1/responses", json=body, timeout=600)

    thread = threading.Thread(target=send)
    thread.start()
    seen: list[dict] = []
    with httpx.Client(timeout=30) as client:
        while thread.is_alive():
            view = client.get(url + "/lmsp/v1/engine").json()
            for model in view["models"]:
                seen += model["prefilling"]
            time.sleep(0.05)
    thread.join()
    return out["r"], seen


def test_a_running_prefill_reports_tokens_done(server):
    # ~1,350 tokens: six 256-token prefill chunks, plenty for a 50 ms poll
    # to catch one mid-prefill, at half the cost of the console test's 200
    # lines (which its page, refreshed once a second, needs).
    body = {"model": MODEL, "input": long_prompt(lines=100), "max_output_tokens": 1, "temperature": 0}
    r, seen = watch_prefill(server.url, body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    prefilled = usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"]
    assert prefilled > 1000
    assert seen, "no prefill was ever reported while the request ran"
    totals = {p["total"] for p in seen}
    assert totals == {prefilled}, (totals, prefilled)
    done = [p["done"] for p in seen]
    assert done == sorted(done), "tokens done only grow"
    assert any(0 < d < prefilled for d in done), f"never caught mid-prefill: {done}"
    owner = seen[0]["owner"]
    assert isinstance(owner, str) and len(owner) == 6 and owner != "local", "owners are tags"
    assert all(p["elapsed_ms"] >= 0 and p["reused"] == usage["input_tokens_details"]["cached_tokens"] for p in seen)
    # Once done, nothing is left listed.
    view = httpx.get(server.url + "/lmsp/v1/engine", timeout=30).json()
    assert all(m["prefilling"] == [] for m in view["models"])
