"""``--config`` names every model and its settings: a per-model flag beside
it would be ignored, so it is refused, naming the flag and the config key to
use instead; the flags that apply to every model (sampling, the KV cache)
still do. Beside them: the local-model flags refused with --engine upstream, and
``lmspd config``'s errors."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

import lmspd.server
from lmspd.cli import main
from lmspd.core.conversation import SamplingDefaults

PER_MODEL = [
    (["--ctx", "4096"], "ctx"),
    (["--threads", "2"], "threads"),
    (["--parallel", "2"], "parallel"),
    (["--gpu-layers", "0"], "gpu_layers"),
    (["--flash-attn", "on"], "flash_attn"),
    (["--kv-type", "q8_0"], "kv_type"),
    (["--rope-scaling", "none"], "rope_scaling"),
    (["--chat-template", "t.jinja"], "chat_template"),
    (["--served-model", "x"], "[models.ID]"),
    (["--upstream-profile", "openai"], "profile"),
    (["--upstream-idle-timeout", "5"], "idle_timeout_s"),
    (["--upstream-progress-timeout", "300"], "progress_timeout_s"),
    (["--upstream-context-window", "4096"], "context_window"),
    (["--model", "y"], "model"),
    (["--upstream-routing", "round-robin"], "routing"),
]


@pytest.mark.parametrize(("flag", "key"), PER_MODEL, ids=[f[0] for f, _ in PER_MODEL])
def test_a_per_model_flag_is_refused_beside_config(flag: list[str], key: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--config", "models.toml", *flag])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"drop {flag[0]} " in err and key in err, err


def test_the_message_names_every_flag_given(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--config", "models.toml", "--ctx", "4096", "--threads", "2", "--kv-type", "q8_0"])
    err = capsys.readouterr().err
    assert "drop --ctx, --threads, --kv-type (in the file, each model's entry: ctx, threads, kv_type)" in err


def test_flags_for_every_model_still_apply_under_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(lmspd.server, "serve", lambda settings: seen.append(settings) or 0)
    assert main(["serve", "--config", str(tmp_path / "models.toml"), "--temperature", "0.3", "--kv-ram-mb", "64",
                 "--swa-full", "--speculative", "off"]) == 0
    (settings,) = seen
    assert settings.config_file == tmp_path / "models.toml"
    assert settings.sampling == SamplingDefaults(temperature=0.3)
    assert (settings.kv_ram_mb, settings.swa_full, settings.speculative) == (64, True, "off")


def test_the_upstream_progress_timeout_flag_reaches_the_settings(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(lmspd.server, "serve", lambda settings: seen.append(settings) or 0)
    upstream = ["serve", "--engine", "upstream", "--upstream-url", "http://h/v1", "--upstream-model", "m"]
    assert main([*upstream, "--upstream-progress-timeout", "90"]) == 0
    assert seen[0].upstream_progress_timeout_s == 90
    with pytest.raises(SystemExit) as exited:
        main([*upstream, "--upstream-progress-timeout", "0"])
    assert exited.value.code == 2 and "--upstream-progress-timeout must be > 0" in capsys.readouterr().err


UPSTREAM = ["serve", "--engine", "upstream", "--upstream-url", "http://h/v1", "--upstream-model", "m"]
LOCAL_ONLY = [
    ["--model", "smollm2-135m-instruct"], ["--ctx", "4096"], ["--threads", "2"], ["--parallel", "2"],
    ["--gpu-layers", "0"], ["--flash-attn", "on"], ["--kv-type", "q8_0"], ["--rope-scaling", "none"],
    ["--chat-template", "t.jinja"], ["--models-max-mem", "4096"], ["--models-idle-s", "60"], ["--swa-full"],
    ["--no-prefix-cache"], ["--kv-ram-mb", "64"], ["--speculative", "off"], ["--repetition-window", "0"],
]


@pytest.mark.parametrize("flag", LOCAL_ONLY, ids=[f[0] for f in LOCAL_ONLY])
def test_a_local_model_flag_is_refused_with_an_upstream_engine(flag: list[str], monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The provider runs the model: the flag was ignored without a word."""
    monkeypatch.setattr(lmspd.server, "serve", lambda settings: pytest.fail("served"))
    with pytest.raises(SystemExit) as exited:
        main([*UPSTREAM, *flag])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag[0]}: for local models (--engine llama)" in err, err


def test_every_local_model_flag_given_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([*UPSTREAM, "--ctx", "4096", "--model", "x", "--swa-full"])
    assert "--model, --ctx, --swa-full: for local models" in capsys.readouterr().err


def test_flags_an_upstream_engine_reads_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(lmspd.server, "serve", lambda settings: seen.append(settings) or 0)
    # Their defaults spelt out, --models-dir (/v1/models lists what is found there), the store and the edge.
    assert main([*UPSTREAM, "--ctx", "auto", "--gpu-layers", "all", "--flash-attn", "auto", "--models-dir", "/tmp",
                 "--max-queue", "4", "--served-model", "mine"]) == 0
    assert seen[0].served_model == "mine"


def test_config_set_key_into_a_data_dir_that_is_a_file_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``lmspd config set-key --data-dir FILE`` ended in a NotADirectoryError traceback."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-from-stdin-42\n"))
    assert main(["config", "set-key", "--data-dir", str(not_a_dir)]) == 2
    assert capsys.readouterr().err == f"lmspd: {not_a_dir}/keys: Not a directory\n"
