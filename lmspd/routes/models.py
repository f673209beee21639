"""``GET /v1/models``: the served models, then the GGUF models found on this
machine (lmspd.engines.llama.discovery) that are not served; and
``models``, the served ones as the catalog Codex reads; ``GET
/lmsp/v1/models``, the served ones with their LMSP capabilities.

A found model is listed with ``"served": false``, to an ``admin`` key only
(open mode's local caller is one): ``lmspd serve --model NAME`` serves it.
Found models never show a filesystem path over HTTP.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from lmspd.dialects import lmsp
from lmspd.http import app_state, json_reply, principal
from lmspd.launch.clients import CODEX_INSTRUCTIONS


def _found(settings: Any) -> list[dict[str, Any]]:
    from lmspd.engines.llama.discovery import Roots, discover

    return [m.public() for m in discover(Roots.default(settings.models_dir)) if m.error is None]


async def openai_models(request: Request) -> Response:
    who = principal(request, "responses:read")
    app = app_state(request)
    data: list[dict[str, Any]] = []
    served_models = list(app.service.models.values())
    for m in served_models:
        info = m.engine.info
        data.append({"id": info.id, "object": "model", "created": info.created, "owned_by": info.owned_by,
                     "served": True, "context_window": info.context_window, **model_status(m.engine),
                     "sampling": info.sampling.as_json()})
    served = {d["id"].lower() for d in data}
    # Found models are the operator's (private repository names): admin
    # only. Directory walks and header reads: off the event loop.
    for found in await asyncio.to_thread(_found, app.settings) if who.allows("admin") else ():
        if found["name"].lower() in served:
            continue
        data.append({"id": found["name"], "object": "model", "created": 0, "owned_by": found["source"],
                     "served": False, "context_window": found["context_length"], "gguf": found})
    # Codex reads a model catalog from the same endpoint (``models``): without
    # the true context window it would overfill the prompt (or compact too
    # late). Only served models: Codex may pick any entry.
    return json_reply({"object": "list", "data": data,
                       "models": [codex_model_entry(m.engine.info) for m in served_models]})


def model_status(engine: Any) -> dict[str, Any]:
    """``status``: loaded, or (a model that loads on first use) unloaded,
    loading, unloading or failed; a failed model's load error and when a
    request tries it again beside it (what such a request would be told)."""
    status = getattr(engine, "status", "loaded")
    if status != "failed":
        return {"status": status}
    stats = engine.stats()
    return {"status": status, "error": stats.get("error"), "retry_in_s": stats.get("retry_in_s")}


def codex_model_entry(info: Any) -> dict[str, Any]:
    """One entry of Codex's ``models`` catalog (its ``ModelInfo``), truthful
    where lmspd knows the answer."""
    return {
        "slug": info.id,
        "display_name": info.id,
        "description": f"Served by lmspd ({info.owned_by}).",
        "context_window": info.context_window,
        "max_context_window": info.context_window,
        "supported_reasoning_levels": [],
        "default_reasoning_level": None,
        "shell_type": "default",
        "visibility": "list",
        "supported_in_api": True,
        "priority": 0,
        "upgrade": None,
        # Codex's ModelInfo requires it (a String without a default: a catalog
        # with an entry lacking it fails to parse whole). What Codex would
        # use otherwise, its own prompt.md, is inside its binary: the short
        # instructions ``lmspd launch codex`` writes into its catalog file.
        "base_instructions": CODEX_INSTRUCTIONS,
        "supports_reasoning_summaries": bool(info.capabilities.get("reasoning")),
        "support_verbosity": False,
        "default_verbosity": None,
        "apply_patch_tool_type": None,
        "truncation_policy": {"mode": "tokens", "limit": max(1, info.context_window // 4)},
        "supports_parallel_tool_calls": True,
        "experimental_supported_tools": [],
        "input_modalities": ["text"],
    }


async def lmsp_models(request: Request) -> Response:
    """``GET /lmsp/v1/models``: the served models with their capabilities."""
    lmsp.check_version(request.headers.get("lmsp-version"))
    principal(request, "responses:read")
    data = []
    for m in app_state(request).service.models.values():
        info = m.engine.info
        # Stored responses, previous_response_id and tasks live in the store,
        # not in an engine: every model has them.
        caps = {"streaming": True, "conversations": True, "tasks": True, **info.capabilities}
        # What a request that sets none is sampled with (the model's own
        # settings, under the operator's).
        data.append({"id": info.id, "object": "model", "context_window": info.context_window, "capabilities": caps,
                     **model_status(m.engine), "sampling": info.sampling.as_json()})
    return json_reply({"object": "list", "data": data}, headers={"LMSP-Version": lmsp.VERSION})
