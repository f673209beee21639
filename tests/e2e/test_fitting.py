"""A real ``lmspd serve`` sizing the bundled model to the memory it is told
it has (``LMSPD_FREE_MEMORY_MB``: the figure ``--ctx auto`` plans with, so
that these runs are the same on any machine): it lowers ``--parallel``
rather than fail, shrinks the window for many sequences, refuses what does
not fit with the numbers, and never dies in llama.cpp's allocator.

SmolLM2-135M's KV is 22.5 KiB a token and sequence in f16 (30 layers x 3 KV
heads x 64 x 2 x 2 B), 11.95 KiB in q8_0 (6 blocks of 34 B per row)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx

from support.server import MODEL, ServerProcess
from support.sse import parse_frames

# This machine's RAM (24 GiB): RAM keeps 10% of it, 2.4 GiB, for the rest of the machine.
THIS_MACHINE_MB = "24576"


def refused(*args: str, free_mb: str) -> tuple[str, float]:
    """Run ``lmspd serve`` expecting it to refuse at start: (its output, seconds)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lmspd-test-") as data:
        done = subprocess.run([sys.executable, "-m", "lmspd", "serve", "--port", "0", "--data-dir", data, *args],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "LMSPD_FREE_MEMORY_MB": free_mb})
    spent = time.monotonic() - start
    assert done.returncode == 2, done.stdout + done.stderr
    return done.stdout + done.stderr, spent


def test_64_sequences_that_do_not_fit_even_the_floor_are_refused_with_the_numbers() -> None:
    # 64 x 16384 (the floor) x 22.5 KiB = 22.5 GiB of KV alone, more than 24 GiB less 2.4 GiB.
    out, spent = refused("--parallel", "64", free_mb=THIS_MACHINE_MB)
    assert spent < 60
    m = re.search(r"--parallel 64 sequences of the smallest automatic window \(16384 tokens\) needs ([\d,]+) MiB"
                  r".* more than the ([\d,]+) MiB usable in RAM", out)
    assert m, out
    needed, usable = (int(g.replace(",", "")) for g in m.groups())
    assert needed > 64 * 16384 * 22.5 / 1024 > usable
    assert "Traceback" not in out and "llama_context" not in out


def test_an_explicit_ctx_and_parallel_are_refused_not_changed() -> None:
    out, _ = refused("--ctx", "32768", "--parallel", "64", free_mb=THIS_MACHINE_MB)
    m = re.search(r"--ctx 32768 with --parallel 64 needs ([\d,]+) MiB .* more than the ([\d,]+) MiB usable", out)
    assert m, out
    # 64 x 32768 x 22.5 KiB = 45 GiB of KV.
    assert int(m.group(1).replace(",", "")) > 45 * 1024
    assert "Traceback" not in out


def test_weights_that_do_not_fit_are_refused_naming_the_flags() -> None:
    # 1100 MiB stated, less 1 GiB of headroom: 76 MiB, less than the 92 MiB file.
    out, _ = refused(free_mb="1100")
    assert re.search(r"weights need \d+ MiB, more than the 76 MiB usable in RAM", out), out
    # In RAM, fewer --gpu-layers cannot help (it was advised): a smaller quantization can.
    assert "use a smaller quantization of the model" in out and "--gpu-layers" not in out, out
    assert "Traceback" not in out


def test_no_flags_in_less_memory_lower_parallel_and_say_so() -> None:
    # 4096 MiB less 1 GiB: 3072 MiB. Four 32768-token windows need 2880 MiB of KV + 92 MiB of weights
    # + ~745 MiB of compute buffers: no; three (2160 MiB of KV) fit.
    srv = ServerProcess(env={"LMSPD_FREE_MEMORY_MB": "4096"}).start()
    try:
        srv.wait_for_log(r"--parallel lowered from 4 to 3 so that each sequence keeps a 32768-token window")
        runtime = srv.health()["models"][MODEL]["runtime"]
        assert (runtime["parallel"], runtime["window"], runtime["backend"]) == (3, 32768, "cpu")
        assert runtime["kv_bytes"] == 3 * 32768 * 30 * 3 * 64 * 2 * 2
        assert "lowered from 4 to 3" in runtime["reason"]
        assert srv.health()["models"][MODEL]["parallel"] == 3
    finally:
        srv.stop()


def test_quantized_kv_with_flash_attention_serves_a_stream_in_a_smaller_window() -> None:
    # 8 sequences in 3072 MiB less 1 GiB (2048 MiB): 8 x 32768 x 11.95 KiB = 3060 MiB of q8_0 KV do not
    # fit; --parallel was given, so the window comes down (not below the 16384 floor).
    srv = ServerProcess("--parallel", "8", "--kv-type", "q8_0", "--flash-attn", "on",
                        env={"LMSPD_FREE_MEMORY_MB": "3072"}).start(timeout=60)
    try:
        m = srv.wait_for_log(r"window lowered to (\d+) \(below 32768, floor 16384\) to fit 8 sequences")
        window = int(m.group(1))
        assert 16384 <= window < 32768
        runtime = srv.health()["models"][MODEL]["runtime"]
        assert runtime == {**runtime, "kv_type": "q8_0", "flash_attn": True, "parallel": 8, "window": window}
        # q8_0: 30 layers x 2 x (192 values = 6 blocks of 34 B) a token.
        assert runtime["kv_bytes"] == 8 * window * 30 * 2 * 6 * 34
        models = httpx.get(srv.url + "/v1/models", timeout=30).json()
        assert models["data"][0]["context_window"] == window
        with httpx.stream("POST", srv.url + "/v1/responses", timeout=120, json={
                "model": MODEL, "input": "Say hello.", "stream": True, "max_output_tokens": 16}) as r:
            assert r.status_code == 200
            frames = list(parse_frames(r.iter_lines()))
        events = [f.event for f in frames if f.event]
        # A short answer completes; a long one stops at max_output_tokens.
        assert "response.output_text.delta" in events
        assert events[-1] in ("response.completed", "response.incomplete")
        last = json.loads(frames[[f.event for f in frames].index(events[-1])].data)["response"]
        assert last["usage"]["output_tokens"] > 0 and last["output"][0]["content"][0]["text"]
    finally:
        srv.stop()
