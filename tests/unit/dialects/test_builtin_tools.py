"""OpenAI's built-in tools. Those OpenAI runs (web search, file search, MCP,
a shell in its container...) are accepted and left out: the client never
sees their calls, and Codex sends web_search on every request. Those the
client runs itself (apply_patch, a local shell, computer use) are a 400
naming them: left out, the client would wait on calls from a model that
never had the tool."""

from __future__ import annotations

import json

import pytest

from lmspd.core.errors import ApiError
from lmspd.core.limits import DEFAULT_LIMITS
from lmspd.dialects.responses_items import additional_tools, decode_tool_choice, decode_tools
from support.clients import CLIENTS
from support.inprocess import MODEL, serving

LIMITS = DEFAULT_LIMITS.request

CLIENT_RUN = [
    {"type": "apply_patch"},
    {"type": "shell", "environment": {"type": "local"}},
    {"type": "shell", "environment": {"type": "local", "skills": [{"name": "x", "description": "y", "path": "/s"}]}},
    {"type": "shell"},
    {"type": "local_shell"},
    {"type": "computer_use_preview", "display_width": 1024, "display_height": 768, "environment": "linux"},
    {"type": "computer"},
]
HOSTED = [
    {"type": "web_search"},
    {"type": "web_search_preview"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "mcp", "server_label": "docs", "server_url": "https://example.com/mcp"},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "image_generation"},
    {"type": "shell", "environment": {"type": "container_auto"}},
    {"type": "shell", "environment": {"type": "container_reference", "container_id": "cntr_1"}},
    {"type": "programmatic_tool_calling"},
    {"type": "tool_search"},
    # Codex's own, on every request (tests/fixtures/clients/codex-cli): left out so that Codex is served.
    {"type": "tool_search", "execution": "client", "parameters": {"type": "object"}},
]


@pytest.mark.parametrize("tool", CLIENT_RUN, ids=lambda t: f"{t['type']}-{t.get('environment')}")
def test_a_tool_the_client_runs_is_refused_by_name(tool) -> None:
    with pytest.raises(ApiError) as refused:
        decode_tools([{"type": "function", "name": "f"}, tool], LIMITS)
    assert refused.value.code == "unsupported_capability" and refused.value.status == 400
    assert refused.value.param == "tools[1].type"
    assert repr(tool["type"]) in refused.value.message and "hosted" not in refused.value.message


@pytest.mark.parametrize("tool", HOSTED, ids=lambda t: f"{t['type']}-{t.get('environment') or t.get('execution')}")
def test_a_tool_openai_runs_is_left_out(tool) -> None:
    tools = decode_tools([{"type": "function", "name": "f"}, tool], LIMITS)
    assert [t.name for t in tools] == ["f"]


def test_in_an_additional_tools_item_too() -> None:
    raw = [{"type": "additional_tools", "role": "developer", "tools": [{"type": "web_search"}, {"type": "apply_patch"}]}]
    with pytest.raises(ApiError) as refused:
        decode_tools(None, LIMITS, more=additional_tools(raw))
    assert refused.value.param == "input[0].tools[1].type"


@pytest.mark.parametrize("choice, param", [
    ({"type": "apply_patch"}, "tool_choice"),
    ({"type": "computer_use_preview"}, "tool_choice"),
    ({"type": "shell"}, "tool_choice"),
    ({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "local_shell"}]}, "tool_choice.tools[0]"),
])
def test_a_tool_choice_naming_a_built_in_tool_is_refused(choice, param) -> None:
    with pytest.raises(ApiError) as refused:
        decode_tool_choice(choice, [])
    assert refused.value.code == "unsupported_capability" and refused.value.param == param
    assert "built-in tool" in refused.value.message
    if choice["type"] in ("apply_patch", "computer_use_preview"):
        assert "hosted" not in refused.value.message and "runs on the client" in refused.value.message


def test_allowed_tools_may_list_a_hosted_tool() -> None:
    from lmspd.core.conversation import FunctionTool

    choice = decode_tool_choice({"type": "allowed_tools", "mode": "auto",
                                 "tools": [{"type": "web_search"}, {"type": "function", "name": "f"}]},
                                [FunctionTool(name="f", description=None, parameters=None)])
    assert choice.allowed == ["f"]


def test_the_engine_never_sees_a_request_without_its_client_tool(tmp_path) -> None:
    with serving(tmp_path) as app:
        r = app.http.post("/v1/responses", json={"model": MODEL, "input": "edit the file",
                                                 "tools": [{"type": "apply_patch"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].type", r.text
        assert app.engine.generations == 0


REQUESTS = sorted(path for path in CLIENTS.glob("*/captured/**/*-request.json") if "responses" in path.name)


@pytest.mark.parametrize("path", REQUESTS, ids=lambda p: str(p.relative_to(CLIENTS)))
def test_every_captured_client_request_declares_tools_lmspd_serves(path) -> None:
    body = json.loads(path.read_text())["body"]
    raw_input = body.get("input") or []
    tools = decode_tools(body.get("tools"), LIMITS, more=additional_tools(raw_input))
    decode_tool_choice(body.get("tool_choice"), tools)
