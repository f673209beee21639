"""Each client's configuration for a running lmspd: pure functions from the
served models to a ``Plan`` (the files to write, the environment and the
arguments to run the client with). Nothing here touches the disk or the
network, so ``--print`` and the golden files show exactly what a launch
writes.

Where each client is pointed, without editing the user's own files:

- **Codex** reads one ``config.toml`` with no include; its ``-c key=value``
  overrides win over it. The provider, model, window and catalog go in as
  overrides, so the user's ``~/.codex`` (login, MCP servers, sessions, trust)
  still applies; ``codex.toml`` holds the same overrides for reading. Codex
  0.171 reads a model catalog from ``model_catalog_json`` (a ``{"models":
  [ModelInfo…]}`` file, its ``StaticModelsManager``): an entry for the
  served model ends the "Model metadata … not found. Defaulting to fallback
  metadata" warning and the fallback's 272k window. An entry must carry
  ``base_instructions``; the fallback's own (Codex's ``prompt.md``) is not
  readable from outside the binary, so the entry carries lmspd's short ones
  (``CODEX_INSTRUCTIONS``): a ``model_instructions_file`` in the user's
  config still replaces them.
- **Claude Code** reads ``--settings FILE`` (its ``env`` block) on top of
  the user's settings.
- **opencode** merges ``OPENCODE_CONFIG`` over the user's global config.
- **pi** reads ``models.json`` from its agent directory only, with no
  include: the launch gives it an lmspd-owned one (``PI_CODING_AGENT_DIR``),
  so its sessions of lmspd models are kept there too.

The API key never goes into a file: each file names an environment variable
that the launch sets when it runs the client.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from lmspd.launch.served import ServedModel

KEY_ENV = "LMSPD_API_KEY"
PROVIDER = "lmspd"
CLIENTS = ("codex", "claude", "pi", "opencode")

# What lmspd's Codex catalog entries say instead of Codex's own prompt.md
# (which a catalog entry cannot name): what a coding agent in Codex's harness
# needs, short enough for a local model's window (~200 tokens, not ~4k).
CODEX_INSTRUCTIONS = """\
You are Codex, a coding agent running in the Codex CLI on the user's machine, \
served by a local model. You and the user share a workspace; work in it to reach \
the user's goal.

- Use the shell tool to inspect files and run commands; read before you edit, and \
run the project's tests after a change when there are any.
- Make the smallest change that does the job, in the style of the surrounding code.
- Do not run destructive commands (deleting files, resetting git history) unless \
the user asks for them.
- Keep messages short: say what you did and what is left. When the task is done, \
give a brief final answer.
"""


@dataclass
class Plan:
    """What a launch writes and runs: ``files`` (name in the client's
    directory → content), ``env`` (set for the client's process; the key's
    variable is named in ``key_env`` and filled in at run time) and ``args``
    (before the user's own)."""

    client: str
    program: str
    directory: Path
    files: dict[str, str]
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    key_env: str = KEY_ENV
    summary: str = ""


def output_budget(model: ServedModel) -> int:
    """The output a client should ask for: lmspd's default ceiling (8192)
    at most, and never more than a quarter of the window, so that the
    prompt keeps most of it; or what ``--max-output-tokens`` asked, within
    the window (on a slow machine an answer of 8192 tokens takes minutes)."""
    if model.max_output_tokens is not None:
        return max(1, min(model.max_output_tokens, model.context_window))
    return max(256, min(8192, model.context_window // 4))


def compact_limit(model: ServedModel) -> int:
    """Where the client should compact: room left for one answer."""
    return max(1, model.context_window - max(output_budget(model), model.context_window // 8))


def build(client: str, models: list[ServedModel], main: ServedModel, small: ServedModel, url: str,
          directory: Path) -> Plan:
    builders = {"codex": codex, "claude": claude, "pi": pi, "opencode": opencode}
    return builders[client](models, main, small, url.rstrip("/"), directory)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    raise TypeError(type(value))


def codex_overrides(main: ServedModel, url: str, catalog: Path) -> dict[str, object]:
    return {
        "model": main.id,
        "model_provider": PROVIDER,
        "model_catalog_json": str(catalog),
        "model_context_window": main.context_window,
        "model_auto_compact_token_limit": compact_limit(main),
        # No reasoning block in the template: nothing to summarize.
        **({} if main.reasoning else {"model_reasoning_summary": "none"}),
        f"model_providers.{PROVIDER}.name": "lmspd",
        f"model_providers.{PROVIDER}.base_url": url + "/v1",
        f"model_providers.{PROVIDER}.env_key": KEY_ENV,
        f"model_providers.{PROVIDER}.wire_api": "responses",
        f"model_providers.{PROVIDER}.supports_websockets": True,
    }


def codex_catalog_entry(model: ServedModel, priority: int) -> dict[str, object]:
    """One ``ModelInfo`` of Codex's catalog (codex-rs/protocol openai_models.rs),
    the fallback's values except what lmspd knows: the window, reasoning as
    the template supports it, text-only input."""
    levels = [{"effort": effort, "description": f"{effort} reasoning effort"} for effort in ("low", "medium", "high")]
    return {
        "slug": model.id,
        "display_name": model.id,
        "description": "Served by lmspd",
        "default_reasoning_level": "medium" if model.reasoning else None,
        "supported_reasoning_levels": levels if model.reasoning else [],
        "shell_type": "default",
        "visibility": "list",
        "supported_in_api": True,
        "priority": priority,
        "upgrade": None,
        "base_instructions": CODEX_INSTRUCTIONS,
        "supports_reasoning_summaries": model.reasoning,
        "default_reasoning_summary": "auto" if model.reasoning else "none",
        "support_verbosity": False,
        "default_verbosity": None,
        "apply_patch_tool_type": None,
        "web_search_tool_type": "text",
        "truncation_policy": {"mode": "bytes", "limit": 10000},
        "supports_parallel_tool_calls": False,
        "context_window": model.context_window,
        "max_context_window": model.context_window,
        "auto_compact_token_limit": compact_limit(model),
        # Codex keeps 5% of a window back by default; the compaction limit
        # already leaves room for the answer, so the window is the served one.
        "effective_context_window_percent": 100,
        "experimental_supported_tools": [],
        "input_modalities": ["text"],
    }


def codex(models: list[ServedModel], main: ServedModel, small: ServedModel, url: str, directory: Path) -> Plan:
    catalog = directory / "models.json"
    overrides = codex_overrides(main, url, catalog)
    toml = "".join(f"{key} = {_toml_value(value)}\n" for key, value in overrides.items())
    entries = [codex_catalog_entry(m, i) for i, m in enumerate([main, *[m for m in models if m != main]])]
    args = [arg for key, value in overrides.items() for arg in ("-c", f"{key}={_toml_value(value)}")]
    return Plan(
        client="codex", program="codex", directory=directory,
        files={"models.json": json.dumps({"models": entries}, indent=2) + "\n",
               "codex.toml": "# lmspd launch codex: passed to Codex as -c overrides (your config.toml is not edited)\n"
                             + toml},
        args=args,
        summary=f"Codex: provider {PROVIDER} at {url}/v1 (Responses over WebSocket), model {main.id}, "
                f"window {main.context_window}, compacts at {compact_limit(main)}")


def claude(models: list[ServedModel], main: ServedModel, small: ServedModel, url: str, directory: Path) -> Plan:
    env = {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_MODEL": main.id,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": main.id,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": main.id,
        # The small/fast model: titles, summaries, quick classifications.
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": small.id,
        "CLAUDE_CODE_SUBAGENT_MODEL": main.id,
        # Claude Code assumes 200k for a model it does not know: compact
        # within the served window instead.
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(main.context_window),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(output_budget(main)),
        # Telemetry, update checks and the like need the internet.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    settings = directory / "settings.json"
    return Plan(
        client="claude", program="claude", directory=directory,
        files={"settings.json": json.dumps({"env": env}, indent=2) + "\n"},
        args=["--settings", str(settings)], key_env="ANTHROPIC_AUTH_TOKEN",
        summary=f"Claude Code: Messages at {url}, model {main.id} (small/fast: {small.id}), "
                f"auto-compact window {main.context_window}")


def pi(models: list[ServedModel], main: ServedModel, small: ServedModel, url: str, directory: Path) -> Plan:
    entries = [{"id": m.id, "name": m.id, "reasoning": m.reasoning, "input": ["text"],
                "contextWindow": m.context_window, "maxTokens": output_budget(m)} for m in models]
    config = {"providers": {PROVIDER: {"baseUrl": url + "/v1", "api": "openai-responses", "apiKey": KEY_ENV,
                                       "models": entries}}}
    return Plan(
        client="pi", program="pi", directory=directory,
        files={"models.json": json.dumps(config, indent=2) + "\n"},
        env={"PI_CODING_AGENT_DIR": str(directory)},
        args=["--provider", PROVIDER, "--model", main.id],
        summary=f"pi: provider {PROVIDER} (openai-responses) at {url}/v1, model {main.id}, "
                f"window {main.context_window}")


def opencode(models: list[ServedModel], main: ServedModel, small: ServedModel, url: str, directory: Path) -> Plan:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {PROVIDER: {
            "npm": "@ai-sdk/openai-compatible",
            "name": "lmspd",
            "options": {"baseURL": url + "/v1", "apiKey": "{env:" + KEY_ENV + "}"},
            "models": {m.id: {"name": m.id, "reasoning": m.reasoning, "tool_call": m.tools,
                              "limit": {"context": m.context_window, "output": output_budget(m)}} for m in models},
        }},
        "model": f"{PROVIDER}/{main.id}",
        "small_model": f"{PROVIDER}/{small.id}",
    }
    path = directory / "opencode.json"
    return Plan(
        client="opencode", program="opencode", directory=directory,
        files={"opencode.json": json.dumps(config, indent=2) + "\n"},
        env={"OPENCODE_CONFIG": str(path)},
        summary=f"opencode: provider {PROVIDER} (Chat Completions) at {url}/v1, model {main.id}, "
                f"window {main.context_window}")
