"""What a config entry and the per-model flags may say: one model per served
id (two under one id are refused at start, naming both), served ids that are
safe names (an id names a KV checkpoint folder), plain messages for a wrong
value, and an entry's paths relative to the config file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import lmspd.engines.llama.engine as llama_engine
import lmspd.server
from lmspd.cli import main
from lmspd.config import Settings
from lmspd.engines.llama.models import resolve_model
from lmspd.engines.specs import (
    ConfigError,
    LlamaSpec,
    build_engine,
    check_served_id,
    kv_dir,
    kv_folder,
    load_config_file,
    specs_from_settings,
)
from lmspd.server import build_service

BUNDLED = "smollm2-135m-instruct"


@pytest.fixture
def no_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """``lmspd serve`` stops at its flags: were one let through, nothing starts."""
    monkeypatch.setattr(lmspd.server, "serve", lambda settings: 0)


def _config(tmp_path: Path, text: str, name: str = "models.toml") -> Path:
    cfg = tmp_path / name
    cfg.write_text(text)
    return cfg


# -- one model per served id --------------------------------------------------------------


@pytest.fixture
def two_tiny(tmp_path: Path) -> tuple[Path, Path]:
    """Two different paths to a GGUF, both named Tiny.gguf (served as "tiny")."""
    source = resolve_model(BUNDLED)[1]
    paths = []
    for folder in ("m1", "m2"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "Tiny.gguf").symlink_to(source)
        paths.append(tmp_path / folder / "Tiny.gguf")
    return paths[0], paths[1]


def test_two_models_with_one_file_name_are_refused_naming_both(tmp_path: Path, two_tiny: tuple[Path, Path]) -> None:
    first, second = two_tiny
    settings = Settings(data_dir=tmp_path, model=str(first), extra_models=[str(second)])
    with pytest.raises(ConfigError) as caught:
        build_service(settings)
    message = str(caught.value)
    assert "'tiny'" in message and f"--model #1 ({first})" in message and f"--model #2 ({second})" in message
    assert "the same model twice" not in message


def test_the_same_model_twice_is_refused(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, model=BUNDLED, extra_models=[BUNDLED])
    with pytest.raises(ConfigError, match=r"--model #1 .* and --model #2 .*\(the same model twice\)"):
        build_service(settings)


def test_served_model_taking_another_models_id_is_refused(tmp_path: Path, two_tiny: tuple[Path, Path]) -> None:
    settings = Settings(data_dir=tmp_path, model=str(two_tiny[0]), served_model=BUNDLED, extra_models=[BUNDLED])
    with pytest.raises(ConfigError) as caught:
        build_service(settings)
    assert f"--served-model {BUNDLED} (for --model #1" in str(caught.value) and "--model #2" in str(caught.value)


def test_distinct_ids_are_all_served(tmp_path: Path, two_tiny: tuple[Path, Path]) -> None:
    settings = Settings(data_dir=tmp_path, model=str(two_tiny[0]), served_model="tiny-1",
                        extra_models=[str(two_tiny[1])])
    assert sorted(build_service(settings).models) == ["tiny", "tiny-1"]


def test_two_local_ids_that_differ_only_in_case_are_refused(tmp_path: Path, two_tiny: tuple[Path, Path]) -> None:
    """Their KV checkpoint folders (named by the id) are one folder on macOS's
    default file system, where each model deleted the other's checkpoints
    (a checkpoint with another model's fingerprint is removed on sight)."""
    settings = Settings(data_dir=tmp_path, model=str(two_tiny[0]), served_model="Tiny",
                        extra_models=[str(two_tiny[1])])
    with pytest.raises(ConfigError) as caught:
        build_service(settings)
    message = str(caught.value)
    assert "'Tiny' (--served-model Tiny" in message and "'tiny' (--model #2" in message
    assert "differ only in letter case" in message


def test_a_repeated_json_key_is_refused(tmp_path: Path) -> None:
    cfg = _config(tmp_path, '{"models": {"a": {"model": "x.gguf"}, "a": {"model": "y.gguf"}}}', "models.json")
    with pytest.raises(ConfigError, match=r"the key 'a' is given twice"):
        load_config_file(cfg)
    cfg.write_text('{"models": {"a": {"ctx": 1024, "ctx": 2048}}}')
    with pytest.raises(ConfigError, match=r"the key 'ctx' is given twice"):
        load_config_file(cfg)


@pytest.mark.parametrize("text", ['[models.a]\nctx = 1\n[models.a]\nctx = 2\n',
                                  '[models.a]\nctx = 1\n[models."a"]\nctx = 2\n',
                                  '[models.a]\nctx = 1\nctx = 2\n'])
def test_a_repeated_toml_key_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config_file(_config(tmp_path, text))


# -- served ids ---------------------------------------------------------------------------

GOOD_IDS = ["smollm2", "llama3.2:latest", "Qwen/Qwen3-8B", "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
            "claude-3-5-sonnet@20240620", "a_b+c", "x" * 128]
BAD_IDS = ["", "/tmp", "../../x", "..", ".", "a/../b", "a/./b", "a//b", "a/", ".hidden", "a/.b", "a b", "a\nb",
           "a\x00b", "a\\b", "x" * 257]


@pytest.mark.parametrize("served", GOOD_IDS)
def test_real_model_names_are_valid_ids(tmp_path: Path, served: str) -> None:
    assert check_served_id(served, "here") == served
    (spec,) = load_config_file(_config(tmp_path, f'[models."{served}"]\nmodel = "{BUNDLED}"\n'))
    assert spec.served_model == served


@pytest.mark.parametrize("served", BAD_IDS)
def test_unsafe_ids_are_refused_in_a_config_entry(tmp_path: Path, served: str) -> None:
    import json

    cfg = _config(tmp_path, json.dumps({"models": {served: {"model": BUNDLED}}}), "models.json")
    with pytest.raises(ConfigError, match="is not a valid served model id") as caught:
        load_config_file(cfg)
    assert str(cfg) in str(caught.value)


@pytest.mark.parametrize("served", ["", "/tmp", "../../x", "a b"])
@pytest.mark.usefixtures("no_serving")
def test_unsafe_ids_are_refused_by_the_flags(served: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--served-model", served])
    assert exited.value.code == 2
    assert "--served-model" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--served-model"):
        specs_from_settings(Settings(served_model=served))
    with pytest.raises(ConfigError, match="--served-model"):
        specs_from_settings(Settings(engine="upstream", upstream_urls=["http://h/v1"], upstream_model="m",
                                     served_model=served))


def test_an_upstream_model_name_that_is_no_id_needs_served_model() -> None:
    settings = Settings(engine="upstream", upstream_urls=["http://h/v1"], upstream_model="/models/llama")
    with pytest.raises(ConfigError, match="give one with --served-model"):
        specs_from_settings(settings)
    settings.served_model = "llama"
    assert specs_from_settings(settings)[0].served_model == "llama"


def test_the_kv_folder_is_one_folder_under_the_kv_dir() -> None:
    assert kv_folder("llama3.2:latest") == "llama3.2:latest"
    assert kv_folder("Qwen/Qwen3-8B") == "Qwen%2FQwen3-8B"
    for served in ("../x", "/tmp", ""):
        with pytest.raises(ConfigError):
            kv_folder(served)


def _capture_engine(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    built: list[dict[str, Any]] = []

    def fake(served: str, path: Path, **kwargs: Any) -> object:
        built.append({"served": served, **kwargs})
        return object()

    monkeypatch.setattr(llama_engine, "LlamaEngine", fake)
    return built


def test_a_local_models_kv_folder_is_mapped_from_its_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = _capture_engine(monkeypatch)
    settings = Settings(data_dir=tmp_path)
    build_engine(LlamaSpec(served_model="Qwen/Qwen3-8B", model=BUNDLED), settings, placement=object())
    assert built[0]["cache"].disk_dir == tmp_path / "kv" / "Qwen%2FQwen3-8B"
    with pytest.raises(ConfigError, match="not a valid served model id"):
        build_engine(LlamaSpec(served_model="../../x", model=BUNDLED), settings, placement=object())
    assert len(built) == 1


# -- plain messages for wrong values -----------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ('[models.a]\nengine = ["llama"]\n', r"models\.a\.engine must be 'llama' or 'upstream', not \['llama'\]"),
    ('[models.a]\nengine = 1\n', r"models\.a\.engine must be"),
    ('[models.a]\nthreads = 0\n', r"models\.a\.threads must be >= 1"),
    ('[models.a]\nthreads = -3\n', r"models\.a\.threads must be >= 1"),
    ('[models.u]\nengine = "upstream"\nurl = "http://h/v1"\nupstream_model = ""\n',
     r"models\.u\.upstream_model must not be empty"),
    ('[models.u]\nengine = "upstream"\nurl = "http://h/v1"\nupstream_model = "m"\napi_key_env = ""\n',
     r"models\.u\.api_key_env must not be empty"),
    ('[models.u]\nengine = "upstream"\nurl = "ftp://x"\nupstream_model = "m"\n', r"models\.u: .*must be an http\(s\) URL"),
    ('[models.u]\nengine = "upstream"\nurls = ["http://h/v1", "h:8000"]\nupstream_model = "m"\n',
     r"models\.u: .*must be an http\(s\) URL"),
])
def test_wrong_values_name_the_entry_and_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config_file(_config(tmp_path, text))


def test_threads_one_is_accepted(tmp_path: Path) -> None:
    (spec,) = load_config_file(_config(tmp_path, "[models.a]\nthreads = 1\n"))
    assert isinstance(spec, LlamaSpec) and spec.threads == 1


@pytest.mark.parametrize("threads", ["0", "-3"])
@pytest.mark.usefixtures("no_serving")
def test_the_threads_flag_must_be_positive(threads: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--threads", threads])
    assert exited.value.code == 2 and "--threads must be >= 1" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--threads must be >= 1"):
        specs_from_settings(Settings(threads=int(threads)))


def test_the_upstream_url_flag_must_be_http() -> None:
    settings = Settings(engine="upstream", upstream_urls=["ftp://x"], upstream_model="m")
    with pytest.raises(ConfigError, match=r"--upstream-url: .*must be an http\(s\) URL"):
        specs_from_settings(settings)


# -- paths relative to the config file ---------------------------------------------------


def test_paths_in_an_entry_are_relative_to_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "conf"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    (spec,) = load_config_file(_config(folder, '[models.a]\nmodel = "sub/Model.GGUF"\nchat_template = "t.jinja"\n'))
    assert isinstance(spec, LlamaSpec)
    assert spec.model == str(folder / "sub" / "Model.GGUF")
    assert spec.chat_template == str(folder / "t.jinja")


def test_absolute_and_home_paths_and_names_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (a, b) = load_config_file(_config(tmp_path, f'[models.a]\nmodel = "{BUNDLED}"\nchat_template = "/abs/t.jinja"\n'
                                                '[models.b]\nmodel = "~/m.gguf"\nchat_template = "~/t.jinja"\n'))
    assert isinstance(a, LlamaSpec) and isinstance(b, LlamaSpec)
    assert (a.model, a.chat_template) == (BUNDLED, "/abs/t.jinja")
    assert (b.model, b.chat_template) == (str(tmp_path / "home" / "m.gguf"), str(tmp_path / "home" / "t.jinja"))


def test_a_long_id_gets_a_folder_name_the_file_system_takes() -> None:
    long = "mradermacher/" + "Llama-3.1-Nemotron-70B-Instruct-HF-abliterated-i1-GGUF/" * 4 + "x-Q4_K_M"
    assert 200 < len(long) <= 256
    folder = kv_folder(long)
    assert len(folder) <= 200 and folder != kv_folder(long[:-1] + "y")


def test_checkpoints_in_the_old_nested_folder_move_once(tmp_path: Path) -> None:
    """Before ids were checked, ``Qwen/Qwen3-8B``'s checkpoints lived in
    ``kv/Qwen/Qwen3-8B``: they move to the new folder (not a cold start,
    not left unpruned), and the emptied folder goes."""
    old = tmp_path / "Qwen" / "Qwen3-8B"
    old.mkdir(parents=True)
    (old / "cp.kv").write_bytes(b"state")
    folder = kv_dir(tmp_path, "Qwen/Qwen3-8B")
    assert folder == tmp_path / "Qwen%2FQwen3-8B" and (folder / "cp.kv").read_bytes() == b"state"
    assert not (tmp_path / "Qwen").exists()
    # Done once: a later start finds the new folder and moves nothing.
    old.mkdir(parents=True)
    (old / "other.kv").write_bytes(b"x")
    assert kv_dir(tmp_path, "Qwen/Qwen3-8B") == folder and not (folder / "other.kv").exists()
