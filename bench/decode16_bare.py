"""16 sequences: llama-cpp-python's own llama_decode rate (no server, no sampling: a fixed next
token) beside lmspd-p16 and llama-16 decode16 rounds (bench/concurrency.py), taking turns.
Same GGUF, 2 threads, 16 x 2048 cells, non-unified KV, batch 512, no flash attention (lmspd's
context). A one-off (2026-12-05, bench/README.md, concurrency scenario 6): llama.cpp logs its
model load verbosely to stderr; the result lines start with "round".

    .venv/bin/python bench/decode16_bare.py 4     # rounds
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp

import concurrency as c
from _common import bundled_model_path
from lmspd.engines.llama import amx

model = str(bundled_model_path())
mp = amx.model_params()  # as lmspd loads it: no AMX kernels where they crash
m = llama_cpp.llama_model_load_from_file(model.encode(), mp)
cp = llama_cpp.llama_context_default_params()
cp.n_ctx = 16 * 2048; cp.n_seq_max = 16; cp.kv_unified = False; cp.n_batch = cp.n_ubatch = 512
cp.n_threads = cp.n_threads_batch = 2
cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
ctx = llama_cpp.llama_init_from_model(m, cp)
vocab = llama_cpp.llama_model_get_vocab(m)
batch = llama_cpp.llama_batch_init(512, 0, 1)

def tok(text):
    buf = (llama_cpp.llama_token * 256)()
    n = llama_cpp.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, 256, True, True)
    return list(buf[:n])

def put(i, t, pos, seq, logits):
    batch.token[i] = t; batch.pos[i] = pos; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = seq; batch.logits[i] = logits

def inproc_round(steps=128):
    mem = llama_cpp.llama_get_memory(ctx)
    for s in range(16):
        llama_cpp.llama_memory_seq_rm(mem, s, -1, -1)
    prompts = [tok(f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n") for p in c.LONG_PROMPTS_16]
    n = 0
    for s, p in enumerate(prompts):
        for j, t in enumerate(p):
            put(n, t, j, s, 1 if j == len(p) - 1 else 0); n += 1
    batch.n_tokens = n
    t0 = time.perf_counter()
    assert llama_cpp.llama_decode(ctx, batch) == 0
    prefill = time.perf_counter() - t0
    the = tok(" the")[-1]
    times = []
    t_start = time.perf_counter()
    for k in range(steps - 1):
        for s, p in enumerate(prompts):
            put(s, the, len(p) + k, s, 1)
        batch.n_tokens = 16
        t0 = time.perf_counter()
        assert llama_cpp.llama_decode(ctx, batch) == 0
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t_start
    return {"prefill_ms": prefill * 1000, "step_ms_p50": statistics.median(times) * 1000,
            "decode_tps": 16 * (steps - 1) / wall}

args = argparse.Namespace(model=None, ctx=4096, threads=2, decode16_tokens=128, decode_tokens=256,
                          gpu_layers="0", flash_attn="off")
tmp = Path(tempfile.mkdtemp(prefix="lmspd-ceiling-"))
servers = {}
started = []
try:
    for system in ("lmspd-p16", "llama-16"):
        srv = c.start(system, args, Path(model), tmp, ctx=2048); started.append(srv)
        servers[system] = (srv.url, c.served_name(system, srv.url), srv.pid)
    for system, (url, name, pid) in servers.items():
        c.decode(url, name, system, args, streams=16, tokens=128, pid=pid)
    inproc_round(16)
    rows = []
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
        row = {"load": os.getloadavg()[0]}
        for system in (["lmspd-p16", "llama-16", "in-process"] if r % 2 == 0 else ["in-process", "llama-16", "lmspd-p16"]):
            if system == "in-process":
                row[system] = inproc_round()["decode_tps"]
            else:
                url, name, pid = servers[system]
                x = c.decode(url, name, system, args, streams=16, tokens=128, pid=pid)
                row[system] = x["decode_tps"] if x["full"] else float("nan")
        print(f"round {r+1} load {row['load']:.1f}: decode-phase tok/s lmspd-p16 {row['lmspd-p16']:.1f}  "
              f"llama-16 {row['llama-16']:.1f}  llama-cpp-python in-process {row['in-process']:.1f}  "
              f"lmspd/in-process {row['lmspd-p16']/row['in-process']:.3f}  llama-16/in-process {row['llama-16']/row['in-process']:.3f}", flush=True)
        rows.append(row)
    for key in ("lmspd-p16", "llama-16"):
        print(key, "/ in-process, median", round(statistics.median(r[key] / r["in-process"] for r in rows), 3))
finally:
    for srv in started:
        srv.stop()
