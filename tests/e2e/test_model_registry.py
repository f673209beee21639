"""Two local models under a memory budget that fits one: each loads on
first use (503 + Retry-After meanwhile, ``loading`` in /lmsp/v1/models),
the idle one is unloaded to make room, and an idle model goes on its own."""

from __future__ import annotations

import os
import re
import threading
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


def test_token_counts_racing_an_idle_unload(other_gguf):
    """Token counts hold no queue slot, and Claude Code sends them all the
    time: one in flight when the idle unload comes must keep the model (it
    used to free it under the count: a crash in llama.cpp), and one that
    comes while the model is away starts its load and hears 503 meanwhile.
    Counts run back to back (the model stays: it is in use), then with
    pauses longer than --models-idle-s between them, so that unloads and
    counts cross."""
    srv = ServerProcess("--model", str(other_gguf), "--ctx", str(CTX), "--models-idle-s", "1").start()
    text = "lorem ipsum dolor sit amet " * 4000  # ~100 KB: a count spends its time in the model
    bodies = {"/v1/messages/count_tokens": {"model": OTHER, "messages": [{"role": "user", "content": text}]},
              "/v1/responses/input_tokens": {"model": OTHER, "input": text}}
    answers: list[tuple[str, int, dict]] = []

    def counts(path: str, seconds: float) -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                r = client.post(path, json=bodies[path])
                answers.append((path, r.status_code, r.json()))
                if r.status_code == 503:
                    time.sleep(0.1)

    def both(seconds: float) -> None:
        threads = [threading.Thread(target=counts, args=(path, seconds)) for path in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)

    try:
        assert ask(srv, OTHER)[0].status_code == 200
        both(3.0)
        for _ in range(3):
            time.sleep(1.6)  # idle past the bound: the unload starts about now
            both(1.0)
        assert srv.proc is not None and srv.proc.poll() is None, srv.log()[-3000:]
        srv.wait_for_log(re.escape(f"unloading {OTHER} (idle for 1 s)"))
        for path, status, body in answers:
            if status == 503:  # while the model is away; a count brings it back (it used to wait for a generation)
                message = body["error"]["message"]
                assert "is being unloaded" in message or "is loading" in message, body
            else:
                assert status == 200 and body["input_tokens"] > 10_000, (path, status, body)
        print(f"{sum(a[1] == 200 for a in answers)} counts answered, {sum(a[1] == 503 for a in answers)} "
              f"refused while the model was away; {srv.log().count('lmspd: unloading ' + OTHER)} unloads")
        assert sum(status == 200 for _, status, _ in answers) > 4, answers
        # And the count comes back once the model does.
        deadline = time.monotonic() + 120
        while (r := httpx.post(srv.url + "/v1/responses/input_tokens", json=bodies["/v1/responses/input_tokens"],
                               timeout=60)).status_code == 503:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert r.status_code == 200 and r.json()["input_tokens"] > 10_000
    finally:
        srv.stop()
