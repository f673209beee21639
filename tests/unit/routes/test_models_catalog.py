"""``GET /v1/models``'s ``models``: the catalog Codex reads (its
``ModelInfo``, codex-rs/protocol/src/openai_models.rs). Codex parses the
whole list or nothing: an entry that lacks a field it requires loses every
entry."""

from __future__ import annotations

from pathlib import Path

from lmspd.launch.clients import CODEX_INSTRUCTIONS, codex_catalog_entry
from lmspd.launch.served import ServedModel
from support.inprocess import MODEL, serving

# ModelInfo's fields that have no serde default and are not an Option.
CODEX_REQUIRED = {"slug", "display_name", "supported_reasoning_levels", "shell_type", "visibility",
                  "supported_in_api", "priority", "base_instructions", "supports_reasoning_summaries",
                  "support_verbosity", "truncation_policy", "supports_parallel_tool_calls",
                  "experimental_supported_tools"}


def test_the_catalog_carries_every_field_codex_requires(tmp_path: Path) -> None:
    with serving(tmp_path) as app:
        reply = app.http.get("/v1/models")
    assert reply.status_code == 200, reply.text
    (entry,) = reply.json()["models"]
    assert entry["slug"] == MODEL
    assert CODEX_REQUIRED <= entry.keys(), CODEX_REQUIRED - entry.keys()
    # As ``lmspd launch codex`` writes them: the same instructions, and no
    # required field that its catalog file has and this one lacks.
    launched = codex_catalog_entry(ServedModel(id=MODEL, context_window=entry["context_window"], reasoning=False, tools=True), 0)
    assert CODEX_REQUIRED <= launched.keys()
    assert entry["base_instructions"] == launched["base_instructions"] == CODEX_INSTRUCTIONS
