"""``--temperature``, ``--top-p``, ``--top-k``, ``--min-p`` and a config
file's keys of the same names: what a request leaves unset is sampled
with, over the model's own settings (its GGUF's), parsed and checked
before anything loads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import lmspd.server
from lmspd.cli import main
from lmspd.core.conversation import Sampling, SamplingDefaults
from lmspd.engines.specs import ConfigError, load_config_file, spec_sampling


def settings_of(monkeypatch: pytest.MonkeyPatch, *flags: str) -> Any:
    seen: list[Any] = []
    monkeypatch.setattr(lmspd.server, "serve", lambda settings: seen.append(settings) or 0)
    assert main(["serve", *flags]) == 0
    return seen[0]


def test_the_flags_become_the_server_s_sampling_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_of(monkeypatch).sampling == SamplingDefaults()
    s = settings_of(monkeypatch, "--temperature", "0.7", "--top-p", "0.8", "--top-k", "20", "--min-p", "0")
    assert s.sampling == SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0)


@pytest.mark.parametrize("flags", [["--temperature", "2.5"], ["--top-p", "-0.1"], ["--top-k", "-1"],
                                   ["--min-p", "1.5"], ["--temperature", "nan"]])
def test_values_out_of_range_are_refused(capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", *flags])
    assert exited.value.code == 2
    assert f"{flags[0]} must be between" in capsys.readouterr().err


def test_the_operator_s_settings_win_field_by_field_and_a_request_s_over_both() -> None:
    model = SamplingDefaults(temperature=0.6, top_k=20, top_p=0.95)
    merged = model.under(SamplingDefaults(temperature=0.3, top_k=0))
    assert merged == SamplingDefaults(temperature=0.3, top_k=0, top_p=0.95)
    unset = Sampling()
    assert (merged.temperature_of(unset), merged.top_k_of(unset), merged.top_p_of(unset)) == (0.3, 0, 0.95)
    given = Sampling(temperature=1.1, top_p=0.5, top_k=5, min_p=0.1)
    assert (merged.temperature_of(given), merged.top_p_of(given), merged.top_k_of(given),
            merged.min_p_of(given)) == (1.1, 0.5, 5, 0.1)


def test_the_flags_are_refused_for_a_provider(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--engine", "upstream", "--upstream-url", "http://127.0.0.1:9/v1", "--upstream-model", "m",
              "--temperature", "0.5"])
    assert "are for local models" in capsys.readouterr().err


def test_a_config_file_sets_a_model_s_sampling_over_the_flags(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text('[models.coder]\nmodel = "smollm2-135m-instruct"\ntemperature = 0.7\ntop_k = 20\n')
    (spec,) = load_config_file(config)
    assert spec.sampling == SamplingDefaults(temperature=0.7, top_k=20)
    flags = SimpleNamespace(sampling=SamplingDefaults(temperature=0.2, min_p=0.05))
    assert spec_sampling(spec, flags) == SamplingDefaults(temperature=0.7, top_k=20, min_p=0.05)
    config.write_text('[models.coder]\nmodel = "smollm2-135m-instruct"\ntop_p = 1.5\n')
    with pytest.raises(ConfigError, match=r"models\.coder: top_p must be between 0 and 1"):
        load_config_file(config)
    config.write_text('[models.coder]\nmodel = "smollm2-135m-instruct"\ntop_k = 2.5\n')
    with pytest.raises(ConfigError, match=r"models\.coder\.top_k has the wrong type"):
        load_config_file(config)
