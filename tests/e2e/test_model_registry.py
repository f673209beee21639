"""Two local models under a memory budget that fits one: each loads on
first use (503 + Retry-After meanwhile, ``loading`` in /lmsp/v1/models),
the idle one is unloaded to make room, and an idle model goes on its own."""

from __future__ import annotations

import os
import re
import time

import httpx
import pytest

from lmspd.engines.llama.fit import ModelShape
from lmspd.engines.llama.gguf import read_gguf
from lmspd.engines.llama.models import resolve_model
from support.server import MODEL, ServerProcess

CTX = 512
PARALLEL = 2
OTHER = "second-copy"


def cost_mib() -> float:
    """What the registry counts for one model: the file, the KV of every
    sequence and the compute buffers (flash attention off on the CPU)."""
    path = resolve_model(None)[1]
    shape = ModelShape.from_metadata(read_gguf(path).metadata)
    assert shape is not None
    return (path.stat().st_size + shape.kv_bytes(CTX, PARALLEL)
            + shape.compute_bytes(CTX, PARALLEL, flash_attn=False)) / 2**20


@pytest.fixture(scope="module")
def other_gguf(tmp_path_factory):
    link = tmp_path_factory.mktemp("models") / f"{OTHER}.gguf"
    os.symlink(resolve_model(None)[1], link)
    return link


def statuses(srv) -> dict[str, str]:
    r = httpx.get(srv.url + "/lmsp/v1/models", timeout=30)
    return {m["id"]: m["status"] for m in r.json()["data"]}


def ask(srv, model: str, timeout: float = 180.0) -> tuple[httpx.Response, list[httpx.Response], set[str]]:
    """Retry as Retry-After says until the model answers; every refusal and status seen."""
    refusals, seen = [], set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.post(srv.url + "/v1/responses", json={"model": model, "input": "Hi.", "max_output_tokens": 4},
                       timeout=120)
        if r.status_code != 503:
            return r, refusals, seen
        refusals.append(r)
        st = statuses(srv)
        seen.add(st[model])
        assert list(st.values()).count("loaded") <= 1, st  # never both in memory
        time.sleep(float(r.headers["Retry-After"]) / 4)
    raise AssertionError(f"{model} never loaded")


def test_two_models_share_a_budget_that_fits_one(other_gguf):
    budget = int(cost_mib() * 1.5)
    srv = ServerProcess("--model", MODEL, "--model", str(other_gguf), "--ctx", str(CTX),
                        "--parallel", str(PARALLEL), "--models-max-mem", str(budget)).start()
    try:
        # Nothing loads at start.
        assert statuses(srv) == {MODEL: "unloaded", OTHER: "unloaded"}
        r, refusals, seen = ask(srv, MODEL)
        assert r.status_code == 200, r.text
        assert refusals, "the first request must find the model not yet loaded"
        first = refusals[0]
        assert first.json()["error"]["code"] == "model_loading" and int(first.headers["Retry-After"]) > 0
        assert seen <= {"loading", "loaded"} and statuses(srv)[MODEL] == "loaded"

        # The other model needs the room: the idle first one is unloaded.
        r, refusals, _ = ask(srv, OTHER)
        assert r.status_code == 200, r.text
        assert refusals
        assert statuses(srv) == {MODEL: "unloaded", OTHER: "loaded"}
        srv.wait_for_log(re.escape(f"lmspd: loaded {OTHER} in"))  # printed once its status says loaded
        log = srv.log()
        assert f"lmspd: loading {MODEL}" in log
        assert f"unloading {MODEL} (to make room for {OTHER})" in log
        # And back: the first one answers again after reloading.
        r, _, _ = ask(srv, MODEL)
        assert r.status_code == 200
        assert statuses(srv) == {MODEL: "loaded", OTHER: "unloaded"}
    finally:
        srv.stop()


def test_an_idle_model_is_unloaded(other_gguf):
    srv = ServerProcess("--model", str(other_gguf), "--ctx", str(CTX), "--models-idle-s", "1").start()
    try:
        r, _, _ = ask(srv, OTHER)
        assert r.status_code == 200
        deadline = time.monotonic() + 30
        while statuses(srv)[OTHER] != "unloaded":
            assert time.monotonic() < deadline, statuses(srv)
            time.sleep(0.2)
        srv.wait_for_log(re.escape(f"unloading {OTHER} (idle for 1 s)"))
    finally:
        srv.stop()
