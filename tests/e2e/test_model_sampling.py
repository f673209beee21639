"""A model's own sampling settings (its GGUF's ``general.sampling.*``) for
what a request leaves unset, as llama.cpp's server uses them: Codex sends
no temperature, and Qwen3-style models are tuned for a top-k the generic
1.0 lacks. The bundled model carries none, so the test serves a copy of
it with ``general.sampling.temp`` 0.7 and ``general.sampling.top_k`` 1:
top-k 1 leaves one candidate, so sampling at any temperature writes the
greedy text, and the echoed temperature is the model's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from support.gguf_writer import with_metadata
from support.llama_server import bundled_gguf
from support.server import MODEL, ServerProcess

STORY = "Write a short story about a robot who learns to paint."


def seeded(seed: int) -> dict:
    """A fixed draw: each test's outcome is the same in every run."""
    return {"extensions": {"lmspd.sampling": {"seed": seed}}}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    path = Path(tmp_path_factory.mktemp("sampling")) / "smollm2-sampling.gguf"
    path.write_bytes(with_metadata(Path(bundled_gguf()).read_bytes(),
                                   {"general.sampling.temp": 0.7, "general.sampling.top_k": 1}))
    return path


@pytest.fixture(scope="module")
def srv(gguf):
    server = ServerProcess("--model", str(gguf), "--ctx", "1024", "--parallel", "1").start()
    yield server
    server.stop()


def model_id(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def respond(server, **fields) -> dict:
    body = {"model": model_id(server), "input": STORY, "max_output_tokens": 40, "store": False, **fields}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def text(response: dict) -> str:
    return response["output"][0]["content"][0]["text"]


def test_the_model_s_settings_fill_what_the_request_leaves_unset(srv):
    srv.wait_for_log(r"sampling for what a request leaves unset: temperature 0\.7, top_k 1 \(its own settings: "
                     r"temperature 0\.7, top_k 1\)")
    listed = httpx.get(srv.url + "/v1/models").json()["data"][0]["sampling"]
    lmsp = httpx.get(srv.url + "/lmsp/v1/models", headers={"LMSP-Version": "1.0"}).json()["data"][0]["sampling"]
    assert listed == lmsp == {"temperature": 0.7, "top_k": 1}
    greedy = respond(srv, temperature=0)
    unset = [respond(srv, **seeded(seed)) for seed in (1, 2)]
    # The model's temperature is what the response reports (not OpenAI's 1.0)...
    assert [r["temperature"] for r in unset] == [0.7, 0.7] and unset[0]["top_p"] == 1.0
    # ...and its top-k 1 is what it sampled with: each draw is the greedy text.
    assert text(unset[0]) == text(unset[1]) == text(greedy), (text(greedy), [text(r) for r in unset])


def test_a_temperature_the_request_gives_is_kept_and_the_model_s_top_k_still_applies(srv):
    greedy = respond(srv, temperature=0)
    given = respond(srv, temperature=1.3, top_p=0.9, **seeded(3))
    assert (given["temperature"], given["top_p"]) == (1.3, 0.9)
    assert text(given) == text(greedy)


def test_the_extension_overrides_the_model_s_top_k(srv):
    """``{"lmspd.sampling": {"top_k": 0}}`` turns the model's top-k off: the
    same draw then writes other than the greedy text."""
    greedy = respond(srv, temperature=0)
    free = respond(srv, extensions={"lmspd.sampling": {"seed": 1, "top_k": 0}})
    assert text(free) != text(greedy)


def test_the_operator_s_flags_win_over_the_model_s_settings(gguf):
    """``--temperature 0.5 --top-k 0``: the model's top-k 1 is off (the same
    draw writes other than the greedy text) and 0.5 is what is reported; the
    model's other settings stay."""
    server = ServerProcess("--model", str(gguf), "--ctx", "1024", "--parallel", "1", "--temperature", "0.5",
                           "--top-k", "0").start()
    try:
        greedy, drawn = respond(server, temperature=0), respond(server, **seeded(1))
        listed = httpx.get(server.url + "/v1/models").json()["data"][0]["sampling"]
    finally:
        server.stop()
    assert drawn["temperature"] == 0.5 and text(drawn) != text(greedy)
    assert listed == {"temperature": 0.5, "top_k": 0}
    assert ("sampling for what a request leaves unset: temperature 0.5, top_k 0 "
            "(its own settings: temperature 0.7, top_k 1)") in server.log()


def test_a_model_without_settings_samples_as_before():
    """The control: the bundled model itself (no ``general.sampling.*``) at the
    generic temperature 1.0 does not write the greedy text with the same
    draws, so the tests above would fail without the model's top-k."""
    server = ServerProcess("--ctx", "1024", "--parallel", "1").start()
    try:
        body = {"model": MODEL, "input": STORY, "max_output_tokens": 40, "store": False}
        replies = [httpx.post(server.url + "/v1/responses", json={**body, **extra}, timeout=120).json()
                   for extra in ({"temperature": 0}, seeded(1), seeded(2),
                                 {"extensions": {"lmspd.sampling": {"seed": 1, "top_k": 1}}})]
        listed = httpx.get(server.url + "/v1/models").json()["data"][0]["sampling"]
    finally:
        server.stop()
    assert [r["temperature"] for r in replies] == [0, 1.0, 1.0, 1.0]
    assert "sampling for what a request leaves unset" not in server.log() and listed == {}
    assert text(replies[1]) != text(replies[0]) and text(replies[2]) != text(replies[0])
    # The extension's top-k 1, on this model, is the greedy text again.
    assert text(replies[3]) == text(replies[0])
