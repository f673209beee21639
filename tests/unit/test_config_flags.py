"""``--config`` names every model and its settings: a per-model flag beside
it would be ignored, so it is refused, naming the flag and the config key to
use instead; the flags that apply to every model (sampling, the KV cache)
still do."""

from __future__ import annotations

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
