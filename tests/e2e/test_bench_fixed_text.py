"""bench/speculative.py --fixed-text: its wrapped server (``_serve-fixed-text``)
makes every request for a prompt take the tokens that the prompt's first
request took, with speculation on or off, whatever the sampler picks. The
bench's auto/off on ``edit`` compares the drafting on one text only if this
holds; the wrapper reaches into lmspd's scheduler and generation, so a change
there that it misses fails here, not in a later session's bench run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from support.server import MODEL, ServerProcess

BENCH = Path(__file__).resolve().parents[2] / "bench" / "speculative.py"
# Sampled at temperature 1: without the wrapper, seeds 1, 2 and 3 write three
# different texts from this prompt (checked with a plain server when written).
BODY = {"model": MODEL, "temperature": 1.0, "max_output_tokens": 24, "store": False,
        "input": "Write a short poem about the sea and a lighthouse."}


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess("--ctx", "1024", "--parallel", "2", entry=[str(BENCH), "_serve-fixed-text"]).start()
    yield server
    server.stop()


def reply(server: ServerProcess, seed: int, speculative: bool, **extra) -> tuple[str, dict]:
    body = {**BODY, **extra,
            "extensions": {"lmspd.sampling": {"seed": seed}, "lmspd.speculative": speculative}}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    text = "".join(part["text"] for item in got["output"] if item["type"] == "message" for part in item["content"])
    return text, got


def test_every_later_request_for_a_prompt_takes_the_first_requests_tokens(srv):
    first, body = reply(srv, seed=1, speculative=False)
    assert first and body["usage"]["output_tokens"] == 24
    assert reply(srv, seed=2, speculative=True)[0] == first
    assert reply(srv, seed=3, speculative=False)[0] == first


def test_past_the_recorded_text_the_sampler_picks_again(srv):
    """A request allowed more tokens than the first took: the recorded ones
    first, then its own."""
    prompt = "List three colours of the sunset."
    first, _ = reply(srv, seed=1, speculative=False, input=prompt, max_output_tokens=8)
    longer, body = reply(srv, seed=2, speculative=False, input=prompt, max_output_tokens=24)
    assert longer.startswith(first) and len(longer) > len(first)
    assert body["usage"]["output_tokens"] > 8


# llama.cpp's side of --fixed-text: its server cannot replay tokens, so the
# bench holds it to off's text with a grammar whose only sentence is that
# text (``literal_grammar``). Run in a child process: the benchmark puts
# bench/ first on sys.path, whose modules would shadow others here.
HELD = 'def total(items):\n\treturn sum(i["price"] for i in items)  # "\\" é\n'
HOLD_SCRIPT = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import httpx, speculative as sp
from _common import bundled_model_path, xllamacpp_server
held = sys.argv[2]
srv = xllamacpp_server(bundled_model_path(), 1024, 2, 512, Path(sys.argv[3]), speculative="ngram_simple").start()
try:
    with httpx.Client(timeout=120) as client:
        prompt = client.post(srv.url + "/tokenize", json={"content": "Write a Python function."}).json()["tokens"]
        def text(seed, fixed):
            body = {"max_output_tokens": 48, "temperature": 1.0, "seed": seed, **({sp.FIXED: held} if fixed else {})}
            return sp.stream_llama_same(client, srv.url, body, prompt).text
        print(json.dumps({"held": [text(s, True) for s in (1, 2)], "free": [text(s, False) for s in (1, 2)]}))
finally:
    srv.stop()
"""


def test_llama_cpps_server_is_held_to_the_recorded_text_by_its_grammar(tmp_path):
    pytest.importorskip("xllamacpp")
    done = subprocess.run([sys.executable, "-c", HOLD_SCRIPT, str(BENCH.parent), HELD, str(tmp_path / "llama.log")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # Quotes, a backslash, a tab, a newline and a non-ASCII letter all survive
    # the grammar's escaping, at temperature 1 with either seed.
    assert got["held"] == [HELD, HELD]
    # Without the grammar the same requests write something else.
    assert all(text != HELD for text in got["free"]) and got["free"][0] != got["free"][1]
