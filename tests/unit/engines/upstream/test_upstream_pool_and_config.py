"""Routing over several endpoints, the provider key, the model config file,
and the queue that lets an upstream model run many generations at once."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest

from lmspd.config import Settings
from lmspd.core.limits import QueueLimits
from lmspd.engines.base import ModelQueue
from lmspd.engines.specs import ConfigError, LlamaSpec, load_config_file, specs_from_settings
from lmspd.engines.upstream.credentials import (
    DEFAULT_ENV,
    CredentialError,
    Secret,
    clear_key,
    resolve_key,
    save_key,
)
from lmspd.engines.upstream.engine import UpstreamSpec
from lmspd.engines.upstream.pool import EndpointPool, join_url, normalize_base_url, redact_url

URLS = ["http://a:1/v1", "http://b:2/v1", "http://c:3/v1"]

# -- routing ------------------------------------------------------------------------


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_down_endpoints_back_off_then_get_retried():
    clock = Clock()
    pool = EndpointPool(URLS[:2], clock=clock)
    a, b = pool.endpoints
    pool.mark_down(a)
    assert pool.live() == [b]
    clock.now += 60
    assert pool.live() == [a, b], "back-off passed: tried again"
    pool.mark_down(b)
    pool.mark_down(a)
    assert pool.live() == [a, b], "all down: still try them"
    assert pool.live(exclude=[0, 1]) == []


def test_going_down_starts_a_new_epoch():
    pool = EndpointPool(URLS[:1])
    (a,) = pool.endpoints
    pool.mark_down(a)
    pool.mark_down(a)  # still the same outage
    assert a.epoch == 1
    pool.mark_up(a)
    pool.mark_down(a)
    assert a.epoch == 2


def test_urls_are_normalized_and_redacted():
    assert normalize_base_url("http://h:8000/v1/chat/completions") == "http://h:8000/v1"
    assert normalize_base_url("https://h/v1/") == "https://h/v1"
    with pytest.raises(ValueError):
        normalize_base_url("ftp://h/v1")
    with pytest.raises(ValueError, match="not in the URL"):
        normalize_base_url("http://user:sk-secret@h/v1")
    assert redact_url("http://user:pw@h:9/v1?key=1") == "http://h:9/v1"


def test_a_query_in_the_base_url_follows_every_path():
    base = normalize_base_url("https://h/openai/deployments/d/chat/completions?api-version=2024-06-01#x")
    assert base == "https://h/openai/deployments/d?api-version=2024-06-01"
    assert join_url(base, "/chat/completions") == (
        "https://h/openai/deployments/d/chat/completions?api-version=2024-06-01")
    assert join_url("http://h:8000/v1", "/models") == "http://h:8000/v1/models"
    endpoint = EndpointPool([base]).endpoints[0]
    assert endpoint.url("/models") == "https://h/openai/deployments/d/models?api-version=2024-06-01"
    assert endpoint.label == "https://h/openai/deployments/d"


# -- the key ------------------------------------------------------------------------


def test_saved_key_is_owner_only_and_resolves(tmp_path, monkeypatch):
    monkeypatch.delenv(DEFAULT_ENV, raising=False)
    assert resolve_key(tmp_path) is None
    path = save_key(tmp_path, "  sk-saved-123\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert resolve_key(tmp_path) == Secret("sk-saved-123")
    save_key(tmp_path, "sk-other", name="vllm")
    assert resolve_key(tmp_path, name="vllm") == Secret("sk-other")
    monkeypatch.setenv(DEFAULT_ENV, "sk-from-env")
    assert resolve_key(tmp_path) == Secret("sk-from-env"), "the environment wins"
    assert clear_key(tmp_path) and not clear_key(tmp_path)


def test_a_config_entrys_named_key_wins_over_the_environment(tmp_path, monkeypatch):
    # key_name is the more specific choice: LMSPD_UPSTREAM_API_KEY is for
    # every model that names none.
    monkeypatch.setenv(DEFAULT_ENV, "sk-from-env")
    save_key(tmp_path, "sk-named", name="vllm")
    save_key(tmp_path, "sk-default")
    assert resolve_key(tmp_path, name="vllm") == Secret("sk-named")
    assert resolve_key(tmp_path) == Secret("sk-from-env")
    # A name with no saved key: the environment's, never the default file's.
    assert resolve_key(tmp_path, name="sglang") == Secret("sk-from-env")
    monkeypatch.delenv(DEFAULT_ENV)
    assert resolve_key(tmp_path, name="sglang") is None


def test_a_key_file_others_can_read_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(DEFAULT_ENV, raising=False)
    path = save_key(tmp_path, "sk-leaky")
    os.chmod(path, 0o644)
    with pytest.raises(CredentialError, match="chmod 600") as caught:
        resolve_key(tmp_path)
    assert "sk-leaky" not in str(caught.value)


def test_named_env_must_be_set_and_bad_keys_are_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("MY_PROVIDER_KEY", raising=False)
    with pytest.raises(CredentialError, match="MY_PROVIDER_KEY"):
        resolve_key(tmp_path, env="MY_PROVIDER_KEY")
    with pytest.raises(CredentialError) as caught:
        save_key(tmp_path, "two words")
    assert "two words" not in str(caught.value)


def test_secret_never_prints():
    s = Secret("sk-very-secret")
    assert "sk-very" not in repr(s) and "sk-very" not in str(s) and "sk-very" not in f"{s}"
    assert s.reveal() == "sk-very-secret"


# -- the config file --------------------------------------------------------------------


def test_toml_config_maps_models_to_engines(tmp_path):
    cfg = tmp_path / "models.toml"
    cfg.write_text('''
[models.local]
engine = "llama"
model = "smollm2-135m-instruct"
ctx = 2048

[models.remote]
engine = "upstream"
urls = ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"]
upstream_model = "Qwen/Qwen3-8B"
profile = "generic"
api_key_env = "VLLM_KEY"
idle_timeout_s = 30
max_concurrency = 64
''')
    local, remote = load_config_file(cfg)
    assert local == LlamaSpec(served_model="local", model="smollm2-135m-instruct", ctx=2048)
    assert isinstance(remote, UpstreamSpec) and remote.served_model == "remote"
    assert remote.urls == ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"]
    assert remote.api_key_env == "VLLM_KEY" and remote.idle_timeout_s == 30 and remote.max_concurrency == 64


def test_routing_settings_from_the_config_file(tmp_path):
    cfg = tmp_path / "models.toml"
    cfg.write_text('[models.r]\nengine = "upstream"\nurls = ["http://a/v1", "http://b/v1"]\nupstream_model = "m"\n'
                   'routing = "round-robin"\naffinity_slack = 2\nprefix_threshold = 0.75\n')
    (spec,) = load_config_file(cfg)
    assert spec.routing_settings.policy == "round-robin"
    assert (spec.routing_settings.affinity_slack, spec.routing_settings.prefix_threshold) == (2, 0.75)
    cfg.write_text('[models.r]\nengine = "upstream"\nurl = "http://a/v1"\nupstream_model = "m"\nrouting = "random"\n')
    with pytest.raises(ConfigError, match="unknown routing policy"):
        load_config_file(cfg)


def test_json_config_and_single_url(tmp_path):
    cfg = tmp_path / "models.json"
    cfg.write_text('{"models": {"r": {"engine": "upstream", "url": "http://h/v1", "upstream_model": "m"}}}')
    (spec,) = load_config_file(cfg)
    assert spec.urls == ["http://h/v1"] and spec.upstream_model == "m"


@pytest.mark.parametrize("text, message", [
    ('[models.r]\nengine = "upstream"\nurl = "http://h/v1"\nupstream_model = "m"\napi_key = "sk-x"\n',
     "keys never go in this file"),
    ('[models.r]\nengine = "upstream"\nupstream_model = "m"\n', "url"),
    ('[models.r]\nengine = "upstream"\nurl = "http://h/v1"\n', "upstream_model"),
    ('[models.r]\nengine = "gpu"\n', "engine must be"),
    ('[models.r]\nengine = "upstream"\nurl = "http://h/v1"\nupstream_model = "m"\nprofile = "x"\n',
     "unknown upstream profile"),
    ('[models.r]\nengine = "llama"\nctx = "big"\n', "wrong type"),
    # Bounded in the file as the flags are.
    ('[models.r]\nengine = "upstream"\nurl = "http://h/v1"\nupstream_model = "m"\nidle_timeout_s = 0\n',
     "idle_timeout_s must be > 0"),
    ('[models.r]\nengine = "upstream"\nurl = "http://h/v1"\nupstream_model = "m"\nconnect_timeout_s = -1\n',
     "connect_timeout_s must be > 0"),
    ('[models.r]\nengine = "upstream"\nurl = "http://h/v1"\nupstream_model = "m"\nhealth_interval_s = -5\n',
     "health_interval_s must be >= 0"),
    ('[other]\n', "one table 'models'"),
    ('not toml [', "not valid TOML"),
])
def test_config_errors_are_plain(tmp_path, text, message):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_config_file(cfg)
    assert "sk-x" not in str(caught.value)


def test_flags_make_one_upstream_spec():
    settings = Settings(engine="upstream", upstream_urls=["http://h/v1"], upstream_model="m", served_model="s",
                        upstream_idle_timeout_s=5)
    (spec,) = specs_from_settings(settings)
    assert spec.served_model == "s" and spec.idle_timeout_s == 5 and spec.routing == "affinity"
    settings.upstream_routing = "least-loaded"
    assert specs_from_settings(settings)[0].routing_settings.policy == "least-loaded"
    settings.served_model = None
    assert specs_from_settings(settings)[0].served_model == "m"
    assert isinstance(specs_from_settings(Settings())[0], LlamaSpec)


# -- the queue --------------------------------------------------------------------------


def test_queue_runs_up_to_its_concurrency_then_queues_fifo():
    async def go():
        queue = ModelQueue(QueueLimits(max_pending=1), concurrency=2)
        first, second = queue.admit(), queue.admit()
        await first.wait()
        await second.wait()
        assert queue.running == 2 and queue.busy
        third = queue.admit()
        waiter = asyncio.ensure_future(third.wait())
        await asyncio.sleep(0)
        assert not waiter.done() and queue.pending == 1
        with pytest.raises(Exception) as caught:
            queue.admit()
        assert getattr(caught.value, "code", None) == "server_overloaded"
        first.release()
        await waiter
        assert queue.running == 2 and queue.pending == 0
        second.release()
        third.release()
        assert queue.running == 0 and not queue.busy

    asyncio.run(go())


# -- the CLI ------------------------------------------------------------------------------


def test_config_set_key_reads_stdin_and_never_echoes(tmp_path, monkeypatch, capsys):
    import io

    from lmspd.cli import main

    monkeypatch.delenv(DEFAULT_ENV, raising=False)
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-from-stdin-42\n"))
    assert main(["config", "set-key", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "sk-from-stdin-42" not in out.out + out.err
    assert resolve_key(tmp_path) == Secret("sk-from-stdin-42")
    assert main(["config", "clear-key", "--data-dir", str(tmp_path)]) == 0
    assert resolve_key(tmp_path) is None


@pytest.mark.parametrize("argv", [
    ["serve", "--engine", "upstream", "--upstream-model", "m"],
    ["serve", "--upstream-url", "http://h/v1"],
    ["serve", "--config", "x.toml", "--model", "y"],
    ["serve", "--repetition-window", "-1"],
    ["serve", "--config", "x.toml", "--upstream-routing", "round-robin"],
    ["serve", "--engine", "upstream", "--upstream-url", "http://h/v1", "--upstream-model", "m",
     "--upstream-routing", "random"],
])
def test_serve_flag_mistakes_are_usage_errors(argv):
    from lmspd.cli import main

    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
