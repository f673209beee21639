"""``GET /lmsp/v1/engine``: a read-only snapshot of what the engines are
doing, for the web console's engine view (scope ``admin`` when keys are set).

Per model: queue, cache tiers with their budgets, resident sequences or
sessions (when the engine's ``stats()`` lists them), the prefills under way
(tokens done of the prompt each one evaluates), and the last
generations the service observed (lmspd.metrics). Owners never appear in
the clear: each is a short tag, stable for the process, that tells two
agents apart without naming a credential.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from lmspd.dialects import lmsp
from lmspd.http import app_state, json_reply, lmsp_request

# Per-process salt: a tag cannot be matched against another server's.
_SALT = os.urandom(16)
# Resident sequences listed per model (the engine may hold more).
MAX_SESSIONS = 64
# Agents (a subagent and its parent) as tags too: the same agent has the
# same tag, so the lineage shows without the client's session ids.
_OWNER_KEYS = ("owner", "agent", "parent_agent")


def owner_tag(owner: Any) -> str:
    return hashlib.blake2b(str(owner).encode(), key=_SALT, digest_size=3).hexdigest()


def _redacted(entry: Any) -> Any:
    if not isinstance(entry, dict):
        return entry
    return {k: (owner_tag(v) if k in _OWNER_KEYS and (v is not None or k == "owner") else v)
            for k, v in entry.items()}


def without_owners(value: Any) -> Any:
    """``value`` (an engine's ``stats()``) with every owner, at any depth,
    replaced by its tag (``/health`` shows the stats whole)."""
    if isinstance(value, dict):
        return {k: (owner_tag(v) if k in _OWNER_KEYS else without_owners(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_owners(v) for v in value]
    return value


def model_view(model_id: str, served: Any, limits: Any) -> dict[str, Any]:
    stats = served.engine.stats()
    if not isinstance(stats, dict):
        stats = {}
    sessions = stats.get("sequences") or stats.get("sessions") or []
    if not isinstance(sessions, list):
        sessions = []
    prefilling = stats.get("prefilling") or []
    if not isinstance(prefilling, list):
        prefilling = []
    info = served.engine.info
    view = {
        "id": model_id,
        "engine": stats.get("engine", "llama"),
        "context_window": info.context_window,
        "queue": {"pending": served.queue.pending, "running": served.queue.running,
                  "concurrency": info.max_concurrency, "max_pending": limits.queue.max_pending},
        "generations": stats.get("generations", 0),
        "cache": stats.get("cache"),
        "sessions": [_redacted(s) for s in sessions[:MAX_SESSIONS]],
        # Prefills under way: {seq, owner tag, done, total, reused, elapsed_ms}.
        "prefilling": [_redacted(p) for p in prefilling[:MAX_SESSIONS]],
        "last": {k: stats[k] for k in ("last_cache_source", "last_cache_detail", "last_reused_tokens",
                                       "last_prefilled_tokens", "last_prefill_ms", "last_output_tokens")
                 if k in stats},
    }
    if "endpoints" in stats:
        view["endpoints"] = stats["endpoints"]
    return view


async def engine_view(request: Request) -> Response:
    lmsp_request(request, "admin")
    app = app_state(request)
    service = app.service
    models = [model_view(mid, served, service.limits) for mid, served in list(service.models.items())]
    recent = [r.as_json() for r in reversed(service.metrics.recent)]
    return json_reply({"object": "engine", "at": time.time(), "shutting_down": service.shutting_down,
                       "models": models, "recent": recent}, headers={"LMSP-Version": lmsp.VERSION})
