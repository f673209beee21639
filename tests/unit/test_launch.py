"""``lmspd launch``: what it writes for each client (golden files under
tests/fixtures/launch/), that a second launch changes nothing, and that the
user's own configuration is never touched. The server is a stub answering
``GET /lmsp/v1/models`` with the body a real ``lmspd serve`` (the bundled
model, default flags, plus a thinking-template model) answered; the real
server and the real Codex CLI are in tests/e2e/test_launch_codex.py."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from lmspd.cli import main
from lmspd.launch.served import ServerRefused, parse_models

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "launch"
MODELS = (FIXTURES / "lmsp_models.json").read_bytes()
CLIENTS = ("codex", "claude", "pi", "opencode")


@pytest.fixture(scope="module")
def stub_url():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = MODELS if self.path == "/lmsp/v1/models" else b"{}"
            self.send_response(200 if self.path == "/lmsp/v1/models" else 404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def launch(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["launch", *args])
    out, err = capsys.readouterr()
    return code, out, err


def normalized(text: str, data_dir: Path, url: str) -> str:
    return text.replace(str(data_dir), "<DATA_DIR>").replace(url, "http://127.0.0.1:8080")


@pytest.mark.parametrize("client", CLIENTS)
def test_print_matches_golden(client, stub_url, tmp_path, capsys):
    code, out, _ = launch(capsys, client, "--print", "--url", stub_url, "--data-dir", str(tmp_path), "--", "--help")
    assert code == 0
    golden = FIXTURES / f"{client}.txt"
    if os.environ.get("LMSPD_UPDATE_GOLDEN"):
        golden.write_text(normalized(out, tmp_path, stub_url))
        pytest.fail(f"{golden} rewritten: review it, then run without LMSPD_UPDATE_GOLDEN")
    assert normalized(out, tmp_path, stub_url) == golden.read_text()
    assert not (tmp_path / "launch").exists(), "--print wrote files"


@pytest.mark.parametrize("client", CLIENTS)
def test_second_launch_is_a_no_op_and_the_users_config_is_untouched(client, stub_url, tmp_path, capsys, monkeypatch):
    home = tmp_path / "home"
    own = {home / ".codex" / "config.toml": 'model = "gpt-5.5"\n[model_providers.mine]\nbase_url = "https://x"\n',
           home / ".claude" / "settings.json": '{"env": {"ANTHROPIC_MODEL": "claude-sonnet"}}\n',
           home / ".pi" / "agent" / "models.json": '{"providers": {}}\n',
           home / ".config" / "opencode" / "opencode.json": '{"model": "anthropic/claude"}\n'}
    for path, text in own.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode())
    monkeypatch.setenv("HOME", str(home))
    data = tmp_path / "data"
    args = (client, "--url", stub_url, "--data-dir", str(data), "--bin", "true")

    code, _, first = launch(capsys, *args)
    assert code == 0, first
    written = sorted((data / "launch" / client).iterdir())
    assert written and all(f"created: {p}" in first for p in written), first
    stamps = {p: p.stat().st_mtime_ns for p in written}

    code, _, second = launch(capsys, *args)
    assert code == 0, second
    assert not re.search(r"^(created|changed):", second, re.M), second
    assert all(f"unchanged: {p}" in second for p in written), second
    assert {p: p.stat().st_mtime_ns for p in written} == stamps
    for path, text in own.items():
        assert path.read_bytes() == text.encode(), path


def test_a_changed_window_is_shown_as_a_diff(stub_url, tmp_path, capsys):
    data = tmp_path / "data"
    assert launch(capsys, "codex", "--url", stub_url, "--data-dir", str(data), "--bin", "true")[0] == 0
    catalog = data / "launch" / "codex" / "models.json"
    catalog.write_text(catalog.read_text().replace('"context_window": 32768', '"context_window": 131072'))
    code, _, err = launch(capsys, "codex", "--url", stub_url, "--data-dir", str(data), "--bin", "true")
    assert code == 0
    assert f"changed: {catalog}" in err
    assert '-      "context_window": 131072,' in err and '+      "context_window": 32768,' in err
    assert json.loads(catalog.read_text())["models"][0]["context_window"] == 32768


@pytest.mark.parametrize(("client", "setting", "models"), [
    ("claude", '"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "300"', 1),  # the main model's
    ("pi", '"maxTokens": 300', 2),  # each served model's
    ("opencode", '"output": 300', 2),
])
def test_max_output_tokens_reaches_the_clients_config(client, setting, models, stub_url, tmp_path, capsys):
    code, out, _ = launch(capsys, client, "--print", "--url", stub_url, "--data-dir", str(tmp_path),
                          "--max-output-tokens", "300")
    assert code == 0
    assert out.count(setting) == models, out


def test_max_output_tokens_must_be_positive(stub_url, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["launch", "claude", "--print", "--url", stub_url, "--max-output-tokens", "0"])
    assert "must be at least 1" in capsys.readouterr().err


def test_a_model_that_is_not_served_is_refused(stub_url, tmp_path, capsys):
    code, _, err = launch(capsys, "claude", "--print", "--url", stub_url, "--data-dir", str(tmp_path),
                          "--model", "llama-70b")
    assert code == 2
    assert "--model llama-70b: not served (served: smollm2-135m-instruct" in err


def test_print_without_a_server_starts_none(tmp_path, capsys):
    code, out, err = launch(capsys, "codex", "--print", "--url", "http://127.0.0.1:9", "--data-dir", str(tmp_path))
    assert code == 2 and out == ""
    assert "no server answers at http://127.0.0.1:9" in err


_json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=3), max_leaves=8)
_rows = st.fixed_dictionaries({}, optional={"id": _json_values | st.text(max_size=8),
                                            "context_window": _json_values | st.integers(-2, 10**6),
                                            "capabilities": _json_values | st.fixed_dictionaries(
                                                {}, optional={"reasoning": _json_values, "tools": _json_values})})
# Bodies shaped like a model list (a ``data`` list of rows whose fields may
# be anything), and bytes that are not JSON at all.
_bodies = (st.builds(lambda data: json.dumps({"data": data}).encode(), st.lists(_rows, max_size=3) | _json_values)
           | st.binary(max_size=512))


@given(_bodies)
@example(b'{"data": [{"id": "m", "context_window": true}]}')  # JSON's true is no window
def test_parse_models_refuses_anything_but_a_model_list(body):
    try:
        models = parse_models(body)
    except ServerRefused:
        return
    assert models and all(type(m.id) is str and m.id and type(m.context_window) is int  # not a bool
                          and m.context_window > 0 for m in models)


def test_parse_models_reads_a_model_list():
    body = json.dumps({"object": "list", "data": [
        {"id": "a", "context_window": 4096, "capabilities": {"reasoning": True, "tools": False}},
        {"id": "b", "context_window": 8192}]}).encode()
    [a, b] = parse_models(body)
    assert (a.id, a.context_window, a.reasoning, a.tools) == ("a", 4096, True, False)
    assert (b.id, b.context_window, b.reasoning, b.tools) == ("b", 8192, False, True)


@pytest.mark.parametrize("flags,url", [(("--no-start",), "http://127.0.0.1:9"), ((), "http://192.0.2.1:9")])
def test_no_server_is_started_when_refused_or_not_on_loopback(flags, url, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("lmspd.launch.command._start_server", lambda *a: pytest.fail("started a server"))
    monkeypatch.setattr("lmspd.launch.served.read_served.__kwdefaults__", {"timeout": 0.5})
    code, _, err = launch(capsys, "codex", "--url", url, "--data-dir", str(tmp_path), "--bin", "true", *flags)
    assert code == 2 and "start one with `lmspd serve`" in err, err


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/"])
def test_the_openai_base_url_names_the_server_too(suffix, stub_url, tmp_path, capsys, monkeypatch):
    """``--url http://HOST:PORT/v1`` (the base URL clients are given) was
    joined before /lmsp/v1/models: HTTP 404."""
    code, out, err = launch(capsys, "pi", "--print", "--url", stub_url + suffix, "--data-dir", str(tmp_path))
    assert code == 0, err
    assert f'"baseUrl": "{stub_url}/v1"' in out, out
    monkeypatch.setenv("LMSPD_URL", stub_url + suffix)
    code, again, err = launch(capsys, "pi", "--print", "--data-dir", str(tmp_path))
    assert (code, again) == (0, out), err


@pytest.mark.parametrize("url", ["http://127.0.0.1:8080/api", "http://127.0.0.1:8080/v1/models",
                                 "http://127.0.0.1:8080/?x=1", "127.0.0.1:8080", "ftp://127.0.0.1:8080"])
def test_a_url_with_another_path_is_refused_before_anything(url, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("lmspd.launch.command._start_server", lambda *a: pytest.fail("started a server"))
    monkeypatch.setattr("lmspd.launch.command.read_served", lambda *a, **k: pytest.fail("asked a server"))
    code, _, err = launch(capsys, "codex", "--url", url, "--data-dir", str(tmp_path), "--bin", "true")
    assert code == 2
    assert err.startswith(f"lmspd launch: --url (or LMSPD_URL) {url!r}: ") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("extra", [("--print",), ("--bin", "true")])
def test_a_data_dir_that_is_a_file_is_one_line(extra, stub_url, tmp_path, capsys):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    code, out, err = launch(capsys, "pi", "--url", stub_url, "--data-dir", str(not_a_dir), *extra)
    assert code == 2 and out == ""
    assert err.strip().endswith("Not a directory") and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith(f"lmspd launch: {not_a_dir}/launch"), err


def test_the_data_dir_a_launch_creates_is_its_owners_alone(stub_url, tmp_path, capsys):
    """As the server creates it (0700): the launch may be first to."""
    previous = os.umask(0o022)
    try:
        data = tmp_path / "fresh"
        assert launch(capsys, "pi", "--url", stub_url, "--data-dir", str(data), "--bin", "true")[0] == 0
    finally:
        os.umask(previous)
    for directory in (data, data / "launch", data / "launch" / "pi"):
        assert directory.stat().st_mode & 0o777 == 0o700, directory


class Stopped:
    def __init__(self):
        self.stopped = False

    def terminate(self):
        self.stopped = True

    def wait(self, timeout=None):
        return -15

    def poll(self):
        return None


def test_ctrl_c_while_the_started_server_loads_stops_it_quietly(tmp_path, capsys, monkeypatch):
    server = Stopped()
    monkeypatch.setattr("lmspd.launch.command._start_server", lambda *a: server)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr("lmspd.launch.command._wait_ready", interrupted)
    monkeypatch.setattr("lmspd.launch.served.read_served.__kwdefaults__", {"timeout": 0.5})
    try:
        code, _, err = launch(capsys, "codex", "--url", "http://127.0.0.1:9", "--data-dir", str(tmp_path))
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt reached the user (a traceback)")
    assert code == 130 and server.stopped
    assert err.strip().endswith("lmspd launch: interrupted: stopping the server it started"), err


def _reporter(tmp_path: Path, name: str, code: str) -> tuple[Path, Path]:
    """An executable Python script that writes what ``code`` evaluates to."""
    out = tmp_path / f"{name}.out"
    script = tmp_path / name
    script.write_text(f"#!{sys.executable}\nimport os, signal\nopen({str(out)!r}, 'w').write(str({code}))\n")
    script.chmod(0o755)
    return script, out


def test_the_client_starts_with_ctrl_c_its_own(stub_url, tmp_path, capsys):
    """The launch lets Ctrl-C pass to the client while it runs. It did so by
    ignoring SIGINT, which the client inherited across exec: the client, and
    every command it ran for the user, started deaf to Ctrl-C."""
    client, out = _reporter(tmp_path, "client", "signal.getsignal(signal.SIGINT)")
    code, _, _ = launch(capsys, "pi", "--url", stub_url, "--data-dir", str(tmp_path / "data"), "--bin", str(client))
    assert code == 0
    # Python installs its KeyboardInterrupt handler only where SIGINT was not inherited ignored.
    assert "default_int_handler" in out.read_text()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the launch's own, put back


def test_the_started_server_has_a_session_of_its_own(tmp_path, monkeypatch):
    """The terminal's Ctrl-C goes to its foreground process group: in the
    launch's group the server stopped mid-request under a client that lets
    the terminal send it (``codex exec``, ``claude -p``)."""
    import lmspd.launch.command as command

    python, out = _reporter(tmp_path, "python", "os.getsid(0) == os.getpid()")
    monkeypatch.setattr(command.sys, "executable", str(python))
    proc = command._start_server("http://127.0.0.1:9", tmp_path / "data")
    assert proc.wait(timeout=30) == 0
    assert out.read_text() == "True"
