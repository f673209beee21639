"""Real agent clients through the bridge: Codex CLI, pi and the Vercel AI
SDK talk Responses to lmspd, lmspd talks Chat Completions to the scripted
provider, and the provider decides the tool calls.

Each test checks the whole loop: the client ran the tool, its output went
back through lmspd to the provider (the provider's answer quotes it only if
it arrived), and the client showed that answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from support import npm
from support.provider import Recorded, Reply, ScriptedProvider, text_stream, tool_stream
from support.server import ServerProcess

MARK = "hello-from-provider"
PATCH = f"*** Begin Patch\n*** Add File: hello.txt\n+hi {MARK}\n*** End Patch\n"
CLIENT_KEY = "LMSPD_CLIENT_KEY"


def agent_responder(request: Recorded) -> Reply:
    """What a model would do: call the shell-like tool the client offers,
    then answer from its output."""
    body = request.body
    tools = {t["function"]["name"] for t in body.get("tools", [])}
    last = body["messages"][-1]
    if last["role"] == "tool":
        content = str(last.get("content"))
        answer = f"The tool printed {MARK}." if MARK in content else f"The tool said: {content[:80]}"
        return Reply(parts=text_stream(answer))
    call_id = f"call_{uuid.uuid4().hex[:12]}"
    if "apply_patch" in tools and "apply_patch" in str(last.get("content")):
        return Reply(parts=tool_stream("apply_patch", {"input": PATCH}, call_id=call_id))
    for name, args in (("exec_command", {"cmd": f"echo {MARK}"}), ("bash", {"command": f"echo {MARK}"}),
                       ("get_weather", {"city": "Paris"})):
        if name in tools:
            return Reply(parts=tool_stream(name, args, call_id=call_id))
    return Reply(parts=text_stream("Hello."))


@pytest.fixture(scope="module")
def npm_prefix():
    try:
        return npm.install()
    except npm.NpmMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def provider():
    p = ScriptedProvider().start()
    p.responder = agent_responder
    yield p
    p.stop()


@pytest.fixture(scope="module")
def lmspd(provider, tmp_path_factory):
    # Two served ids on one provider: Codex offers apply_patch only to models
    # it knows (gpt-5.5), and falls back to generic metadata for the other.
    config = tmp_path_factory.mktemp("cfg") / "models.json"
    upstream = {"engine": "upstream", "url": provider.url, "upstream_model": "scripted"}
    config.write_text(json.dumps({"models": {"capture-model": upstream, "gpt-5.5": upstream}}))
    srv = ServerProcess("--config", str(config)).start(timeout=60)
    yield srv
    srv.stop()


@pytest.fixture
def work(tmp_path, provider):
    provider.requests.clear()
    path = tmp_path / "work"
    path.mkdir()
    return path


def jsonl(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def tool_results(provider: ScriptedProvider) -> list[str]:
    return [str(m.get("content")) for r in provider.requests if r.path.endswith("/chat/completions")
            for m in r.body["messages"] if m["role"] == "tool"]


# -- Codex CLI ------------------------------------------------------------------------


def run_codex(npm_prefix: Path, lmspd: ServerProcess, work: Path, prompt: str, model: str) -> list[dict]:
    home = work.parent / "codex_home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(f"""
model = "{model}"
model_provider = "lmspd"
approval_policy = "never"
sandbox_mode = "danger-full-access"

[model_providers.lmspd]
name = "lmspd"
base_url = "{lmspd.url}/v1"
env_key = "{CLIENT_KEY}"
wire_api = "responses"
""")
    cmd = [str(npm.codex(npm_prefix)), "exec", "--skip-git-repo-check", "--json", "--ephemeral",
           "-c", "model_providers.lmspd.stream_max_retries=0", "-c", "model_providers.lmspd.request_max_retries=0",
           "-c", "model_providers.lmspd.stream_idle_timeout_ms=15000", "-m", model, prompt]
    env = {**os.environ, "CODEX_HOME": str(home), CLIENT_KEY: "unused-locally"}
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)
    events = jsonl(done.stdout)
    assert done.returncode == 0, f"codex exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert any(e.get("type") == "turn.completed" for e in events), done.stdout[-2000:]
    return events


def agent_messages(events: list[dict]) -> list[str]:
    return [e["item"]["text"] for e in events
            if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]


def test_codex_runs_its_shell_tool_then_answers(npm_prefix, lmspd, provider, work):
    events = run_codex(npm_prefix, lmspd, work, f"Run 'echo {MARK}' in the shell and tell me what it printed.",
                       "capture-model")
    commands = [e["item"] for e in events if e.get("type") == "item.completed"
                and e["item"].get("type") == "command_execution"]
    assert commands and commands[0]["exit_code"] == 0 and MARK in commands[0]["aggregated_output"]
    assert agent_messages(events) == [f"The tool printed {MARK}."]
    assert any(MARK in r for r in tool_results(provider))
    # Codex's namespace tool reached the provider as plain functions.
    names = {t["function"]["name"] for t in provider.requests[0].body["tools"]}
    assert "exec_command" in names and any(n.startswith("multi_agent_v1__") for n in names)


def test_codex_applies_a_patch_through_the_custom_tool(npm_prefix, lmspd, provider, work):
    events = run_codex(npm_prefix, lmspd, work, "Create hello.txt using apply_patch.", "gpt-5.5")
    assert (work / "hello.txt").read_text() == f"hi {MARK}\n"
    changes = [e["item"] for e in events if e.get("type") == "item.completed"
               and e["item"].get("type") == "file_change"]
    assert changes and changes[0]["status"] == "completed"
    first, second = provider.requests[0].body, provider.requests[-1].body
    (wrapper,) = [t["function"] for t in first["tools"] if t["function"]["name"] == "apply_patch"]
    assert wrapper["parameters"]["required"] == ["input"] and wrapper["strict"] is True
    call = next(m for m in second["messages"] if m.get("tool_calls"))["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"input": PATCH}
    assert agent_messages(events)


# -- pi -----------------------------------------------------------------------------------


def test_pi_completes_a_bash_tool_loop(npm_prefix, lmspd, provider, work):
    home = work.parent / "pi_home"
    home.mkdir()
    (home / "models.json").write_text(json.dumps({"providers": {"lmspd": {
        "baseUrl": f"{lmspd.url}/v1", "api": "openai-responses", "apiKey": CLIENT_KEY,
        "models": [{"id": "capture-model", "name": "lmspd", "reasoning": False, "input": ["text"],
                    "contextWindow": 128000, "maxTokens": 4096}]}}}))
    cmd = ["node", str(npm.pi_cli(npm_prefix)), "--no-session", "--provider", "lmspd", "--model", "capture-model",
           "--mode", "json", "-p", f"Run 'echo {MARK}' in bash and tell me the output"]
    env = {**os.environ, "PI_CODING_AGENT_DIR": str(home), CLIENT_KEY: "unused-locally"}
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-2000:]
    events = jsonl(done.stdout)
    tools = [e for e in events if e.get("type") == "tool_execution_end"]
    assert tools and not tools[0].get("isError"), done.stdout[-2000:]
    finals = [c.get("text") for e in events if e.get("type") == "message_end"
              and e["message"].get("role") == "assistant" for c in e["message"]["content"] if c.get("type") == "text"]
    assert finals[-1] == f"The tool printed {MARK}."
    assert any(MARK in r for r in tool_results(provider))


# -- Vercel AI SDK -------------------------------------------------------------------------


def test_vercel_ai_sdk_completes_a_tool_loop_json_and_stream(npm_prefix, lmspd, provider, work):
    driver = Path(__file__).parent.parent / "support" / "js" / "vercel_tool_loop.mjs"
    done = subprocess.run(["node", str(driver), str(npm_prefix), f"{lmspd.url}/v1", "capture-model"],
                          cwd=work, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for mode in ("generateText", "streamText"):
        run = result[mode]
        assert "error" not in run and not run.get("errors"), (mode, run)
        assert run["calls"] == ["Paris"], (mode, run)
        # The provider's answer quotes the tool output it received.
        assert run["text"].startswith("The tool said:") and "Sunny in Paris, 21C" in run["text"], (mode, run)
        assert run["finishReason"] == "stop", (mode, run)
    assert any("Sunny in Paris" in r for r in tool_results(provider))
