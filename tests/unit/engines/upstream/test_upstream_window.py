"""An upstream model's context window: given, else learnt from the provider
at start (vLLM/SGLang ``max_model_len``, llama.cpp's ``/props`` ``n_ctx``
or ``meta.n_ctx_train``), else the default; the start-up log says which."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import lmspd.server
from lmspd.cli import main
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.engines.specs import build_engine, load_config_file, specs_from_settings
from lmspd.engines.upstream.credentials import DEFAULT_ENV
from lmspd.engines.upstream.engine import UpstreamEngine, UpstreamSpec
from lmspd.engines.upstream.window import DEFAULT_CONTEXT_WINDOW, discover_window
from support.provider import ScriptedProvider


@pytest.fixture
def provider():
    """A fresh one per test, not conftest's per module: these tests set what
    it says about its models (``model_entries``, ``props``)."""
    p = ScriptedProvider().start()
    yield p
    p.stop()


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEFAULT_ENV, raising=False)


def settings(tmp_path: Path, **kw: Any) -> Any:
    return SimpleNamespace(data_dir=tmp_path, limits=DEFAULT_LIMITS, config_file=None, **kw)


def built(spec: UpstreamSpec, tmp_path: Path, **kw: Any) -> UpstreamEngine:
    engine = build_engine(spec, settings(tmp_path, **kw))
    asyncio.run(engine.aclose())
    return engine


def spec(*urls: str, **kw: Any) -> UpstreamSpec:
    return UpstreamSpec(served_model="up", upstream_model="served-name", urls=list(urls), **kw)


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def test_vllm_and_sglang_say_max_model_len(provider, tmp_path, caplog):
    provider.model_entries = [{"id": "other", "max_model_len": 8192},
                              {"id": "served-name", "object": "model", "max_model_len": 40960}]
    with caplog.at_level(logging.INFO, "lmspd.upstream"):
        engine = built(spec(provider.url), tmp_path)
    assert engine.info.context_window == 40960
    assert f"model up: context window 40960 (max_model_len from {provider.url}/models)" in caplog.text
    assert provider.requests[0].path == "/v1/models"


def test_llama_cpp_server_says_its_slot_window_in_props(provider, tmp_path, caplog):
    provider.model_entries = [{"id": "model.gguf", "owned_by": "llamacpp", "meta": {"n_ctx_train": 131072}}]
    provider.props = {"default_generation_settings": {"n_ctx": 4096}, "total_slots": 4}
    with caplog.at_level(logging.INFO, "lmspd.upstream"):
        assert built(spec(provider.url), tmp_path).info.context_window == 4096
    assert "n_ctx from http://127.0.0.1:" in caplog.text and "/props" in caplog.text
    provider.props = None  # an older server: the trained length is the bound it gives
    assert built(spec(provider.url), tmp_path).info.context_window == 131072


def test_a_base_url_with_a_query_is_asked_with_the_query_after_the_path(provider):
    """Azure-style ``?api-version=``: ``/models`` and ``/props`` go before
    it (they once went after it, into the query, and missed the server);
    the start-up log's URL leaves the query out."""
    provider.model_entries = [{"id": "served-name", "max_model_len": 40960}]
    window = discover_window([provider.url + "?api-version=1"], "served-name")
    assert window is not None and window.tokens == 40960
    assert window.source == f"max_model_len from {provider.url}/models"
    provider.model_entries = [{"id": "model.gguf", "owned_by": "llamacpp"}]
    provider.props = {"default_generation_settings": {"n_ctx": 4096}}
    window = discover_window([provider.url + "?api-version=1"], "served-name")
    assert window is not None and window.tokens == 4096 and "api-version" not in window.source
    assert [r.path for r in provider.requests] == ["/v1/models", "/v1/models", "/props"]


def test_several_endpoints_report_the_smallest(provider, tmp_path):
    other = ScriptedProvider().start()
    try:
        provider.model_entries = [{"id": "served-name", "max_model_len": 32768}]
        other.model_entries = [{"id": "served-name", "max_model_len": 16384}]
        assert built(spec(provider.url, other.url, dead_url()), tmp_path).info.context_window == 16384
    finally:
        other.stop()


def test_the_provider_key_goes_with_the_question(provider, tmp_path, monkeypatch):
    monkeypatch.setenv(DEFAULT_ENV, "sk-window-key")
    provider.model_entries = [{"id": "served-name", "max_model_len": 2048}]
    assert built(spec(provider.url), tmp_path).info.context_window == 2048
    assert provider.requests[0].headers["authorization"] == "Bearer sk-window-key"


def test_a_provider_that_says_nothing_gets_the_default(provider, tmp_path, caplog):
    with caplog.at_level(logging.INFO, "lmspd.upstream"):
        assert built(spec(provider.url), tmp_path).info.context_window == DEFAULT_CONTEXT_WINDOW
        assert built(spec(dead_url()), tmp_path).info.context_window == DEFAULT_CONTEXT_WINDOW
    assert f"context window {DEFAULT_CONTEXT_WINDOW} (the default: the provider did not say" in caplog.text


def test_a_given_window_wins_and_asks_nothing(provider, tmp_path, caplog):
    provider.model_entries = [{"id": "served-name", "max_model_len": 40960}]
    with caplog.at_level(logging.INFO, "lmspd.upstream"):
        assert built(spec(provider.url, context_window=1000), tmp_path).info.context_window == 1000
    assert "context window 1000 (given: --upstream-context-window)" in caplog.text
    assert provider.requests == []


def test_the_flag_and_the_config_key_set_it(monkeypatch, tmp_path):
    seen: list[Any] = []
    monkeypatch.setattr(lmspd.server, "serve", lambda s: seen.append(s) or 0)
    assert main(["serve", "--engine", "upstream", "--upstream-url", "http://127.0.0.1:9/v1", "--upstream-model", "m",
                 "--upstream-context-window", "65536"]) == 0
    (from_flags,) = specs_from_settings(seen[0])
    assert isinstance(from_flags, UpstreamSpec) and from_flags.context_window == 65536
    assert main(["serve", "--engine", "upstream", "--upstream-url", "http://127.0.0.1:9/v1",
                 "--upstream-model", "m"]) == 0
    assert specs_from_settings(seen[1])[0].context_window is None  # type: ignore[union-attr]
    config = tmp_path / "models.toml"
    config.write_text('[models.q]\nengine = "upstream"\nurl = "http://127.0.0.1:9/v1"\nupstream_model = "m"\n')
    (from_file,) = load_config_file(config)
    assert isinstance(from_file, UpstreamSpec) and from_file.context_window is None


@pytest.mark.parametrize("flags", [["--upstream-context-window", "0"],
                                   ["--engine", "llama", "--upstream-context-window", "4096"]])
def test_the_flag_s_mistakes_are_usage_errors(flags, capsys):
    upstream = ["--engine", "upstream", "--upstream-url", "http://127.0.0.1:9/v1", "--upstream-model", "m"]
    with pytest.raises(SystemExit) as exited:
        main(["serve", *(flags if "llama" in flags else upstream + flags)])
    assert exited.value.code == 2
    assert "--upstream-context-window" in capsys.readouterr().err


def _serve_raw(answer: Callable[[socket.socket], None]) -> tuple[str, threading.Thread, socket.socket]:
    """A listening socket whose every connection gets ``answer``."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def run() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                with contextlib.suppress(OSError):
                    answer(conn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{server.getsockname()[1]}/v1", thread, server


def test_an_endpoint_that_answers_another_protocol_or_trickles_says_nothing_in_time() -> None:
    """Discovery is best effort: another protocol on the port (http.client's
    BadStatusLine, no OSError) stopped the server's start; a body trickling
    in held it for as long as it trickled. Both are "did not say", within
    the one deadline, and the endpoints are asked side by side."""
    ssh, _, ssh_server = _serve_raw(lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n"))

    def trickle(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
        for _ in range(100):
            conn.sendall(b" ")
            time.sleep(0.1)

    slow, _, slow_server = _serve_raw(trickle)
    try:
        started = time.monotonic()
        assert discover_window([ssh, slow, slow], "m", timeout_s=1.0) is None
        assert time.monotonic() - started < 2.5  # one deadline for all, not one per endpoint or per read
    finally:
        ssh_server.close()
        slow_server.close()
