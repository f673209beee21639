"""``lmspd render``: the prompt printed for a request body is the one the
engine prepares for it (text and tokens), in every dialect, for both bundled
models (their templates and tool syntaxes differ); what the routes refuse,
it refuses with the route's own error; what only a server holds (stored
history) is refused with a way forward."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Callable

import pytest

from lmspd.cli import main
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.dialects import anthropic_messages, chat_completions, lmsp, openai_responses
from lmspd.engines.llama.fit import AUTO_MIN_WINDOW
from support.llama_engine import bundled_engine

PARAMETERS = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
SOURCE = "def add(a, b):\n    return a + b\n"

BODIES: dict[str, tuple[dict[str, Any], Callable[..., Any]]] = {
    "responses": ({
        "model": "m", "instructions": "You edit files.",
        "tools": [{"type": "function", "name": "read_file", "description": "Read a file.", "parameters": PARAMETERS}],
        "tool_choice": "none",
        "input": [
            {"role": "user", "content": "Open add.py."},
            {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": '{"path": "add.py"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": SOURCE},
            {"role": "user", "content": "Write it out again."},
        ],
    }, openai_responses.decode_request),
    "lmsp": ({
        "model": "m", "max_output_tokens": 32,
        "tools": [{"type": "function", "name": "read_file", "parameters": PARAMETERS}],
        "tool_choice": "required",
        "input": [{"role": "user", "content": "Open add.py."}],
    }, lmsp.decode_request),
    "chat": ({
        "model": "m",
        "tools": [{"type": "function", "function": {"name": "read_file", "parameters": PARAMETERS}}],
        "messages": [
            {"role": "system", "content": "You edit files."},
            {"role": "user", "content": "Open add.py."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "read_file",
                                                                  "arguments": '{"path": "add.py"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": SOURCE},
        ],
    }, chat_completions.decode_request),
    "messages": ({
        "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "You edit files."}],
        "tools": [{"name": "read_file", "description": "Read a file.", "input_schema": PARAMETERS}],
        "messages": [
            {"role": "user", "content": "Open add.py."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                               "input": {"path": "add.py"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": SOURCE}]},
        ],
    }, anthropic_messages.decode_request),
}


def render(capsys: pytest.CaptureFixture[str], tmp_path: Path, body: dict[str, Any] | bytes,
           *args: str) -> tuple[int, str, str]:
    path = tmp_path / "body.json"
    path.write_bytes(body if isinstance(body, bytes) else json.dumps(body).encode())
    code = main(["render", str(path), *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("model,origin", [("smollm2-135m-instruct", "gguf"),
                                          ("gemma3-270m", "fallback")])  # its GGUF has no template: lmspd's
def test_the_prompt_is_the_one_the_engine_prepares(model: str, origin: str, capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    with bundled_engine(n_ctx=2048, model=model, grammars_at_start=False) as engine:
        for dialect, (body, decode) in BODIES.items():
            code, out, err = render(capsys, tmp_path, body, "--model", model, "--dialect", dialect, "--json")
            assert code == 0, err
            shown = json.loads(out)
            prepared = engine.prepare(decode(body, DEFAULT_LIMITS.request).conversation)
            assert shown["tokens"] == prepared.tokens, dialect
            assert shown["text"] == prepared.text and shown["input_tokens"] == len(prepared.tokens)
            assert shown["grammar"] == (prepared.grammar is not None), dialect
            assert shown["model"] == model and shown["template"] == origin and shown["dialect"] == dialect
    # The tool list (tool_choice "none" still lists it: its description is
    # nowhere else) and the tool's output are in the prompt.
    text = json.loads(render(capsys, tmp_path, BODIES["responses"][0], "--json")[1])["text"]
    assert "Read a file." in text and SOURCE in text


def test_plain_output_is_the_prompt_itself_and_a_summary_apart(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    code, out, err = render(capsys, tmp_path, {"model": "m", "instructions": "Be brief.", "input": "Hi."})
    assert code == 0
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\n"
    # The window of a server's --ctx auto (before its fitting to memory): SmolLM2 was trained on 8192.
    assert "smollm2-135m-instruct:" in err and f"tokens of a {AUTO_MIN_WINDOW}-token window" in err


def test_a_body_from_stdin(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    stdin = io.TextIOWrapper(io.BytesIO(json.dumps({"model": "m", "input": "Hi."}).encode()))
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["render", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"].endswith("Hi.<|im_end|>\n<|im_start|>assistant\n")


def test_a_chat_template_file_replaces_the_ggufs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] ")
    code, out, _ = render(capsys, tmp_path, {"model": "m", "input": "Hi."}, "--chat-template", str(template),
                          "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["text"] == "[user] Hi.\n[assistant] " and shown["template"] == "--chat-template"


def test_a_prompt_over_the_window_is_the_routes_refusal(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = render(capsys, tmp_path, {"model": "m", "input": "word " * 400}, "--ctx", "64")
    assert code == 2 and "POST /v1/responses would refuse it (context_length_exceeded)" in err


@pytest.mark.parametrize("body,args,message", [
    (b'{"model": "m", "input":', (), "POST /v1/responses would refuse it (invalid_json): The body is not valid JSON"),
    (b'{"model": "m", "input": "a", "input": "b"}', (), "invalid_json"),
    (b'[1]', (), "The JSON body must be an object."),
    (b'{"model": "m", "messages": []}', ("--dialect", "messages"), "POST /v1/messages would refuse it ("),
    (b'{"model": "m", "input": "x", "previous_response_id": "resp_1"}', (),
     "Previous response 'resp_1' not found. Stored history lives in a running server"),
    (b'{"model": "m", "input": "x", "conversation": "conv_1"}', (),
     "Conversation 'conv_1' not found. Stored history lives in a running server"),
    (b'{"model": "m", "input": "x"}', ("--model", "no-such-model"), "unknown model 'no-such-model'"),
    (b'{"model": "m", "input": "x"}', ("--ctx", "-1"), "--ctx must be between 0"),
    (b'{"model": "m", "input": "x"}', ("--chat-template", "/no/such/template"),
     "cannot read chat template /no/such/template: No such file"),
])
def test_refusals_say_why(body: bytes, args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str],
                          tmp_path: Path) -> None:
    code, out, err = render(capsys, tmp_path, body, *args)
    assert code == 2 and out == ""
    assert err.startswith("lmspd render: ") and message in err


def test_a_body_over_the_routes_limit_is_refused_unread(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    limit = DEFAULT_LIMITS.request.max_body_bytes
    body = b'{"model": "m", "input": "' + b"x" * limit + b'"}'
    code, _, err = render(capsys, tmp_path, body)
    assert code == 2 and f"the body is over {limit} bytes" in err


def test_a_window_is_padded_as_llama_cpp_pads_a_servers(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = render(capsys, tmp_path, {"model": "m", "input": "Hi."}, "--ctx", "1000", "--json")
    assert code == 0 and json.loads(out)["window"] == 1024


@pytest.mark.parametrize(("ctx", "window"), [((), AUTO_MIN_WINDOW), (("--ctx", "auto"), AUTO_MIN_WINDOW),
                                           (("--ctx", "0"), 8192)])
def test_the_default_window_is_a_servers_ctx_auto(ctx: tuple[str, ...], window: int,
                                                  capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # --ctx auto: the trained length (8192 for SmolLM2), or AUTO_MIN_WINDOW where that is longer; 0: the trained.
    code, out, _ = render(capsys, tmp_path, {"model": "m", "input": "Hi."}, *ctx, "--json")
    assert code == 0 and json.loads(out)["window"] == window


def test_the_default_window_rule_is_the_servers() -> None:
    """One rule for both (fit.asked_window): what render sizes by is what fit starts from."""
    from lmspd.engines.llama.fit import asked_window

    assert asked_window(None, 8192) == AUTO_MIN_WINDOW and asked_window(None, 131072) == 131072
    assert asked_window(None, 0) == AUTO_MIN_WINDOW and asked_window(0, 0) == AUTO_MIN_WINDOW
    assert asked_window(0, 40000) == 40192 and asked_window(1000, 8192) == 1024


def test_the_cache_repairs_are_serves_and_its_flags_turn_them_off(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path) -> None:
    tools = [{"type": "function", "name": name, "description": f"Tool {name}.", "parameters": PARAMETERS}
             for name in ("zeta", "alpha")]
    body = {"model": "m", "tools": tools, "instructions": "x-anthropic-billing-header: cc_version=1; cch=abc;\nBe brief.",
            "input": "Hi."}

    def text(*flags: str) -> str:
        code, out, err = render(capsys, tmp_path, body, "--json", *flags)
        assert code == 0, err
        return json.loads(out)["text"]

    repaired = text()
    assert repaired.index("## alpha") < repaired.index("## zeta") and "billing-header" not in repaired
    kept = text("--keep-billing-header", "--keep-tool-order")
    assert kept.index("## zeta") < kept.index("## alpha") and "x-anthropic-billing-header" in kept


@pytest.mark.parametrize("template,message", [
    (b"\xff\xfe{{ messages }}", "is not UTF-8 text"),
    (b"{% for m in messages %}{{ m.content }}", "does not compile"),
])
def test_a_template_file_that_cannot_be_used_is_refused(template: bytes, message: str,
                                                         capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_bytes(template)
    code, out, err = render(capsys, tmp_path, {"model": "m", "input": "Hi."}, "--chat-template", str(path))
    assert code == 2 and out == "" and err.startswith("lmspd render: ") and message in err


def test_a_file_llama_cpp_cannot_load_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = tmp_path / "broken.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 64)
    code, _, err = render(capsys, tmp_path, {"model": "m", "input": "Hi."}, "--model", str(model))
    assert code == 2 and err.startswith(f"lmspd render: {model}: ")


def test_a_model_llama_cpp_refuses_is_refused_in_its_words(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """As the server's load says: llama-cpp-python's own message is only
    "Failed to load model from file" (render loaded it with llama.cpp's
    output pointed at /dev/null, the reason with it)."""
    from support.gguf_writer import gguf_bytes, model_metadata

    model = tmp_path / "frob.gguf"
    model.write_bytes(gguf_bytes(model_metadata(arch="frobnicator")))
    code, _, err = render(capsys, tmp_path, {"model": "m", "input": "Hi."}, "--model", str(model))
    assert code == 2 and "unknown model architecture: 'frobnicator'" in err, err
